"""
Putting a finished output in place without ever replacing what its writer did not check: the
output is written under a temporary name, and the check of its target (nothing there, or an
earlier output of the same kind) is made when the write starts. Whatever appears at the target
meanwhile, or takes the earlier output's place, is left as it is and the write stops with one
line. The rename that puts it in place refuses to replace (Linux's ``renameat2`` with
``RENAME_NOREPLACE``), and an earlier output is swapped out atomically (``RENAME_EXCHANGE``) and
checked to be the very one that was checked (same inode), else swapped back.
"""

import ctypes
import errno
import os
from pathlib import Path
from typing import Callable, Optional, Tuple

from ..errors import CheckpointError

#: A path's ``(st_dev, st_ino)``: which file or directory it is, whatever its name.
Identity = Tuple[int, int]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 and later


def identity(path: Path) -> Optional[Identity]:
    """What is at ``path`` now (not following a symbolic link), ``None`` when nothing is."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino)


def _rename2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``: ``False`` where the kernel or filesystem lacks it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # EINVAL: a filesystem without the flag
        return False
    raise OSError(code, os.strerror(code), str(target))


def rename_noreplace(source: Path, target: Path) -> None:
    """
    Rename ``source`` to ``target``, raising :class:`FileExistsError` when anything is at
    ``target``. Without ``renameat2``: a file is linked (which refuses an existing name) then
    unlinked; a directory is renamed right after checking that nothing is there (a rename over an
    empty directory would replace it), the one place a race stays open.
    """
    if _rename2(source, target, _RENAME_NOREPLACE):
        return
    if not source.is_dir():
        os.link(source, target)  # FileExistsError when anything is there
        os.unlink(source)
        return
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def place(
    new: Path,
    target: Path,
    checked: Optional[Identity],
    *,
    still_replaceable: Callable[[Path], bool],
    what: str,
) -> Optional[Path]:
    """
    Put ``new`` at ``target``. ``checked`` is what was at ``target`` when its check passed:
    ``None`` (nothing: the rename refuses to replace anything that appeared since), or an earlier
    output's identity, swapped out only if that same one is still there and
    ``still_replaceable(path)`` says so (its marker unchanged). Returns where the earlier output
    now is (``new``'s old name: the caller removes it), or ``None``. Otherwise raises a one-line
    :class:`CheckpointError` naming ``target`` (``what``: the output, for the message), with
    ``target`` as it was and ``new`` left for the caller to remove.
    """
    changed = CheckpointError(
        f"refusing to put {what} at {target}: something else was put there while it was being "
        "written; it was left as it is, and nothing was written there. Remove it yourself or "
        "choose another path, and run again."
    )
    if checked is None:
        try:
            rename_noreplace(new, target)
        except FileExistsError:
            raise changed from None
        return None
    if identity(target) != checked:
        raise changed
    if _rename2(new, target, _RENAME_EXCHANGE):
        if identity(new) == checked and still_replaceable(new):
            return new
        _rename2(new, target, _RENAME_EXCHANGE)  # swap back: the newcomer returns to its name
        raise changed
    # Without RENAME_EXCHANGE: the earlier output moved aside under a name of our own, checked there.
    aside = new.with_name(new.name + ".old")
    rename_noreplace(target, aside)
    if identity(aside) != checked or not still_replaceable(aside):
        rename_noreplace(aside, target)
        raise changed
    try:
        rename_noreplace(new, target)
    except FileExistsError:
        raise CheckpointError(
            f"refusing to put {what} at {target}: something else was put there while the earlier "
            f"output was moved aside, to {aside}, where it stays; nothing was written there."
        ) from None
    return aside
