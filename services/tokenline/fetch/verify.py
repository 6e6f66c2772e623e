"""Incremental hashing of a download and the check against what the source promised. No I/O."""

from __future__ import annotations

import base64
import binascii
import hashlib

from tokenline.fetch.errors import FetchError
from tokenline.fetch.manifest import RemoteFile


def base64_sha256(value: str | None) -> str | None:
    """A sha256 a source states in base64 (S3's x-amz-checksum-sha256, an HTTP Digest), as hex;
    None when there is none, it is no sha256, or it is a multipart upload's composite checksum
    (it ends in -N and is not a digest of the content)."""
    if not value or "-" in value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


class Hashes:
    """Every digest a file is checked against, fed chunk by chunk as the bytes arrive (a second
    read of a 10 GB shard would double the disk traffic). sha256 is always computed: it is what
    the marker records."""

    def __init__(self, remote: RemoteFile) -> None:
        self.remote = remote
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5(usedforsecurity=False) if remote.md5 else None
        self.git_sha1 = None
        if remote.git_sha1 and remote.size is not None:
            # git's blob id is sha1("blob <size>\0" + content): the Hub's id for non-LFS files.
            self.git_sha1 = hashlib.sha1(usedforsecurity=False)
            self.git_sha1.update(f"blob {remote.size}\0".encode())

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self.sha256.update(chunk)
        if self.md5 is not None:
            self.md5.update(chunk)
        if self.git_sha1 is not None:
            self.git_sha1.update(chunk)

    def mismatch(self) -> str | None:
        """What differs from the source's promise, or None when everything matches."""
        r = self.remote
        if r.size is not None and self.size != r.size:
            return f"size {self.size} bytes, expected {r.size}"
        if r.sha256 and self.sha256.hexdigest() != r.sha256.lower():
            return f"sha256 {self.sha256.hexdigest()}, expected {r.sha256.lower()}"
        if self.md5 is not None and self.md5.hexdigest() != (r.md5 or "").lower():
            return f"md5 {self.md5.hexdigest()}, expected {r.md5} (the object's ETag)"
        if self.git_sha1 is not None and self.git_sha1.hexdigest() != (r.git_sha1 or "").lower():
            return f"git blob sha1 {self.git_sha1.hexdigest()}, expected {r.git_sha1}"
        return None

    def check(self, source: str) -> str:
        """Raise IntegrityError on a mismatch; return the sha256 hex digest otherwise."""
        problem = self.mismatch()
        if problem:
            raise FetchError(
                f"{source}: {self.remote.name} failed verification ({problem}); the partial "
                "file was discarded. Run the fetch again; if it keeps failing the source serves "
                "corrupt or changing data",
                reason="IntegrityError",
            )
        return self.sha256.hexdigest()
