"""Model URIs, one type per scheme, and what the rest of the fetch asks of them (a name fit
for logs, a cache directory name). No I/O; `tokenline.fetch.parse` turns text into them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit, urlunsplit


class _NoSecrets:
    """A URI with nothing secret in it (credentials come from the environment, never in the
    URI): it is its own form for logs. ``HttpsURI`` is the exception."""

    uri: str  # each type's canonical spelling (a property)

    def redacted(self) -> str:
        return self.uri


@dataclass(frozen=True)
class HfURI(_NoSecrets):
    """``hf://org/name[@revision]``: a Hugging Face Hub model repository (or a mirror of it)."""

    repo_id: str
    revision: str | None = None
    scheme: str = "hf"

    @property
    def uri(self) -> str:
        return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class S3URI(_NoSecrets):
    """``s3://bucket/prefix``: every object under the prefix. Options ride in the query:
    ``endpoint`` (MinIO, Ceph, GCS's XML API), ``region``, ``path_style`` (true/false; by default
    path style exactly when an endpoint is given, which is what MinIO needs) and ``anonymous``
    (public buckets). Credentials never do: they come from the environment (a Secret)."""

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str | None = None
    path_style: bool | None = None
    anonymous: bool = False
    scheme: str = "s3"

    @property
    def uri(self) -> str:
        query = []
        if self.endpoint:
            query.append(f"endpoint={self.endpoint}")
        if self.region:
            query.append(f"region={self.region}")
        if self.path_style is not None:
            query.append(f"path_style={str(self.path_style).lower()}")
        if self.anonymous:
            query.append("anonymous=true")
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return base + ("?" + "&".join(query) if query else "")

    @property
    def key_prefix(self) -> str:
        """The listing prefix: ``prefix/``, so ``models/llama`` never matches ``models/llama2``."""
        return f"{self.prefix}/" if self.prefix else ""


@dataclass(frozen=True)
class PvcURI(_NoSecrets):
    """``pvc://claim/path``: a directory on a PersistentVolumeClaim the operator mounts at
    ``<pvc root>/<claim>`` (read-only); the model is read in place, never copied."""

    claim: str
    path: str = ""
    scheme: str = "pvc"

    @property
    def uri(self) -> str:
        return f"pvc://{self.claim}" + (f"/{self.path}" if self.path else "")


@dataclass(frozen=True)
class OciURI(_NoSecrets):
    """``oci://registry/repo:tag`` or ``...@sha256:…``: a model image ("modelcar"). Only parsed
    here: the operator mounts it as an image volume (or copies it out in an init container)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None
    scheme: str = "oci"

    @property
    def reference(self) -> str:
        """The image reference a container runtime pulls: ``registry/repo:tag[@digest]``."""
        ref = f"{self.registry}/{self.repository}"
        if self.tag:
            ref += f":{self.tag}"
        if self.digest:
            ref += f"@{self.digest}"
        return ref

    @property
    def uri(self) -> str:
        return f"oci://{self.reference}"


@dataclass(frozen=True)
class HttpsURI:
    """``https://…`` (or ``http://`` inside a cluster): one tar, tar.gz or zip archive of the
    model directory. ``#sha256=<hex>`` pins its digest (checked before anything is unpacked)."""

    url: str
    sha256: str | None = None
    scheme: str = "https"

    @property
    def uri(self) -> str:
        return self.url + (f"#sha256={self.sha256}" if self.sha256 else "")

    def redacted(self) -> str:
        return redact(self.url)


@dataclass(frozen=True)
class LocalURI(_NoSecrets):
    """A directory on this machine (or ``file:///path``), read in place."""

    path: str
    scheme: str = "local"

    @property
    def uri(self) -> str:
        return self.path


ModelURI = HfURI | S3URI | PvcURI | OciURI | HttpsURI | LocalURI


def redact(url: str) -> str:
    """A URL fit for logs: no user:password, and query values hidden (presigned URLs carry their
    signature there)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    query = "&".join(f"{k}=…" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def cache_name(uri: ModelURI) -> str:
    """A directory name for this model under a shared cache root: readable, and unique per URI
    (a short hash of the canonical URI), so replicas that name the same model meet in the same
    directory and two models never share one."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "--", uri.redacted().split("?", 1)[0]).strip("-.")
    digest = hashlib.sha256(uri.uri.encode()).hexdigest()[:12]
    return f"{readable[:80]}--{digest}"


def is_remote(uri: ModelURI) -> bool:
    """Whether fetching it downloads bytes (the others are read in place or mounted)."""
    return isinstance(uri, HfURI | S3URI | HttpsURI)
