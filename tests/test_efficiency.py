"""The scheduler-efficiency arithmetic of benches/compare.py (uma_trio/loadgen/efficiency.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from uma_trio.loadgen.efficiency import (
    Capacity,
    best_of,
    busy_seconds,
    efficiency,
    ideal_seconds,
    needed_for,
)
from uma_trio.loadgen.records import RequestRecord

CAPACITY = Capacity(prefill={100: 100.0, 1000: 50.0}, decode={1: 10.0, 2: 16.0})


def record(client: str, sent: float, tokens: list[float], prompt: int) -> RequestRecord:
    return RequestRecord(
        client=client, lane="interactive", index=0, sent=sent, token_times=tokens, ended=tokens[-1],
        eos_reason="length", prompt_tokens=prompt, completion_tokens=len(tokens),
    )  # fmt: skip


def compare_module() -> Any:
    """benches/compare.py, imported as its own module (it imports its siblings by name)."""
    benches = Path(__file__).resolve().parent.parent / "benches"
    sys.path.insert(0, str(benches))
    try:
        spec = importlib.util.spec_from_file_location("compare_points", benches / "compare.py")
        assert spec is not None and spec.loader is not None
        compare = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = compare  # its dataclasses look their module up
        spec.loader.exec_module(compare)
    finally:
        sys.path.remove(str(benches))
    return compare


def test_busy_time_is_the_union_of_request_spans() -> None:
    records = [record("a", 0.0, [1.0, 2.0], 1), record("b", 1.5, [3.0], 1), record("c", 5.0, [6.0], 1)]
    assert busy_seconds(records) == pytest.approx(3.0 + 1.0)


def test_capacity_interpolates_prefill_time_and_prices_decode_by_concurrency() -> None:
    assert CAPACITY.prefill_seconds(100) == pytest.approx(1.0)
    assert CAPACITY.prefill_seconds(550) == pytest.approx(1.0 + (20.0 - 1.0) / 2)
    assert CAPACITY.prefill_seconds(50) == pytest.approx(0.5)
    assert CAPACITY.decode_seconds_per_token(1) == pytest.approx(0.1)
    assert CAPACITY.decode_seconds_per_token(2) == pytest.approx(1 / 16)
    # past the last measured point, the last segment's slope: 3 sequences take 0.15 s a step
    assert CAPACITY.decode_seconds_per_token(3) == pytest.approx(0.15 / 3)


def test_ideal_time_counts_each_prompt_prefix_once_and_decodes_at_the_concurrency_seen() -> None:
    alone = [record("a", 0.0, [1.0, 1.1, 1.2], 100)]
    # prefill 1 s, then two tokens decoding alone at 10 tok/s
    assert ideal_seconds(alone, CAPACITY, {}) == pytest.approx(1.0 + 0.2)
    together = [record("a", 0.0, [1.0, 1.1, 1.2], 100), record("b", 0.5, [1.0, 1.1, 1.2], 100)]
    # b's prompt is a's again: no prefill; all four later tokens arrive while both decode
    assert ideal_seconds(together, CAPACITY, {}) == pytest.approx(1.0 + 4 / 16)
    assert efficiency(together, CAPACITY, {}) == pytest.approx((1.0 + 4 / 16) / 1.2, abs=1e-3)


def test_a_chunk_of_several_tokens_is_priced_per_token() -> None:
    chunked = record("a", 0.0, [1.0, 1.2], 100)
    chunked.completion_tokens = 5  # the second event carried four tokens
    assert ideal_seconds([chunked], CAPACITY, {}) == pytest.approx(1.0 + 4 * 0.1)


def test_the_capacity_of_two_passes_is_each_points_best() -> None:
    before = Capacity(prefill={128: 300.0, 2048: 200.0}, decode={1: 100.0, 3: 150.0})
    after = Capacity(prefill={128: 280.0, 2048: 240.0}, decode={1: 110.0, 3: 140.0})
    best = best_of([before, after])
    assert best.prefill == {128: 300.0, 2048: 240.0}
    assert best.decode == {1: 110.0, 3: 150.0}


def test_each_run_prices_the_prompts_its_scenario_reaches_and_every_batch_width() -> None:
    """compare.py measures the capacity around every run: for the mixed scenario (30- and
    2,000-token prompts) the prompts up to 2,048, not the 8,000-token prompt that alone took a
    minute; every decoder count, which guard_bound reads as the step of a batch that wide."""
    compare = compare_module()
    widths = [1, 2, 3, 4, 5, 6, 8, 16]
    assert compare.capacity_points("mixed") == ([128, 512, 2048], widths)
    assert compare.capacity_points("storm") == ([128, 512, 2048, 8000], widths)
    assert compare.capacity_points("scaling") == ([128], widths)


def test_a_deadline_for_the_whole_load_asks_its_ideal_time_over_the_window() -> None:
    records = [record("chat", 0.5, [1.0, 1.1, 1.2], 100), record("bulk", 1.0, [3.0], 1000)]
    ideal = ideal_seconds(records, CAPACITY, {})
    # due 4.5 s after the first send (0.5 s): the load needs ideal / 4.5 of the engine
    assert needed_for(records, CAPACITY, {}, done_by=5.0) == pytest.approx(round(ideal / 4.5, 3))
    # a deadline tighter than the work itself asks for more than the engine has
    assert needed_for(records, CAPACITY, {}, done_by=0.5 + ideal / 2) > 1.0
    assert needed_for(records, CAPACITY, {}, done_by=0.5) is None
    assert needed_for([], CAPACITY, {}, done_by=5.0) is None


def test_compare_prices_the_background_deadline_against_the_whole_run() -> None:
    """compare.py's table: the deadline is 2x llama-server's completion of the prompt uma-trio
    ended last, the whole load is due by then, and the efficiency that asks for is set beside
    what each server achieved."""
    from uma_trio.loadgen import ScenarioResult, load_suite

    compare = compare_module()
    scenario = next(s for s in load_suite(compare.SCENARIOS / "mixed.json").runs if s.name == "mixed")

    def bulk(sent: float, first: float, end: float) -> RequestRecord:
        return RequestRecord(
            client="bulk", lane="background", index=0, sent=sent, token_times=[first, end], ended=end,
            eos_reason="length", prompt_tokens=1000, completion_tokens=2,
        )  # fmt: skip

    ours = [record("chat-0", 100.0, [100.5, 101.0, 101.5], 100), bulk(101.0, 110.0, 111.0)]
    theirs = [record("chat-0", 0.0, [6.0, 6.5, 7.0], 100), bulk(1.0, 3.0, 5.0)]  # bulk in 4 s
    results = [
        ScenarioResult(scenario=scenario, started=100.0, finished=111.0, records=ours, target="uma-trio"),
        ScenarioResult(scenario=scenario, started=0.0, finished=7.0, records=theirs, target="llama-server"),
    ]
    rep = compare.Rep(results=results, steal="", rss={}, gc="", out=Path("."), capacity=CAPACITY)
    rows = compare.deadline_table([rep, rep]).strip().splitlines()[-2:]
    assert rows[0].split("|")[2:] == rows[1].split("|")[2:]  # a run's figures leak not into the next's
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    ideal = ideal_seconds(ours, CAPACITY, {})
    # due 2 x 4 s after uma-trio sent the prompt (1 s after its first request): 9 s
    assert cells[1] == "9.00"
    assert cells[2] == f"{ideal:.2f}"
    assert float(cells[3]) == pytest.approx(ideal / 9.0, abs=1e-3)
    assert cells[4] == str(efficiency(ours, CAPACITY, {}))
    assert cells[5] == str(efficiency(theirs, CAPACITY, {}))
    assert cells[6] == "2.50"  # 10 s against 4 s
