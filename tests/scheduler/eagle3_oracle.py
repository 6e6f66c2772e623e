"""For the EAGLE-3 tests: random heads in SpecForge's checkpoint format (vLLM's
``LlamaForCausalLMEagle3``), and an oracle that computes a head's greedy proposals the way
speculators' PyTorch head does (its ``Eagle3DecoderLayer`` and ``Eagle3Attention``: the whole
row sequence each time, eager attention with a float32 softmax, transformers' Llama norm, MLP
and rotary) with vLLM's ``d2t`` mapping of the logits, from the target's hidden states as
transformers computes them (``output_hidden_states``: entry ``i`` enters layer ``i``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_head(
    out: Path,
    target: dict,
    *,
    draft_vocab: int,
    d2t: torch.Tensor | None = None,
    seed: int = 0,
    aux: tuple[int, ...] | None = (1, 2, 3),
    own_embedding: bool = False,
    hidden: int | None = None,
    architecture: str = "LlamaForCausalLMEagle3",
    speculators: bool = False,
    fc_inputs: int = 3,  # the target hidden states its fc reads (vLLM's heads: three)
) -> Path:
    """A random head for ``target`` (its config.json, as a dict) in a new directory; in
    speculators' format (its config, ``layers.0.``, ``norm_before_residual`` on) with
    ``speculators``."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h = hidden or target["hidden_size"]
    heads, kv, dim = target["num_attention_heads"], target["num_key_value_heads"], 64
    inter = 2 * h

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=g) * scale

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(size, generator=g)

    layer = "layers.0." if speculators else "midlayer."
    tensors = {
        "fc.weight": rand(h, fc_inputs * target["hidden_size"]),
        layer + "input_layernorm.weight": norm(h),
        layer + "hidden_norm.weight": norm(h),
        layer + "post_attention_layernorm.weight": norm(h),
        layer + "self_attn.q_proj.weight": rand(heads * dim, 2 * h),
        layer + "self_attn.k_proj.weight": rand(kv * dim, 2 * h),
        layer + "self_attn.v_proj.weight": rand(kv * dim, 2 * h),
        layer + "self_attn.o_proj.weight": rand(h, heads * dim),
        layer + "mlp.gate_proj.weight": rand(inter, h),
        layer + "mlp.up_proj.weight": rand(inter, h),
        layer + "mlp.down_proj.weight": rand(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": rand(draft_vocab, h, scale=1.0),
    }
    if d2t is not None:
        tensors["d2t"] = d2t
        t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + d2t] = True
        tensors["t2d"] = t2d
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(target["vocab_size"], h, scale=1.0)
    config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    if speculators:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3"},
            "draft_vocab_size": config.pop("draft_vocab_size"),
            "eagle_aux_hidden_state_layer_ids": list(aux or ()),
            "transformer_layer_config": config,
        }
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


class OracleHead(torch.nn.Module):
    """A head computed as speculators' PyTorch implementation computes it (written from its
    ``Eagle3DecoderLayer``/``Eagle3Attention``; no KV cache: every row again each guess)."""

    def __init__(self, path: Path) -> None:
        import transformers
        from safetensors.torch import load_file
        from transformers.models.llama import modeling_llama as llama

        super().__init__()
        raw = json.loads((path / "config.json").read_text())
        # speculators' format: its layer's config, and norm_before_residual on by default
        self.norm_before_residual = raw.get("norm_before_residual", "speculators_model_type" in raw)
        if "speculators_model_type" in raw:
            raw = raw["transformer_layer_config"] | {"draft_vocab_size": raw["draft_vocab_size"]}
        self.config = config = transformers.LlamaConfig(**raw)
        h, self.heads, self.kv = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.dim, eps = config.head_dim, config.rms_norm_eps
        linear = torch.nn.Linear
        self.fc = linear(3 * h, h, bias=False)
        self.input_layernorm = llama.LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = llama.LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = llama.LlamaRMSNorm(h, eps=eps)
        self.q_proj = linear(2 * h, self.heads * self.dim, bias=False)
        self.k_proj = linear(2 * h, self.kv * self.dim, bias=False)
        self.v_proj = linear(2 * h, self.kv * self.dim, bias=False)
        self.o_proj = linear(self.heads * self.dim, h, bias=False)
        self.mlp = llama.LlamaMLP(config)
        self.norm = llama.LlamaRMSNorm(h, eps=eps)
        self.lm_head = linear(h, raw["draft_vocab_size"], bias=False)
        self.rotary = llama.LlamaRotaryEmbedding(config)
        self.apply_rotary, self.repeat_kv = llama.apply_rotary_pos_emb, llama.repeat_kv
        state = load_file(path / "model.safetensors")
        self.d2t = state.pop("d2t", None)
        state.pop("t2d", None)
        self.embed = state.pop("embed_tokens.weight", None)
        names = {
            k: k.replace("midlayer.", "").replace("layers.0.", "").replace("self_attn.", "")
            for k in state
        }
        self.load_state_dict({names[k]: v for k, v in state.items()})
        self.vocab = config.vocab_size

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """speculators' Eagle3DecoderLayer over rows [1, L, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        length = x.shape[1]
        q = self.q_proj(x).view(1, length, self.heads, self.dim).transpose(1, 2)
        k = self.k_proj(x).view(1, length, self.kv, self.dim).transpose(1, 2)
        v = self.v_proj(x).view(1, length, self.kv, self.dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = self.apply_rotary(q, k, cos, sin)
        k, v = self.repeat_kv(k, self.heads // self.kv), self.repeat_kv(v, self.heads // self.kv)
        weights = q @ k.transpose(2, 3) / math.sqrt(self.dim)
        causal = torch.full((length, length), float("-inf")).triu(1)
        weights = torch.softmax(weights + causal, dim=-1, dtype=torch.float32)
        attn = (weights @ v).transpose(1, 2).reshape(1, length, -1)
        h = residual + self.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """vLLM's compute_logits: the draft vocabulary's logits placed at their target ids."""
        logits = self.lm_head(self.norm(out))
        if self.d2t is None:
            return logits
        full = logits.new_full((self.vocab,), float("-inf"))
        full[torch.arange(logits.shape[-1]) + self.d2t] = logits
        return full

    @torch.no_grad()
    def propose(self, tokens: list[int], aux: torch.Tensor, embed: torch.Tensor, k: int):
        """``k`` greedy guesses after ``tokens``; ``aux``: the target's auxiliary states of
        positions 0..len(tokens) - 2, [rows, 3 * hidden]."""
        embed = self.embed if self.embed is not None else embed
        ids = torch.tensor(tokens[1:])
        hidden = self.fc(aux)
        positions = torch.arange(len(tokens) - 1)
        guesses: list[int] = []
        for _ in range(k):
            out = self.layer(embed[ids][None], hidden[None], positions[None])[0]
            guess = int(self.logits(out[-1]).argmax())
            guesses.append(guess)
            ids = torch.cat([ids, torch.tensor([guess])])
            hidden = torch.cat([hidden, out[-1:]])
            positions = torch.cat([positions, positions[-1:] + 1])
        return guesses


@torch.no_grad()
def target_aux(model, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """transformers' residual stream entering ``layers`` at every position of ``tokens``."""
    out = model(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
