"""Two review findings on the metrics: the last tick's Prometheus gauges of an idle daemon read
0 (not its last busy tick for ever), and an embedding is counted as ``embedded``, its time kept
out of the generation latencies."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from uma_trio.observability.metrics import OUTCOMES, Metrics
from uma_trio.observability.prometheus import build_registry, exposition
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.runtime.delivery import deliver

from .helpers import sim_daemon

LAST_TICK = (  # labels besides the model's
    ("uma_scheduler_served_decoders", ()),
    ("uma_scheduler_tokens_per_tick", (("kind", "decode"),)),
    ("uma_scheduler_tick_seconds", (("kind", "last"),)),
    ("uma_scheduler_tick_seconds", (("kind", "predicted"),)),
    ("uma_scheduler_bmt_bytes", (("kind", "estimate"),)),
)


def _of(model: str, key: tuple[str, tuple[tuple[str, str], ...]]) -> tuple[str, tuple[tuple[str, str], ...]]:
    name, labels = key
    return name, tuple(sorted((*labels, ("model", model))))


def _scrape(snapshot: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = exposition(build_registry(CollectorRegistry(), lambda: snapshot)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def _generate(server: Any, request: GenerateRequest) -> list[Any]:
    stream = await server.open_request(request, trio.current_time(), connection=1)
    async with aclosing(deliver(server, stream)) as events:
        return [event async for event in events]


async def test_last_tick_gauges_read_zero_while_nothing_runs(autojump_clock: trio.abc.Clock) -> None:
    async with sim_daemon() as server:
        await _generate(server, GenerateRequest(id="a", prompt="hello " * 20, max_tokens=8))
        await trio.sleep(5.0)
        idle = server.metrics_snapshot()
    assert idle["sessions"]["active"] == 0 and idle["sessions"]["waiting"] == 0
    assert idle["scheduler"]["served_decoders"] > 0 and idle["scheduler"]["decode_ms_last"] > 0  # kept
    samples = _scrape(idle)
    model = next(iter(idle["by_model"]))
    for key in LAST_TICK:
        assert samples[_of(model, key)] == 0.0, key
    assert samples[_of(model, ("uma_scheduler_tick_seconds", (("kind", "ewma"),)))] > 0  # smoothed: kept

    # The same figures while a request runs (or waits): the last tick's, as before.
    busy = {**idle, "by_model": {m: {**v, "idle": False} for m, v in idle["by_model"].items()}}
    samples = _scrape(busy)
    scheduler = idle["scheduler"]
    assert samples[_of(model, LAST_TICK[0])] == scheduler["served_decoders"]
    assert samples[_of(model, LAST_TICK[1])] == scheduler["tokens_per_tick"]["decode"]
    assert samples[_of(model, LAST_TICK[2])] == pytest.approx(scheduler["decode_ms_last"] / 1000)
    assert samples[_of(model, LAST_TICK[3])] == pytest.approx(scheduler["predicted_ms_last"] / 1000)


async def test_the_routers_headroom_is_the_least_any_busy_model_has(autojump_clock: trio.abc.Clock) -> None:
    """With several models the headroom read the primary's slack alone: a second model whose
    streams had spent theirs showed a router all of it left while the primary sat idle."""
    async with sim_daemon() as server:
        snap = server.metrics_snapshot()
    primary = next(iter(snap["by_model"]))
    spent = {**snap["scheduler"], "slack": {**snap["scheduler"]["slack"], "used": 0.05, "budget": 0.05}}
    snap["by_model"] = {
        primary: {"scheduler": snap["scheduler"], "idle": True},
        "b": {"scheduler": spent, "idle": False},
    }
    samples = _scrape(snap)
    assert samples[("uma_p95_headroom_ratio", ())] == 0.0
    snap["by_model"]["b"]["idle"] = True
    assert _scrape(snap)[("uma_p95_headroom_ratio", ())] == 1.0


def test_an_embedding_counts_as_embedded_and_not_as_a_request_duration() -> None:
    metrics = Metrics()
    assert "embedded" in OUTCOMES
    metrics.on_finished("interactive", "stop", 1.0, computed_tokens=7, embed=True)
    metrics.on_completed("interactive", 0.004, 1.0, embed=True)
    metrics.on_finished("interactive", "cancelled", 1.0, computed_tokens=3, embed=True)  # not embedded
    metrics.on_finished("interactive", "stop", 2.0, computed_tokens=9)
    metrics.on_completed("interactive", 0.5, 2.0)
    snapshot = metrics.snapshot(3.0)
    assert snapshot["requests"]["interactive"] == {"embedded": 1, "cancelled": 1, "stop": 1}
    e2e = snapshot["latency"]["run"]["interactive"]["e2e_ms"]
    assert e2e["count"] == 1 and e2e["max"] == pytest.approx(500.0)
    assert metrics.window_sums(3.0).useful_tokens == 16  # an embedding's work is not waste
    text = exposition(metrics.registry).decode()
    durations = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "uma_request_duration_seconds"
        for s in family.samples
        if s.labels.get("lane") == "interactive"
    }
    assert durations["uma_request_duration_seconds_count"] == 1


async def test_an_embed_request_leaves_the_generation_latencies_alone(autojump_clock: trio.abc.Clock) -> None:
    """Through a daemon on the simulated engine: the embedding's few milliseconds are in no
    request-duration, TTFT or token-gap figure."""
    async with sim_daemon() as server:
        events = await _generate(server, GenerateRequest(id="e", prompt="embed this text", embed=True))
        snapshot = server.metrics_snapshot()
    assert events[-1].reason == "stop" and events[-1].embedding
    for scope in ("run", "window"):
        lane = snapshot["latency"][scope]["interactive"]
        assert lane["e2e_ms"]["count"] == 0 and lane["ttft_ms"]["count"] == 0 and lane["itl_ms"]["count"] == 0


async def test_an_embed_request_is_counted_as_embedded(autojump_clock: trio.abc.Clock) -> None:
    async with sim_daemon() as server:
        await _generate(server, GenerateRequest(id="e", prompt="embed this text", embed=True))
        snapshot = server.metrics_snapshot()
    assert snapshot["requests"]["interactive"] == {"embedded": 1}
