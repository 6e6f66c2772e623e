"""https://: one archive. Its digest comes from ``#sha256=`` in the URI, or from what the
server states (x-amz-checksum-sha256 on a presigned S3/MinIO URL, Repr-Digest / Digest sha-256);
its size from Content-Length; its ETag pins the version a resume continues."""

from __future__ import annotations

import re

import httpx

import tokenline.fetch.httpio as httpio
from tokenline.fetch.errors import FetchError
from tokenline.fetch.manifest import RemoteFile
from tokenline.fetch.uri import HttpsURI
from tokenline.fetch.verify import base64_sha256

AUTH_HINT = "the server refused the request; use a URL that needs no credentials (a presigned one)"
_SF_SHA256 = re.compile(r"sha-256=:([A-Za-z0-9+/=]+):", re.IGNORECASE)
_LEGACY_SHA256 = re.compile(r"sha-256=([A-Za-z0-9+/=]+)", re.IGNORECASE)


def stated_sha256(headers: httpx.Headers) -> str | None:
    """A whole-content sha256 the server states, if any."""
    for header, pattern in (("repr-digest", _SF_SHA256), ("digest", _LEGACY_SHA256)):
        m = pattern.search(headers.get(header, ""))
        if m and (digest := base64_sha256(m.group(1))):
            return digest
    return base64_sha256(headers.get("x-amz-checksum-sha256"))


def describe(uri: HttpsURI, http: httpx.Client) -> RemoteFile:
    """The archive as a RemoteFile (a HEAD; a server that refuses HEAD gives no size up front)."""
    label = uri.redacted()
    response = httpio.head(http, uri.url, {})
    size = etag = sha256 = None
    if response is not None:
        if response.status_code >= 400:
            error = httpio.status_error(response, label, "the archive", AUTH_HINT)
            if isinstance(error, FetchError):
                raise error
        else:
            if "content-length" in response.headers and "content-encoding" not in response.headers:
                size = int(response.headers["content-length"])
            etag = response.headers.get("etag")
            sha256 = stated_sha256(response.headers)
    if uri.sha256 and sha256 and uri.sha256 != sha256:
        raise FetchError(
            f"fetch {label}: the URI pins sha256 {uri.sha256} but the server states {sha256}; "
            "fix the #sha256= in the URI or the archive on the server",
            reason="IntegrityError",
        )
    return RemoteFile(
        name="archive", size=size, sha256=uri.sha256 or sha256, etag=etag, locator=uri.url
    )
