"""The client connections open on the socket and on the HTTP ports, and how many requests
each has sent.

An idle decode task woken by a request waits a moment before it plans
(``DecodeLoop._gather_burst``), so requests sent together share their first tick.  A lone
request pays that wait (2 ms) for nothing, and a client that sends one request after
another on the only connection open (an agent, a script, one editor) pays it on every
request: 9.2 ms to the first token of a short request over the socket against
llama-server's 7.1, and 6.7 ms without the wait (BENCHMARKS.md "Short requests").  Such a
client's requests can only form a burst among themselves: another client's would need a
connection of its own (HTTP/1.1 carries one request at a time), and a new connection counts
as arriving from its accept (http/fresh.py).  So when the only connection open has sent a
request before the one now waiting, and nothing else is on its way in, the decode task waits
only a few scheduler passes, enough for that connection's task to read what the client has
already written to it; more requests waiting then is a burst, and gets the whole wait.  A
client's first request waits in full: it may be the first of a burst whose other
connections are still being made.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class Clients:
    def __init__(self) -> None:
        # Open connection -> [requests it has sent]; a list of its own per connection, so a
        # closing connection removes its entry and never a newer one under the same key (an
        # HTTP peer's address and port, reused).
        self._sent: dict[Hashable, list[int]] = {}

    @property
    def open(self) -> int:
        return len(self._sent)

    @contextmanager
    def connected(self, key: Hashable) -> Iterator[None]:
        """Count the connection ``key`` (a socket connection, an HTTP peer) while it is open."""
        entry = self._sent[key] = [0]
        try:
            yield
        finally:
            if self._sent.get(key) is entry:
                del self._sent[key]

    def sent(self, key: Hashable) -> None:
        """A request came in on ``key`` (ignored for a connection not counted)."""
        if (entry := self._sent.get(key)) is not None:
            entry[0] += 1

    def lone_follow_up(self) -> bool:
        """Whether one connection is open and it has sent a request before its latest."""
        return len(self._sent) == 1 and next(iter(self._sent.values()))[0] >= 2
