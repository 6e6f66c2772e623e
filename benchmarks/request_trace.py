"""Which files of services/ one streaming chat request runs through, in each of the four
processes, and how often it comes back to a file it had left.

It starts `tokenline serve` (whose stages do not inherit TOKENLINE_ variables, hence the hook's own
names) with a profile hook in every process (a ``sitecustomize`` on
PYTHONPATH, idle until signalled), warms the stack up, then records the files the request's
code runs in between SIGUSR1 and SIGUSR2 to each stage: the sequence of files of services/ that
execution passes through (calls and returns; library code in between is not counted). A
second window of the same length with no request shows what the stages do anyway (heartbeats),
so the request's own files can be told apart.

    python benchmarks/request_trace.py [--model tiny] [--max-tokens 4] [--services DIR]

A "return" is an entry into a file this process had already run and left; the distinct
returns count each (from, to) pair once, however many tokens repeat it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVICES = Path(__file__).resolve().parent.parent / "services"

HOOK = """
import json, os, signal, sys

_root = os.environ["REQUEST_TRACE_ROOT"]
_out = os.environ["REQUEST_TRACE_DIR"]
_files = []


def _profile(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
    elif event == "return" and frame.f_back is not None:
        name = frame.f_back.f_code.co_filename
    else:
        return
    if name.startswith(_root) and (not _files or _files[-1] != name):
        _files.append(name)


def _start(signum, frame):
    _files.clear()
    sys.setprofile(_profile)


def _stop(signum, frame):
    sys.setprofile(None)
    with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as out:
        json.dump({"argv": sys.argv, "files": list(_files)}, out)


signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _stage_of(argv: list[str]) -> str:
    for stage in ("api", "tokenizer", "scheduler", "detokenizer"):
        if stage in argv:
            return stage
    return " ".join(argv[:3])


def _window(pids: list[int], out: Path, root: str, action) -> dict[str, list[str]]:
    for path in out.glob("*.json"):
        path.unlink()
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.1)
    action()
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while len(list(out.glob("*.json"))) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    traces = {}
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        traces[_stage_of(data["argv"])] = [f.removeprefix(root) for f in data["files"]]
    return traces


def _returns(files: list[str]) -> tuple[int, set[tuple[str, str]]]:
    seen: set[str] = set()
    count, pairs = 0, set()
    for previous, current in zip([None, *files], files, strict=False):
        if current in seen:
            count += 1
            pairs.add((previous, current))
        seen.add(current)
    return count, pairs


def _report(title: str, traces: dict[str, list[str]]) -> set[str]:
    print(f"== {title}")
    every: set[str] = set()
    distinct_returns = 0
    for stage in ("api", "tokenizer", "scheduler", "detokenizer"):
        files = traces.get(stage, [])
        count, pairs = _returns(files)
        distinct_returns += len(pairs)
        every |= set(files)
        print(f"{stage:12} {len(set(files)):3} files, {count:4} returns ({len(pairs)} distinct)")
        for name in sorted(set(files)):
            print(f"    {name}")
    print(f"all stages: {len(every)} distinct files, {distinct_returns} distinct returns\n")
    return every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--services", type=Path, default=SERVICES, help="another checkout's services/ to trace"
    )
    args = parser.parse_args()
    services = args.services.resolve()
    work = Path(tempfile.mkdtemp(prefix="request-trace-"))
    (work / "hook").mkdir()
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    (work / "out").mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(work / "hook"), str(services)]),
        "REQUEST_TRACE_ROOT": str(services / "tokenline"),
        "REQUEST_TRACE_DIR": str(work / "out"),
    }
    port = ["--port", str(args.port)]
    serve = subprocess.Popen(
        [sys.executable, "-m", "tokenline.cli", "serve", "--model", args.model, *port],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{args.port}"
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": args.max_tokens,
        "stream": True,
    }

    def request() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                pass

    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for _ in range(3):
            request()
        pids = _children(serve.pid)
        started = time.monotonic()
        root = str(services / "tokenline") + "/"
        traced = _window(pids, work / "out", root, request)
        length = time.monotonic() - started
        idle = _window(pids, work / "out", root, lambda: time.sleep(max(length - 0.1, 0.0)))
        request_files = _report(f"one streaming chat request ({args.max_tokens} tokens)", traced)
        idle_files = _report(f"an idle window of the same length ({length:.2f} s)", idle)
        print("files only the request ran:", len(request_files - idle_files))
    finally:
        serve.terminate()
        serve.wait(timeout=30)


if __name__ == "__main__":
    main()
