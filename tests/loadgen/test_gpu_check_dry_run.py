"""The prepared GPU check runs end to end on the CPU with tiny shapes (its dry run), so the one
run a lent GPU gets does not fail on a typo: every stage reports, and the JSON is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_gpu_check_dry_run_reports_every_stage(tmp_path):
    out = tmp_path / "dry.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--small", "--device", "cpu",
         "--out", str(out), "--contexts", "32,64", "--batches", "1,4", "--decode-steps", "4"],
        capture_output=True,
        text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] is True
    stages = report["stages"]
    assert stages["copy_bandwidth_gb_per_s"] > 0
    for shape in ("qwen3-small", "llama-wide-small"):
        assert stages[f"{shape}: logits"]["max_error_over_std"] < 1e-3  # float32 on the CPU
        for batch in (1, 4):
            for context in (32, 64):
                row = stages[f"{shape}: {batch}x{context}"]
                assert row["decode_tokens_per_s"] > 0 and row["ttft_s"] > 0
                assert 0 < row["of_roofline"] < 1
        assert set(stages[f"{shape}: decode step costs"]) >= {"kernels", "host_syncs"}
    # speculation beside the decode path: one token per step's output from every proposer
    rows = stages["qwen3-small: speculation"]
    assert {row["mode"] for row in rows} >= {"off", "every guess right", "eagle3 (random head)"}
    assert all(row["same_output"] == 1.0 for row in rows)  # float32
    right = [row for row in rows if row["mode"] == "every guess right"]
    assert all(row["tokens_per_step"] > row["batch"] for row in right)
