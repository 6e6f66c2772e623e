"""Keys and limits on real servers: `tokenline api` alone for what needs no stage (key-file
rotation, oversized bodies over a real socket), and one four-process stack started with keys
for the official openai client."""

from __future__ import annotations

import os
import socket
import time

import httpx
import openai
import pytest
from api_testkit import api_process

KEY = "sk-live-static-key"
FILE_KEY_OLD = "sk-live-file-key-1"
FILE_KEY_NEW = "sk-live-file-key-2"


def _write_keys(path, *keys: str) -> None:
    """Replace the file in one rename, as a Secret update does (a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# api keys\n" + "\n".join(keys) + "\n")
    os.replace(tmp, path)


def _status(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=10).status_code


def test_a_rotated_key_file_applies_without_a_restart(tmp_path):
    key_file = tmp_path / "keys"
    _write_keys(key_file, FILE_KEY_OLD)
    with api_process(tmp_path, "--api-key", KEY, "--api-key-file", str(key_file)) as api:
        pid = api.process.pid
        assert _status(api.url, FILE_KEY_OLD) == 200
        assert _status(api.url, FILE_KEY_NEW) == 401
        _write_keys(key_file, FILE_KEY_NEW)
        deadline = time.monotonic() + 10
        while _status(api.url, FILE_KEY_NEW) != 200:
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.2)
        assert _status(api.url, FILE_KEY_OLD) == 401
        assert _status(api.url, KEY) == 200  # --api-key keys stay
        assert _status(api.url, None) == 401
        assert api.process.pid == pid and api.process.poll() is None
        log = api.log()
    assert "API key(s) in force" in log
    for secret in (KEY, FILE_KEY_OLD, FILE_KEY_NEW):
        assert secret not in log


def _raw_request(port: int, head: bytes, body_chunks=(), timeout: float = 10) -> bytes:
    """Send ``head`` then as much of ``body_chunks`` as the server takes; its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending: what we want
        received = b""
        try:
            while data := sock.recv(65536):
                received += data
        except (ConnectionResetError, TimeoutError):
            pass
        return received


def test_a_64_mib_body_is_refused_before_it_is_sent(tmp_path):
    with api_process(tmp_path) as api:
        port = int(api.url.rsplit(":", 1)[1])
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n"
        )
        started = time.monotonic()
        answer = _raw_request(port, head)  # not a byte of the body is sent
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"request_too_large"' in answer
        assert time.monotonic() - started < 5


def test_a_chunked_body_is_cut_off_at_the_limit(tmp_path):
    with api_process(tmp_path, "--max-body-size", "1MiB") as api:
        port = int(api.url.rsplit(":", 1)[1])
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"x" * 65536
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0

        def body():  # 64 MiB, if the server kept reading
            nonlocal sent
            yield b'1d\r\n{"model": "tiny", "prompt": "\r\n'
            for _ in range(1024):
                sent += len(piece)
                yield chunk

        answer = _raw_request(port, head, body())
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert sent < 32 * 2**20, f"the server read {sent} bytes of a refused body"
        assert httpx.get(f"{api.url}/health").status_code == 200


# ── a whole stack with keys ────────────────────────────────────────────────────────────────────
@pytest.fixture(scope="module")
def keyed_stack(launch_stack, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    _write_keys(key_file, FILE_KEY_OLD)
    running = launch_stack(
        "--request-timeout", "60", "--api-key", KEY, "--api-key-file", str(key_file)
    )
    yield running
    running.stop()


def test_the_openai_client_with_a_key(keyed_stack):
    base = f"{keyed_stack.api_url}/v1"
    for key in (KEY, FILE_KEY_OLD):
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=keyed_stack.model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 3
        chunks = list(
            client.completions.create(
                model=keyed_stack.model, prompt="hello", max_tokens=3, stream=True
            )
        )
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    wrong = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_probes_and_metrics_need_no_key(keyed_stack):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_stack.api_url}{path}").status_code == 200
    assert httpx.get(f"{keyed_stack.api_url}/v1/models").status_code == 401


def test_no_key_in_the_stacks_log(keyed_stack):
    with open(keyed_stack.log_path) as f:
        log = f.read()
    assert KEY not in log and FILE_KEY_OLD not in log


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        below = [p for p, parent in parents.items() if parent == current]
        found += below
        frontier += below
    return found


def test_no_key_on_any_child_command_line(keyed_stack):
    """`ps` shows every local user each process's command line: the keys given to `serve`
    reach the api through its environment, which only its own user can read."""
    children = _descendants(keyed_stack.process.pid)
    stages = {s: keyed_stack.pid_of(s) for s in ("api", "tokenizer", "scheduler", "detokenizer")}
    assert set(stages.values()) <= set(children)
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert KEY.encode() not in cmdline, cmdline
    with open(f"/proc/{stages['api']}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    assert f"TOKENLINE_API_KEY={KEY}".encode() in environ  # how it got there instead
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        with open(f"/proc/{stages[stage]}/environ", "rb") as f:
            assert KEY.encode() not in f.read(), stage


# Last in this module: an empty prompt once took the scheduler down, and if it ever does
# again, nothing after it uses this stack.
def test_an_empty_prompt_is_answered_and_kills_nothing(keyed_stack):
    pids = {s: keyed_stack.pid_of(s) for s in ("tokenizer", "scheduler", "detokenizer")}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{keyed_stack.api_url}/v1/completions"
    for prompt in ("", [""]):
        body = {"model": keyed_stack.model, "prompt": prompt, "max_tokens": 2}
        response = httpx.post(url, json=body, headers=headers, timeout=30)
        assert response.status_code in (200, 400), response.text
    time.sleep(1.5)
    assert {s: keyed_stack.pid_of(s) for s in pids} == pids, "a stage restarted"
    ok = {"model": keyed_stack.model, "prompt": "still serving", "max_tokens": 2}
    assert httpx.post(url, json=ok, headers=headers, timeout=30).status_code == 200
