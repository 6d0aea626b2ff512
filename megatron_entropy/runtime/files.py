"""Writing a run's files: whole or not at all, and a full or unwritable disk said as such (a
refused read too, as a read).

No torch here (the study's and the Slurm helpers' processes write with it too)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

# The errors of a disk that takes no more (or no) writes: reported as one line naming the path.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
# A write that failed with less than this left on its file system failed for want of space:
# dist_checkpointing's writer processes lose the errno (torch's zip writer reports only a short
# write, "unexpected pos"), and the partial file they leave keeps the disk full until removed.
FULL_BELOW_BYTES = 64 * 2**20


def write_text_atomic(path: Path, text: str, tmp: Optional[Path] = None,
                      before_replace: Optional[Callable[[], None]] = None) -> Path:
    """``path`` := ``text`` through ``tmp`` (default ``.NAME.tmp`` beside it) and a rename:
    readers see the old or the new text, and a failed write leaves no temporary file.
    ``before_replace`` runs once the new text is written (to move the old file aside)."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _errno_in(error: BaseException) -> Optional[OSError]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in WRITE_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def disk_error(error: BaseException, path: Path) -> Optional[OSError]:
    """The OSError (errno, and ``path`` as its file name) that ``error``, raised while writing
    under ``path``, stands for: one in its chain of causes, else ENOSPC when the file system
    has (almost) no space left; None when it is no disk error. Call it before removing what the
    failed write left, which frees the space it took."""
    found = _errno_in(error)
    if found is not None:
        return OSError(found.errno, os.strerror(found.errno), str(found.filename or path))
    try:
        free = shutil.disk_usage(_existing(path)).free
    except OSError:
        return None
    if free < FULL_BELOW_BYTES:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free // 1024} KiB free)",
                       str(path))
    return None


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def describe(error: OSError, action: Optional[str] = None) -> str:
    """One line: what could not be done to which path (``action`` where the caller knows,
    e.g. "read"), and why (errno name and text). Else a refused access (EACCES, EPERM) to a
    path that exists and cannot be read is a read, one behind a folder that cannot be entered
    (said) an open; the rest are writes (a full or read-only disk, a folder that takes no new
    file)."""
    name = errno.errorcode.get(error.errno, str(error.errno))
    why = error.strerror
    if not error.filename:
        return f"a {action or 'write'} failed: {name} ({why})"
    path = Path(error.filename)
    refused = error.errno in (errno.EACCES, errno.EPERM)
    closed = _closed_folder(path) if refused else None
    if action is None:
        unreadable = refused and os.access(path, os.F_OK) and not os.access(path, os.R_OK)
        action = "open" if closed else "read" if unreadable else "write"
    if closed is not None:
        why += f": {closed} cannot be entered"
    return f"cannot {action} {error.filename}: {name} ({why})"


def _closed_folder(path: Path) -> Optional[Path]:
    """The first folder on the way to ``path`` that exists and this process cannot enter."""
    for folder in reversed(path.absolute().parents):
        if os.access(folder, os.F_OK) and not os.access(folder, os.X_OK):
            return folder
    return None


def relative_note(path: str | os.PathLike) -> str:
    """What a "does not exist" message adds for a relative ``path`` (empty for an absolute one):
    where it was looked for (config/loading.py: INPUT_PATH_KEYS)."""
    if Path(path).is_absolute():
        return ""
    return (" (a relative path in a config file is taken from the file's folder, else from the "
            f"working directory, {os.getcwd()})")
