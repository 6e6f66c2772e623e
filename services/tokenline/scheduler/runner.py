"""The model runner: owns the model, the paged KV cache and the step's forward pass.

The model is a family's own module (``models/``: the native ones, or transformers' modules with
tokenline's attention for the rest), chosen and loaded once at start; the runner never reaches
into a layer. It sizes the KV pool from the model's attention geometry, chooses the attention
backend (``attention/``) that every layer calls, and runs a step: ``step_inputs`` turns the step's
chunks into a flat batch of token rows and the backend's metadata (``step_inputs.py``), and
``execute`` runs the model over them and returns the logits of the rows that sample. Layers with
a sliding window keep their K/V in the pool for the whole context (blocks that fell out of every
window are not given back early).

LoRA (``enable_lora``): the runner holds every device slot's adapter weights stacked per
layer (lora/apply.py) and reads one thing per step, the slot of each sequence; a step in which
no row uses an adapter runs exactly as without LoRA (and with ``--compile``, compiled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenline.cores import usable_cores
from tokenline.model_source import ModelSource, positions_computed_alike
from tokenline.scheduler import attention, models
from tokenline.scheduler.attention import AttentionShape
from tokenline.scheduler.attention.decode_contexts import DecodeContexts
from tokenline.scheduler.attention.flex import FlexAttentionBackend, flex_block_size
from tokenline.scheduler.decode_graphs import DecodeGraphs, capture_sizes
from tokenline.scheduler.layers.compiled import missing_compiler
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.linear import CACHE_SIZED_WEIGHTS, packs_weights, weight_bytes
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.lora.adapters import ModelShape
from tokenline.scheduler.lora.apply import LoraStep, LoraWeights
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.step_inputs import StepBatch, build_step_batch, long_tensor, to_device
from tokenline.scheduler.warm_up import activation_peak, kv_pool_bytes

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's inputs, built by `ModelRunner.step_inputs` for `ModelRunner.execute`."""

    chunks: list[Chunk]
    step: StepBatch | None  # None: a decode step in fixed buffers (``bucket``)
    metadata: object  # the attention backend's, for every layer
    lora: LoraStep | None = None  # each row's adapter slot; None: no row uses an adapter
    bucket: int = 0  # a decode step padded into this bucket's fixed buffers (decode_graphs.py)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX-512 BF16 or AMX); elsewhere oneDNN emulates it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_dtype(
    dtype: str, device: torch.device, checkpoint: torch.dtype | None = None
) -> torch.dtype:
    """``--dtype``; ``auto``: the checkpoint's half-precision dtype where the device computes
    in it (CUDA; a CPU with bf16 in hardware, in bf16), else float32 on CPU and bf16 on CUDA.
    A float32 checkpoint stays float32 on CPU: it was written to be served exactly so."""
    if dtype != "auto":
        return DTYPES[dtype]
    half = checkpoint in (torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return checkpoint if half else torch.bfloat16
    return torch.bfloat16 if half and cpu_has_fast_bf16() else torch.float32


def default_torch_threads(model: torch.nn.Module) -> int:
    """Every core for a model whose weights outgrow the caches (`CACHE_SIZED_WEIGHTS`): a
    decode step streams them from memory, and a second thread's bandwidth outweighs what the
    other stages lose by it. Below, every core but one, which the api, tokenizer and
    detokenizer stages use: a small model's step is mostly their kind of work, and threads
    that spin against them cost more than they bring."""
    cores = usable_cores()
    return cores if weight_bytes(model) >= CACHE_SIZED_WEIGHTS else max(1, cores - 1)


def checkpoint_dtype(source: ModelSource) -> torch.dtype | None:
    """The dtype the checkpoint's config names (its weights' own), or None."""
    try:
        config = source.load_config()
    except (ValueError, KeyError, OSError):
        return None  # models.load refuses it with the reason
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    text = getattr(config, "get_text_config", lambda: None)()
    named = named or getattr(text, "dtype", None)
    if isinstance(named, str):
        named = DTYPES.get(named)
    return named if isinstance(named, torch.dtype) else None


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """How a `ModelRunner` is built. The scheduler reads them from its settings once
    (``start.runner_options``); tensor-parallel ranks are spawned with them (picklable)."""

    device: str = "auto"  # auto: CUDA when there is one
    dtype: str = "auto"  # `pick_dtype`
    block_size: int = 16  # tokens per KV block (flex rounds it to its tiles)
    kv_cache_memory: int | None = None  # the KV pool's bytes; None: `_size_pool` decides
    gpu_memory_utilization: float = 0.9
    torch_threads: int | None = None  # None: `default_torch_threads`
    dense_decode: bool = True  # auto attention on CPU keeps decode rows dense
    compile_layers: bool = False  # --compile
    attention_backend: str = "auto"
    model_impl: str = "auto"
    max_model_len: int | None = None  # None: the checkpoint's
    cuda_graph_sizes: Sequence[int] | None = None  # decode buckets (`capture_sizes`)
    enforce_eager: bool = False  # no decode buckets
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the largest step: warm-up runs it, the pool leaves room


class ModelRunner:
    def __init__(self, source: ModelSource, options: RunnerOptions = RunnerOptions()) -> None:
        self.device = pick_device(options.device)
        torch_threads = options.torch_threads
        if self.device.type == "cpu":
            torch.set_num_threads(torch_threads or max(1, usable_cores() - 1))
        dtype = options.dtype
        self.dtype = pick_dtype(
            dtype, self.device, checkpoint_dtype(source) if dtype == "auto" else None
        )
        self.source = source
        try:
            with torch.no_grad():
                self.model = self._load_model(source, options.model_impl)
            geometry = self.model.geometry
            self.window = geometry.window
        except ModelRefused as exc:
            raise SystemExit(f"{source.spec}: {exc}") from None
        self.model.eval()
        if self.device.type == "cpu" and not torch_threads:
            torch.set_num_threads(default_torch_threads(self.model))
        self.config = self.model.config
        self.num_layers = len(geometry.layers)
        self.num_heads = geometry.num_heads  # this rank's
        self.num_kv_heads = geometry.num_kv_heads
        self.head_dim = geometry.head_dim
        self.vocab_size = self.model.vocab_size
        self.max_model_len = options.max_model_len or source.max_model_len()
        alike = positions_computed_alike(self.model.text_config)
        if alike is not None and self.max_model_len > alike:
            raise SystemExit(
                f"{source.spec}: --max-model-len {self.max_model_len}: past {alike} positions "
                "this model's rope frequencies (rope_type dynamic or longrope) follow each "
                "forward call's longest sequence, which a batched, chunked, cached engine cannot "
                f"reproduce per request; serve it with --max-model-len {alike} or less"
            )
        backend = attention.backend_name(
            options.attention_backend, self.device, options.dense_decode
        )
        block_size = options.block_size
        if backend == "flex":  # its pages must fit the kernels' tiles
            block_size = flex_block_size(self.device, block_size)
        self.block_size = block_size
        self.num_blocks = self._size_pool(
            options.kv_cache_memory, options.gpu_memory_utilization, options.max_num_batched_tokens
        )
        slots = self.num_blocks * block_size
        # Keys and values of a slot sit side by side, so one gather fetches both.
        shape = (self.num_layers, slots, 2 * self.num_kv_heads, self.head_dim)
        # Zeroed, not empty: batched decode reads masked padding slots, and a NaN there would
        # still poison the row (0 × NaN is NaN).
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._slides = [layer.slides for layer in geometry.layers]
        # Chosen once: how every step's attention is computed (attention/__init__.py).
        self.attention = attention.choose(
            backend,
            AttentionShape(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                device=self.device,
                block_size=block_size,
                window=self.window,
                compile=options.compile_layers,
                max_blocks_per_seq=-(-self.max_model_len // block_size),
                max_num_seqs=options.max_num_seqs,
            ),
            self.kv_cache,
        )
        self.graphs: DecodeGraphs | None = None
        graph_sizes = options.cuda_graph_sizes
        if not options.enforce_eager and (self.device.type == "cuda" or graph_sizes):
            refusal = self._graph_refusal()
            if refusal:
                log.info("decode steps run eagerly: %s", refusal)
            else:
                sizes = capture_sizes(graph_sizes, options.max_num_seqs)
                self.graphs = DecodeGraphs(self, sizes, capture=self.device.type == "cuda")
        self.lora: LoraWeights | None = None  # enable_lora's device slots
        # EAGLE-3 (speculative/eagle3.py): handed each step's chunks and the model's
        # auxiliary hidden states after the forward; None (the default): nothing is kept
        self.aux_sink: Callable[[list[Chunk], torch.Tensor], None] | None = None
        self.lora_shape = ModelShape(self.num_layers, self.model.lora_dims)
        self._compiled = False
        on_cpu = self.device.type == "cpu"
        on_cpu_flex = on_cpu and isinstance(self.attention, FlexAttentionBackend)
        if options.compile_layers and on_cpu_flex:
            # flex on CPU: its kernel, compiled afresh for each shape inside the layers' graph,
            # turns dynamic and fails to build; flex alone is compiled, the layers stay eager
            log.info("--compile: flex attention compiled, the layers eager over packed weights")
        elif options.compile_layers:
            self._compiled = self.model.compile_layers()
            if not self._compiled:
                log.warning(
                    "--compile: %s has no compiled path (Llama-style layers with a SiLU MLP on "
                    "one device have one); running it eagerly",
                    self.model.describe(),
                )
        if options.compile_layers and (on_cpu_flex or (on_cpu and self._compiled)):
            missing = missing_compiler()  # else warm-up's first step would fail
            if missing:
                raise SystemExit(
                    f"--compile on a CPU builds its kernels with a C++ compiler, and {missing}: "
                    "install one (g++ or clang++, or set CXX to one) or serve without --compile"
                )
        if packs_weights(Placement(self.device, self.dtype)):
            self.model.pack_weights()  # but for the compiled graph's: inductor packs those
        if self.model.implementation == "transformers":
            from tokenline.scheduler.models.generic import check_batch_exact

            try:
                check_batch_exact(self)
            except ModelRefused as exc:
                raise SystemExit(f"{source.spec}: {self.model.architecture}: {exc}") from None
        log.info(
            "runner: %s, %s on %s/%s, KV pool %d blocks x %d tokens, attention %s",
            source.spec,
            self.model.describe(),
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
            self.attention.name,
        )

    def _graph_refusal(self) -> str:
        """Why decode steps cannot run over fixed buffers here; "" when they can."""
        if not isinstance(self.attention, FlexAttentionBackend):
            return f"the {self.attention.name} attention backend has no fixed-buffer decode"
        return self.model.graph_refusal()

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraWeights:
        """Allocate ``max_loras`` zeroed device slots of rank ``max_rank`` for LoRA adapters."""
        if not self.lora_shape.dims:
            raise SystemExit(
                f"--enable-lora: {self.model.describe()} takes no LoRA adapters (they need a "
                "native module)"
            )
        self.lora = LoraWeights(
            self.lora_shape.dims, self.num_layers, max_loras, max_rank, self.dtype, self.device
        )
        return self.lora

    def _load_model(self, source: ModelSource, implementation: str) -> models.CausalLM:
        """The whole model on the device (parallel/runner.py loads a rank's shard instead)."""
        return models.load(source, implementation, Placement(self.device, self.dtype))

    @property
    def compiled_layers(self) -> bool:
        """True when --compile took effect."""
        return self._compiled

    @property
    def decode_contexts(self) -> DecodeContexts | None:
        """The dense decode rows, when the attention backend keeps them."""
        decode = getattr(self.attention, "decode", None)
        return getattr(decode, "contexts", None)

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def _size_pool(self, kv_cache_memory: int | None, utilization: float, tokens: int) -> int:
        """Blocks in the pool: ``--kv-cache-memory``'s worth, or on a GPU what
        ``--gpu-memory-utilization`` leaves after the weights and the largest prefill chunk's
        measured activations (warm_up.py); 512 MiB on CPU."""
        if kv_cache_memory is None:
            if self.device.type == "cuda":
                peak = activation_peak(self, tokens)
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_memory = kv_pool_bytes(total, free, utilization, peak)
            else:
                kv_cache_memory = 512 * 2**20
        blocks = kv_cache_memory // (self.bytes_per_token * self.block_size)
        if blocks < 2:
            raise SystemExit(
                f"{self.source.spec}: no room for a KV cache ({kv_cache_memory} bytes for blocks "
                f"of {self.bytes_per_token * self.block_size}); raise --gpu-memory-utilization "
                "or --kv-cache-memory, or lower --max-num-batched-tokens"
            )
        return blocks

    # ── one forward pass ───────────────────────────────────────────────────────────────────────
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; return logits [rows that sample, vocab] in float32."""
        return self.forward_keeping(chunks, [])[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 of final hidden states kept by `forward_keeping`."""
        return self.model.logits(hidden)

    @torch.inference_mode()
    def forward_keeping(
        self, chunks: list[Chunk], spans: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final hidden states (after the last norm) of more token rows.

        ``spans``: (chunk index, offset of the first row within that chunk, rows). The hidden
        states come back [sum of the spans' rows, hidden size] in span order, for `logits`:
        kept rather than turned into logits here, so that the caller bounds how many rows of
        logits exist at once (a prompt's rows times the vocabulary can be gigabytes)."""
        return self.execute(self.step_inputs(chunks), spans)

    @torch.inference_mode()
    def step_inputs(self, chunks: list[Chunk]) -> StepInputs:
        """A step's inputs: the flat batch and every layer's attention metadata. The host work
        before the forward, timed apart from it."""
        uses_lora = self.lora is not None and any(c.seq.lora_slot >= 0 for c in chunks)
        if self.graphs is not None and not uses_lora:
            bucket = self.graphs.bucket_for(chunks)
            if bucket is not None:
                self.graphs.write(chunks, bucket)
                return StepInputs(chunks, None, None, bucket=bucket)
        step = build_step_batch(chunks, block_size=self.block_size, device=self.device)
        lora = None
        if uses_lora:
            slots = [s for c in chunks for s in [c.seq.lora_slot] * c.num_tokens]
            lora = self.lora.step(slots)
        return StepInputs(chunks, step, self.attention.prepare(step), lora)

    @torch.inference_mode()
    def execute(
        self, inputs: StepInputs, spans: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over a step's inputs: logits of the rows that sample, and the kept
        hidden states of ``spans`` (see `forward_keeping`)."""
        if inputs.bucket:  # decode only: every row samples; padding rows are cut off
            logits = self.graphs.run(inputs.bucket)[: len(inputs.chunks)]
            return logits, logits[:0]
        step = inputs.step
        rows = step.sample_rows
        if spans:
            starts = [0]
            for chunk in inputs.chunks:
                starts.append(starts[-1] + chunk.num_tokens)
            kept = [starts[k] + first + i for k, first, n in spans for i in range(n)]
            rows = torch.cat((rows, to_device(long_tensor(kept), self.device)))
        context = ForwardContext(
            step.positions,
            step.max_position,
            self.attention,
            inputs.metadata,
            inputs.lora,
            self.lora,
        )
        hidden = self.model(step.input_ids, context, rows)
        if self.aux_sink is not None:
            self.aux_sink(inputs.chunks, self.model.aux_hidden)
            self.model.aux_hidden = None  # taken: not held until the next step
        sampling = step.sample_rows.shape[0]
        return self.model.logits(hidden[:sampling]), hidden[sampling:]

    def release_decode_contexts(self) -> None:
        """The engine is idle: the attention backend gives back what it keeps between steps
        (the dense decode rows)."""
        self.attention.release()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
