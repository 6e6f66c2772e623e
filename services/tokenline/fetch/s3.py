"""s3://: every object under a prefix, with boto3 (AWS, MinIO, Ceph RGW, GCS's XML API).

Credentials come from boto3's usual chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN (from a Secret), a web identity (IRSA), or an instance profile; the endpoint
from the URI or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; the region from the URI or AWS_REGION /
AWS_DEFAULT_REGION. None of them is ever logged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenline.fetch.download import Opener, Stream
from tokenline.fetch.errors import FetchError, Transient
from tokenline.fetch.manifest import RemoteFile, safe_name
from tokenline.fetch.uri import S3URI
from tokenline.fetch.verify import base64_sha256

CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (from a Secret) to keys that may list and "
    "read the bucket, or add ?anonymous=true for a public bucket"
)
_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
    "403",
    "401",
}
_MISSING_CODES = {"NoSuchBucket", "NoSuchKey", "404"}
READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class S3Plan:
    files: list[RemoteFile]
    opener: Opener


def make_client(uri: S3URI, read_timeout: float = 60.0) -> Any:
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    endpoint = (
        uri.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    region = uri.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    # MinIO and most S3-compatible stores serve path-style only; AWS prefers virtual hosts.
    path_style = uri.path_style if uri.path_style is not None else bool(endpoint)
    config = Config(
        s3={"addressing_style": "path" if path_style else "auto"},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=15,
        read_timeout=read_timeout,
        signature_version=UNSIGNED if uri.anonymous else None,
        # Ranged GETs carry no whole-object checksum; the engine verifies the whole file.
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=region or "us-east-1", config=config
    )


def _transient_types() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as be
    from urllib3 import exceptions as ue

    return (
        be.ConnectionError,
        be.HTTPClientError,
        be.ResponseStreamingError,
        be.ReadTimeoutError,
        be.IncompleteReadError,  # the body ended before Content-Length: a cut connection
        ue.HTTPError,
        ConnectionError,
        TimeoutError,
    )


def _error(exc: Exception, uri: S3URI, what: str) -> FetchError | Transient:
    from botocore import exceptions as be

    if isinstance(exc, be.NoCredentialsError | be.PartialCredentialsError):
        return FetchError(
            f"fetch {uri.uri}: no usable S3 credentials; {CREDENTIALS_HINT}", "Unauthorized"
        )
    if isinstance(exc, be.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _AUTH_CODES or status in (401, 403):
            return FetchError(
                f"fetch {uri.uri}: {what}: access denied ({code}); {CREDENTIALS_HINT}",
                reason="Unauthorized",
            )
        if code in _MISSING_CODES or status == 404:
            return FetchError(
                f"fetch {uri.uri}: {what}: not found ({code}); check the bucket, the prefix "
                "and the endpoint",
                reason="NotFound",
            )
        if code in ("PreconditionFailed", "412"):
            return FetchError(
                f"fetch {uri.uri}: {what} changed while it was being downloaded; run again to "
                "fetch the new version",
                reason="IntegrityError",
            )
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
            return Transient(f"S3 {code or status}")
        return FetchError(f"fetch {uri.uri}: {what}: {code or status}", reason="FetchFailed")
    if isinstance(exc, _transient_types()):
        return Transient(f"{type(exc).__name__}: {exc}")
    return FetchError(f"fetch {uri.uri}: {what}: {type(exc).__name__}: {exc}", "FetchFailed")


def _md5_of(etag: str, head: dict) -> str | None:
    """A single-part, unencrypted object's ETag is its MD5; multipart (-N) and SSE-KMS/SSE-C
    ETags are not, and are then only used to pin the version."""
    if "-" in etag or len(etag) != 32 or head.get("ServerSideEncryption") == "aws:kms":
        return None
    if head.get("SSECustomerAlgorithm"):
        return None
    return etag.lower()


def plan(uri: S3URI, client: Any) -> S3Plan:
    """List the objects under the prefix and what each must be."""
    prefix = uri.key_prefix
    files: list[RemoteFile] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix)
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    except Exception as exc:
        error = _error(exc, uri, f"listing bucket {uri.bucket}")
        if isinstance(error, Transient):
            raise FetchError(
                f"fetch {uri.uri}: cannot reach the object store ({error}); check the endpoint "
                "and the network path",
                reason="NetworkError",
            ) from None
        raise error from None
    for key in keys:
        if key.endswith("/"):
            continue  # a "directory" placeholder some tools create
        name = safe_name(key[len(prefix) :], uri.uri)
        try:
            head = client.head_object(Bucket=uri.bucket, Key=key, ChecksumMode="ENABLED")
        except Exception as exc:
            error = _error(exc, uri, key)
            raise (
                error if isinstance(error, FetchError) else FetchError(str(error), "NetworkError")
            ) from None
        etag = str(head.get("ETag", "")).strip('"')
        files.append(
            RemoteFile(
                name=name,
                size=int(head["ContentLength"]),
                sha256=base64_sha256(head.get("ChecksumSHA256")),
                md5=_md5_of(etag, head),
                etag=etag or None,
                locator=key,
            )
        )
    if not files:
        raise FetchError(
            f"fetch {uri.uri}: no objects under s3://{uri.bucket}/{prefix}; check the prefix (it "
            "names a directory of model files) and that the credentials may list it",
            reason="NotFound",
        )

    @contextlib.contextmanager
    def open_from(remote: RemoteFile, offset: int) -> Iterator[Stream]:
        args: dict[str, Any] = {"Bucket": uri.bucket, "Key": remote.locator}
        if remote.etag:
            args["IfMatch"] = remote.etag  # a resumed range must come from the same version
        if offset:
            args["Range"] = f"bytes={offset}-"
        try:
            response = client.get_object(**args)
        except Exception as exc:
            code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code", "")
            if code == "InvalidRange" and remote.size == offset:
                yield Stream(offset, iter(()))
                return
            raise _error(exc, uri, remote.locator) from None
        body = response["Body"]
        start = 0
        content_range = response.get("ContentRange") or ""
        if content_range.startswith("bytes "):
            start = int(content_range[6:].split("-", 1)[0])
        try:
            # Small reads: a read that a cut interrupts loses what it had gathered.
            yield Stream(start, body.iter_chunks(READ_SIZE))
        except Exception as exc:
            if isinstance(exc, FetchError | Transient):
                raise
            raise _error(exc, uri, remote.locator) from None
        finally:
            body.close()

    return S3Plan(files=files, opener=open_from)
