"""The daemon process's own resources (psutil): memory, file descriptors, CPU, threads."""

from __future__ import annotations

import msgspec
import psutil


class ProcessFigures(msgspec.Struct, frozen=True):
    rss_bytes: int
    open_fds: int | None  # None where the platform cannot count them
    threads: int
    cpu_s: float  # user + system CPU time since start


class ProcessSampler:
    def __init__(self) -> None:
        self._process = psutil.Process()

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
            )
