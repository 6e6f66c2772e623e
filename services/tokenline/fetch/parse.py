"""Model URIs parsed and validated, no I/O.

The same parser serves the CLI (`tokenline fetch`, `--model`), the operator (to reject a bad
``spec.model.uri`` before it becomes a crash-looping pod) and the fetcher, so a URI means one
thing everywhere. Every error names the URI part that is wrong and shows a working example.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from tokenline.fetch.errors import InvalidURI
from tokenline.fetch.uri import (
    S3URI,
    HfURI,
    HttpsURI,
    LocalURI,
    ModelURI,
    OciURI,
    PvcURI,
    redact,
)

SCHEMES = ("hf", "s3", "pvc", "oci", "https", "http", "file")

EXAMPLES = {
    "hf": "hf://Qwen/Qwen3-0.6B@main",
    "s3": "s3://models/qwen3-0.6b?endpoint=http://minio.storage:9000",
    "pvc": "pvc://model-store/qwen3-0.6b",
    "oci": "oci://ghcr.io/acme/qwen3-0.6b:v1",
    "https": "https://models.example.com/qwen3-0.6b.tar.gz#sha256=<64 hex digits>",
}

# Hub ids: an optional namespace and a name, each [A-Za-z0-9._-] and at most 96 characters.
_HF_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
# A git revision: a branch, tag or commit; branch names may hold "/" (refs/pr/1).
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
# S3 bucket naming rules (MinIO and GCS's XML API accept the same names).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# A Kubernetes object name (DNS-1123 subdomain), which a PersistentVolumeClaim's name is.
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# The OCI distribution spec's grammar for repository path components, tags and digests.
_OCI_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_OCI_REGISTRY = re.compile(
    r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::\d{1,5})?$"
)
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

_S3_OPTIONS = ("endpoint", "region", "path_style", "anonymous")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bad(value: str, what: str, scheme: str | None = None) -> InvalidURI:
    shown = redact(value) if scheme in ("http", "https") else value
    hint = f"; for example {EXAMPLES[scheme]}" if scheme in EXAMPLES else ""
    return InvalidURI(f"model URI {shown!r}: {what}{hint}")


def parse_uri(value: str) -> ModelURI:
    """Parse and validate a model URI; raise InvalidURI naming what is wrong and how to fix it.

    A value without a scheme is a local directory (whether it exists is checked when fetching;
    ``tiny`` is the caller's to handle before this).
    """
    if not isinstance(value, str) or not value.strip():
        raise InvalidURI(
            "model URI is empty; give hf://, s3://, pvc://, oci://, https:// or a path"
        )
    value = value.strip()
    if "://" not in value:
        return LocalURI(path=value)
    scheme = value.split("://", 1)[0].lower()
    if scheme == "hf":
        return _parse_hf(value)
    if scheme == "s3":
        return _parse_s3(value)
    if scheme == "pvc":
        return _parse_pvc(value)
    if scheme == "oci":
        return _parse_oci(value)
    if scheme in ("https", "http"):
        return _parse_https(value)
    if scheme == "file":
        path = urlsplit(value).path
        if not path:
            raise _bad(value, "a file:// URI needs an absolute path, as in file:///models/qwen3")
        return LocalURI(path=path)
    hint = ""
    if scheme in ("gs", "gcs"):
        hint = (
            " (Google Cloud Storage: use s3://BUCKET/PREFIX?endpoint=https://storage.googleapis.com"
        )
        hint += " with HMAC keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    raise InvalidURI(
        f"model URI {redact(value)!r}: unknown scheme {scheme!r}{hint}; supported: "
        "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM/PATH, oci://REGISTRY/REPO:TAG, "
        "https://HOST/ARCHIVE.tar.gz, or a local directory"
    )


def _parse_hf(value: str) -> HfURI:
    rest = value[len("hf://") :]
    if "?" in rest or "#" in rest:
        raise _bad(value, "hf:// takes no query or fragment; pin a revision with @REVISION", "hf")
    repo_id, _, revision = rest.partition("@")
    repo_id = repo_id.strip("/")
    parts = repo_id.split("/")
    if not repo_id or len(parts) > 2 or not all(_HF_PART.match(p) for p in parts):
        raise _bad(
            value,
            "expected hf://ORG/NAME (letters, digits, '.', '_' and '-', at most 96 each)",
            "hf",
        )
    if "--" in repo_id or ".." in repo_id:
        raise _bad(value, "'--' and '..' are not allowed in a Hub repository id", "hf")
    if "@" in value[len("hf://") :] and not revision:
        raise _bad(
            value, "nothing after '@': give a branch, tag or commit sha, or drop the '@'", "hf"
        )
    if revision and (not _HF_REVISION.match(revision) or ".." in revision):
        raise _bad(value, f"revision {revision!r} is not a valid branch, tag or commit", "hf")
    return HfURI(repo_id=repo_id, revision=revision or None)


def _flag(value: str, key: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _bad(value, f"{key}={raw!r} must be true or false", "s3")


def _parse_s3(value: str) -> S3URI:
    parts = urlsplit(value)
    if "@" in parts.netloc:
        raise InvalidURI(
            "model URI s3://…: credentials do not belong in the URI (it is logged and stored in "
            "the resource spec); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the "
            "environment, from a Secret"
        )
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise _bad(
            value,
            f"bucket {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.', '-')",
            "s3",
        )
    if parts.fragment:
        raise _bad(value, "s3:// takes no #fragment", "s3")
    prefix = parts.path.strip("/")
    _check_relative(value, prefix, "s3")
    options: dict[str, str] = {}
    for key, raw in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _S3_OPTIONS:
            if key.lower() in (
                "access_key",
                "secret_key",
                "aws_access_key_id",
                "token",
                "password",
            ):
                raise InvalidURI(
                    f"model URI s3://{bucket}/…: {key} does not belong in the URI; set "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (from a Secret) instead"
                )
            raise _bad(value, f"unknown option {key!r}; allowed: {', '.join(_S3_OPTIONS)}", "s3")
        options[key] = raw
    endpoint = options.get("endpoint") or None
    if endpoint is not None:
        ep = urlsplit(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise _bad(value, f"endpoint {endpoint!r} must be an http:// or https:// URL", "s3")
        if ep.username or ep.password:
            raise InvalidURI(
                "model URI s3://…: the endpoint must not carry credentials; set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (from a Secret) instead"
            )
    region = options.get("region") or None
    if region is not None and not re.match(r"^[a-z0-9-]{1,64}$", region):
        raise _bad(value, f"region {region!r} is not a region name such as us-east-1", "s3")
    path_style = (
        _flag(value, "path_style", options["path_style"]) if "path_style" in options else None
    )
    anonymous = _flag(value, "anonymous", options["anonymous"]) if "anonymous" in options else False
    return S3URI(bucket, prefix, endpoint, region, path_style, anonymous)


def _check_relative(value: str, path: str, scheme: str) -> None:
    if not path:
        return
    segments = PurePosixPath(path).parts
    if any(s in ("..", ".") for s in segments) or "//" in path or "\\" in path:
        raise _bad(value, f"path {path!r} must not contain '.', '..', '//' or '\\'", scheme)


def _parse_pvc(value: str) -> PvcURI:
    parts = urlsplit(value)
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise _bad(value, "pvc:// takes only a claim name and a path", "pvc")
    claim = parts.netloc
    if not claim or len(claim) > 253 or not _DNS1123.match(claim):
        raise _bad(
            value,
            f"claim {claim!r} is not a claim name (lowercase letters, digits, '-', '.')",
            "pvc",
        )
    path = parts.path.strip("/")
    _check_relative(value, path, "pvc")
    return PvcURI(claim=claim, path=path)


def _parse_oci(value: str) -> OciURI:
    rest = value[len("oci://") :]
    if "?" in rest or "#" in rest:
        raise _bad(value, "oci:// takes an image reference only", "oci")
    ref, _, digest = rest.partition("@")
    if digest and not _OCI_DIGEST.match(digest):
        raise _bad(value, f"digest {digest!r} must be sha256: and 64 lowercase hex digits", "oci")
    registry, _, path = ref.partition("/")
    if (
        not path
        or not _OCI_REGISTRY.match(registry)
        or ("." not in registry and ":" not in registry and registry != "localhost")
    ):
        raise _bad(
            value,
            "expected oci://REGISTRY/REPOSITORY:TAG with a registry host such as ghcr.io "
            "(Docker Hub images are docker.io/ORG/NAME)",
            "oci",
        )
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _OCI_TAG.match(tag):
            raise _bad(value, f"tag {tag!r} is not a valid image tag", "oci")
    if not all(_OCI_COMPONENT.match(c) for c in path.split("/")):
        raise _bad(value, f"repository {path!r} must be lowercase path components", "oci")
    if not tag and not digest:
        raise _bad(
            value,
            "give a tag or a digest: an untagged image means 'latest', which lets replicas serve "
            "different models",
            "oci",
        )
    return OciURI(registry=registry, repository=path, tag=tag, digest=digest or None)


def _parse_https(value: str) -> HttpsURI:
    parts = urlsplit(value)
    if not parts.hostname:
        raise _bad(value, "no host", "https")
    if parts.username or parts.password:
        raise InvalidURI(
            f"model URI {redact(value)!r}: credentials do not belong in the URI (it is logged "
            "and stored in the resource spec); use a presigned URL or a mirror without auth"
        )
    sha256 = None
    if parts.fragment:
        key, _, digest = parts.fragment.partition("=")
        if key != "sha256" or not _SHA256_HEX.match(digest.lower()):
            raise _bad(value, "the only fragment allowed is #sha256=<64 hex digits>", "https")
        sha256 = digest.lower()
    if not parts.path or parts.path.endswith("/"):
        raise _bad(
            value,
            "point at one archive (.tar, .tar.gz, .tgz or .zip), not a directory listing",
            "https",
        )
    url = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, parts.query, ""))
    return HttpsURI(url=url, sha256=sha256)
