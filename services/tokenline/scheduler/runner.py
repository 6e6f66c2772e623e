"""The model runner: owns the weights, the paged KV cache and the forward pass.

Weights and layer modules come from transformers (``AutoModelForCausalLM.from_pretrained``), so
any Llama / Qwen2 / Qwen3 / Mistral style decoder loads as is. The forward is ours: it walks the
model's own modules over a flat batch of tokens from many sequences, writes each layer's keys
and values into a preallocated pool of fixed-size blocks, and attends over each sequence's
blocks. Per layer, decoding sequences share one attention call (on CPU over dense copies of
their contexts, ``decode_contexts.py``), chunks that start a prompt share another, and chunks
that continue a prompt get one each. ``step_inputs.py`` turns a step's chunks into tensors;
``layers.py`` holds what a layer does around attention (norms, rotary, projections, MLP), with
the weights laid out for the device. Layers with a sliding window (Mistral v0.1, Qwen2/Qwen3
with ``use_sliding_window``) make the same calls with the window added to their masks; their
K/V stays in the pool for the whole context (blocks that fell out of every window are not
given back early).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from tokenline.model_source import ModelSource
from tokenline.scheduler.decode_contexts import DecodeContexts
from tokenline.scheduler.layers import (
    DecoderLayer,
    Rotary,
    fits_layer_tail,
    layer_tail,
    prepare_layer,
    rms_norm,
    rotate,
)
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.step_inputs import FirstChunks, StepInputs, build_step_inputs

log = logging.getLogger(__name__)


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


def _decode_mask(slides: bool, full: torch.Tensor, windowed: torch.Tensor | None) -> torch.Tensor:
    """A sliding layer's mask when its window hides anything this step; else the full one."""
    return windowed if slides and windowed is not None else full


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
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = pick_device(device)
        if self.device.type == "cpu":
            # On CPU the model shares the machine with three other stages; threads that spin
            # against them cost more than they bring (see benchmarks/README.md).
            torch.set_num_threads(torch_threads or max(1, (os.cpu_count() or 2) - 1))
        self.dtype = pick_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            source.path, revision=source.revision, dtype=self.dtype
        ).to(self.device)
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
        self.decode_contexts = None
        if self.device.type == "cpu" and dense_decode:
            self.decode_contexts = DecodeContexts(
                self.num_layers, 2 * self.num_kv_heads, self.head_dim, self.dtype
            )
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
        self._norm = rms_norm(decoder.norm)
        self._rotary = Rotary(decoder.rotary_emb, self.dtype, self.device)
        self._lm_head = self.model.lm_head
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
            "runner: %s on %s/%s, KV pool %d blocks x %d tokens",
            source.spec,
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
        )

    @property
    def compiled_layers(self) -> bool:
        """True when --compile took effect (the layers fit the compiled tail)."""
        return self._tail is not None

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
        step = build_step_inputs(
            chunks,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            kv_cache=self.kv_cache,
            decode_contexts=self.decode_contexts,
            window=self.window,
        )
        hidden = self._embed(step.input_ids)  # [T, H]
        cos, sin = self._rotary.at(step.positions, step.max_position)  # [T, 1, D] each
        for index, layer in enumerate(self._layers):
            attn_out = self._attention(index, layer, layer.input_norm(hidden), cos, sin, step)
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
            for chunk in chunks:
                starts.append(starts[-1] + chunk.num_tokens)
            kept = [starts[k] + first + i for k, first, n in spans for i in range(n)]
            rows = torch.cat((rows, torch.tensor(kept, dtype=torch.long, device=self.device)))
        hidden = self._norm(hidden.index_select(0, rows))
        sampling = step.sample_rows.shape[0]
        return self._lm_head(hidden[:sampling]).float(), hidden[sampling:]

    def _attention(
        self, index, layer: DecoderLayer, hidden, cos, sin, step: StepInputs
    ) -> torch.Tensor:
        attn = layer.module.self_attn
        tokens = hidden.shape[0]
        heads = self.num_heads
        qk_size = (heads + self.num_kv_heads) * self.head_dim
        qkv = F.linear(hidden, *layer.qkv)
        qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: q and k are normalised apart, then rotated
            q = rotate(layer.q_norm(qk[:, :heads]), cos, sin)
            k = rotate(layer.k_norm(qk[:, heads:]), cos, sin)
        else:
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        pool = self.kv_cache[index]
        new_kv = torch.cat((k, v), dim=1).to(self.dtype)  # [T, 2 * kv_heads, D]
        pool.index_copy_(0, step.slots, new_kv)
        kvh = self.num_kv_heads
        scale = getattr(attn, "scaling", None)
        slides = self._slides[index]
        out = None if step.decode_only else torch.empty_like(q)
        if step.decode_rows is not None:
            qd = q if step.decode_only else q.index_select(0, step.decode_rows)
            batch = qd.shape[0]
            # The query heads that share a KV head attend as one group of rows, so K and V
            # are read once per KV head instead of being repeated for every query head.
            qd = qd.view(batch, kvh, self.num_heads // kvh, self.head_dim)
            if step.decode_plan is not None:
                od = self._dense_decode(index, qd, new_kv, step, scale, slides)
            else:
                gather = step.decode_gather
                kv = pool.index_select(0, gather.view(-1)).view(*gather.shape, *pool.shape[1:])
                kv = kv.transpose(1, 2)  # [B, 2 * kv_heads, L, D]
                kd, vd = kv[:, :kvh], kv[:, kvh:]
                mask = _decode_mask(slides, step.decode_mask, step.decode_window_mask)
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            od = od.reshape(batch, self.num_heads, self.head_dim)
            if step.decode_only:
                out = od
            else:
                out.index_copy_(0, step.decode_rows, od)
        if step.first_chunks is not None:
            self._first_chunk_attention(q, new_kv, step.first_chunks, out, scale, slides)
        for row, n, context, start in step.prefills:
            qp = q[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
            kv = pool.index_select(0, context).transpose(0, 1).unsqueeze(0)  # [1, 2kvh, L, D]
            kp, vp = kv[:, :kvh], kv[:, kvh:]
            if start == 0:
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
                )
            else:  # a later chunk sees every earlier token plus its own causal prefix
                q_pos = torch.arange(start, start + n, device=self.device).unsqueeze(1)
                k_pos = torch.arange(start + n, device=self.device).unsqueeze(0)
                visible = k_pos <= q_pos
                if slides:
                    visible &= k_pos > q_pos - self.window
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=visible, scale=scale, enable_gqa=True
                )
            out[row : row + n] = op[0].transpose(0, 1)
        return out.reshape(tokens, self.num_heads * self.head_dim)  # o_proj: the caller's

    def _first_chunk_attention(
        self,
        q: torch.Tensor,
        new_kv: torch.Tensor,
        first: FirstChunks,
        out: torch.Tensor,
        scale,
        slides: bool,
    ) -> None:
        batch, longest = first.shape
        kvh = self.num_kv_heads
        qf = q.index_select(0, first.index).view(batch, longest, self.num_heads, self.head_dim)
        kv = new_kv.index_select(0, first.index).view(batch, longest, 2 * kvh, self.head_dim)
        qf, kv = qf.transpose(1, 2), kv.transpose(1, 2)  # [S, heads, n_max, D]
        if slides and first.window_mask is not None:
            causal = {"attn_mask": first.window_mask}
        else:
            causal = {"is_causal": True}
        of = F.scaled_dot_product_attention(
            qf, kv[:, :kvh], kv[:, kvh:], scale=scale, enable_gqa=True, **causal
        )
        of = of.transpose(1, 2).reshape(batch * longest, self.num_heads, self.head_dim)
        if first.valid is not None:
            of = of.index_select(0, first.valid)
        out.index_copy_(0, first.rows, of)

    def _dense_decode(self, index, qd, new_kv, step: StepInputs, scale, slides) -> torch.Tensor:
        plan = step.decode_plan
        dense = self.decode_contexts.buffer[index]  # [rows, 2 * kv_heads, capacity, D]
        new_kv = new_kv if step.decode_only else new_kv.index_select(0, step.decode_rows)
        dense[plan.rows, :, plan.positions] = new_kv
        if plan.order is not None:  # attention runs in row order
            qd = qd.index_select(0, plan.order)
        kvh, rows, length = self.num_kv_heads, plan.num_rows, plan.length
        od = F.scaled_dot_product_attention(
            qd,
            dense[:rows, :kvh, :length],
            dense[:rows, kvh:, :length],
            attn_mask=_decode_mask(slides, plan.mask, plan.window_mask),
            scale=scale,
        )
        return od if plan.order is None else od.index_select(0, plan.rows)

    def release_decode_contexts(self) -> None:
        """The engine is idle: give the dense decode copies' memory back."""
        if self.decode_contexts is not None and self.decode_contexts.num_rows:
            self.decode_contexts.clear()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
