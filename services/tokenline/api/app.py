"""The api stage: a FastAPI app whose lifespan owns the ring, and a uvicorn server that drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from tokenline.api.endpoints.lora import runtime_updates_allowed
from tokenline.api.http.auth import ApiKeyAuth, ApiKeys
from tokenline.api.http.body_size import BodySizeLimit
from tokenline.api.http.cors import OpenAIShapedCORS, RefuseWebSockets
from tokenline.api.http.errors import (
    ApiError,
    http_error,
    unexpected_error,
    validation_error,
)
from tokenline.api.http.head import HeadAsGet
from tokenline.api.openai.generation_defaults import request_defaults
from tokenline.api.ring.client import RingClient
from tokenline.api.ring.lora_names import LoraNames
from tokenline.api.routes import lora_router, router
from tokenline.lifecycle import freeze_startup_heap
from tokenline.settings import Settings
from tokenline.transport import AsyncRing

log = logging.getLogger(__name__)


def create_app(settings: Settings, heartbeat_timeout: float = 5.0) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ring = AsyncRing(settings.endpoints, settings.ring_security)
        ring_client = RingClient(settings, ring, heartbeat_timeout, app.state.lora_names)
        app.state.ring_client = ring_client
        await ring_client.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await ring_client.stop()

    app = FastAPI(title="tokenline", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.started = int(time.time())
    app.state.settings = settings
    # what a request's left-out sampling fields become (the model's generation config)
    app.state.request_defaults = request_defaults(settings)
    # The LoRA adapters requests may name: the endpoints read them, the ring client keeps them
    app.state.lora_names = LoraNames(
        settings.enable_lora, settings.model_name, settings.model, settings.model_names
    )
    app.include_router(router)
    if runtime_updates_allowed(settings):
        # Not served otherwise, as in vLLM: a 404 like any unknown route, not a refusal
        app.include_router(lora_router)
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)
    # The last added runs first: keys are checked before a byte of the body is read.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_size)
    app.add_middleware(ApiKeyAuth, keys=ApiKeys(settings.api_keys, settings.api_key_file))
    app.add_middleware(HeadAsGet)
    app.add_middleware(RefuseWebSockets)
    if settings.allowed_origins:
        # Outermost: a preflight carries no key, and an error answer needs the headers too
        # for the browser to show it.
        app.add_middleware(
            OpenAIShapedCORS,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Tokenline-Timings", "Retry-After"],
            max_age=600,
        )
    return app


class DrainingServer(uvicorn.Server):
    """On SIGTERM: fail readiness, refuse new requests, let in-flight ones finish for
    ``drain_timeout`` seconds, abort the rest with reason ``shutdown``, then exit."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is None and hasattr(self._app.state, "ring_client"):
            loop = asyncio.get_event_loop()
            self._drain_task = loop.create_task(self._drain())
        else:  # a second signal, or nothing to drain: stop now
            super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        ring_client: RingClient = self._app.state.ring_client
        ring_client.draining = True
        log.info(
            "api: draining %d in-flight request(s) for up to %.0fs",
            ring_client.in_flight,
            self._drain_timeout,
        )
        deadline = time.monotonic() + self._drain_timeout
        while ring_client.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110 (polls a count)
            await asyncio.sleep(0.1)
        if ring_client.in_flight:
            ring_client.fail_all("shutdown")
            await asyncio.sleep(0.5)  # let the handlers send their error events
        self.should_exit = True


# Longer than the idle timeouts of the clients and proxies in front of us (httpx and the
# OpenAI SDK drop pooled connections after 5 s, nginx and cloud load balancers after 60 s):
# a server that closes an idle connection first races the client reusing it, and the
# client's request dies with "connection reset".
KEEP_ALIVE_TIMEOUT_S = 75


def run(settings: Settings) -> int:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        # Chosen, not left to "auto": the pure-Python defaults cost the api most of a core
        # when streaming to a few dozen clients (benchmarks/README.md).
        loop="uvloop",
        http="httptools",
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    server = DrainingServer(config, app, settings.drain_timeout)
    server.run(sockets=[listening_socket(settings.host, settings.port)])
    return 0


# Accepted connections inherit this from the listening socket. A small kernel send buffer
# makes an unread stream block the sender after tens of kilobytes instead of megabytes, so
# backpressure (and the slow-client limit) starts where the api can see it.
SEND_BUFFER_BYTES = 32 * 1024


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
