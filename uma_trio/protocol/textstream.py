"""Token bytes → client text: UTF-8 safe and stop-string aware.  Pure.

Two hazards sit between a token's bytes and what may be sent:

* a character can be split across tokens (emoji, CJK): the incremental UTF-8
  decoder holds the partial bytes until the character completes;
* a stop string can span tokens: text that might be the start of a stop string
  is held back until it either completes the stop (generation ends, the stop
  string is never sent) or diverges from it (the held text is released).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # safe to send now (may be empty)
    stopped: bool  # a stop string matched; ``text`` ends right before it
    stop: str | None = None  # the stop string that matched (Anthropic's answers name it)


class TextStream:
    """Feed token pieces in order; get back what may be sent to the client."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stop if s)
        self._held = ""

    def push(self, piece: bytes) -> TextDelta:
        self._held += self._decoder.decode(piece)
        if not self._stops:
            text, self._held = self._held, ""
            return TextDelta(text, False)
        found = _earliest_stop(self._held, self._stops)
        if found is not None:
            cut, stop = found
            text, self._held = self._held[:cut], ""
            # Bytes of a character begun after the stop string are never sent: without the
            # reset, flush() would turn them into a stray U+FFFD after the stop.
            self._decoder.reset()
            return TextDelta(text, True, stop)
        keep = _longest_stop_prefix_suffix(self._held, self._stops)
        split = len(self._held) - keep
        text, self._held = self._held[:split], self._held[split:]
        return TextDelta(text, False)

    def flush(self) -> str:
        """At the end of generation: everything still held.  A character cut off (max_tokens,
        the context's end) is dropped: it ended the answer as U+FFFD on every route."""
        text, self._held = self._held, ""
        self._decoder.reset()
        return text


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` starts, and which (the first listed, of two
    starting there)."""
    found = [(i, n, s) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    if not found:
        return None
    i, _, stop = min(found)
    return i, stop


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
