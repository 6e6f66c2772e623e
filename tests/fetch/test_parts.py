"""The pure parts: progress rate limiting, backoff bounds, file selection, the marker."""

from __future__ import annotations

import random

import pytest

from tokenline.fetch import FetchError
from tokenline.fetch.manifest import FileEntry, Marker, RemoteFile, digest_of, safe_name, select
from tokenline.fetch.progress import Progress
from tokenline.fetch.retry import Backoff


def test_progress_logs_at_most_once_per_interval_with_bytes_total_and_rate():
    now = [0.0]
    progress = Progress("hf://a/b", total=10 * 2**20, interval=5.0, clock=lambda: now[0])
    lines = []
    for i in range(1, 81):  # 80 chunks of 128 KiB over 10 s
        now[0] = i * 0.125
        if line := progress.advance(128 * 1024):
            lines.append(line)
    assert len(lines) == 2
    assert lines[0].startswith("fetch hf://a/b: 5.0 MiB / 10.0 MiB (50%) at 1.0 MiB/s")
    assert "s left" in lines[0]


def test_backoff_grows_is_capped_and_bounded():
    backoff = Backoff(attempts=5, base=1.0, cap=8.0)
    rng = random.Random(0)
    delays = [backoff.delay(n, rng) for n in range(1, 7)]
    assert all(0.5 <= d <= 1 for d in delays[:1]) and all(4 <= d <= 8 for d in delays[3:])
    assert not backoff.exhausted(4) and backoff.exhausted(5)


def test_select_prefers_safetensors_and_puts_config_last():
    names = ["config.json", "model.safetensors", "pytorch_model.bin", ".gitattributes", "a.json"]
    files = [RemoteFile(n, 1) for n in names]
    assert [f.name for f in select(files)] == ["a.json", "model.safetensors", "config.json"]
    assert [f.name for f in select(files, include=["*.bin", "*.json"])] == [
        "a.json",
        "pytorch_model.bin",
        "config.json",
    ]
    assert next(f.name for f in select(files, exclude=["a.json"])) == "model.safetensors"


@pytest.mark.parametrize(
    "name", ["../x", "/etc/passwd", "a//b", ".tokenline-fetch/complete.json", "a\\b"]
)
def test_names_that_escape_the_directory_are_refused(name):
    with pytest.raises(FetchError, match="outside the model directory"):
        safe_name(name, "s3://b/p")


def test_marker_round_trip_and_digest_depends_on_content(tmp_path):
    entries = (FileEntry("config.json", 2, "aa"), FileEntry("w.safetensors", 3, "bb"))
    marker = Marker("hf://a/b", "c0ffee", digest_of(entries), 5, entries)
    assert Marker.from_json(marker.to_json()) == marker
    assert Marker.from_json("{not json") is None
    changed = (FileEntry("config.json", 2, "aa"), FileEntry("w.safetensors", 3, "bc"))
    assert digest_of(changed) != marker.digest
    (tmp_path / "config.json").write_bytes(b"{}")
    assert not marker.intact_in(tmp_path)
    (tmp_path / "w.safetensors").write_bytes(b"abc")
    assert marker.intact_in(tmp_path)


def test_the_fetch_counter_passes_promtool():
    import shutil
    import subprocess

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from tokenline.fetch.progress import MODEL_FETCH_BYTES

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package)")
    registry = CollectorRegistry()  # the same metric, alone, so other modules' metrics stay out
    counter = Counter(
        MODEL_FETCH_BYTES._name, MODEL_FETCH_BYTES._documentation, ["scheme"], registry=registry
    )
    counter.labels("s3").inc(1024)
    text = generate_latest(registry)
    assert b"tokenline_model_fetch_bytes_total" in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
