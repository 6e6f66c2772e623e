"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import Request

from tokenline.api.http.head import HEAD_SCOPE_KEY

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
    500: "server_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        headers = dict(self.headers or {})
        if self.retry_after:
            headers["Retry-After"] = str(self.retry_after)
        # ASCII-escaped: a message that quotes client input (a lone surrogate, say) must not
        # fail to encode and turn a 400 into a 500
        content = json.dumps(self.body(), ensure_ascii=True).encode()
        return Response(content, self.status, headers, media_type="application/json")


# What the client sees when its request ends early, by abort reason.
ABORT_ERRORS = {
    "deadline": (
        504,
        "request_timeout",
        "the request ran past the server's --request-timeout; ask for fewer tokens "
        "or raise the timeout",
    ),
    "slow_client": (
        408,
        "slow_client",
        "the stream was not read for longer than --slow-client-timeout",
    ),
    "stage_failure": (
        503,
        "stage_failure",
        "a pipeline stage failed while serving this request; retry shortly",
    ),
    "shutdown": (503, "shutting_down", "the server is shutting down; retry on another replica"),
    "client_disconnect": (499, "client_disconnect", "the client went away"),
}


# ── the refusals every endpoint shares ─────────────────────────────────────────────────────────
def invalid(param: str | None, message: str, code: str = "invalid_request_error") -> ApiError:
    """A 400 naming the field at fault: every refusal of what a request asks goes through here
    (``unsupported_parameter`` for what is not served, ``limit_exceeded`` past a flag)."""
    return ApiError(400, message, code, param)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist; this server serves `{served}` (see /v1/models).",
        "model_not_found",
        "model",
    )


def ended_with(
    reason: str | None, code: str | None = None, message: str | None = None, status: int = 0
) -> ApiError:
    """A generation that ended neither ``stop`` nor ``length``: its code, message and status,
    when a stage gave them."""
    text = message or f"generation ended with {reason or 'error'}"
    return ApiError(status or 500, text, code or "engine_error")


def unencodable(exc: Exception) -> ApiError:
    """A value the schemas let through but the ring's encoder cannot carry: a gap in them."""
    return invalid(
        None,
        f"the request holds a value the server cannot carry ({exc}); keep integers "
        "within their documented ranges and strings valid Unicode",
    )


def no_websocket(path: str) -> ApiError:
    return ApiError(
        404,
        f"no WebSocket route {path}; this server answers plain HTTP requests (and SSE "
        "streams); see /openapi.json for the routes served",
        "not_found",
    )


def abort_error(reason: str) -> ApiError:
    status, code, message = ABORT_ERRORS.get(reason, (500, reason, f"aborted: {reason}"))
    return ApiError(status, message, code)


# ── exception handlers (registered in app.py) ─────────────────────────────────────────────────
_BODY_CAUSES = {
    UnicodeDecodeError: "the body is not valid UTF-8; send JSON encoded as UTF-8",
    RecursionError: "the body's JSON nests too deeply; flatten it",
}


def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's and FastAPI's own errors (no route, wrong method, unparsable body) in
    OpenAI's shape instead of ``{"detail": ...}``."""
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
        status, "invalid_request_error"
    )
    if status == 404:
        message = f"no route {request.url.path}; see /openapi.json for the routes served"
    elif status == 405:
        method = "HEAD" if request.scope.get(HEAD_SCOPE_KEY) else request.method
        message = f"{method} is not allowed on {request.url.path}"
        headers = dict(exc.headers or {})
        served = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        if "GET" in served and "HEAD" not in served:  # head.py serves it for every GET
            headers["Allow"] = ", ".join([*served, "HEAD"])
        return ApiError(status, message, code, headers=headers).response()
    elif status == 400 and exc.__cause__ is not None:
        cause = exc.__cause__
        if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
            message = "a number in the body has too many digits; no field takes one that large"
            return ApiError(status, message, code, headers=exc.headers).response()
        message = next(
            (text for kind, text in _BODY_CAUSES.items() if isinstance(cause, kind)),
            f"the body could not be parsed as JSON: {cause}",
        )
    return ApiError(status, message, code, headers=exc.headers).response()


# pydantic names union branches and validators in an error's location ("stop", "list[str]",
# 0): internals, not parameters the client sent
_LOC_NOISE = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "body"})


# a union branch that is a model shows as its class name: CamelCase, where fields are snake_case
_MODEL_NAME = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+")


def _param(loc: tuple) -> str | None:
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int)
        or (p not in _LOC_NOISE and "[" not in p and "(" not in p and not _MODEL_NAME.fullmatch(p))
    ]
    return ".".join(parts) or None


def validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if len(errors) > 1:
        # A union reports one error per branch ("stop" as a str, then as a list): of the
        # first field's errors, the deepest says best what is wrong.
        field = _param(tuple(first.get("loc", ())[:2]))
        same = [e for e in errors if _param(tuple(e.get("loc", ())[:2])) == field]
        first = max(same, key=lambda e: len(_param(tuple(e.get("loc", ()))) or ""))
    if first.get("type") == "json_invalid":
        return ApiError(
            400,
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
            "invalid_request_error",
        ).response()
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden" and param is not None:
        named = first.get("ctx", {}).get("field")  # raised by a validator, at its model's loc
        if named:
            param = f"{param}.{named}"
        field = param.rsplit(".", 1)[-1]
        where = f" (at {param})" if field != param else ""
        message = (
            f"`{field}`{where} is not supported by this server; remove it "
            "(the README lists the request fields served)"
        )
        return ApiError(400, message, "unsupported_parameter", param=param).response()
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and first.get("type") == "value_error":  # a check across fields
        return ApiError(400, f"invalid request body: {reason}", "invalid_request_error").response()
    if param is None:
        content_type = request.headers.get("content-type", "")
        if content_type and "json" not in content_type.lower():
            message = (
                f"the body must be JSON: send it with `Content-Type: application/json` "
                f"(got {content_type})"
            )
            return ApiError(415, message, "unsupported_media_type").response()
        if not content_type:
            message = "send the body as a JSON object with `Content-Type: application/json`"
            return ApiError(400, message, "invalid_request_error").response()
        if first.get("type") == "missing":
            message = "the body is empty; send a JSON object"
        else:
            message = "the body must be a JSON object"
        return ApiError(400, message, "invalid_request_error").response()
    message = f"invalid request body at {param}: {reason}"
    return ApiError(400, message, "invalid_request_error", param=param).response()


def unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug, in OpenAI's shape, with its traceback in the log."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return ApiError(
        500,
        "the server failed on this request; retry, and report it if it persists",
        "server_error",
    ).response()
