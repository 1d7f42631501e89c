"""API keys on the HTTP gateway: the ASGI middleware that checks them and the principal a
key names (docs/SECURITY.md)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request

from ..protocol.openai import ApiError
from ..protocol.openai_errors import shape_for
from .responses import error_response
from .serve import Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers, probes)
HTTP_OWNER = "http"  # the principal of requests made without a key


class BearerAuth:
    """ASGI middleware: with API keys set, every path but /health needs one of them, as
    ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header).  Every key
    is compared, in constant time, so the answer's timing says nothing about which came
    close.  The key a request used names its principal (``scope["state"]["uma_owner"]``):
    holders of different keys never share cached prefixes."""

    def __init__(self, app: Any, api_keys: Sequence[str], count: Callable[[ApiError], None]) -> None:
        self.app = app
        self.keys = [(key.encode(), key_owner(key)) for key in api_keys]
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization")
            scheme, _, token = (given or b"").strip().partition(b" ")
            if given is None and b"x-api-key" in headers:
                given, scheme, token = headers[b"x-api-key"], b"bearer", headers[b"x-api-key"]
            owner = None
            for key, key_principal in self.keys:  # no early exit: the time is the same either way
                if hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer":
                    owner = key_principal
            if scope["path"] in OPEN_PATHS:  # answered either way; a key says more (/health)
                if owner is not None:
                    scope.setdefault("state", {})["uma_owner"] = owner
                await self.app(scope, receive, send)
                return
            if given is None:
                # Anthropic's clients send their key as x-api-key: name the header they know.
                header = (
                    "x-api-key: <key>"
                    if shape_for(scope["path"]) == "anthropic"
                    else "Authorization: Bearer <key>"
                )
                error: ApiError | None = ApiError(
                    401, f"You didn't provide an API key: send `{header}`.", code="invalid_api_key"
                )  # fmt: skip
            elif owner is None:
                error = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            else:
                error = None
                scope.setdefault("state", {})["uma_owner"] = owner
            if error is not None:
                error.shape = shape_for(scope["path"])  # answered before the route's own shape
                self.count(error)
                response = error_response(error, headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def key_owner(key: str) -> str:
    """The principal of requests made with ``key``: a digest, never the key itself."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def request_owner(request: Request) -> str:
    return str(request.scope.get("state", {}).get("uma_owner", HTTP_OWNER))
