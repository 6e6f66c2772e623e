"""The stage runtime gives glibc's free heap pages back (issue 34: the scheduler's RSS grew with
no byte more in use, in memory freed inside the heap and kept resident)."""

from __future__ import annotations

import ctypes
import os

import pytest

from tokenline.stage_runtime import TRIM_INTERVAL_S, HeapTrim, StageRuntime

MiB = 2**20
BLOCK = 64 * 2**10  # under glibc's smallest mmap threshold: always carved from the heap
BLOCKS = 640  # 40 MiB, half of it freed


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Idle:
    stage = "scheduler"

    def housekeeping(self, now):
        return []

    def held(self):
        return []


def test_trims_at_most_once_per_interval():
    now = [100.0]
    trim = HeapTrim(clock=lambda: now[0])
    if trim._trim is None:
        pytest.skip("no malloc_trim in this C library")
    assert not trim()
    now[0] += TRIM_INTERVAL_S
    assert trim()
    assert not trim()
    now[0] += TRIM_INTERVAL_S - 0.1
    assert not trim()
    now[0] += 0.1
    assert trim()


def test_runtime_housekeeping_trims():
    now = [0.0]
    runtime = StageRuntime(_Idle(), send=lambda m: None, clock=lambda: now[0])
    calls = []
    runtime._trim_heap._trim = calls.append
    runtime.tick(force=True)
    assert calls == []
    now[0] = TRIM_INTERVAL_S + 1
    runtime.tick()
    assert calls == [0]


def test_freed_heap_memory_leaves_the_resident_set():
    trim = HeapTrim(interval_s=0)
    if trim._trim is None or not os.path.exists("/proc/self/statm"):
        pytest.skip("needs glibc and /proc")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    # Every other block freed: holes between live blocks, which free() never gives back (it
    # only shrinks the heap's top), as a step's tensors freed between longer-lived ones.
    for block in blocks[::2]:
        libc.free(block)
    freed = BLOCK * len(blocks[::2])
    try:
        before = _rss()
        assert trim()
        released = before - _rss()
    finally:
        for block in blocks[1::2]:
            libc.free(block)
    # All but each hole's first page (its chunk header) and what the thread cache keeps.
    assert released > 0.75 * freed, f"{released / MiB:.1f} of {freed / MiB:.0f} MiB released"
