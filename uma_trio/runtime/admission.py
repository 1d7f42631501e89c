"""Which waiting request starts next: a pure function of the queue and what the context has
free (issue 18), so the rule is stated and tested in one place.

An interactive request goes first, else a background one.  Within a lane, the clients take
turns: the request picked is the oldest of the client that runs the fewest sessions now
(:func:`client_of`: a socket connection, or an HTTP principal), so an app that queued eight
requests does not hold back another's one, and with every client equal it is first in,
first out.  Nobody overtakes the request picked: a large one is not starved by small ones
behind it.  (A client may still hold every sequence while nobody else asks; the next one
freed goes to another client's request before its own queued ones.  Keeping one back for
others would cost a lone app, and every HTTP app without keys, a session for good.)  A
request fits when a sequence id is available (free, or a
cached prefix that would yield it) and the cells it may come to need (prompt plus
``max_tokens``) fit beside what running requests reserve and pinned prefixes hold.
Background requests never take the last ``interactive_reserve`` sequences, nor those
interactive requests needed lately (:class:`InteractiveDemand`).  A request whose prompt
shares a prefix with one its owner's running requests is still reading waits while 128
tokens or more of it are unread, then copies what is read (:func:`follows`); meanwhile the
requests behind it may start.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..sched.kv_manager import TokenArray, common_prefix
from ..sched.state import Lane


def client_of(owner: str, connection: int) -> str:
    """Whose turn a request counts against: its socket connection (each app has its own; a
    user's apps share one principal, ``uid:N``), or over HTTP its principal: requests made
    with one API key are one client, and without keys all HTTP requests together, since a
    connection there carries one request at a time."""
    return f"{owner}#{connection}" if owner.startswith("uid:") else owner


def spare_places(max_queue: int) -> int:
    """Places past a full queue (``--max-queue``) kept for requests of clients with nothing
    waiting, so that one app filling the queue does not shut every other out: a quarter of
    it, one at least, none where there is no queue (``--max-queue 0``)."""
    return max(1, max_queue // 4) if max_queue > 0 else 0


@dataclass(frozen=True, slots=True)
class Waiting:
    lane: Lane
    reserved_cells: int  # prompt plus max_tokens
    client: str = ""  # :func:`client_of`


@dataclass(frozen=True, slots=True)
class Capacity:
    """The context, as admission sees it now."""

    available_seqs: int  # ids a request could get: free ones plus those the cache would yield
    room_cells: int  # the whole context less the cells pinned prefixes hold
    reserved_cells: int  # what running requests may come to need
    background_running: int
    background_cap: int  # sequences background requests may hold at once
    running: Mapping[str, int] = field(default_factory=dict)  # sessions each client runs

    def fits(self, request: Waiting) -> bool:
        if not self.available_seqs or self.reserved_cells + request.reserved_cells > self.room_cells:
            return False
        return request.lane == "interactive" or self.background_running < self.background_cap


# A request waits for a reader only while this much of the prefix they share is unread:
# below it, reading it side by side costs about one tick (at once on a GPU), where waiting
# costs a tick and a stream copy each, the copies admitted one a round while chats decode
# (a burst of sixteen 32-token prompts would start in waves).  The loads' own 64-token chats
# never wait.
FOLLOW_MIN_UNREAD = 128


@dataclass(frozen=True, slots=True)
class Reader:
    """A running request still reading its prompt, as a waiting one may follow it."""

    lane: Lane
    prompt: TokenArray
    n_past: int  # the prompt tokens whose KV cells it holds


def follows(prompt: TokenArray, lane: Lane, readers: Sequence[Reader], min_reuse: int) -> bool:
    """Whether a request with ``prompt`` should wait for one of ``readers`` (its owner's
    running requests still reading their prompts) to read the prefix they share, and then
    copy it as a cached prefix, rather than start now and read that prefix too.  Identical
    prompts arriving together (an app's burst, an agent's fan-out) were each read in full,
    side by side: six 1,600-token prompts all got their first token after 46 s, where one
    alone took 7 s.  Only while :data:`FOLLOW_MIN_UNREAD` tokens of it are still unread: the
    rest it reads beside the reader.  An interactive request does not wait for a background
    one, which reads at the pace the latency guard leaves it."""
    limit = len(prompt) - 1  # its last token is read by the request itself, for its logits
    for reader in readers:
        if lane == "interactive" and reader.lane != "interactive":
            continue
        if reader.n_past + FOLLOW_MIN_UNREAD > min(limit, len(reader.prompt)):
            continue  # too little left to read for any shared prefix to count (no scan)
        shared = min(common_prefix(reader.prompt, prompt), limit)
        if shared >= min_reuse and shared - reader.n_past >= FOLLOW_MIN_UNREAD:
            return True
    return False


def next_to_admit(waiting: Sequence[Waiting], capacity: Capacity) -> int | None:
    """The index in ``waiting`` (oldest first) of the request to start now, or None."""
    for lane in ("interactive", "background"):
        turns = [(capacity.running.get(r.client, 0), i) for i, r in enumerate(waiting) if r.lane == lane]
        if turns:
            pick = min(turns)[1]  # the fewest sessions running, then the oldest
            if capacity.fits(waiting[pick]):
                return pick
    return None


class InteractiveDemand:
    """How many sequences interactive requests have needed lately: the most that ran or
    waited at once over the last ``window_s``.  Background requests leave that many to them,
    so chat clients coming back after a turn's think time find their sessions, instead of
    queueing behind background prompts that took the sessions meanwhile (a background
    prompt gains little from them while chats stream: it only gets the headroom).  Noted
    every round of the decode loop; time is passed in."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        # Each change of the count holds until the next.  Only the changes that can still be
        # the peak are kept, as [when, count, until] with the counts falling from front to
        # back: a change followed by a higher count never is again, since the higher one
        # holds later.  So peak() is the front's count once the changes that ended before the
        # window are dropped, in O(1) amortized: a chain of short requests notes two changes
        # per request, a few thousand in the window, and the loop asks every round.
        self._peaks: deque[list[float]] = deque()
        self._last = -1  # the count noted last

    def note(self, now: float, count: int) -> None:
        if count == self._last:
            return
        if self._peaks:
            self._peaks[-1][2] = now  # the change before this one (always last) ends here
        while self._peaks and self._peaks[-1][1] <= count:
            self._peaks.pop()
        self._peaks.append([now, count, math.inf])
        self._last = count

    def peak(self, now: float) -> int:
        start = now - self.window_s
        while self._peaks and self._peaks[0][2] <= start:
            self._peaks.popleft()  # it ended before the window began
        return int(self._peaks[0][1]) if self._peaks else 0
