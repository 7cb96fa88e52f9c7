"""The OpenAI error object and the exception that carries it through the HTTP layer.

Every failure a client can see is an `APIError` rendered as {"error": {message, type, param, code}}.
Not validation itself (see protocol.py).
"""
from __future__ import annotations

import math

from starlette.responses import JSONResponse

from chatserve.core.errors import ErrorCode

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_overloaded"}


class APIError(Exception):
    """A client-visible error: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(self.status, "invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def error_response(err: APIError) -> JSONResponse:
    """The JSON response for an APIError (status, OpenAI error body, Retry-After where set)."""
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers())


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


_STATUS = {ErrorCode.INVALID_VALUE: 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
           ErrorCode.SERVER_OVERLOADED: 503, ErrorCode.SHUTTING_DOWN: 503,
           ErrorCode.ENGINE_ERROR: 500, ErrorCode.CLIENT_TOO_SLOW: 500}


def status_for(code: ErrorCode | str | None) -> int:
    """The HTTP status for an engine error code (the one place this rule lives); unknown codes are 500."""
    try:
        return _STATUS[ErrorCode(code)]
    except ValueError:
        return 500


def admission_error(code: ErrorCode, message: str, retry_after: float | None) -> APIError:
    """The APIError for a refused request: its code's status, and Retry-After on a 503."""
    status = status_for(code)
    return APIError(status, message, code=code.value,
                    retry_after=(retry_after or 1.0) if status == 503 else retry_after)


def engine_error_body(message: str, code: ErrorCode | None) -> dict:
    """The OpenAI error object for a request the engine ended with an error mid-generation."""
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": (code or ErrorCode.ENGINE_ERROR).value}}
