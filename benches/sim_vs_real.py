"""The simulator against the real daemon on the mixed scenario (issue 19, point 5).

The mixed run of ``benches/scenarios/mixed.json`` (3 chats of 4 turns, a 2,000-token
background prompt 1 s in) runs ``--repeats`` times on a fresh ``uma-trio serve`` (a
subprocess, over its socket, with compare.py's settings: 4 sessions of 4,096 cells, 2
threads), and ``--repeats`` times in virtual time on the simulated engine
(``uma_trio.loadgen.simulate``, one seed each) with the same settings.

The simulated machine is this one, calibrated without looking at the mixed run:

* the cost model ``uma-trio calibrate`` measured here (``--cost-model``; calibrated first
  when the file is missing): the engine alone;
* how the daemon's steps spread around that model under a live load, for each kind of step
  (planned decode steps beside streaming clients, steps run ahead, steps carrying prompt
  tokens), and the event loop's time between two steps: from one real run of the same
  chats without the background prompt (``--tick-trace``; ``engine.sim.StepNoise``);
* the time a request spends outside the engine before its first token (connecting,
  framing, tokenizing, delivering): that same run's TTFT p50 less the simulator's for the
  same chats with the step spread above (``StepNoise.request_s``).

Prints the interactive gap p95, TTFT p50 and the background request's completion time of
each, and the simulator's ratio to the real runs' median (also for the cost model alone,
without the measured spread); writes ``OUT/sim_vs_real.csv``.

    python benches/sim_vs_real.py [--repeats 3] [--cost-model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import trio
import trio.testing
from bench_output import free_port, write_csv
from compare import SCENARIOS, SETUPS, running, uma_command

from uma_trio.config import ServerConfig
from uma_trio.engine.calibrate import default_cost_model_path
from uma_trio.engine.sim import StepNoise
from uma_trio.loadgen import Scenario, ScenarioResult, lane_stats, load_suite, run_scenario
from uma_trio.loadgen.simulate import simulate
from uma_trio.loadgen.targets import UmaTarget
from uma_trio.sched.cost import CostCoefficients

FIGURES = ("interactive gap p95 (ms)", "interactive TTFT p50 (ms)", "background completion (s)")


def figures(result: ScenarioResult) -> dict[str, float]:
    inter, bg = lane_stats(result, "interactive"), lane_stats(result, "background")
    values = (inter.gap_p95 * 1000.0, inter.ttft_p50 * 1000.0, bg.completion_max)
    return dict(zip(FIGURES, values, strict=True))


def real_run(scenario: Scenario, cost_model: Path, log: Path, trace: Path | None = None) -> ScenarioResult:
    setup = SETUPS["mixed"]
    with tempfile.TemporaryDirectory(prefix="uma-svr-") as tmp:
        sock, port = Path(tmp) / "u.sock", free_port()
        command = [*uma_command(setup, sock, port, trace), "--cost-model", str(cost_model)]
        with running(command, f"http://127.0.0.1:{port}", "uma-trio", log):
            return trio.run(run_scenario, UmaTarget(sock, "uma-trio"), scenario)


def measured_machine(trace: Path, cost: CostCoefficients, seed: int) -> StepNoise:
    """Each step's measured time over ``cost``'s prediction, by kind of step (planned decode
    steps beside streaming clients, steps run ahead, steps carrying prompt tokens), and the
    median time between two steps, from a ``--tick-trace`` file."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    ratios: dict[str, list[float]] = {"decode": [], "ahead": [], "prompt": []}
    between = []
    for before, row in itertools.pairwise(rows):
        predicted = cost.predict(row["decode"], row["prefill"], row["kv_cells"])
        if predicted > 0 and (row["decode"] or row["prefill"]):
            kind = "prompt" if row["prefill"] else "ahead" if row["ahead"] else "decode"
            ratios[kind].append(row["step_ms"] / 1000.0 / predicted)
        interval = row["t"] - before["t"] - row["step_ms"] / 1000.0
        if 0 <= interval < 0.1:  # not an idle wait for the next request
            between.append(interval)
    return StepNoise(
        ratios=ratios["decode"], ahead_ratios=ratios["ahead"], prompt_ratios=ratios["prompt"],
        overhead_s=statistics.median(between), seed=seed,
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
    parser.add_argument("--repeats", type=int, default=3)
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
    trace = args.out / "ticks-alone.jsonl"
    trace.unlink(missing_ok=True)
    print("real daemon, the chats alone (the machine's step spread) ...", flush=True)
    alone_run = real_run(alone, args.cost_model, args.out / "uma-alone.log", trace)
    alone_ttft = lane_stats(alone_run, "interactive")
    real, simulated = [], []
    for repeat in range(args.repeats):
        print(f"real daemon, run {repeat + 1} of {args.repeats} ...", flush=True)
        real.append(figures(real_run(scenario, args.cost_model, args.out / f"uma-{repeat}.log")))
        measured = measured_machine(trace, cost, seed=repeat)
        # Copies: each simulation draws the seeded spread from its start.
        sim_alone = lane_stats(simulated_run(alone, cost, dataclasses.replace(measured)), "interactive")
        outside = max(0.0, alone_ttft.ttft_p50 - sim_alone.ttft_p50)
        machine = dataclasses.replace(measured, request_s=outside)
        simulated.append(figures(simulated_run(scenario, cost, machine)))
    plain = figures(simulated_run(scenario, cost, None))
    kinds = {"decode": machine.ratios, "ahead": machine.ahead_ratios, "prompt": machine.prompt_ratios}
    spread = ", ".join(f"{kind} {statistics.median(r):.2f} ({len(r)})" for kind, r in kinds.items() if r)
    print(f"machine: measured / predicted p50 by kind of step (steps) {spread}, "
          f"between steps {machine.overhead_s * 1000:.2f} ms, outside the engine per request "
          f"{machine.request_s * 1000:.1f} ms")  # fmt: skip

    rows = []
    print(f"\n{'':<27} {'real (runs)':>20} {'median':>7} {'simulated (seeds)':>20} {'median':>7} "
          f"{'sim/real':>8} {'model alone':>11} {'sim/real':>8}")  # fmt: skip
    for name in FIGURES:
        real_median = statistics.median(run[name] for run in real)
        sim_median = statistics.median(run[name] for run in simulated)
        runs = " / ".join(f"{run[name]:.1f}" for run in real)
        seeds = " / ".join(f"{run[name]:.1f}" for run in simulated)
        ratio, plain_ratio = sim_median / real_median, plain[name] / real_median
        print(f"{name:<27} {runs:>20} {real_median:>7.1f} {seeds:>20} {sim_median:>7.1f} "
              f"{ratio:>8.2f} {plain[name]:>11.1f} {plain_ratio:>8.2f}")  # fmt: skip
        rows.append({"figure": name, "real_runs": runs, "real_median": round(real_median, 3),
                     "simulated_seeds": seeds, "simulated_median": round(sim_median, 3),
                     "sim_over_real": round(ratio, 3), "model_alone": round(plain[name], 3),
                     "model_alone_over_real": round(plain_ratio, 3)})  # fmt: skip
    write_csv(args.out / "sim_vs_real.csv", rows, list(rows[0]))


if __name__ == "__main__":
    main()
