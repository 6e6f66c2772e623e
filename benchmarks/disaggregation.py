"""Decode streams while long prompts arrive: one mixed stack against a prefill stack and a
decode stack (prefill/decode disaggregation over NIXL), the routing sidecar's two calls made by
this script. Reports the inter-token latency of the decode streams (p50, p99).

Eight streams generate ``--tokens`` tokens each (ignore_eos) while a long prompt (``--prompt``
tokens) arrives every ``--every`` seconds. Mixed: the long prompts go to the same stack, whose
steps then carry their prefill chunks beside the streams' tokens. Split: the streams run on the
decode stack; each long prompt is prefilled on the prefill stack, and only its last partial
block is computed by the decode stack. On one machine both stacks share its cores: with
``--pin`` the prefill stack runs on the last core and the decode stack on the others (the mixed
stack on all).

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/disaggregation.py --model /tmp/smollm2-shape --pin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx
from soak import free_port_block, wait_ready  # this folder's: the same stack handling

PRODUCER = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
CONSUMER = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'


@contextmanager
def stack(model: str, *flags: str, cores: str | None = None, env: dict | None = None):
    """A ``tokenline serve`` of ``model``; yields its base URL."""
    port = free_port_block(4)
    argv = [sys.executable, "-m", "tokenline.cli", "serve", "--model", model, "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--ipc-dir", tempfile.mkdtemp(prefix="tl-bench-"), *flags]
    if cores:
        argv = ["taskset", "-c", cores, *argv]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    process = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, 300, process)
        except RuntimeError as exc:
            raise SystemExit(f"{exc}; see {log.name}") from None
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


async def stream(client: httpx.AsyncClient, url: str, tokens: int, gaps: list[float]) -> None:
    body = {
        "model": "m",
        "prompt": "The history of the lighthouse",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


async def long_prompt(
    client: httpx.AsyncClient,
    mixed: str | None,
    prefill: str | None,
    decode: str | None,
    prompt: list[int],
) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if mixed is not None:
        (await client.post(mixed + "/v1/completions", json=body)).raise_for_status()
        return
    first = await client.post(
        prefill + "/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    first.raise_for_status()
    params = first.json()["kv_transfer_params"]
    answer = await client.post(
        decode + "/v1/completions", json={**body, "kv_transfer_params": params}
    )
    answer.raise_for_status()


async def measure(args, mixed: str | None, prefill: str | None, decode: str | None) -> dict:
    gaps: list[float] = []
    serving = mixed or decode
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [
            asyncio.create_task(stream(client, serving, args.tokens, gaps)) for _ in range(8)
        ]
        await asyncio.sleep(args.every)
        n = 0
        longs = []
        while not all(s.done() for s in streams):
            prompt = [(100 + 7 * n + i) % 30000 + 10 for i in range(args.prompt)]  # distinct
            longs.append(asyncio.create_task(long_prompt(client, mixed, prefill, decode, prompt)))
            n += 1
            await asyncio.sleep(args.every)
        await asyncio.gather(*streams, *longs)
    gaps.sort()
    return {
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
        "long_prompts": n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each stream generates")
    parser.add_argument("--prompt", type=int, default=2000, help="tokens of each long prompt")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--pin", action="store_true", help="prefill on the last core")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    flags = (
        "--served-model-name",
        "m",
        "--max-model-len",
        str(args.prompt + 256),
        "--request-timeout",
        "600",
    )
    cores = os.cpu_count() or 2
    last, rest = str(cores - 1), f"0-{cores - 2}" if cores > 2 else "0"
    results = []
    for _ in range(args.rounds):
        with stack(args.model, *flags) as mixed:
            results.append({"setup": "mixed", **asyncio.run(measure(args, mixed, None, None))})
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(1))}
        with (
            stack(
                args.model,
                *flags,
                "--kv-transfer-config",
                PRODUCER,
                cores=last if args.pin else None,
                env=env,
            ) as prefill,
            stack(
                args.model,
                *flags,
                "--kv-transfer-config",
                CONSUMER,
                cores=rest if args.pin else None,
            ) as decode,
        ):
            results.append(
                {"setup": "prefill+decode", **asyncio.run(measure(args, None, prefill, decode))}
            )
    for row in results:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
