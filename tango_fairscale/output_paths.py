"""
Where the package may write an output it was asked for, and what it may replace there: the one
rule of ``export_hf`` (the engine's option and ``consolidate --format hf``) and ``consolidate``.

An output replaces only an earlier output of the same kind, recognised by what the package wrote
into it: a ``from_pretrained`` directory holds :data:`EXPORT_MARKER` and nothing but the files
that marker lists; a consolidated ``.pt`` file carries the :data:`PT_MARKER_RECORD` record in its
zip archive (``torch.load`` ignores records it does not know, so both still load as before). Any
other existing path is refused, as is every path that is or holds a Tango workspace, a step's work
directory, a checkpoint directory, a step's ``weights.pt``, metrics log or checkpoint link, or lies
inside a checkpoint directory, inside a workspace outside a step's work directory (its other
directories are Tango's), or inside any step's work directory but the running step's own (a
cached step's outputs are Tango's to keep as they are; ``consolidate`` and ``plan`` run no step).
Before this rule ``export_hf: "."`` replaced the work directory and
``consolidate WORK WORK --format hf --force`` deleted every checkpoint.

The writers' temporaries are also named here, and a rerun removes those an interrupted write left
(:func:`remove_stale_temporaries`): only entries of the writers' own name pattern, of this user,
whose writing process is gone, never anything else.
"""

import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import checkpointing
from .errors import CheckpointError
from .version import VERSION

logger = logging.getLogger(__name__)

#: The kinds of output: a ``from_pretrained`` directory, a consolidated ``.pt`` file, and the
#: JSON of ``plan --json`` (which carries the marker's fields at its top level).
HF_EXPORT = "hf_export"
CONSOLIDATED = "consolidated"
PLAN_JSON = "plan_json"
_KIND_NAMES = {
    HF_EXPORT: "a from_pretrained directory",
    CONSOLIDATED: "a consolidated .pt file",
    PLAN_JSON: "a plan --json file",
}
#: Larger than any plan JSON: a bigger file is not read to be recognised (and is not one).
_PLAN_JSON_LIMIT = 16 << 20

#: The file in each ``from_pretrained`` directory the package writes: who wrote it, and its files.
EXPORT_MARKER = "tango_fairscale_export.json"
#: The record in each consolidated ``.pt`` archive ``consolidate`` writes (``ARCHIVE/<name>``).
PT_MARKER_RECORD = "tango_fairscale.json"
_WRITTEN_BY = "tango_fairscale"

#: Files of a model's directory that go with its weights into an export: the tokenizer's (any of them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)
#: What an export writes (:mod:`tango_fairscale.finetune.hf_export`): an interrupted export's temporary
#: directory holds nothing else.
_EXPORT_FILE = re.compile(
    "|".join(
        [
            r"config\.json",
            r"generation_config\.json",
            r"model\.safetensors",
            r"model-\d{5}-of-\d{5}\.safetensors",
            r"model\.safetensors\.index\.json",
            # A peft adapter's (hf_export.export_peft_adapter).
            r"adapter_config\.json",
            r"adapter_model\.safetensors",
            *(re.escape(name) for name in (*TOKENIZER_FILES, EXPORT_MARKER)),
        ]
    )
)
#: ``metrics.METRICS_FILE_NAME`` (importing the metrics callback here would import the engine
#: through it: a circle; tests/test_output_paths.py checks the two agree).
METRICS_FILE_NAME = "metrics.jsonl"
#: A step's own entries in its work directory: Tango's checkpoints and links, ``weights.pt``, the log.
_RUN_ENTRY = re.compile(r"checkpoint_state_.*|weights\.pt|" + re.escape(METRICS_FILE_NAME))
#: The entries of a directory looked at to say what it holds (the message only: it is refused anyway).
_CHILDREN_LOOKED_AT = 1000


def export_hf_path(export_hf: str, work_dir: Path) -> Path:
    """
    Where the engine's ``export_hf`` writes: ``~`` is the user's home directory, as in a shell
    (it made a directory named ``~`` in the work directory), and a relative path is relative to
    the step's work directory.
    """
    return Path(work_dir) / os.path.expanduser(export_hf)


def check_writable(path: Path, needed_bytes: int = 0) -> None:
    """
    ``path`` can be written, checked before any work: its nearest existing directory takes a new
    file (a read-only filesystem, missing permissions) and has ``needed_bytes`` free. Otherwise
    an export found it after training, in a 90-line traceback.
    """
    ancestor = Path(os.path.abspath(path))
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return  # a file where a directory should be: check_output names it
    try:
        # Unnamed where the filesystem allows (O_TMPFILE), and gone when closed.
        with tempfile.TemporaryFile(dir=ancestor, prefix=".tango-fairscale-probe-"):
            pass
    except OSError as error:
        code = errno.errorcode.get(error.errno or 0, "")
        raise CheckpointError(
            f"Cannot write {path}: {ancestor} does not take new files ({error.strerror or error}"
            f"{', ' + code if code else ''}): give a writable directory, or make it writable"
        ) from None
    free = shutil.disk_usage(ancestor).free
    if needed_bytes > free:
        raise CheckpointError(
            f"Cannot write {path}: its filesystem has {_size(free)} free, and the export needs about "
            f"{_size(needed_bytes)}: free space there, or give a directory on another filesystem"
        )


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    return f"{count} B"


def marker(kind: str, files: Sequence[str] = ()) -> bytes:
    """The marker of an output of ``kind`` (with the files a ``from_pretrained`` directory holds)."""
    content: Dict[str, object] = {"written_by": _WRITTEN_BY, "output": kind, "version": VERSION}
    if files:
        content["files"] = sorted(files)
    return (json.dumps(content, indent=2) + "\n").encode()


def _read_marker(data: bytes, kind: str) -> Optional[Dict[str, object]]:
    try:
        content = json.loads(data)
    except ValueError:
        return None
    if (
        isinstance(content, dict)
        and content.get("written_by") == _WRITTEN_BY
        and content.get("output") == kind
    ):
        return content
    return None


# --- what a path is ----------------------------------------------------------------------------


def is_workspace(path: Path) -> bool:
    """A Tango local workspace: ``settings.json``, ``cache/`` and ``runs/``, as Tango makes one."""
    return (path / "settings.json").is_file() and (path / "cache").is_dir() and (path / "runs").is_dir()


def is_checkpoint_dir(path: Path) -> bool:
    """
    A checkpoint directory: its marker, or worker files without one (an interrupted save is still
    a checkpoint a later save or a resume reads, so nothing else belongs in it).
    """
    # DCP's metadata file by name: importing the torch backend's modules costs a second.
    return path.is_dir() and (
        (path / checkpointing.MARKER).exists()
        or any(path.glob("worker*_*.pt"))
        or (path / "dcp" / ".metadata").is_file()
    )


def is_work_dir(path: Path, work_dir: Optional[Path] = None) -> bool:
    """
    A step's work directory: the step's own (``work_dir``), one holding checkpoints or a metrics log,
    or a workspace's ``cache/<step>/work`` (empty while a fresh run starts).
    """
    if work_dir is not None and _same(path, work_dir):
        return True
    if not path.is_dir():
        return False
    if (path / METRICS_FILE_NAME).is_file() or any(path.glob("checkpoint_state_*")):
        return True
    # Tango's layout, WORKSPACE/cache/<step>/work, also reached through a run's link to the step.
    resolved = path.resolve()
    return (
        resolved.name == "work"
        and resolved.parent.parent.name == "cache"
        and is_workspace(resolved.parent.parent.parent)
    )


def _same(a: Path, b: Path) -> bool:
    return Path(os.path.abspath(a)) == Path(os.path.abspath(b)) or a.resolve() == b.resolve()


def _run_entry(path: Path, work_dir: Optional[Path]) -> Optional[str]:
    """What ``path`` is when it is one of a step's own entries in its work directory (by name: it
    need not exist yet, as in pre-flight)."""
    if not _RUN_ENTRY.fullmatch(path.name) or not is_work_dir(path.parent, work_dir):
        return None
    if path.name == "weights.pt":
        return f"the step's weights {path}"
    if path.name == METRICS_FILE_NAME:
        return f"the step's metrics log {path}"
    if path.is_symlink():
        return f"the step's checkpoint link {path}"
    return f"the step's checkpoint directory {path}"


def _what_it_is(path: Path, work_dir: Optional[Path]) -> Optional[str]:
    """``path`` described as one of the things an output may never be, or None."""
    entry = _run_entry(path, work_dir)
    if entry is not None:
        return entry
    if path.is_symlink() and path.name.startswith("checkpoint_state_"):
        return f"the checkpoint link {path}"
    if is_workspace(path):
        return f"the Tango workspace {path}"
    if is_work_dir(path, work_dir):
        return f"the step's work directory {path}"
    if is_checkpoint_dir(path):
        return f"the checkpoint directory {path}"
    return None


def _what_it_holds(path: Path, work_dir: Optional[Path], sources: Sequence[Path]) -> Optional[str]:
    """What ``path`` (a directory) holds that an output may never replace, or None."""
    resolved = path.resolve()
    # The outermost first: a directory holding the work directory holds its checkpoints too.
    known = [
        (work_dir, "the step's work directory"),
        *((source, "the checkpoint directory") for source in sources),
    ]
    for inner, what in known:
        if inner is not None and resolved in Path(inner).resolve().parents:
            return f"{what} {inner}"
    try:
        children = [child for _, child in zip(range(_CHILDREN_LOOKED_AT), path.iterdir())]
    except OSError:
        return None
    for child in children:
        if child.is_dir() and not child.is_symlink():
            held = _what_it_is(child, work_dir)
            if held is not None:
                return held
    return None


# --- outputs of the package ---------------------------------------------------------------------


def is_export_dir(path: Path) -> Tuple[bool, List[str]]:
    """
    Whether ``path`` is a ``from_pretrained`` directory the package wrote (its marker), and the
    entries in it the export did not write (then it is not replaced).
    """
    try:
        content = _read_marker((path / EXPORT_MARKER).read_bytes(), HF_EXPORT)
    except OSError:
        return False, []
    if content is None:
        return False, []
    written = set(content.get("files") or []) | {EXPORT_MARKER}  # type: ignore[call-overload]
    foreign = sorted(
        child.name
        for child in path.iterdir()
        if child.name not in written or child.is_symlink() or not child.is_file()
    )
    return True, foreign


def is_consolidated_file(path: Path) -> bool:
    """Whether ``path`` is a ``.pt`` file ``consolidate`` wrote (the record in its archive)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.filename.split("/", 1)[-1] == PT_MARKER_RECORD and info.file_size < 1 << 16:
                    return _read_marker(archive.read(info), CONSOLIDATED) is not None
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return False


def is_plan_json(path: Path) -> bool:
    """Whether ``path`` is a JSON file ``plan --json`` wrote (the marker's fields at its top)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        if path.stat().st_size > _PLAN_JSON_LIMIT:
            return False
        return _read_marker(path.read_bytes(), PLAN_JSON) is not None
    except OSError:
        return False


def plan_json(content: Dict[str, object]) -> str:
    """``plan --json``'s file: ``content`` with the marker's fields, so that a rerun may replace it."""
    return json.dumps({**json.loads(marker(PLAN_JSON)), **content}, indent=2)


def _is_output(path: Path, kind: str) -> Tuple[bool, List[str]]:
    if kind == HF_EXPORT:
        return is_export_dir(path) if path.is_dir() and not path.is_symlink() else (False, [])
    if kind == PLAN_JSON:
        return is_plan_json(path), []
    return is_consolidated_file(path), []


# --- the rule ----------------------------------------------------------------------------------


def check_output(
    path: Path,
    kind: str,
    *,
    replace: bool = True,
    work_dir: Optional[Path] = None,
    sources: Sequence[Path] = (),
    label: str = "",
    running_step: bool = True,
) -> None:
    """
    Raise a one-line :class:`CheckpointError` unless an output of ``kind`` may be written at
    ``path``: a new path, or an earlier output of the same kind (with ``replace``; without it,
    the error says to pass ``--force``). ``work_dir`` is the step's work directory (known in the
    engine and pre-flight, where it may still be empty), ``sources`` the checkpoints being read.
    ``label`` names the option the path came from in the message (``training_engine.export_hf``).
    ``running_step``: ``work_dir`` is the running step's own, where its outputs may go; otherwise
    (``consolidate`` reading a finished step) no work directory is written into.
    """
    path = Path(path)
    absolute = Path(os.path.abspath(path))
    resolved = path.resolve()
    name = f"{path} ({label})" if label else str(path)
    fix = f"choose a new path (or one this package wrote {_KIND_NAMES[kind]} to before)"
    for candidate in dict.fromkeys([absolute, resolved]):
        what = _what_it_is(candidate, work_dir)
        if what is None and candidate.exists() and candidate.is_dir() and not candidate.is_symlink():
            what = _what_it_holds(candidate, work_dir, sources)
            verb = "holds"
        else:
            verb = "is"
        if what is not None:
            raise CheckpointError(f"refusing to write {name}: it {verb} {what}; {fix}")
    # Inside: a checkpoint (anywhere above), or a workspace outside a step's work directory.
    for chain in (resolved.parents, absolute.parents):
        in_work_dir = False
        for directory in chain:
            checkpoint = is_checkpoint_dir(directory)
            inside = (
                f"the checkpoint directory {directory}" if checkpoint else _run_entry(directory, work_dir)
            )
            if inside is not None:
                raise CheckpointError(f"refusing to write {name} inside {inside}: choose a path outside it")
            if is_work_dir(directory, work_dir):
                if not running_step or work_dir is None or not _same(directory, work_dir):
                    # Another step's outputs (Tango keeps a cached step's as they are), or, with no
                    # running step (consolidate, plan), any step's.
                    whose = "another" if running_step and work_dir is not None else "a"
                    raise CheckpointError(
                        f"refusing to write {name} inside the work directory {directory}, which "
                        f"holds {whose} step's outputs: choose a path outside it"
                    )
                in_work_dir = True
            elif not in_work_dir and is_workspace(directory):
                raise CheckpointError(
                    f"refusing to write {name} inside the Tango workspace {directory}, whose "
                    "directories are Tango's: choose a path outside it, or inside a step's work directory"
                )
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        raise CheckpointError(
            f"refusing to replace {name}: it is a symbolic link (to {os.readlink(path)}); {fix}"
        )
    ours, foreign = _is_output(path, kind)
    if ours and foreign:
        raise CheckpointError(
            f"refusing to replace {name}: it holds {', '.join(foreign[:5])}, which no export "
            "wrote; move them out or remove the directory yourself, or choose another path"
        )
    if ours:
        if not replace:
            raise CheckpointError(f"output {name} already exists: pass --force to replace it")
        return
    for other in _KIND_NAMES:
        if other != kind and _is_output(path, other)[0]:
            raise CheckpointError(
                f"refusing to replace {name}: it is {_KIND_NAMES[other]}, not {_KIND_NAMES[kind]}; "
                "choose another path"
            )
    if kind != HF_EXPORT and path.is_dir():
        raise CheckpointError(f"output {name} is a directory: give the path of the file to write")
    described = "directory" if path.is_dir() else "file"
    missing = {
        HF_EXPORT: EXPORT_MARKER,
        CONSOLIDATED: PT_MARKER_RECORD + " record",
        PLAN_JSON: '"written_by" field',
    }[kind]
    raise CheckpointError(
        f"refusing to replace {name}: it is a {described} this package did not write (no "
        f"{missing}); remove it yourself or choose another path"
    )


# --- temporaries -------------------------------------------------------------------------------


def _host() -> str:
    # In the name of an export's temporaries: on a filesystem shared by the hosts of a launch,
    # another host's writer is alive whatever this host's process table says.
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"


def temporary_sibling(path: Path, suffix: str = "tmp") -> Path:
    """
    A unique sibling of ``path`` for a directory written beside it (``tmp``) or the one it
    replaces (``old``): ``.NAME.HOST.PID.HEX.SUFFIX``, which :func:`remove_stale_temporaries`
    recognises once its process is gone.
    """
    path = Path(path)
    return path.with_name(f".{path.name}.{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{suffix}")


#: The file an export's temporary directory holds while it is written: the random part of its
#: name. The sweep removes a directory of that name only when it holds this file with that token
#: (a user's directory that merely matches the name pattern is never removed).
TEMPORARY_TOKEN = ".tango_fairscale_temporary"


def mark_temporary(directory: Path) -> None:
    """Write :data:`TEMPORARY_TOKEN` into a new :func:`temporary_sibling` directory."""
    (Path(directory) / TEMPORARY_TOKEN).write_text(Path(directory).name.rsplit(".", 2)[-2])


def _temporary_pattern(name: str) -> "re.Pattern[str]":
    # Files of checkpointing.files.atomic_file (.NAME.PID.HEX.tmp, in a directory of one host),
    # and directories of temporary_sibling (.NAME.HOST.PID.HEX.tmp|old).
    return re.compile(
        rf"\.{re.escape(name)}\.(?:(?P<host>[A-Za-z0-9.-]+)\.)?(?P<pid>\d+)\.(?P<token>[0-9a-f]{{8}})"
        r"\.(?P<suffix>tmp|old)"
    )


def _boot_time() -> Optional[float]:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _process_start(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), where ``/proc`` says; else None."""
    boot = _boot_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if boot is None else boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def writer_gone(pid: int, modified: float) -> bool:
    """
    Whether the process ``pid`` that last wrote an entry at ``modified`` (its mtime) is gone: no
    such process, or one that started after the entry was written (the id reused, as in a
    restarted container). A process of another user counts as alive.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    started = _process_start(pid)
    # Two seconds: the boot time is whole seconds, the start time in clock ticks.
    return started is not None and started > modified + 2.0


def _stale(entry: Path, host: Optional[str], token: str) -> bool:
    """Whether ``entry`` (its name matched) is a temporary of this user that no live writer holds."""
    try:
        info = entry.lstat()
    except OSError:
        return False
    if info.st_uid != os.getuid():
        return False
    if stat.S_ISREG(info.st_mode):
        # atomic_file's: a torch.save zip archive, possibly cut short (or still empty).
        if host is not None:
            return False
        with open(entry, "rb") as handle:
            start = handle.read(2)
        return start in (b"", b"P", b"PK")
    if stat.S_ISDIR(info.st_mode):
        # An export's: this host's, holding the token its name carries (mark_temporary), and
        # nothing but export files beside it.
        if host != _host():
            return False
        try:
            if (entry / TEMPORARY_TOKEN).read_text() != token:
                return False
        except OSError:
            return False
        return all(
            child.name == TEMPORARY_TOKEN or (_EXPORT_FILE.fullmatch(child.name) and child.is_file())
            for child in entry.iterdir()
        )
    return False


def remove_stale_temporaries(path: Path) -> List[Path]:
    """
    Remove what interrupted writes of ``path`` left beside it (``.NAME.PID.HEX.tmp`` files,
    ``.NAME.HOST.PID.HEX.tmp`` export directories holding :data:`TEMPORARY_TOKEN` with their
    ``HEX``): entries of this user whose writing process is gone, of the expected shape. Returns
    what was removed; anything else is kept.
    """
    path = Path(path)
    pattern = _temporary_pattern(path.name)
    removed: List[Path] = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            modified = entry.lstat().st_mtime
        except OSError:
            continue
        if not writer_gone(int(match["pid"]), modified) or not _stale(entry, match["host"], match["token"]):
            continue
        try:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as error:
            logger.warning("Cannot remove %s, left by an interrupted write: %s", entry, error)
            continue
        logger.warning("Removed %s, left by an interrupted write (process %s)", entry, match["pid"])
        removed.append(entry)
    return removed
