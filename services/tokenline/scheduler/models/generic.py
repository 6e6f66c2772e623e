"""Any other transformers decoder, run by transformers' own modules with tokenline's paged
attention (vLLM's Transformers backend does the same): ``--model-impl transformers``, or
``auto`` for an architecture without a native module.

tokenline's attention is registered as an attention implementation
(``AttentionInterface.register``); the model is loaded with it, so every attention module hands
its rotated q, k and v to the step's attention backend, which writes K/V into the paged pool and
attends each row over its own sequence. The rest of the model (embeddings, norms, MLPs, MoE,
multipliers, logit scaling) is the family's code as it is. A whole step is one flat sequence of
token rows for transformers, so the sequences stay apart only if nothing but attention mixes
positions; `check_batch_exact` proves that for the model at hand before it serves.

At load a probe forward records what each layer asks of attention (its index, scale, window);
a model is refused when a layer asks for what the backends do not compute (soft-capped scores,
attention sinks, bidirectional attention), when not every layer attends through the interface
(recurrent or linear-attention layers keep state of their own), or when loading left a weight
missing or unused.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.model_source import ModelSource
from tokenline.scheduler.attention import AttentionLayer
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.models.base import CausalLM, Geometry

log = logging.getLogger(__name__)
ATTENTION = "tokenline_paged"
_OWNER = "_tokenline_owner"  # set on every module of a loaded model: who answers its attention


def _paged_attention(module, query, key, value, attention_mask, **kwargs):
    owner = module.__dict__.get(_OWNER)
    if owner is None:
        raise RuntimeError(f"{type(module).__name__} was not loaded by tokenline")
    return owner.attend(module, query, key, value, kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _paged_attention)


@dataclass(frozen=True)
class _Call:
    """What one attention call asked for, recorded by the probe."""

    layer_idx: int
    scale: float | None
    window: int | None
    num_heads: int
    num_kv_heads: int
    head_dim: int


class _GivenHidden(torch.nn.Module):
    """Stands in for the decoder under the LM head: hands back the hidden states it is given,
    so the family's own ``forward`` turns them into logits (Granite's scaling, Gemma's cap)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


class TransformersCausalLM(CausalLM):
    implementation = "transformers"

    def __init__(self, source: ModelSource, config, place: Placement) -> None:
        super().__init__(config, place)
        if place.tp is not None:
            raise ModelRefused(
                f"{self.architecture} runs on transformers' modules, which tokenline does not "
                "shard: tensor parallelism needs a native module"
            )
        _register()
        from transformers import AutoModelForCausalLM

        try:
            hf, info = AutoModelForCausalLM.from_pretrained(
                source.path,
                revision=source.revision,
                dtype=place.dtype,
                attn_implementation=ATTENTION,
                output_loading_info=True,
            )
        except (ValueError, KeyError, OSError) as exc:
            raise ModelRefused(f"transformers cannot load it with paged attention: {exc}") from exc
        left = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
        if left or info.get("error_msgs"):
            raise ModelRefused(f"loading left weights unmatched: {left or info['error_msgs']}")
        self.hf = hf.to(place.device).eval()
        for module in self.hf.modules():
            module.__dict__[_OWNER] = self
        self.decoder = getattr(self.hf, self.hf.base_model_prefix)
        # the LM head's view of the model: its own forward over hidden states given to it
        self._given = _GivenHidden()
        self._head = copy.copy(self.hf)
        self._head._modules = dict(self.hf._modules)
        self._head._modules[self.hf.base_model_prefix] = self._given
        self._head_logits = self._plain_head  # or `_family_head`: chosen by the probe
        self._context: ForwardContext | None = None
        self._calls: list[_Call] | None = None
        self.geometry = self._probe()
        self._layers = {layer.index: layer for layer in self.geometry.layers}

    # ── attention, called by transformers' modules ────────────────────────────────────────
    def attend(self, module, query, key, value, kwargs: dict) -> tuple[torch.Tensor, None]:
        """``query`` ``[1, heads, T, D]``, ``key``/``value`` ``[1, kv_heads, T, D]`` in,
        ``[1, T, heads, D]`` out."""
        window = kwargs.get("sliding_window")
        if self._calls is not None:  # the probe: record, and attend as transformers would
            return self._reference(module, query, key, value, kwargs)
        context = self._context
        if context is None:
            raise RuntimeError("attention outside a tokenline forward")
        layer = self._layers[module.layer_idx]
        if bool(window) != layer.slides:
            raise RuntimeError(f"layer {module.layer_idx} changed its window to {window}")
        tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
        q = query[0].transpose(0, 1)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        out = context.attention.forward(q, k, v, layer, context.metadata)
        return out.view(1, tokens, heads, dim), None

    def _reference(self, module, query, key, value, kwargs):
        unsupported = {
            name: kwargs[name]
            for name in ("softcap", "s_aux", "sinks")
            if kwargs.get(name) is not None
        }
        if unsupported:
            raise ModelRefused(
                f"layer {module.layer_idx} asks attention for {sorted(unsupported)}, which "
                "tokenline's attention kernels do not compute"
            )
        if getattr(module, "is_causal", True) is False:
            raise ModelRefused(f"layer {module.layer_idx} attends both ways (not causal)")
        scale, window = kwargs.get("scaling"), kwargs.get("sliding_window") or None
        self._calls.append(
            _Call(module.layer_idx, scale, window, query.shape[1], key.shape[1], query.shape[3])
        )
        length = query.shape[2]
        pos = torch.arange(length, device=query.device)
        visible = pos.unsqueeze(0) <= pos.unsqueeze(1)
        if window:
            visible &= pos.unsqueeze(0) > pos.unsqueeze(1) - window
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=visible, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2), None

    def _probe(self) -> Geometry:
        """One forward of a few tokens, recording every attention call, and the way the family
        turns hidden states into logits."""
        self._calls = []
        try:
            ids = (torch.arange(4, device=self.place.device) % self.vocab_size).tolist()
            want = self.reference_logits(ids)
            calls = self._calls
            self._calls = []  # the head's check attends as the reference does, unrecorded
            self._choose_head(ids, want)
        finally:
            self._calls = None
        layers = sorted({c.layer_idx for c in calls})
        expected = getattr(self.text_config, "num_hidden_layers", len(layers))
        if len(calls) != len(layers) or len(layers) != expected:
            raise ModelRefused(
                f"{len(calls)} attention calls over {len(layers)} of its {expected} layers: "
                "layers that keep state of their own (recurrent, linear attention) or share "
                "another layer's K/V are not served"
            )
        shapes = {(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}
        if len(shapes) > 1:
            raise ModelRefused(f"its layers have different attention shapes: {sorted(shapes)}")
        (heads, kv_heads, head_dim) = shapes.pop()
        by_layer = {c.layer_idx: c for c in calls}
        return Geometry(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            layers=tuple(
                AttentionLayer(i, by_layer[idx].scale, by_layer[idx].window is not None)
                for i, idx in enumerate(layers)
            ),
            windows=tuple(by_layer[idx].window for idx in layers),
        )

    def graph_refusal(self) -> str:
        return "it runs on transformers' modules, whose steps are not captured"

    # ── the runner's calls ────────────────────────────────────────────────────────────────
    def forward(
        self, input_ids: torch.Tensor, context: ForwardContext, rows: torch.Tensor
    ) -> torch.Tensor:
        self._context = context
        try:
            out = self.decoder(
                input_ids=input_ids.unsqueeze(0),
                position_ids=context.positions.unsqueeze(0),
                use_cache=False,
            )
        finally:
            self._context = None
        return out.last_hidden_state[0].index_select(0, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head_logits(hidden)

    def _plain_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(hidden).float()

    def _family_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The family's own ``forward`` after its decoder: Granite's logit scaling, Gemma's cap."""
        self._given.hidden = hidden.unsqueeze(0)
        try:
            return self._head(input_ids=None, use_cache=False).logits[0].float()
        finally:
            self._given.hidden = None

    @torch.inference_mode()
    def _choose_head(self, ids: list[int], want: torch.Tensor) -> None:
        """The LM head alone where it gives the model's logits, else the family's forward over
        given hidden states; refused when neither does."""
        tokens = torch.tensor([ids], device=self.place.device)
        hidden = self.decoder(input_ids=tokens, use_cache=False).last_hidden_state[0, -1:]
        for head in (self._plain_head, self._family_head):
            try:
                got = head(hidden)[0]
            except (AttributeError, TypeError, ValueError):
                continue  # a family whose forward wants more than hidden states
            if torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                self._head_logits = head
                return
        raise ModelRefused(
            "its logits are not its LM head's over its hidden states, nor its own forward's "
            "over given hidden states"
        )

    @torch.inference_mode()
    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        """The model's own forward over one sequence (attention as transformers computes it):
        the last position's logits."""
        calls = self._calls
        if calls is None:
            self._calls = []  # attend as the reference does, recording nothing kept
        try:
            out = self.hf(input_ids=torch.tensor([ids], device=self.place.device), use_cache=False)
        finally:
            self._calls = calls
        return out.logits[0, -1].float()


def check_batch_exact(runner) -> None:
    """Refuse the model unless a step of two sequences gives each the logits of the model's
    own forward over it alone, for their prompts (one step, two chunks) and for a decode token
    each (one step, their K/V read back from the pool). A model that mixes positions outside
    attention (a convolution, a recurrent layer) fails here instead of serving wrong text."""
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence

    model = runner.model
    vocab, block = model.vocab_size, runner.block_size
    prompts = [[(37 * i + 11) % vocab for i in range(7)], [(53 * i + 5) % vocab for i in range(5)]]
    seqs, next_block = [], 0
    for n, ids in enumerate(prompts):
        seq = Sequence(f"check-{n}", list(ids), SamplingParams(max_tokens=1), max_tokens=1)
        blocks = -(-(len(ids) + 1) // block)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    if next_block > runner.num_blocks:
        raise ModelRefused("the KV pool is too small to check the model before serving it")
    tolerance = 1e-3 if runner.dtype == torch.float32 else 5e-2
    try:
        for step in range(2):
            if step == 0:
                chunks = [Chunk(s, 0, len(s.prompt_ids)) for s in seqs]
            else:
                chunks = [Chunk(s, s.num_tokens - 1, 1) for s in seqs]
            got = runner.forward(chunks)
            for seq, row in zip(seqs, got, strict=True):
                want = model.reference_logits(seq.prompt_ids + seq.output_ids)
                error = float((row - want).abs().max())
                if not error <= tolerance * max(float(want.std()), 1e-6):
                    raise ModelRefused(
                        f"its logits in a batch of two sequences differ from its own forward "
                        f"over each alone (max error {error:.3g}): something outside attention "
                        "mixes positions, and tokenline's flat batches would serve it wrong"
                    )
                seq.num_computed = seq.num_tokens
                seq.output_ids.append(int(want.argmax()))
    finally:
        runner.release_decode_contexts()
