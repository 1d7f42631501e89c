"""Who may talk to the HTTP gateway from a browser: Host, Origin and Content-Type checks.

A web page in the user's browser can send requests to ``127.0.0.1``: a cross-origin
``text/plain`` or form POST needs no CORS preflight, and a DNS-rebinding page (a name that
resolves to 127.0.0.1, ``Host: evil.example``) can even read the answers.  Three checks stop
that, before authentication and routing (docs/SECURITY.md "Web pages"):

* **Host** must name this server: an IP address, ``localhost``, the ``--http`` host, or one
  of ``--allowed-hosts`` (``*`` allows any).  Rebinding pages send their own name.
* **Origin**, when a browser sends one, must match ``--cors-origins`` (defaults: local pages,
  desktop-app and editor webviews).  ``Origin: null`` (sandboxed frames, ``file:``) is refused
  unless listed.  Tools that are not browsers send no Origin and are not affected.
* **Content-Type** of a POST must be ``application/json``, which no page can send across
  origins without a preflight that the origin check answers.  A POST with no Origin and
  either no Content-Type or ``application/octet-stream`` comes from a tool (every current
  browser sends an Origin with a POST; a form has a type, never that one): its body is read
  as JSON, as Ollama reads every body (LiteLLM's Ollama provider sends no type, its async
  calls ``application/octet-stream``).

Allowed origins get CORS headers (Starlette's ``CORSMiddleware``, which also answers their
preflights), on this middleware's own refusals too (a wrong Content-Type): without them the
page's script sees an opaque network error instead of the 415.  The matching here is pure;
:class:`OriginGuard` is the ASGI middleware.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..protocol.errors import shown
from ..protocol.openai import ApiError
from ..protocol.openai_errors import shape_for

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_CORS_ORIGINS = (
    "http://localhost", "http://localhost:*", "https://localhost", "https://localhost:*",
    "http://127.0.0.1", "http://127.0.0.1:*", "https://127.0.0.1", "https://127.0.0.1:*",
    "http://[::1]", "http://[::1]:*", "https://[::1]", "https://[::1]:*",
    "app://*", "tauri://*", "vscode-webview://*",
)  # fmt: skip
JSON_TYPE = "application/json"
# What tools send a JSON body as when they name no type of their own: httpx and aiohttp say
# this of raw bytes (LiteLLM's async Ollama calls were all 415s).  No form can send it.
RAW_BYTES_TYPE = "application/octet-stream"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"


def host_name(header: str) -> str:
    """The host of a ``Host`` header value, without its port or IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(
    bind_host: str | None, extra: Iterable[str], own_names: Iterable[str] = ()
) -> frozenset[str]:
    """Loopback names, the host the gateway is bound to and ``extra``; bound to a wildcard
    (every address), the machine's own names instead (``own_names``: its hostname and fully
    qualified name, each also as its mDNS ``.local`` name), which other machines on the LAN
    address it by (a router's ``http://mac-a.local:8080/v1`` was a 403).  A rebinding page
    comes under a name of its attacker's, never this machine's own."""
    hosts = {*LOOPBACK_HOSTS, *(host_name(h) for h in extra)}
    if bind_host and bind_host not in ("0.0.0.0", "::", ""):
        hosts.add(host_name(bind_host if ":" not in bind_host else f"[{bind_host}]"))
    elif bind_host is not None:
        for name in (n.strip().lower().rstrip(".") for n in own_names):
            if name and name not in ("localhost", "localhost.localdomain"):
                hosts.update({name, name if name.endswith(".local") else f"{name.split('.')[0]}.local"})
    return frozenset(hosts)


def host_allowed(name: str, hosts: frozenset[str]) -> bool:
    """A listed name, or any IP address: a rebinding page reaches us under a *name* it
    controls, while a page whose origin is our own address would be served by us."""
    if name in hosts:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def origin_pattern(patterns: Sequence[str]) -> re.Pattern[str]:
    """One regular expression for ``patterns``: ``*`` stands for any run of characters other
    than ``/`` (a port, a host), everything else is literal; matched whole.  A closing ``:*``
    is any port or none: a browser writes a page on the scheme's default port without one
    (``http://localhost:*`` refused ``http://localhost``)."""
    parts = [_origin_regex(p.strip().lower()) for p in patterns if p.strip()]
    return re.compile("|".join(f"(?:{p})" for p in parts) or "(?!)")


def _origin_regex(pattern: str) -> str:
    def literal(text: str) -> str:
        return re.escape(text).replace(r"\*", "[^/]*")

    if pattern.endswith(":*"):
        return literal(pattern[:-2]) + "(?::[^/]*)?"
    return literal(pattern)


def _media_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


def content_type_is_json(header: str | None) -> bool:
    return header is not None and _media_type(header) == JSON_TYPE


def check(
    *,
    method: str,
    host: str | None,
    origin: str | None,
    content_type: str | None,
    hosts: frozenset[str],
    origins: re.Pattern[str],
) -> ApiError | None:
    """The refusal for one request, or None.  Pure."""
    if "*" not in hosts and (host is None or not host_allowed(host_name(host), hosts)):
        return ApiError(
            403, f"Host {shown(host or '')!r} is not this server's (add it with --allowed-hosts)",
            type="permission_error", code="host_not_allowed",
        )  # fmt: skip
    if origin is not None and not origins.fullmatch(origin.strip().lower()):
        return ApiError(
            403, f"requests from the web origin {shown(origin)!r} are not allowed (--cors-origins)",
            type="permission_error", code="origin_not_allowed",
        )  # fmt: skip
    # No Content-Type, or raw bytes, from a tool (no Origin) is JSON, as Ollama reads it:
    # LiteLLM's Ollama provider (Aider's) sends none, its async calls raw bytes.  A page's
    # request always has an Origin (a POST), and is then checked as any other.
    raw = content_type is None or _media_type(content_type) == RAW_BYTES_TYPE
    tool_without_type = origin is None and raw
    if method == "POST" and not content_type_is_json(content_type) and not tool_without_type:
        got = shown(content_type or "none")
        return ApiError(
            415, f"send the body as JSON with `Content-Type: {JSON_TYPE}` (got {got!r})",
            code=UNSUPPORTED_MEDIA_TYPE,
        )  # fmt: skip
    return None


# A request target in absolute form, as the ASGI server passes it on ("/http://host/path").
_ABSOLUTE = re.compile(r"^/?https?://([^/?#]*)(.*)$", re.IGNORECASE | re.DOTALL)
_ABSOLUTE_RAW = re.compile(rb"^/?https?://[^/?#]*(.*)$", re.IGNORECASE | re.DOTALL)


def origin_form(scope: dict[str, Any]) -> dict[str, Any]:
    """``scope`` with a request line in absolute form (``GET http://host:port/path``, which
    RFC 9112 §3.2.2 requires a server to accept, and proxy-minded clients send) read as its
    path, and Host as the target's authority: the RFC has the server ignore the Host header
    then, so the Host check applies to the authority.  It was a 404 naming the URL."""
    match = _ABSOLUTE.match(scope["path"])
    if match is None:
        return scope
    authority = match.group(1).rsplit("@", 1)[-1]  # without a user:password@
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"]
    normal = {
        **scope,
        "path": match.group(2) or "/",
        "headers": [*headers, (b"host", authority.encode("latin-1"))],
    }
    raw = _ABSOLUTE_RAW.match(scope.get("raw_path") or b"")
    if raw is not None:
        normal["raw_path"] = raw.group(1) or b"/"
    return normal


class OriginGuard:
    """ASGI middleware applying :func:`check` to every HTTP request (the module docstring),
    after reading an absolute-form request line as origin form (:func:`origin_form`)."""

    def __init__(
        self,
        app: Any,
        *,
        hosts: frozenset[str],
        origins: re.Pattern[str],
        refuse: Callable[[ApiError], Any],
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins
        self.refuse = refuse  # the gateway's error response (and its error count)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = origin_form(scope)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            method = scope["method"]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                method = "PREFLIGHT"  # answered by CORSMiddleware: only Host and Origin apply
            error = check(
                method=method, host=headers.get("host"), origin=headers.get("origin"),
                content_type=headers.get("content-type"), hosts=self.hosts, origins=self.origins,
            )  # fmt: skip
            if error is not None:
                error.shape = shape_for(scope["path"])  # answered before the route's own shape
                response = self.refuse(error)
                if error.code == UNSUPPORTED_MEDIA_TYPE:  # Host and Origin passed: the page may read it
                    _allow_origin(response, headers.get("origin"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _allow_origin(response: Any, origin: str | None) -> None:
    """The CORS headers CORSMiddleware gives an allowed origin's answers, on a refusal made
    before it (``origin`` has passed :func:`check`; no Origin, no headers)."""
    if origin is not None:
        response.headers["access-control-allow-origin"] = origin
        response.headers.add_vary_header("Origin")
