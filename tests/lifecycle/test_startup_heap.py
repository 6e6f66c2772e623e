"""What a stage builds before serving is taken out of the garbage collector's scans.

A full collection in a process holding torch and transformers walked ~240k objects and took
~100 ms, stalling whatever step or stream was in flight; frozen, those objects are skipped.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tokenline.lifecycle import freeze_startup_heap


@pytest.fixture
def unfrozen_afterwards() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_objects_built_at_startup_leave_the_collected_generations(unfrozen_afterwards):
    built_at_startup = [{"weights": i} for i in range(1000)]
    gc.collect()
    assert any(o is built_at_startup for o in gc.get_objects(generation=2))

    freeze_startup_heap()

    assert gc.get_freeze_count() >= len(built_at_startup)
    assert not any(o is built_at_startup for o in gc.get_objects(generation=2))
    served = [{"token": i} for i in range(10)]  # allocated while serving: still collected
    assert any(o is served for o in gc.get_objects())
