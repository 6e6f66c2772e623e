"""The scheduler process: the model loaded and warmed up, the engine over it (grammars, LoRA
adapters, KV events), then the stage joined to the ring (`run`); stage.py is the handler that
serves it."""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from tokenline.lifecycle import Drain
from tokenline.metrics import serve_metrics
from tokenline.model_source import ModelSource, resolve
from tokenline.reasoning import parser_for
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.engine_limits import EngineLimits, default_token_budget
from tokenline.scheduler.grammar import GrammarCompiler
from tokenline.scheduler.kv_events import attach
from tokenline.scheduler.kv_transfer import config as kv_transfer
from tokenline.scheduler.lora.adapters import LoraError
from tokenline.scheduler.lora.options import LoraOptions
from tokenline.scheduler.lora_config import LoraConfigWatcher
from tokenline.scheduler.parallel import stage as parallel_stage
from tokenline.scheduler.pooling import config as pooling_config
from tokenline.scheduler.runner import ModelRunner, RunnerOptions, pick_device
from tokenline.scheduler.speculative import config as speculative
from tokenline.scheduler.stage import LoraChanges, SchedulerStage
from tokenline.scheduler.waiting import Scheduling, parse_weights
from tokenline.scheduler.warm_up import warm_up
from tokenline.settings import Settings
from tokenline.settings.declaration import sizes_of
from tokenline.stage_runtime import serve_stage
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    seed_sampling(settings.seed)
    source = resolve(
        settings.model, settings.model_cache_dir, settings.revision, settings.chat_template
    )
    if settings.metrics_port:  # a worker node's too: its pod's probes read it
        serve_metrics(settings.metrics_port)
    options = runner_options(settings, source)
    if pooling_config.runner_of(settings.runner, source) == "pooling":  # embeddings, scores
        from tokenline.scheduler.pooling import start as pooling_start

        return pooling_start.run(settings, source, options, drain)
    if settings.tensor_parallel_size > 1 and settings.node_rank > 0:
        return parallel_stage.run_worker_node(settings, source, options)
    if settings.tensor_parallel_size > 1:  # rank 0's sharded runner, its workers started
        runner = parallel_stage.driver_runner(settings, source, options)
    else:
        runner = ModelRunner(source, options)
    budget = options.max_num_batched_tokens
    # before the stage joins the ring (and /ready turns true): the first requests must not
    # wait for kernels to compile or graphs to be captured
    warm_up(runner, budget)
    limits = EngineLimits(options.max_model_len, options.max_num_seqs, budget)
    lora = None
    if settings.enable_lora:
        lora = LoraOptions(
            settings.max_loras,
            settings.max_lora_rank,
            settings.max_cpu_loras,
            settings.model_cache_dir,
        )
    tokenizer = source.load_tokenizer()
    grammars, refusal = grammar_compiler(source.spec, tokenizer)
    # where a grammar starts: after the thinking, as the detokenizer splits it
    try:
        _, reasoning = parser_for(settings.reasoning_parser, tokenizer)
    except ValueError as exc:
        raise SystemExit(f"scheduler: {exc}") from None
    engine = Engine(
        runner,
        limits,
        source.eos_token_ids(),
        prefix_caching=not settings.no_prefix_caching,
        grammars=grammars,
        lora=lora,
        grammar_refusal=refusal,
        reasoning=reasoning,
        speculative=speculative_config(settings),
        scheduling=Scheduling(
            settings.scheduling_policy,
            parse_weights(settings.tenant_weights) if settings.tenant_weights else None,
        ),
        kv_transfer=kv_transfer_config(settings),
    )
    lora_changes = start_loras(settings, engine)
    kv_events = attach(settings, engine.pool, runner.device.type)
    ring = SyncRing("scheduler", settings.endpoints, settings.ring_security)
    log.info(
        "scheduler ready: %s, %d KV blocks, prefix caching %s",
        source.spec,
        runner.num_blocks,
        "on" if engine.prefix_caching else "off",
    )
    stage = SchedulerStage(engine, settings.model_name, kv_events, lora_changes)
    serve_stage(stage, ring, drain)
    return 0


def speculative_config(settings: Settings) -> speculative.SpeculativeConfig | None:
    """--speculative-config, a draft model's source fetched into the model cache first."""
    config = speculative.parse(settings.speculative_config)
    if config is not None and config.model is not None:
        draft = resolve(config.model, settings.model_cache_dir, chat_template=None)
        config = dataclasses.replace(config, model=draft.path)
    return config


def kv_transfer_config(settings: Settings) -> kv_transfer.KVTransferConfig | None:
    """--kv-transfer-config, where this scheduler can honour it."""
    config = kv_transfer.config_of(settings.kv_transfer_config)
    if config is None or settings.tensor_parallel_size == 1:
        return config
    if settings.nnodes > 1:
        raise SystemExit(
            "--kv-transfer-config with --nnodes above 1 is not served yet: KV would move "
            "between ranks on other nodes; run the pod's ranks on one node"
        )
    return config


def seed_sampling(seed: int | None) -> None:
    """vLLM's --seed: requests without a seed of their own draw from the process's generator,
    seeded here, so the same requests in the same order sample the same tokens after a
    restart. None: a fresh seed each start."""
    if seed is not None:
        torch.manual_seed(seed)


def runner_options(settings: Settings, source: ModelSource) -> RunnerOptions:
    """The runner's options, read from the settings once (every tensor-parallel rank builds
    its runner from these)."""
    return RunnerOptions(
        device=settings.device,
        dtype=settings.dtype,
        block_size=settings.block_size,
        kv_cache_memory=settings.kv_cache_memory,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        torch_threads=settings.torch_threads,
        compile_layers=settings.compile,
        attention_backend=settings.attention_backend,
        model_impl=settings.model_impl,
        max_model_len=source.max_model_len(settings.max_model_len),
        cuda_graph_sizes=sizes_of(settings.cuda_graph_sizes),
        enforce_eager=settings.enforce_eager,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens
        or default_token_budget(pick_device(settings.device).type),
    )


def grammar_compiler(spec: str, tokenizer) -> tuple[GrammarCompiler | None, str]:
    """The grammar compiler over the model's tokenizer, or None and why: a tokenizer the grammar
    library cannot read (a word-level vocabulary with a WordPiece decoder, say) costs the model
    its structured outputs, never its plain generation."""
    try:
        return GrammarCompiler(tokenizer), ""
    except Exception as exc:  # llguidance names what it could not read; nothing else is at stake
        reason = (
            "structured outputs and tool calls are not available for this model: the grammar "
            f"library (llguidance) cannot read its tokenizer ({exc})"
        )
        log.warning("%s: %s", spec, reason)
        return None, reason


def lora_module(text: str, served: str) -> tuple[str, str]:
    """One --lora-modules value, in either of vLLM's forms: ``NAME=URI`` or a JSON object with
    ``name`` and ``path`` (and ``base_model_name``, which must be ``served``, the model's)."""
    expected = 'expected NAME=PATH_OR_URI or {"name": ..., "path": ...}'
    if not text.lstrip().startswith("{"):
        name, sep, uri = text.partition("=")
        if not sep or not name or not uri:
            raise SystemExit(f"--lora-modules {text!r}: {expected}")
        return name, uri
    try:
        module = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--lora-modules {text!r}: not JSON ({exc})") from None
    name, uri = module.get("name"), module.get("path")
    if not isinstance(name, str) or not isinstance(uri, str) or not name or not uri:
        raise SystemExit(f"--lora-modules {text!r}: {expected}")
    unknown = sorted(set(module) - {"name", "path", "base_model_name"})
    if unknown:
        raise SystemExit(f"--lora-modules {name}: unknown keys {unknown}")
    base = module.get("base_model_name")
    if base is not None and base != served:
        raise SystemExit(
            f"--lora-modules {name}: base_model_name {base!r} is not the served model {served!r}"
        )
    return name, uri


def start_loras(settings: Settings, engine: Engine) -> LoraChanges | None:
    """Load --lora-modules (a bad one stops the stage: it was asked for at start) and return
    --lora-config's watcher, polled between steps."""
    if engine.loras is None:
        if settings.lora_modules or settings.lora_config:
            log.warning("--lora-modules/--lora-config ignored: --enable-lora is off")
        return None
    for module in settings.lora_modules or []:
        name, uri = lora_module(module, settings.model_name)
        try:
            engine.loras.add(name, uri)
        except LoraError as exc:
            raise SystemExit(f"--lora-modules {name}: {exc}") from exc
        log.info("LoRA adapter %s loaded from %s", name, uri)
    if not settings.lora_config:
        return None
    return LoraConfigWatcher(settings.lora_config)
