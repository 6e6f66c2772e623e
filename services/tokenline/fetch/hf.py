"""hf://: what a Hub repository holds at a revision, via huggingface_hub.

huggingface_hub resolves the revision to a commit, lists the files with their sizes, LFS sha256
and git blob ids, reads HF_TOKEN and HF_ENDPOINT (a mirror or a fake Hub), and tells a gated
repository from a missing one. The bytes then go through the shared engine, pinned to the
resolved commit, so every file comes from the same revision and is checked against the Hub's
digest (huggingface_hub's own downloader does not check content digests).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.fetch.errors import FetchError
from tokenline.fetch.manifest import RemoteFile, safe_name
from tokenline.fetch.retry import Backoff
from tokenline.fetch.uri import HfURI

log = logging.getLogger("tokenline.fetch")

AUTH_HINT = (
    "the repository is private or gated: set HF_TOKEN (from a Secret) to a token of an account "
    "that has access (for a gated model, accept its terms on the Hub first)"
)


@dataclass(frozen=True)
class HfPlan:
    revision: str  # the commit sha the files come from
    files: list[RemoteFile]
    headers: Callable[[], dict[str, str]]


def endpoint_from_env() -> str:
    """HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def plan(
    uri: HfURI,
    endpoint: str | None = None,
    token: str | None = None,
    backoff: Backoff | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> HfPlan:
    """Resolve the revision and list the files, retrying transient failures."""
    from huggingface_hub import HfApi, get_token, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    endpoint = (endpoint or endpoint_from_env()).rstrip("/")
    token = token or os.environ.get("HF_TOKEN") or get_token()
    api = HfApi(endpoint=endpoint, token=token or False, library_name="tokenline")
    backoff = backoff or Backoff()
    failures = 0
    while True:
        try:
            info = api.model_info(uri.repo_id, revision=uri.revision, files_metadata=True)
            break
        except Exception as exc:
            error = _classify(exc, uri, endpoint, bool(token))
            if isinstance(error, FetchError):
                raise error from None
            failures += 1
            if backoff.exhausted(failures):
                raise FetchError(
                    f"fetch {uri.uri}: the Hub at {endpoint} did not answer ({error}); check the "
                    "network path or HF_ENDPOINT, then run again",
                    reason="NetworkError",
                ) from None
            log.warning("fetch %s: the Hub did not answer (%s); retrying", uri.uri, error)
            sleep(backoff.delay(failures))

    revision = info.sha
    if not revision:
        raise FetchError(f"fetch {uri.uri}: the Hub gave no commit for the revision", "NotFound")
    files = []
    for sibling in info.siblings or []:
        name = safe_name(sibling.rfilename, uri.uri)
        url = hf_hub_url(uri.repo_id, name, revision=revision, endpoint=endpoint)
        if sibling.lfs is not None:
            files.append(RemoteFile(name, sibling.lfs.size, sha256=sibling.lfs.sha256, locator=url))
        elif sibling.size is not None:
            files.append(RemoteFile(name, sibling.size, git_sha1=sibling.blob_id, locator=url))
        else:
            files.append(_from_headers(name, url, token))
    if not files:
        raise FetchError(f"fetch {uri.uri}: the repository has no files at {revision}", "NotFound")

    def headers() -> dict[str, str]:
        # Built per request, never logged: it carries the token.
        return build_hf_headers(token=token or False, library_name="tokenline")

    return HfPlan(revision=revision, files=files, headers=headers)


def _from_headers(name: str, url: str, token: str | None) -> RemoteFile:
    """A mirror that lists files without sizes: ask the file itself (a HEAD on resolve), whose
    X-Linked-Etag / ETag is the LFS sha256 (64 hex) or the git blob sha1 (40 hex)."""
    from huggingface_hub import get_hf_file_metadata

    meta = get_hf_file_metadata(url, token=token or False)
    etag = (meta.etag or "").strip('"').lower()
    if len(etag) == 64:
        return RemoteFile(name, meta.size, sha256=etag, locator=url)
    if len(etag) == 40:
        return RemoteFile(name, meta.size, git_sha1=etag, locator=url)
    return RemoteFile(name, meta.size, locator=url)


def _classify(exc: Exception, uri: HfURI, endpoint: str, has_token: bool) -> FetchError | str:
    """A FetchError for what retrying cannot fix, else a short description to retry on."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return FetchError(
            f"fetch {uri.uri}: the repository is gated; "
            + (
                "the token in HF_TOKEN has not been granted access: accept the model's terms on "
                "the Hub with that account"
                if has_token
                else "set HF_TOKEN (from a Secret) to a "
                "token of an account that accepted the model's terms"
            ),
            reason="Unauthorized",
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return FetchError(
            f"fetch {uri.uri}: revision {uri.revision!r} does not exist; use a branch, tag or "
            "commit sha of the repository",
            reason="NotFound",
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return FetchError(
            f"fetch {uri.uri}: no repository {uri.repo_id!r} at {endpoint}; check the name, or, "
            + (
                "if it is private, that HF_TOKEN's account can read it"
                if has_token
                else "if it is private, set HF_TOKEN (from a Secret)"
            ),
            reason="NotFound",
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(exc.response, "status_code", None) if exc.response is not None else None
        if status in (401, 403):
            return FetchError(f"fetch {uri.uri}: HTTP {status}; {AUTH_HINT}", "Unauthorized")
        if status is not None and status < 500 and status not in (408, 429):
            return FetchError(f"fetch {uri.uri}: the Hub answered HTTP {status}", "FetchFailed")
        return f"HTTP {status}"
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return FetchError(
            f"fetch {uri.uri}: HF_HUB_OFFLINE is set; unset it to download, or pass a local "
            "directory",
            reason="NotSupported",
        )
    transport = type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "urllib3")
    if transport or isinstance(exc, OSError | TimeoutError):
        return f"{type(exc).__name__}: {exc}"
    return FetchError(f"fetch {uri.uri}: {type(exc).__name__}: {exc}", reason="FetchFailed")
