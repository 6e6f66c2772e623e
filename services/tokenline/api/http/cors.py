"""What browsers send beyond plain requests, answered in OpenAI's error shape: CORS preflights
(--allowed-origin) and WebSocket handshakes (no route takes one)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenline.api.http.errors import ApiError, no_websocket


class OpenAIShapedCORS(CORSMiddleware):
    """Starlette refuses a preflight with a plain-text 400 ("Disallowed CORS origin"); every
    error this server answers has OpenAI's body, so this one does too."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        message = (
            f"this server does not allow the preflight's {refused} (--allowed-origin names "
            "the origins; methods GET, HEAD, POST and OPTIONS are served)"
        )
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        headers.pop("content-type", None)
        return ApiError(response.status_code, message, "cors_refused", headers=headers).response()


class RefuseWebSockets:
    """No route takes a WebSocket. Starlette would close the handshake and uvicorn answer
    an empty 403; where the server lets the app answer the handshake with HTTP (ASGI's
    ``websocket.http.response`` extension), the answer is an OpenAI-shaped 404."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        await receive()  # websocket.connect
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        response = no_websocket(scope["path"]).response()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": response.status_code,
                "headers": response.raw_headers,
            }
        )
        await send({"type": "websocket.http.response.body", "body": response.body})
