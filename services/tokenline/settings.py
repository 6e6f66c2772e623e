"""Settings shared by the stage commands; every flag has a TOKENLINE_* environment mirror."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.transport import RingEndpoints


@dataclass
class Settings:
    model: str = "tiny"
    served_model_name: str | None = None
    revision: str | None = None
    model_cache_dir: str | None = None
    endpoints: RingEndpoints = field(default_factory=RingEndpoints)
    metrics_port: int = 0  # 0: no separate metrics server (the api serves /metrics itself)
    log_level: str = "info"
    max_model_len: int | None = None
    # api
    host: str = "0.0.0.0"
    port: int = 8000
    request_timeout: float = 600.0
    slow_client_timeout: float = 30.0
    drain_timeout: float = 30.0
    max_waiting: int = 256
    # scheduler
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 on CUDA, 128 on CPU
    block_size: int = 16
    torch_threads: int | None = None  # CPU only; None: every core but one
    compile: bool = False  # torch.compile the layers' dense tail (for GPUs)

    @property
    def model_name(self) -> str:
        """The name clients use and /v1/models lists."""
        return self.served_model_name or self.model
