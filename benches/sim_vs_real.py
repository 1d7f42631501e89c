"""The simulator against the real daemon on the mixed scenario (issue 19, point 5).

The mixed run of ``benches/scenarios/mixed.json`` (3 chats of 4 turns, a 2,000-token
background prompt 1 s in) runs ``--repeats`` times on a fresh ``uma-trio serve`` (a
subprocess, over its socket, with compare.py's settings: 4 sessions of 4,096 cells, 2
threads), and ``--seeds`` times in virtual time on the simulated engine
(``uma_trio.loadgen.simulate``, one seed each) with the same settings.

The simulated machine is this one, calibrated without looking at the mixed run:

* the cost model ``uma-trio calibrate`` measured here (``--cost-model``; calibrated first
  when the file is missing): the engine alone;
* how the daemon's steps spread around that model under a live load, for each kind of step
  (planned decode steps beside streaming clients, steps run ahead, steps carrying prompt
  tokens), and the event loop's time between two steps: from real runs of the same chats
  without the background prompt (``--tick-trace``; ``engine.sim.StepNoise``);
* the time a request spends outside the engine before its first token (connecting,
  framing, tokenizing, delivering): those runs' TTFT p50 less the simulator's for the
  same chats with the step spread above (``StepNoise.request_s``).

A figure is taken over every sample of its runs together: the gap p95 over all the chats'
gaps, the TTFT p50 over all their first tokens, the background completion as the median of
the runs'.  One run has 12 chat turns, and its TTFT p50 moved by ±30 % from one run to the
next with the same code (BENCHMARKS.md, runs 10 and 11): more than the 15 % the simulator
is read against.  Pooled over 5 real runs and 20 seeds it settles.

Prints the interactive gap p95, TTFT p50 and the background request's completion time, each
run's and pooled, and the simulator's ratio to the real daemon (also for the cost model
alone, without the measured spread); writes ``OUT/sim_vs_real.csv``.

    python benches/sim_vs_real.py [--repeats 5] [--seeds 20] [--cost-model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import trio
import trio.testing
from bench_output import free_port, write_csv
from compare import SCENARIOS, SETUPS, running, uma_command

from uma_trio.config import ServerConfig
from uma_trio.engine.calibrate import default_cost_model_path
from uma_trio.engine.sim import StepNoise
from uma_trio.loadgen import Scenario, ScenarioResult, lane_stats, load_suite, run_scenario
from uma_trio.loadgen.simulate import simulate
from uma_trio.loadgen.stats import gaps, percentile, ttft
from uma_trio.loadgen.targets import UmaTarget
from uma_trio.sched.cost import CostCoefficients

FIGURES = ("interactive gap p95 (ms)", "interactive TTFT p50 (ms)", "background completion (s)")


def figures(results: list[ScenarioResult]) -> dict[str, float]:
    """The three figures over every sample of ``results`` together (the module docstring)."""
    chats = [r for result in results for r in result.records if r.lane == "interactive"]
    every_gap = np.concatenate([gaps(r) for r in chats])
    first_tokens = [t for t in map(ttft, chats) if t is not None]
    completions = [lane_stats(result, "background").completion_max for result in results]
    values = (
        percentile(every_gap, 95) * 1000.0,
        percentile(first_tokens, 50) * 1000.0,
        math.nan if any(map(math.isnan, completions)) else statistics.median(completions),
    )
    return dict(zip(FIGURES, values, strict=True))


def real_run(scenario: Scenario, cost_model: Path, log: Path, trace: Path | None = None) -> ScenarioResult:
    setup = SETUPS["mixed"]
    with tempfile.TemporaryDirectory(prefix="uma-svr-") as tmp:
        sock, port = Path(tmp) / "u.sock", free_port()
        command = [*uma_command(setup, sock, port, trace), "--cost-model", str(cost_model)]
        with running(command, f"http://127.0.0.1:{port}", "uma-trio", log):
            return trio.run(run_scenario, UmaTarget(sock, "uma-trio"), scenario)


def measured_machine(traces: list[Path], cost: CostCoefficients) -> StepNoise:
    """Each step's measured time over ``cost``'s prediction, by kind of step (planned decode
    steps beside streaming clients, steps run ahead, steps carrying prompt tokens), and the
    median time between two steps, from ``--tick-trace`` files."""
    ratios: dict[str, list[float]] = {"decode": [], "ahead": [], "prompt": []}
    between = []
    steps = (
        pair for trace in traces
        for pair in itertools.pairwise(json.loads(line) for line in trace.read_text().splitlines())
    )  # fmt: skip
    for before, row in steps:
        predicted = cost.predict(row["decode"], row["prefill"], row["kv_cells"])
        if predicted > 0 and (row["decode"] or row["prefill"]):
            kind = "prompt" if row["prefill"] else "ahead" if row["ahead"] else "decode"
            ratios[kind].append(row["step_ms"] / 1000.0 / predicted)
        interval = row["t"] - before["t"] - row["step_ms"] / 1000.0
        if 0 <= interval < 0.1:  # not an idle wait for the next request
            between.append(interval)
    return StepNoise(
        ratios=ratios["decode"], ahead_ratios=ratios["ahead"], prompt_ratios=ratios["prompt"],
        overhead_s=statistics.median(between),
    )  # fmt: skip


def simulated_run(scenario: Scenario, cost: CostCoefficients, machine: StepNoise | None) -> ScenarioResult:
    setup = SETUPS["mixed"]
    config = ServerConfig(
        n_ctx=setup.n_ctx, max_sessions=setup.slots, max_prompt_tokens=setup.n_ctx, metrics_interval_s=3600.0
    )

    async def run() -> ScenarioResult:
        result, _ = await simulate(scenario, cost, config, machine=machine)
        return result

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="real runs, each of the chats alone and mixed")
    parser.add_argument("--seeds", type=int, default=20, help="simulated runs")
    parser.add_argument("--cost-model", type=Path, default=default_cost_model_path())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sim_vs_real")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cost_model.is_file():
        print(f"calibrating into {args.cost_model} (about a minute) ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "uma_trio", "calibrate", "--out", str(args.cost_model), "--threads", "2"],
            check=True,
        )
    cost = CostCoefficients.load(args.cost_model)
    scenario = next(run for run in load_suite(SCENARIOS / "mixed.json").runs if run.name == "mixed")

    alone = msgspec.structs.replace(
        scenario, name="mixed-alone", clients=[c for c in scenario.clients if c.lane != "background"]
    )
    traces, alone_runs, real = [], [], []
    for repeat in range(args.repeats):  # alternated, so both see the machine's state of the moment
        print(f"real daemon, run {repeat + 1} of {args.repeats}: the chats alone, then mixed ...", flush=True)
        traces.append(args.out / f"ticks-alone-{repeat}.jsonl")
        traces[-1].unlink(missing_ok=True)
        alone_runs.append(real_run(alone, args.cost_model, args.out / f"uma-alone-{repeat}.log", traces[-1]))
        real.append(real_run(scenario, args.cost_model, args.out / f"uma-{repeat}.log"))
    measured = measured_machine(traces, cost)
    # Copies: each simulation draws its seeded spread from its start.
    seeds = range(args.seeds)
    sim_alone = [simulated_run(alone, cost, dataclasses.replace(measured, seed=seed)) for seed in seeds]
    ttft_ms = FIGURES[1]  # the chats' TTFT p50, here without the background prompt
    outside = max(0.0, (figures(alone_runs)[ttft_ms] - figures(sim_alone)[ttft_ms]) / 1000.0)
    machine = dataclasses.replace(measured, request_s=outside)
    simulated = [simulated_run(scenario, cost, dataclasses.replace(machine, seed=seed)) for seed in seeds]
    plain = figures([simulated_run(scenario, cost, None)])
    kinds = {"decode": machine.ratios, "ahead": machine.ahead_ratios, "prompt": machine.prompt_ratios}
    spread = ", ".join(f"{kind} {statistics.median(r):.2f} ({len(r)})" for kind, r in kinds.items() if r)
    print(f"machine: measured / predicted p50 by kind of step (steps) {spread}, "
          f"between steps {machine.overhead_s * 1000:.2f} ms, outside the engine per request "
          f"{machine.request_s * 1000:.1f} ms")  # fmt: skip

    rows = []
    real_each = [figures([run]) for run in real]
    sim_each = [figures([run]) for run in simulated]
    real_pooled, sim_pooled = figures(real), figures(simulated)
    print(f"\n{'':<27} {'real runs: each':>34} {'pooled':>7} {'seeds: from / to':>17} {'pooled':>7} "
          f"{'sim/real':>8} {'model alone':>11} {'sim/real':>8}")  # fmt: skip
    for name in FIGURES:
        runs = " / ".join(f"{run[name]:.1f}" for run in real_each)
        seed_range = f"{min(r[name] for r in sim_each):.1f} / {max(r[name] for r in sim_each):.1f}"
        ratio, plain_ratio = sim_pooled[name] / real_pooled[name], plain[name] / real_pooled[name]
        print(f"{name:<27} {runs:>34} {real_pooled[name]:>7.1f} {seed_range:>17} {sim_pooled[name]:>7.1f} "
              f"{ratio:>8.2f} {plain[name]:>11.1f} {plain_ratio:>8.2f}")  # fmt: skip
        rows.append({"figure": name, "real_runs": runs, "real_pooled": round(real_pooled[name], 3),
                     "simulated_seed_range": seed_range, "simulated_pooled": round(sim_pooled[name], 3),
                     "sim_over_real": round(ratio, 3), "model_alone": round(plain[name], 3),
                     "model_alone_over_real": round(plain_ratio, 3)})  # fmt: skip
    write_csv(args.out / "sim_vs_real.csv", rows, list(rows[0]))


if __name__ == "__main__":
    main()
