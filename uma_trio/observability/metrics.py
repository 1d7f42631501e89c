"""What the runtime records: counters, latency distributions, and per-window sums.

The decode and connection tasks call the ``on_*`` methods with the time of
the event; nothing here reads a clock or does I/O, so a simulation under
trio's mock clock gives exact figures.  Every latency goes to two places: a
:class:`~.latency.LatencyDigest` (quantiles, run and sliding window) and a
Prometheus histogram (fixed buckets, for scrapers).  docs/METRICS.md lists
every figure and how it is computed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import msgspec
from prometheus_client import CollectorRegistry, Histogram

from ..protocol.messages import CancelReason, FinishReason, Lane
from .latency import LatencyDigest, Percentiles
from .window import SlotWindow

LANES: tuple[Lane, ...] = get_args(Lane)
# How a request ended, as counted: its eos reason, except that an embedding request that got
# its embedding is ``embedded``, not ``stop``; it generated nothing, so its few milliseconds
# stay out of the request-duration, TTFT and token-gap figures too.
Outcome = FinishReason | Literal["embedded"]
OUTCOMES: tuple[Outcome, ...] = (*get_args(FinishReason), "embedded")

# Prometheus buckets (seconds).  Token gaps and ticks live in 5-100 ms here; TTFT and
# request times reach seconds when a long prompt is prefilled at ~300 tokens/s.
GAP_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.25, 0.5, 1.0, 2.5)  # fmt: skip
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


@dataclass
class WindowSums:
    """Additive figures of one window slot (or of a whole window, once summed)."""

    generated: int = 0  # tokens sent to clients
    generated_at_cap: int = 0  # ... by ticks that kept the latency cap (or had none)
    capped_ticks: int = 0  # ticks with an interactive stream decoding
    kept_cap_ticks: int = 0  # ... whose step took at most latency_cap × baseline
    bmt_bytes: int = 0  # estimated bytes the ticks moved (ΣBMT)
    busy_s: float = 0.0  # time inside engine steps
    overhead_s: float = 0.0  # time between back-to-back steps (scheduling, I/O, Python)
    computed_tokens: int = 0  # batch tokens spent on requests that ended in the window
    useful_tokens: int = 0  # ... on those that ended with stop or length

    def add(self, other: WindowSums) -> None:
        for name in _WINDOW_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_WINDOW_FIELDS = tuple(f.name for f in fields(WindowSums))


class LaneLatency:
    """The four per-request latencies of one lane."""

    KINDS = ("queue", "ttft", "itl", "e2e")

    def __init__(self, window_s: float) -> None:
        self.queue = LatencyDigest(window_s)  # arrival → admitted to a session slot
        self.ttft = LatencyDigest(window_s)  # arrival → first token
        self.itl = LatencyDigest(window_s)  # between consecutive tokens of a request
        self.e2e = LatencyDigest(window_s)  # arrival → eos

    def summary(self, now: float | None) -> dict[str, Percentiles]:
        digests: dict[str, LatencyDigest] = {kind: getattr(self, kind) for kind in self.KINDS}
        return {
            f"{kind}_ms": digest.run() if now is None else digest.window(now)
            for kind, digest in digests.items()
        }


class Metrics:
    def __init__(self, window_s: float = 60.0, started: float = 0.0) -> None:
        self.window_s = window_s
        self.started = started
        self.requests: dict[Lane, Counter[Outcome]] = {lane: Counter() for lane in LANES}
        self.cancels: Counter[CancelReason] = Counter()
        self.errors: Counter[str] = Counter()  # error events sent, by code
        self.tokens_prompt: Counter[Lane] = Counter()
        self.tokens_generated: Counter[Lane] = Counter()
        self.ticks = 0
        self.batch_tokens: Counter[str] = Counter()  # "decode" / "prefill"
        self.decode_s_total = 0.0
        self.connections_open = 0
        self.connections_total = 0
        self.lane_changes = 0
        self.context_rebuilds = 0  # contexts replaced after a failure that left them in doubt
        self.latency = {lane: LaneLatency(window_s) for lane in LANES}
        self.tick_time = LatencyDigest(window_s)
        self._sums: SlotWindow[WindowSums] = SlotWindow(WindowSums, window_s)

        self.registry = CollectorRegistry()
        self._histograms = {
            kind: Histogram(
                f"uma_{name}_seconds", doc, ["lane"], registry=self.registry,
                buckets=GAP_BUCKETS if kind == "itl" else REQUEST_BUCKETS,
            )
            for kind, name, doc in (
                ("queue", "queue_wait", "Arrival to admission into a session slot"),
                ("ttft", "time_to_first_token", "Arrival to the first generated token"),
                ("itl", "inter_token_latency", "Gap between consecutive tokens of one request"),
                ("e2e", "request_duration", "Arrival to the end of the request"),
            )
        }  # fmt: skip
        self._children: dict[tuple[str, Lane], Histogram] = {}
        self._tick_histogram = Histogram(
            "uma_tick_duration_seconds", "Engine step (llama_decode + sampling) per tick",
            registry=self.registry, buckets=GAP_BUCKETS,
        )  # fmt: skip

    @property
    def activity(self) -> tuple[int, int, int, int]:
        """Changes whenever anything happened: a step, a request, a connection, an error."""
        return (
            self.ticks, sum(self.tokens_prompt.values()), self.connections_total, sum(self.errors.values())
        )  # fmt: skip

    # -- events ------------------------------------------------------------------------

    def _latency(self, kind: str, lane: Lane, seconds: float, now: float) -> None:
        getattr(self.latency[lane], kind).add(seconds, now)
        # The labelled child, looked up once: labels() takes a lock and builds a key per call,
        # and this runs for every token.
        key = (kind, lane)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._histograms[kind].labels(lane)
        child.observe(max(seconds, 0.0))

    def on_submitted(self, lane: Lane, prompt_tokens: int) -> None:
        self.tokens_prompt[lane] += prompt_tokens

    def on_admitted(self, lane: Lane, queue_s: float, now: float) -> None:
        self._latency("queue", lane, queue_s, now)

    def on_generated(self, lane: Lane) -> None:
        self.tokens_generated[lane] += 1

    def on_token_latency(self, lane: Lane, now: float, *, ttft_s: float | None, gap_s: float | None) -> None:
        """A request's token reached its client (its first when ``ttft_s`` is set)."""
        if ttft_s is not None:
            self._latency("ttft", lane, ttft_s, now)
        if gap_s is not None:
            self._latency("itl", lane, gap_s, now)

    def on_tick(
        self,
        now: float,
        *,
        step_s: float,
        overhead_s: float,
        decode_tokens: int,
        prefill_tokens: int,
        generated: int,
        bmt_bytes: int,
        cap_s: float,
    ) -> None:
        """One engine step ended at ``now``; ``cap_s`` is 0 when no interactive stream decoded."""
        self.ticks += 1
        self.batch_tokens["decode"] += decode_tokens
        self.batch_tokens["prefill"] += prefill_tokens
        self.decode_s_total += step_s
        self.tick_time.add(step_s, now)
        self._tick_histogram.observe(step_s)
        kept = cap_s <= 0.0 or step_s <= cap_s
        # Added in place: every tick, so no WindowSums is built for it.
        slot = self._sums.at(now)
        slot.generated += generated
        slot.generated_at_cap += generated if kept else 0
        slot.capped_ticks += int(cap_s > 0.0)
        slot.kept_cap_ticks += int(cap_s > 0.0 and kept)
        slot.bmt_bytes += bmt_bytes
        slot.busy_s += step_s
        slot.overhead_s += overhead_s

    def on_finished(
        self,
        lane: Lane,
        reason: FinishReason,
        now: float,
        *,
        computed_tokens: int,
        cancel_reason: CancelReason | None = None,
        embed: bool = False,
    ) -> None:
        """A request ended with ``reason``; ``embed``: an embedding request, counted as
        ``embedded`` when it got its embedding (``stop``)."""
        outcome: Outcome = "embedded" if embed and reason == "stop" else reason
        self.requests[lane][outcome] += 1
        if cancel_reason is not None:
            self.cancels[cancel_reason] += 1
        useful = computed_tokens if reason in ("stop", "length") else 0
        self._add_sums(WindowSums(computed_tokens=computed_tokens, useful_tokens=useful), now)

    def on_completed(self, lane: Lane, e2e_s: float, now: float, *, embed: bool = False) -> None:
        """A request that ended with stop or length had its eos written ``e2e_s`` after arrival.
        An embedding's is not a generation's time and is left out (``embed``)."""
        if not embed:
            self._latency("e2e", lane, e2e_s, now)

    def on_error(self, code: str) -> None:
        self.errors[code] += 1

    def _add_sums(self, sums: WindowSums, now: float) -> None:
        self._sums.at(now).add(sums)

    # -- reading -------------------------------------------------------------------------

    def window_sums(self, now: float) -> WindowSums:
        total = WindowSums()
        for slot in self._sums.within(now):
            total.add(slot)
        return total

    def window_elapsed(self, now: float) -> float:
        """The seconds the window's sums cover now: from its first slot (or the start, while
        the uptime is shorter) to ``now``."""
        return max(now - max(self.started, self._sums.start(now)), 1e-9)

    def latency_snapshot(self, now: float) -> dict[str, Any]:
        def figures(window_now: float | None) -> dict[str, Any]:
            tick = self.tick_time.run() if window_now is None else self.tick_time.window(window_now)
            lanes: dict[str, Any] = {lane: self.latency[lane].summary(window_now) for lane in LANES}
            built: dict[str, Any] = msgspec.to_builtins({**lanes, "tick_ms": tick})
            return built

        return {"window_s": self.window_s, "run": figures(None), "window": figures(now)}

    def snapshot(self, now: float) -> dict[str, Any]:
        ticks = self.ticks
        batch_tokens = sum(self.batch_tokens.values())
        return {
            "uptime_s": round(now - self.started, 3),
            "requests": {lane: dict(self.requests[lane]) for lane in LANES},
            "cancels": dict(self.cancels),
            "errors": dict(self.errors),
            "tokens": {
                "prompt": {lane: self.tokens_prompt[lane] for lane in LANES},
                "generated": {lane: self.tokens_generated[lane] for lane in LANES},
            },
            "ticks": ticks,
            "batch_tokens": {"decode": self.batch_tokens["decode"], "prefill": self.batch_tokens["prefill"]},
            "avg_batch_tokens": round(batch_tokens / ticks, 3) if ticks else 0.0,
            "decode_s_total": round(self.decode_s_total, 6),
            "connections": {"open": self.connections_open, "total": self.connections_total},
            "lane_changes": self.lane_changes,
            "context_rebuilds": self.context_rebuilds,
            "latency": self.latency_snapshot(now),
        }
