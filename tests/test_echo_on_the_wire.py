"""Echo and prompt logprobs across the real ring: the tokenizer, scheduler and detokenizer run as
their own processes on IPC sockets, and this test plays the api (it binds the api's inbox and
pushes into the tokenizer's). The first reply carries the prompt as sent and one logprob entry
per prompt token; every stage lets the uid go afterwards."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import msgspec
import pytest
import zmq

from tokenline import protocol
from tokenline.transport import RingEndpoints

STAGES = ("tokenizer", "scheduler", "detokenizer")
PROMPT = "The old river road runs far, é 🙂"


@pytest.fixture(scope="module")
def ring(model_cache, tmp_path_factory, port_block):
    """(endpoints, metrics ports) of the three ring stages, running until the module ends."""
    directory = tmp_path_factory.mktemp("ring")
    endpoints = RingEndpoints.in_directory(str(directory))
    flags = [f"--{s}-endpoint={endpoints.of(s)}" for s in protocol.STAGES]
    base = port_block(3)
    ports = {stage: base + i for i, stage in enumerate(STAGES)}
    processes = []
    for stage in STAGES:
        log = open(directory / f"{stage}.log", "w")  # closed once the process ends
        argv = [sys.executable, "-m", "tokenline.cli", stage, "--model-cache-dir"]
        argv += [str(model_cache), "--metrics-port", str(ports[stage]), *flags]
        if stage == "scheduler":
            argv += ["--device", "cpu", "--max-num-batched-tokens", "8"]  # chunked prefill
        processes.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        yield endpoints, ports
    finally:
        for process, _ in processes:
            process.terminate()
        for process, log in processes:
            process.wait(30)
            log.close()


def _metric(port: int, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def _exchange(endpoints: RingEndpoints, requests: list[protocol.Generate], timeout: float = 120):
    """Send the requests round the ring; every reply per uid, until each uid has ended."""
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(endpoints.api)
    outbox.connect(endpoints.tokenizer)
    to_ring, from_ring = protocol.Codec(protocol.ToTokenizer), protocol.Codec(protocol.ToApi)
    replies: dict[str, list[protocol.Reply]] = {r.uid: [] for r in requests}
    try:
        for request in requests:
            outbox.send(to_ring.encode(request))
        deadline = time.monotonic() + timeout
        while any(not r or r[-1].finish_reason is None for r in replies.values()):
            assert time.monotonic() < deadline, f"no end for some uid: {replies}"
            if not inbox.poll(500):
                continue
            message = from_ring.decode(inbox.recv())
            assert not isinstance(message, protocol.Failed), message
            if isinstance(message, protocol.ReplyBatch):
                for reply in message.replies:
                    replies[reply.uid].append(reply)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
    return replies


def test_the_first_reply_carries_the_prompt_and_its_logprobs(ring, tiny_tokenizer):
    endpoints, ports = ring
    sampling = protocol.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scored = msgspec.structs.replace(sampling, echo=True, prompt_logprobs=2, logprobs=1)
    requests = [
        protocol.Generate(uid="w-plain", sampling=sampling, timeout_s=60, prompt=PROMPT),
        protocol.Generate(uid="w-echo", sampling=scored, timeout_s=60, prompt=PROMPT),
        protocol.Generate(
            uid="w-read",
            sampling=msgspec.structs.replace(scored, max_tokens=0),
            timeout_s=60,
            prompt=PROMPT,
        ),
    ]
    replies = _exchange(endpoints, requests)
    ids = tiny_tokenizer(PROMPT)["input_ids"]
    for uid in ("w-echo", "w-read"):
        first, *rest = replies[uid]
        assert first.prompt_text == PROMPT, uid
        entries = first.prompt_logprobs
        assert len(entries) == len(ids) == replies[uid][-1].prompt_tokens
        assert entries[0] is None
        assert [e.token for e in entries[1:]] == [tiny_tokenizer.decode([i]) for i in ids[1:]]
        assert all(len(e.top) == 2 and e.top[0].logprob >= e.logprob - 1e-6 for e in entries[1:])
        assert all(r.prompt_text is None and r.prompt_logprobs is None for r in rest), uid
    assert all(r.prompt_text is None and r.prompt_logprobs is None for r in replies["w-plain"])
    text = {uid: "".join(r.text for r in rs) for uid, rs in replies.items()}
    assert text["w-echo"] == text["w-plain"], "asking for the prompt changes no output"
    read = replies["w-read"]
    assert (text["w-read"], read[-1].finish_reason, sum(r.num_tokens for r in read)) == (
        "",
        "length",
        0,
    )
    deadline = time.monotonic() + 10  # the gauges follow the ledger within a sweep
    while any(_metric(port, "tokenline_live_uids") for port in ports.values()):
        assert time.monotonic() < deadline, "a stage still holds a uid"
        time.sleep(0.2)
