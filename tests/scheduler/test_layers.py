"""The runner's layer pieces give the bits of transformers' own modules.

They replace module calls with fewer kernels (fused RMSNorm, rotary embeddings without
slices, residuals inside ``addmm``, column-major weights); each is checked here against the
module it stands in for, on small random models of every supported family.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from scheduler_testkit import COMMON, FAMILIES
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tokenline.scheduler.layers import Rotary, column_major, prepare_layer, rms_norm, rotate

SMALL = {**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 512}


def _model(family: str, **extra) -> torch.nn.Module:
    config_name, model_name, family_extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**SMALL, **family_extra, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norm weights away from 1, biases away from 0
            param.add_(torch.randn_like(param) * 0.5)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_the_modules_bits(family, dtype):
    model = _model(family).to(dtype)
    attn = model.model.layers[0].self_attn
    norms = [model.model.norm, model.model.layers[0].input_layernorm]
    norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
    for module in norms:
        norm = rms_norm(module)
        assert norm is not module, f"{type(module).__name__} is not replaced"
        for rows in (1, 16, 300):
            x = (torch.randn(rows, module.weight.shape[0]) * 3).to(dtype)
            with torch.inference_mode():
                assert torch.equal(norm(x), module(x))


def test_rms_norm_calls_modules_of_other_kinds():
    layer_norm = torch.nn.LayerNorm(8)
    assert rms_norm(layer_norm) is layer_norm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rotation_gives_transformers_bits(family):
    model = _model(family)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // 4
    rotary = Rotary(model.model.rotary_emb, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 255, 256, 300, 511])  # past the table's first size
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(q, positions.unsqueeze(0))
        want_q, want_k = apply_rotary_pos_emb(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin
        )
        got_cos, got_sin = rotary.at(positions, int(positions.max()))
        got_q, got_k = rotate(q, got_cos, got_sin), rotate(k, got_cos, got_sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def test_dynamic_rotary_is_computed_for_each_step():
    """Dynamic NTK scaling changes the frequencies with the step's longest position, so no
    table of positions can stand for it."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = _model("llama", rope_parameters=rope)
    model.config.max_position_embeddings = 64  # scaling starts past 64 positions
    model.model.rotary_emb.original_max_seq_len = 64
    rotary = Rotary(model.model.rotary_emb, torch.float32, torch.device("cpu"))
    x = torch.randn(3, 4, 16)
    for positions in (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 200])):
        with torch.inference_mode():
            cos, sin = model.model.rotary_emb(x, positions.unsqueeze(0))
            want, _ = apply_rotary_pos_emb(
                x.transpose(0, 1).unsqueeze(0), x.transpose(0, 1).unsqueeze(0), cos, sin
            )
            got = rotate(x, *rotary.at(positions, int(positions.max())))
        assert torch.equal(got, want[0].transpose(0, 1))
    assert rotary._table.shape[0] == 0  # nothing was tabulated


def test_a_rotary_type_per_layer_type_is_computed_for_each_step():
    model = _model("llama")
    model.model.rotary_emb.rope_type = {"full_attention": "default"}
    rotary = Rotary(model.model.rotary_emb, torch.float32, torch.device("cpu"))
    positions = torch.tensor([3, 9])
    cos, _ = rotary.at(positions, 9)
    want_cos, _ = model.model.rotary_emb(torch.empty(0), positions.unsqueeze(0))
    assert torch.equal(cos[:, 0], want_cos[0])
    assert rotary._table.shape[0] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("transposed", [False, True])
def test_prepared_layer_gives_the_modules_results(family, transposed):
    model = _model(family)
    layer = model.model.layers[0]
    x = torch.randn(16, model.config.hidden_size)
    attn_out = torch.randn(16, layer.self_attn.o_proj.in_features)
    with torch.inference_mode():
        want_attn = x + layer.self_attn.o_proj(attn_out)
        want_mlp = want_attn + layer.mlp(layer.post_attention_layernorm(want_attn))
        attn = layer.self_attn
        want_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        prepared = prepare_layer(layer, transposed)
        got_attn = prepared.attention_residual(x, attn_out)
        got_mlp = prepared.mlp_residual(got_attn)
        got_qkv = torch.nn.functional.linear(x, *prepared.qkv)
    torch.testing.assert_close(got_attn, want_attn, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_mlp, want_mlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_qkv, want_qkv, rtol=0, atol=1e-5)
    # the modules are views into the fused weights: nothing is held twice
    weight = prepared.qkv[0]
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    for linear in (attn.q_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert (linear.weight.stride(0) == 1) is transposed  # column-major storage


def test_column_major_keeps_shape_and_values():
    weight = torch.randn(5, 3)
    stored = column_major(weight)
    assert stored.shape == (5, 3) and stored.stride() == (1, 5)
    assert torch.equal(stored, weight)
