"""What every command shares: the error a bad argument raises, and its one-line message."""


class UsageError(Exception):
    """A bad command-line argument: reported as one ``error:`` line, with exit status 2."""


def one_line(error: BaseException, lines: int = 2) -> str:
    """The first ``lines`` non-blank lines of ``error``'s message, joined with ``"; "``."""
    # Parser errors (jsonnet, YAML) span several lines, the second usually the location: keep
    # both on one line, so the command's error stays a single line.
    parts = [line.strip() for line in str(error).splitlines() if line.strip()][:lines]
    return "; ".join(parts) or type(error).__name__
