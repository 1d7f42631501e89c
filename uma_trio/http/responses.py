"""JSON responses and error objects for the gateway: OpenAI's shape, Anthropic's under
/v1/messages (even for errors answered outside a route: 404, 405, 500)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..protocol.errors import ErrorCode
from ..protocol.openai import ApiError
from ..protocol.openai_errors import shape_for

_json = msgspec.json.Encoder()


def json_response(value: Any, headers: Mapping[str, str] | None = None, status: int = 200) -> Response:
    return Response(_json.encode(value), status_code=status, media_type="application/json", headers=headers)


def error_response(error: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    if error.status in (429, 503) and error.uma_code != ErrorCode.SHUTTING_DOWN:
        # Busy or loading: worth a retry soon.  A draining daemon says nothing: a router
        # takes Retry-After as how long to rest it (LiteLLM, ahead of its cooldown_time), and
        # one second brought its retries back every second of the drain.
        headers = {"retry-after": "1", **(headers or {})}
    if error.close_connection:  # the rest of a request would follow: the connection cannot go on
        headers = {"connection": "close", **(headers or {})}
    if error.shape == "anthropic":  # Anthropic's clients log an error's request-id (the SDK's request_id)
        headers = {"request-id": f"req_{secrets.token_hex(12)}", **(headers or {})}
    return json_response(error.body(), headers=headers, status=error.answer_status)


async def unexpected_error_response(request: Request, exc: Exception) -> Response:
    """A bug: still the API's error object (Starlette logs the traceback and re-raises)."""
    error = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
    error.shape = shape_for(request.url.path)
    return error_response(error)


async def http_error_response(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 as the API's error objects."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = ApiError(exc.status_code, message, code=code)
    error.shape = shape_for(request.url.path)
    return error_response(error, headers=exc.headers)
