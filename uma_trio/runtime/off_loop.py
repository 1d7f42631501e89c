"""Running an engine's blocking helper (tokenizing, hashing the model file) off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

from ..engine.base import Engine

R = TypeVar("R")


async def off_loop(engine: Engine, fn: Callable[[], R]) -> R:
    """``fn()`` in a worker thread, or inline for an engine whose helpers never block: a
    simulated engine must stay on the loop, where under MockClock a thread wait would let
    virtual time jump."""
    if not engine.tokenizer_blocks:
        return fn()
    return await trio.to_thread.run_sync(fn)
