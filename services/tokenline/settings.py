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
    # api security: keys, TLS, and limits checked before anything is queued (api/limits.py)
    api_keys: list[str] = field(default_factory=list, repr=False)  # never in a log line
    api_key_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_body_size: int = 8 * 2**20  # bytes
    max_n: int = 16
    max_tokens_limit: int = 131_072
    max_stop_strings: int = 16
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 256
    max_messages: int = 2048
    max_prompt_chars: int = 2**20  # a completions prompt, or all of a chat's message contents
    max_logprobs: int = 20
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
    no_prefix_caching: bool = False  # prefix caching is on unless this is set

    @property
    def model_name(self) -> str:
        """The name clients use and /v1/models lists."""
        return self.served_model_name or self.model
