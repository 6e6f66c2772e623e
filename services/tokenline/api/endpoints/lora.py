"""/v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM serves them; answered by the
scheduler over the ring.

The api checks what it can answer alone (the names, whether the adapter is already there or
not there at all) against the adapters the scheduler last reported, with vLLM's messages and
status codes; the rest travels the ring as a `protocol.LoraCall` (`RingClient.call`), and the
scheduler answers with the adapters it serves after it, or with a `Failed` (a path that holds
no adapter, a rank past --max-lora-rank) that reaches the client with the scheduler's status.
Success is vLLM's plain-text sentence with a 200.
"""

from __future__ import annotations

import logging
import os

import msgspec
from fastapi.responses import PlainTextResponse

from tokenline import protocol
from tokenline.api.endpoints.base import Endpoint
from tokenline.api.http.errors import ApiError, invalid
from tokenline.api.openai.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from tokenline.api.ring.lora_names import ChangeInProgress, name_problem, shown_uri
from tokenline.fetch.errors import InvalidURI
from tokenline.fetch.parse import parse_uri
from tokenline.fetch.uri import S3URI
from tokenline.settings import Settings

log = logging.getLogger(__name__)

#: vLLM's switch for the two endpoints, honoured beside --allow-runtime-lora-updates
RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed(settings: Settings, environ: dict[str, str] | None = None) -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served: the flag, or
    vLLM's environment variable set to 1 or true (read as vLLM reads it)."""
    env = os.environ if environ is None else environ
    from_env = env.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")
    return bool(settings.allow_runtime_lora_updates) or from_env


def _in_progress(name: str) -> ApiError:
    return invalid(
        "lora_name",
        f"a load or unload of the lora adapter '{name}' is in progress; retry once it is answered",
    )


def _not_found(name: str) -> ApiError:
    return ApiError(
        404, f"The lora adapter '{name}' cannot be found.", "model_not_found", "lora_name"
    )


class LoraAdapters(Endpoint):
    async def _send(self, call: protocol.LoraCall) -> None:
        """Send ``call`` around the ring and wait for the scheduler's answer."""
        try:
            answer = await self.ring_client.call(lambda uid: msgspec.structs.replace(call, uid=uid))
        except ApiError as exc:
            if exc.code != "request_timeout":
                raise
            # The generic deadline message speaks of tokens; this one says what is known: the
            # scheduler may still carry the change out, and /v1/models will show it if so.
            raise ApiError(
                504,
                f"the {call.action} of the lora adapter '{call.name}' was not answered within "
                f"--request-timeout ({self.settings.request_timeout:g}s); it may still take "
                "effect: see /v1/models",
                "request_timeout",
            ) from None
        if not isinstance(answer, protocol.LoraAnswer):  # a uid is answered by its own kind
            raise ApiError(500, "the ring answered a LoRA call with another kind", "server_error")

    def _require_lora(self) -> None:
        if not self.settings.enable_lora:
            raise invalid(
                None,
                "LoRA adapters are not served: start the server with --enable-lora",
                "lora_disabled",
            )

    async def load(self, body: LoadLoraAdapterRequest) -> PlainTextResponse:
        self._require_lora()
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise invalid(None, "Both 'lora_name' and 'lora_path' must be provided.")
        problem = name_problem(name)
        if problem is not None:
            raise invalid("lora_name", f"{problem}: {name!r}")
        if _sends_credentials_elsewhere(path):
            raise invalid(
                "lora_path",
                "an s3:// endpoint named by a request would be sent this server's S3 "
                "credentials; set AWS_ENDPOINT_URL on the server and leave endpoint= out, load "
                "it at start (--lora-modules, --lora-config), or add anonymous=true for a "
                "public bucket",
            )
        names = self.request.app.state.lora_names
        if name in names.bases:
            raise invalid("lora_name", f"'{name}' is the base model's name; choose another")
        if name in names:
            raise invalid("lora_name", f"The lora adapter '{name}' has already been loaded.")
        try:
            with names.changing(name):
                await self._send(protocol.LoraCall(uid="", action="load", name=name, uri=path))
        except ChangeInProgress:
            raise _in_progress(name) from None
        names.loaded(name, path)
        log.info("loaded LoRA adapter %r from %s", name, shown_uri(path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        self._require_lora()
        name = body.lora_name
        if not name and body.lora_int_id is None:
            raise invalid(None, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        names = self.request.app.state.lora_names
        if name not in names:
            raise _not_found(name)
        # The scheduler lets the adapter's requests in flight finish; its answer comes at once.
        try:
            with names.changing(name):
                await self._send(protocol.LoraCall(uid="", action="unload", name=name))
        except ChangeInProgress:
            raise _in_progress(name) from None
        log.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _sends_credentials_elsewhere(path: str) -> bool:
    """Whether loading ``path`` would sign requests with the server's S3 credentials (boto3's
    chain: its environment, IRSA, the instance profile) to an endpoint the caller chose."""
    try:
        uri = parse_uri(path)
    except InvalidURI:
        return False  # the scheduler's load says what is wrong with it
    return isinstance(uri, S3URI) and uri.endpoint is not None and not uri.anonymous
