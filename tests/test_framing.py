from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.protocol.framing import FrameDecoder, encode_frame

PAYLOADS = [b'{"id":"a"}', b"", b"x" * 1000, "héllo 🌍".encode()]


def test_one_byte_at_a_time() -> None:
    stream = b"".join(encode_frame(p) for p in PAYLOADS)
    decoder = FrameDecoder(4096)
    out = []
    for i in range(len(stream)):
        out += decoder.feed(stream[i : i + 1])
    assert out == PAYLOADS and decoder.buffered == 0


@given(st.lists(st.binary(max_size=300), max_size=8), st.lists(st.integers(1, 50), min_size=1))
def test_arbitrary_splits(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    decoder = FrameDecoder(4096)
    out, pos, i = [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        out += decoder.feed(stream[pos : pos + step])
        pos, i = pos + step, i + 1
    assert out == payloads


def test_length_over_limit_is_fatal_as_soon_as_the_header_arrives() -> None:
    decoder = FrameDecoder(100)
    with pytest.raises(UmaError) as info:
        decoder.feed((101).to_bytes(4, "little"))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE and info.value.fatal


def test_limit_itself_is_accepted() -> None:
    assert FrameDecoder(5).feed(encode_frame(b"12345")) == [b"12345"]
