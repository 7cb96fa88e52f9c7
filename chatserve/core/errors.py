"""ErrorCode: why the engine refused or ended a request, carried by AdmissionError and the engine's
deltas so the HTTP layer never classifies errors by their message text.

Only the codes; the HTTP status of each is chatserve.server.errors.status_for. Pure Python.
"""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    # the request can never run as given (400)
    INVALID_VALUE = "invalid_value"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    # refused for now; retry after a while (503)
    SERVER_OVERLOADED = "server_overloaded"
    SHUTTING_DOWN = "shutting_down"
    # ended while generating (500)
    ENGINE_ERROR = "engine_error"
    CLIENT_TOO_SLOW = "client_too_slow"
