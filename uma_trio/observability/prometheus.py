"""Prometheus text exposition of the metrics snapshot (``prometheus_client``).

Latency histograms are live ``prometheus_client`` histograms kept by
:class:`~.metrics.Metrics`; process figures come from its standard
``ProcessCollector``.  Everything else is read from the same JSON snapshot the
socket's ``metrics`` request returns, by :class:`SnapshotCollector`, so the two
views never disagree.  Names follow Prometheus conventions: base units
(seconds, bytes, ratios), ``_total`` for counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import LANES

# `_created` series are an OpenMetrics idea; in the classic text format they show up as
# stray gauges.  Process-wide, and this process is the daemon.
disable_created_metrics()  # type: ignore[no-untyped-call]

MS = 1e-3

Snapshot = Callable[[], dict[str, Any]]


def _counter(
    name: str, doc: str, labels: list[str], rows: dict[Any, Any] | int | float
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    if isinstance(rows, dict):
        for key, value in sorted(rows.items()):
            family.add_metric(list(key) if isinstance(key, tuple) else [str(key)], value)
    else:
        family.add_metric([], rows)
    return family


def _gauge(name: str, doc: str, labels: list[str], rows: dict[Any, Any]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in sorted(rows.items()):
        if value is not None:
            family.add_metric(list(key) if isinstance(key, tuple) else ([str(key)] if labels else []), value)
    return family


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        requests = {(lane, outcome): n for lane, by in snap["requests"].items() for outcome, n in by.items()}
        yield _counter("uma_requests", "Requests ended, by lane and outcome", ["lane", "outcome"], requests)
        yield _counter("uma_cancels", "Requests cancelled, by cause", ["reason"], snap["cancels"])
        yield _counter("uma_errors", "Error events sent, by code", ["code"], snap["errors"])
        yield _counter("uma_prompt_tokens", "Prompt tokens accepted", ["lane"], snap["tokens"]["prompt"])
        yield _counter("uma_generated_tokens", "Tokens generated", ["lane"], snap["tokens"]["generated"])
        yield _counter("uma_ticks", "Engine steps run", [], snap["ticks"])
        yield _counter("uma_batch_tokens", "Tokens fed to the engine", ["kind"], snap["batch_tokens"])
        yield _counter("uma_engine_busy_seconds", "Seconds inside engine steps", [], snap["decode_s_total"])
        yield _counter("uma_connections", "Socket connections accepted", [], snap["connections"]["total"])
        yield _counter("uma_lane_changes", "Priority messages that moved a request", [], snap["lane_changes"])
        rebuilds = snap["context_rebuilds"]
        yield _counter("uma_context_rebuilds", "Contexts replaced after a failed decode", [], rebuilds)

        yield from self._engine(snap.get("engine") or {})
        open_now = {"": snap["connections"]["open"]}
        yield _gauge("uma_connections_open", "Socket connections open now", [], open_now)
        yield _gauge("uma_sessions", "Requests by state", ["state"], snap["sessions"])
        kv = snap["kv"]
        yield _gauge(
            "uma_kv_cells", "KV cache cells", ["kind"],
            {k: kv[f"cells_{k}"] for k in ("total", "used", "reserved", "per_seq")},
        )  # fmt: skip
        yield _gauge(
            "uma_kv_seqs", "KV sequence ids", ["kind"], {"total": kv["seqs_total"], "free": kv["seqs_free"]}
        )
        cache = snap["prefix_cache"]
        yield _counter(
            "uma_prefix_cache_lookups", "Admitted requests, by prefix-cache result", ["result"],
            {"hit": cache["hits"], "miss": cache["misses"]},
        )  # fmt: skip
        yield _counter("uma_prefix_cache_reused_tokens", "Prompt tokens reused", [], cache["reused_tokens"])
        yield _counter("uma_prefix_cache_evictions", "Cached prefixes evicted", [], cache["evictions"])
        yield _counter(
            "uma_prefix_cache_moves", "Cached prefixes moved to keep running sequence ids together", [],
            cache["moves"],
        )  # fmt: skip
        yield _gauge(
            "uma_prefix_cache_held", "What the prefix cache holds now", ["kind"],
            {"cells": cache["cells"], "sequences": cache["sequences"]},
        )  # fmt: skip
        loops = _loops(snap)  # read once: the scheduler's series and the router's headroom
        yield from self._scheduler(loops)
        yield from self._garbage_collector(snap["process"])
        yield from self._router(snap, loops)
        yield from self._window_quantiles(snap["latency"]["window"])
        yield from self._scorecard(snap["scorecard"])

    def _engine(self, e: dict[str, Any]) -> Iterator[Metric]:
        """What the engine runs on: one info row, the layers on a GPU, the KV bytes, the
        per-step overhead (docs/METRICS.md "engine")."""
        if "gpu_layers" not in e:  # a simulated engine
            return
        gpus = [d for d in e["devices"] if d["kind"] in ("GPU", "IGPU")]
        info = {
            "backend": "/".join(e["backends"]),
            "device": ", ".join(f"{d['name']} {d['description']}" for d in gpus) or "CPU",
            "kv_location": e["kv"]["location"], "kv_type": e["kv"]["type"], "flash_attn": e["flash_attn"],
            "mode": "deterministic" if e["settings"]["deterministic"] else "fast",
            "n_ubatch": str(e["settings"]["n_ubatch"]),
        }  # fmt: skip
        yield _gauge("uma_engine_info", "The engine's backend, devices and settings", list(info), {
            tuple(info.values()): 1})  # fmt: skip
        layers = e["gpu_layers"]
        yield _gauge("uma_engine_gpu_layers", "Model layers", ["kind"], {
            "offloaded": layers["offloaded"], "total": layers["total"]})  # fmt: skip
        yield _gauge("uma_engine_kv_bytes", "Bytes of the KV cache", [], {"": e["kv"]["bytes"]})
        steps = e.get("step_overhead") or {}
        if steps:
            yield _gauge(
                "uma_engine_step_gap_seconds", "Mean time from a step's results to the next decode", [],
                {"": _seconds(steps["gap_ms_mean"])},
            )  # fmt: skip
            yield _gauge("uma_engine_step_gap_ratio", "Step gap over step time", [], {"": steps["gap_share"]})

    def _garbage_collector(self, process: dict[str, Any]) -> Iterator[Metric]:
        """The cyclic collector's pauses, which stall every stream at once (process.GcPauses)."""
        young = process["gc_collections"] - process["gc_full"]
        yield _counter(
            "uma_gc_collections",
            "Cyclic garbage collections",
            ["kind"],
            {"full": process["gc_full"], "young": young},
        )
        yield _counter(
            "uma_gc_pause_seconds", "Seconds the garbage collector held the GIL", [], process["gc_pause_s"]
        )
        yield _gauge(
            "uma_gc_pause_max_seconds",
            "The longest garbage-collector pause",
            [],
            {"": _seconds(process["gc_pause_max_ms"])},
        )

    def _router(
        self, snap: dict[str, Any], loops: dict[str, tuple[dict[str, Any], bool]]
    ) -> Iterator[Metric]:
        """What a router in front of several daemons reads (docs/FLEET.md): the Gateway API
        Inference Extension's endpoint picker takes the first three by name."""
        sessions, kv = snap["sessions"], snap["kv"]
        yield _gauge(
            "uma_num_requests_waiting", "Requests queued for a sequence", [], {"": sessions["waiting"]}
        )
        yield _gauge("uma_num_requests_running", "Requests holding a sequence", [], {"": sessions["active"]})
        # Cells running requests have reserved (prompt + max_tokens), of all: cached prefixes
        # are evictable and do not count.
        kv = snap.get("kv_loaded", kv)  # every loaded model's (runtime/loop_gauges.py)
        usage = kv["cells_reserved"] / kv["cells_total"] if kv["cells_total"] else 0.0
        yield _gauge(
            "uma_kv_cache_usage_ratio", "KV cache share reserved by running requests, 0-1", [], {"": usage}
        )
        # 1: no recent interactive tick ran past the latency cap; 0: the p95 slack is spent.
        # The window counts ticks, so it keeps the last streams' overruns while nothing runs:
        # an idle daemon has all its headroom (a request's first tick beside no stream spends
        # none), and once read 0 until 400 interactive ticks had run.
        # With several models, the least any busy one has left: they share the machine.
        headroom = min((_headroom(s["slack"], idle) for s, idle in loops.values()), default=1.0)
        yield _gauge(
            "uma_p95_headroom_ratio",
            "Share of the p95 slack not spent (1: all of it left)",
            [],
            {"": headroom},
        )
        models = {(m["id"], m["state"]): 1 for m in snap.get("models", [])}
        yield _gauge("uma_model", "The daemon's models, by state", ["model", "state"], models)

    def _scheduler(self, loops: dict[str, tuple[dict[str, Any], bool]]) -> Iterator[Metric]:
        """Each loaded model's scheduler, labelled by ``model``: ``loops`` maps a model id to
        its policy snapshot and whether its loop is idle (nothing runs or waits).  An idle
        loop's last-tick figures (its time, prediction, tokens, decoders, ΣBMT estimate) read
        0: the policy keeps the last busy tick's, which would otherwise stand for ever (the
        JSON snapshot keeps them)."""
        rows: dict[str, dict[Any, Any]] = {}

        def put(name: str, key: Any, value: Any) -> None:
            rows.setdefault(name, {})[key] = value

        for model, (s, idle) in loops.items():
            kinds = {
                "last": 0.0 if idle else _seconds(s["decode_ms_last"]), "ewma": _seconds(s["decode_ms_ewma"]),
                "budget": _seconds(s["budget_ms_last"]),
                "predicted": 0.0 if idle else _seconds(s["predicted_ms_last"]),
            }  # fmt: skip
            for kind, value in kinds.items():
                put("tick", (model, kind), value)
            for kind, n in s["tokens_per_tick"].items():
                put("tokens", (model, kind), 0 if idle else n)
            put("decoders", (model,), 0 if idle else s["served_decoders"])
            put("guard", (model,), 0 if idle else int(s["prefill_guard_active"]))
            put("over", (model,), s["ticks_over_budget"])
            put("rescue", (model,), s["rescue_ticks"])
            put("preempted", (model,), s["preempted_ticks"])
            put("slack", (model,), s["slack"]["used"])
            put("bmt", (model, "estimate"), 0 if idle else s["bmt_estimate_last"])
            put("bmt", (model, "budget"), s["bmt_budget"])
        by = ["model"]
        yield _gauge(
            "uma_scheduler_tick_seconds", "Last tick: measured, budget, predicted, smoothed", [*by, "kind"],
            rows.get("tick", {}),
        )  # fmt: skip
        yield _gauge(
            "uma_scheduler_tokens_per_tick", "Tokens in the last tick (0 while idle)", [*by, "kind"],
            rows.get("tokens", {}),
        )  # fmt: skip
        yield _gauge(
            "uma_scheduler_served_decoders",
            "Decoders in the last tick (0 while idle)",
            by,
            rows.get("decoders", {}),
        )
        yield _gauge(
            "uma_scheduler_prefill_guard_active",
            "1 while background prefill is held or ramping (0 while idle)",
            by,
            rows.get("guard", {}),
        )  # fmt: skip
        yield _counter(
            "uma_scheduler_ticks_over_budget", "Ticks over budget × 1.25", by, rows.get("over", {})
        )
        yield _counter(
            "uma_scheduler_rescue_ticks", "Ticks that served a starving session", by, rows.get("rescue", {})
        )
        yield _counter(
            "uma_scheduler_preempted_ticks", "Steps stopped midway for an arriving interactive request",
            by, rows.get("preempted", {}),
        )  # fmt: skip
        yield _gauge(
            "uma_scheduler_slack_used", "Share of the recent interactive ticks that ran past the cap",
            by, rows.get("slack", {}),
        )  # fmt: skip
        yield _gauge(
            "uma_scheduler_bmt_bytes", "Last tick's ΣBMT estimate and the guard's budget", [*by, "kind"],
            rows.get("bmt", {}),
        )  # fmt: skip

    def _window_quantiles(self, window: dict[str, Any]) -> Iterator[Metric]:
        names = {
            "queue_ms": "uma_queue_wait_window_seconds",
            "ttft_ms": "uma_time_to_first_token_window_seconds",
            "itl_ms": "uma_inter_token_latency_window_seconds",
            "e2e_ms": "uma_request_duration_window_seconds",
        }
        for key, name in names.items():
            rows = {
                (lane, quantile): _seconds(window[lane][key][q])
                for lane in LANES
                for q, quantile in _QUANTILES.items()
                if window[lane][key][q] is not None
            }
            yield _gauge(name, f"{key[:-3]} over the sliding window, by quantile", ["lane", "quantile"], rows)

    def _scorecard(self, card: dict[str, Any]) -> Iterator[Metric]:
        pct = 0.01
        rows: dict[str, tuple[str, float | None]] = {
            "uma_scorecard_tokens_per_second": ("Generated tokens/s over the window", card["tokens_per_s"]),
            "uma_scorecard_tokens_at_cap_per_second": (
                "Generated tokens/s of ticks that kept the latency cap",
                card["tokens_per_s_at_cap"],
            ),
            "uma_scorecard_latency_cap": ("Configured latency cap (× baseline tick)", card["latency_cap"]),
            "uma_scorecard_cap_kept_ratio": (
                "Capped ticks that kept the cap",
                _scale(card["cap_kept_pct"], pct),
            ),
            "uma_scorecard_scheduler_efficiency_ratio": (
                "Useful batch tokens / batch tokens spent",
                card["scheduler_efficiency"],
            ),
            "uma_scorecard_engine_idle_ratio": (
                "Engine idle between back-to-back steps",
                _scale(card["engine_idle_pct"], pct),
            ),
            "uma_scorecard_bmt_per_token_bytes": (
                "Estimated bytes moved per generated token",
                _scale(card["sum_bmt_mb_per_token"], 1e6),
            ),
        }
        for name, (doc, value) in rows.items():
            yield _gauge(name, doc, [], {"": value})


def _seconds(ms: float) -> float:
    return round(ms * MS, 9)  # ms figures are rounded to µs; keep the text free of float noise


_QUANTILES = {"p50": "0.5", "p95": "0.95", "p99": "0.99", "max": "1"}


def _scale(value: float | None, factor: float) -> float | None:
    # Rounded to the digits the figure had (a percentage of 2 decimals is a ratio of 4), not
    # the binary noise of the product (0.5085000000000001).
    return None if value is None else round(value * factor, 12)


def build_registry(registry: CollectorRegistry, snapshot: Snapshot) -> CollectorRegistry:
    """Add the snapshot and process collectors to the registry holding the histograms."""
    registry.register(SnapshotCollector(snapshot))
    ProcessCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def _loops(snap: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """Each loaded model's scheduler snapshot and whether its loop is idle, by model id
    (``by_model``, runtime/loop_gauges.py); a snapshot without it is the one model's."""
    by_model = snap.get("by_model")
    if not by_model:
        sessions = snap["sessions"]
        return {
            snap.get("model", ""): (snap["scheduler"], not sessions["active"] and not sessions["waiting"])
        }
    return {model: (m["scheduler"], m["idle"]) for model, m in by_model.items()}


def _headroom(slack: dict[str, Any], idle: bool) -> float:
    """1: no recent interactive tick ran past the latency cap; 0: the p95 slack is spent."""
    if idle:
        return 1.0
    return max(0.0, 1.0 - slack["used"] / slack["budget"]) if slack["budget"] else 0.0
