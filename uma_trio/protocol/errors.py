"""Error codes and the one exception type the protocol layer raises.

Every failure a client can see is an ``error`` event carrying one of these codes
and a human-readable message.  Code raises :class:`UmaError` anywhere; the
connection handler converts it to a wire event in exactly one place.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Wire error codes, in the seeds' ``E_<AREA>_<NNN>`` style (docs/PROTOCOL.md)."""

    # Framing and schema: the client sent something we cannot understand.
    INVALID_JSON = "E_PROTO_001"
    SCHEMA = "E_PROTO_002"
    INVALID_UTF8 = "E_PROTO_003"
    FRAME_TOO_LARGE = "E_PROTO_004"
    UNKNOWN_TYPE = "E_PROTO_005"
    DUPLICATE_ID = "E_PROTO_006"
    UNKNOWN_ID = "E_PROTO_007"
    FRAME_TIMEOUT = "E_PROTO_008"  # a frame begun did not arrive whole in time
    # Limits: the request is well formed but exceeds what the daemon allows.
    PROMPT_TOO_LARGE = "E_LIMIT_001"
    CONTEXT_OVERFLOW = "E_LIMIT_002"
    MAX_TOKENS = "E_LIMIT_003"
    SERVER_BUSY = "E_LIMIT_004"
    TOO_MANY_IN_FLIGHT = "E_LIMIT_005"
    TOO_MANY_CONNECTIONS = "E_LIMIT_006"
    IDLE_TIMEOUT = "E_LIMIT_007"
    SHUTTING_DOWN = "E_LIMIT_008"
    # Model: the loaded model cannot serve this request (no chat template, ...).
    MODEL = "E_MODEL_001"
    MODEL_NOT_FOUND = "E_MODEL_002"  # the request names a model the daemon does not have
    MODEL_LOAD = "E_MODEL_003"  # the model could not be loaded (a corrupt file, no memory)
    # Runtime: the engine failed while serving an accepted request.
    DECODE_FAILED = "E_RUNTIME_001"
    KV_FULL = "E_RUNTIME_002"
    SAMPLING_FAILED = "E_RUNTIME_003"  # choosing this request's next token raised
    CONTEXT_LOST = "E_RUNTIME_004"  # the context failed beyond repair and was rebuilt
    INTERNAL = "E_RUNTIME_005"  # a bug or a figure that could not be read; the log has the detail
    # Structured output: the request's JSON schema or grammar cannot be compiled.
    GRAMMAR = "E_GRAMMAR_001"
    # Access control: the peer may not use this daemon.
    PEER_NOT_ALLOWED = "E_AUTH_001"
    # KV snapshots (the `snapshot` request).
    SNAPSHOT_NOT_FOUND = "E_SNAPSHOT_001"
    SNAPSHOT_MISMATCH = "E_SNAPSHOT_002"  # saved from another model file, KV type or context size
    SNAPSHOT_INVALID = "E_SNAPSHOT_003"  # unreadable, corrupt, or refused by llama.cpp


class UmaError(Exception):
    """A failure that becomes an ``error`` event with ``code`` and ``message``.

    ``fatal`` marks errors after which the byte stream can no longer be trusted
    (a bad length prefix): the connection sends the event and then closes.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: str | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.fatal = fatal


def too_long(detail: str) -> str:
    """The message of a prompt that does not fit.  Clients tell a context overflow by its
    words, not its code: Claude Code by Anthropic's "prompt is too long" (it then compacts the
    conversation), LiteLLM by llama-server's "exceeds the available context size" (its
    ``context_window_fallbacks`` then move to a model with more room).  Both, then ``detail``."""
    return f"prompt is too long: {detail} (the request exceeds the available context size)"


def too_many_tokens_asked(detail: str) -> str:
    """The message of a prompt that fits but leaves less room than ``max_tokens`` asks for: it
    names what to lower (the prompt is not what is too long), and keeps the words LiteLLM
    reads as a context overflow (:func:`too_long`)."""
    return f"max_tokens is too large: {detail} (the request exceeds the available context size)"


def shown(value: str, limit: int = 64) -> str:
    """Client-supplied text as it may appear in a message or a log line: control characters
    escaped (a newline cannot forge a log line) and at most ``limit`` characters, marked
    when cut."""
    cut = len(value) > limit
    text = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value[:limit]
    )
    return f"{text}... ({len(value)} characters)" if cut else text
