"""Requests on their way in: read, connecting or being tokenized, not yet queued.

An idle decode task woken by one request waits for these before it plans its first tick
(``DecodeLoop._gather_burst``), so a burst shares that tick.  Front ends mark a request
for as long as it is on its way (:meth:`Arrivals.mark`); marks nest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Arrivals:
    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def mark(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
