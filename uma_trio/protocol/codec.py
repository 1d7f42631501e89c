"""JSON payload ⇄ typed messages.  Pure functions, no I/O.

Errors come out as :class:`UmaError` with the code the protocol assigns and,
for schema problems, msgspec's own message with its ``$.path``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from .errors import ErrorCode, UmaError
from .framing import encode_frame
from .messages import MESSAGE_TYPES, REQUEST_ID_PATTERN, ClientMessage, ServerEvent
from .schema_words import json_fault, readable

_json_decoder = msgspec.json.Decoder()
_event_encoder = msgspec.json.Encoder()
_event_decoder: msgspec.json.Decoder[ServerEvent] = msgspec.json.Decoder(ServerEvent)


def decode_client_message(payload: bytes) -> ClientMessage:
    """Parse one frame's payload into a client message, or raise :class:`UmaError`."""
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UmaError(ErrorCode.INVALID_UTF8, f"payload is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = _json_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise UmaError(ErrorCode.INVALID_JSON, f"invalid JSON: {json_fault(exc, payload)}") from None
    except RecursionError:  # msgspec recurses per nesting level; found by the fuzz tests
        raise UmaError(ErrorCode.INVALID_JSON, "invalid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise UmaError(ErrorCode.INVALID_JSON, f"expected a JSON object, got {type(obj).__name__}")
    request_id = _request_id_of(obj)
    kind = obj.get("type", "generate")
    message_type = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if message_type is None:
        known = ", ".join(sorted(MESSAGE_TYPES))
        raise UmaError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {kind!r} (expected one of: {known})",
            request_id=request_id,
        )
    try:
        return msgspec.convert(obj, type=message_type)
    except msgspec.ValidationError as exc:
        message = readable(str(exc))
        if " - at `$" not in message:  # msgspec names no path for the top level's own faults
            message += " - at `$`"
        raise UmaError(ErrorCode.SCHEMA, message, request_id=request_id) from None


_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def is_request_id(value: str) -> bool:
    """Whether the daemon accepts ``value`` as a request id (PROTOCOL.md)."""
    return _REQUEST_ID.match(value) is not None


def _request_id_of(obj: dict[str, Any]) -> str | None:
    """The id to put on an error event, when the message carried a usable one (a valid id:
    anything else may be what broke the message)."""
    value = obj.get("id")
    return value if isinstance(value, str) and is_request_id(value) else None


def encode_event(event: ServerEvent) -> bytes:
    """One event, framed and ready for the socket."""
    return encode_frame(_event_encoder.encode(event))


def encode_message(message: ClientMessage | dict[str, Any]) -> bytes:
    """One client message (a Struct or a plain dict), framed."""
    return encode_frame(_event_encoder.encode(message))


def decode_server_event(payload: bytes) -> ServerEvent:
    """Parse one event from the daemon (used by the client)."""
    try:
        return _event_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise UmaError(ErrorCode.INVALID_JSON, f"bad event from daemon: {exc}") from None
