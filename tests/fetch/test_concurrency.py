"""Two fetchers started at once on one directory: one downloads, the other waits and finds the
model complete. Real processes (`python -m tokenline.fetch`, what the init container runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from fetch_servers import model_files, tar_gz

from tokenline.fetch import FetchError, fetch, read_marker
from tokenline.fetch.lock import exclusive
from tokenline.fetch.manifest import WORK_DIR


def test_two_fetchers_on_one_directory_download_once(file_server, tmp_path):
    archive = tar_gz(model_files(shard=200_000))
    file_server.file("/m.tar.gz", archive)
    file_server.throttle = 400_000  # about half a second per download: the two overlap
    target = tmp_path / "shared-cache"
    env = dict(os.environ, TOKENLINE_FETCH_PROGRESS_INTERVAL="0.2")
    cmd = [sys.executable, "-m", "tokenline.fetch", f"{file_server.url}/m.tar.gz", str(target)]

    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]

    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0]["digest"] == results[1]["digest"]
    assert sorted(r["cached"] for r in results) == [False, True]
    assert len(file_server.gets("/m.tar.gz")) == 1  # one download
    assert file_server.bytes_sent("/m.tar.gz") == len(archive)
    waiter = next(err for (_, err), r in zip(outs, results, strict=True) if r["cached"])
    assert "waiting for it" in waiter or "complete in" in waiter  # it saw the lock or the marker
    assert read_marker(target) is not None


def test_the_lock_excludes_threads_of_one_process_too(file_server, tmp_path):
    archive = tar_gz(model_files())
    file_server.file("/m.tar.gz", archive)
    file_server.throttle = 1_000_000
    results = []

    def run() -> None:
        results.append(fetch(f"{file_server.url}/m.tar.gz", tmp_path / "m"))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3 and len({r.digest for r in results}) == 1
    assert len(file_server.gets("/m.tar.gz")) == 1


def test_a_held_lock_times_out_with_the_holder_named(tmp_path):
    (tmp_path / "m" / WORK_DIR).mkdir(parents=True)
    with exclusive(tmp_path / "m" / WORK_DIR / "lock", timeout=1):
        with pytest.raises(FetchError, match=f"pid {os.getpid()}") as info:
            fetch("https://127.0.0.1:9/never.tar.gz", tmp_path / "m", lock_timeout=0.3)
    assert info.value.reason == "LockTimeout"
