"""https:// archives from a real local HTTP server that cuts connections mid-file."""

from __future__ import annotations

import hashlib
import io
import logging
import zipfile

import pytest
from fetch_servers import FAST, model_files, tar_gz

from tokenline.fetch import FetchError, fetch, read_marker
from tokenline.fetch.manifest import WORK_DIR


def test_a_cut_download_resumes_with_range_and_the_sha_matches(file_server, tmp_path):
    files = model_files()
    archive = tar_gz(files)
    sha = hashlib.sha256(archive).hexdigest()
    file_server.file("/m.tar.gz", archive)
    # Dropped twice, a third of the way in each time.
    file_server.cut["/m.tar.gz"] = [len(archive) // 3] * 2

    result = fetch(f"{file_server.url}/m.tar.gz#sha256={sha}", tmp_path / "m", backoff=FAST)

    gets = file_server.gets("/m.tar.gz")
    assert len(gets) == 3
    assert "range" not in gets[0].headers
    assert gets[1].headers["range"] == f"bytes={len(archive) // 3}-"
    assert gets[1].headers["if-range"].startswith('"')  # resumes only the same version
    assert gets[2].status == 206
    assert file_server.bytes_sent("/m.tar.gz") == len(archive)  # no byte sent twice
    assert result.digest == f"sha256:{sha}"
    for name, body in files.items():  # the lone top-level directory is stepped into
        assert (tmp_path / "m" / name).read_bytes() == body
    assert read_marker(tmp_path / "m").digest == f"sha256:{sha}"
    assert not (tmp_path / "m" / WORK_DIR / "archive").exists()


def test_zip_and_a_second_fetch_is_served_from_the_marker(file_server, tmp_path):
    files = model_files(b"z")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, body in files.items():
            zf.writestr(name, body)
    file_server.file("/m.zip", buf.getvalue())

    first = fetch(f"{file_server.url}/m.zip", tmp_path / "m", backoff=FAST)
    served = len(file_server.log)
    second = fetch(f"{file_server.url}/m.zip", tmp_path / "m", backoff=FAST)

    assert not first.cached and second.cached
    assert len(file_server.log) == served  # not one request
    assert second.digest == first.digest and second.size == sum(map(len, files.values()))


def test_a_wrong_digest_leaves_no_marker_and_no_model(file_server, tmp_path):
    archive = tar_gz(model_files())
    file_server.file("/m.tar.gz", archive)

    with pytest.raises(FetchError) as info:
        fetch(f"{file_server.url}/m.tar.gz#sha256={'0' * 64}", tmp_path / "m", backoff=FAST)

    assert info.value.reason == "IntegrityError"
    assert "failed verification" in str(info.value)
    assert read_marker(tmp_path / "m") is None
    assert not (tmp_path / "m" / "config.json").exists()
    # A loader asking for the directory is told it is incomplete, not handed half a model.
    with pytest.raises(FetchError, match="incomplete download"):
        fetch(str(tmp_path / "m"))


def test_a_server_that_ignores_range_restarts_from_zero(file_server, tmp_path):
    from fetch_servers import Reply

    archive = tar_gz(model_files())
    file_server.route("/plain.tar.gz", lambda _h: Reply(200, archive, {}, ranges=False))
    file_server.cut["/plain.tar.gz"] = [len(archive) // 2]

    result = fetch(f"{file_server.url}/plain.tar.gz", tmp_path / "m", backoff=FAST)

    assert result.digest == "sha256:" + hashlib.sha256(archive).hexdigest()
    assert file_server.gets("/plain.tar.gz")[1].status == 200


def test_retries_are_bounded_and_the_error_says_what_to_do(file_server, tmp_path):
    archive = tar_gz(model_files())
    file_server.file("/m.tar.gz", archive)
    file_server.cut["/m.tar.gz"] = [0] * 100  # never sends a byte

    with pytest.raises(FetchError) as info:
        fetch(f"{file_server.url}/m.tar.gz", tmp_path / "m", backoff=FAST)

    assert info.value.reason == "NetworkError"
    assert "resumes where it stopped" in str(info.value)
    assert len(file_server.gets("/m.tar.gz")) == FAST.attempts


def test_presigned_query_and_404_are_not_leaked(file_server, tmp_path, caplog):
    url = f"{file_server.url}/missing.tar.gz?X-Amz-Signature=topsecret&X-Amz-Credential=AKID"

    with caplog.at_level(logging.DEBUG), pytest.raises(FetchError) as info:
        fetch(url, tmp_path / "m", backoff=FAST)

    assert info.value.reason == "NotFound"
    assert "topsecret" not in str(info.value) and "topsecret" not in caplog.text
