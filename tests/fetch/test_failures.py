"""A full disk and a permission error: a clear error, no marker, nothing that looks complete.

Both are real kernel errors: the full disk is a file size limit (RLIMIT_FSIZE, so writes fail
with EFBIG exactly as they fail with ENOSPC on a full volume) and the permission error comes
from a directory this user may not write (as root, the child process drops to nobody first).
Each runs in a forked child so the limit and the uid stay there.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import stat

import pytest
from fetch_servers import FAST, model_files, tar_gz

from tokenline.fetch import FetchError, fetch, read_marker

NOBODY = 65534


def in_child(body) -> tuple[str, str] | None:
    """Run ``body()`` in a forked child; return (reason, message) of the FetchError it raised."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target() -> None:
        try:
            body()
            child.send(None)
        except FetchError as exc:
            child.send((exc.reason, str(exc)))
        except BaseException as exc:  # anything else is a bug the test should show
            child.send(("Unexpected", repr(exc)))

    proc = ctx.Process(target=target)
    proc.start()
    got = parent.recv() if parent.poll(60) else ("Timeout", "the child did not answer")
    proc.join(10)
    return got


def test_a_full_disk_fails_clearly_and_leaves_no_complete_model(hub, tmp_path):
    files = model_files(shard=600_000)
    hub.add("acme/tiny", "main", files)
    target = tmp_path / "m"

    def fetch_with_a_small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        fetch("hf://acme/tiny", target, backoff=FAST)

    reason, message = in_child(fetch_with_a_small_disk)

    assert reason == "DiskFull", message
    assert "larger volume" in message and "resumes" in message
    assert read_marker(target) is None
    assert not (target / "model.safetensors").exists()
    assert not (target / "config.json").exists()
    with pytest.raises(FetchError, match="incomplete download"):
        fetch(str(target))  # what a loader given the directory is told

    # With room again, the same command finishes the job from where it stopped.
    result = fetch("hf://acme/tiny", target, backoff=FAST)
    assert (target / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert result.downloaded < sum(map(len, files.values()))


def test_too_little_free_space_fails_before_the_first_byte(hub, tmp_path):
    files = model_files()
    hub.add("acme/huge", "main", files)
    hub.size_override["model.safetensors"] = 1 << 60  # the Hub says an exabyte

    with pytest.raises(FetchError, match="is free") as info:
        fetch("hf://acme/huge", tmp_path / "m", backoff=FAST)

    assert info.value.reason == "DiskFull"
    assert not any("/resolve/" in s.path for s in hub.server.log)


def test_a_directory_this_user_may_not_write(file_server, tmp_path):
    file_server.file("/m.tar.gz", tar_gz(model_files()))
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    # Let an unprivileged child reach it (pytest's base directory is private to root).
    for p in (tmp_path, tmp_path.parent, tmp_path.parent.parent):
        p.chmod(p.stat().st_mode | stat.S_IXOTH)
    target = parent / "m"

    def fetch_unprivileged() -> None:
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        fetch(f"{file_server.url}/m.tar.gz", target, backoff=FAST)

    try:
        reason, message = in_child(fetch_unprivileged)
    finally:
        parent.chmod(0o755)
    assert reason == "PermissionDenied", message
    assert "fsGroup" in message and str(target) in message
    assert not target.exists()
