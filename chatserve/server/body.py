"""Reading a JSON request body safely: content type, size (declared and streamed), UTF-8, JSON.

Rejects NaN/Infinity, lone surrogates, overflowing floats and over-deep nesting with a 400.
Not field validation (protocol.py).
"""
from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from chatserve.server.errors import APIError

MAX_DEPTH = 64


def _reject_constant(name: str) -> Any:
    raise APIError(400, f"invalid JSON: {name} is not allowed", code="invalid_json")


def check_media_type(content_type: str | None) -> None:
    if not content_type:
        return                                   # tolerated: curl -d without -H, some SDKs
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"unsupported content type {media!r}: send application/json",
                       code="unsupported_media_type")
    for p in params.split(";"):
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(415, "only UTF-8 JSON is accepted", code="unsupported_media_type")


def parse_json_bytes(raw: bytes) -> Any:
    """Strict JSON from bytes: UTF-8, finite numbers, no lone surrogates, bounded depth."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except APIError:
        raise
    except RecursionError:
        raise APIError(400, "invalid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"invalid JSON: {e}", code="invalid_json") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Walk a parsed value (iteratively): depth, finite floats, strings encodable as UTF-8."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"invalid JSON: nested deeper than {MAX_DEPTH}", code="invalid_json")
        if isinstance(v, str):
            _check_str(v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise APIError(400, "invalid JSON: number out of range", code="invalid_json")
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_str(k)
                stack.append((x, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "invalid string: lone UTF-16 surrogate", code="invalid_encoding") from None


async def read_json(request: Request, max_bytes: int) -> Any:
    check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length", code="invalid_request") from None
        if n > max_bytes:
            raise APIError(413, f"request body of {n} bytes is over the {max_bytes} byte limit",
                           code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise APIError(413, f"request body is over the {max_bytes} byte limit", code="request_too_large")
    if not buf:
        raise APIError(400, "empty request body: send a JSON object", code="invalid_json")
    return parse_json_bytes(bytes(buf))


async def read_json_object(request: Request, max_bytes: int) -> dict:
    body = await read_json(request, max_bytes)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body
