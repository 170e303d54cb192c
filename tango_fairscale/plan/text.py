"""How the plan writes for people, and reads them: memory sizes, and an exception on one line."""

import re

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size} B"


def parse_memory(text: str) -> int:
    """
    A memory size: ``80GiB``, ``80G`` and ``81920MiB`` are binary (2**30 and 2**20 bytes), ``80GB``
    decimal (10**9), a bare number bytes. Raises ``ValueError`` naming the forms.
    """
    match = _SIZE.match(text)
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"{text!r} is not a memory size: write e.g. 80GiB (or 80G), 80GB or 24000MiB")
    number, prefix, binary, byte = match.groups()
    power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
    base = 1000 if (byte and not binary) else 1024
    return int(float(number) * base**power)


def one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one line of about ``limit`` characters at most (Tango's lists every name)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > limit:
        line = line[:limit].rstrip() + " ..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
