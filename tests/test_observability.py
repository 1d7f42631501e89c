"""The metrics recorder, its sliding window, the scorecard, Prometheus text and the views: pure,
no daemon and no model."""

from __future__ import annotations

import gc
from typing import Any

import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from uma_trio.observability.latency import GAMMA, LatencyDigest
from uma_trio.observability.metrics import Metrics
from uma_trio.observability.process import GC_PAUSES, ProcessSampler
from uma_trio.observability.prometheus import exposition
from uma_trio.observability.scorecard import scorecard
from uma_trio.observability.window import SlotWindow


def test_slot_window_keeps_the_last_window_and_drops_older_slots() -> None:
    window: SlotWindow[list[int]] = SlotWindow(list, window_s=10.0, slots=5)  # 2 s slots
    for t in range(30):
        window.at(float(t)).append(t)
    inside = sorted(v for slot in window.within(29.5) for v in slot)
    # The current slot (28-29) plus five whole ones (18-27): at least 10 s, at most 12 s.
    assert inside == list(range(18, 30))
    assert list(window.within(100.0)) == []
    with pytest.raises(ValueError):
        SlotWindow(list, window_s=0.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_latency_digest_quantiles_are_within_one_bucket_of_the_exact_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.lognormal(mean=np.log(0.010), sigma=0.6, size=5000)
    digest = LatencyDigest(window_s=60.0)
    for i, v in enumerate(values):
        digest.add(float(v), now=i * 0.01)  # 50 s: all inside the window
    for summary in (digest.run(), digest.window(50.0)):
        assert summary.count == len(values)
        assert summary.max == pytest.approx(values.max() * 1000, abs=1e-3)
        assert summary.mean == pytest.approx(values.mean() * 1000, abs=1e-3)  # rounded to µs
        for q, figure in ((50, summary.p50), (95, summary.p95), (99, summary.p99)):
            exact = np.percentile(values, q, method="lower") * 1000
            assert figure is not None
            assert abs(figure - exact) <= exact * (GAMMA - 1), (q, figure, exact)


def test_latency_digest_window_forgets_old_samples() -> None:
    digest = LatencyDigest(window_s=10.0)
    digest.add(1.0, now=0.0)  # a slow one, long ago
    for i in range(100):
        digest.add(0.010, now=20.0 + i * 0.05)
    assert digest.run().max == pytest.approx(1000.0)
    recent = digest.window(25.0)
    assert recent.count == 100 and recent.max == pytest.approx(10.0)
    assert digest.window(1000.0).count == 0 and digest.window(1000.0).p95 is None


def test_latency_digest_values_folded_late_land_in_the_slots_of_their_time() -> None:
    # Values wait to be folded into the sketches until a read or a full batch: the late fold
    # must still put each one in the window slot of its own time.
    digest = LatencyDigest(window_s=10.0)
    for i in range(300):  # past one batch: part folded on the way, part pending
        digest.add(0.5, now=i * 0.01)
    assert digest.window(2.0).count == 300
    for i in range(10):  # pending, 100 s after the first ones
        digest.add(0.002, now=100.0 + i * 0.01)
    recent = digest.window(100.5)
    assert recent.count == 10 and recent.max == pytest.approx(2.0)
    digest.add(0.004, now=200.0)
    assert digest.window(205.0).count == 1
    assert digest.run().count == 311 and digest.run().max == pytest.approx(500.0)


def _busy_metrics() -> Metrics:
    """60 s window; ticks every 10 ms from t=100 s to t=110 s, half of them over the cap."""
    metrics = Metrics(window_s=60.0, started=0.0)
    t = 100.0
    for i in range(1000):
        t += 0.010
        over = i % 2 == 1
        metrics.on_tick(
            t, step_s=0.009 if over else 0.007, overhead_s=0.001, decode_tokens=2, prefill_tokens=0,
            generated=2, bmt_bytes=100_000_000, cap_s=0.008,
        )  # fmt: skip
        metrics.on_generated("interactive")
        metrics.on_generated("interactive")
        metrics.on_token_latency("interactive", t, ttft_s=None, gap_s=0.010)
    metrics.on_finished("interactive", "length", t, computed_tokens=300)
    metrics.on_finished("background", "cancelled", t, computed_tokens=100, cancel_reason="client")
    return metrics


def test_scorecard_formulas() -> None:
    metrics = _busy_metrics()
    card = scorecard(metrics, 110.0, latency_cap=1.2, rss_bytes=2 * 10**9)
    assert card.window_s == 60.0
    assert card.tokens_per_s == pytest.approx(2000 / 60.0, rel=1e-3)
    assert card.tokens_per_s_at_cap == pytest.approx(1000 / 60.0, rel=1e-3)
    assert card.cap_kept_pct == 50.0
    assert card.scheduler_efficiency == 0.75  # 300 useful of 400 spent
    assert card.engine_idle_pct == pytest.approx(100 * 1.0 / (1.0 + 8.0), abs=0.01)
    assert card.sum_bmt_mb_per_token == 50.0  # 100 MB per tick, 2 tokens per tick
    assert card.p95_ms == pytest.approx(10.0, rel=0.01)
    assert card.rss_gb == 2.0
    # Ten minutes later the window is empty: nothing to measure is None, not 0 or a guess.
    later = scorecard(metrics, 700.0, latency_cap=1.2, rss_bytes=0)
    assert later.tokens_per_s == 0.0 and later.p95_ms is None and later.cap_kept_pct is None
    assert later.scheduler_efficiency is None and later.sum_bmt_mb_per_token is None
    # The log line says a missing figure as "-", without the unit it would have had.
    line = later.log_line()
    assert "cap kept -)" in line and "p95 - p99 -," in line and "ttft p95 -," in line, line
    assert "engine idle -," in line and "ΣBMT -," in line and "- ms" not in line and "-%" not in line, line
    assert "cap kept 50.0%" in card.log_line() and "p95 9.9 ms p99" in card.log_line()


def test_scorecard_rates_divide_by_the_time_the_window_really_covers() -> None:
    # 13 slots of 5 s (the current one and 12 whole): at these times the window starts at 35 s
    # and holds 60, 62.5 and 65 s of data, one token every 0.1 s.
    for now in (95.01, 97.5, 99.95):
        metrics = Metrics(window_s=60.0, started=0.0)
        for i in range(int(now * 10) + 1):
            metrics.on_tick(
                i * 0.1, step_s=0.01, overhead_s=0.0, decode_tokens=1, prefill_tokens=0, generated=1,
                bmt_bytes=0, cap_s=0.0,
            )  # fmt: skip
        card = scorecard(metrics, now, latency_cap=1.2, rss_bytes=0)
        assert card.window_s == pytest.approx(now - 35.0, abs=1e-3)
        assert card.tokens_per_s == pytest.approx(10.0, rel=0.01)


def test_scorecard_right_after_start_divides_by_the_uptime() -> None:
    metrics = Metrics(window_s=60.0, started=100.0)
    metrics.on_tick(
        105.0, step_s=0.01, overhead_s=0.0, decode_tokens=1, prefill_tokens=0, generated=50,
        bmt_bytes=0, cap_s=0.0,
    )  # fmt: skip
    card = scorecard(metrics, 110.0, latency_cap=1.2, rss_bytes=0)
    assert card.window_s == 10.0 and card.tokens_per_s == 5.0
    assert card.tokens_per_s_at_cap == 5.0  # no interactive stream: no cap to break
    assert card.cap_kept_pct is None and card.sum_bmt_mb_per_token is None


def test_counters_snapshot() -> None:
    metrics = _busy_metrics()
    metrics.on_submitted("background", 123)
    metrics.on_error("E_PROTO_001")
    snap = metrics.snapshot(110.0)
    assert snap["requests"] == {"interactive": {"length": 1}, "background": {"cancelled": 1}}
    assert snap["cancels"] == {"client": 1}
    assert snap["errors"] == {"E_PROTO_001": 1}
    assert snap["tokens"]["prompt"] == {"interactive": 0, "background": 123}
    assert snap["tokens"]["generated"] == {"interactive": 2000, "background": 0}
    assert snap["ticks"] == 1000 and snap["batch_tokens"] == {"decode": 2000, "prefill": 0}
    itl = snap["latency"]["window"]["interactive"]["itl_ms"]
    assert itl["count"] == 1000 and itl["p50"] == pytest.approx(10.0, rel=0.01)


def test_histograms_in_the_exposition_match_the_recorded_samples() -> None:
    metrics = _busy_metrics()
    families = {f.name: f for f in text_string_to_metric_families(exposition(metrics.registry).decode())}
    itl = families["uma_inter_token_latency_seconds"]
    assert itl.type == "histogram"
    samples = {
        (s.name, s.labels.get("le")): s.value for s in itl.samples if s.labels["lane"] == "interactive"
    }
    assert samples[("uma_inter_token_latency_seconds_count", None)] == 1000
    assert samples[("uma_inter_token_latency_seconds_bucket", "0.0075")] == 0
    assert samples[("uma_inter_token_latency_seconds_bucket", "0.01")] == 1000
    tick = {
        s.labels.get("le"): s.value for s in families["uma_tick_duration_seconds"].samples if "le" in s.labels
    }
    assert tick["0.0075"] == 500 and tick["0.01"] == 1000  # 7 ms and 9 ms ticks, half each


def test_views_render_a_snapshot() -> None:
    from uma_trio.observability.views import dashboard, report

    metrics = _busy_metrics()
    snapshot: dict[str, Any] = metrics.snapshot(110.0)
    snapshot.update(
        model="m.gguf",
        sessions={"active": 1, "waiting": 0, "prefilling": 0, "decoding": 1, "parked": 0},
        kv={"cells_used": 10, "cells_total": 100},
        process={"rss_bytes": 2**30, "open_fds": 12, "gc_pause_max_ms": 31.25},
        scorecard=msgspec.to_builtins(scorecard(metrics, 110.0, latency_cap=1.2, rss_bytes=2**30)),
        in_flight=[
            {"id": "chat-7", "connection": 3, "lane": "background", "phase": "decode", "parked": True,
             "prompt_tokens": 20, "prefilled": 20, "generated": 5, "max_tokens": 40, "age_ms": 1500.0,
             "gap_ms": 12.5},
            {"id": "job-2", "connection": 4, "lane": "background", "phase": "prefill", "parked": False,
             "prompt_tokens": 900, "prefilled": 12, "generated": 0, "max_tokens": 8, "age_ms": 800.0,
             "gap_ms": 800.0, "held": "budget"},
        ],
    )  # fmt: skip
    console = Console(record=True, width=140)
    console.print(dashboard(snapshot))
    screen = console.export_text()
    assert "chat-7" in screen and "decode (parked)" in screen and "5/40" in screen
    assert "prefill (budget)" in screen and "12/900" in screen
    assert "token gap" in screen and "scorecard" in screen and "1,024 MiB" in screen
    assert "GC pause max 31.2 ms" in screen
    console.print(report(snapshot))
    assert "counters (whole run)" in console.export_text()


def test_views_print_a_clients_id_as_it_is_and_each_rows_model() -> None:
    """An id is the client's: "[/b]" once raised rich's MarkupError in top and metrics for
    every operator, and "[red]x" was restyled."""
    from uma_trio.observability.views import sessions_table

    row = {"connection": 1, "lane": "interactive", "phase": "decode", "parked": False, "prompt_tokens": 3,
           "prefilled": 3, "generated": 1, "max_tokens": 9, "age_ms": 10.0, "gap_ms": 1.0}  # fmt: skip
    ids = ("[/b]", "[red]x", "a[b]c")
    in_flight = [{**row, "id": i, "model": "smol"} for i in ids]
    console = Console(record=True, width=140)
    console.print(sessions_table({"in_flight": in_flight}))
    screen = console.export_text()
    assert all(i in screen for i in ids) and "model" not in screen  # one model: no column
    in_flight[0]["model"] = "second"
    console.print(sessions_table({"in_flight": in_flight}))
    assert "model" in (screen := console.export_text()) and "second" in screen


def test_gc_pauses_count_every_collection_and_how_long_it_held_the_gil() -> None:
    ProcessSampler()
    sampler = ProcessSampler()
    before = sampler.sample()
    cycles = []
    for _ in range(50_000):  # objects in cycles: a full collection has work to do
        node: dict[str, Any] = {}
        node["self"] = node
        cycles.append(node)
    del cycles
    gc.collect()
    gc.collect(0)
    after = sampler.sample()
    assert after.gc_collections >= before.gc_collections + 2
    assert after.gc_full >= before.gc_full + 1
    assert after.gc_pause_s > before.gc_pause_s
    assert 0 < after.gc_pause_max_ms <= after.gc_pause_s * 1000.0 + 1e-3
    assert gc.callbacks.count(GC_PAUSES._on_gc) == 1  # a second sampler did not add another
