"""Overload: more clients than sessions wait in a bounded queue, the rest are told the daemon
is busy at once; nobody hangs, and everything accepted is served in full.

Simulated engine on virtual time, real sockets and decode loop.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import trio

from .helpers import RawClient, sim_daemon, text_of


async def test_a_burst_beyond_sessions_and_queue(autojump_clock: trio.abc.Clock) -> None:
    sessions, queue, clients = 4, 16, 100
    outcomes: dict[int, tuple[list[dict[str, Any]], float]] = {}
    async with sim_daemon(
        max_sessions=sessions, max_queue=queue, interactive_reserve=0, n_ctx=1024, max_connections=200
    ) as server:
        config = server.config
        connected = trio.Event()
        ready = 0

        async def client(i: int) -> None:
            nonlocal ready
            raw = await RawClient.connect(config.socket_path)
            ready += 1
            if ready == clients:
                connected.set()
            await connected.wait()  # all at the same instant
            sent = trio.current_time()
            await raw.send({"id": f"r{i}", "prompt": "word " * 100, "max_tokens": 50})
            events = await raw.until_end(f"r{i}")
            outcomes[i] = (events, trio.current_time() - sent)
            await raw.aclose()

        with trio.fail_after(600):
            async with trio.open_nursery() as burst:
                for i in range(clients):
                    burst.start_soon(client, i)

        # Beyond the context: refused with its own code, at once.
        raw = await RawClient.connect(config.socket_path)
        await raw.send({"id": "huge", "prompt": "word " * 1000, "max_tokens": 100})
        huge = await raw.until_end("huge")
        await raw.aclose()

    # Each client is a connection with nothing waiting: a quarter of the queue more gets in.
    served = sessions + queue + queue // 4
    codes = Counter(events[-1].get("code", events[-1]["event"]) for events, _ in outcomes.values())
    assert codes == Counter({"eos": served, "E_LIMIT_004": clients - served}), codes
    for events, waited in outcomes.values():
        if events[-1]["event"] == "eos":
            assert len(text_of(events).split()) == 50  # served in full
        else:
            assert waited == 0.0 and "try again" in events[-1]["message"]  # told at once
    assert huge[-1]["code"] == "E_LIMIT_002" and "exceeds the per-request context" in huge[-1]["message"]
    assert server.loop.gauges()["sessions"]["active"] == 0


async def test_an_interactive_request_gets_past_a_full_background_queue(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with sim_daemon(max_sessions=2, max_queue=2, n_ctx=1024) as server:
        config = server.config
        raw = await RawClient.connect(config.socket_path)
        background = {"prompt": "word " * 100, "max_tokens": 200, "priority": "background"}
        for i in range(6):  # 2 free ids + a queue of 2 are taken, the rest refused at once
            await raw.send({"id": f"bg{i}", **background})
        await trio.sleep(0.1)
        await raw.send({"id": "fg", "prompt": "quick question", "max_tokens": 10})
        by_id: dict[str, list[dict[str, Any]]] = {}
        while sum(e[-1]["event"] in ("eos", "error") for e in by_id.values()) < 7:
            event = await raw.next_event()
            assert event is not None
            by_id.setdefault(event["id"], []).append(event)
        await raw.aclose()
    fg = by_id.pop("fg")
    assert fg[-1]["event"] == "eos" and len(text_of(fg).split()) == 10
    codes = Counter(events[-1].get("code", "eos") for events in by_id.values())
    assert codes == Counter({"eos": 4, "E_LIMIT_004": 2}), codes


async def test_an_app_that_fills_the_queue_does_not_shut_another_out(autojump_clock: trio.abc.Clock) -> None:
    """One app filled every place of the queue, and every other app's request was E_LIMIT_004
    until it drained (the noisy-neighbour review: 136 of 136 refused over 30 s).  Places past
    a full queue are kept for clients with nothing waiting: the flooder's next request is
    still refused, and the other app's runs before the flooder's queue."""
    async with sim_daemon(max_sessions=2, max_queue=4, interactive_reserve=0, n_ctx=1024) as server:
        config = server.config
        flood = await RawClient.connect(config.socket_path)
        ends: dict[str, tuple[str, float]] = {}

        async def read_flood() -> None:
            while len(ends) < 9:
                event = await flood.next_event()
                assert event is not None
                if event["event"] in ("eos", "error"):
                    ends[event["id"]] = (event.get("code", event["event"]), trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_flood)
            for i in range(8):  # 2 sessions and the 4 places taken, the last 2 refused
                await flood.send({"id": f"f{i}", "prompt": "word " * 50, "max_tokens": 100})
            await trio.sleep(0.05)
            await flood.send({"id": "more", "prompt": "word " * 50, "max_tokens": 100})
            other = await RawClient.connect(config.socket_path)
            await other.send({"id": "mine", "prompt": "quick question", "max_tokens": 5})
            mine = await other.until_end("mine")
            mine_done = trio.current_time()
        await flood.aclose()
        await other.aclose()
    assert mine[-1]["event"] == "eos" and len(text_of(mine).split()) == 5, mine[-1]
    codes = Counter(code for code, _ in ends.values())
    assert codes == Counter({"eos": 6, "E_LIMIT_004": 3}) and ends["more"][0] == "E_LIMIT_004", ends
    queued = sorted(t for rid, (code, t) in ends.items() if code == "eos")[2:]  # the 4 that waited
    assert all(mine_done < t for t in queued), (mine_done, ends)
