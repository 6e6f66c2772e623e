"""An EAGLE-3 head in the format vLLM and SGLang load (vLLM's ``LlamaForCausalLMEagle3``,
SpecForge's checkpoints): one Llama decoder layer over the target's hidden states, guessing
the token after each position. Written from vLLM's ``llama_eagle3.py`` and speculators'
``Eagle3DecoderLayer``.

The checkpoint (speculators' format is read as vLLM reads it, `from_speculators`):
``config.json`` (a Llama config of one layer, with ``draft_vocab_size`` and
optionally ``norm_before_residual`` and the target layers it reads,
``eagle_aux_hidden_state_layer_ids`` or ``eagle_config``'s) and the tensors ``fc`` ([hidden,
3 * hidden]: the target's three auxiliary hidden states, side by side, to one),
``midlayer.*`` (the layer), ``norm``, ``lm_head`` ([draft_vocab_size, hidden]; absent: the
target's, over the same vocabulary), ``d2t`` (target id = draft id + ``d2t[draft id]``;
absent: the same ids) and optionally ``embed_tokens`` (absent: the target's embedding).

A row at position ``p`` reads the token at ``p + 1`` and a hidden state ``h``: at the target's
positions, ``fc`` of the target's auxiliary states at ``p``; at the head's own guesses, its
own output (before the final norm) at ``p - 1``. Its layer computes

    residual = h;  x = cat(input_layernorm(embed(token)), hidden_norm(h))
    h = residual + o_proj(attention(rotary(q, k, v of x)))     # K/V kept per sequence
    out = h + mlp(post_attention_layernorm(h))                 # the next row's hidden state
    guess = d2t(argmax(lm_head(norm(out))))

(``norm_before_residual``: the residual is ``hidden_norm(h)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from tokenline.scheduler.layers.rotary import RopeFrequencies, Rotary, rotate
from tokenline.scheduler.models.llama import head_dim_of
from tokenline.scheduler.speculative.whole_vocabulary import MissingVocabulary, whole_vocabulary

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER = "layers.0."  # vLLM's name for the checkpoints' ``midlayer.``
_OWN = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"}
REQUIRED = ["fc.weight", "norm.weight"] + [
    _LAYER + name + ".weight"
    for name in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )
]  # fmt: skip


class HeadRefused(ValueError):
    """The head cannot be served beside this target; the message says why and what to do."""


class HeadCache:
    """One sequence's keys (rotated) and values in the head's one layer, rows in position
    order; `truncate` rolls guesses back."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.k = torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            size = max(need, 2 * self.k.shape[0], 64)
            grown_k = self.k.new_empty(size, *self.k.shape[1:])
            grown_v = self.v.new_empty(size, *self.v.shape[1:])
            grown_k[: self.length] = self.k[: self.length]
            grown_v[: self.length] = self.v[: self.length]
            self.k, self.v = grown_k, grown_v
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def aux_layer_ids(config: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads, as vLLM picks them:
    the config's ids, else (2, num_layers // 2, num_layers - 3)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    eagle = config.get("eagle_config")
    if not ids and isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in ids):
        raise HeadRefused(
            f"its auxiliary layers {list(ids)} are not layers of the target (0 to "
            f"{num_layers - 1}); set eagle_aux_hidden_state_layer_ids in its config.json"
        )
    return ids


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (safetensors, sharded or not, or a PyTorch
    ``.bin``, read as plain tensors), by name without a leading ``model.``, with
    ``midlayer.`` read as vLLM reads it (``layers.0.``)."""
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors |= load_file(file)
    else:
        for file in sorted(path.glob("*.bin")):
            tensors |= torch.load(file, map_location="cpu", weights_only=True)
    if not tensors:
        raise HeadRefused(f"{path} has no weights (*.safetensors or *.bin)")
    named = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.").replace("midlayer.", _LAYER)
        named[name] = tensor
    return named


class Eagle3Head:
    """The head's weights on the target's device and dtype, and its forward over rows of one
    sequence (`forward`) and guess from a row's output (`guess`)."""

    def __init__(
        self,
        config,
        tensors: dict[str, torch.Tensor],
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        aux_layers: tuple[int, ...],
    ) -> None:
        self.aux_layers = aux_layers  # the target layers it reads, in layer order
        self.hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.eps = config.rms_norm_eps
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.act = ACT2FN[config.hidden_act]
        self.dtype, self.device = dtype, device
        self.w = {  # what the head computes with (not t2d, nor speculators' verifier_*)
            n: t.to(device=device, dtype=dtype)
            for n, t in tensors.items()
            if n.startswith(_LAYER) or n in _OWN
        }
        d2t = tensors.get("d2t")
        self.d2t = None if d2t is None else d2t.to(device=device, dtype=torch.long)
        self.fc = self.w["fc.weight"]
        self.embed, self.lm_head = embed, lm_head  # the target's, unless the head has its own
        if "embed_tokens.weight" in self.w:
            self.embed = lambda ids: F.embedding(ids, self.w["embed_tokens.weight"])
        if "lm_head.weight" in self.w:
            self.lm_head = lambda x: F.linear(x, self.w["lm_head.weight"])
        self.rotary = Rotary(RopeFrequencies(config).to(device), dtype, device)

    def new_cache(self) -> HeadCache:
        return HeadCache(self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states ([rows, 3 * hidden]) as the head reads them."""
        return F.linear(aux.to(self.dtype), self.fc)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.w[name]  # transformers' LlamaRMSNorm: in float32, weight after rounding
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def forward(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache
    ) -> torch.Tensor:
        """The layer's output (before the final norm) at rows of one sequence, in position
        order after every row ``cache`` holds; their K/V join ``cache``."""
        rows, layer = token_ids.shape[0], _LAYER
        hidden = hidden.to(self.dtype)
        normed = self._norm(hidden, layer + "hidden_norm.weight")
        residual = normed if self.norm_before_residual else hidden
        embeds = self._norm(self.embed(token_ids).to(self.dtype), layer + "input_layernorm.weight")
        x = torch.cat((embeds, normed), dim=-1)
        attn = layer + "self_attn."
        q = self._linear(x, attn + "q_proj").view(rows, self.num_heads, self.head_dim)
        k = self._linear(x, attn + "k_proj").view(rows, self.num_kv_heads, self.head_dim)
        v = self._linear(x, attn + "v_proj").view(rows, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary.at(positions, int(positions.max()))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        start = cache.length
        cache.append(k, v)
        keys, values = cache.k[: cache.length], cache.v[: cache.length]
        mask = None
        if rows > 1:  # each new row sees the rows before it, its own included
            seen = start + torch.arange(rows, device=self.device).unsqueeze(1)
            mask = torch.arange(cache.length, device=self.device).unsqueeze(0) <= seen
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )[0].transpose(0, 1)
        h = residual + self._linear(out.reshape(rows, -1), attn + "o_proj")
        mlp = layer + "mlp."
        m = self._norm(h, layer + "post_attention_layernorm.weight")
        gated = self.act(self._linear(m, mlp + "gate_proj")) * self._linear(m, mlp + "up_proj")
        return h + self._linear(gated, mlp + "down_proj")

    def guess(self, out: torch.Tensor) -> int:
        """The target id of the head's greedy guess from one row's output."""
        logits = self.lm_head(self._norm(out, "norm.weight"))
        draft = int(logits.reshape(-1).argmax())
        return draft if self.d2t is None else draft + int(self.d2t[draft])


def local_copy(path: str) -> Path:
    """The head's directory: ``path`` itself, or a Hugging Face id's files in its cache
    (start.py has fetched URIs already)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "*.bin"]
        return Path(snapshot_download(path, allow_patterns=patterns))
    except Exception as exc:  # any failure to fetch is the same refusal, with its reason
        raise HeadRefused(
            f"it is neither a directory nor a Hugging Face repository that can be fetched "
            f"({type(exc).__name__}: {exc})"
        ) from None


def from_speculators(raw: dict) -> dict:
    """A head config in speculators' format (``speculators_model_type``) as vLLM reads it
    (its ``update_eagle3``): the layer's Llama config with the EAGLE-3 fields on top, where
    ``norm_before_residual`` is on unless the config says otherwise."""
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise HeadRefused(f"it is a speculators {kind!r} model, not an EAGLE-3 head")
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise HeadRefused(
            f"its layer is a {layer.get('model_type')} layer; tokenline runs Llama-layer heads"
        )
    unread = [key for key in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(key)]
    if unread:
        raise HeadRefused(f"it sets {unread}, which tokenline's head does not compute yet")
    layer["architectures"] = [ARCHITECTURES[0]]
    layer["draft_vocab_size"] = raw.get("draft_vocab_size")
    layer["norm_before_residual"] = raw.get("norm_before_residual", True)
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            layer[key] = raw[key]
    return layer


def load_head(path: str, target) -> Eagle3Head:
    """The EAGLE-3 head at ``path`` for ``target`` (a `ModelRunner`); `HeadRefused` says why
    it cannot serve beside it."""
    import transformers

    root = local_copy(path)
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise HeadRefused(f"its config.json cannot be read ({exc})") from None
    if "speculators_model_type" in raw:
        raw = from_speculators(raw)
    architecture = (raw.get("architectures") or ["(none)"])[0]
    if architecture not in ARCHITECTURES:
        raise HeadRefused(
            f"its architecture {architecture} is not an EAGLE-3 head tokenline runs (it runs "
            f"{', '.join(ARCHITECTURES)}, and speculators' eagle3)"
        )
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise HeadRefused("it reads no auxiliary hidden states (use_aux_hidden_state false)")
    if raw.get("num_hidden_layers", 1) != 1:
        raise HeadRefused(
            f"it has {raw['num_hidden_layers']} layers; tokenline runs EAGLE-3 heads of one"
        )
    model = target.model
    text = model.text_config
    if not getattr(model, "captures_aux", False):
        raise HeadRefused(
            f"the target {model.describe()} does not hand its hidden states to a head (the "
            "native Llama, Mistral, Qwen2, Qwen3 and their MoE modules do); speculate with "
            '"ngram" or "draft_model" there'
        )
    target_hidden = int(text.hidden_size)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = transformers.LlamaConfig(**fields)
    hidden = int(config.hidden_size)
    if hidden != target_hidden or raw.get("target_hidden_size", hidden) != target_hidden:
        raise HeadRefused(
            f"its hidden size is {hidden} and the target's {target_hidden}: a head is trained "
            "for one target; use the head made for this model"
        )
    if int(config.vocab_size) != model.vocab_size:
        raise HeadRefused(
            f"its vocabulary has {config.vocab_size} tokens and the target's "
            f"{model.vocab_size}: use the head made for this model"
        )
    aux = aux_layer_ids(raw, len(model.geometry.layers))
    tensors = read_tensors(root)
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise HeadRefused(f"its checkpoint lacks {missing}: not an EAGLE-3 head's weights")
    fc = tensors.get("fc.weight")
    width = len(set(aux)) * target_hidden
    if fc is None or tuple(fc.shape) != (hidden, width):
        raise HeadRefused(
            f"its fc weight is {None if fc is None else list(fc.shape)}, not [{hidden}, {width}] "
            f"for the target layers {sorted(set(aux))}"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None and draft_vocab != model.vocab_size:
        raise HeadRefused(f"it has no lm_head for its draft vocabulary of {draft_vocab}")
    if lm_head is not None and lm_head.shape[0] != draft_vocab:
        raise HeadRefused(f"its lm_head has {lm_head.shape[0]} rows, not {draft_vocab}")
    d2t = tensors.get("d2t")
    if d2t is None and draft_vocab != model.vocab_size:
        raise HeadRefused("it has a smaller vocabulary than the target's and no d2t to map it")
    targets = None if d2t is None else d2t + torch.arange(d2t.shape[0])
    if targets is not None and (
        d2t.shape[0] != draft_vocab
        or int(targets.max()) >= model.vocab_size
        or int(targets.min()) < 0
    ):
        raise HeadRefused("its d2t does not map its draft vocabulary into the target's")
    embed, head_logits = model.model.embed_tokens, model.lm_head
    if model.place.tp is not None:  # the target's vocabulary is split; only rank 0 guesses
        try:
            whole = whole_vocabulary(
                target, embed="embed_tokens.weight" not in tensors, lm_head=lm_head is None
            )
        except MissingVocabulary as exc:
            raise HeadRefused(str(exc)) from None
        embed, head_logits = whole[0] or embed, whole[1] or head_logits
    return Eagle3Head(
        config,
        tensors,
        embed,
        head_logits,
        target.dtype,
        target.device,
        tuple(sorted(set(aux))),  # vLLM keeps them in layer order, each once
    )
