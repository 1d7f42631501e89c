"""Scripted load: scenarios, a runner that records every token's arrival, and stats.

Shared by the simulation tests (virtual time under ``trio.testing.MockClock``)
and the real-daemon benchmarks, so both measure the same scenario the same way.
"""

from __future__ import annotations

from .records import RequestRecord
from .runner import CONNECT_FAILED, CONNECTION_LOST, INTERRUPTED, ScenarioResult, run_scenario
from .scenario import (
    ClientSpec,
    Lane,
    Scenario,
    Suite,
    load_scenario,
    load_suite,
    mixed_scenario,
    prompt_text,
    scenario_from_dict,
)
from .stats import LaneStats, lane_stats, summarize, to_csv_rows, worst_pause
from .targets import TIMEOUT

__all__ = [
    "CONNECTION_LOST",
    "CONNECT_FAILED",
    "INTERRUPTED",
    "TIMEOUT",
    "ClientSpec",
    "Lane",
    "LaneStats",
    "RequestRecord",
    "Scenario",
    "ScenarioResult",
    "Suite",
    "lane_stats",
    "load_scenario",
    "load_suite",
    "mixed_scenario",
    "prompt_text",
    "run_scenario",
    "scenario_from_dict",
    "summarize",
    "to_csv_rows",
    "worst_pause",
]
