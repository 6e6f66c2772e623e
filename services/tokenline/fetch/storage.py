"""The local side: directories, free space, and OS errors turned into advice."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from tokenline.fetch.errors import FetchError
from tokenline.fetch.progress import human_bytes


def disk_error(exc: OSError, path: Path | str, action: str) -> FetchError:
    """An OSError from writing the model, as a FetchError that says what to do about it."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what = {
            errno.ENOSPC: "no space left on device",
            errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file too large for this filesystem or process limit",
        }[code]
        return FetchError(
            f"{action} {path}: {what}. Give the model directory a larger volume (its size must "
            "hold the whole model), or free space; nothing was marked complete, and the next "
            "fetch resumes where this one stopped",
            reason="DiskFull",
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "read-only filesystem" if code == errno.EROFS else "permission denied"
        return FetchError(
            f"{action} {path}: {what}. Make the directory writable by this user (in a Pod: "
            "securityContext.fsGroup, or a volume that is not mounted readOnly)",
            reason="PermissionDenied",
        )
    return FetchError(f"{action} {path}: {exc.strerror or exc}", reason="DiskError")


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise FetchError(
            f"cannot use {path} as the model directory: a file of that name exists; give a "
            "directory path",
            reason="DiskError",
        ) from exc
    except OSError as exc:
        raise disk_error(exc, path, "cannot create") from exc
    return path


def check_free_space(path: Path, needed: int, label: str) -> None:
    """Fail before the first byte rather than at 97% of a 140 GB download."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return  # cannot tell (some network filesystems): find out while writing
    if needed > free:
        raise FetchError(
            f"fetch {label}: needs {human_bytes(needed)} more in {path}, but only "
            f"{human_bytes(free)} is free. Give the model directory a larger volume or free "
            "space; nothing was downloaded",
            reason="DiskFull",
        )
