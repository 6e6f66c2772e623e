"""``fetch(uri, target)``: deliver a model into a directory, or find it where it already is.

Remote schemes (hf://, s3://, https://) are downloaded into ``target`` under an exclusive lock,
every file verified and renamed into place, and a marker written last. A second fetcher on the
same directory waits for the lock and then finds the marker; a fetcher that finds the marker
first returns at once without touching the network. In-place schemes (a directory, pvc://, a
mounted oci:// image) are checked and described, never copied.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import tokenline.fetch.lock as lock
from tokenline.fetch.errors import FetchError
from tokenline.fetch.manifest import (
    WORK_DIR,
    FileEntry,
    marker_path,
    read_marker,
)
from tokenline.fetch.parse import parse_uri
from tokenline.fetch.result import FetchResult
from tokenline.fetch.retry import Backoff
from tokenline.fetch.session import JOURNAL, Session
from tokenline.fetch.storage import disk_error, ensure_dir
from tokenline.fetch.uri import (
    HttpsURI,
    LocalURI,
    ModelURI,
    OciURI,
    PvcURI,
)

log = logging.getLogger("tokenline.fetch")

DEFAULT_PVC_ROOT = "/mnt/pvc"
T = TypeVar("T")


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
        session = Session(
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
