from __future__ import annotations

import json

import pytest

from uma_trio.protocol.codec import decode_client_message, decode_server_event, encode_event
from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.protocol.messages import (
    CancelRequest,
    EosEvent,
    GenerateRequest,
    MetricsRequest,
    Timings,
    TokenEvent,
    Usage,
)  # fmt: skip


def decode(obj: object) -> object:
    return decode_client_message(json.dumps(obj).encode())


def test_seeds_request_exactly_as_written() -> None:
    msg = decode({"id": "uuid", "prompt": "string", "max_tokens": 20, "stream": True,
                  "temperature": 0.0, "top_p": 1.0})  # fmt: skip
    assert isinstance(msg, GenerateRequest)
    assert (msg.id, msg.prompt, msg.max_tokens, msg.temperature, msg.priority) == (
        "uuid",
        "string",
        20,
        0.0,
        "interactive",
    )


def test_control_messages() -> None:
    assert isinstance(decode({"type": "cancel", "id": "x"}), CancelRequest)
    assert isinstance(decode({"type": "metrics"}), MetricsRequest)


@pytest.mark.parametrize(
    ("payload", "code", "needle"),
    [
        (b"{not json", ErrorCode.INVALID_JSON, "invalid JSON"),
        (b"[1, 2]", ErrorCode.INVALID_JSON, "object"),
        (b'{"id": "a", "prompt": "\xff"}', ErrorCode.INVALID_UTF8, "UTF-8"),
        (b'{"id": "a", "prompt": 5}', ErrorCode.SCHEMA, "$.prompt"),
        (b'{"id": "a", "prompt": "p", "max_tokens": "9"}', ErrorCode.SCHEMA, "$.max_tokens"),
        (b'{"id": "a", "prompt": "p", "bogus": 1}', ErrorCode.SCHEMA, "unknown field `bogus` - at `$`"),
        (b'{"id": "a", "prompt": "p", "top_p": 0}', ErrorCode.SCHEMA, "$.top_p"),
        (b'{"id": "a", "prompt": "p", "priority": "urgent"}', ErrorCode.SCHEMA, "$.priority"),
        (b'{"id": "a"}', ErrorCode.SCHEMA, "exactly one"),
        (
            b'{"id": "a", "prompt": "p", "messages": [{"role": "user", "content": "c"}]}',
            ErrorCode.SCHEMA,
            "exactly one",
        ),
        (b'{"prompt": "p"}', ErrorCode.SCHEMA, "id"),
        (b'{"type": "launch", "id": "a"}', ErrorCode.UNKNOWN_TYPE, "launch"),
    ],
)
def test_bad_input_gets_its_code(payload: bytes, code: ErrorCode, needle: str) -> None:
    with pytest.raises(UmaError) as info:
        decode_client_message(payload)
    assert info.value.code is code
    assert needle in info.value.message


def test_error_keeps_the_request_id_when_usable() -> None:
    with pytest.raises(UmaError) as info:
        decode({"id": "keep-me", "prompt": 1})
    assert info.value.request_id == "keep-me"


def test_events_round_trip() -> None:
    token = TokenEvent(id="a", text="hi", token_id=7)
    eos = EosEvent(id="a", reason="stop", usage=Usage(3, 1, 4), timings=Timings(queue_ms=0.1, total_ms=5.0))
    for event in (token, eos):
        framed = encode_event(event)
        assert decode_server_event(framed[4:]) == event
    wire = json.loads(encode_event(eos)[4:])
    assert wire["event"] == "eos" and "text" not in wire and "cancel_reason" not in wire


@pytest.mark.parametrize("bad_id", ["日本-1", "a b", "line\r\nX-Injected: 1", "tab\t", "", "x" * 129])
def test_request_ids_outside_printable_ascii_are_refused(bad_id: str) -> None:
    """Issue 17: an id reaches HTTP headers (latin-1) and log lines; refused at decoding, and
    not echoed on the error event either."""
    with pytest.raises(UmaError) as info:
        decode({"id": bad_id, "prompt": "hi"})
    assert info.value.code is ErrorCode.SCHEMA and info.value.request_id is None
    good = decode({"id": "chatcmpl-9f8e:x/1", "prompt": "hi"})
    assert isinstance(good, GenerateRequest) and good.id == "chatcmpl-9f8e:x/1"


def test_snapshot_names_refuse_a_trailing_newline() -> None:
    """Issue 17: ``$`` matched before a final newline, and a file ``trail\\n.umakv`` was made."""
    for bad in ("trail\n", "../x", ".hidden", "a/b"):
        with pytest.raises(UmaError) as info:
            decode({"type": "snapshot", "op": "restore", "name": bad})
        # Said in words: msgspec's regex, repr'd, came with its backslashes doubled.
        assert "letters, digits, '.', '_' and '-'" in info.value.message and "regex" not in info.value.message


def test_tool_call_arguments_nested_past_the_stack_are_kept_as_text() -> None:
    """Arguments nested 1,000 deep raised RecursionError while the turn was rendered, which
    ended the connection with no answer, and its other requests with it."""
    from uma_trio.protocol.messages import ChatMessage, ToolCall, ToolCallFunction

    deep = '{"a":' * 1000 + "1" + "}" * 1000
    call = ToolCall(id="c1", function=ToolCallFunction(name="f", arguments=deep))
    turn = ChatMessage(role="assistant", tool_calls=[call]).template_fields()
    assert turn["tool_calls"][0]["function"]["arguments"] == deep
