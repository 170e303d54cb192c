"""
Tango's command line, with the plugin loaded by a plain ``import tango_fairscale`` instead of
``-i tango_fairscale``, the way a notebook cell or a helper function of a user's program would
load it before calling Tango.

Run it as ``python -m tests.tango_suite.plain_import run config.json ...``. The import happens
inside ``main()``, not at module level: Tango's training workers are spawned processes that
re-import this module (as ``__mp_main__``) but do not call ``main()``, so they only get the
plugin if the plugin itself sees to it.
"""


def main() -> None:
    from tango.__main__ import main as tango_main

    import tango_fairscale  # noqa: F401  (registers the engine and the model constructor)

    tango_main(prog_name="tango")


if __name__ == "__main__":
    main()
