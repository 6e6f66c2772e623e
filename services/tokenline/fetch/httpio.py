"""Ranged HTTP GETs with httpx: the transport under hf:// and https://."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator

import httpx

from tokenline.fetch.download import Opener, Stream
from tokenline.fetch.errors import FetchError, Transient
from tokenline.fetch.manifest import RemoteFile
from tokenline.fetch.uri import redact

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class _RedactQueries(logging.Filter):
    """httpx logs every request's full URL at INFO; a presigned URL's query is a credential.
    Installed on the "httpx" logger, it hides query values in those records (nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, httpx.URL) for a in record.args):
            record.args = tuple(
                redact(str(a)) if isinstance(a, httpx.URL) and a.query else a for a in record.args
            )
        return True


if not any(isinstance(f, _RedactQueries) for f in logging.getLogger("httpx").filters):
    logging.getLogger("httpx").addFilter(_RedactQueries())


def client(read_timeout: float = 60.0) -> httpx.Client:
    """A client for model files. The read timeout turns a stalled connection (no byte for a
    minute) into a retry instead of a download that hangs forever. httpx drops the
    Authorization header on a redirect to another host (the Hub redirects to its CDN)."""
    return httpx.Client(
        follow_redirects=True,
        timeout=httpx.Timeout(connect=15.0, read=read_timeout, write=60.0, pool=15.0),
        headers={"Accept-Encoding": "identity"},  # sizes and hashes are of the raw bytes
    )


def status_error(
    response: httpx.Response, label: str, name: str, auth_hint: str
) -> FetchError | Transient:
    """Map an unwanted status to a retry or to a FetchError with advice. The URL is not
    quoted: a presigned one carries its signature."""
    code = response.status_code
    if code in RETRYABLE:
        return Transient(f"HTTP {code}")
    if code in (401, 403):
        return FetchError(
            f"fetch {label}: {name}: HTTP {code}, access denied; {auth_hint}", "Unauthorized"
        )
    if code in (404, 410):
        return FetchError(
            f"fetch {label}: {name}: HTTP {code}, not found; check the URI (and the revision)",
            reason="NotFound",
        )
    return FetchError(f"fetch {label}: {name}: unexpected HTTP {code}", reason="FetchFailed")


def opener(
    http: httpx.Client,
    headers: Callable[[], dict[str, str]],
    label: str,
    auth_hint: str,
) -> Opener:
    """An Opener that GETs ``remote.locator`` from an offset with a Range header (and If-Range
    with the object's ETag, so a changed object is sent whole instead of spliced)."""

    @contextlib.contextmanager
    def open_from(remote: RemoteFile, offset: int) -> Iterator[Stream]:
        h = dict(headers())
        if offset:
            h["Range"] = f"bytes={offset}-"
            if remote.etag and not remote.etag.startswith("W/"):
                h["If-Range"] = remote.etag
        try:
            with http.stream("GET", remote.locator, headers=h) as response:
                if response.status_code == 416 and remote.size == offset:
                    yield Stream(offset, iter(()))  # already whole
                    return
                if response.status_code not in (200, 206):
                    raise status_error(response, label, remote.name, auth_hint)
                start = 0
                if response.status_code == 206:
                    m = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
                    if not m:
                        raise Transient("206 without a usable Content-Range")
                    start = int(m.group(1))
                # No chunk size: httpx holds bytes back until a chunk fills; a cut loses them.
                yield Stream(start, response.iter_raw())
        except httpx.TransportError as exc:  # connect, read timeout, a body cut short
            raise Transient(f"{type(exc).__name__}: {exc}") from None

    return open_from


def head(http: httpx.Client, url: str, headers: dict[str, str]) -> httpx.Response | None:
    """A HEAD, or None when the server does not answer HEAD usefully (some do not)."""
    try:
        response = http.head(url, headers=headers)
    except httpx.TransportError as exc:
        raise Transient(f"{type(exc).__name__}: {exc}") from None
    if response.status_code in (405, 501):
        return None
    return response
