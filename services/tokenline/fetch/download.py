"""The downloader, shared by every remote scheme: partial file, resume, retries, verify,
rename. A transport only supplies an ``Opener``: "give me the bytes of this file from offset N".

Invariants: a file appears under its real name only after every byte is verified; the partial
file and a small sidecar naming the object version survive a crash or a pod restart, so the next
attempt resumes instead of starting over; a partial of another version is never resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from tokenline.fetch.errors import FetchError, Transient
from tokenline.fetch.manifest import FileEntry, RemoteFile, fsync_dir
from tokenline.fetch.progress import MODEL_FETCH_BYTES, Progress
from tokenline.fetch.retry import Backoff
from tokenline.fetch.storage import disk_error
from tokenline.fetch.verify import Hashes

log = logging.getLogger("tokenline.fetch")

CHUNK = 1 << 20


@dataclass
class Stream:
    """Bytes of one file starting at ``start`` (0 when the server ignored the Range asked for)."""

    start: int
    chunks: Iterator[bytes]


# An opener yields a Stream from the given offset; it raises Transient for what a retry may fix
# and FetchError for what it cannot (404, 403, bad credentials).
Opener = Callable[[RemoteFile, int], AbstractContextManager[Stream]]


@dataclass
class Downloader:
    label: str  # the redacted URI, for messages
    scheme: str  # the metric label
    partial_dir: Path
    progress: Progress
    backoff: Backoff = field(default_factory=Backoff)
    sleep: Callable[[float], None] = time.sleep

    def fetch_file(self, remote: RemoteFile, dest: Path, open_from: Opener) -> FileEntry:
        """Download ``remote`` to ``dest`` (verified, atomically renamed) and return its entry."""
        key = hashlib.sha256(remote.name.encode()).hexdigest()[:32]
        part = self.partial_dir / f"{key}.part"
        meta = self.partial_dir / f"{key}.json"
        identity = json.dumps(
            {"name": remote.name, "identity": remote.identity, "size": remote.size}
        )
        try:
            if not (meta.exists() and meta.read_text() == identity):
                part.unlink(missing_ok=True)  # a partial of another version: never stitch
                meta.write_text(identity)
            handle = open(part, "ab+")
        except OSError as exc:
            raise disk_error(exc, part, "cannot write the partial download") from exc
        try:
            hashes = self._rehash(handle, remote)
            restarted = False
            while True:
                hashes = self._receive(handle, remote, hashes, open_from, part)
                if hashes.mismatch() is None or restarted:
                    break
                # Verification failed: maybe the resumed bytes were stale. Start over once.
                log.warning(
                    "fetch %s: %s failed verification (%s); downloading it again from the start",
                    self.label,
                    remote.name,
                    hashes.mismatch(),
                )
                restarted = True
                hashes = self._reset(handle, remote, hashes.size, part)
            try:
                sha256 = hashes.check(self.label)
            except FetchError:
                self._discard(handle, part, meta)
                raise
            try:
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                raise disk_error(exc, part, "cannot write") from exc
        finally:
            handle.close()
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
            meta.unlink(missing_ok=True)
            fsync_dir(dest.parent)
        except OSError as exc:
            raise disk_error(exc, dest, "cannot move the verified file into place at") from exc
        return FileEntry(name=remote.name, size=hashes.size, sha256=sha256)

    def _rehash(self, handle, remote: RemoteFile) -> Hashes:
        """Hash what an earlier attempt left, so the resumed download is checked end to end."""
        hashes = Hashes(remote)
        handle.seek(0)
        if remote.size is not None and os.fstat(handle.fileno()).st_size > remote.size:
            handle.truncate(0)  # longer than the object: not ours to trust
        while chunk := handle.read(CHUNK):
            hashes.update(chunk)
        if hashes.size:
            log.info("fetch %s: resuming %s at byte %d", self.label, remote.name, hashes.size)
            self.progress.skip(hashes.size)
        return hashes

    def _reset(self, handle, remote: RemoteFile, had: int, part: Path) -> Hashes:
        try:
            handle.truncate(0)
            handle.seek(0)
        except OSError as exc:
            raise disk_error(exc, part, "cannot write") from exc
        self.progress.rewind(had)
        return Hashes(remote)

    def _discard(self, handle, part: Path, meta: Path) -> None:
        with contextlib.suppress(OSError):
            handle.close()
            part.unlink(missing_ok=True)
            meta.unlink(missing_ok=True)

    def _receive(
        self, handle, remote: RemoteFile, hashes: Hashes, open_from: Opener, part: Path
    ) -> Hashes:
        """Append bytes until the file is whole, resuming after each broken attempt; return the
        hashes of the whole file (new ones when the server made us start over)."""
        failures = 0
        while True:
            got = 0
            try:
                if remote.size is not None and hashes.size >= remote.size:
                    return hashes
                with open_from(remote, hashes.size) as stream:
                    if stream.start != hashes.size:
                        if stream.start != 0:
                            raise Transient(
                                f"server sent bytes from {stream.start}, asked for {hashes.size}"
                            )
                        # The server ignored Range (a 200): take the whole body from byte 0.
                        log.info(
                            "fetch %s: server ignored Range; restarting %s", self.label, remote.name
                        )
                        hashes = self._reset(handle, remote, hashes.size, part)
                    for chunk in stream.chunks:
                        try:
                            handle.write(chunk)
                        except OSError as exc:
                            raise disk_error(exc, part, "cannot write") from exc
                        hashes.update(chunk)
                        got += len(chunk)
                        MODEL_FETCH_BYTES.labels(self.scheme).inc(len(chunk))
                        line = self.progress.advance(len(chunk))
                        if line:
                            log.info("%s", line)
                if remote.size is not None and hashes.size < remote.size:
                    raise Transient(f"connection ended at byte {hashes.size} of {remote.size}")
                return hashes  # too long is reported by verification, which discards the file
            except Transient as exc:
                failures = 1 if got else failures + 1
                if self.backoff.exhausted(failures):
                    raise FetchError(
                        f"fetch {self.label}: {remote.name} failed {failures} times in a row with "
                        f"no progress (last: {exc}); check the network path to the source, then "
                        "run again: the download resumes where it stopped",
                        reason="NetworkError",
                    ) from None
                delay = self.backoff.delay(failures)
                log.warning(
                    "fetch %s: %s interrupted at byte %d (%s); retry %d/%d in %.1f s",
                    self.label,
                    remote.name,
                    hashes.size,
                    exc,
                    failures,
                    self.backoff.attempts - 1,
                    delay,
                )
                self.sleep(delay)
