"""Run-ahead: the compute thread decodes the next step of a steady batch by itself."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.engine.base import BatchEntry, EngineError, Follow, Sampled, StepResult
from uma_trio.engine.held_results import HeldResults
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.engine.sim import SimEngine
from uma_trio.runtime.run_ahead import MAX_AHEAD, RunAhead, ahead_budget
from uma_trio.runtime.server import Server

from .conftest import running_server
from .helpers import RawClient, assert_nothing_held, frame, sim_daemon, text_of

GREEDY = Sampler(SamplingParams(temperature=0.0))


def decode(seq: int, pos: int) -> BatchEntry:
    return BatchEntry(seq, np.array([5], dtype=np.int32), pos, GREEDY)


def result(*tokens: tuple[int, int, bool]) -> StepResult:
    return StepResult([Sampled(seq, tok, b"x", eog) for seq, tok, eog in tokens], len(tokens), 0.01)


def test_budget_stops_at_max_tokens_and_at_the_stream_buffer() -> None:
    assert ahead_budget(max_tokens=100, generated=10, buffer_room=None) == MAX_AHEAD
    assert ahead_budget(max_tokens=12, generated=10, buffer_room=None) == 1  # this step brings 11
    assert ahead_budget(max_tokens=11, generated=10, buffer_room=None) == 0
    assert ahead_budget(max_tokens=100, generated=10, buffer_room=5) == 3  # + this token + the tail
    assert ahead_budget(max_tokens=100, generated=10, buffer_room=2) == 0


def test_follow_continues_each_session_one_position_on_within_its_budget() -> None:
    ahead = RunAhead()
    ahead.arm({1: 2, 2: 1, 3: 0})
    entries = [decode(1, 10), decode(2, 20), decode(3, 30)]
    after = ahead.follow(entries, result((1, 41, False), (2, 42, False), (3, 43, False)))
    assert after is not None
    assert [(e.seq_id, int(e.tokens[0]), e.pos0) for e in after] == [(1, 41, 11), (2, 42, 21)]
    after = ahead.follow(after, result((1, 51, False), (2, 52, False)))
    assert after is not None and [e.seq_id for e in after] == [1]  # seq 2's budget is spent
    assert ahead.follow(after, result((1, 61, False))) is None  # and now seq 1's


def test_follow_drops_end_of_generation_and_stops_when_told() -> None:
    ahead = RunAhead()
    ahead.arm({1: 5, 2: 5})
    entries = [decode(1, 10), decode(2, 20)]
    after = ahead.follow(entries, result((1, 2, True), (2, 42, False)))
    assert after is not None and [e.seq_id for e in after] == [2]
    ahead.stop()
    assert ahead.follow(after, result((2, 43, False))) is None
    ahead.arm({1: 0})
    assert not ahead.steady  # nothing may run ahead: not armed at all


def test_follow_ends_the_chain_when_one_session_leaves_where_work_waits() -> None:
    """Armed with stop_when_one_leaves, the chain ends instead of going on without a session
    that reached its end of generation or its budget; otherwise it goes on with the rest."""
    entries = [decode(1, 10), decode(2, 20)]
    for eog, budgets in ((True, {1: 5, 2: 5}), (False, {1: 0, 2: 5})):
        sampled = result((1, 2, eog), (2, 42, False))
        carries_on, stops = RunAhead(), RunAhead()
        carries_on.arm(dict(budgets))
        stops.arm(dict(budgets), stop_when_one_leaves=True)
        after = carries_on.follow(entries, sampled)
        assert after is not None and [e.seq_id for e in after] == [2]
        assert stops.follow(entries, sampled) is None
    both = RunAhead()
    both.arm({1: 5, 2: 5}, stop_when_one_leaves=True)
    after = both.follow(entries, result((1, 41, False), (2, 42, False)))
    assert after is not None and [e.seq_id for e in after] == [1, 2]  # nobody left: it goes on


# -- the whole daemon on the simulated engine (run-ahead forced on) ------------------


async def stream_all(server: Server, requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    client = await RawClient.connect(server.config.socket_path)
    await client.send_bytes(b"".join(frame(r) for r in requests))
    return await client.until_all_end([r["id"] for r in requests])


def req(rid: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"id": rid, "prompt": "a b c d", "max_tokens": max_tokens, "temperature": 0.0, **kw}


async def test_steady_streams_run_ahead_and_every_token_arrives(autojump_clock: trio.abc.Clock) -> None:
    async with sim_daemon(run_ahead=True, prefix_cache_cells=None, stream_buffer=64) as server:
        events = await stream_all(server, [req(f"r{i}", 40 + i) for i in range(6)])
        for i in range(6):
            tokens = [e for e in events[f"r{i}"] if e["event"] == "token"]
            assert len(tokens) == 40 + i and events[f"r{i}"][-1]["reason"] == "length"
        gauges = server.loop.gauges()
        assert gauges["run_ahead"]["steps"] > 0.7 * server.loop._tick  # most steps ran ahead
        await server.loop.wait_idle()
        assert_nothing_held(server)


async def test_a_step_llama_cpp_refused_while_running_ahead_is_planned_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """llama_decode returning 1 (no KV slot) or -1 runs nothing: a planned step is retried, a
    step run ahead failed every running request (E_RUNTIME_004) and rebuilt the context."""
    refused: list[int] = []

    def refusing_once(sim: SimEngine) -> SimEngine:
        real = sim.next_ahead

        async def next_ahead() -> tuple[Sequence[BatchEntry], StepResult]:
            if not refused and sim.running_ahead:
                refused.append(1)
                sim._ahead.clear()  # the chain ends at the step llama.cpp refused
                raise EngineError(1, "injected: llama_decode found no KV slot")
            return await real()

        sim.next_ahead = next_ahead  # type: ignore[method-assign]
        return sim

    async with sim_daemon(refusing_once, run_ahead=True, prefix_cache_cells=None, stream_buffer=64) as server:
        events = await stream_all(server, [req(f"r{i}", 40) for i in range(3)])
        for i in range(3):
            tokens = [e for e in events[f"r{i}"] if e["event"] == "token"]
            assert (len(tokens), events[f"r{i}"][-1].get("reason")) == (40, "length"), events[f"r{i}"][-1]
        assert refused and server.metrics.context_rebuilds == 0
        await server.loop.wait_idle()
        assert_nothing_held(server)


async def test_a_stop_string_mid_run_ahead_trims_the_extra_cells(autojump_clock: trio.abc.Clock) -> None:
    """The simulated engine's every token reads " tok": the stop string ends r0 on its third
    token while the compute thread has already decoded further; that token is dropped and
    its cell trimmed, so the cached prefix holds exactly the request's tokens."""
    async with sim_daemon(run_ahead=True, prefix_cache_cells=None, stream_buffer=64) as server:
        events = await stream_all(server, [req("r0", 50, stop=["tok tok tok"]), req("r1", 50)])
        assert events["r0"][-1]["reason"] == "stop"
        assert events["r1"][-1]["reason"] == "length"
        assert server.loop.gauges()["run_ahead"]["dropped_tokens"] >= 1
        await server.loop.wait_idle()
        assert_nothing_held(server)  # engine cells == cached prefixes' cells


@pytest.mark.parametrize("lane", ["interactive", "background"])
async def test_a_cancel_during_run_ahead_leaves_nothing_behind(
    autojump_clock: trio.abc.Clock, lane: str
) -> None:
    """A background chain is preemptible: the cancel stops the step in flight, undone."""
    async with sim_daemon(run_ahead=True, prefix_cache_cells=None, stream_buffer=64) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send_bytes(
            frame(req("long", 2000, priority=lane)) + frame(req("short", 30, priority=lane))
        )
        reasons: dict[str, str] = {}
        seen = 0
        while len(reasons) < 2:
            event = await client.next_event()
            assert event is not None
            if event["event"] == "eos":
                reasons[event["id"]] = event["reason"]
            elif event["id"] == "long" and (seen := seen + 1) == 40:
                await client.send({"type": "cancel", "id": "long"})
        assert reasons == {"long": "cancelled", "short": "length"}
        assert server.loop.gauges()["run_ahead"]["steps"] > 0
        if lane == "background":
            assert server.loop.policy.snapshot()["preempted_ticks"] >= 1
        await server.loop.wait_idle()
        assert_nothing_held(server)


def test_held_results_go_back_together_newest_first_each_with_its_wait() -> None:
    """A background chain's results are kept and handed back together, the newest first (its
    caller waits on the oldest, and finds the rest done when that one wakes it); each says how
    long it waited.  With nothing to hold for, each goes back at once."""
    futures: list[Future[StepResult]] = [Future() for _ in range(3)]
    order: list[int] = []
    for i, future in enumerate(futures):
        future.add_done_callback(lambda _, i=i: order.append(i))
    held = HeldResults(hold_s=60.0)
    for future in futures:
        held.hand_back(future, result((1, 7, False)))
    assert not any(f.done() for f in futures)
    time.sleep(0.002)
    held.release()
    assert order == [2, 1, 0]
    waits = [f.result().held_s for f in futures]
    assert waits[0] >= waits[1] >= waits[2] and waits[2] >= 0.002
    at_once: Future[StepResult] = Future()
    HeldResults(hold_s=0.0).hand_back(at_once, result((1, 7, False)))
    assert at_once.done() and at_once.result().held_s == 0.0
    # Once the oldest has waited hold_s, the next result hands every one back.
    late = [Future(), Future()]
    held = HeldResults(hold_s=0.001)
    held.hand_back(late[0], result((1, 7, False)))
    time.sleep(0.002)
    held.hand_back(late[1], result((1, 8, False)))
    assert all(f.done() for f in late)


# -- the real model: the compute thread's own queue ----------------------------------------


@pytest.mark.model
async def test_real_model_greedy_output_is_the_same_with_and_without_run_ahead(
    llama_model: LlamaModel, server_config: Any
) -> None:
    prompts = ["Explain what a CPU does.", "Write a poem about the sea.", "List three fruits."]
    texts: dict[bool, list[str]] = {}
    for on in (False, True):
        async with running_server(llama_model, server_config, run_ahead=on) as server:
            async with UmaClient.connect(server.config.socket_path) as client:
                with trio.fail_after(120):
                    results: list[str] = [""] * len(prompts)

                    async def one(i: int, client: UmaClient = client, results: list[str] = results) -> None:
                        done = await client.complete(
                            messages=[{"role": "user", "content": prompts[i]}], max_tokens=32, temperature=0.0
                        )
                        results[i] = done.text

                    async with trio.open_nursery() as nursery:
                        for i in range(len(prompts)):
                            nursery.start_soon(one, i)
                    # A stop string mid-answer, then the same prompt again: it reuses the
                    # cached prefix the stop left, which must hold exactly its tokens.
                    stopped = await client.complete(
                        messages=[{"role": "user", "content": prompts[0]}],
                        max_tokens=32,
                        temperature=0.0,
                        stop=[results[0].split()[3]],
                    )
                    again = await client.complete(
                        messages=[{"role": "user", "content": prompts[0]}], max_tokens=32, temperature=0.0
                    )
            assert stopped.eos.reason == "stop" and again.text == results[0]
            assert (server.loop.gauges()["run_ahead"]["steps"] > 0) == on
            texts[on] = results
    assert texts[True] == texts[False]
    assert all(len(t) > 20 for t in texts[True])


@pytest.mark.model
async def test_a_background_stream_s_tokens_come_back_together_and_the_same(
    llama_model: LlamaModel, server_config: Any
) -> None:
    """On the CPU a lone stream runs ahead; in the background lane nobody watches its tokens
    one by one, so its chain's results come back together (engine/held_results.py): most of
    its tokens reach the client right after the one before, where an interactive stream's
    come a step apart.  The tokens are the same, and the time the results were held is not
    counted as the engine idling between steps."""
    async with running_server(llama_model, server_config, run_ahead=True) as server:
        client = await RawClient.connect(server.config.socket_path)
        ends: dict[str, dict[str, Any]] = {}
        texts: dict[str, str] = {}
        idle: dict[str, float | None] = {}
        for lane in ("background", "interactive"):
            ask = {"id": lane, "prompt": "hello " * 32, "max_tokens": 64,
                   "temperature": 0.0, "priority": lane}  # fmt: skip
            with trio.fail_after(120):
                await client.send(ask)
                events = await client.until_end(lane)
            ends[lane], texts[lane] = events[-1], text_of(events)
            idle[lane] = server.scorecard(trio.current_time()).engine_idle_pct
        assert ends["background"]["reason"] == ends["interactive"]["reason"] == "length"
        assert texts["background"] == texts["interactive"] and len(texts["background"]) > 64
        # The median gap between two tokens written to the client.
        assert ends["background"]["timings"]["itl_p50_ms"] < 1.0, ends["background"]["timings"]
        assert ends["interactive"]["timings"]["itl_p50_ms"] > 2.0, ends["interactive"]["timings"]
        assert server.loop.gauges()["run_ahead"]["steps"] > 0
        # Counted from when each held step ended, not when it was handed back: with the
        # ~10 steps of a hand-back read as one long gap, the engine read ~45 % idle.
        assert idle["background"] is not None and idle["background"] < 25.0, idle


def http_chunks(raw: bytes) -> list[bytes]:
    """The chunks of a chunked HTTP/1.1 body, after the response's head."""
    body, chunks = raw.split(b"\r\n\r\n", 1)[1], []
    while True:
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(body[:size])
        body = body[size + 2 :]


@pytest.mark.model
async def test_a_background_sse_stream_writes_its_tokens_together(keyed_http_server: Server) -> None:
    """Over HTTP too a background stream's tokens, handed back together, go out together: a
    few body chunks for 64 tokens, where an interactive stream's each take their own."""
    host, port = keyed_http_server.http_url.removeprefix("http://").split(":")
    chunks: dict[str, list[bytes]] = {}
    for lane in ("background", "interactive"):
        ask = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "hello " * 32, "max_tokens": 64,
               "temperature": 0, "stream": True}  # fmt: skip
        body = json.dumps(ask).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer k\r\nX-Uma-Priority: {lane}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(head.encode() + body)
        received = b""
        with trio.fail_after(120):
            while not received.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's terminator
                data = await stream.receive_some(65536)
                assert data, received[:600]
                received += data
        await stream.aclose()
        chunks[lane] = http_chunks(received)
        events = [
            line for chunk in chunks[lane] for line in chunk.split(b"\n") if line.startswith(b"data: {")
        ]
        assert len(events) == 65, (lane, len(events))  # 64 tokens and the last, with finish_reason
    assert len(chunks["background"]) <= 20, len(chunks["background"])
    assert len(chunks["interactive"]) >= 60, len(chunks["interactive"])


async def test_tick_trace_has_one_line_per_step_run_ahead_or_planned(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    trace = tmp_path / "ticks.jsonl"
    async with sim_daemon(run_ahead=True, tick_trace=trace, stream_buffer=64) as server:
        await stream_all(server, [req(f"r{i}", 30) for i in range(3)])
        await server.loop.wait_idle()
        ticks = server.loop._tick
        # Readable while the daemon runs, not only once it stops (a review found it empty).
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == ticks
    assert [r["tick"] for r in rows] == list(range(ticks))
    # Each request prefills its 4 prompt tokens; the step that ends its prompt samples token 1.
    assert sum(r["prefill"] for r in rows) == 3 * 4
    assert sum(r["decode"] for r in rows) == 3 * 29
    assert any(r["ahead"] for r in rows) and not rows[0]["ahead"]
    assert all(r["step_ms"] > 0 for r in rows)


async def test_by_default_steady_streams_run_ahead_together(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """--run-ahead by default, on an engine whose step takes the host's cores (the simulated
    one, as a CPU): two streams run ahead side by side, then the longer one alone, and every
    token of both arrives."""
    trace = tmp_path / "ticks.jsonl"
    async with sim_daemon(tick_trace=trace, stream_buffer=64) as server:
        assert not server.engine.step_frees_host
        events = await stream_all(server, [req("short", 12), req("long", 48)])
        await server.loop.wait_idle()
        assert server.loop.gauges()["run_ahead"]["enabled"] is True
    assert [len([e for e in events[r] if e["event"] == "token"]) for r in ("short", "long")] == [12, 48]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    ahead = [r for r in rows if r["ahead"]]
    assert {r["decode"] for r in ahead} == {1, 2}


def test_startup_heap_is_frozen_after_collecting_its_garbage() -> None:
    """The daemon freezes what start-up allocated, so a full collection does not scan it
    mid-serving (26-46 ms with the GIL held on the dev machine); garbage is collected first,
    never frozen."""
    import gc
    import weakref

    from uma_trio.process_setup import freeze_startup_heap

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    gone = weakref.ref(a)
    del a, b
    try:
        freeze_startup_heap()
        assert gone() is None
        assert gc.get_freeze_count() > 10_000  # modules, classes, functions of the process
    finally:
        gc.unfreeze()


async def test_a_chat_stops_a_background_chain_as_fast_as_a_planned_step(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A lone background stream runs ahead on a CPU too (its chain stays preemptible): a chat
    arriving mid-chain stops the step in flight, and its first token comes as soon as with the
    background steps planned.  The background stream loses nothing."""
    first_token: dict[bool, float] = {}
    for on in (False, True):
        trace = tmp_path / f"ticks-{on}.jsonl"
        async with sim_daemon(run_ahead=on, tick_trace=trace, stream_buffer=64) as server:
            background = await RawClient.connect(server.config.socket_path)
            await background.send(req("bg", 400, priority="background"))
            await trio.sleep(0.5)  # well into its decode
            assert server.loop.gauges()["sessions"]["decoding"] == 1
            chat = await RawClient.connect(server.config.socket_path)
            sent = trio.current_time()
            await chat.send(req("chat", 8))
            assert (await chat.next_event() or {}).get("event") == "token"
            first_token[on] = trio.current_time() - sent
            assert len([e for e in await chat.until_end("chat") if e["event"] == "token"]) == 7
            bg = await background.until_end("bg")
            assert len([e for e in bg if e["event"] == "token"]) == 400
            await server.loop.wait_idle()
            assert server.loop.policy.snapshot()["preempted_ticks"] >= 1
            assert_nothing_held(server)
        ran_ahead = [json.loads(line)["ahead"] for line in trace.read_text().splitlines()]
        assert any(ran_ahead) == on
    assert first_token[True] <= first_token[False] + 0.001


async def test_streams_run_ahead_while_a_background_prompt_waits_for_its_rescue(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Chats decoding beside a background prompt the guard has no room for: their steps run
    ahead for as long as the plan stands (Plan.stands_for), and the prompt is still rescued
    and finishes, with every chat token delivered."""
    trace = tmp_path / "ticks.jsonl"
    async with sim_daemon(tick_trace=trace, stream_buffer=64) as server:
        long_prompt = "word " * 1500
        requests = [req("a", 300), req("b", 300), req("bg", 4, priority="background", prompt=long_prompt)]
        events = await stream_all(server, requests)
        await server.loop.wait_idle()
        assert_nothing_held(server)
    assert [len([e for e in events[r] if e["event"] == "token"]) for r in ("a", "b", "bg")] == [300, 300, 4]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    beside_prompt = [r for r in rows if r["ahead"] and r["skipped"]]
    assert len(beside_prompt) > 50
    assert any(r["rescue"] for r in rows)


async def test_streams_run_ahead_while_a_request_waits_for_a_sequence(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Two sequences, three chats: the third waits for one to end.  Meanwhile the two run
    ahead (only a session ending or an arrival can free room, and both stop the chain), and
    the third starts as soon as with every step planned."""
    first_token: dict[bool, float] = {}
    for on in (False, True):
        trace = tmp_path / f"ticks-{on}.jsonl"
        async with sim_daemon(
            run_ahead=on, tick_trace=trace, max_sessions=2, prefix_cache_cells=None, stream_buffer=64
        ) as server:
            client = await RawClient.connect(server.config.socket_path)
            started = trio.current_time()
            await client.send_bytes(b"".join(frame(req(r, n)) for r, n in (("a", 300), ("b", 60), ("c", 50))))
            events: dict[str, list[dict[str, Any]]] = {"a": [], "b": [], "c": []}
            ended = 0
            while ended < 3:
                event = await client.next_event()
                assert event is not None
                if event["id"] == "c" and not events["c"]:
                    first_token[on] = trio.current_time() - started
                events[event["id"]].append(event)
                ended += event["event"] == "eos"
            assert [len([e for e in events[r] if e["event"] == "token"]) for r in "abc"] == [300, 60, 50]
            await server.loop.wait_idle()
            assert_nothing_held(server)
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
        beside_queue = [r for r in rows if r["ahead"] and r["waiting"]]
        assert (len(beside_queue) > 30) == on
    assert first_token[True] <= first_token[False] + 0.001


class CancelInTheHandOff(SimEngine):
    """Cancels request "long" from inside ``follow``: after the next step's batch is built
    from a token, before the loop has that token's step (LlamaEngine's hand-off order)."""

    loop: Any = None
    at_step = 30  # steps run ahead before the cancel lands

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ahead_steps = 0

    async def _step_and_follow(
        self, entries: Sequence[BatchEntry], follow: Follow | None, *, preemptible: bool = False,
        ahead: bool = False,
    ) -> StepResult:  # fmt: skip
        def follow_then_cancel(ran: Sequence[BatchEntry], result: StepResult) -> Sequence[BatchEntry] | None:
            assert follow is not None
            after = follow(ran, result)
            self.ahead_steps += ahead
            if after and ahead and self.ahead_steps == self.at_step:
                for session in list(self.loop._active.values()):
                    if session.id == "long":
                        self.loop.cancel(session, "client")
            return after

        chained = follow_then_cancel if follow is not None else None
        return await super()._step_and_follow(entries, chained, preemptible=preemptible, ahead=ahead)


async def test_a_cancel_in_the_run_ahead_hand_off_keeps_the_cached_prefix_whole(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The step run ahead already fed the cancelled request's last sampled token: the prefix
    cache records as many tokens as the sequence holds cells."""
    engines: list[CancelInTheHandOff] = []

    def wrap(sim: SimEngine) -> SimEngine:
        engines.append(CancelInTheHandOff(sim.cost, n_ctx_seq=sim.n_ctx_seq, n_seq_max=sim.n_seq_max))
        return engines[-1]

    async with sim_daemon(wrap=wrap, run_ahead=True, prefix_cache_cells=None, stream_buffer=64) as server:
        engines[0].loop = server.loop
        client = await RawClient.connect(server.config.socket_path)
        await client.send_bytes(
            frame({"id": "long", "prompt": "a b c d", "max_tokens": 500, "temperature": 0.0})
        )
        assert (await client.until_end("long"))[-1]["reason"] == "cancelled"
        await server.loop.wait_idle()
        cached = server.loop.kv.cached()
        assert cached and all(len(tokens) == server.engine.seq_cells(s) for s, tokens in cached.items())
        assert_nothing_held(server)
