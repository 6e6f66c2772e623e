"""The real-shape benchmarks' own parts: the tokenizer grown to a model's exact vocabulary, and
the in-process profile, run end to end on the tiny model so that a benchmark run does not fail
on a typo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_shapes  # noqa: E402


def test_the_tokenizer_has_exactly_the_models_vocabulary_and_decodes_every_id():
    tokenizer = real_shapes.tokenizer_of_size(2000)
    assert len(tokenizer) == 2000
    for token_id in (0, 700, 1000, 1999):  # trained, merged, and the last merged id
        assert tokenizer.decode([token_id]), token_id
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.timeout(300)
def test_the_forward_profile_groups_a_decode_step(tmp_path):
    from tokenline import tiny_model

    model = tiny_model.build(tmp_path / "tiny")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "forward_profile.py"), "--model-dir",
         str(model), "--dtype", "float32", "--batch", "1", "3", "--steps", "2", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ms a decode step unprofiled") == 2
    assert "matmul" in done.stdout and "attention" in done.stdout
