"""The runner walks each supported family's own transformers modules and matches its generate.

Small random models of each architecture are built from a config (no download), saved in
Hugging Face format and loaded through the same path as a real model.
"""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import COMMON, FAMILIES, SLIDING, family_runner, saved_family_model

from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner


def _greedy_against_transformers(family, spec, tmp_path, dense_decode: bool = True) -> None:
    model = saved_family_model(spec, tmp_path)
    runner = family_runner(family, tmp_path, dense_decode)
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=16), eos_ids=[])
    prompts = {f"p{i}": [(7 * i + j) % 290 + 5 for j in range(9 + 5 * i)] for i in range(3)}
    for uid, ids in prompts.items():
        engine.add(uid, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {uid: [] for uid in prompts}
    while engine.has_work():
        for out in engine.step():
            got[out.uid] += out.token_ids

    reference = model.eval()
    for uid, ids in prompts.items():
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert got[uid] == out[0, len(ids) :].tolist(), (family, uid)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_for_each_family(family, tmp_path):
    _greedy_against_transformers(family, FAMILIES[family], tmp_path)


@pytest.mark.parametrize("dense_decode", [True, False], ids=["dense-decode", "gather-decode"])
@pytest.mark.parametrize("family", list(SLIDING))
def test_sliding_window_layers_match_transformers_past_the_window(family, dense_decode, tmp_path):
    _greedy_against_transformers(family, SLIDING[family], tmp_path, dense_decode)


def test_the_window_is_read_per_layer_from_the_model(tmp_path):
    import transformers

    config = transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    runner = ModelRunner(
        ModelSource(spec="qwen2", path=str(tmp_path)), device="cpu", kv_cache_memory=2**20
    )
    assert runner.window == 8
    assert runner._slides == [False, True]


@pytest.mark.parametrize("dense_decode", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_logits_follow_transformers(family, dense_decode, tmp_path):
    """GPUs run bf16: the same path on CPU stays within bf16 rounding of transformers' own
    bf16 forward, for a prompt and for the decode step after it (a wrong rotation or norm
    would be off by whole logits, not hundredths)."""
    from tokenline.scheduler.kv_cache import BlockPool
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence

    model = saved_family_model(FAMILIES[family], tmp_path)
    reference = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    runner = family_runner(family, tmp_path, dense_decode, dtype="bfloat16")
    ids = [(7 * j) % 290 + 5 for j in range(20)]
    seq = Sequence(uid="a", prompt_ids=ids, sampling=SamplingParams(max_tokens=2), max_tokens=2)
    pool = BlockPool(runner.num_blocks, runner.block_size)
    pool.grow(seq, len(ids) + 1)

    def logits_against_reference(chunk: Chunk) -> torch.Tensor:
        got = runner.forward([chunk])[0]
        with torch.inference_mode():
            want = reference.eval()(torch.tensor([ids + seq.output_ids])).logits[0, -1].float()
        assert (got - want).abs().max() < 0.1 * want.std(), (family, chunk.start)
        return got

    first = logits_against_reference(Chunk(seq, 0, len(ids)))  # the prompt
    seq.num_computed = len(ids)
    seq.output_ids.append(int(first.argmax()))
    logits_against_reference(Chunk(seq, len(ids), 1))  # the decode step after it
