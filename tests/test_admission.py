"""Which waiting request starts next (issue 18: admission as a pure function), alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from uma_trio.runtime.admission import (
    FOLLOW_MIN_UNREAD,
    Capacity,
    InteractiveDemand,
    Reader,
    Waiting,
    follows,
    next_to_admit,
)

ROOMY = Capacity(
    available_seqs=4, room_cells=10_000, reserved_cells=0, background_running=0, background_cap=3
)


def chat(cells: int = 100) -> Waiting:
    return Waiting("interactive", cells)


def job(cells: int = 100) -> Waiting:
    return Waiting("background", cells)


def test_the_oldest_interactive_request_goes_before_older_background_ones() -> None:
    assert next_to_admit([job(), job(), chat(), chat()], ROOMY) == 2
    assert next_to_admit([job(), job()], ROOMY) == 0
    assert next_to_admit([], ROOMY) is None


def test_nobody_overtakes_the_head_of_its_lane() -> None:
    tight = Capacity(
        available_seqs=4, room_cells=1_000, reserved_cells=500, background_running=0, background_cap=3
    )
    # The interactive head needs 600 cells and 500 are free: the small chat behind it waits
    # too, and the background head, which fits, goes.
    assert next_to_admit([chat(600), chat(50), job(100)], tight) == 2
    assert next_to_admit([chat(600), chat(50)], tight) is None


def test_no_free_id_or_the_background_cap_holds_requests_back() -> None:
    no_ids = Capacity(
        available_seqs=0, room_cells=10_000, reserved_cells=0, background_running=0, background_cap=3
    )
    assert next_to_admit([chat(), job()], no_ids) is None
    capped = Capacity(
        available_seqs=1, room_cells=10_000, reserved_cells=0, background_running=3, background_cap=3
    )
    assert next_to_admit([job()], capped) is None  # the last id is kept for a chat
    assert next_to_admit([job(), chat()], capped) == 1


def test_interactive_demand_is_the_peak_of_the_last_window() -> None:
    demand = InteractiveDemand(window_s=10.0)
    demand.note(0.0, 3)
    demand.note(1.0, 1)  # two chats are between turns
    assert demand.peak(5.0) == 3
    demand.note(9.0, 2)
    assert demand.peak(10.5) == 3 and demand.peak(11.5) == 2  # the 3 ended at 1.0 s
    demand.note(20.0, 0)
    assert demand.peak(20.0) == 2 and demand.peak(31.0) == 0
    assert InteractiveDemand().peak(0.0) == 0


def naive_peak(changes: list[tuple[float, int]], now: float, window_s: float) -> int:
    """The definition: the highest count that held at any time in ``(now - window_s, now]``;
    each change holds until the next one."""
    start = now - window_s
    held = [
        count for i, (_, count) in enumerate(changes) if i + 1 == len(changes) or changes[i + 1][0] > start
    ]
    return max(held, default=0)


@given(
    st.lists(st.tuples(st.floats(0.0, 4.0), st.integers(0, 6), st.floats(0.0, 4.0)), min_size=1, max_size=80)
)
def test_interactive_demand_matches_the_definition_at_every_read(
    steps: list[tuple[float, int, float]],
) -> None:
    """Notes and reads at random, never going back in time (the decode loop's clock)."""
    demand = InteractiveDemand(window_s=10.0)
    changes: list[tuple[float, int]] = []
    now = 0.0
    for advance, count, wait in steps:
        now += advance
        demand.note(now, count)
        if not changes or changes[-1][1] != count:
            changes.append((now, count))
        assert demand.peak(now) == naive_peak(changes, now, 10.0)
        now += wait  # a read between two notes
        assert demand.peak(now) == naive_peak(changes, now, 10.0)


def test_interactive_demand_keeps_only_what_can_still_be_the_peak() -> None:
    demand = InteractiveDemand(window_s=10.0)
    for i in range(2_000):  # a chain of short requests: 0, 1, 0, 1, ...
        demand.note(i * 0.01, i % 2)
    assert demand.peak(20.0) == 1
    assert len(demand._peaks) <= 2


def test_clients_take_turns_within_a_lane() -> None:
    """One app queued eight chats before another's one: the other's goes next, since its
    client runs nothing; among equals it is first in, first out."""
    hog = [Waiting("interactive", 100, "uid:1#3") for _ in range(8)]
    other = Waiting("interactive", 100, "uid:1#4")
    busy = Capacity(
        available_seqs=4, room_cells=10_000, reserved_cells=0, background_running=0, background_cap=3,
        running={"uid:1#3": 4},
    )  # fmt: skip
    assert next_to_admit([*hog, other], busy) == 8
    assert next_to_admit([*hog, other], ROOMY) == 0  # nobody runs anything: the oldest
    # The pick is not overtaken: it needs more cells than are free, so nothing starts.
    tight = Capacity(
        available_seqs=4, room_cells=1_000, reserved_cells=500, background_running=0, background_cap=3,
        running={"uid:1#3": 1},
    )  # fmt: skip
    assert (
        next_to_admit([Waiting("interactive", 50, "uid:1#3"), Waiting("interactive", 600, "b")], tight)
        is None
    )


def test_a_socket_connection_is_a_client_and_so_is_an_http_principal() -> None:
    from uma_trio.runtime.admission import client_of

    assert client_of("uid:1000", 3) != client_of("uid:1000", 4)  # two apps of one user
    assert client_of("http", 3) == client_of("http", 9)  # HTTP: a connection per request
    assert client_of("key:abc", 3) != client_of("http", 3)


def test_a_request_waits_for_a_reader_of_its_prefix_only_while_it_is_worth_it() -> None:
    """:func:`follows`: wait while a running request reads a prefix this prompt shares, at
    least FOLLOW_MIN_UNREAD tokens of it unread (then copy what it read); not for a short or
    nearly read prefix, and an interactive request never for a background reader."""
    unread = FOLLOW_MIN_UNREAD
    prompt = np.arange(3 * unread, dtype=np.int32)
    same_start = np.concatenate([prompt[: 2 * unread], np.full(unread, -1, dtype=np.int32)])
    reading = Reader("interactive", prompt.copy(), n_past=unread // 2)
    assert follows(prompt, "interactive", [reading], min_reuse=16)
    assert follows(same_start, "background", [reading], min_reuse=16)
    # Less than FOLLOW_MIN_UNREAD of the shared part unread: admitted now, its claim copies
    # what is read and it reads the rest beside the reader.
    nearly = Reader("interactive", prompt, n_past=2 * unread - unread // 2)
    assert not follows(same_start, "interactive", [nearly], min_reuse=16)
    # Its last token is its own to read: an identical prompt read all but that is not waited for.
    done = Reader("interactive", prompt, n_past=len(prompt) - 1)
    assert not follows(prompt, "interactive", [done], min_reuse=16)
    # A short shared prefix (a chat template's system line, a load generator's short chats):
    # read side by side, as before.
    short = np.concatenate([prompt[: unread - 1], np.full(unread, -1, dtype=np.int32)])
    assert not follows(short, "interactive", [Reader("interactive", prompt, n_past=0)], min_reuse=16)
    background_reader = Reader("background", prompt, n_past=0)
    assert not follows(prompt, "interactive", [background_reader], min_reuse=16)
    assert follows(prompt, "background", [background_reader], min_reuse=16)
    assert not follows(prompt, "interactive", [], min_reuse=16)
