"""What a model is made of: the files a source lists, the files a fetch verified, and the marker
that says a directory holds a complete model. Pure functions plus two small file helpers.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from tokenline.fetch.errors import FetchError

# Everything the fetcher keeps for itself lives under this name inside the target directory:
# the lock, partial downloads, the journal of verified files and the completion marker.
WORK_DIR = ".tokenline-fetch"
MARKER = "complete.json"
MARKER_VERSION = 1

# When a repository has safetensors weights, these are the same weights again in another format
# (vLLM makes the same choice): skipping them halves many downloads.
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf")
DEFAULT_EXCLUDE = (".gitattributes", ".git/*", "*/.git/*")


@dataclass(frozen=True)
class RemoteFile:
    """One file a source offers, with whatever the source says it must be.

    ``identity`` ties a partial download to one version of the object, so a resume never
    stitches bytes of two versions together (it is the ETag or the sha the source gave).
    """

    name: str  # relative POSIX path inside the model directory
    size: int | None
    sha256: str | None = None  # hex; Hub LFS oid, S3 x-amz-checksum-sha256, #sha256=
    md5: str | None = None  # hex; a single-part S3 ETag
    git_sha1: str | None = None  # hex; the Hub's blob id for files not in LFS
    etag: str | None = None
    locator: str = ""  # source-specific: a URL or an object key

    @property
    def identity(self) -> str:
        return self.sha256 or self.md5 or self.git_sha1 or self.etag or f"size:{self.size}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a delivered model, as verified (sha256 is None for files unpacked from an
    archive: the archive's own digest covers them)."""

    name: str
    size: int
    sha256: str | None = None


def safe_name(name: str, source: str) -> str:
    """A file name from a remote listing, checked so it cannot escape the target directory or
    touch the fetcher's own files."""
    path = PurePosixPath(name)
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("..", ".", "") for p in name.split("/"))
        or path.parts[0] == WORK_DIR
    ):
        raise FetchError(
            f"{source} lists a file named {name!r}, which would be written outside the model "
            "directory; refusing to fetch it (check the source)",
            reason="IntegrityError",
        )
    return str(path)


def select(
    files: Sequence[RemoteFile],
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> list[RemoteFile]:
    """The files to fetch: ``include`` globs (all when None), minus ``exclude`` globs, minus
    duplicate weight formats when safetensors are present; ``config.json`` comes last, so a
    directory whose fetch broke off never looks like a loadable model even to a loader that does
    not check the marker."""

    def matches(name: str, patterns: Iterable[str]) -> bool:
        return any(
            fnmatch.fnmatch(name, p) or fnmatch.fnmatch(name.split("/")[-1], p) for p in patterns
        )

    chosen = [f for f in files if include is None or matches(f.name, include)]
    chosen = [f for f in chosen if not matches(f.name, (*DEFAULT_EXCLUDE, *(exclude or ())))]
    if include is None and any(f.name.endswith(".safetensors") for f in chosen):
        chosen = [f for f in chosen if not matches(f.name, _OTHER_WEIGHTS)]
    return sorted(chosen, key=lambda f: (f.name == "config.json", f.name))


def digest_of(entries: Iterable[FileEntry]) -> str:
    """A content digest for a whole model: sha256 over its sorted (name, size, sha256) lines, so
    two directories with this digest hold the same bytes."""
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.name):
        h.update(f"{e.name}\0{e.size}\0{e.sha256 or ''}\n".encode())
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class Marker:
    """Written last, after every file is verified and in place: its presence is the only thing
    that makes a directory a complete model."""

    uri: str
    revision: str | None
    digest: str
    size: int
    files: tuple[FileEntry, ...]

    def to_json(self) -> str:
        body = asdict(self)
        body["version"] = MARKER_VERSION
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Marker | None:
        try:
            body = json.loads(text)
            if body.get("version") != MARKER_VERSION:
                return None
            files = tuple(FileEntry(**f) for f in body["files"])
            return cls(body["uri"], body["revision"], body["digest"], int(body["size"]), files)
        except (ValueError, KeyError, TypeError):
            return None  # a marker this version cannot read is no marker: fetch again

    def intact_in(self, root: Path) -> bool:
        """Cheap check that the files are still there at their sizes (a full re-hash of hundreds
        of GB on every pod start would defeat the cache)."""
        try:
            return all((root / f.name).stat().st_size == f.size for f in self.files)
        except OSError:
            return False


def marker_path(root: Path) -> Path:
    return root / WORK_DIR / MARKER


def read_marker(root: Path) -> Marker | None:
    try:
        return Marker.from_json(marker_path(root).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync and rename, so a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (a crash right after must not lose it); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
