"""Batch shapes and llama.cpp's CUDA graphs: a prompt tick is never the one captured.  Pure.

llama.cpp's CUDA backend replays a step as a CUDA graph once the same graph shape has run
twice in a row: the first step of a new shape runs kernel by kernel, the second is
*captured* (recorded, then instantiated or updated: several ms for an 8B model), and later
ones replay the capture, ~4 ms faster than running kernel by kernel on the H100.  A steady
decode keeps its shape for hundreds of steps, so its capture pays.  A prompt arrives in
chunks, and two chunks of the same size in a row had the second captured for nothing: the
next chunk's shape differs again.  On the H100 those were the slowest ticks beside decoding
chats, 12.5-13.1 ms against 9.2 ms for the same chunk run kernel by kernel (BENCHMARKS.md
"GPU", run GB's trace), and the chats saw them as their longest gaps.

A shape here is what changes llama.cpp's graph from one step to the next: the batch's tokens
and how many of them return logits (one per decode token, one per prompt chunk that ends its
prompt).  :class:`ShapeStreak` follows the shapes the engine ran; :func:`steer_clear` moves
a tick that carries prompt tokens off the one shape whose next step would be captured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .state import SessionState

Shape = tuple[int, int]  # (tokens in the batch, of which return logits)


def shape_of(decoders: int, chunks: Iterable[tuple[int, int]]) -> Shape:
    """The shape of a batch of ``decoders`` decode tokens and prompt ``chunks``, each given
    as (tokens this tick, prompt tokens left before it): a chunk that ends its prompt
    returns logits for its last token."""
    tokens, outputs = decoders, decoders
    for n, remaining in chunks:
        tokens += n
        outputs += n > 0 and n == remaining
    return tokens, outputs


@dataclass
class ShapeStreak:
    """The last shape the engine ran and for how many steps in a row."""

    last: Shape | None = None
    run: int = 0

    def record(self, shape: Shape) -> None:
        if shape == self.last:
            self.run += 1
        else:
            self.last, self.run = shape, 1

    def capturing(self) -> Shape | None:
        """The shape a step now would be captured at: the last one, run once so far."""
        return self.last if self.run == 1 else None


def steer_clear(
    decoders: int, chunks: list[tuple[SessionState, int]], avoid: Shape | None, room: int = 1
) -> list[tuple[SessionState, int]]:
    """``chunks`` (prompt chunks beside ``decoders`` decode tokens) changed by one token where
    the batch would otherwise have the shape ``avoid``: the last chunk of two or more tokens
    one shorter, else, if the batch has ``room`` for a token, a chunk with prompt left one
    longer.  Unchanged where the batch has no prompt token, misses ``avoid`` already, or no
    chunk can move."""
    if avoid is None or not any(n for _, n in chunks):
        return chunks
    if shape_of(decoders, ((n, s.prompt_remaining) for s, n in chunks)) != avoid:
        return chunks
    for i in reversed(range(len(chunks))):
        session, n = chunks[i]
        if n >= 2:
            return [*chunks[:i], (session, n - 1), *chunks[i + 1 :]]
    for i, (session, n) in enumerate(chunks):
        if room > 0 and n < session.prompt_remaining:
            return [*chunks[:i], (session, n + 1), *chunks[i + 1 :]]
    return chunks


def plan_shape(
    decode: Sequence[int], prefill: Sequence[tuple[int, int]], sessions: Sequence[SessionState]
) -> Shape:
    """The shape of a plan's batch (``decode`` and ``prefill`` by session key), the prompts
    left read from ``sessions`` as they were when it was planned."""
    remaining = {s.key: s.prompt_remaining for s in sessions}
    return shape_of(len(decode), ((n, remaining.get(key, 0)) for key, n in prefill))
