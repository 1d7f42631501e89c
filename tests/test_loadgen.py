"""The load generator: scenario parsing, stats arithmetic, prompt sizing, one real run."""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import llama_cpp as llama
import msgspec
import numpy as np
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.loadgen import (
    CONNECT_FAILED,
    TIMEOUT,
    ClientSpec,
    RequestRecord,
    Scenario,
    ScenarioResult,
    lane_stats,
    load_scenario,
    mixed_scenario,
    prompt_text,
    run_scenario,
    scenario_from_dict,
    summarize,
    to_csv_rows,
    worst_pause,
)
from uma_trio.loadgen.scenario import MAX_COPIES
from uma_trio.loadgen.stats import CSV_FIELDS, completion_time, gaps, tokens_per_s, ttft, window_gaps
from uma_trio.loadgen.targets import UmaTarget
from uma_trio.protocol.framing import FrameDecoder

from .conftest import running_server
from .helpers import frame, sim_daemon

# -- hand-made records ---------------------------------------------------------------

SCENARIO = Scenario(
    name="hand",
    clients=[
        ClientSpec(name="a", prompt_tokens=5, max_tokens=4),
        ClientSpec(name="b", prompt_tokens=5, max_tokens=2),
        ClientSpec(name="bg", lane="background", prompt_tokens=50, max_tokens=2, start_s=1.0),
    ],
)


def record(client: str, sent: float, tokens: list[float], ended: float | None, **kw: object) -> RequestRecord:
    spec = SCENARIO.client(client)
    fields: dict[str, object] = {"eos_reason": "length", "completion_tokens": len(tokens)} | kw
    return msgspec.convert(
        {"client": client, "lane": spec.lane, "index": 0, "sent": sent, "token_times": tokens, "ended": ended}
        | fields,
        RequestRecord,
    )


def hand_result() -> ScenarioResult:
    return ScenarioResult(
        scenario=SCENARIO,
        started=10.0,
        finished=14.0,
        records=[
            record("a", 10.0, [10.5, 10.6, 10.8, 11.1], 11.2),  # gaps 0.1 0.2 0.3
            record("b", 10.0, [10.4, 10.8], 10.9),  # gap 0.4
            record("bg", 11.0, [13.0, 13.5], 13.6),  # gap 0.5
        ],
    )


def test_gaps_exclude_the_first_token() -> None:
    a = hand_result().records[0]
    assert gaps(a) == pytest.approx([0.1, 0.2, 0.3])
    assert ttft(a) == pytest.approx(0.5)
    assert completion_time(a) == pytest.approx(1.2)
    empty = record("a", 0.0, [], None, eos_reason=None)
    assert gaps(empty).size == 0 and ttft(empty) is None and completion_time(empty) is None
    # No eos: completion falls back to the last token.
    assert completion_time(record("a", 0.0, [0.5, 0.7], None)) == pytest.approx(0.7)


def test_lane_stats_split_lanes_and_take_percentiles() -> None:
    stats = summarize(hand_result())
    assert set(stats) == {"interactive", "background"}
    inter, bg = stats["interactive"], stats["background"]
    assert (inter.requests, inter.completed, inter.failed, inter.tokens) == (2, 2, 0, 6)
    assert inter.gap_count == 4
    assert inter.gap_p50 == pytest.approx(0.25)
    assert inter.gap_p95 == pytest.approx(0.385)  # linear: 0.3 + 0.85 * (0.4 - 0.3)
    assert inter.gap_max == pytest.approx(0.4)
    assert inter.ttft == pytest.approx((0.5, 0.4))
    assert inter.completion == pytest.approx((1.2, 0.9))
    assert inter.ttft_max == pytest.approx(0.5) and inter.completion_p50 == pytest.approx(1.05)
    assert inter.tokens_per_s == pytest.approx(6 / 1.2)  # the lane's own span: 10.0 to 11.2
    assert (bg.requests, bg.tokens, bg.gap_count) == (1, 2, 1)
    assert bg.gap_p50 == bg.gap_max == pytest.approx(0.5)
    assert bg.ttft == pytest.approx((2.0,)) and bg.completion == pytest.approx((2.6,))
    assert bg.tokens_per_s == pytest.approx(2 / 2.6)
    assert tokens_per_s(hand_result()) == pytest.approx(8 / 3.6)  # all requests: 10.0 to 13.6


def test_all_lanes_tokens_per_s_leave_out_the_wait_before_the_first_send() -> None:
    """Clients that all start 2 s in: the `all` row counted those idle 2 s, and showed fewer
    tokens/s than its only lane."""
    result = hand_result()
    result.started = 8.0
    assert tokens_per_s(result) == pytest.approx(8 / 3.6)
    result.records = [r for r in result.records if r.lane == "interactive"]
    assert tokens_per_s(result) == pytest.approx(tokens_per_s(result, "interactive"))


def test_failures_and_empty_lanes() -> None:
    result = hand_result()
    result.records[1] = record("b", 10.0, [], 10.1, eos_reason=None, error_code="E_LIMIT_003")
    inter = lane_stats(result, "interactive")
    assert (inter.completed, inter.failed, inter.tokens) == (1, 1, 4)
    assert inter.ttft == pytest.approx((0.5,))  # no first token, no TTFT
    # Nor a completion: an instant refusal is no fast completion (three refusals showed a
    # completion p50 of 2 ms beside completed 0).
    assert inter.completion == pytest.approx((1.2,))
    result.records[0] = record("a", 10.0, [10.5], 10.6, eos_reason=None, error_code="CONNECTION_LOST")
    assert lane_stats(result, "interactive").completion == () and math.isnan(
        lane_stats(result, "interactive").completion_p50
    )
    result.records = [r for r in result.records if r.lane == "interactive"]
    assert set(summarize(result)) == {"interactive"}
    none = lane_stats(result, "background")
    assert none.requests == none.gap_count == 0 and math.isnan(none.gap_p95)


def test_window_gaps_and_worst_pause() -> None:
    records = hand_result().records
    # Gaps overlapping [10.65, 10.75]: a's 10.6→10.8 and b's 10.4→10.8.
    assert sorted(window_gaps(records, (10.65, 10.75))) == pytest.approx([0.2, 0.4])
    assert worst_pause(records, (10.65, 10.75)) == pytest.approx(0.4)
    # A gap that begins inside the window counts too: a's 10.8→11.1.
    assert worst_pause(records[:1], (10.9, 12.0)) == pytest.approx(0.3)
    assert worst_pause(records, (20.0, 21.0)) == 0.0
    inter = lane_stats(hand_result(), "interactive", window=(10.65, 10.75))
    assert inter.gap_count == 2 and inter.gap_max == pytest.approx(0.4)


def test_csv_rows_one_per_request() -> None:
    rows = to_csv_rows(hand_result())
    assert [r["client"] for r in rows] == ["a", "b", "bg"]
    assert all(list(r) == list(CSV_FIELDS) for r in rows)
    a, _, bg = rows
    assert a["ttft_ms"] == pytest.approx(500.0) and a["completion_ms"] == pytest.approx(1200.0)
    assert a["gap_p50_ms"] == pytest.approx(200.0) and a["gap_max_ms"] == pytest.approx(300.0)
    assert bg["sent_s"] == pytest.approx(1.0) and bg["lane"] == "background" and bg["tokens"] == 2


# -- scenarios -----------------------------------------------------------------------


def test_scenario_from_dict_fills_defaults() -> None:
    scenario = scenario_from_dict(
        {
            "name": "chain",
            "clients": [
                {"name": "agent", "prompt_tokens": 20, "max_tokens": 8, "requests": 3, "think_s": 0.5},
                {"name": "job", "lane": "background", "prompt_tokens": 500, "max_tokens": 4, "start_s": 2},
            ],
        }
    )
    agent, job = scenario.clients
    assert (agent.lane, agent.start_s, agent.requests, agent.think_s) == ("interactive", 0.0, 3, 0.5)
    assert (job.lane, job.start_s, job.requests) == ("background", 2.0, 1)
    request = job.request(0)
    assert request == {
        "id": "job-0", "prompt": prompt_text(500), "max_tokens": 4, "stream": True,
        "temperature": 0.0, "stop": [], "priority": "background",
    }  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 0, "max_tokens": 8}]},
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 5}]},
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 5, "max_tokens": 8, "lane": "bulk"}]},
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 5, "max_tokens": 8, "start_s": -1}]},
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 5, "max_tokens": 8, "colour": "red"}]},
        {"name": "x", "clients": []},
        {"name": "x", "clients": [{"name": "a", "prompt_tokens": 5, "max_tokens": 8}] * 2},
        {"name": "x", "clients": [{"name": "chat 1", "prompt_tokens": 5, "max_tokens": 8}]},  # no request id
    ],
    ids=[
        "zero-prompt",
        "missing-field",
        "bad-lane",
        "negative-start",
        "unknown-field",
        "no-clients",
        "dup",
        "name-with-space",
    ],
)
def test_bad_scenarios_are_rejected(bad: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        scenario_from_dict(bad)


def test_copies_are_bounded_and_many_load_fast() -> None:
    """1e9 copies ran out of memory, and the duplicate-name check was quadratic (20,000
    copies took 9 s to load)."""
    client = {"name": "a", "prompt_tokens": 4, "max_tokens": 4}
    for copies in (MAX_COPIES + 1, 10**9):
        with pytest.raises(msgspec.ValidationError, match="copies"):
            scenario_from_dict({"name": "x", "clients": [client | {"copies": copies}]})
    many = {"name": "x", "clients": [client | {"name": f"c{i}", "copies": MAX_COPIES} for i in range(8)]}
    began = time.perf_counter()
    scenario = scenario_from_dict(many)
    assert time.perf_counter() - began < 3.0  # ~0.1 s; quadratically ~25 s
    assert len(scenario.expanded().clients) == 8 * MAX_COPIES


def test_load_scenario_from_json(tmp_path: Path) -> None:
    path = tmp_path / "mixed.json"
    path.write_bytes(msgspec.json.encode(mixed_scenario(2000, 200)))
    assert load_scenario(path) == mixed_scenario(2000, 200)


def test_mixed_scenario_shape() -> None:
    base, mixed = mixed_scenario(None, 200), mixed_scenario(2000, 200)
    assert [c.lane for c in base.clients] == ["interactive"] * 3
    assert mixed.clients[:3] == base.clients
    bg = mixed.client("background")
    assert (bg.lane, bg.prompt_tokens, bg.max_tokens, bg.start_s) == ("background", 2000, 32, 2.0)
    assert all(c.max_tokens == 200 and c.prompt_tokens == 30 and c.requests > 1 for c in base.clients)


def test_prompt_text_counts_words() -> None:
    assert prompt_text(3) == "hello hello hello"
    assert len(prompt_text(2000).split()) == 2000
    with pytest.raises(ValueError):
        prompt_text(0)


# -- the real model and daemon -------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("n", [1, 2, 20, 30, 50, 2000])
def test_prompt_text_is_n_tokens_for_the_real_tokenizer(llama_model: LlamaModel, n: int) -> None:
    tokens = llama_model.tokenize(prompt_text(n))
    vocab = llama.llama_model_get_vocab(llama_model.handle)
    bos = 1 if llama.llama_vocab_get_add_bos(vocab) else 0
    if bos:
        assert int(tokens[0]) == llama.llama_vocab_bos(vocab)
    assert len(tokens) - bos == n


@pytest.mark.model
async def test_tiny_scenario_against_the_real_daemon(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    scenario = Scenario(
        name="tiny",
        clients=[
            ClientSpec(name="i0", prompt_tokens=20, max_tokens=8),
            ClientSpec(name="i1", prompt_tokens=20, max_tokens=8),
            ClientSpec(name="bg", lane="background", prompt_tokens=50, max_tokens=8),
        ],
    )
    async with running_server(llama_model, server_config) as server:
        with trio.fail_after(120):
            result = await run_scenario(server.config.socket_path, scenario)

    assert [(r.client, r.index) for r in result.records] == [("i0", 0), ("i1", 0), ("bg", 0)]
    for r in result.records:
        assert r.ok and r.eos_reason == "length" and r.error_code is None
        assert r.completion_tokens == 8 and len(r.token_times) == 8
        assert r.prompt_tokens == scenario.client(r.client).prompt_tokens  # prompt_text sized it
        assert result.started <= r.sent < r.token_times[0] and r.ended is not None
        assert r.token_times == sorted(r.token_times) and r.token_times[-1] <= r.ended <= result.finished
    stats = summarize(result)
    inter, bg = stats["interactive"], stats["background"]
    assert (inter.requests, inter.completed, inter.tokens, inter.gap_count) == (2, 2, 16, 14)
    assert (bg.requests, bg.completed, bg.tokens, bg.gap_count) == (1, 1, 8, 7)
    for lane in (inter, bg):
        assert 0 < lane.gap_p50 <= lane.gap_p95 <= lane.gap_max
        assert all(0 < t < c for t, c in zip(lane.ttft, lane.completion, strict=True))
        assert lane.tokens_per_s > 0
    all_gaps = np.concatenate([gaps(r) for r in result.records])
    assert (all_gaps > 0).all()
    first, last = min(r.sent for r in result.records), max(r.ended or 0.0 for r in result.records)
    assert tokens_per_s(result) == pytest.approx(24 / (last - first))  # from the first send
    assert len(to_csv_rows(result)) == 3


@pytest.mark.model
async def test_refused_requests_are_recorded_and_the_chain_goes_on(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    scenario = Scenario(
        name="refused", clients=[ClientSpec(name="c", prompt_tokens=5, max_tokens=8, requests=2)]
    )
    async with running_server(llama_model, server_config, max_tokens=4) as server:
        with trio.fail_after(60):
            result = await run_scenario(server.config.socket_path, scenario)
    assert [(r.index, r.error_code, r.eos_reason, r.token_times) for r in result.records] == [
        (0, "E_LIMIT_003", None, []),
        (1, "E_LIMIT_003", None, []),
    ]
    assert lane_stats(result, "interactive").failed == 2


# -- failures: connect, stall, refusal -----------------------------------------------


@asynccontextmanager
async def fake_daemon(handler: Callable[[trio.SocketStream], Awaitable[None]]) -> AsyncIterator[Path]:
    """A Unix socket served by ``handler`` (one task per connection): a daemon that misbehaves
    in ways the simulated one does not."""
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        path = Path(tmp) / "fake.sock"
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(path))
        sock.listen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, handler, [trio.SocketListener(sock)])
            yield path
            nursery.cancel_scope.cancel()


async def read_request_id(stream: trio.SocketStream) -> str:
    decoder = FrameDecoder(1 << 20)
    while True:
        for payload in decoder.feed(await stream.receive_some(65536)):
            return str(json.loads(payload)["id"])


CHAIN = scenario_from_dict({"name": "s", "clients": [{"name": "a", "prompt_tokens": 4, "max_tokens": 8,
                                                      "requests": 2}]})  # fmt: skip


async def test_a_client_that_cannot_connect_gets_a_failed_record_per_request(tmp_path: Path) -> None:
    """It raised out of the whole run: a bench lost every run already done."""
    scenario = scenario_from_dict(
        {"name": "s", "clients": [{"name": "a", "prompt_tokens": 4, "max_tokens": 8, "requests": 2},
                                  {"name": "b", "prompt_tokens": 4, "max_tokens": 8}]}
    )  # fmt: skip
    missing = tmp_path / "none.sock"
    result = await run_scenario(missing, scenario)
    assert [(r.client, r.index, r.error_code) for r in result.records] == [
        ("a", 0, CONNECT_FAILED), ("a", 1, CONNECT_FAILED), ("b", 0, CONNECT_FAILED),
    ]  # fmt: skip
    message = result.records[0].error_message or ""
    assert str(missing) in message and "uma-trio serve" in message  # which socket, and what to do
    assert lane_stats(result, "interactive").failed == 3


async def test_a_daemon_that_dies_mid_run_keeps_what_ran(autojump_clock: trio.abc.Clock) -> None:
    scenario = scenario_from_dict(
        {"name": "die", "clients": [{"name": "long", "prompt_tokens": 4, "max_tokens": 4000},
                                    {"name": "late", "prompt_tokens": 4, "max_tokens": 4, "start_s": 4}]}
    )  # fmt: skip
    async with sim_daemon() as server, trio.open_nursery() as nursery:

        async def die() -> None:
            await trio.sleep(2.0)
            server.request_shutdown(force=True)

        nursery.start_soon(die)
        result = await run_scenario(server.config.socket_path, scenario)
    long, late = result.records
    assert long.token_times and not long.ok  # what it streamed before the daemon went is kept
    assert (late.error_code, late.sent - result.started) == (CONNECT_FAILED, 4.0)
    assert str(server.config.socket_path) in (late.error_message or "")


async def silent(stream: trio.SocketStream) -> None:
    """Reads the request, never answers: a daemon stopped with SIGSTOP."""
    await read_request_id(stream)
    await trio.sleep_forever()


async def test_a_daemon_that_stops_answering_times_the_request_out(autojump_clock: trio.abc.Clock) -> None:
    """The bench hung forever on it.  The default is the HTTP target's 600 s; the chain stops
    there (its next request would wait as long)."""
    async with fake_daemon(silent) as path:
        with trio.fail_after(10_000):
            result = await run_scenario(path, CHAIN)
    (only,) = result.records
    assert only.error_code == TIMEOUT and only.ended is not None
    assert only.ended - only.sent == pytest.approx(600.0)


async def test_the_timeout_is_per_event(autojump_clock: trio.abc.Clock) -> None:
    async def slow_then_silent(stream: trio.SocketStream) -> None:
        request_id = await read_request_id(stream)
        for _ in range(3):  # each 4 s apart, within a 5 s timeout; the whole request is longer
            await trio.sleep(4.0)
            await stream.send_all(frame({"event": "token", "id": request_id, "text": "x", "token_id": 1}))
        await trio.sleep_forever()

    async with fake_daemon(slow_then_silent) as path:
        with trio.fail_after(10_000):
            result = await run_scenario(UmaTarget(path, timeout_s=5.0), CHAIN)
    (only,) = result.records
    assert [t - only.sent for t in only.token_times] == pytest.approx([4.0, 8.0, 12.0])
    assert only.error_code == TIMEOUT and only.ended == pytest.approx(only.token_times[-1] + 5.0)


async def test_a_connection_the_daemon_refused_records_its_code(autojump_clock: trio.abc.Clock) -> None:
    """Over --max-connections the daemon says E_LIMIT_006 and hangs up; when both came before
    the request was sent, the record said CONNECTION_LOST."""

    async def refuse(stream: trio.SocketStream) -> None:
        refusal = {"event": "error", "id": None, "code": "E_LIMIT_006", "message": "too many connections"}
        await stream.send_all(frame(refusal))
        await stream.aclose()

    spec = CHAIN.clients[0]
    async with fake_daemon(refuse) as path, UmaTarget(path).connect() as connection:
        await trio.sleep(1.0)  # the refusal and the hang-up are read before anything is sent
        rec = RequestRecord(client=spec.name, lane=spec.lane, index=0, sent=trio.current_time())
        assert not await connection.run(spec, 0, rec, trio.current_time, lambda: None)
    assert rec.error_code == "E_LIMIT_006"
