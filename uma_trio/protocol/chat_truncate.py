"""Fitting a chat into its context by dropping its oldest messages, as Ollama's ``truncate``
(server/prompt.go ``chatPrompt``): the system messages and the last message always stay,
and a tool's result never stays without the assistant turn that made the call.  Pure: the
caller says whether a candidate fits (it renders and tokenizes it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from .messages import ChatMessage

SYSTEM_ROLES = frozenset({"system", "developer"})
R = TypeVar("R")


def _block_start(messages: Sequence[ChatMessage], i: int) -> int:
    """Where the message at ``i`` may be cut from: a tool result's assistant call (the run of
    results before it included), else ``i`` itself."""
    if messages[i].role != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1].role == "tool":
        start -= 1
    call = start - 1
    return call if call >= 0 and messages[call].role == "assistant" and messages[call].tool_calls else i


def cut_points(messages: Sequence[ChatMessage]) -> list[int]:
    """The places a chat may be cut at, in order, each dropping more: the first keeps every
    message, the last keeps only the system messages and the last message (with its call)."""
    last = len(messages) - 1
    cuts: list[int] = []
    for i, message in enumerate(messages):
        if message.role in SYSTEM_ROLES and i != last:
            continue  # a cut there keeps what the cut at the next message keeps
        start = _block_start(messages, i)
        if not cuts or start > cuts[-1]:
            cuts.append(start)
    return cuts


def kept(messages: Sequence[ChatMessage], cut: int) -> list[ChatMessage]:
    """What a cut at ``cut`` keeps: the system messages before it, and every message from it."""
    return [m for j, m in enumerate(messages) if j >= cut or m.role in SYSTEM_ROLES]


def fewest_dropped(
    messages: Sequence[ChatMessage],
    measure: Callable[[list[ChatMessage]], R | None],
    fits: Callable[[R], bool],
    *,
    first: int = 0,
) -> tuple[list[ChatMessage], R] | None:
    """The kept messages of the earliest cut from ``cut_points(messages)[first:]`` that fits,
    with its measure; None if even the last does not.  A binary search (log2 of the cuts'
    number of measures, not one per dropped message), as fewer messages never take more
    tokens; a cut ``measure`` cannot render (None: a template that wants its roles to
    alternate) counts as not fitting."""
    cuts = cut_points(messages)[first:]
    found: dict[int, tuple[list[ChatMessage], R]] = {}

    def fits_at(k: int) -> bool:
        candidate = kept(messages, cuts[k])
        value = measure(candidate)
        if value is None or not fits(value):
            return False
        found[k] = (candidate, value)
        return True

    lo, hi = 0, len(cuts)  # the answer is in [lo, hi]; hi == len(cuts): none fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits_at(mid):
            hi = mid
        else:
            lo = mid + 1
    return found.get(lo)
