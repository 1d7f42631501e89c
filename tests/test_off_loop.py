"""Where an engine's blocking helper runs: a worker thread, except for small inputs."""

from __future__ import annotations

import threading
from typing import cast

import pytest

from uma_trio.engine.base import Engine
from uma_trio.runtime.off_loop import off_loop

pytestmark = pytest.mark.trio


class BlockingTokenizer:
    tokenizer_blocks = True


async def test_large_work_goes_to_a_worker_thread_and_small_work_stays_on_the_loop() -> None:
    engine = cast(Engine, BlockingTokenizer())
    loop_thread = threading.get_ident()
    assert await off_loop(engine, threading.get_ident) != loop_thread
    assert await off_loop(engine, threading.get_ident, small=True) == loop_thread
