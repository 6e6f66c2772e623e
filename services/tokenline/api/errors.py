"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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


def abort_error(reason: str) -> ApiError:
    status, code, message = ABORT_ERRORS.get(reason, (500, reason, f"aborted: {reason}"))
    return ApiError(status, message, code)
