"""The model runner: owns the weights, the paged KV cache and the forward pass.

Weights and layer modules come from transformers (``AutoModelForCausalLM.from_pretrained``), so
any Llama / Qwen2 / Qwen3 / Mistral style decoder loads as is. The forward is ours: it walks the
model's own modules over a flat batch of tokens from many sequences; each layer's attention is
the attention backend's (``attention/``), chosen once here at start: it writes the layer's keys
and values into a preallocated pool of fixed-size blocks and attends over each sequence's
context. The runner keeps loading, KV pool sizing and the layer loop. ``step_inputs.py`` turns
a step's chunks into a flat batch; ``layers.py`` holds what a layer does around attention
(norms, rotary, projections, MLP), with the weights laid out for the device. Layers with a
sliding window (Mistral v0.1, Qwen2/Qwen3 with ``use_sliding_window``) make the same calls with
the window added to their masks; their K/V stays in the pool for the whole context (blocks
that fell out of every window are not given back early).

LoRA (``enable_lora``): the runner holds every device slot's adapter weights stacked per
layer (lora/apply.py) and reads one thing per step, the slot of each sequence; a step in which
no row uses an adapter runs exactly as without LoRA (and with ``--compile``, compiled).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.model_source import ModelSource
from tokenline.scheduler import attention
from tokenline.scheduler.attention import AttentionLayer, AttentionShape
from tokenline.scheduler.attention.decode_contexts import DecodeContexts
from tokenline.scheduler.layers import (
    DecoderLayer,
    Rotary,
    fits_layer_tail,
    layer_tail,
    prepare_layer,
    rms_norm,
    rotate,
)
from tokenline.scheduler.lora.adapters import ModelShape
from tokenline.scheduler.lora.apply import LayerDelta, LoraStep, LoraWeights
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.step_inputs import StepBatch, build_step_batch

log = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    """One step's inputs, built by `ModelRunner.prepare` for `ModelRunner.execute`."""

    chunks: list[Chunk]
    step: StepBatch
    metadata: object  # the attention backend's, for every layer
    cos: torch.Tensor  # [T, 1, D]: rotary tables at the step's positions
    sin: torch.Tensor
    lora: LoraStep | None = None  # each row's adapter slot; None: no row uses an adapter


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _layer_window(attention: torch.nn.Module, config) -> int | None:
    """The layer's sliding attention window as its transformers module applies it; None: the
    layer attends to the whole context."""
    if hasattr(attention, "sliding_window"):  # Qwen2, Qwen3: set per layer type
        return attention.sliding_window or None
    if getattr(config, "model_type", None) == "mistral":  # every layer, from the config
        return getattr(config, "sliding_window", None) or None
    return None


class ModelRunner:
    def __init__(
        self,
        source: ModelSource,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        torch_threads: int | None = None,
        dense_decode: bool = True,
        compile_layers: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        self.device = pick_device(device)
        if self.device.type == "cpu":
            # On CPU the model shares the machine with three other stages; threads that spin
            # against them cost more than they bring (see benchmarks/README.md).
            torch.set_num_threads(torch_threads or max(1, (os.cpu_count() or 2) - 1))
        self.dtype = pick_dtype(dtype, self.device)
        self.model = self._load_model(source)
        self.model.eval()
        config = self.model.config
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.num_blocks = self._size_pool(kv_cache_memory, gpu_memory_utilization)
        slots = self.num_blocks * block_size
        # Keys and values of a slot sit side by side, so one gather fetches both.
        shape = (self.num_layers, slots, 2 * self.num_kv_heads, self.head_dim)
        # Zeroed, not empty: batched decode reads masked padding slots, and a NaN there would
        # still poison the row (0 × NaN is NaN).
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        decoder = self.model.model
        self._embed = decoder.embed_tokens
        with torch.no_grad():
            transposed = self.device.type == "cpu"  # see layers.column_major
            self._layers = [prepare_layer(layer, transposed) for layer in decoder.layers]
        windows = [_layer_window(layer.self_attn, config) for layer in decoder.layers]
        if len({w for w in windows if w}) > 1:
            raise SystemExit(
                f"{source.spec}: its layers slide over different windows ({windows}); tokenline "
                "supports one window per model"
            )
        # A query at position i sees keys i - window < j <= i in the layers that slide.
        self.window = next((w for w in windows if w), None)
        self._slides = [w is not None for w in windows]
        self._attention_layers = [
            AttentionLayer(index, getattr(layer.self_attn, "scaling", None), slides)
            for index, (layer, slides) in enumerate(zip(decoder.layers, self._slides, strict=True))
        ]
        # Chosen once: how every step's attention is computed (attention/__init__.py).
        self.attention = attention.choose(
            attention.backend_name(attention_backend, self.device, dense_decode),
            AttentionShape(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                device=self.device,
                block_size=block_size,
                window=self.window,
            ),
            self.kv_cache,
        )
        self._norm = rms_norm(decoder.norm)
        self._rotary = Rotary(decoder.rotary_emb, self.dtype, self.device)
        self._lm_head = self.model.lm_head
        self.lora: LoraWeights | None = None  # enable_lora's device slots
        self.lora_shape = ModelShape.of([layer.module for layer in self._layers])
        if any(layer.gate_up is None for layer in self._layers):
            # MLPs the runner calls as modules get no deltas: adapters of them are refused
            dims = dict(self.lora_shape.dims)
            for module in ("gate_proj", "up_proj", "down_proj"):
                dims.pop(module, None)
            self.lora_shape = ModelShape(self.num_layers, dims)
        self._tail = None
        if compile_layers:
            if all(fits_layer_tail(f, config) for f in self._layers):
                # dynamic: one graph for every token count, shared by every layer
                self._tail = torch.compile(layer_tail, dynamic=True)
            else:
                log.warning(
                    "--compile: %s's layers are not Llama-style (RMSNorm, SiLU-gated MLP); "
                    "running them eagerly",
                    source.spec,
                )
        log.info(
            "runner: %s on %s/%s, KV pool %d blocks x %d tokens, attention %s",
            source.spec,
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
            self.attention.name,
        )

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraWeights:
        """Allocate ``max_loras`` zeroed device slots of rank ``max_rank`` for LoRA adapters."""
        self.lora = LoraWeights(
            self.lora_shape.dims, self.num_layers, max_loras, max_rank, self.dtype, self.device
        )
        return self.lora

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        """The whole model on the device (parallel/runner.py loads a rank's shard instead)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            source.path, revision=source.revision, dtype=self.dtype
        ).to(self.device)

    @property
    def compiled_layers(self) -> bool:
        """True when --compile took effect (the layers fit the compiled tail)."""
        return self._tail is not None

    @property
    def decode_contexts(self) -> DecodeContexts | None:
        """The dense decode rows, when the attention backend keeps them."""
        decode = getattr(self.attention, "decode", None)
        return getattr(decode, "contexts", None)

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def _size_pool(self, kv_cache_memory: int | None, utilization: float) -> int:
        if kv_cache_memory is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_memory = max(0, int(free - total * (1 - utilization)))
            else:
                kv_cache_memory = 512 * 2**20
        return max(2, kv_cache_memory // (self.bytes_per_token * self.block_size))

    # ── one forward pass ───────────────────────────────────────────────────────────────────────
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; return logits [rows that sample, vocab] in float32."""
        return self.forward_keeping(chunks, [])[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 of final hidden states kept by `forward_keeping`."""
        return self._lm_head(hidden).float()

    @torch.inference_mode()
    def forward_keeping(
        self, chunks: list[Chunk], spans: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final hidden states (after the last norm) of more token rows.

        ``spans``: (chunk index, offset of the first row within that chunk, rows). The hidden
        states come back [sum of the spans' rows, hidden size] in span order, for `logits`:
        kept rather than turned into logits here, so that the caller bounds how many rows of
        logits exist at once (a prompt's rows times the vocabulary can be gigabytes)."""
        return self.execute(self.prepare(chunks), spans)

    @torch.inference_mode()
    def prepare(self, chunks: list[Chunk]) -> PreparedStep:
        """A step's inputs: the flat batch, every layer's attention metadata and the rotary
        tables of its positions. The host work before the forward, timed apart from it."""
        step = build_step_batch(chunks, block_size=self.block_size, device=self.device)
        cos, sin = self._rotary.at(step.positions, step.max_position)  # [T, 1, D] each
        lora = None
        if self.lora is not None and any(c.seq.lora_slot >= 0 for c in chunks):
            slots = [s for c in chunks for s in [c.seq.lora_slot] * c.num_tokens]
            lora = self.lora.step(slots)
        return PreparedStep(chunks, step, self.attention.prepare(step), cos, sin, lora)

    @torch.inference_mode()
    def execute(
        self, prepared: PreparedStep, spans: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over prepared inputs: logits of the rows that sample, and the kept
        hidden states of ``spans`` (see `forward_keeping`)."""
        step, metadata, cos, sin = prepared.step, prepared.metadata, prepared.cos, prepared.sin
        hidden = self._embed(step.input_ids)  # [T, H]
        for index, layer in enumerate(self._layers):
            lora = None
            if prepared.lora is not None:
                lora = LayerDelta(self.lora.layers[index], prepared.lora)
            x = layer.input_norm(hidden)
            attn_out = self._attention(index, layer, x, cos, sin, metadata, lora)
            if lora is not None:  # the compiled tail has no LoRA deltas
                hidden = layer.mlp_residual(layer.attention_residual(hidden, attn_out, lora), lora)
                continue
            if self._tail is not None:
                module = layer.module
                norm, mlp = module.post_attention_layernorm, module.mlp
                hidden = self._tail(
                    hidden,
                    attn_out,
                    (module.self_attn.o_proj.weight, module.self_attn.o_proj.bias),
                    norm.weight,
                    norm.variance_epsilon,
                    layer.gate_up,
                    (mlp.down_proj.weight, mlp.down_proj.bias),
                )
                continue
            hidden = layer.mlp_residual(layer.attention_residual(hidden, attn_out))
        rows = step.sample_rows
        if spans:
            starts = [0]
            for chunk in prepared.chunks:
                starts.append(starts[-1] + chunk.num_tokens)
            kept = [starts[k] + first + i for k, first, n in spans for i in range(n)]
            rows = torch.cat((rows, torch.tensor(kept, dtype=torch.long, device=self.device)))
        hidden = self._norm(hidden.index_select(0, rows))
        sampling = step.sample_rows.shape[0]
        return self._lm_head(hidden[:sampling]).float(), hidden[sampling:]

    def _attention(
        self, index, layer: DecoderLayer, hidden, cos, sin, metadata, lora: LayerDelta | None
    ) -> torch.Tensor:
        """Project and rotate this layer's q, k, v; the backend stores k, v and attends."""
        tokens = hidden.shape[0]
        heads = self.num_heads
        qk_size = (heads + self.num_kv_heads) * self.head_dim
        qkv = F.linear(hidden, *layer.qkv)
        if lora is not None:
            qkv = lora.add("qkv", qkv, hidden)
        qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: q and k are normalised apart, then rotated
            q = rotate(layer.q_norm(qk[:, :heads]), cos, sin)
            k = rotate(layer.k_norm(qk[:, heads:]), cos, sin)
        else:
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        # o_proj: the caller's
        return self.attention.forward(q, k, v, self._attention_layers[index], metadata)

    def release_decode_contexts(self) -> None:
        """The engine is idle: the attention backend gives back what it keeps between steps
        (the dense decode rows)."""
        self.attention.release()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
