"""One long-lived thread for every ``llama_decode`` of a context.

llama.cpp's CPU backend runs each graph on an OpenMP team that belongs to the
*calling* thread, and an idle team lingers for as long as that thread lives.
``trio.to_thread`` hands calls to whichever cached worker is free, so a daemon
could end up with several teams; on a 2-core machine the stale ones cost a
third of the decode speed (docs/BENCHMARKS.md).  Pinning every call to one
thread keeps exactly one team, and closing the thread frees it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")
_STARTED_WAIT_S = 0.05  # a bound, not a wait: a queued call (a snapshot job first) just proceeds
# The longest a thread holding the GIL keeps a waiting one out (Python's default is 5 ms): the
# compute thread needs the GIL again the moment llama_decode returns, to sample and hand the
# results back, while the event loop may be busy writing tokens to clients.  0.1 ms against
# 0.5 ms on the H100 (one run, same machine): steps 2-7 % shorter at 4-16 streams, tok/s
# +1 to +8 % (docs/BENCHMARKS.md "GPU").  UMA_GIL_SWITCH_INTERVAL_MS overrides it.
GIL_SWITCH_INTERVAL_S = float(os.environ.get("UMA_GIL_SWITCH_INTERVAL_MS", "0.1")) / 1000.0


class ComputeThread:
    """Runs blocking calls, one at a time and in order, on a single thread."""

    def __init__(self, name: str) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the compute thread and block until it returns."""
        return self._executor.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object, started: threading.Event | None = None) -> T:
        """Run ``fn(*args)`` on the compute thread without blocking trio.

        Not cancellable once submitted: the call always runs to its end and its
        result is returned; a cancellation waits for the caller's next checkpoint
        (like ``to_thread.run_sync`` without ``abandon_on_cancel``).  So sampled
        tokens are never lost and the caller never races its own next call.

        With ``started``, trio's thread blocks (briefly: the thread's wake-up and the Python
        before the blocking call) until ``fn`` sets it.  Otherwise the event loop would go on
        running other tasks' Python while the compute thread waits for the GIL to reach
        ``llama_decode``, and the device would sit idle meanwhile.
        """
        return await self.wait_started(self._executor.submit(fn, *args), started)

    async def wait_started(self, future: Future[T], started: threading.Event | None) -> T:
        """:meth:`wait` for ``future``, whose call sets ``started`` (see :meth:`run`)."""
        if started is not None:
            started.wait(_STARTED_WAIT_S)
        return await self.wait(future)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Queue ``fn(*args)`` behind whatever the thread has queued; may be called from the
        compute thread itself (a step queueing the next one: it starts the moment the current
        call returns, with no round trip through the event loop)."""
        return self._executor.submit(fn, *args)

    @staticmethod
    async def wait(future: Future[T]) -> T:
        """Wait for a submitted call without blocking trio; not cancellable (see :meth:`run`).
        A call already done (results handed back together, engine/held_results.py) is
        returned at once, without a round trip through trio's wake-up."""
        if future.done():
            return future.result()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def wake(done: Future[T]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.capture(done.result))

        future.add_done_callback(wake)
        # Returns the captured outcome unwrapped: the value, or the call's exception raised here.
        result: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return result

    def close(self) -> None:
        """Finish queued calls and end the thread (and with it its OpenMP team)."""
        self._executor.shutdown(wait=True)
