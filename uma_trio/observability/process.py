"""The daemon process's own resources (psutil): memory, file descriptors, CPU, threads, and
the cyclic garbage collector's pauses."""

from __future__ import annotations

import gc
import time
from typing import Any

import msgspec
import psutil


class GcPauses:
    """How long the cyclic garbage collector held the GIL: every stream's delivery and the
    compute thread's sampling wait for it, so a long collection is a gap all chats see at
    once.  Fed by ``gc.callbacks`` (start/stop of each collection, in whichever thread ran
    it); process-wide, like the collector itself (:data:`GC_PAUSES`)."""

    def __init__(self) -> None:
        self.collections = 0
        self.full = 0  # of the oldest generation: these scan every tracked object
        self.total_s = 0.0
        self.max_s = 0.0
        self._started: float | None = None

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-collection
            return
        paused, self._started = time.perf_counter() - self._started, None
        self.collections += 1
        self.full += info.get("generation") == 2
        self.total_s += paused
        self.max_s = max(self.max_s, paused)


GC_PAUSES = GcPauses()


class ProcessFigures(msgspec.Struct, frozen=True):
    rss_bytes: int
    open_fds: int | None  # None where the platform cannot count them
    threads: int
    cpu_s: float  # user + system CPU time since start
    gc_collections: int  # cyclic collections since the first sampler (the daemon's start)
    gc_full: int  # of them, full ones (the oldest generation)
    gc_pause_s: float  # the GIL held by them, in all
    gc_pause_max_ms: float  # the longest


class ProcessSampler:
    def __init__(self) -> None:
        self._process = psutil.Process()
        GC_PAUSES.install()

    def sample(self) -> ProcessFigures:
        with self._process.oneshot():
            cpu = self._process.cpu_times()
            try:
                fds: int | None = self._process.num_fds()
            except (AttributeError, psutil.Error):  # num_fds is POSIX-only
                fds = None
            return ProcessFigures(
                rss_bytes=self._process.memory_info().rss,
                open_fds=fds,
                threads=self._process.num_threads(),
                cpu_s=round(cpu.user + cpu.system, 3),
                gc_collections=GC_PAUSES.collections,
                gc_full=GC_PAUSES.full,
                gc_pause_s=round(GC_PAUSES.total_s, 6),
                gc_pause_max_ms=round(GC_PAUSES.max_s * 1000.0, 3),
            )
