"""One fetch of a remote model (hf://, s3://, an https archive): list, download, verify, record.

`tokenline.fetch.api.fetch` checks the target and takes the lock; a `Session` then does the
network part, journalling each verified file so a restarted fetch skips it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import tokenline.fetch.archive as archive
import tokenline.fetch.httpio as httpio
import tokenline.fetch.https as https
from tokenline.fetch.download import Downloader
from tokenline.fetch.errors import FetchError, Transient
from tokenline.fetch.manifest import (
    FileEntry,
    Marker,
    RemoteFile,
    digest_of,
    marker_path,
    select,
    write_atomic,
)
from tokenline.fetch.progress import Progress, human_bytes
from tokenline.fetch.result import FetchResult
from tokenline.fetch.retry import Backoff
from tokenline.fetch.storage import check_free_space, disk_error, ensure_dir
from tokenline.fetch.uri import S3URI, HfURI, HttpsURI

log = logging.getLogger("tokenline.fetch")
JOURNAL = "verified.jsonl"  # in the work folder: the files verified so far, one a line
T = TypeVar("T")


@dataclass
class Session:
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

    def downloader(self, total: int | None) -> Downloader:
        progress = Progress(self.label, total, self.progress_interval, self.clock)
        partial = ensure_dir(self.work / "partial")
        return Downloader(self.label, self.uri.scheme, partial, progress, self.backoff, self.sleep)

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
                import tokenline.fetch.hf as hf

                hf_plan = hf.plan(self.uri, hf_endpoint, hf_token, self.backoff, self.sleep)
                revision, listed = hf_plan.revision, hf_plan.files
                http = httpio.client(self.read_timeout)
                opener = httpio.opener(http, hf_plan.headers, self.label, hf.AUTH_HINT)
            else:
                import tokenline.fetch.s3 as s3

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
        downloader = self.downloader(total)
        downloader.progress.skip(sum(e.size for e in done.values()))
        for f in todo:
            entry = downloader.fetch_file(f, self.target / f.name, opener)
            done[f.name] = entry
            self._journal_add(f, entry)
        entries = tuple(done[f.name] for f in wanted)
        return self._finish(entries, revision, digest_of(entries), downloader.progress)

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
            downloader = self.downloader(remote.size)
            downloaded = self.work / "archive"
            opener = httpio.opener(http, lambda: {}, self.label, https.AUTH_HINT)
            entry = downloader.fetch_file(remote, downloaded, opener)
        finally:
            http.close()
        log.info("fetch %s: archive verified (sha256 %s); unpacking", self.label, entry.sha256)
        root = archive.unpack(downloaded, self.work / "staging", self.label)
        entries = tuple(archive.move_into(root, self.target))
        if not entries:
            raise FetchError(f"fetch {self.label}: the archive is empty", reason="NotFound")
        result = self._finish(entries, None, f"sha256:{entry.sha256}", downloader.progress)
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
