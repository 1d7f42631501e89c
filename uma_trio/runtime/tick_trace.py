"""``--tick-trace FILE``: one JSON line per engine step, for diagnosing the scheduler.

Each line holds what the policy planned and what the step cost: ``t`` (the decode task's
clock, s), ``tick``, ``decode`` and ``prefill`` (tokens), ``predicted_ms``, ``budget_ms``,
``cap_ms``, ``step_ms`` (measured), ``kv_cells`` (read by attention, as the cost model
counts them), ``ahead`` (run ahead by the compute thread, not planned), ``skipped``
(sessions left out), ``waiting`` (requests queued for a sequence) and ``rescue``.
Buffered, written by the decode task only, so it costs a few microseconds a step; flushed
every second and whenever the loop goes idle, so ``tail -f`` follows it and a crash loses
at most a second of it (held until shutdown, a review found a running daemon's file empty).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import msgspec

from ..sched.state import Plan

_encoder = msgspec.json.Encoder()
FLUSH_EVERY_S = 1.0


class TickTrace:
    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] = path.open("ab", buffering=1 << 16)
        self._flushed_at = 0.0

    def write(self, *, t: float, tick: int, plan: Plan, step_s: float, ahead: bool, waiting: int) -> None:
        row = {
            "t": round(t, 6), "tick": tick, "decode": len(plan.decode), "prefill": plan.prefill_tokens,
            "predicted_ms": round(plan.predicted_s * 1000.0, 3),
            "budget_ms": round(plan.budget_s * 1000.0, 3),
            "cap_ms": round(plan.cap_s * 1000.0, 3), "step_ms": round(step_s * 1000.0, 3), "ahead": ahead,
            "skipped": len(plan.skipped), "waiting": waiting, "rescue": plan.rescue,
            "kv_cells": plan.kv_cells,
        }  # fmt: skip
        self._file.write(_encoder.encode(row) + b"\n")
        if t - self._flushed_at >= FLUSH_EVERY_S:
            self.flush(t)

    def flush(self, t: float) -> None:
        self._file.flush()
        self._flushed_at = t

    def close(self) -> None:
        self._file.close()
