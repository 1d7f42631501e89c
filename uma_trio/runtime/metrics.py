"""Counters the runtime keeps; plain data, updated by the decode and connection tasks.

This is the v1 set (counters and gauges).  Latency histograms, the seeds'
scorecard and Prometheus exposition belong to the observability issue.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metrics:
    started: float = 0.0
    requests_finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    cancels: Counter[str] = field(default_factory=Counter)  # by cancel reason
    errors: Counter[str] = field(default_factory=Counter)  # by error code
    tokens_prompt: int = 0
    tokens_generated: int = 0
    ticks: int = 0
    batch_tokens: int = 0
    decode_s_total: float = 0.0
    connections_open: int = 0
    connections_total: int = 0
    lane_changes: int = 0

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "uptime_s": round(now - self.started, 3),
            "requests": dict(self.requests_finished),
            "cancels": dict(self.cancels),
            "errors": dict(self.errors),
            "tokens_prompt": self.tokens_prompt,
            "tokens_generated": self.tokens_generated,
            "ticks": self.ticks,
            "batch_tokens_total": self.batch_tokens,
            "avg_batch_tokens": round(self.batch_tokens / self.ticks, 3) if self.ticks else 0.0,
            "decode_s_total": round(self.decode_s_total, 6),
            "connections": {"open": self.connections_open, "total": self.connections_total},
            "lane_changes": self.lane_changes,
        }
