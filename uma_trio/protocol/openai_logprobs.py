"""OpenAI's two shapes of log-probabilities: chat's ``{"content": [...]}`` (the daemon's own
entries as they are) and the legacy completions' parallel lists.  Pure."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from msgspec import Struct

from .messages import TokenLogprob


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token's text starts in the completion


def chat_logprobs(entries: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
    return None if entries is None else ChatLogprobs(list(entries))


def completion_logprobs(entries: Sequence[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """``offset``: the length of the completion text before these tokens (a stream's chunk)."""
    if entries is None:
        return None
    # From the bytes: a character split across tokens reads as U+FFFD in each token's text
    # (3 characters for one emoji), and counting those shifted every offset after it.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts, at = [], offset
    for entry in entries:
        starts.append(at)
        at += len(decoder.decode(bytes(entry.bytes)))
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        text_offset=starts,
    )
