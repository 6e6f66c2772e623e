"""`LoraConfigWatcher`: the operator's adapters file (a ConfigMap volume) turned into loads and
unloads, as the kubelet updates it: an atomic swap of the file, never a partial write."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tokenline.scheduler.lora_config import (
    LoraChange,
    LoraConfigError,
    LoraConfigWatcher,
    parse_adapters,
)


def write(path: Path, adapters: list[dict] | str) -> None:
    """Replace the file the way the kubelet does: a new file renamed over the old one."""
    text = adapters if isinstance(adapters, str) else json.dumps({"adapters": adapters})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load(name: str, uri: str) -> LoraChange:
    return LoraChange("load", name, uri)


def unload(name: str, uri: str) -> LoraChange:
    return LoraChange("unload", name, uri)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tmp_path / "adapters.json"


def test_first_read_loads_every_adapter_in_file_order(config):
    write(config, [{"name": "sql", "uri": "hf://acme/sql-lora"}, {"name": "a", "uri": "/ad/a"}])
    watcher = LoraConfigWatcher(config)
    assert watcher.poll() == [load("sql", "hf://acme/sql-lora"), load("a", "/ad/a")]
    assert watcher.adapters == {"sql": "hf://acme/sql-lora", "a": "/ad/a"}
    assert watcher.poll() == []  # unchanged file: nothing to do


def test_added_removed_and_changed_adapters(config):
    write(config, [{"name": "a", "uri": "/ad/a"}, {"name": "b", "uri": "/ad/b"}])
    watcher = LoraConfigWatcher(config)
    watcher.poll()

    write(config, [{"name": "b", "uri": "/ad/b2"}, {"name": "c", "uri": "s3://bucket/c"}])
    # removed a, changed b (unload, then load from the new uri), added c; unloads first
    assert watcher.poll() == [
        unload("a", "/ad/a"),
        unload("b", "/ad/b"),
        load("b", "/ad/b2"),
        load("c", "s3://bucket/c"),
    ]
    write(config, [])
    assert watcher.poll() == [unload("b", "/ad/b2"), unload("c", "s3://bucket/c")]
    assert watcher.adapters == {}


def test_a_file_rewritten_in_place_is_noticed(config):
    config.write_text(json.dumps({"adapters": [{"name": "a", "uri": "/x"}]}))
    watcher = LoraConfigWatcher(config)
    assert watcher.poll() == [load("a", "/x")]
    config.write_text(json.dumps({"adapters": [{"name": "a", "uri": "/xy"}]}))  # size changes
    assert watcher.poll() == [unload("a", "/x"), load("a", "/xy")]
    # same size, new modification time
    config.write_text(json.dumps({"adapters": [{"name": "a", "uri": "/yy"}]}))
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert watcher.poll() == [unload("a", "/xy"), load("a", "/yy")]


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        json.dumps({"adapters": {"a": "/x"}}),
        json.dumps({"adapters": ["a"]}),
        json.dumps({"adapters": [{"name": "a b", "uri": "/x"}]}),
        json.dumps({"adapters": [{"name": "a", "uri": ""}]}),
        json.dumps({"adapters": [{"uri": "/x"}]}),
        json.dumps({"adapters": [{"name": "a", "uri": "/x"}, {"name": "a", "uri": "/y"}]}),
    ],
)
def test_a_bad_file_logs_an_error_and_changes_nothing(config, text, caplog):
    write(config, [{"name": "keep", "uri": "/keep"}])
    watcher = LoraConfigWatcher(config)
    assert watcher.poll() == [load("keep", "/keep")]

    write(config, text)
    with caplog.at_level(logging.ERROR, logger="tokenline.scheduler.lora_config"):
        assert watcher.poll() == []
    assert watcher.error
    assert any("adapters unchanged" in r.getMessage() for r in caplog.records)
    assert watcher.adapters == {"keep": "/keep"}
    assert watcher.poll() == []  # not re-read, not logged again, until it changes

    # fixed: diffed against what is loaded, not against the bad file
    write(config, [{"name": "keep", "uri": "/keep"}, {"name": "new", "uri": "/new"}])
    assert watcher.poll() == [load("new", "/new")]
    assert watcher.error is None


def test_a_missing_file_loads_nothing_until_it_appears(config):
    watcher = LoraConfigWatcher(config)
    assert watcher.poll() == []
    write(config, [{"name": "a", "uri": "/x"}])
    assert watcher.poll() == [load("a", "/x")]
    config.unlink()
    assert watcher.poll() == [unload("a", "/x")]
    assert watcher.poll() == []


def test_an_empty_document_has_no_adapters(config):
    write(config, "{}")
    watcher = LoraConfigWatcher(config)
    assert watcher.poll() == []
    assert watcher.error is None


def test_a_kubelet_style_symlink_swap_is_followed(tmp_path):
    """A ConfigMap volume: adapters.json -> ..data/adapters.json, ..data -> a timestamped
    directory, swapped by renaming a new ..data link over the old one."""
    first, second = tmp_path / "..2026_1", tmp_path / "..2026_2"
    for directory, uri in ((first, "/one"), (second, "/two")):
        directory.mkdir()
        (directory / "adapters.json").write_text(
            json.dumps({"adapters": [{"name": "a", "uri": uri}]})
        )
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "adapters.json").symlink_to("..data/adapters.json")
    watcher = LoraConfigWatcher(tmp_path / "adapters.json")
    assert watcher.poll() == [load("a", "/one")]

    (tmp_path / "..data_tmp").symlink_to(second.name)
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert watcher.poll() == [unload("a", "/one"), load("a", "/two")]


def test_parse_adapters_keeps_file_order_and_strips_uris():
    text = json.dumps({"adapters": [{"name": "z", "uri": " /z "}, {"name": "a", "uri": "/a"}]})
    assert list(parse_adapters(text).items()) == [("z", "/z"), ("a", "/a")]
    with pytest.raises(LoraConfigError, match="twice"):
        parse_adapters(json.dumps({"adapters": [{"name": "a", "uri": "/a"}] * 2}))
