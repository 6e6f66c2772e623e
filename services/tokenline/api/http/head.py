"""``HEAD`` wherever ``GET`` is served: the GET route answers, the body is left out.

One middleware instead of a HEAD route beside every GET route, so each path has one route
and a 405's ``Allow`` header names every method served there (errors.py adds HEAD to it).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEAD_SCOPE_KEY = "tokenline.head"  # set on a request that came as HEAD


class HeadAsGet:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET", HEAD_SCOPE_KEY: True}, receive, without_body)
