"""OpenAI's two shapes of log-probabilities: chat's ``{"content": [...]}`` (the daemon's own
entries as they are) and the legacy completions' parallel lists.  Pure."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import msgspec
from msgspec import Struct

from .messages import TokenLogprob, TopLogprob


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token's text starts in the completion


def legacy_token(entry: TokenLogprob | TopLogprob) -> str:
    """A token as the legacy completions' lists name it: its text, or where its bytes are part
    of a character split across tokens, ``bytes:\\xe5\\x9b`` as OpenAI writes them (the text
    read U+FFFD, the same for every such token, so the tokens no longer joined to the text
    and two of them collided as one key of ``top_logprobs``)."""
    try:
        return bytes(entry.bytes).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)


def openai_named(entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
    """The daemon's entries with every token named as OpenAI names it (:func:`legacy_token`):
    a token holding part of a character by its bytes, not U+FFFD, so the alternatives of one
    position stay apart.  Chat's and the Responses API's ``bytes`` stay as they are."""
    return [e if _whole(e) else _renamed(e) for e in entries]


def _whole(entry: TokenLogprob) -> bool:
    return "\ufffd" not in entry.token and all("\ufffd" not in t.token for t in entry.top_logprobs)


def _renamed(entry: TokenLogprob) -> TokenLogprob:
    tops = [msgspec.structs.replace(t, token=legacy_token(t)) for t in entry.top_logprobs]
    return msgspec.structs.replace(entry, token=legacy_token(entry), top_logprobs=tops)


def chat_logprobs(entries: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
    return None if entries is None else ChatLogprobs(openai_named(entries))


class TextOffsets:
    """Where each token's text starts in a completion, counted from the tokens' bytes: a
    character split across tokens reads as U+FFFD in each token's text (3 characters for one
    emoji), and counting those shifted every offset after it.  One per completion, so a
    stream's chunks count on from where the last one stopped, whatever text was held back
    (a pending stop string) or a character was cut between chunks."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def starts(self, entries: Sequence[TokenLogprob]) -> list[int]:
        starts = []
        for entry in entries:
            starts.append(self.at)
            self.at += len(self._decoder.decode(bytes(entry.bytes)))
        return starts


def completion_logprobs(
    entries: Sequence[TokenLogprob] | None, offsets: TextOffsets | None = None
) -> CompletionLogprobs | None:
    """``offsets``: the completion's (a stream's, across its chunks); by default a fresh one."""
    if entries is None:
        return None
    return CompletionLogprobs(
        tokens=[legacy_token(e) for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{legacy_token(t): t.logprob for t in e.top_logprobs} for e in entries],
        text_offset=(offsets or TextOffsets()).starts(entries),
    )
