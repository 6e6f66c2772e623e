"""The shared layers give the bits of transformers' own modules.

They replace module calls with fewer kernels (fused RMSNorm, rotary embeddings without slices,
residuals inside ``addmm``, fused projections in column-major storage); each is checked here
against the module it stands in for, on small random models of every native family.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from scheduler_testkit import COMMON, FAMILIES
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tokenline.scheduler.layers.embedding import VocabEmbedding
from tokenline.scheduler.layers.linear import ColumnLinear, QKVLinear, RowLinear
from tokenline.scheduler.layers.norm import GemmaRMSNorm, RMSNorm
from tokenline.scheduler.layers.placement import Placement
from tokenline.scheduler.layers.rotary import RopeFrequencies, Rotary, rotate

SMALL = {**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 512}
CPU = torch.device("cpu")


def _model(family: str, **extra) -> torch.nn.Module:
    config_name, model_name, family_extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**SMALL, **family_extra, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norm weights away from 1, biases away from 0
            param.add_(torch.randn_like(param) * 0.5)
    return model


def _gemma3(**extra) -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(
        **{**SMALL, "head_dim": 16, "num_hidden_layers": 2, **extra},
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    return model


def _norm_like(module: torch.nn.Module, kind: type[RMSNorm], dtype) -> RMSNorm:
    eps = getattr(module, "variance_epsilon", None) or module.eps
    norm = kind(module.weight.shape[0], eps, Placement(CPU, dtype))
    norm.load_weight("weight", None, module.weight.detach())
    return norm


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_the_modules_bits(family, dtype):
    model = _model(family).to(dtype)
    attn = model.model.layers[0].self_attn
    modules = [model.model.norm, model.model.layers[0].input_layernorm]
    modules += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
    for module in modules:
        norm = _norm_like(module, RMSNorm, dtype)
        for rows in (1, 16, 300):
            x = (torch.randn(rows, module.weight.shape[0]) * 3).to(dtype)
            with torch.inference_mode():
                assert torch.equal(norm(x), module(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_gives_the_modules_bits(dtype):
    """Gemma's weight is an offset from one, applied in float32 before rounding."""
    model = _gemma3().to(dtype)
    layer = model.model.layers[0]
    for module in (model.model.norm, layer.pre_feedforward_layernorm, layer.self_attn.q_norm):
        norm = _norm_like(module, GemmaRMSNorm, dtype)
        x = (torch.randn(16, module.weight.shape[0]) * 3).to(dtype)
        with torch.inference_mode():
            assert torch.equal(norm(x), module(x))


def _rotation_matches(reference, ours, positions, head_dim, layer_type=None) -> None:
    rotary = Rotary(ours, torch.float32, CPU, layer_type)
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    with torch.inference_mode():
        args = (q, positions.unsqueeze(0)) + ((layer_type,) if layer_type else ())
        cos, sin = reference(*args)
        want_q, want_k = apply_rotary_pos_emb(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin
        )
        got_cos, got_sin = rotary.at(positions, int(positions.max()))
        got_q, got_k = rotate(q, got_cos, got_sin), rotate(k, got_cos, got_sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rotation_gives_transformers_bits(family):
    model = _model(family)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // 4
    positions = torch.tensor([0, 1, 7, 255, 256, 300, 511])  # past the table's first size
    _rotation_matches(model.model.rotary_emb, RopeFrequencies(config), positions, head_dim)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_rotation_of_each_layer_type_gives_transformers_bits(layer_type):
    """Gemma 3's sliding layers rotate with base 10k, its full layers with base 1M scaled
    linearly: one table per layer type."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    }
    model = _gemma3(rope_parameters=rope)
    ours = RopeFrequencies(model.config, sorted(set(model.config.layer_types)))
    positions = torch.tensor([0, 3, 9, 300])
    _rotation_matches(model.model.rotary_emb, ours, positions, 16, layer_type)


def test_dynamic_rotary_is_computed_for_each_step():
    """Dynamic NTK scaling changes the frequencies with the step's longest position, so no
    table of positions can stand for it."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = _model("llama", rope_parameters=rope)
    model.config.max_position_embeddings = 64  # scaling starts past 64 positions
    module = model.model.rotary_emb
    module.original_max_seq_len = module.max_seq_len_cached = 64
    rotary = Rotary(RopeFrequencies(model.config), torch.float32, CPU)
    x = torch.randn(3, 4, 16)
    for positions in (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 200]), torch.tensor([5])):
        with torch.inference_mode():
            cos, sin = module(x, positions.unsqueeze(0))
            want, _ = apply_rotary_pos_emb(
                x.transpose(0, 1).unsqueeze(0), x.transpose(0, 1).unsqueeze(0), cos, sin
            )
            got = rotate(x, *rotary.at(positions, int(positions.max())))
        assert torch.equal(got, want[0].transpose(0, 1))
    assert rotary._table.shape[0] == 0  # nothing was tabulated


# Every rope type transformers computes, past the trained length (64 here) where they scale.
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10_000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10_000.0,
        "original_max_position_embeddings": 64,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500_000.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 16 for i in range(8)],
        "long_factor": [2.0 + i / 4 for i in range(8)],
        "original_max_position_embeddings": 64,
        "rope_theta": 10_000.0,
    },
}
# Each native family's config and its own transformers rotary module, with 16-wide heads.
ROTARY_FAMILIES = {
    "llama": ("LlamaConfig", "llama", "LlamaRotaryEmbedding"),
    "mistral": ("MistralConfig", "mistral", "MistralRotaryEmbedding"),
    "qwen2": ("Qwen2Config", "qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": ("Qwen3Config", "qwen3", "Qwen3RotaryEmbedding"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeRotaryEmbedding"),
    "mixtral": ("MixtralConfig", "mixtral", "MixtralRotaryEmbedding"),
}
# Steps of growing, then shrinking lengths: the dynamic types grow their frequencies past the
# trained length and go back to the originals below it.
STEP_POSITIONS = (range(0, 9), range(0, 40), range(60, 70), range(0, 130), range(200, 256), [3])


def _same_steps(reference, ours, layer_type=None) -> None:
    x = torch.empty(0, dtype=torch.bfloat16)
    with torch.inference_mode():
        for step in STEP_POSITIONS:
            positions = torch.tensor(list(step)).unsqueeze(0)
            by_type = (layer_type,) if layer_type else ()
            want, got = reference(x, positions, *by_type), ours(x, positions, *by_type)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), list(step)


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
@pytest.mark.parametrize("family", sorted(ROTARY_FAMILIES))
def test_rope_frequencies_are_each_familys_module_in_every_rope_type(family, rope):
    config_name, module_family, module_name = ROTARY_FAMILIES[family]
    shapes = {**COMMON, "head_dim": 16, "max_position_embeddings": 64}
    config = getattr(transformers, config_name)(**shapes, rope_parameters=ROPE_TYPES[rope])
    modeling = importlib.import_module(f"transformers.models.{module_family}.modeling_{family}")
    reference = getattr(modeling, module_name)(config=config)
    _same_steps(reference, RopeFrequencies(config))


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
def test_gemma3_frequencies_are_its_modules_for_each_layer_type(rope):
    """The sliding layers keep their own default rotary while the full layers scale."""
    layer_types = ["sliding_attention", "full_attention"]
    config = transformers.Gemma3TextConfig(
        **{**SMALL, "head_dim": 16, "num_hidden_layers": 2, "max_position_embeddings": 64},
        layer_types=layer_types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": ROPE_TYPES[rope],
        },
    )
    reference = modeling_gemma3.Gemma3RotaryEmbedding(config=config)
    ours = RopeFrequencies(config, sorted(set(layer_types)))
    for layer_type in layer_types:
        _same_steps(reference, ours, layer_type)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_projections_give_the_modules_results(family):
    """q/k/v and gate/up load into one weight each, stored column-major on CPU (MKL's fast
    layout for few rows); o and down add the residual in the same kernel."""
    model = _model(family)
    layer, config = model.model.layers[0], model.config
    attn, mlp = layer.self_attn, layer.mlp
    place = Placement(CPU, torch.float32)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // 4
    qkv = QKVLinear(config.hidden_size, 4, 2, head_dim, attn.q_proj.bias is not None, place)
    for shard, linear in zip("qkv", (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
        qkv.load_weight("weight", shard, linear.weight.detach())
        if linear.bias is not None:
            qkv.load_weight("bias", shard, linear.bias.detach())
    inter = config.intermediate_size
    gate_up = ColumnLinear(config.hidden_size, [inter, inter], False, place, "MLP width")
    gate_up.load_weight("weight", 0, mlp.gate_proj.weight.detach())
    gate_up.load_weight("weight", 1, mlp.up_proj.weight.detach())
    o = RowLinear(attn.o_proj.in_features, config.hidden_size, False, place, "heads")
    o.load_weight("weight", None, attn.o_proj.weight.detach())
    x = torch.randn(16, config.hidden_size)
    attn_out = torch.randn(16, attn.o_proj.in_features)
    with torch.inference_mode():
        want_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        want_gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        torch.testing.assert_close(qkv(x), want_qkv, rtol=0, atol=1e-5)
        torch.testing.assert_close(gate_up(x), want_gate_up, rtol=0, atol=1e-5)
        torch.testing.assert_close(o(attn_out, x), x + attn.o_proj(attn_out), rtol=0, atol=1e-5)
    for linear in (qkv, gate_up, o):
        assert linear.weight.stride(0) == 1  # column-major storage


def test_gemma_embedding_scale_is_rounded_as_the_modules():
    model = _gemma3().to(torch.bfloat16)
    module = model.model.embed_tokens
    embedding = VocabEmbedding(300, 64, Placement(CPU, torch.bfloat16), 64**0.5)
    embedding.load_weight("weight", None, module.weight.detach())
    ids = torch.tensor([0, 5, 299])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), module(ids))
