"""What a scheduler imports to start: the compiler stack (dynamo, inductor) only when something
compiles, and none of transformers' model classes for a family tokenline runs itself. Importing
them costs seconds of a two-core stage's start and most of a stack's time to ready
(benchmarks/README.md, "Start-up")."""

from __future__ import annotations

import subprocess
import sys

from tokenline.model_source import ModelSource

HEAVY = """
heavy = ("torch._dynamo", "torch._inductor", "transformers.modeling_utils")
print(sorted({m for m in sys.modules if m.startswith(heavy) and m.count(".") <= 1}))
"""
IMPORTS = """
import sys
import tokenline.scheduler.start
import tokenline.scheduler.stage
import tokenline.scheduler.grammar
import tokenline.scheduler.layers.compiled
"""
# a native family's model built, its weights loaded and warmed up, as a scheduler starts
RUNNER = """
import sys
from tokenline.model_source import ModelSource
from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.warm_up import warm_up
warm_up(ModelRunner(ModelSource("tiny", sys.argv[1])), 128)
"""


def _heavy_modules(probe: str, *args: str) -> str:
    command = [sys.executable, "-c", probe + HEAVY, *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def test_the_scheduler_imports_no_compiler_until_one_is_asked_for() -> None:
    assert _heavy_modules(IMPORTS) == "[]"


def test_building_a_native_model_imports_neither_compiler_nor_transformers_models(
    tiny_source: ModelSource,
) -> None:
    """The rotary tables come from layers/rotary.py's RopeFrequencies, not from the family's
    modeling module (which imports transformers' model classes and, through them, dynamo)."""
    assert _heavy_modules(RUNNER, tiny_source.path) == "[]"
