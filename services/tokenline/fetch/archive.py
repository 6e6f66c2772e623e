"""Unpacking a verified archive (tar, tar.gz/bz2/xz, zip) into a staging directory.

The kind is read from the bytes, not the URL (a presigned URL's path may not say). Nothing may
land outside the staging directory: tar members go through Python's "data" filter (no absolute
paths, no .., no links out, no devices); zip members are checked the same way by name.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import zipfile
from pathlib import Path

from tokenline.fetch.errors import FetchError
from tokenline.fetch.manifest import FileEntry, safe_name
from tokenline.fetch.storage import disk_error


def unpack(archive: Path, staging: Path, label: str) -> Path:
    """Unpack into ``staging`` and return the model root inside it: a lone top-level directory
    (``model/config.json``) is stepped into, as archives of a directory usually have one."""
    if staging.exists():
        shutil.rmtree(staging)  # a half-unpacked earlier attempt
    staging.mkdir(parents=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    safe_name(info.filename.rstrip("/"), label)
                    if (info.external_attr >> 16) & 0o170000 == 0o120000:
                        raise FetchError(
                            f"{label}: the zip holds a symlink {info.filename!r}; refusing it",
                            "IntegrityError",
                        )
                zf.extractall(staging)
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive, "r:*") as tf:
                tf.extractall(staging, filter="data")
        else:
            raise FetchError(
                f"fetch {label}: the download is not a tar, tar.gz or zip archive; https:// "
                "takes one archive of the model directory",
                reason="NotSupported",
            )
    except tarfile.FilterError as exc:
        raise FetchError(f"fetch {label}: unsafe archive member: {exc}", "IntegrityError") from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise FetchError(
            f"fetch {label}: the archive is corrupt: {exc}", "IntegrityError"
        ) from None
    except OSError as exc:
        raise disk_error(exc, staging, "cannot unpack into") from exc
    entries = [p for p in staging.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return staging


def move_into(root: Path, target: Path) -> list[FileEntry]:
    """Move every unpacked file into ``target`` (same filesystem: renames), config.json last."""
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and not p.is_symlink()),
        key=lambda p: (p.name == "config.json" and p.parent == root, str(p)),
    )
    entries = []
    for path in files:
        name = path.relative_to(root).as_posix()
        dest = target / name
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size
            os.replace(path, dest)
        except OSError as exc:
            raise disk_error(exc, dest, "cannot move the unpacked file to") from exc
        entries.append(FileEntry(name=name, size=size))
    return entries
