"""s3:// against moto's S3 server on loopback, path-style, credentials from the environment."""

from __future__ import annotations

import hashlib
import logging

import boto3
import pytest
from botocore.config import Config
from fetch_servers import FAST, CuttingProxy, model_files, sha256_b64

from tokenline.fetch import FetchError, fetch, parse_uri, read_marker
from tokenline.fetch import s3 as s3_source
from tokenline.fetch.verify import base64_sha256


def bucket(endpoint: str, name: str, files: dict[str, bytes], prefix: str, sha: bool):
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    s3.create_bucket(Bucket=name)
    for key, body in files.items():
        extra = {"ChecksumSHA256": sha256_b64(body)} if sha else {}
        s3.put_object(Bucket=name, Key=f"{prefix}/{key}", Body=body, **extra)
    s3.put_object(Bucket=name, Key=f"{prefix}2/config.json", Body=b"{}")  # a sibling prefix
    return s3


@pytest.mark.parametrize("sha", [True, False], ids=["checksum-sha256", "etag-md5"])
def test_a_prefix_is_fetched_and_verified(s3_env, tmp_path, sha, caplog):
    files = model_files(b"s3")
    name = f"models-{'sha' if sha else 'md5'}"
    bucket(s3_env, name, files, "qwen/v1", sha)

    with caplog.at_level(logging.DEBUG):
        result = fetch(f"s3://{name}/qwen/v1?endpoint={s3_env}", tmp_path / "m", backoff=FAST)

    assert sorted(f.name for f in result.files) == sorted(files)  # not qwen/v12's
    for key, body in files.items():
        assert (tmp_path / "m" / key).read_bytes() == body
    shard = next(f for f in result.files if f.name == "model.safetensors")
    assert shard.sha256 == hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert read_marker(tmp_path / "m").uri == f"s3://{name}/qwen/v1?endpoint={s3_env}"
    assert "s3cr3t-never-logged" not in caplog.text
    # What the store promised, and so what was checked: the single-part ETag (MD5) always, the
    # x-amz-checksum-sha256 when the uploader stored one.
    uri = parse_uri(f"s3://{name}/qwen/v1?endpoint={s3_env}")
    listed = {f.name: f for f in s3_source.plan(uri, s3_source.make_client(uri)).files}
    remote = listed["model.safetensors"]
    assert remote.md5 == hashlib.md5(files["model.safetensors"]).hexdigest()
    # moto 5.2 keeps the checksum but does not return it on HEAD (S3 and MinIO do); the test
    # below makes the HEAD carry one.
    assert remote.sha256 in (None, shard.sha256)


@pytest.mark.parametrize("good", [True, False])
def test_x_amz_checksum_sha256_is_checked(s3_env, tmp_path, monkeypatch, good):
    files = model_files(b"ck")
    bucket(s3_env, f"models-ck-{str(good).lower()}", files, "m", sha=False)
    real = s3_source.make_client

    def client_whose_head_states_a_checksum(uri, read_timeout=60.0):
        client = real(uri, read_timeout)

        def add_checksum(http_response, parsed, **_):
            body = files[http_response.url.split("?")[0].rsplit("/m/", 1)[1]]
            parsed["ChecksumSHA256"] = sha256_b64(body if good else body + b"!")

        # What S3 and MinIO send for an object uploaded with a SHA-256 checksum.
        client.meta.events.register("after-call.s3.HeadObject", add_checksum)
        return client

    monkeypatch.setattr(s3_source, "make_client", client_whose_head_states_a_checksum)
    monkeypatch.setattr(s3_source, "_md5_of", lambda etag, head: None)  # the checksum alone
    uri = f"s3://models-ck-{str(good).lower()}/m?endpoint={s3_env}"
    if good:
        result = fetch(uri, tmp_path / "m", backoff=FAST)
        assert result.size == sum(map(len, files.values()))
    else:
        with pytest.raises(FetchError, match="sha256") as info:
            fetch(uri, tmp_path / "m", backoff=FAST)
        assert info.value.reason == "IntegrityError"
        assert read_marker(tmp_path / "m") is None


def test_checksums_that_are_not_content_digests_are_not_used():
    body = b"x" * 10
    assert base64_sha256(sha256_b64(body)) == hashlib.sha256(body).hexdigest()
    assert base64_sha256(sha256_b64(body) + "-3") is None  # multipart composite
    md5 = hashlib.md5(body).hexdigest()
    assert s3_source._md5_of(md5, {}) == md5
    assert s3_source._md5_of(md5 + "-2", {}) is None  # multipart ETag
    assert s3_source._md5_of(md5, {"ServerSideEncryption": "aws:kms"}) is None


def test_the_object_store_digest_is_checked(s3_env, tmp_path, monkeypatch):
    files = model_files(b"x")
    s3 = bucket(s3_env, "models-tamper", files, "m", sha=False)
    real_plan = s3_source.plan

    def plan_then_tamper(uri, client):
        planned = real_plan(uri, client)
        # The object changes between listing and download: its ETag no longer matches.
        s3.put_object(Bucket="models-tamper", Key="m/tokenizer.json", Body=b"tampered")
        return planned

    monkeypatch.setattr(s3_source, "plan", plan_then_tamper)
    with pytest.raises(FetchError) as info:
        fetch(f"s3://models-tamper/m?endpoint={s3_env}", tmp_path / "m", backoff=FAST)
    assert info.value.reason == "IntegrityError"
    assert read_marker(tmp_path / "m") is None


def test_a_cut_object_resumes_with_a_ranged_get(s3_env, tmp_path):
    files = model_files(b"cut", shard=900_000)
    bucket(s3_env, "models-cut", files, "m", sha=True)
    proxy = CuttingProxy(s3_env, after=300_000, times=2)
    try:
        result = fetch(f"s3://models-cut/m?endpoint={proxy.url}", tmp_path / "m", backoff=FAST)
    finally:
        proxy.close()
    assert proxy.cuts == 2
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == files["model.safetensors"]
    # Resumed, not restarted: about the shard's size went over the wire, not two or three times.
    assert result.downloaded < sum(map(len, files.values())) + 2 * 64 * 1024


def test_missing_prefix_and_bad_credentials_say_what_to_do(s3_env, tmp_path, monkeypatch):
    bucket(s3_env, "models-empty", {"config.json": b"{}"}, "there", sha=False)
    with pytest.raises(FetchError, match="no objects under s3://models-empty/nothere/") as info:
        fetch(f"s3://models-empty/nothere?endpoint={s3_env}", tmp_path / "m", backoff=FAST)
    assert info.value.reason == "NotFound"

    with pytest.raises(FetchError, match="not found") as missing:
        fetch(f"s3://no-such-bucket/m?endpoint={s3_env}", tmp_path / "m", backoff=FAST)
    assert missing.value.reason == "NotFound"

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(FetchError, match="AWS_ACCESS_KEY_ID") as creds:
        fetch(f"s3://models-empty/there?endpoint={s3_env}", tmp_path / "m", backoff=FAST)
    assert creds.value.reason == "Unauthorized"
