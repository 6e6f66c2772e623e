"""``--kv-transfer-config``: vLLM's JSON, read once at start.

Keys as vLLM names them: ``kv_connector`` (``NixlConnector``, the one llm-d's sidecar speaks
to), ``kv_role`` (``kv_producer``: lends its prompts' KV; ``kv_consumer``: reads KV others
computed; ``kv_both``), ``kv_load_failure_policy`` (``fail``, vLLM's default, or
``recompute``), ``engine_id`` and ``kv_connector_extra_config``. The side channel listens where
vLLM's does: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and ``VLLM_NIXL_SIDE_CHANNEL_PORT``; lent blocks
are kept for ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds at most when no decode pod reads them.

``kv_connector_extra_config`` holds tokenline's own keys, which vLLM has no equivalent of:
``pull_timeout_s``, ``lease_s`` and ``side_channel_keys``, a directory made by ``tokenline
ring-keys --out DIR`` and shared by every prefill and decode pod of one service. With it the
side channel speaks CurveZMQ both ways (side_channel.py): a decode pod reads only from a pod
that holds the directory's secret, whatever host a request's ``kv_transfer_params`` name.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from tokenline.ring_security import keys_problem

CONNECTORS = ("NixlConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
_KNOWN = {
    "kv_connector",
    "kv_role",
    "kv_load_failure_policy",
    "engine_id",
    "kv_connector_extra_config",
    "kv_buffer_device",
}
# vLLM's defaults (envs.py)
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_LEASE_S = 480.0
DEFAULT_PULL_TIMEOUT_S = 30.0
EXTRA = ("pull_timeout_s", "lease_s", "side_channel_keys")


@dataclass(frozen=True)
class KVTransferConfig:
    role: str
    failure_policy: str = "fail"
    engine_id: str = ""
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    lease_s: float = DEFAULT_LEASE_S  # a lent block nobody reads is freed after this
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S  # a read that takes longer has failed
    side_channel_keys: str | None = None  # CurveZMQ keys of the service's pods; None: no CURVE

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def parse(text: str) -> dict:
    """The JSON's keys, checked; raises ValueError naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(
            '--kv-transfer-config must be a JSON object, e.g. {"kv_connector": '
            '"NixlConnector", "kv_role": "kv_consumer"}'
        )
    unknown = sorted(set(value) - _KNOWN)
    if unknown:
        raise ValueError(
            f"--kv-transfer-config: {', '.join(unknown)} not served; tokenline reads "
            f"{', '.join(sorted(_KNOWN))}"
        )
    if value.get("kv_connector") not in CONNECTORS:
        raise ValueError(
            f"--kv-transfer-config: kv_connector {value.get('kv_connector')!r} is not served; "
            "use NixlConnector (llm-d's prefill/decode contract)"
        )
    if value.get("kv_role") not in ROLES:
        raise ValueError(
            f"--kv-transfer-config: kv_role {value.get('kv_role')!r}; use one of {', '.join(ROLES)}"
        )
    policy = value.get("kv_load_failure_policy", "fail")
    if policy not in FAILURE_POLICIES:
        raise ValueError(
            f"--kv-transfer-config: kv_load_failure_policy {policy!r}; use fail or recompute"
        )
    extra = value.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    for key in extra:
        if key not in EXTRA:
            raise ValueError(
                f"--kv-transfer-config: kv_connector_extra_config.{key} is not served; "
                f"tokenline reads {', '.join(EXTRA)}"
            )
    if "side_channel_keys" in extra:
        _check_keys(extra["side_channel_keys"])
    return value


def _check_keys(directory: object) -> None:
    """Refused at start, not at the first read: a pod without usable keys serves no one."""
    where = "--kv-transfer-config: kv_connector_extra_config.side_channel_keys"
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"{where} must name a directory, not {directory!r}")
    problem = keys_problem(directory)
    if problem:
        raise ValueError(
            f"{where}: {problem}; create it with `tokenline ring-keys --out {directory}` and give "
            "every prefill and decode pod of the service the same directory"
        )


def config_of(text: str | None, environ: dict[str, str] | None = None) -> KVTransferConfig | None:
    """The scheduler's transfer configuration; None without ``--kv-transfer-config``."""
    if not text:
        return None
    value = parse(text)
    env = os.environ if environ is None else environ
    extra = value.get("kv_connector_extra_config", {})
    lease = float(extra.get("lease_s", env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", DEFAULT_LEASE_S)))
    return KVTransferConfig(
        role=value["kv_role"],
        failure_policy=value.get("kv_load_failure_policy", "fail"),
        engine_id=value.get("engine_id") or str(uuid.uuid4()),
        side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
        side_channel_port=int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT)),
        lease_s=lease,
        pull_timeout_s=float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S)),
        side_channel_keys=extra.get("side_channel_keys"),
    )
