"""The mixed scenario on the real daemon: how much does one long background prompt hurt chat?

Three interactive clients stream (~30-token prompts, ``--interactive-tokens``
each, chained back to back so they stream for the whole run).  The scenario
runs twice on a fresh in-process daemon: the baseline without, then with one
background client sending a ``--bg-prompt-tokens`` prompt (max_tokens 32) at
t = 2 s.  The scenario is :func:`uma_trio.loadgen.mixed_scenario`, the same one
the simulation tests replay in virtual time.

Prints a side-by-side table: interactive inter-token gaps (p50/p95/max, over
the whole run and over the background request's lifetime, the baseline taking
the same window from its own start), interactive TTFT, the background
request's TTFT and completion time, tokens/s (over the whole run, and for the
interactive lane also over its own span: the background request may outlive it).  Writes it to ``--out``
(default ``benches/results/mixed_scenario.csv``); ``--requests-out`` also
writes one row per request.

    python benches/mixed_scenario.py [--bg-prompt-tokens 2000] [--interactive-tokens 200]
                                     [--interactive-requests 5] [--out PATH] [--requests-out PATH]

It warns when the interactive chains end before the background request does
(the run then no longer measures the mix): raise ``--interactive-requests``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import trio
from bench_output import write_csv

from uma_trio.config import ServerConfig
from uma_trio.daemon import serving
from uma_trio.engine.llama import LlamaModel
from uma_trio.loadgen import Scenario, ScenarioResult, lane_stats, mixed_scenario, run_scenario, to_csv_rows
from uma_trio.loadgen.stats import CSV_FIELDS, span, tokens_per_s
from uma_trio.model_files import ensure_default_model


async def run_once(model: LlamaModel, scenario: Scenario, timeout_s: float) -> ScenarioResult:
    """One scenario run against a fresh daemon (fresh context: no KV left from the last run).

    The daemon gets the policy ``uma-trio serve`` would build (``policy_for``), ΣBMT
    bandwidth probe included.  ``timeout_s`` turns a stuck run into an error, not a hang.
    """
    with tempfile.TemporaryDirectory(prefix="uma-bench-") as tmp:
        config = ServerConfig(
            socket_path=Path(tmp) / "m.sock", n_ctx=4096, max_prompt_tokens=4096, metrics_interval_s=3600
        )
        async with serving(model, config):
            with trio.fail_after(timeout_s):
                result = await run_scenario(config.socket_path, scenario)
    return result


def bg_window(result: ScenarioResult) -> tuple[float, float] | None:
    """The background request's lifetime, relative to the scenario start."""
    for record in result.records:
        if record.lane == "background" and record.ended is not None:
            return record.sent - result.started, record.ended - result.started
    return None


def figures(result: ScenarioResult, window: tuple[float, float] | None) -> dict[str, float]:
    """The table's figures for one run; ``window`` (relative seconds) picks the 'during bg' gaps."""
    ms = 1000.0
    inter = lane_stats(result, "interactive")
    out = {
        "interactive gap p50 (ms)": inter.gap_p50 * ms,
        "interactive gap p95 (ms)": inter.gap_p95 * ms,
        "interactive gap max (ms)": inter.gap_max * ms,
    }
    if window is not None:
        absolute = (result.started + window[0], result.started + window[1])
        during = lane_stats(result, "interactive", window=absolute)
        out |= {
            "  during bg: gap p50 (ms)": during.gap_p50 * ms,
            "  during bg: gap p95 (ms)": during.gap_p95 * ms,
            "  during bg: gap max (ms)": during.gap_max * ms,
        }
    bg = lane_stats(result, "background")
    out |= {
        "interactive TTFT p50 (ms)": inter.ttft_p50 * ms,
        "interactive TTFT max (ms)": inter.ttft_max * ms,
        "background TTFT (s)": bg.ttft_p50,
        "background completion (s)": bg.completion_max,
        "interactive tok/s": inter.tokens_per_s,
        "interactive tok/s (own span)": inter.tokens / interactive_end(result),
        "aggregate tok/s": tokens_per_s(result),
        "run span (s)": span(result),
        "failed requests": float(inter.failed + bg.failed),
    }
    return out


def _cell(value: float) -> float | None:
    """A CSV cell: rounded, empty for nan (no baseline figure, no ratio)."""
    return None if math.isnan(value) else round(value, 3)


def interactive_end(result: ScenarioResult) -> float:
    """Seconds from the start to the last interactive request's end."""
    ends = [r.ended or r.sent for r in result.records if r.lane == "interactive"]
    return max(ends, default=result.started) - result.started


def check_coverage(result: ScenarioResult) -> None:
    """Warn when the interactive chains ended before the background request did."""
    window = bg_window(result)
    inter_end = interactive_end(result)
    if window is not None and inter_end < window[1]:
        print(
            f"warning: the interactive chains ended at t = {inter_end:.2f} s, before the background"
            f" request (t = {window[1]:.2f} s): raise --interactive-requests"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bg-prompt-tokens", type=int, default=2000)
    parser.add_argument("--interactive-tokens", type=int, default=200)
    parser.add_argument("--interactive-requests", type=int, default=5, help="chain length per client")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before giving up")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mixed_scenario.csv")
    parser.add_argument("--requests-out", type=Path, default=None, help="also write one row per request")
    args = parser.parse_args()

    model = LlamaModel(ensure_default_model())
    chain = {"interactive_requests": args.interactive_requests}
    baseline_scenario = mixed_scenario(None, args.interactive_tokens, **chain)
    mixed = mixed_scenario(args.bg_prompt_tokens, args.interactive_tokens, **chain)
    print(f"running {baseline_scenario.name} ...", flush=True)
    baseline = trio.run(run_once, model, baseline_scenario, args.timeout)
    print(f"running {mixed.name} ...", flush=True)
    with_bg = trio.run(run_once, model, mixed, args.timeout)
    model.close()
    check_coverage(with_bg)

    window = bg_window(with_bg)
    base_fig, bg_fig = figures(baseline, window), figures(with_bg, window)
    rows = []
    print(f"\n{'':<28} {'baseline':>10} {'with bg':>10} {'with/without':>13}")
    for name, with_value in bg_fig.items():
        base_value = base_fig[name]
        if name.startswith("background") or name == "failed requests":
            ratio = math.nan
        else:
            ratio = with_value / base_value if base_value else math.nan
        rows.append({"metric": name.strip(), "baseline": _cell(base_value),
                     "with_bg": _cell(with_value), "ratio": _cell(ratio),
                     "bg_prompt_tokens": args.bg_prompt_tokens,
                     "interactive_tokens": args.interactive_tokens,
                     "interactive_requests": args.interactive_requests})  # fmt: skip
        shown_ratio = "" if math.isnan(ratio) else f"{ratio:.2f}"
        base_shown = "-" if math.isnan(base_value) else f"{base_value:.1f}"
        print(f"{name:<28} {base_shown:>10} {with_value:>10.1f} {shown_ratio:>13}")
    if window is not None:
        print(f"(background request in flight from t = {window[0]:.2f} s to {window[1]:.2f} s)")

    write_csv(args.out, rows, list(rows[0]))
    if args.requests_out is not None:
        per_request = [
            {"run": run, **row}
            for run, result in (("baseline", baseline), ("with_bg", with_bg))
            for row in to_csv_rows(result)
        ]
        write_csv(args.requests_out, per_request, ["run", *CSV_FIELDS])


if __name__ == "__main__":
    main()
