"""``fetch(uri, target)``: deliver a model into a directory, or find it where it already is.

Remote schemes (hf://, s3://, https://) are downloaded into ``target`` under an exclusive lock,
every file verified and renamed into place, and a marker written last. A second fetcher on the
same directory waits for the lock and then finds the marker; a fetcher that finds the marker
first returns at once without touching the network. In-place schemes (a directory, pvc://, a
mounted oci:// image) are checked and described, never copied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tokenline.fetch import archive, httpio, https, lock
from tokenline.fetch.download import Engine
from tokenline.fetch.errors import FetchError, Transient
from tokenline.fetch.manifest import (
    WORK_DIR,
    FileEntry,
    Marker,
    RemoteFile,
    digest_of,
    marker_path,
    read_marker,
    select,
    write_atomic,
)
from tokenline.fetch.progress import Progress, human_bytes
from tokenline.fetch.retry import Backoff
from tokenline.fetch.storage import check_free_space, disk_error, ensure_dir
from tokenline.fetch.uri import (
    S3URI,
    HfURI,
    HttpsURI,
    LocalURI,
    ModelURI,
    OciURI,
    PvcURI,
    parse_uri,
)

log = logging.getLogger("tokenline.fetch")

DEFAULT_PVC_ROOT = "/mnt/pvc"
JOURNAL = "verified.jsonl"
T = TypeVar("T")


@dataclass(frozen=True)
class FetchResult:
    """Where the model is and what it is; ``status()`` is the operator's ``status.model``."""

    uri: str  # redacted: safe to log and to put in a status
    scheme: str
    path: Path  # the directory to load the model from
    revision: str | None  # the Hub commit the files come from
    digest: str | None  # sha256 over the files (or the archive), "sha256:..."
    size: int
    files: tuple[FileEntry, ...]
    downloaded: int = 0  # bytes received in this call
    cached: bool = False  # the model was complete already: nothing was fetched
    in_place: bool = False  # read where it is (a directory, pvc://, a mounted oci:// image)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"uri": self.uri, "state": "Ready", "size": self.size}
        if self.revision:
            body["revision"] = self.revision
        if self.digest:
            body["digest"] = self.digest
        return body


def fetch(
    uri: str | ModelURI,
    target: Path | str | None = None,
    *,
    force: bool = False,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    lock_timeout: float = 6 * 3600.0,
    progress_interval: float = 5.0,
    read_timeout: float = 60.0,
    backoff: Backoff | None = None,
    hf_endpoint: str | None = None,
    hf_token: str | None = None,
    pvc_root: Path | str | None = None,
    oci_mount: Path | str | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> FetchResult:
    """Deliver the model named by ``uri``; raise FetchError (with ``.reason``) when it cannot be.

    ``target`` is required for hf://, s3:// and https://, and ignored for in-place schemes.
    ``force`` fetches again even when a complete model is there. ``include``/``exclude`` are
    globs on file names (hf:// and s3://). ``pvc_root`` is where claims are mounted
    (TOKENLINE_PVC_ROOT, default /mnt/pvc: pvc://claim/path is <root>/claim/path);
    ``oci_mount`` is where the operator mounted the image (TOKENLINE_OCI_MOUNT).
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    if isinstance(parsed, LocalURI | PvcURI | OciURI):
        return _in_place(parsed, pvc_root, oci_mount)
    if target is None:
        raise FetchError(
            f"fetch {parsed.redacted()}: a download needs a target directory (tokenline fetch "
            "URI DIR)",
            reason="InvalidURI",
        )
    target = Path(target).expanduser().absolute()
    label = parsed.redacted()
    ensure_dir(target)
    work = ensure_dir(target / WORK_DIR)

    hit = _complete(target, parsed, parsed.scheme) if not force else None
    if hit:
        log.info("fetch %s: complete in %s already (%s), nothing to do", label, target, hit.digest)
        return hit

    def waiting(holder: str) -> None:
        log.info(
            "fetch %s: another fetcher (%s) is writing %s; waiting for it", label, holder, target
        )

    with lock.exclusive(work / "lock", lock_timeout, on_wait=waiting, clock=clock):
        hit = _complete(target, parsed, parsed.scheme) if not force else None
        if hit:
            log.info("fetch %s: completed by the other fetcher (%s)", label, hit.digest)
            return hit
        _clear_marker(target, parsed, force)
        session = _Session(
            parsed,
            target,
            work,
            progress_interval,
            read_timeout,
            backoff or Backoff(),
            clock,
            sleep,
        )
        if isinstance(parsed, HttpsURI):
            return session.archive()
        return session.files(hf_endpoint, hf_token, include, exclude)


def _complete(target: Path, uri: ModelURI, scheme: str) -> FetchResult | None:
    marker = read_marker(target)
    if marker is None or marker.uri != uri.uri or not marker.intact_in(target):
        return None
    return FetchResult(
        uri=uri.redacted(),
        scheme=scheme,
        path=target,
        revision=marker.revision,
        digest=marker.digest,
        size=marker.size,
        files=marker.files,
        cached=True,
    )


def _clear_marker(target: Path, uri: ModelURI, force: bool) -> None:
    """Before writing: the marker goes first, so a crash mid-fetch leaves no complete model.
    Another model's directory is only reused when asked (its files are then removed)."""
    marker = read_marker(target)
    if marker is None:
        return
    if marker.uri != uri.uri:
        if not force:
            raise FetchError(
                f"{target} holds another model ({marker.uri}); give each model its own "
                "directory, or pass --force to replace it",
                reason="InvalidURI",
            )
        for entry in marker.files:
            with contextlib.suppress(OSError):
                (target / entry.name).unlink()
    try:
        marker_path(target).unlink(missing_ok=True)
        (target / WORK_DIR / JOURNAL).unlink(missing_ok=True)
    except OSError as exc:
        raise disk_error(exc, marker_path(target), "cannot remove the old marker") from exc


@dataclass
class _Session:
    uri: HfURI | S3URI | HttpsURI
    target: Path
    work: Path
    progress_interval: float
    read_timeout: float
    backoff: Backoff
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    @property
    def label(self) -> str:
        return self.uri.redacted()

    def retrying(self, what: str, call: Callable[[], T]) -> T:
        """Metadata calls (a HEAD) get the same bounded retries as the bytes."""
        failures = 0
        while True:
            try:
                return call()
            except Transient as exc:
                failures += 1
                if self.backoff.exhausted(failures):
                    raise FetchError(
                        f"fetch {self.label}: {what} failed {failures} times ({exc}); check the "
                        "network path to the source",
                        reason="NetworkError",
                    ) from None
                self.sleep(self.backoff.delay(failures))

    def engine(self, total: int | None) -> Engine:
        progress = Progress(self.label, total, self.progress_interval, self.clock)
        partial = ensure_dir(self.work / "partial")
        return Engine(self.label, self.uri.scheme, partial, progress, self.backoff, self.sleep)

    def files(
        self,
        hf_endpoint: str | None,
        hf_token: str | None,
        include: Sequence[str] | None,
        exclude: Sequence[str] | None,
    ) -> FetchResult:
        revision = None
        http = None
        try:
            if isinstance(self.uri, HfURI):
                from tokenline.fetch import hf

                hf_plan = hf.plan(self.uri, hf_endpoint, hf_token, self.backoff, self.sleep)
                revision, listed = hf_plan.revision, hf_plan.files
                http = httpio.client(self.read_timeout)
                opener = httpio.opener(http, hf_plan.headers, self.label, hf.AUTH_HINT)
            else:
                from tokenline.fetch import s3

                s3_plan = s3.plan(self.uri, s3.make_client(self.uri, self.read_timeout))
                listed, opener = s3_plan.files, s3_plan.opener
            wanted = select(listed, include, exclude)
            if not wanted:
                raise FetchError(
                    f"fetch {self.label}: no file matches the include/exclude patterns",
                    reason="NotFound",
                )
            return self._download(wanted, opener, revision)
        finally:
            if http is not None:
                http.close()

    def _download(self, wanted: list[RemoteFile], opener, revision: str | None) -> FetchResult:
        journal = self._journal()
        done: dict[str, FileEntry] = {}
        for f in wanted:
            entry = journal.get((f.name, f.identity))
            with contextlib.suppress(OSError):
                if entry and (self.target / f.name).stat().st_size == entry.size:
                    done[f.name] = entry
        total = sum(f.size or 0 for f in wanted)
        todo = [f for f in wanted if f.name not in done]
        check_free_space(self.target, sum(f.size or 0 for f in todo), self.label)
        log.info(
            "fetch %s: %d files, %s%s into %s%s",
            self.label,
            len(wanted),
            human_bytes(total),
            f" at revision {revision}" if revision else "",
            self.target,
            f" ({len(done)} verified by an earlier run)" if done else "",
        )
        engine = self.engine(total)
        engine.progress.skip(sum(e.size for e in done.values()))
        for f in todo:
            entry = engine.fetch_file(f, self.target / f.name, opener)
            done[f.name] = entry
            self._journal_add(f, entry)
        entries = tuple(done[f.name] for f in wanted)
        return self._finish(entries, revision, digest_of(entries), engine.progress)

    def archive(self) -> FetchResult:
        assert isinstance(self.uri, HttpsURI)
        http = httpio.client(self.read_timeout)
        try:
            remote = self.retrying("HEAD", lambda: https.describe(self.uri, http))
            if remote.size is not None:
                # The archive and what it unpacks to are both on disk for a while.
                check_free_space(self.target, 2 * remote.size, self.label)
            log.info(
                "fetch %s: one archive, %s, into %s",
                self.label,
                human_bytes(remote.size) if remote.size is not None else "size unknown",
                self.target,
            )
            engine = self.engine(remote.size)
            downloaded = self.work / "archive"
            opener = httpio.opener(http, lambda: {}, self.label, https.AUTH_HINT)
            entry = engine.fetch_file(remote, downloaded, opener)
        finally:
            http.close()
        log.info("fetch %s: archive verified (sha256 %s); unpacking", self.label, entry.sha256)
        root = archive.unpack(downloaded, self.work / "staging", self.label)
        entries = tuple(archive.move_into(root, self.target))
        if not entries:
            raise FetchError(f"fetch {self.label}: the archive is empty", reason="NotFound")
        result = self._finish(entries, None, f"sha256:{entry.sha256}", engine.progress)
        with contextlib.suppress(OSError):
            downloaded.unlink()
            shutil.rmtree(self.work / "staging")
        return result

    def _finish(
        self, entries: tuple[FileEntry, ...], revision: str | None, digest: str, progress: Progress
    ) -> FetchResult:
        size = sum(e.size for e in entries)
        marker = Marker(self.uri.uri, revision, digest, size, entries)
        try:
            write_atomic(marker_path(self.target), marker.to_json())
        except OSError as exc:
            raise disk_error(exc, marker_path(self.target), "cannot write the marker") from exc
        with contextlib.suppress(OSError):
            (self.work / JOURNAL).unlink(missing_ok=True)
            shutil.rmtree(self.work / "partial", ignore_errors=True)
        log.info("%s; model ready in %s (%s)", progress.summary(), self.target, digest)
        return FetchResult(
            uri=self.label,
            scheme=self.uri.scheme,
            path=self.target,
            revision=revision,
            digest=digest,
            size=size,
            files=entries,
            downloaded=progress.received,
        )

    def _journal(self) -> dict[tuple[str, str], FileEntry]:
        """Files an interrupted earlier run verified and moved into place: kept, not fetched
        again (the journal is only trusted for this URI)."""
        found: dict[tuple[str, str], FileEntry] = {}
        try:
            lines = (self.work / JOURNAL).read_text().splitlines()
        except OSError:
            return found
        for line in lines:
            try:
                row = json.loads(line)
                if row["uri"] == self.uri.uri:
                    found[(row["name"], row["identity"])] = FileEntry(
                        row["name"], int(row["size"]), row["sha256"]
                    )
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        return found

    def _journal_add(self, remote: RemoteFile, entry: FileEntry) -> None:
        row = {
            "uri": self.uri.uri,
            "name": entry.name,
            "identity": remote.identity,
            "size": entry.size,
            "sha256": entry.sha256,
        }
        try:
            with open(self.work / JOURNAL, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise disk_error(exc, self.work / JOURNAL, "cannot write") from exc


def _in_place(uri: LocalURI | PvcURI | OciURI, pvc_root, oci_mount) -> FetchResult:
    if isinstance(uri, OciURI):
        mount = oci_mount or os.environ.get("TOKENLINE_OCI_MOUNT")
        if not mount:
            raise FetchError(
                f"{uri.uri}: an OCI model image is mounted by the operator (an image volume, or "
                "an init container that copies it out); tokenline fetch does not pull images. "
                "Outside Kubernetes: podman create IMAGE; podman cp ID:/models DIR; then use DIR",
                reason="NotSupported",
            )
        path = Path(mount)
        where = f"{uri.uri} (mounted at {path})"
    elif isinstance(uri, PvcURI):
        root = Path(pvc_root or os.environ.get("TOKENLINE_PVC_ROOT") or DEFAULT_PVC_ROOT)
        path = root / uri.claim / uri.path
        where = f"{uri.uri} (at {path})"
        if not (root / uri.claim).is_dir():
            raise FetchError(
                f"{where}: claim {uri.claim} is not mounted at {root / uri.claim}; in a Pod the "
                "operator mounts it, elsewhere set TOKENLINE_PVC_ROOT to where claims are mounted",
                reason="NotFound",
            )
    else:
        path = Path(uri.path).expanduser()
        where = str(path)
    if not path.is_dir():
        raise FetchError(f"{where}: no such directory; check the path", reason="NotFound")
    marker = read_marker(path)
    if marker is None and (path / WORK_DIR).is_dir():
        raise FetchError(
            f"{where} is an incomplete download (no completion marker); run tokenline fetch "
            "again with the same URI and directory to finish it",
            reason="Incomplete",
        )
    if marker is not None:
        if not marker.intact_in(path):
            raise FetchError(
                f"{where}: files listed in its marker are missing or changed size; fetch it again",
                reason="Incomplete",
            )
        files, revision, digest = marker.files, marker.revision, marker.digest
    else:
        files = tuple(
            FileEntry(p.relative_to(path).as_posix(), p.stat().st_size)
            for p in sorted(path.rglob("*"))
            if p.is_file()
        )
        revision, digest = None, None
    return FetchResult(
        uri=uri.redacted(),
        scheme=uri.scheme,
        path=path.resolve(),
        revision=revision,
        digest=digest,
        size=sum(f.size for f in files),
        files=files,
        cached=True,
        in_place=True,
    )
