"""Shared by the scheduler tests: fake sequences for the policy, a drain loop for the engine."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.policy import BatchPolicy, Chunk, StepOutput
from tokenline.scheduler.sequence import Sequence, Status

# Prompts of assorted lengths; "<|assistant|>" and "hello please" make the tiny model emit its
# EOS (<|end|>) within a few greedy tokens, "a" makes it repeat itself.
PROMPTS = [
    "hello please",
    "The quick brown fox jumps over the lazy dog near the river in the morning light.",
    "你好 世界 🙂",
    "<|assistant|>",
    "a",
    "request queue world",
]


# Small random models of each supported family, built from a config (no download).
COMMON = dict(  # the shapes every family shares
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # per-head q/k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}
# Windows shorter than the prompts and the generations, so every attention path (the causal
# batch of prompt-starting chunks, chunks that continue a prompt, decode) crosses them.
SLIDING = {
    "mistral-window-8": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-window-8-layer-1": (  # layer 0 attends to everything, layer 1 slides
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3-window-8": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    ),
}

# Mixtures of experts: layers where several tokens of a batch share an expert and some experts
# get none (8 experts, 2 each); Qwen3-MoE with a dense layer among the sparse ones.
MOE = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 32,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3-moe-unnormalised": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    ),
}
# Gemma 3: a sliding layer (window 8, shorter than the prompts) then a full one, soft-capped
# logits, scores scaled by query_pre_attn_scalar.
GEMMA = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 32,
        },
    ),
}
NATIVE = {**FAMILIES, **MOE, **GEMMA}
# Families with no native module: transformers' modules with tokenline's attention. Granite
# multiplies embeddings, attention scores, residuals and logits; Phi-3 fuses its projections;
# OLMo-2 normalises after attention and the MLP, and q and k over all heads.
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
GENERIC = {
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.2,
            "logits_scaling": 8.0,
            **_IDS,
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _IDS),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _IDS),
}


def saved_family_model(spec, path):
    """A small random model of ``spec``'s family (a FAMILIES or SLIDING entry), saved to
    ``path`` in Hugging Face format and returned."""
    import torch
    import transformers

    config_name, model_name, extra = spec
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # larger weights, so that greedy paths diverge visibly if wrong
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(path)
    return model


def generate_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of ``ids``: the oracle for the engine's tokens."""
    import torch

    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def family_runner(
    family: str,
    path,
    dense_decode: bool = True,
    dtype: str = "float32",
    model_impl="auto",
    compile_layers: bool = False,
):
    """A CPU runner over the model ``saved_family_model`` left in ``path``."""
    from tokenline.model_source import ModelSource
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    return ModelRunner(
        ModelSource(spec=family, path=str(path)),
        RunnerOptions(
            device="cpu",
            dtype=dtype,
            kv_cache_memory=2**20,
            torch_threads=1,
            dense_decode=dense_decode,
            model_impl=model_impl,
            compile_layers=compile_layers,
        ),
    )


# ── policy: no model, no tensors ──────────────────────────────────────────────────────────────
_distinct = itertools.count(1)


def fake_seq(
    uid: str, prompt_len: int, max_tokens: int = 10_000, prompt_ids: list[int] | None = None
) -> Sequence:
    """A sequence whose prompt shares no token with any other fake's, unless ``prompt_ids``
    says otherwise: prefix caching changes a schedule only where a test asks it to."""
    if prompt_ids is None:
        first = next(_distinct) * 1_000_000
        prompt_ids = list(range(first, first + prompt_len))
    return Sequence(
        uid=uid,
        prompt_ids=prompt_ids,
        sampling=SamplingParams(),
        max_tokens=max_tokens,
    )


def fake_step(sched: BatchPolicy, token: int = 7) -> list[Chunk]:
    """One engine step with a fake runner: schedule, check each chunk, "compute" it and
    sample ``token`` for each chunk that samples; the policy applies that (which registers
    the blocks filled in the prefix cache, and ends a sequence at its max_tokens)."""
    chunks = sched.schedule()
    block_size = sched.pool.block_size
    assert sum(c.num_tokens for c in chunks) <= sched.max_num_batched_tokens
    assert len({id(c.seq) for c in chunks}) == len(chunks), "a sequence got two chunks"
    for c in chunks:
        assert c.seq.status is Status.RUNNING, f"{c.seq.uid} scheduled while {c.seq.status}"
        assert c.num_tokens >= 1
        assert c.start == c.seq.num_computed, f"{c.seq.uid} skips or repeats tokens"
        assert len(c.seq.block_table) * block_size >= c.start + c.num_tokens, "KV slots missing"
    sampled = [(c.seq, [token]) for c in chunks if c.samples]
    sched.update_from_output(StepOutput(chunks, sampled))
    return chunks


def forget_finished(sched: BatchPolicy, live: dict[str, Sequence]) -> None:
    """Check that the policy ended exactly the sequences of ``live`` that reached their
    max_tokens, blocks and all, and drop those from ``live``."""
    for uid, seq in list(live.items()):
        assert (len(seq.output_ids) >= seq.max_tokens) is (seq.status is Status.FINISHED)
        if seq.status is Status.FINISHED:
            assert uid not in sched.by_uid and not seq.block_table
            del live[uid]


def assert_blocks_conserved(sched: BatchPolicy) -> None:
    """Every usable block is either free (perhaps cached) or referenced by as many live
    sequences as its reference count says; a sequence holds a block at most once."""
    pool = sched.pool
    holders = Counter()
    for seq in sched.by_uid.values():
        assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.uid} holds a block twice"
        holders.update(seq.block_table)
    assert 0 not in holders, "block 0 is the padding target and must never be handed out"
    for block in range(1, pool.num_blocks):
        assert pool.refs(block) == holders[block], f"block {block}'s reference count is wrong"
    assert len(holders) == pool.num_referenced, "blocks leaked or duplicated"
    assert len(holders) + pool.num_free == pool.num_blocks - 1, "blocks leaked or duplicated"
    unreferenced = pool._free + list(pool._evictable)
    assert len(set(unreferenced)) == pool.num_free, "a block is free twice"
    assert not set(unreferenced) & set(holders), "a held block is also free"


def assert_states_consistent(sched: BatchPolicy) -> None:
    running = {s.uid for s in sched.running}
    waiting = {s.uid for s in sched.waiting}
    paused = set(sched.paused)
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    assert not (running & waiting or running & paused or waiting & paused)
    assert running | waiting | paused == set(sched.by_uid)
    for uid, seq in sched.by_uid.items():
        expected = (
            Status.RUNNING
            if uid in running
            else Status.WAITING
            if uid in waiting
            else Status.PAUSED
        )
        assert seq.status is expected, f"{uid} is {seq.status} but sits in {expected}"
    assert len(sched.running) <= sched.max_num_seqs


# ── engine: drive it until it is idle ─────────────────────────────────────────────────────────
@dataclass
class Drained:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    terminals: Counter = field(default_factory=Counter)
    steps: int = 0


def drain(engine: Engine, max_steps: int = 2_000, into: Drained | None = None) -> Drained:
    """Step until the engine has no work; every uid gets exactly one terminal output."""
    seen = into or Drained()
    while engine.has_work() or engine.compiling:
        assert seen.steps < max_steps, f"engine still busy after {max_steps} steps"
        if not engine.has_work():  # only grammars being built on the worker: wait for them
            time.sleep(0.001)
            continue
        collect(engine.step(), seen)
    return seen


def collect(outputs, seen: Drained) -> Drained:
    seen.steps += 1
    for out in outputs:
        assert out.uid not in seen.reasons, f"{out.uid} got output after its terminal one"
        seen.tokens.setdefault(out.uid, []).extend(out.token_ids)
        if out.finish_reason is not None:
            seen.reasons[out.uid] = out.finish_reason
            seen.terminals[out.uid] += 1
    return seen


def assert_idle(engine: Engine) -> None:
    """An engine with nothing to do holds no KV block and no request."""
    assert not engine.has_work()
    assert engine.pool.usage == 0.0
    assert engine.pool.num_referenced == 0
    assert engine.pool.num_free == engine.pool.num_blocks - 1
    assert not engine.policy.by_uid
    assert not engine.compiling
    assert not (engine.policy.running or engine.policy.waiting or engine.policy.paused)
    dense = engine.runner.decode_contexts
    assert dense is None or (dense.num_rows == 0 and dense.buffer.numel() == 0)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
