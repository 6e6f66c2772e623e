"""hf:// against a fake Hub (HF_ENDPOINT) on loopback: revisions, a gated repo, cuts, digests."""

from __future__ import annotations

import hashlib
import logging

import pytest
from fetch_servers import FAST, model_files

from tokenline.fetch import MODEL_FETCH_BYTES, FetchError, fetch, read_marker


def fetched_bytes() -> float:
    return MODEL_FETCH_BYTES.labels("hf")._value.get()


def test_revisions_resolve_to_commits_and_every_file_matches_the_hub(hub, tmp_path):
    main_files, v1_files = model_files(b"main"), model_files(b"v1")
    main_commit = hub.add("acme/tiny", "main", main_files)
    v1_commit = hub.add("acme/tiny", "v1", v1_files)
    before = fetched_bytes()

    latest = fetch("hf://acme/tiny", tmp_path / "latest", backoff=FAST)
    pinned = fetch("hf://acme/tiny@v1", tmp_path / "v1", backoff=FAST)
    by_sha = fetch(f"hf://acme/tiny@{v1_commit}", tmp_path / "sha", backoff=FAST)

    assert latest.revision == main_commit and pinned.revision == v1_commit
    assert by_sha.digest == pinned.digest != latest.digest
    for name, body in v1_files.items():
        assert (tmp_path / "v1" / name).read_bytes() == body
    shard = next(f for f in pinned.files if f.name == "model.safetensors")
    assert shard.sha256 == hashlib.sha256(v1_files["model.safetensors"]).hexdigest()
    assert read_marker(tmp_path / "v1").revision == v1_commit
    # Every file was fetched at the commit, not the moving branch name.
    resolves = [s.path for s in hub.server.log if "/resolve/" in s.path]
    assert all(main_commit in p or v1_commit in p for p in resolves)
    assert fetched_bytes() - before == 2 * sum(map(len, v1_files.values())) + sum(
        map(len, main_files.values())
    )


def test_a_gated_repo_needs_the_token_and_the_token_is_never_logged(
    hub, tmp_path, monkeypatch, caplog
):
    hub.add("acme/gated", "main", model_files())
    hub.gated["acme/gated"] = "hf_granted_token"

    with pytest.raises(FetchError) as no_token:
        fetch("hf://acme/gated", tmp_path / "a", backoff=FAST)
    assert no_token.value.reason == "Unauthorized"
    assert "gated" in str(no_token.value) and "HF_TOKEN" in str(no_token.value)

    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    with pytest.raises(FetchError, match="has not been granted access"):
        fetch("hf://acme/gated", tmp_path / "a", backoff=FAST)

    monkeypatch.setenv("HF_TOKEN", "hf_granted_token")
    with caplog.at_level(logging.DEBUG):
        result = fetch("hf://acme/gated", tmp_path / "a", backoff=FAST, progress_interval=0)
    assert result.size == sum(map(len, model_files().values()))
    assert "hf_granted_token" not in caplog.text
    downloads = [s for s in hub.server.log if "/resolve/" in s.path]
    assert all(s.headers.get("authorization") == "Bearer hf_granted_token" for s in downloads)


def test_a_cut_shard_resumes_and_its_sha_matches(hub, tmp_path):
    files = model_files(shard=600_000)
    commit = hub.add("acme/big", "main", files)
    path = f"/acme/big/resolve/{commit}/model.safetensors"
    hub.server.cut[path] = [250_000]

    result = fetch("hf://acme/big", tmp_path / "m", backoff=FAST)

    gets = hub.server.gets(path)
    assert [g.status for g in gets] == [200, 206]
    assert gets[1].headers["range"] == "bytes=250000-"
    assert hub.server.bytes_sent(path) == len(files["model.safetensors"])
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert result.downloaded == sum(map(len, files.values()))


def test_bytes_that_do_not_match_the_hub_are_refused(hub, tmp_path):
    hub.add("acme/bad", "main", model_files())
    hub.corrupt.add("model.safetensors")  # the LFS sha256 catches it
    with pytest.raises(FetchError) as lfs:
        fetch("hf://acme/bad", tmp_path / "m", backoff=FAST)
    assert lfs.value.reason == "IntegrityError" and "sha256" in str(lfs.value)
    assert read_marker(tmp_path / "m") is None
    assert not (tmp_path / "m" / "model.safetensors").exists()

    hub.corrupt = {"config.json"}  # a non-LFS file: its git blob id catches it
    with pytest.raises(FetchError, match="git blob sha1"):
        fetch("hf://acme/bad", tmp_path / "m", backoff=FAST)


def test_missing_repo_and_revision_say_so(hub, tmp_path):
    hub.add("acme/tiny", "main", model_files())
    with pytest.raises(FetchError, match="revision 'nope' does not exist") as rev:
        fetch("hf://acme/tiny@nope", tmp_path / "m", backoff=FAST)
    assert rev.value.reason == "NotFound"
    with pytest.raises(FetchError, match="no repository 'acme/other'"):
        fetch("hf://acme/other", tmp_path / "m", backoff=FAST)


def test_an_interrupted_fetch_keeps_verified_files_and_progress_is_logged(hub, tmp_path, caplog):
    files = model_files(shard=400_000)
    commit = hub.add("acme/tiny", "main", files)
    shard = f"/acme/tiny/resolve/{commit}/model.safetensors"
    hub.server.cut[shard] = [100_000] + [0] * 10  # then dead: the first run gives up
    with pytest.raises(FetchError, match="resumes where it stopped"):
        fetch("hf://acme/tiny", tmp_path / "m", backoff=FAST)
    assert read_marker(tmp_path / "m") is None
    assert not (tmp_path / "m" / "config.json").exists()  # config.json comes last

    hub.server.cut.clear()
    sent = hub.server.bytes_sent(shard)
    with caplog.at_level(logging.INFO, logger="tokenline.fetch"):
        result = fetch("hf://acme/tiny", tmp_path / "m", backoff=FAST, progress_interval=0)
    # The second run resumed the partial shard and did not fetch generation_config.json again.
    assert hub.server.bytes_sent(shard) - sent == len(files["model.safetensors"]) - sent
    first = f"/acme/tiny/resolve/{commit}/generation_config.json"
    assert len(hub.server.gets(first)) == 1
    assert "verified by an earlier run" in caplog.text
    assert "resuming model.safetensors" in caplog.text
    assert any("/s" in r.message and "%" in r.message for r in caplog.records)
    assert result.digest == read_marker(tmp_path / "m").digest


def test_a_mirror_without_file_metadata_is_checked_against_the_resolve_headers(hub, tmp_path):
    files = model_files(b"mirror")
    hub.add("acme/tiny", "main", files)
    hub.bare = True

    result = fetch("hf://acme/tiny", tmp_path / "m", backoff=FAST)

    assert result.size == sum(map(len, files.values()))
    heads = [s for s in hub.server.log if s.method == "HEAD"]
    assert len(heads) == len(files)  # one HEAD per file for its ETag / X-Linked-Etag and size
    hub.corrupt.add("model.safetensors")
    with pytest.raises(FetchError, match="sha256"):
        fetch("hf://acme/tiny", tmp_path / "again", backoff=FAST)
