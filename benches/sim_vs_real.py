"""The simulator against the real daemon on the mixed scenario (issue 19, point 5).

The mixed run of ``benches/scenarios/mixed.json`` (3 chats of 4 turns, a 2,000-token
background prompt 1 s in) runs ``--repeats`` times on a fresh ``uma-trio serve`` (a
subprocess, over its socket, with compare.py's settings: 4 sessions of 4,096 cells, 2
threads), and once in virtual time on the simulated engine (``uma_trio.loadgen.simulate``)
with the same settings.  Both use the cost model ``uma-trio calibrate`` measured on this
machine (``--cost-model``; calibrated first when the file is missing), so the simulated
machine is this one.  Prints the interactive gap p95, TTFT p50 and the background request's
completion time of each, and the simulator's error against the real runs' median; writes
``OUT/sim_vs_real.csv``.

    python benches/sim_vs_real.py [--repeats 3] [--cost-model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trio
import trio.testing
from bench_output import free_port, write_csv
from compare import SCENARIOS, SETUPS, running, uma_command

from uma_trio.config import ServerConfig
from uma_trio.engine.calibrate import default_cost_model_path
from uma_trio.loadgen import Scenario, ScenarioResult, lane_stats, load_suite, run_scenario
from uma_trio.loadgen.simulate import simulate
from uma_trio.loadgen.targets import UmaTarget
from uma_trio.sched.cost import CostCoefficients

FIGURES = ("interactive gap p95 (ms)", "interactive TTFT p50 (ms)", "background completion (s)")


def figures(result: ScenarioResult) -> dict[str, float]:
    inter, bg = lane_stats(result, "interactive"), lane_stats(result, "background")
    values = (inter.gap_p95 * 1000.0, inter.ttft_p50 * 1000.0, bg.completion_max)
    return dict(zip(FIGURES, values, strict=True))


def real_run(scenario: Scenario, cost_model: Path, log: Path) -> ScenarioResult:
    setup = SETUPS["mixed"]
    with tempfile.TemporaryDirectory(prefix="uma-svr-") as tmp:
        sock, port = Path(tmp) / "u.sock", free_port()
        command = [*uma_command(setup, sock, port), "--cost-model", str(cost_model)]
        with running(command, f"http://127.0.0.1:{port}", "uma-trio", log):
            return trio.run(run_scenario, UmaTarget(sock, "uma-trio"), scenario)


def simulated_run(scenario: Scenario, cost: CostCoefficients) -> ScenarioResult:
    setup = SETUPS["mixed"]
    config = ServerConfig(
        n_ctx=setup.n_ctx, max_sessions=setup.slots, max_prompt_tokens=setup.n_ctx, metrics_interval_s=3600.0
    )

    async def run() -> ScenarioResult:
        result, _ = await simulate(scenario, cost, config)
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

    real = []
    for repeat in range(args.repeats):
        print(f"real daemon, run {repeat + 1} of {args.repeats} ...", flush=True)
        real.append(figures(real_run(scenario, args.cost_model, args.out / f"uma-{repeat}.log")))
    sim = figures(simulated_run(scenario, cost))

    rows = []
    print(f"\n{'':<28} {'real (runs)':>28} {'real median':>12} {'simulated':>10} {'sim / real':>10}")
    for name in FIGURES:
        values = [run[name] for run in real]
        median = statistics.median(values)
        ratio = sim[name] / median if median else float("nan")
        runs = " / ".join(f"{v:.1f}" for v in values)
        print(f"{name:<28} {runs:>28} {median:>12.1f} {sim[name]:>10.1f} {ratio:>10.2f}")
        rows.append({"figure": name, "real_runs": runs, "real_median": round(median, 3),
                     "simulated": round(sim[name], 3), "sim_over_real": round(ratio, 3)})  # fmt: skip
    write_csv(args.out / "sim_vs_real.csv", rows, list(rows[0]))


if __name__ == "__main__":
    main()
