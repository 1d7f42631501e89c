"""Running an engine's blocking helper (tokenizing, hashing the model file) off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

from ..engine.base import Engine

R = TypeVar("R")


# Tokenizing this much text takes well under a millisecond: less than the hop to a worker
# thread, which on a machine whose cores run a step waits for that step to end (on 2 cores
# a 30-token chat turn then missed the next tick: TTFT +13 ms, BENCHMARKS.md "Issue 19").
INLINE_TEXT_CHARS = 4096
INLINE_TURNS = 64  # a chat of more turns is rendered off the loop, however short their text


# Grammar compiles at once, daemon-wide (one per core here).  An abandoned compile runs on
# to its end and holds its thread until then: in trio's default pool, shared with every
# prompt's tokenizing, a client sending big grammars and hanging up could fill it and stall
# everyone's long prompts.  Its own limiter keeps that to the compiles.
COMPILES_AT_ONCE = 2
_compiles: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("compiles")


def run_limiter(var: trio.lowlevel.RunVar[trio.CapacityLimiter], tokens: int) -> trio.CapacityLimiter:
    """The limiter ``var`` holds in this trio run (one per run, as trio's own default
    thread limiter), made with ``tokens`` on first use."""
    try:
        return var.get()
    except LookupError:
        limiter = trio.CapacityLimiter(tokens)
        var.set(limiter)
        return limiter


def compile_limiter() -> trio.CapacityLimiter:
    """This run's limiter of grammar compiles (:data:`COMPILES_AT_ONCE`)."""
    return run_limiter(_compiles, COMPILES_AT_ONCE)


async def off_loop(
    engine: Engine, fn: Callable[[], R], *, small: bool = False, abandon: bool = False,
    limiter: trio.CapacityLimiter | None = None,
) -> R:  # fmt: skip
    """``fn()`` in a worker thread, or inline when it is ``small`` or for an engine whose
    helpers never block: a simulated engine must stay on the loop, where under MockClock a
    thread wait would let virtual time jump.  ``abandon``: a cancelled caller stops waiting
    and the thread's result is thrown away; only for work that touches nothing the daemon
    frees (a grammar's compile, not llama.cpp's tokenizer), so a shutdown need not wait.
    ``limiter``: the threads it may take (default: trio's pool)."""
    if small or not engine.tokenizer_blocks:
        return fn()
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=abandon, limiter=limiter)
