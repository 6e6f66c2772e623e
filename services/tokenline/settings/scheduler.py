"""The scheduler stage's settings: its engine's (`ENGINE`: device and dtype, KV cache,
batching, compilation, prefix caching, attention, model code) and tensor parallelism's
(`TENSOR_PARALLEL`); the CRD's ``engine`` section sets both.
"""

from __future__ import annotations

from tokenline.scheduler.kv_transfer import config as kv_transfer
from tokenline.scheduler.speculative import config as speculative
from tokenline.scheduler.waiting import parse_weights
from tokenline.settings.declaration import (
    API,
    SCHEDULER,
    CheckedText,
    CrdField,
    Setting,
    parse_bool,
    parse_bytes,
    parse_sizes,
)


class SpeculativeConfigText(CheckedText):
    """vLLM's ``--speculative-config`` JSON, checked when it is read (a bad one fails at start,
    naming the key) and kept as its text."""

    check = staticmethod(speculative.parse)


ENGINE: tuple[Setting, ...] = (
    Setting(
        "device",
        default="auto",
        help="compute device",
        stages=SCHEDULER,
        crd=CrdField("engine.device", "Where the model runs."),
        choices=("auto", "cpu", "cuda"),
    ),
    Setting(
        "dtype",
        default="auto",
        help="weights and KV dtype (auto: the checkpoint's bf16/fp16 on CUDA, and on a CPU "
        "with bf16 in hardware as bf16; fp32 on other CPUs and for fp32 checkpoints; bf16 for "
        "fp32 checkpoints on CUDA)",
        stages=SCHEDULER,
        crd=CrdField("engine.dtype", "Weights' data type."),
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "kv-cache-memory",
        parse_bytes,
        help="KV cache size, e.g. 8GiB (default: --gpu-memory-utilization of the GPU, "
        "512MiB on CPU)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.kvCacheMemory",
            "KV cache budget in bytes, e.g. 8GiB; defaults to what gpuMemoryUtilization leaves.",
        ),
    ),
    Setting(
        "gpu-memory-utilization",
        float,
        0.9,
        help="fraction of GPU memory to use",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.gpuMemoryUtilization",
            "Fraction of GPU memory the runner may use.",
            {"minimum": 0.05, "maximum": 1},
        ),
    ),
    Setting(
        "max-num-seqs",
        int,
        256,
        help="most sequences decoded together",
        stages=SCHEDULER,
        crd=CrdField("engine.maxNumSeqs", "Sequences decoded together at most.", {"minimum": 1}),
    ),
    Setting(
        "max-num-batched-tokens",
        int,
        help="token budget of one step; long prompts are prefilled in chunks of it "
        "(default: 2048 on CUDA, 128 on CPU, where small steps measured faster)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.maxNumBatchedTokens",
            "Tokens one forward step may hold at most; defaults to the scheduler's own for its "
            "device: 2048 on a GPU, 128 on CPU.",
            {"minimum": 1},
        ),
    ),
    Setting("block-size", int, 16, help="tokens per KV cache block", stages=SCHEDULER),
    Setting(
        "torch-threads",
        int,
        help="CPU threads for the model (default: every core this process may use, by its "
        "CPU affinity and cgroup quota, when its weights outgrow a CPU's caches, 64 MiB and "
        "more; else every core but one, which the other stages use)",
        stages=SCHEDULER,
    ),
    Setting(
        "compile",
        parse_bool,
        False,
        help="torch.compile the layers: on a CPU a dense Llama-style model's layers as one graph "
        "with frozen weights (start-up waits for it; measured no faster than the eager layers "
        "in the stack, benchmarks/README.md); on a GPU each layer's projections, norm and MLP "
        "(fewer kernel launches)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.compile",
            "torch.compile the layers: on a CPU a dense Llama-style model's as one graph, on a "
            "GPU each layer's projections, norm and MLP; start-up waits for compilation.",
        ),
        switch=True,
    ),
    Setting(
        "no-prefix-caching",
        parse_bool,
        False,
        help="compute every prompt in full instead of reusing the KV blocks of prefixes "
        "computed before (prefix caching is on by default)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.prefixCaching",
            "Keep the KV of computed prompt prefixes and reuse it for prompts that start the "
            "same way (system prompts, conversations, tool definitions).",
            inverted=True,
            on="1",
        ),
        switch=True,
    ),
    Setting(
        "prefix-caching-hash-algo",
        default="blake2b",
        help="how KV blocks are named: blake2b (tokenline's), or sha256_cbor (vLLM's, seeded by "
        "PYTHONHASHSEED) so a router that hashes prompts itself, like llm-d's, finds them",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.prefixCachingHashAlgo",
            "How KV blocks are named: blake2b (tokenline's) or sha256_cbor (vLLM's, seeded by "
            "router.kvEvents.hashSeed as PYTHONHASHSEED), which llm-d's precise prefix-cache "
            "scorer needs, as it hashes prompts itself. Unset: sha256_cbor with "
            "router.kvEvents enabled, else blake2b.",
            # no default in the CRD: the operator derives it from router.kvEvents
            {"default": None},
        ),
        choices=("blake2b", "sha256_cbor"),
    ),
    Setting(
        "attention-backend",
        default="auto",
        help="how attention is computed (scheduler/attention): flex (paged, read in place by "
        "flex_attention; compiled on CUDA and with --compile), sdpa (paged, contexts gathered "
        "from the KV pool), dense-cpu (decode rows kept dense between steps); auto: flex on "
        "CUDA, dense-cpu on CPU",
        stages=SCHEDULER,
        choices=("auto", "flex", "sdpa", "dense-cpu"),
    ),
    Setting(
        "enforce-eager",
        parse_bool,
        False,
        help="run every step eagerly: no captured CUDA graphs for decode steps",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.enforceEager",
            "Run every step eagerly, without captured CUDA graphs for decode steps (they cut "
            "the CPU's kernel launches at small batches; capturing them takes seconds at start).",
        ),
        switch=True,
    ),
    Setting(
        "cuda-graph-sizes",
        parse_sizes,
        help="decode batch sizes captured as CUDA graphs (vLLM's flag): one value N captures "
        "1, 2, 4 and every multiple of 8 up to N; several values capture those; default N = "
        "min(2 x max-num-seqs, 512). A step is padded up to the next size",
        stages=SCHEDULER,
        metavar="N|N,N,...",
    ),
    Setting(
        "model-impl",
        default="auto",
        help="which code runs the model (vLLM's --model-impl): tokenline (a native module, "
        "scheduler/models), transformers (transformers' own modules with tokenline's paged "
        "attention: any decoder, slower, no tensor parallelism or LoRA); auto: the native "
        "module when the architecture has one",
        stages=SCHEDULER,
        choices=("auto", "tokenline", "transformers"),
    ),
    Setting(
        "seed",
        int,
        help="seed of the scheduler's random numbers (vLLM's --seed): requests that give no "
        "seed of their own draw from it, so the same requests in the same order sample the "
        "same tokens after a restart (default: a fresh seed each start)",
        stages=SCHEDULER,
    ),
    Setting(
        "speculative-config",
        SpeculativeConfigText,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4} proposes the tokens that '
        "followed the last earlier occurrence of a sequence's last n tokens (n from "
        "prompt_lookup_max down to prompt_lookup_min) and checks them in one forward; "
        '{"method": "draft_model", "model": M, "num_speculative_tokens": 4} has a smaller model '
        'of the same vocabulary guess, "eagle3" an EAGLE-3 head fed the target\'s hidden '
        "states. Output is the same as without it. Requests with a "
        "grammar or penalties take a token per step",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.speculative",
            'Speculative decoding, vLLM\'s --speculative-config JSON, e.g. {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}; the output is the same.',
        ),
        metavar="JSON",
    ),
)


class KVTransferConfigText(CheckedText):
    """vLLM's ``--kv-transfer-config`` JSON, checked when it is read, kept as its text."""

    check = staticmethod(kv_transfer.parse)


# Prefill/decode disaggregation (scheduler/kv_transfer/): the operator sets it per role.
KV_TRANSFER: tuple[Setting, ...] = (
    Setting(
        "kv-transfer-config",
        KVTransferConfigText,
        help='prefill/decode disaggregation, vLLM\'s JSON: {"kv_connector": "NixlConnector", '
        '"kv_role": "kv_producer"} lends the KV of prompts asked with kv_transfer_params '
        '{"do_remote_decode": true} to decode pods; "kv_consumer" reads it from the prefill '
        "pod a request names instead of computing the prompt (kv_both: either); "
        '"kv_load_failure_policy": "fail" (default) or "recompute" for a read that fails. The '
        "side channel listens on VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT "
        '(127.0.0.1:5600); "kv_connector_extra_config": {"side_channel_keys": DIR} makes it '
        "speak CurveZMQ with the keys of DIR (`tokenline ring-keys --out DIR`), shared by every "
        "pod of the service",
        stages=SCHEDULER,
        metavar="JSON",
    ),
)
ENGINE += KV_TRANSFER


class TenantWeightsText(CheckedText):
    """``team-a=1,team-b=3`` (``*`` for every other tenant), checked when it is read, kept as
    its text."""

    check = staticmethod(parse_weights)


# Who runs first (scheduler/waiting.py): the scheduler orders by priority and tenant share, and
# the api, which knows the tenant, holds each tenant's waiting requests to a limit.
SCHEDULING: tuple[Setting, ...] = (
    Setting(
        "scheduling-policy",
        default="fcfs",
        help="fcfs: first come, first served; priority: the `priority` request field orders "
        "waiting requests (lower runs earlier, vLLM's meaning) and running ones are preempted "
        "lowest priority first (a request with a priority other than 0 is refused under fcfs)",
        stages=API | SCHEDULER,
        crd=CrdField(
            "scheduling.policy",
            "fcfs, or priority: requests' `priority` field (lower runs earlier, as vLLM's) "
            "orders admission and preemption.",
        ),
        choices=("fcfs", "priority"),
    ),
    Setting(
        "tenant-weights",
        TenantWeightsText,
        help="fair share of tenants (the API key's name, else --tenant-header's value): "
        "within a priority level, the scheduler's tokens are shared by these weights, e.g. "
        "team-a=1,team-b=3 (* for every other tenant; unnamed ones weigh 1); an idle "
        "tenant's share goes to the busy ones. Unset: tenants are not told apart",
        stages=SCHEDULER,
        crd=CrdField(
            "scheduling.tenantWeights",
            "Fair share of tenants, e.g. team-a=1,team-b=3 (* for every other tenant).",
            {"pattern": r"^[^=,\s]+=[0-9]*\.?[0-9]+(,[^=,\s]+=[0-9]*\.?[0-9]+)*$"},
        ),
        metavar="TENANT=WEIGHT,...",
    ),
    Setting(
        "tenant-header",
        default="x-llm-d-inference-fairness-id",
        help="the request header naming the tenant when the API key has no name (llm-d's "
        "gateway sets x-llm-d-inference-fairness-id); empty: only key names count",
        stages=API,
        crd=CrdField(
            "scheduling.tenantHeader",
            "Header that names a request's tenant when its API key has no name.",
        ),
    ),
    Setting(
        "max-waiting-per-tenant",
        int,
        0,
        help="most requests one tenant may have waiting for their first token; beyond, 429 "
        "with Retry-After (0: only --max-waiting holds)",
        stages=API,
        crd=CrdField(
            "scheduling.maxWaitingPerTenant",
            "Requests one tenant may have waiting; beyond, 429 with Retry-After. 0: no limit.",
            {"minimum": 0},
        ),
    ),
)

ENGINE += SCHEDULING  # the engine's too: the CRD keeps them in their own section

# Tensor parallelism (scheduler/parallel/): vLLM's flag names. One pod holds
# tensor-parallel-size / nnodes ranks; with nnodes > 1 the operator makes a LeaderWorkerSet
# and sets the last three on each pod from LWS_LEADER_ADDRESS and LWS_WORKER_INDEX.
TENSOR_PARALLEL: tuple[Setting, ...] = (
    Setting(
        "tensor-parallel-size",
        int,
        1,
        help="devices the model is split over (attention heads, MLP and vocabulary split "
        "across ranks; rank 0 schedules); must divide the model's heads and MLP width",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.tensorParallelSize",
            "Devices (GPUs) the model is split over, one process each; the scheduler "
            "container requests this many GPUs per node (tensorParallelSize / nodes).",
            {"minimum": 1, "maximum": 64},
        ),
    ),
    Setting(
        "nnodes",
        int,
        1,
        help="nodes the tensor-parallel group spans (each holds tensor-parallel-size / nnodes "
        "ranks)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.nodes",
            "Nodes one replica spans: above 1 the operator runs each replica as a "
            "LeaderWorkerSet group of this size.",
            {"minimum": 1, "maximum": 16},
        ),
    ),
    Setting(
        "node-rank",
        int,
        0,
        help="this node's place in a multi-node group (0: the leader, which runs the ring)",
        stages=SCHEDULER,
        serve=False,
    ),
    Setting(
        "master-addr",
        default="127.0.0.1",
        help="the leader's address, where the tensor-parallel group meets (multi-node)",
        stages=SCHEDULER,
        serve=False,
    ),
    Setting(
        "master-port",
        int,
        help="the port of the group's rendezvous on the leader (default: a free port; "
        "multi-node groups need a fixed one)",
        stages=SCHEDULER,
        serve=False,
    ),
    Setting(
        "distributed-timeout",
        float,
        300.0,
        help="seconds a collective may wait for another rank before the stage gives up and "
        "exits (a dead rank is noticed at once; this bounds a stuck one)",
        stages=SCHEDULER,
    ),
)
