"""What a scheduler imports to start: the compiler stack (dynamo, inductor) only when something
compiles. Importing it costs seconds of a two-core stage's start and most of a stack's time to
ready (benchmarks/README.md, "Start-up")."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import tokenline.scheduler.start
import tokenline.scheduler.stage
import tokenline.scheduler.grammar
import tokenline.scheduler.layers.compiled
compiler = ("torch._dynamo", "torch._inductor")
print(sorted({m.split(".")[1] for m in sys.modules if m.startswith(compiler)}))
"""


def test_the_scheduler_imports_no_compiler_until_one_is_asked_for() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
