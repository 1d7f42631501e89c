from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from uma_trio.protocol.textstream import TextStream


def run(pieces: list[bytes], stop: list[str]) -> tuple[str, bool]:
    stream, out = TextStream(stop), []
    for piece in pieces:
        delta = stream.push(piece)
        out.append(delta.text)
        if delta.stopped:
            return "".join(out), True
    return "".join(out) + stream.flush(), False


def test_character_split_across_tokens_is_held_until_complete() -> None:
    data = "🌍".encode()
    stream = TextStream()
    assert stream.push(data[:2]).text == ""
    assert stream.push(data[2:]).text == "🌍"


def test_stop_string_across_tokens_is_never_sent() -> None:
    text, stopped = run([b"Hello ", b"wor", b"ld! more"], ["world"])
    assert (text, stopped) == ("Hello ", True)


def test_held_prefix_is_released_when_it_diverges() -> None:
    stream = TextStream(["STOP"])
    assert stream.push(b"abc ST").text == "abc "
    assert stream.push(b"ART").text == "START"


def test_flush_returns_held_text_at_the_end() -> None:
    stream = TextStream(["</s>"])
    assert stream.push(b"end </").text == "end "
    assert stream.flush() == "</"


def test_a_character_cut_off_at_the_end_is_dropped_not_replaced() -> None:
    """Context review: an answer cut by max_tokens inside "＆" (ef bc 86) ended "＆＆\ufffd" on
    every route; bytes that are not UTF-8 in the middle still read U+FFFD."""
    stream = TextStream()
    assert stream.push("＆".encode() + b"\xef\xbc").text == "＆"
    assert stream.flush() == ""
    broken = TextStream()
    assert broken.push(b"a\xffb").text + broken.flush() == "a\ufffdb"


@given(st.text(max_size=60), st.lists(st.integers(1, 7), min_size=1), st.sampled_from(["##", "END", "é!"]))
def test_any_split_gives_text_before_the_first_stop(text: str, cuts: list[int], stop: str) -> None:
    data = text.encode()
    pieces, pos, i = [], 0, 0
    while pos < len(data):
        pieces.append(data[pos : pos + cuts[i % len(cuts)]])
        pos, i = pos + cuts[i % len(cuts)], i + 1
    out, stopped = run(pieces, [stop])
    if stop in text:
        assert stopped and out == text[: text.index(stop)]
    else:
        assert not stopped and out == text


def test_the_stop_string_that_matched_is_named() -> None:
    stream = TextStream(["end", "op", "stop"])
    first = stream.push(b"do not st")
    assert (first.text, first.stop) == ("do not ", None)
    delta = stream.push(b"op here")
    assert (delta.text, delta.stopped, delta.stop) == ("", True, "stop")  # "stop" starts before "op"


def test_a_character_begun_after_the_stop_string_is_not_flushed() -> None:
    # The token that completes the stop may go on into half a character (byte-level BPE):
    # the end of generation flushes nothing after the stop, not a U+FFFD.
    stream = TextStream(["END"])
    assert stream.push(b"hello ").text == "hello "
    delta = stream.push(b"END\xe2\x82")
    assert (delta.text, delta.stopped) == ("", True)
    assert stream.flush() == ""
