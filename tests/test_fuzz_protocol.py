"""Property-based fuzzing of the framing and message decoding: any input is a message or an
error with a code, never another exception (a crash would end the connection unanswered)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from uma_trio.protocol.codec import decode_client_message
from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.protocol.framing import HEADER_SIZE, FrameDecoder, encode_frame
from uma_trio.protocol.messages import MESSAGE_TYPES, GenerateRequest, SnapshotRequest

EXAMPLES = 1500  # per property; the tests' docstrings in docs/RELIABILITY.md quote the totals

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "id", "type", "prompt", "messages", "max_tokens", "stream", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "priority", "op", "name",
]  # fmt: skip
message_like = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=6),
    st.sampled_from([*MESSAGE_TYPES, "generate", "x", "save", "list", "restore"]) | json_values,
    max_size=6,
)


def decodes_or_fails_cleanly(payload: bytes) -> Any:
    try:
        message = decode_client_message(payload)
    except UmaError as exc:
        assert exc.code in set(ErrorCode) and exc.message
        assert not exc.fatal  # only a bad length prefix ends a connection
        return None
    assert isinstance(message, tuple(MESSAGE_TYPES.values()))
    if isinstance(message, GenerateRequest):
        assert (message.prompt is None) != (message.messages is None)
    if isinstance(message, SnapshotRequest) and message.op == "save":
        assert message.name is not None
    return message


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes(payload: bytes) -> None:
    decodes_or_fails_cleanly(payload)


@settings(max_examples=EXAMPLES, deadline=None)
@given(json_values)
def test_any_json_value(value: Any) -> None:
    decodes_or_fails_cleanly(json.dumps(value).encode())


@settings(max_examples=EXAMPLES, deadline=None)
@given(message_like)
def test_message_shaped_objects(obj: dict[str, Any]) -> None:
    decodes_or_fails_cleanly(json.dumps(obj).encode())


@settings(max_examples=EXAMPLES, deadline=None)
@given(message_like, st.integers(0, 60))
def test_truncated_and_corrupted_json(obj: dict[str, Any], cut: int) -> None:
    text = json.dumps(obj).encode()
    decodes_or_fails_cleanly(text[: len(text) * cut // 60])
    decodes_or_fails_cleanly(text[:cut] + b"\xff\xfe" + text[cut:])  # invalid UTF-8


@given(st.integers(1, 200_000), st.sampled_from([b"[", b'{"a":', b'{"id":"x","prompt":']))
@settings(max_examples=50, deadline=None)
def test_deep_nesting_is_an_error_not_a_crash(depth: int, opener: bytes) -> None:
    assert decodes_or_fails_cleanly(opener * depth) is None


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(1, 97), min_size=1, max_size=40), st.integers(0, 300))
def test_frame_decoder_on_random_streams(stream: bytes, cuts: list[int], limit: int) -> None:
    """Frames or one fatal FRAME_TOO_LARGE; never more buffered than one frame's worth."""
    decoder = FrameDecoder(limit)
    pos, i = 0, 0
    try:
        while pos < len(stream):
            step = cuts[i % len(cuts)]
            for payload in decoder.feed(stream[pos : pos + step]):
                assert len(payload) <= limit
            assert decoder.buffered < HEADER_SIZE + limit
            pos, i = pos + step, i + 1
    except UmaError as exc:
        assert exc.code == ErrorCode.FRAME_TOO_LARGE and exc.fatal


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.binary(max_size=50), max_size=10), st.integers(1, 13))
def test_frames_survive_any_split(payloads: list[bytes], step: int) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    decoder, out = FrameDecoder(64), []
    for pos in range(0, len(stream), step):
        out += decoder.feed(stream[pos : pos + step])
    assert out == payloads and decoder.buffered == 0
