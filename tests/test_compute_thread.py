"""The compute thread: every call on one thread, results and errors handed back to trio."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import trio

from uma_trio.engine.compute_thread import ComputeThread


@pytest.fixture
def compute() -> Iterator[ComputeThread]:
    thread = ComputeThread("test-compute")
    yield thread
    thread.close()


async def test_every_call_runs_on_the_same_thread(compute: ComputeThread) -> None:
    seen = {await compute.run(threading.get_ident) for _ in range(5)}
    seen.add(compute.call(threading.get_ident))
    assert len(seen) == 1 and threading.get_ident() not in seen


async def test_exception_is_raised_in_the_awaiting_task(compute: ComputeThread) -> None:
    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await compute.run(fail)
    assert await compute.run(lambda: 42) == 42  # the thread survives


async def test_cancel_waits_for_the_call_and_keeps_its_result(compute: ComputeThread) -> None:
    finished = threading.Event()

    def slow() -> str:
        time.sleep(0.2)
        finished.set()
        return "done"

    results = []
    with trio.move_on_after(0.01) as scope:
        results.append(await compute.run(slow))
        assert finished.is_set()  # the call was over before anything else ran
        await trio.lowlevel.checkpoint()  # the cancellation lands here
        results.append("not reached")
    assert scope.cancelled_caught and results == ["done"]


async def test_trio_keeps_running_during_a_call(compute: ComputeThread) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await compute.run(time.sleep, 0.2)
        nursery.cancel_scope.cancel()
    assert ticks >= 5
