"""Model URIs: what parses, and what each error tells the user to do. No I/O."""

from __future__ import annotations

import pytest

from tokenline.fetch import InvalidURI, is_remote, parse_uri, redact
from tokenline.fetch.uri import S3URI, HfURI, HttpsURI, LocalURI, OciURI, PvcURI


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hf://Qwen/Qwen3-0.6B", HfURI("Qwen/Qwen3-0.6B")),
        ("hf://Qwen/Qwen3-0.6B@main", HfURI("Qwen/Qwen3-0.6B", "main")),
        ("hf://gpt2@refs/pr/1", HfURI("gpt2", "refs/pr/1")),
        ("s3://models/qwen/v1", S3URI("models", "qwen/v1")),
        (
            "s3://models/q?endpoint=http://minio:9000&region=eu-west-1&path_style=false",
            S3URI("models", "q", "http://minio:9000", "eu-west-1", False),
        ),
        ("s3://public-models/q?anonymous=true", S3URI("public-models", "q", anonymous=True)),
        ("pvc://model-store/qwen3/v1", PvcURI("model-store", "qwen3/v1")),
        ("pvc://model-store", PvcURI("model-store", "")),
        ("oci://ghcr.io/acme/qwen3:v1", OciURI("ghcr.io", "acme/qwen3", "v1")),
        (
            "oci://localhost:5000/qwen3@sha256:" + "a" * 64,
            OciURI("localhost:5000", "qwen3", None, "sha256:" + "a" * 64),
        ),
        ("https://h.example/m.tar.gz", HttpsURI("https://h.example/m.tar.gz")),
        (
            "https://h.example/m.zip#sha256=" + "AB" * 32,
            HttpsURI("https://h.example/m.zip", "ab" * 32),
        ),
        ("/models/qwen3", LocalURI("/models/qwen3")),
        ("file:///models/qwen3", LocalURI("/models/qwen3")),
    ],
)
def test_valid_uris(value, expected):
    assert parse_uri(value) == expected
    assert parse_uri(expected.uri) == expected  # the canonical form parses back to itself


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "empty"),
        ("gs://bucket/m", "storage.googleapis.com"),
        ("ftp://h/m", "unknown scheme 'ftp'"),
        ("hf://a/b/c", "expected hf://ORG/NAME"),
        ("hf://org/name@", "nothing after '@'"),
        ("hf://org/na me", "expected hf://ORG/NAME"),
        ("hf://org/name?x=1", "pin a revision with @REVISION"),
        ("s3://Bad_Bucket/m", "not a bucket name"),
        ("s3://AKID:secret@bucket/m", "AWS_ACCESS_KEY_ID"),
        ("s3://bucket/m?secret_key=x", "AWS_SECRET_ACCESS_KEY"),
        ("s3://bucket/m?endpiont=http://x", "unknown option 'endpiont'"),
        ("s3://bucket/m?endpoint=minio:9000", "must be an http:// or https:// URL"),
        ("s3://bucket/m?path_style=maybe", "must be true or false"),
        ("s3://bucket/a/../b", "must not contain"),
        ("pvc://Model_Store/x", "not a claim name"),
        ("pvc://store/../etc", "must not contain"),
        ("oci://acme/qwen3:v1", "registry host"),
        ("oci://ghcr.io/acme/qwen3", "give a tag or a digest"),
        ("oci://ghcr.io/Acme/qwen3:v1", "lowercase"),
        ("oci://ghcr.io/acme/qwen3@sha256:abc", "64 lowercase hex"),
        ("https://user:pw@h.example/m.tar.gz", "presigned"),
        ("https://h.example/models/", "not a directory listing"),
        ("https://h.example/m.tar.gz#md5=abc", "#sha256="),
    ],
)
def test_invalid_uris_say_what_is_wrong(value, says):
    with pytest.raises(InvalidURI) as info:
        parse_uri(value)
    assert says in str(info.value)
    assert info.value.reason == "InvalidURI"
    assert "secret" not in str(info.value).replace("secret_key", "").replace("SECRET", "")
    assert "pw@" not in str(info.value)


def test_examples_in_errors_parse():
    from tokenline.fetch.parse import EXAMPLES

    for example in EXAMPLES.values():
        parse_uri(example.replace("<64 hex digits>", "0" * 64))


def test_redaction_hides_signatures_and_passwords():
    url = "https://u:p@h.example:8443/m.tar.gz?X-Amz-Signature=abc&X-Amz-Credential=AKID"
    assert redact(url) == "https://h.example:8443/m.tar.gz?X-Amz-Signature=…&X-Amz-Credential=…"
    assert (
        parse_uri("https://h.example/m.tar.gz?sig=abc").redacted()
        == "https://h.example/m.tar.gz?sig=…"
    )


def test_which_schemes_download():
    assert [is_remote(parse_uri(u)) for u in ("hf://a/b", "s3://bkt/p", "https://h/m.zip")] == [
        True
    ] * 3
    assert not any(is_remote(parse_uri(u)) for u in ("pvc://c/p", "oci://r.io/a:1", "/m"))


def test_cache_names_are_readable_and_unique_per_uri():
    from tokenline.fetch import cache_name

    main = cache_name(parse_uri("hf://Qwen/Qwen3-0.6B@main"))
    assert main.startswith("hf--Qwen--Qwen3-0.6B--main--")
    assert main != cache_name(parse_uri("hf://Qwen/Qwen3-0.6B@v2"))
    signed = cache_name(parse_uri("https://h.example/m.tar.gz?sig=SECRET"))
    assert "SECRET" not in signed and "/" not in signed
