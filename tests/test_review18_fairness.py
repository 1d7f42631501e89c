"""Review 18, fairness between clients: a slow reader cannot hold every session while others
wait, snapshot jobs take turns with the streams' ticks, and prefix-cache copies are admitted
one a round beside decoding streams.  All on the simulated daemon under virtual time."""

from __future__ import annotations

from typing import Any

import trio

import uma_trio.runtime.decode_loop as decode_loop
from uma_trio.engine.base import Engine
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.runtime.decode_loop import PARKED_HOLD_S
from uma_trio.runtime.server import Server
from uma_trio.runtime.stream import RequestStream
from uma_trio.sched.kv_manager import Claim

from .helpers import RawClient, sim_daemon


def record_copies(monkeypatch: Any) -> list[int]:
    """The engine's step count at each claim that copies a KV stream, from now on."""
    copies: list[int] = []
    real = decode_loop.set_up_sequence

    def recording(engine: Engine, claim: Claim) -> tuple[int, list[int]]:
        if claim.source is not None and not claim.adopted:
            copies.append(len(engine.steps))  # type: ignore[attr-defined]
        return real(engine, claim)

    monkeypatch.setattr(decode_loop, "set_up_sequence", recording)
    return copies


async def _drain_now(client: RawClient) -> list[dict[str, Any]]:
    """Everything ``client``'s socket holds now (a slow reader's occasional read)."""
    events: list[dict[str, Any]] = []
    while True:
        with trio.move_on_after(0.001) as scope:
            event = await client.next_event()
        if scope.cancelled_caught or event is None:
            return events
        events.append(event)


async def _first_token_s(server: Server, request_id: str, max_tokens: int = 10) -> float:
    """Seconds from sending a streamed request to its first token event."""
    client = await RawClient.connect(server.config.socket_path)
    sent = trio.current_time()
    await client.send({"id": request_id, "prompt": "hi there", "max_tokens": max_tokens})
    while True:
        event = await client.next_event()
        assert event is not None and event["event"] != "error", event
        if event["event"] == "token":
            return trio.current_time() - sent


async def test_a_slow_reader_holding_every_session_yields_to_a_waiting_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A client reading every 24 s (under the 30 s stall timeout) kept its 8 sessions parked
    and another client's 10-token request queued for good; now a session parked longer than
    PARKED_HOLD_S while a request waits is cancelled as stalled."""
    async with sim_daemon() as server:
        config = server.config
        assert config.stall_timeout_s > PARKED_HOLD_S + 10
        # Two connections (one client may not hold every session), four requests each.
        hogs = [await RawClient.connect(config.socket_path) for _ in range(2)]
        ids = [f"h{i}" for i in range(config.max_sessions)]
        for i, rid in enumerate(ids):
            await hogs[i % 2].send({"id": rid, "prompt": "tell me everything", "max_tokens": 4000})
        seen: list[dict[str, Any]] = []

        async def read_rarely() -> None:
            while True:
                await trio.sleep(config.stall_timeout_s * 0.8)
                for hog in hogs:
                    seen.extend(await _drain_now(hog))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_rarely)
            await trio.sleep(5)
            assert server.loop.gauges()["sessions"]["parked"] == config.max_sessions
            with trio.move_on_after(120) as scope:  # virtual: before, it waited for good
                ttft = await _first_token_s(server, "v")
            assert not scope.cancelled_caught, "the request still waits after 120 s"
            nursery.cancel_scope.cancel()
        assert ttft <= PARKED_HOLD_S + 3.0, ttft
        for hog in hogs:
            seen.extend(await _drain_now(hog))
        ends = {e["id"]: e for e in seen if e["event"] == "eos"}
        assert set(ends) == set(ids)
        assert all(e["reason"] == "cancelled" and e["cancel_reason"] == "stalled" for e in ends.values())


async def test_a_parked_session_nobody_waits_for_is_left_to_the_stall_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with sim_daemon() as server:
        config = server.config
        hog = await RawClient.connect(config.socket_path)
        await hog.send({"id": "h", "prompt": "tell me everything", "max_tokens": 3000})
        await trio.sleep(config.stall_timeout_s - 5)  # parked nearly all this time
        assert server.loop.gauges()["sessions"]["parked"] == 1
        assert not server.metrics.cancels
        events = await hog.until_end("h")
        assert events[-1]["event"] == "eos" and events[-1]["reason"] == "length"


async def test_a_parked_session_stays_while_the_others_run_and_nobody_waits(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Parked beside running streams (the loop ticks all along): still left alone."""
    async with sim_daemon(max_sessions=2) as server:
        hog = await RawClient.connect(server.config.socket_path)
        await hog.send({"id": "h", "prompt": "tell me everything", "max_tokens": 3000})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, server, "other", 3000)
            await trio.sleep(server.config.stall_timeout_s - 5)
            assert server.loop.gauges()["sessions"]["parked"] == 1
            assert not server.metrics.cancels
            nursery.cancel_scope.cancel()


async def test_a_parked_session_stays_while_the_only_request_waiting_follows_a_reader(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request waiting for a running one to read the prompt prefix they share (SCHEDULER.md
    "A prefix still being read is waited for") waits for no sequence: cancelling a parked
    session would not start it sooner, so the parked one is left to the stall timeout."""
    settings = dict(n_ctx=8192, max_prompt_tokens=8192, prefix_cache_cells=None, stream_buffer=64)
    async with sim_daemon(**settings) as server:
        hog = await RawClient.connect(server.config.socket_path)
        await hog.send({"id": "h", "prompt": "tell me everything", "max_tokens": 3000})
        while server.loop.gauges()["sessions"]["parked"] < 1:  # its reader has stopped reading
            await trio.sleep(0.1)
        prompt = " ".join(f"w{i}" for i in range(6000))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, server, "reader", 4, prompt)
            await trio.sleep(0.5)
            nursery.start_soon(_stream, server, "follower", 4, prompt)
            await trio.sleep(PARKED_HOLD_S + 3.0)
            rows = {r["id"]: r for r in server.loop.gauges()["in_flight"]}
            assert rows["reader"]["phase"] == "prefill" and rows["follower"]["phase"] == "waiting", rows
            assert server.loop.gauges()["sessions"]["parked"] == 1
            assert not server.metrics.cancels
        # The follower copied what the reader read.
        assert server.loop.kv.stats.reused_tokens >= 5000


async def _stream(server: Server, request_id: str, max_tokens: int, prompt: str = "count to many") -> None:
    request = GenerateRequest(id=request_id, prompt=prompt, max_tokens=max_tokens, stream=True)
    stream = await server.open_request(request, trio.current_time(), connection=1)
    await _read_all(stream)


async def _read_all(stream: RequestStream) -> None:
    async for _ in stream.receive:
        pass


async def test_snapshot_jobs_take_turns_with_the_streams_ticks(autojump_clock: trio.abc.Clock) -> None:
    """Jobs queued together ran back to back in the decode task, freezing every stream
    (four saves of a long prompt: 1.3 s); now one a round while sessions run."""
    async with sim_daemon() as server:
        engine: Any = server.engine
        ran_at: list[int] = []

        async def job() -> None:
            ran_at.append(len(engine.steps))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, server, "s", 2000)
            await trio.sleep(1.0)
            assert server.loop.gauges()["sessions"]["decoding"] == 1
            async with trio.open_nursery() as jobs:
                for _ in range(3):
                    jobs.start_soon(server.loop.exclusive, job)
            nursery.cancel_scope.cancel()
        assert len(ran_at) == 3 and ran_at[0] < ran_at[1] < ran_at[2], ran_at


async def test_snapshot_jobs_all_run_while_nothing_else_runs(autojump_clock: trio.abc.Clock) -> None:
    async with sim_daemon() as server:
        engine: Any = server.engine
        ran_at: list[int] = []

        async def job() -> None:
            ran_at.append(len(engine.steps))

        with trio.fail_after(1.0):
            async with trio.open_nursery() as jobs:
                for _ in range(3):
                    jobs.start_soon(server.loop.exclusive, job)
        assert ran_at == [0, 0, 0]


async def test_prefix_copies_are_admitted_one_a_round_beside_a_stream(
    autojump_clock: trio.abc.Clock, monkeypatch: Any
) -> None:
    """Each claim that copies a KV stream costs a copy at the start of the next step, which
    the decoding streams wait for: six at once stretched a chat's tick to 124 ms.  Beside an
    interactive stream, one such request is admitted a round; the rest wait one tick each."""
    copies = record_copies(monkeypatch)  # the engine's step count at each copying claim
    shared = " ".join(f"word{i}" for i in range(200))
    async with sim_daemon(prefix_cache_cells=None) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, server, "s", 3000)
            await trio.sleep(1.0)
            assert server.loop.gauges()["sessions"]["decoding"] == 1
            await _stream(server, "first", 1, shared)  # cached: the next ones share it
            async with trio.open_nursery() as burst:
                for k in range(5):
                    burst.start_soon(_stream, server, f"c{k}", 1, f"{shared} variant{k} and then some more")
            nursery.cancel_scope.cancel()
    assert len(copies) >= 4, copies
    assert len(set(copies)) == len(copies), copies  # never two in one round
    assert server.engine.steps[copies[0]][0] >= 1  # ...and the stream decoded in those steps


async def test_prefix_copies_are_admitted_together_when_no_stream_decodes(
    autojump_clock: trio.abc.Clock, monkeypatch: Any
) -> None:
    copies = record_copies(monkeypatch)
    shared = " ".join(f"word{i}" for i in range(200))
    async with sim_daemon(prefix_cache_cells=None) as server:
        await _stream(server, "first", 1, shared)
        async with trio.open_nursery() as burst:
            for k in range(5):
                burst.start_soon(_stream, server, f"c{k}", 1, f"{shared} variant{k} and then some more")
    assert len(copies) >= 4 and len(set(copies)) == 1, copies


async def test_a_session_freed_goes_to_another_clients_request_first(autojump_clock: trio.abc.Clock) -> None:
    """A client that queued sixteen chats before another app's one: first in, first out,
    the other waited behind all eight of the first one's queued requests; now the first
    session freed goes to the client running none (runtime/admission.py)."""
    async with sim_daemon() as server:
        config = server.config
        hog = await RawClient.connect(config.socket_path)
        for i in range(2 * config.max_sessions):
            await hog.send({"id": f"h{i}", "prompt": "tell me everything", "max_tokens": 100})
        first_tokens: dict[str, float] = {}

        async def read_all() -> None:
            while (event := await hog.next_event()) is not None:
                if event["event"] == "token":
                    first_tokens.setdefault(event["id"], trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await trio.sleep(0.5)
            assert server.loop.gauges()["sessions"]["waiting"] == config.max_sessions
            with trio.fail_after(60):
                await _first_token_s(server, "other")
            other_at = trio.current_time()
            nursery.cancel_scope.cancel()
        queued_first = min(first_tokens.get(f"h{i}", float("inf")) for i in range(config.max_sessions, 16))
        assert other_at <= queued_first, (other_at, queued_first)
