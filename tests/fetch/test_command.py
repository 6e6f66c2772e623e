"""`tokenline fetch URI DIR` (main(argv)) and the schemes read in place."""

from __future__ import annotations

import json

import pytest
from fetch_servers import model_files, tar_gz

from tokenline.fetch import FetchError, fetch, main


def test_main_prints_the_result_and_writes_the_termination_message(file_server, tmp_path, capsys):
    file_server.file("/m.tar.gz", tar_gz(model_files()))
    log = tmp_path / "termination-log"

    code = main([f"{file_server.url}/m.tar.gz", str(tmp_path / "m"), "--termination-log", str(log)])

    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["state"] == "Ready" and printed["digest"].startswith("sha256:")
    assert printed["path"] == str(tmp_path / "m") and printed["files"] == 4
    status = json.loads(log.read_text())  # what the operator copies into status.model
    assert status == {k: printed[k] for k in ("uri", "state", "size", "digest")}


def test_main_exit_codes_and_failure_message(tmp_path, capsys):
    log = tmp_path / "termination-log"
    assert main(["s3://Bad_Bucket/x", str(tmp_path / "m"), "--termination-log", str(log)]) == 2
    assert "not a bucket name" in capsys.readouterr().err
    assert json.loads(log.read_text())["reason"] == "InvalidURI"

    assert main(["oci://ghcr.io/acme/m:v1", "--termination-log", str(log)]) == 1
    failed = json.loads(log.read_text())
    assert failed["state"] == "Failed" and failed["reason"] == "NotSupported"
    assert "image volume" in failed["message"]


def test_pvc_oci_and_directories_are_read_in_place(tmp_path, monkeypatch):
    claim = tmp_path / "pvc" / "model-store" / "qwen3"
    claim.mkdir(parents=True)
    (claim / "config.json").write_text("{}")
    monkeypatch.setenv("TOKENLINE_PVC_ROOT", str(tmp_path / "pvc"))

    pvc = fetch("pvc://model-store/qwen3", tmp_path / "unused")
    assert pvc.path == claim and pvc.in_place and pvc.size == 2
    assert not (tmp_path / "unused").exists()  # nothing copied

    with pytest.raises(FetchError, match="claim other is not mounted") as missing:
        fetch("pvc://other/qwen3")
    assert missing.value.reason == "NotFound"
    with pytest.raises(FetchError, match="no such directory"):
        fetch("pvc://model-store/nope")

    oci = fetch("oci://ghcr.io/acme/qwen3:v1", oci_mount=claim)
    assert oci.path == claim and oci.uri == "oci://ghcr.io/acme/qwen3:v1"

    local = fetch(str(claim))
    assert local.files[0].name == "config.json"
    with pytest.raises(FetchError, match="no such directory"):
        fetch(str(tmp_path / "nowhere"))


def test_a_download_needs_a_directory_and_a_directory_holds_one_model(file_server, tmp_path):
    with pytest.raises(FetchError, match="needs a target directory"):
        fetch("hf://acme/tiny")
    file_server.file("/a.tar.gz", tar_gz(model_files(b"a")))
    file_server.file("/b.tar.gz", tar_gz(model_files(b"b")))
    fetch(f"{file_server.url}/a.tar.gz", tmp_path / "m")
    with pytest.raises(FetchError, match="holds another model"):
        fetch(f"{file_server.url}/b.tar.gz", tmp_path / "m")
    replaced = fetch(f"{file_server.url}/b.tar.gz", tmp_path / "m", force=True)
    assert b'"b"' in (tmp_path / "m" / "config.json").read_bytes()
    assert not replaced.cached
    # A fetched directory given as --model is checked against its marker.
    assert fetch(str(tmp_path / "m")).digest == replaced.digest
