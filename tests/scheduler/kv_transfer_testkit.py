"""What the KV-transfer tests share: the two roles' configurations, stepping an engine until
its requests end, the routing sidecar's first call, and a tensor-parallel group to read or lend
from."""

from __future__ import annotations

import time
from collections.abc import Iterator

from scheduler_testkit import greedy

from tokenline import tiny_model
from tokenline.model_source import ModelSource
from tokenline.protocol import KVTransferParams, TokenOutput
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.kv_transfer.link import KVLayout
from tokenline.scheduler.parallel.worker import Driver, start
from tokenline.scheduler.runner import RunnerOptions

MiB = 2**20
RANKS = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=4 * MiB, torch_threads=1)
LIMITS = EngineLimits(tiny_model.MAX_POSITIONS, 256, 2048)
MAX_TOKENS = 12
# a side channel's handshake with no engine behind it: the smallest layout there is
TINY_LAYOUT = KVLayout(
    model="m",
    dtype="torch.float32",
    block_size=4,
    num_layers=1,
    num_kv_heads=1,
    head_dim=4,
    tp_size=1,
)
LONG = (
    "The quick brown fox jumps over the lazy dog near the river in the morning light, and "
    "then it runs across the field, past the old mill and into the dark forest beyond."
)


def producer_config(**kw) -> KVTransferConfig:
    return KVTransferConfig(role="kv_producer", engine_id="prefill", side_channel_port=0, **kw)


def consumer_config(**kw) -> KVTransferConfig:
    return KVTransferConfig(role="kv_consumer", engine_id="decode", **kw)


def run(engine: Engine, uids: set[str], timeout_s: float = 20.0) -> dict[str, list[TokenOutput]]:
    """Step ``engine`` until each of ``uids`` has its terminal output (or a refusal)."""
    outputs: dict[str, list[TokenOutput]] = {uid: [] for uid in uids}
    ended: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while ended != uids:
        assert time.monotonic() < deadline, f"still waiting for {uids - ended}"
        for uid, error in engine.take_rejected():
            outputs[uid].append(TokenOutput(uid=uid, token_ids=[], error_code=error.code))
            ended.add(uid)
        if not engine.has_work():
            time.sleep(0.002)
            continue
        for out in engine.step():
            outputs[out.uid].append(out)
            if out.finish_reason is not None:
                ended.add(out.uid)
    return outputs


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def prefill(producer: Engine, uid: str, prompt: list[int]) -> KVTransferParams:
    """What the routing sidecar does first: the prompt on the prefill pod, max_tokens 1."""
    asked = KVTransferParams(do_remote_decode=True)
    producer.add(uid, prompt, greedy(1, kv_transfer=asked))
    (last,) = [o for o in run(producer, {uid})[uid] if o.finish_reason]
    assert last.kv_transfer is not None and last.kv_transfer.do_remote_prefill
    return last.kv_transfer


def settle(producer: Engine, timeout_s: float = 5.0) -> None:
    """Until the decode side's releases have reached the prefill engine."""
    deadline = time.monotonic() + timeout_s
    while producer.transfers.lending.loans and time.monotonic() < deadline:
        producer.expire()
        time.sleep(0.01)


def closing(engine: Engine) -> Iterator[Engine]:
    """A module fixture's body: ``engine``, its side channel and reader closed after."""
    yield engine
    engine.transfers.close()


def tp2_group(source: ModelSource) -> Iterator[Driver]:
    """A module fixture's body: a TP=2 group on gloo (rank 1 in a process of its own)."""
    deaths: list[str] = []
    driver = start(source, RANKS, 2, timeout_s=60, on_death=deaths.append)
    yield driver
    assert not deaths
    driver.close()
