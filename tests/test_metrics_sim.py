"""Metrics of the whole daemon on the simulated engine under trio's mock clock: exact timing."""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import trio

from tests.helpers import assert_lane_percentiles_agree
from uma_trio.client import UmaClient
from uma_trio.engine.sim import SimEngine
from uma_trio.loadgen.scenario import ClientSpec, Scenario
from uma_trio.loadgen.simulate import SIM_CONFIG, simulate
from uma_trio.runtime.server import Server
from uma_trio.runtime.stream import RequestStream
from uma_trio.sched.cost import CostCoefficients
from uma_trio.sched.policy import default_policy


async def test_metrics_are_answered_while_a_long_engine_step_runs(autojump_clock: trio.abc.Clock) -> None:
    slow = CostCoefficients(fixed_s=2.0, source="test: every step takes 2 s")
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "m.sock")
        server = Server(SimEngine(slow), config, policy=default_policy(config, prior=slow))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            async with (
                UmaClient.connect(config.socket_path) as gen,
                UmaClient.connect(config.socket_path) as ask,
                trio.open_nursery() as requests,
            ):
                requests.start_soon(lambda: gen.complete(prompt="word " * 50, max_tokens=3))
                await trio.sleep(0.5)  # the first step (its prompt) runs from t=0 to t=2 s
                asked = trio.current_time()
                snapshot = await ask.metrics()
                assert trio.current_time() == asked  # answered at once, not after the tick
                assert snapshot["ticks"] == 0
                assert snapshot["sessions"]["prefilling"] == 1
                (row,) = snapshot["in_flight"]
                assert row["phase"] == "prefill" and row["age_ms"] == 500.0
                requests.cancel_scope.cancel()
            server.request_shutdown(force=True)


async def test_counters_and_percentiles_match_what_the_clients_saw(autojump_clock: trio.abc.Clock) -> None:
    clients = [
        ClientSpec(name=f"chat-{i}", prompt_tokens=30, max_tokens=60, requests=3, think_s=0.2)
        for i in range(3)
    ]
    clients.append(ClientSpec(name="bulk", lane="background", prompt_tokens=900, max_tokens=40, start_s=0.5))
    result, server = await simulate(Scenario(name="metrics", clients=clients), CostCoefficients())
    assert all(r.ok for r in result.records)
    snapshot = server.metrics_snapshot()

    for lane in ("interactive", "background"):
        mine = [r for r in result.records if r.lane == lane]
        assert snapshot["requests"][lane] == dict(Counter(r.eos_reason for r in mine))
        assert snapshot["tokens"]["prompt"][lane] == sum(r.prompt_tokens or 0 for r in mine)
        assert snapshot["tokens"]["generated"][lane] == sum(r.completion_tokens or 0 for r in mine)
        assert_lane_percentiles_agree(snapshot["latency"], result.records, lane)
    assert snapshot["cancels"] == {} and snapshot["errors"] == {}
    assert snapshot["scorecard"]["scheduler_efficiency"] == 1.0  # nothing was cancelled


async def test_a_request_in_flight_shows_when_it_should_end(autojump_clock: trio.abc.Clock) -> None:
    """``in_flight`` rows carry ``eta_s`` (issue 19: a background job's expected completion,
    shown by ``uma-trio top``): mid-prompt it names an end close to the real one."""
    from uma_trio.protocol.messages import GenerateRequest

    from .helpers import sim_daemon

    async with sim_daemon(n_ctx=8192, max_prompt_tokens=8192) as server:
        prompt = " ".join(f"w{i}" for i in range(3000))
        request = GenerateRequest(id="job", prompt=prompt, max_tokens=16, priority="background", stream=True)
        stream = await server.open_request(request, trio.current_time(), connection=1)
        await trio.sleep(2.0)
        row = next(r for r in server.loop.gauges()["in_flight"] if r["id"] == "job")
        asked = trio.current_time()
        assert row["phase"] == "prefill" and row["eta_s"] is not None
        async for _ in stream.receive:
            pass
        left = trio.current_time() - asked
        assert 0.5 * left <= row["eta_s"] <= 2.0 * left, (row["eta_s"], left)


async def test_an_embedding_in_flight_ends_with_its_prompt(autojump_clock: trio.abc.Clock) -> None:
    """Scheduler review: ``top`` showed an embedding as ``0/256`` generated and its ``eta_s``
    counted 256 answer tokens it never generates."""
    from rich.console import Console

    from uma_trio.observability.views import sessions_table
    from uma_trio.protocol.messages import GenerateRequest

    from .helpers import sim_daemon

    async with sim_daemon(n_ctx=8192, max_prompt_tokens=8192) as server:
        prompt = " ".join(f"w{i}" for i in range(3000))
        request = GenerateRequest(id="vec", prompt=prompt, embed=True, priority="background")
        stream = await server.open_request(request, trio.current_time(), connection=1)
        await trio.sleep(2.0)
        row = next(r for r in server.loop.gauges()["in_flight"] if r["id"] == "vec")
        asked = trio.current_time()
        assert row["phase"] == "prefill" and row["max_tokens"] == 0 and row["eta_s"] is not None
        console = Console(width=200, record=True)
        console.print(sessions_table(server.metrics_snapshot()))
        shown = console.export_text()
        async for _ in stream.receive:
            pass
        left = trio.current_time() - asked
        assert 0.5 * left <= row["eta_s"] <= 1.5 * left, (row["eta_s"], left)
    assert "vec" in shown and "/256" not in shown


async def test_a_held_decoder_s_expected_end_grows_with_its_wait(autojump_clock: trio.abc.Clock) -> None:
    """A background request decoding alone, then held by the budget beside three streaming
    chats: its ``eta_s`` counts the wait for its next token (the pace so far), so it grows
    while the request does not move, instead of repeating the figure of its last token."""
    from uma_trio.protocol.messages import GenerateRequest

    from .helpers import sim_daemon

    async def drain(stream: RequestStream) -> None:
        async for _ in stream.receive:
            pass

    async with sim_daemon(max_sessions=5) as server, trio.open_nursery() as nursery:
        job = GenerateRequest(id="job", prompt="w " * 20, max_tokens=400, priority="background", stream=True)
        nursery.start_soon(drain, await server.open_request(job, trio.current_time(), connection=2))
        await trio.sleep(0.3)
        for i in range(3):
            chat = GenerateRequest(id=f"chat{i}", prompt="hello " * 20, max_tokens=2000, stream=True)
            nursery.start_soon(drain, await server.open_request(chat, trio.current_time(), connection=1))
        seen = []
        for _ in range(40):
            await trio.sleep(0.05)
            row = next(r for r in server.loop.gauges()["in_flight"] if r["id"] == "job")
            seen.append((row["held"], row["generated"], row["gap_ms"], row["eta_s"]))
        held = [(gap, eta, generated) for why, generated, gap, eta in seen if why == "budget"]
        assert len(held) >= 10, seen
        longest = max(held)
        gap_s, eta, generated = longest[0] / 1000, longest[1], longest[2]
        assert gap_s > 0.2, seen  # held for a while: the chats' guard leaves no room
        assert eta >= (400 - generated) * gap_s / (generated + 1), (longest, seen)
        assert eta > min(e for _, e, _ in held), seen
        nursery.cancel_scope.cancel()


async def test_a_request_in_flight_says_what_holds_it(autojump_clock: trio.abc.Clock) -> None:
    """``in_flight[].held``: why the last tick left a request out.  Beside three streaming
    chats on a machine where a prompt token costs more than their tick's headroom (the
    built-in CPU cost model), a background prompt is held by the budget; a second one, with
    no sequence free for it, by the queue; the chats by nothing.  Once the chats end, nothing
    holds the prompt."""
    from uma_trio.protocol.messages import GenerateRequest

    from .helpers import sim_daemon

    async def drain(stream: RequestStream) -> None:
        async for _ in stream.receive:
            pass

    async with sim_daemon(max_sessions=5) as server, trio.open_nursery() as nursery:
        chats = []
        for i in range(3):
            chat = GenerateRequest(id=f"chat{i}", prompt="hello " * 20, max_tokens=2000, stream=True)
            chats.append(await server.open_request(chat, trio.current_time(), connection=1))
            nursery.start_soon(drain, chats[-1])
        await trio.sleep(0.5)
        # The shortest background prompt is read first once there is room; the last one queues.
        for name, words in (("job", 1500), ("more", 3000), ("late", 600)):
            job = GenerateRequest(id=name, prompt="w " * words, max_tokens=4, priority="background")
            nursery.start_soon(drain, await server.open_request(job, trio.current_time(), connection=2))
            await trio.sleep(0.01)
        held: Counter[str | None] = Counter()
        for _ in range(20):
            await trio.sleep(0.05)
            rows = {row["id"]: row for row in server.loop.gauges()["in_flight"]}
            assert [rows[f"chat{i}"]["held"] for i in range(3)] == [None, None, None]
            assert rows["late"]["phase"] == "waiting" and rows["late"]["held"] == "queue"
            held[rows["job"]["held"]] += 1
        assert rows["job"]["phase"] == "prefill"
        assert held["budget"] >= 15, held  # served only by the odd rescue tick
        for stream in chats:
            stream.cancel("client")
        await trio.sleep(0.5)
        rows = {row["id"]: row for row in server.loop.gauges()["in_flight"]}
        assert rows["job"]["phase"] == "prefill" and rows["job"]["held"] is None
        nursery.cancel_scope.cancel()


async def test_an_idle_daemon_shows_its_whole_p95_headroom(autojump_clock: trio.abc.Clock) -> None:
    """The slack window counts ticks, so it keeps the last streams' overruns while nothing
    runs; a router reading headroom 0 from an idle daemon (until 400 more interactive ticks)
    would send it nothing."""
    from prometheus_client import generate_latest

    clients = [ClientSpec(name="chat", prompt_tokens=30, max_tokens=20)]
    result, server = await simulate(Scenario(name="idle", clients=clients), CostCoefficients())
    assert all(r.ok for r in result.records)
    for _ in range(server.loop.policy.slack.window):  # the window spent: every tick over the cap
        server.loop.policy.slack.record(over_cap=True)
    snapshot = server.metrics_snapshot()
    assert snapshot["scheduler"]["slack"]["used"] >= snapshot["scheduler"]["slack"]["budget"]
    assert not snapshot["sessions"]["active"] and not snapshot["sessions"]["waiting"]
    assert "uma_p95_headroom_ratio 1.0" in generate_latest(server.registry).decode()


async def test_an_idle_daemon_holds_no_prefill_and_its_ratios_carry_no_float_noise(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While idle the last tick's gauges read 0, the prefill guard's too (its hold counts
    ticks, so a hold from the last burst outlasts the idle spell in the policy's own state);
    a percentage of two decimals is a ratio of four, not 0.5085000000000001."""
    from prometheus_client import CollectorRegistry, generate_latest

    from uma_trio.observability.prometheus import SnapshotCollector

    clients = [ClientSpec(name="chat", prompt_tokens=30, max_tokens=20)]
    result, server = await simulate(Scenario(name="idle", clients=clients), CostCoefficients())
    assert all(r.ok for r in result.records)
    server.loop.policy.controls = replace(server.loop.policy.controls, hold_left=4)  # left from a burst
    snapshot = server.metrics_snapshot()
    assert snapshot["scheduler"]["prefill_guard_active"]
    snapshot["scorecard"]["cap_kept_pct"] = 50.85
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot))
    lines = generate_latest(registry).decode().splitlines()
    guard = [line for line in lines if line.startswith("uma_scheduler_prefill_guard_active{")]
    assert guard and all(line.endswith(" 0.0") for line in guard), guard
    assert "uma_scorecard_cap_kept_ratio 0.5085" in lines
