"""Real servers on loopback for the fetch tests: a file server that can cut connections and
throttle, a fake Hugging Face Hub built on it, and a TCP proxy that cuts (moto serves S3).

A module of its own, not conftest.py: test files import from it (tests/ is no package, and
pytest inserts this directory into sys.path)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import socket
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenline.fetch.retry import Backoff

# Retries in milliseconds, so a test of four failed attempts takes no time.
FAST = Backoff(attempts=4, base=0.01, cap=0.05)


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    ranges: bool = True  # honour Range requests


@dataclass
class Served:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    status: int
    sent: int  # body bytes written


class FileServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 whose routes are plain functions.

    ``cut[path] = [n1, n2, ...]``: the next GETs of ``path`` send n1, n2, ... body bytes and then
    drop the connection (a flaky link), one limit per GET. ``throttle`` (bytes/s) slows every
    body down, so two fetchers started together really overlap.
    """

    def __init__(self) -> None:
        self.routes: list[tuple[re.Pattern[str], Callable[..., Reply]]] = []
        self.log: list[Served] = []
        self.cut: dict[str, list[int]] = {}
        self.throttle: float | None = None
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.handle_any(head=True)

            def do_GET(self) -> None:
                self.handle_any(head=False)

            def handle_any(self, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                reply = Reply(404, b"not found")
                for pattern, route in server.routes:
                    m = pattern.fullmatch(path)
                    if m:
                        reply = route(self, *m.groups())
                        break
                status, body, headers = reply.status, reply.body, dict(reply.headers)
                rng = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                if (
                    rng
                    and status == 200
                    and reply.ranges
                    and (not if_range or if_range == headers.get("ETag"))
                ):
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                    if start >= len(body):
                        status, body = 416, b""
                        headers["Content-Range"] = f"bytes */{len(reply.body)}"
                    else:
                        status = 206
                        headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                        body = body[start:]
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                if status in (200, 206) and reply.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                sent = 0
                limit = None
                with server.lock:
                    if not head and server.cut.get(path):
                        limit = server.cut[path].pop(0)
                if not head:
                    sent = self.send_body(body, limit)
                with server.lock:
                    server.log.append(
                        Served(
                            self.command,
                            path,
                            {k.lower(): v for k, v in self.headers.items()},
                            status,
                            sent,
                        )
                    )
                if limit is not None and sent < len(body):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            def send_body(self, body: bytes, limit: int | None) -> int:
                sent = 0
                view = memoryview(body)
                step = 16384
                while sent < len(body):
                    n = min(step, len(body) - sent)
                    if limit is not None:
                        n = min(n, limit - sent)
                        if n <= 0:
                            return sent
                    try:
                        self.wfile.write(view[sent : sent + n])
                    except (BrokenPipeError, ConnectionResetError):
                        return sent
                    sent += n
                    if server.throttle:
                        time.sleep(n / server.throttle)
                return sent

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # the connections this server cuts on purpose end in errors

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def route(self, pattern: str, fn: Callable[..., Reply]) -> None:
        self.routes.append((re.compile(pattern), fn))

    def file(self, path: str, body: bytes, **headers: str) -> None:
        etag = '"' + hashlib.md5(body).hexdigest() + '"'
        self.route(re.escape(path), lambda _h: Reply(200, body, {"ETag": etag, **headers}))

    def bytes_sent(self, path: str) -> int:
        return sum(s.sent for s in self.log if s.path == path and s.method == "GET")

    def gets(self, path: str) -> list[Served]:
        return [s for s in self.log if s.path == path and s.method == "GET"]


def model_files(seed: bytes = b"a", shard: int = 300_000) -> dict[str, bytes]:
    """A small model directory: a config, a tokenizer file and a weight shard of ``shard``
    pseudo-random bytes (different for each seed, so revisions differ)."""
    weights = b"".join(
        hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(shard // 32)
    )
    return {
        "config.json": json.dumps({"model_type": "llama", "seed": seed.decode()}).encode(),
        "generation_config.json": json.dumps({"eos_token_id": 2}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "seed": seed.decode()}).encode(),
        "model.safetensors": weights,
    }


def tar_gz(files: dict[str, bytes], top: str | None = "model") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, body in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


# ── a fake Hugging Face Hub ────────────────────────────────────────────────────────────────────


def git_blob_sha1(body: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()


class FakeHub:
    """The routes huggingface_hub's model_info and a resolve download use:

    GET /api/models/{repo}[/revision/{rev}]?blobs=true -> {"id", "sha", "siblings": [...]}
    GET|HEAD /{repo}/resolve/{rev}/{file} -> the bytes, with X-Repo-Commit, ETag and, for LFS
        files, X-Linked-Etag / X-Linked-Size, as the Hub sends them
    Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, GatedRepo, EntryNotFound) the way
    huggingface_hub tells them apart. A gated repo answers 401 without a token, 403 with a token
    that was not granted access.
    """

    LFS_SUFFIXES = (".safetensors", ".bin")

    def __init__(self, server: FileServer) -> None:
        self.server = server
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> commit -> files
        self.refs: dict[str, dict[str, str]] = {}  # repo -> branch/tag -> commit
        self.gated: dict[str, str] = {}  # repo -> the token that was granted access
        self.corrupt: set[str] = set()  # file names served with one byte flipped
        self.size_override: dict[str, int] = {}
        self.bare = False  # a mirror that lists file names only, no sizes or blob ids
        server.route(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", self.info)
        server.route(r"/api/models/([^/]+/[^/]+)", lambda h, repo: self.info(h, repo, "main"))
        server.route(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.resolve)

    def add(self, repo: str, ref: str, files: dict[str, bytes]) -> str:
        commit = hashlib.sha1(repo.encode() + ref.encode() + b"".join(files.values())).hexdigest()
        self.repos.setdefault(repo, {})[commit] = files
        self.refs.setdefault(repo, {})[ref] = commit
        return commit

    def _commit(self, handler, repo: str, rev: str) -> tuple[str | None, Reply | None]:
        if repo not in self.repos:
            return None, Reply(404, b"{}", {"X-Error-Code": "RepoNotFound"})
        if repo in self.gated:
            auth = handler.headers.get("Authorization", "")
            if not auth:
                return None, Reply(401, b"{}", {"X-Error-Code": "GatedRepo"})
            if auth != f"Bearer {self.gated[repo]}":
                return None, Reply(403, b"{}", {"X-Error-Code": "GatedRepo"})
        commit = self.refs[repo].get(rev, rev if rev in self.repos[repo] else None)
        if commit is None:
            return None, Reply(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
        return commit, None

    def info(self, handler, repo: str, rev: str) -> Reply:
        commit, error = self._commit(handler, repo, rev)
        if error:
            return error
        siblings = []
        for name, body in self.repos[repo][commit].items():
            size = self.size_override.get(name, len(body))
            entry = {"rfilename": name, "size": size, "blobId": git_blob_sha1(body)}
            if self.bare:
                entry = {"rfilename": name}
            elif name.endswith(self.LFS_SUFFIXES):
                sha = hashlib.sha256(body).hexdigest()
                entry["lfs"] = {"size": size, "sha256": sha, "pointerSize": 134}
            siblings.append(entry)
        body = {"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings}
        if repo in self.gated:
            body["gated"] = "manual"
        return Reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def resolve(self, handler, repo: str, rev: str, name: str) -> Reply:
        commit, error = self._commit(handler, repo, rev)
        if error:
            return error
        files = self.repos[repo][commit]
        if name not in files:
            return Reply(404, b"", {"X-Error-Code": "EntryNotFound"})
        body = files[name]
        if name in self.corrupt:
            body = bytes([body[0] ^ 1]) + body[1:]
        headers = {"X-Repo-Commit": commit, "Content-Type": "application/octet-stream"}
        if name.endswith(self.LFS_SUFFIXES):
            sha = hashlib.sha256(files[name]).hexdigest()
            headers |= {
                "ETag": f'"{sha}"',
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(body)),
            }
        else:
            headers["ETag"] = f'"{git_blob_sha1(files[name])}"'
        return Reply(200, body, headers)


# ── S3: moto's server, and a proxy that cuts a connection mid-body ────────────────────────────


def sha256_b64(body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(body).digest()).decode()


class CuttingProxy:
    """A TCP proxy to ``upstream`` that drops the connection once more than ``after`` response
    bytes went through it, ``times`` times. Metadata replies are small, so only a large body is
    cut, the way a flaky link cuts a long transfer."""

    def __init__(self, upstream: str, after: int, times: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.after, self.times = after, times
        self.cuts = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self.pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, True), daemon=True).start()

    def pipe(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        total = 0
        try:
            while data := src.recv(65536):
                if response and self.cuts < self.times and total + len(data) > self.after:
                    self.cuts += 1
                    dst.sendall(data[: max(self.after - total, 0)])
                    break
                dst.sendall(data)
                total += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
