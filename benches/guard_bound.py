"""Could any scheduler within the latency guard finish the background prompts by the target?

Reads one mixed (or storm) run's tick trace and figures and prints, for each background prompt's
deadline (the target ratio × the peer's completion time), the prompt tokens due by then
against the most any schedule within the guard could read by then on that machine
(``uma_trio/loadgen/guard_bound.py`` says how the bound is taken: every figure in the
scheduler's favour but the chats' own pace, which stays as the run had it).  "short" means no
scheduler that keeps the chats at that pace meets the target there without breaking the
guard; "within reach" means the bound does not rule it out.

    python benches/guard_bound.py --gpu RESULTS_DIR [--ratio 1.5]   # benches/gpu/run.sh's results/
    python benches/guard_bound.py --compare RUN_DIR [--ratio 2.0]   # compare.py's OUT/mixed[/run-K]/

With ``--gpu`` the prompts are gpu_compare.py's (2,000 and 8,000 words at 1 s and 2 s), with
``--compare`` those of the run's scenario in benches/scenarios/ (``mixed``, ``storm``: the
directory's name, or its parent's for ``run-K``), each due by the ratio × llama-server's
completion of the same prompt (the run's requests.csv), and compare.py's ``capacity.csv`` (the engine
alone; in the run's folder or up to two above it) then gives the fastest prefill of those
prompts and of each batch width.  The first prompt's arrival is the first tick that left a
session out or read 100+ prompt tokens (``--arrival-tick`` overrides it); the others arrive
as the scenario spaces them.  Prints a table; ``--csv`` writes it too.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from uma_trio.loadgen.guard_bound import Background, Verdict, last_daemon, ticks_from_trace, verdicts

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
FIRST_BACKGROUND_S = 1.0  # when the first background prompt goes out, into the mixed run


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The last daemon's lines (benches/gpu/run.sh's repeated mixed parts share one file); a
    line cut short (a daemon stopped mid-write) is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return last_daemon(rows)


def first_arrival(rows: list[dict[str, Any]], tick: int | None) -> float:
    """The trace time the first background prompt arrived (the start of its tick's step)."""
    for row in rows:
        if (tick is not None and row["tick"] == tick) or (
            tick is None and (row["skipped"] >= 1 or row["prefill"] >= 100)
        ):
            return float(row["t"]) - float(row["step_ms"]) / 1000.0
    raise SystemExit("no background prompt found in the trace (give --arrival-tick)")


Inputs = tuple[Path, float, list[tuple[int, float, float]]]
Capacity = tuple[dict[int, float], dict[int, float]]  # sequences -> step s; prompt length -> tok/s


def gpu_inputs(results: Path) -> Inputs:
    """gpu_compare.py's mixed part: (trace, uma-trio's chats-alone gap p95 s,
    [(prompt tokens, arrival after the first s, the peer's completion s)])."""
    rows = [json.loads(line) for line in (results / "runs.jsonl").read_text().splitlines() if line.strip()]
    mixed = {r["system"]: r for r in rows if r.get("part") == "mixed"}
    uma, peer = mixed["uma-trio"], mixed["llama-server"]
    tokens = uma.get("bulk_prompt_tokens") or [2000, 8000]
    prompts = [(tokens[0], 0.0, peer["bulk2k_s"]), (tokens[1], 1.0, peer["bulk8k_s"])]
    return results / "ticks-mixed.jsonl", uma["alone_gap_ms_p95"] / 1000.0, prompts


def scenario_of(run: Path) -> str:
    """The scenario a compare.py run directory holds: ``OUT/NAME`` or ``OUT/NAME/run-K``."""
    return run.parent.name if run.name.startswith("run-") else run.name


def peer_completions(run: Path, scenario: str) -> dict[str, float]:
    """llama-server's completion time (s) of each background client's request in ``run``."""
    with (run / "requests.csv").open() as f:
        return {
            r["client"]: float(r["completion_ms"]) / 1000.0
            for r in csv.DictReader(f)
            if (r["target"], r["scenario"], r["lane"]) == ("llama-server", scenario, "background")
            and r["completion_ms"]
            and not r["error_code"]
        }


def compare_inputs(run: Path) -> Inputs:
    """A compare.py scenario with background prompts (``mixed``, ``storm``): the same, from the
    run's summary.csv and requests.csv and the scenario's file in benches/scenarios/; each
    prompt's deadline is against llama-server's completion of that same prompt."""
    with (run / "summary.csv").open() as f:
        summary = [r for r in csv.DictReader(f) if r["target"] != "target"]

    def figure(target: str, scenario: str, lane: str, column: str) -> float:
        for r in summary:
            if (r["target"], r["scenario"], r["lane"]) == (target, scenario, lane):
                return float(r[column])
        raise SystemExit(f"{run}/summary.csv has no {target} {scenario} {lane} row")

    name = scenario_of(run)
    scenario = json.loads((SCENARIOS / f"{name}.json").read_text())
    bulk = [c for c in scenario["runs"][0]["clients"] if c.get("lane") == "background"]
    peer = peer_completions(run, name)
    missing = [c["name"] for c in bulk if c["name"] not in peer]
    if missing:
        raise SystemExit(f"{run}/requests.csv has no completed llama-server request of {', '.join(missing)}")
    first = min(c["start_s"] for c in bulk)
    prompts = [(c["prompt_tokens"], c["start_s"] - first, peer[c["name"]]) for c in bulk]
    alone_p95 = figure("uma-trio", f"{name}-alone", "interactive", "gap_p95_ms") / 1000.0
    return run / "ticks.jsonl", alone_p95, prompts


def capacity(start: Path) -> Capacity:
    """compare.py's ``capacity.csv`` (llama-batched-bench, the engine alone), found in
    ``start`` or above it: (sequences decoding together -> their step s, prompt length ->
    prefill tokens/s); empty where there is none."""
    for folder in (start, start.parent, start.parent.parent):  # compare.py: OUT/mixed/run-K
        path = folder / "capacity.csv"
        if path.exists():
            with path.open() as f:
                rows = [r for r in csv.DictReader(f) if float(r["tok_s"]) > 0]
            steps = {int(r["n"]): int(r["n"]) / float(r["tok_s"]) for r in rows if r["kind"] == "decode"}
            return steps, {int(r["n"]): float(r["tok_s"]) for r in rows if r["kind"] == "prefill"}
    return {}, {}


def row_of(v: Verdict, ratio: float) -> dict[str, Any]:
    r = v.room
    return {
        "deadline": v.label, "ratio": ratio,
        "needed_tokens": v.needed, "room_tokens": r.tokens,
        "beside_chats_gain": r.beside_gain, "free_s": round(r.free_s, 3), "free_tokens": r.free_tokens,
        "window_s": round(r.window_s, 3), "chat_ticks": r.interactive_ticks,
        "verdict": "short" if v.short else "within reach",
    }  # fmt: skip


def bound_rows(
    inputs: Inputs, engine: Capacity, ratio: float, arrival_tick: int | None = None
) -> list[dict[str, Any]]:
    """A row per deadline, for the run ``inputs`` describes (``engine``: :func:`capacity`'s)."""
    trace, alone_p95, specs = inputs
    steps, rates = engine
    rows = read_trace(trace)
    arrival = first_arrival(rows, arrival_tick)
    prompts = [Background(n, arrival + offset, arrival + offset + ratio * peer) for n, offset, peer in specs]
    # Both scenarios send their first background prompt 1 s into the mixed run: the p95's
    # slack is counted over the run's chat gaps from then on.
    found = verdicts(
        ticks_from_trace(rows), alone_p95, prompts, batch_steps=steps, prefill_rates=rates,
        run_start_s=arrival - FIRST_BACKGROUND_S,
    )  # fmt: skip
    return [row_of(v, ratio) for v in found]


def compare_rows(run: Path, ratio: float = 2.0) -> list[dict[str, Any]]:
    """The bound for one of compare.py's mixed runs (its directory)."""
    return bound_rows(compare_inputs(run), capacity(run), ratio)


def gpu_lines(results: Path, ratio: float = 1.5) -> list[str]:
    """The bound for gpu_compare.py's last mixed part, as lines for its report."""
    try:
        rows = bound_rows(gpu_inputs(results), capacity(results), ratio)
    except Exception as exc:
        return [f"\nbackground under the guard: not computed ({exc!r})"]
    return ["\nbackground under the guard (benches/guard_bound.py):"] + [
        f"{r['deadline']} ({ratio}x llama-server's): need {r['needed_tokens']} tokens, any schedule "
        f"within the guard reads at most {r['room_tokens']}: {r['verdict']}"
        for r in rows
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--gpu", type=Path, help="benches/gpu/run.sh's results directory")
    source.add_argument("--compare", type=Path, help="compare.py's mixed or storm run directory")
    ap.add_argument(
        "--ratio", type=float, help="the target: completion ≤ RATIO × the peer's (GPU 1.5, CPU 2.0)"
    )
    ap.add_argument("--arrival-tick", type=int, help="the tick the first background prompt arrived in")
    ap.add_argument("--csv", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    folder = args.gpu if args.gpu is not None else args.compare
    inputs = gpu_inputs(folder) if args.gpu is not None else compare_inputs(folder)
    ratio = args.ratio or (1.5 if args.gpu is not None else 2.0)
    trace, alone_p95, specs = inputs
    engine = capacity(folder)
    print(
        f"{trace}: chats-alone gap p95 {alone_p95 * 1000:.2f} ms; guard: p95 ≤ 1.2×, "
        f"max ≤ 2× that p95; engine capacity {'from capacity.csv' if engine[0] else 'not measured'}"
    )
    for tokens, _, peer in specs:
        print(f"  background {tokens} tokens: peer {peer:.2f} s; due {ratio * peer:.2f} s after it arrives")
    table = bound_rows(inputs, engine, ratio, args.arrival_tick)
    for r in table:
        print(
            f"{r['deadline']}: need {r['needed_tokens']}, the guard leaves at most {r['room_tokens']} "
            f"({r['free_tokens']} in {r['free_s']} s of {r['window_s']} s with no chat decoding, "
            f"{r['beside_chats_gain']} more beside {r['chat_ticks']} chat ticks): {r['verdict']}"
        )
    if args.csv is not None:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)


if __name__ == "__main__":
    main()
