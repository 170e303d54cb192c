"""
Writes ``docs/python-api.md``, the reference of the package's public Python API, from the
signatures and docstrings of the names it lists: ``tests/test_docs.py`` checks that the page is
what this script writes now, so the page cannot drift from the code.

    python scripts/api_reference.py          # rewrite docs/python-api.md
    python scripts/api_reference.py --check  # exit 1 when the page differs
"""

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "python-api.md"

#: (section, names imported from ``tango_fairscale``), in the page's order.
SECTIONS: List[Tuple[str, List[str]]] = [
    ("Building the model", ["with_wrapped_modules", "from_pretrained", "with_lora", "plan_wrapping"]),
    ("Training", ["FairScaleTrainingEngine", "FSDPConfig"]),
    ("A trained step's outputs", ["train_outputs", "TrainOutputs", "read_weights", "read_checkpoint"]),
]

HEADER = """# Python API

What a pipeline's own code imports from `tango_fairscale` (every name below is in its
`__all__`), beside the registered names configs use. Generated from the signatures and
docstrings by `python scripts/api_reference.py`; `tests/test_docs.py` fails when this page and
the code differ. `examples/python_api/train.py` (run by the tests) uses them: Tango steps built
in Python, two custom steps, the engine, then the training step's outputs found and read. Every
option of the engine and of `FSDPConfig` in words: [`configuration.md`](configuration.md).
"""


def _plain(text: str) -> str:
    """Annotations without their modules' paths (``tango.integrations.torch.model.Model`` -> ``Model``)."""
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Za-z_][A-Za-z0-9_]*)", r"\1", text)


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _entry(name: str, obj: Any) -> List[str]:
    if inspect.isclass(obj):
        target = obj.__init__ if "__init__" in vars(obj) else obj
        signature = inspect.signature(target)
        parameters = [p for p in signature.parameters.values() if p.name != "self"]
        signature = signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)
        kind = "class"
    else:
        signature, kind = inspect.signature(obj), "function"
    lines = [f"### `{name}` ({kind})", "", "```python", f"{name}{_plain(str(signature))}", "```", ""]
    summary = _summary(obj)
    if summary:
        lines += [summary, ""]
    if inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__"):
        for field in obj.__dataclass_fields__:
            doc = _field_doc(obj, field)
            lines.append(f"- `{field}`: {doc}" if doc else f"- `{field}`")
        lines.append("")
    return lines


def _field_doc(cls: Any, field: str) -> str:
    """A dataclass field's docstring (the string literal after it in the source of the class defining it)."""
    for klass in cls.__mro__:
        if field not in getattr(klass, "__annotations__", {}):
            continue
        match = re.search(rf"\n    {field}: [^\n]*\n    \"\"\"(.*?)\"\"\"", inspect.getsource(klass), re.S)
        if match:
            return " ".join(match.group(1).split())
    return ""


def render() -> str:
    import tango_fairscale

    lines = [HEADER]
    for section, names in SECTIONS:
        lines += [f"## {section}", ""]
        for name in names:
            assert name in tango_fairscale.__all__, f"{name} is not in tango_fairscale.__all__"
            lines += _entry(name, getattr(tango_fairscale, name))
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} differs from the code: run python scripts/api_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
