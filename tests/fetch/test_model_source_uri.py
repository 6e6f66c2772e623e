"""`--model URI` for every stage: the stage's model source fetches the model once into its cache
directory and loads it from there; a bad URI stops the stage with the fetch's reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fetch_servers import FileServer, tar_gz

from tokenline import tiny_model
from tokenline.model_source import chat_template_text, resolve


def _tiny_archive(tmp_path: Path) -> bytes:
    model = tiny_model.ensure_cached(str(tmp_path / "built"))
    files = {p.name: p.read_bytes() for p in Path(model).iterdir() if p.is_file()}
    return tar_gz(files, top="tiny")


def test_a_model_uri_is_fetched_once_and_loads_like_a_directory(file_server: FileServer, tmp_path):
    archive = _tiny_archive(tmp_path)
    file_server.file("/tiny.tar.gz", archive)
    uri = f"{file_server.url}/tiny.tar.gz#sha256={hashlib.sha256(archive).hexdigest()}"
    cache = str(tmp_path / "cache")

    source = resolve(uri, cache_dir=cache)
    assert (Path(source.path) / "config.json").is_file()
    assert Path(source.path).is_relative_to(Path(cache) / "models")
    assert source.load_config().vocab_size == len(source.load_tokenizer())
    assert chat_template_text(uri, cache) == tiny_model.CHAT_TEMPLATE

    again = resolve(uri, cache_dir=cache)  # a second stage of the same pod: no second download
    assert again.path == source.path
    assert len(file_server.gets("/tiny.tar.gz")) == 1


def test_a_bad_model_uri_stops_the_stage_with_the_reason(tmp_path):
    with pytest.raises(SystemExit) as caught:
        resolve("s3://", cache_dir=str(tmp_path))
    assert str(caught.value).startswith("--model s3") and "bucket" in str(caught.value)


def test_tokenline_fetch_is_the_command_an_init_container_runs(file_server: FileServer, tmp_path):
    import json
    import subprocess
    import sys

    archive = _tiny_archive(tmp_path)
    file_server.file("/tiny.tar.gz", archive)
    target = tmp_path / "models"
    command = [sys.executable, "-m", "tokenline.cli", "fetch"]
    done = subprocess.run(
        [*command, f"{file_server.url}/tiny.tar.gz", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (Path(result["path"]) / "config.json").is_file()
    bad = subprocess.run([*command, "s3://", str(target)], capture_output=True, timeout=60)
    assert bad.returncode == 2
