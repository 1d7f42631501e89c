"""OpenAI's error object: :class:`ApiError`, and how the daemon's own errors and a body's
validation failures become one.  Pure, like the rest of :mod:`.openai`."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from .errors import ErrorCode, UmaError
from .schema_words import json_fault, readable


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        uma_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.uma_code = uma_code  # the daemon's E_ code, for its error counts (HTTP.md)
        self.counted = False  # already in the daemon's error counts (the decode loop's own errors)
        self.close_connection = False  # answer with `Connection: close` (a body left unread)
        self.shape = "openai"  # "ollama": Ollama's API answers {"error": "message"}

    def __str__(self) -> str:
        return self.message  # as renamed since (client_param): the answer's, not the first one

    @property
    def answer_status(self) -> int:
        """The status answered: Anthropic's API says a server too busy to take a request with
        529 ``overloaded_error`` (its 429 is an account's rate limit, which Claude Code reports
        as such); every 429 of the daemon is its own capacity (queue, requests in flight)."""
        return 529 if self.shape == "anthropic" and self.status == 429 else self.status

    def body(self) -> dict[str, Any]:
        if self.shape == "ollama":
            return {"error": self.message}
        if self.shape == "anthropic":
            status = self.answer_status
            kind = _ANTHROPIC_TYPE.get(status, "api_error" if status >= 500 else self.type)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Anthropic's error type of each HTTP status (its "Errors" page); other 5xx: api_error.
_ANTHROPIC_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 529: "overloaded_error", 503: "overloaded_error",
}  # fmt: skip
ANTHROPIC_PREFIX = "/v1/messages"  # the paths whose errors come in Anthropic's shape


OLLAMA_PREFIX = "/api/"  # Ollama's paths: their errors are {"error": "message"}


def shape_for(path: str) -> str:
    """The error shape of a path answered before (or outside) its route: auth, Host, Origin,
    media type, 404, 405, 500 (the official ollama client showed an OpenAI error object's repr)."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    return "ollama" if path.startswith(OLLAMA_PREFIX) else "openai"


# HTTP status and OpenAI error type of each daemon error code.  `code` in the error object
# is the daemon's E_ code, except where OpenAI defines one that clients act on.
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_JSON: (400, "invalid_request_error"),
    ErrorCode.SCHEMA: (400, "invalid_request_error"),
    ErrorCode.INVALID_UTF8: (400, "invalid_request_error"),
    ErrorCode.FRAME_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.UNKNOWN_TYPE: (400, "invalid_request_error"),
    ErrorCode.DUPLICATE_ID: (409, "invalid_request_error"),
    ErrorCode.UNKNOWN_ID: (404, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LARGE: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    ErrorCode.MAX_TOKENS: (400, "invalid_request_error"),
    ErrorCode.SERVER_BUSY: (429, "rate_limit_error"),
    ErrorCode.TOO_MANY_IN_FLIGHT: (429, "rate_limit_error"),
    ErrorCode.TOO_MANY_CONNECTIONS: (429, "rate_limit_error"),
    ErrorCode.IDLE_TIMEOUT: (408, "invalid_request_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.MODEL: (400, "invalid_request_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    # A model refused by the settings (--memory-budget, --max-loaded) or its file: a 500 had
    # the SDKs retry, each try loading it again.
    ErrorCode.MODEL_LOAD: (422, "invalid_request_error"),
    ErrorCode.GRAMMAR: (400, "invalid_request_error"),
    ErrorCode.DECODE_FAILED: (500, "server_error"),
    ErrorCode.KV_FULL: (503, "server_error"),
    ErrorCode.SAMPLING_FAILED: (500, "server_error"),
    ErrorCode.CONTEXT_LOST: (503, "server_error"),  # a retry runs on the rebuilt context
    ErrorCode.INTERNAL: (500, "server_error"),
    # Socket-only (framing, peer credentials); mapped so every code has an answer.
    ErrorCode.FRAME_TIMEOUT: (408, "invalid_request_error"),
    ErrorCode.PEER_NOT_ALLOWED: (403, "permission_error"),
    # Snapshots are socket-only today; mapped so every code has an answer.
    ErrorCode.SNAPSHOT_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.SNAPSHOT_MISMATCH: (409, "invalid_request_error"),
    ErrorCode.SNAPSHOT_INVALID: (422, "invalid_request_error"),
}
_OPENAI_CODE = {
    ErrorCode.PROMPT_TOO_LARGE: "context_length_exceeded",
    ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded",
    ErrorCode.MODEL_NOT_FOUND: "model_not_found",
}
_PARAM = {ErrorCode.MAX_TOKENS: "max_tokens", ErrorCode.MODEL_NOT_FOUND: "model"}


def api_error(code: ErrorCode, message: str) -> ApiError:
    """The HTTP answer to a daemon error."""
    status, kind = _STATUS[code]
    return ApiError(
        status, message, type=kind, param=_PARAM.get(code), code=_OPENAI_CODE.get(code, code), uma_code=code
    )


def from_uma_error(error: UmaError) -> ApiError:
    return api_error(error.code, error.message)


_PATH = re.compile(r"(?:at|in) `\$\.?([^`]*)`")  # "at `key` in `$.logit_bias`": the field


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the field the body got wrong (the translated APIs' refusals)."""
    return ApiError(400, message, param=param)


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError | ValueError) -> ApiError:
    """A bad body, naming the offending field as ``param`` where msgspec says which."""
    message = readable(str(exc))
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"the body is not valid JSON: {message}", code=ErrorCode.INVALID_JSON)
    found = _PATH.search(message)
    if found is None and not message.startswith("Expected"):  # msgspec's own name types
        found = _FIRST_FIELD.search(message)
    param = found.group(1) if found and found.group(1) else None
    return ApiError(400, message, param=param, code=ErrorCode.SCHEMA)


# A check across fields (a struct's __post_init__) has no path: its message names the field
# it refuses first ("`tool_choice` `required` needs `tools`"); param was null.
_FIRST_FIELD = re.compile(r"`([a-z_]+)`")


BodyT = TypeVar("BodyT")


def decode_json(data: bytes, kind: type[BodyT]) -> BodyT:
    """An HTTP body as ``kind``, or a 400: not UTF-8 (msgspec raises UnicodeDecodeError, no
    DecodeError), not JSON, nested too deeply (msgspec recurses per level), or not ``kind``."""
    try:
        return msgspec.json.decode(data, type=kind)
    except UnicodeDecodeError as exc:
        raise api_error(ErrorCode.INVALID_UTF8, f"the body is not valid UTF-8 (byte {exc.start})") from None
    except RecursionError:
        message = "the body is not valid JSON: nested too deeply"
        raise ApiError(400, message, code=ErrorCode.INVALID_JSON) from None
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        message = f"the body is not valid JSON: {json_fault(exc, data)}"
        raise ApiError(400, message, code=ErrorCode.INVALID_JSON) from None


def client_param(error: ApiError, names: dict[str, str]) -> ApiError:
    """A translated request's field named as the client's (``names``: ours → theirs), so a
    refusal the socket protocol's checks make names what the client sent."""
    if error.param is not None:
        head, sep, rest = error.param.partition("[")
        error.param = names.get(head, head) + sep + rest
    # msgspec's message says where too: "... - at `$.stop[0]`" (a field the client never sent),
    # and a check across fields names it so: "`template_args` may not set ...".
    error.message = _MESSAGE_FIELD.sub(lambda m: m[1] + names.get(m[2], m[2]), error.message)
    return error


_MESSAGE_FIELD = re.compile(r"(`(?:\$\.)?)([A-Za-z_]+)(?=[`\[.])")


def stop_param(error: ApiError, stop: str | list[str] | None) -> ApiError:
    """A single stop string is checked as a one-item list: name it as the client sent it."""
    if isinstance(stop, str) and error.param == "stop[0]":
        error.param = "stop"
    return error
