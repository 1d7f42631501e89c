"""CPU time the hypervisor took from this VM (``steal`` in /proc/stat) while a benchmark ran.

On a shared VM one engine step sometimes takes 4x its usual time with nothing else in it
(BENCHMARKS.md, runs AS, AT and AX); whether the host took the cores then is what this
records.  A thread samples the machine's cumulative steal time every ``interval_s``
(psutil, all CPUs together) against ``time.perf_counter``; :meth:`StealSampler.during`
gives the steal between two such times.  Where the kernel does not report steal (no
hypervisor, or one that hides it) every figure is 0.
"""

from __future__ import annotations

import bisect
import threading
import time
from types import TracebackType

import psutil


def cumulative_steal_s() -> float:
    """Seconds of steal since boot, summed over the CPUs (0 where the kernel has none)."""
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


class StealSampler:
    """Samples :func:`cumulative_steal_s` in a thread while the ``with`` block runs."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self._interval_s = interval_s
        self._times: list[float] = []
        self._steal: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-steal", daemon=True)

    def __enter__(self) -> StealSampler:
        self._record()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._record()

    def _record(self) -> None:
        self._times.append(time.perf_counter())
        self._steal.append(cumulative_steal_s())

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._record()

    def during(self, start: float, end: float) -> float:
        """Steal seconds between two ``time.perf_counter`` times, from the samples around them."""
        return _steal_between(self._times, self._steal, start, end)


def _steal_between(times: list[float], steal: list[float], start: float, end: float) -> float:
    """The cumulative series' rise from the last sample at or before ``start`` to the first
    at or after ``end`` (so a window is never under-counted)."""
    if not times or end <= start:
        return 0.0
    first = max(bisect.bisect_right(times, start) - 1, 0)
    last = min(bisect.bisect_left(times, end), len(times) - 1)
    return max(steal[last] - steal[first], 0.0)
