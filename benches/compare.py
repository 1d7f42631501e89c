"""uma-trio side by side with llama-server on every scenario in benches/scenarios/.

For each scenario this starts a fresh ``uma-trio serve`` (socket and ``--http``) and a
fresh ``llama-server`` built by ``benches/peers/build.sh`` from the llama.cpp that
the pinned llama-cpp-python vendors.  Both get the same model, per-request context,
threads and parallel slots.  The scenario then runs on each of them, one after the
other, through the same load generator as ``uma-trio bench``, and the servers are
stopped.  Results go to ``OUT/SCENARIO/`` (tokens.csv, requests.csv, summary.csv, PNG
plots, uma-trio's per-step trace ``ticks.jsonl``) and the side-by-side tables to
``OUT/tables.md``.

``--reps N`` runs each scenario N times, each time on freshly started servers (so no run
finds the prompts of the one before in a cache) with the targets' order alternating; each
run's results go to ``OUT/SCENARIO/run-K/``, and the tables (and ``OUT/SCENARIO/summary.csv``)
give every figure's median over the runs, followed by each run's uma-trio / llama-server
ratio of aggregate tokens/s (uma_trio/loadgen/repeats.py).  On a 2-core VM one run moves by
±10 % from the next, more than the targets the ratios are read against.

Where a one-request-at-a-time server applies (``mixed``, ``ipc``), llama-cpp-python's own
server (``python -m llama_cpp.server``, installed by build.sh into ``peers/lcp-venv``) runs
as a third target.  Every target gets one unreported warm-up request first.

Extra comparisons:

* every scenario gets a scheduler-efficiency table per target: the engine time its work
  needs at the capacity ``llama-batched-bench`` measures just before and just after each run
  (the best of the two, ``capacity.csv`` beside the run's results) over the time the server
  had work (uma_trio/loadgen/efficiency.py);
* ``scaling`` and ``scaling_background`` (the same streams in the background lane) also
  run ``llama-batched-bench`` (the engine's ceiling, no server) at the same batch sizes;
* ``mixed`` and ``storm`` also get, per run, the most of the background prompts any schedule
  within the latency guard could read by twice llama-server's completion of each
  (benches/guard_bound.py);
* ``each_app_separate`` runs the mixed load with one server process per client
  (``llama-server --parallel 1`` each, every one loading the model) against one
  shared uma-trio, and compares aggregate tokens/s and total RSS;
* ``long_ctx`` (the seeds' benchmark B) is an engine-level sweep over KV types, not a
  load-generator suite: it runs in ``benches/long_ctx.py``, and this script says so.

    python benches/compare.py [--scenarios mixed scaling ...] [--reps N] [--peers DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import guard_bound
import httpx
import msgspec
import psutil
import trio
from bench_output import free_port
from cpu_steal import StealSampler
from prometheus_client.parser import text_string_to_metric_families

from uma_trio.loadgen import Scenario, ScenarioResult, load_suite, run_scenario
from uma_trio.loadgen.bench import (
    SUMMARY_FIELDS,
    run_bench,
    side_by_side,
    summary_rows,
    write_csv,
    write_results,
)
from uma_trio.loadgen.efficiency import Capacity, best_of, busy_seconds, efficiency, ideal_seconds, needed_for
from uma_trio.loadgen.repeats import median_rows, rep_ratios, spread_line
from uma_trio.loadgen.targets import OpenAITarget, Target, UmaTarget
from uma_trio.model_files import ensure_default_model

ROOT = Path(__file__).resolve().parent
SCENARIOS = ROOT / "scenarios"
DEFAULT_PEERS = Path(os.environ.get("UMA_CACHE_DIR", Path.home() / ".cache" / "uma-trio")) / "peers"
THREADS = os.cpu_count() or 1


@dataclass(frozen=True)
class Setup:
    slots: int  # parallel sequences: uma-trio --max-sessions, llama-server --parallel
    n_ctx: int  # KV cells per request (llama-server gets slots * n_ctx in all)


SETUPS = {
    "mixed": Setup(slots=4, n_ctx=4096),
    "storm": Setup(slots=4, n_ctx=8192),
    "agents": Setup(slots=6, n_ctx=1024),
    "scaling": Setup(slots=16, n_ctx=1024),
    "scaling_background": Setup(slots=16, n_ctx=1024),
    "ipc": Setup(slots=4, n_ctx=1024),
    "ttft_long": Setup(slots=4, n_ctx=2048),
    "chat_beside_long": Setup(slots=4, n_ctx=2048),
}


def wait_healthy(
    url: str, process: subprocess.Popen[bytes], what: str, timeout: float = 120, path: str = "/v1/models"
) -> None:
    """Until ``url + path`` answers 200; SystemExit if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not become healthy in {timeout:g} s")


def gc_line(url: str) -> str:
    """The daemon's garbage-collector pauses (docs/METRICS.md "process"): a long one is a gap
    every stream sees at once."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    kinds = {s.labels["kind"]: s.value for s in samples if s.name == "uma_gc_collections_total"}
    value = {s.name: s.value for s in samples if not s.labels}
    return (
        f"uma-trio's garbage collector: {sum(kinds.values()):.0f} collections ({kinds['full']:.0f} full), "
        f"{value['uma_gc_pause_seconds_total'] * 1000:.1f} ms in all, "
        f"the longest {value['uma_gc_pause_max_seconds'] * 1000:.1f} ms\n"
    )


def rss_bytes(process: subprocess.Popen[bytes]) -> int:
    try:
        return int(psutil.Process(process.pid).memory_info().rss)
    except psutil.Error:
        return 0


@contextmanager
def running(
    command: Sequence[str], url: str, what: str, log: Path, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` started (in ``cwd``: ``python -m uma_trio`` there imports that checkout's
    package) and healthy; stopped on exit."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            wait_healthy(url, process, what)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def uma_command(setup: Setup, sock: Path, port: int, trace: Path | None = None) -> list[str]:
    prompt_limit = str(setup.n_ctx)
    return [
        sys.executable, "-m", "uma_trio", "serve", "--socket", str(sock), "--http", f"127.0.0.1:{port}",
        "--n-ctx", str(setup.n_ctx), "--max-sessions", str(setup.slots), "--max-prompt-tokens", prompt_limit,
        "--threads", str(THREADS), "--log-level", "warning",
        *(["--tick-trace", str(trace)] if trace is not None else []),
    ]  # fmt: skip


def llama_server_command(
    peers: Path, model: Path, setup: Setup, port: int, slots: int | None = None
) -> list[str]:
    slots = slots or setup.slots
    return [
        str(peers / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-c", str(slots * setup.n_ctx), "-np", str(slots), "-t", str(THREADS), "-tb", str(THREADS),
    ]  # fmt: skip


def llama_cpp_python_command(peers: Path, model: Path, setup: Setup, port: int) -> list[str]:
    """llama-cpp-python's own server: one ``Llama`` object, one request at a time."""
    return [
        str(peers / "lcp-venv" / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(setup.n_ctx),
        "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
    ]  # fmt: skip


LLAMA_CPP_PYTHON_SCENARIOS = ("mixed", "ipc")  # where a one-request-at-a-time server applies


def batched_bench_rows(
    peers: Path, model: Path, sizes: Sequence[int], prompts: Sequence[int], tokens: int
) -> list[tuple[int, int, float, float]]:
    """``llama-batched-bench``'s rows: (prompt length, sequences, S_PP, S_TG) in tokens/s."""
    command = [
        str(peers / "llama-batched-bench"), "-m", str(model),
        "-c", str(max(sizes) * (max(prompts) + tokens)), "-b", "2048", "-ub", "512",
        "-npp", ",".join(map(str, prompts)), "-ntg", str(tokens),
        "-npl", ",".join(map(str, sizes)), "-t", str(THREADS), "-tb", str(THREADS),
    ]  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"[0-9.]+", c) for c in cells[:8]):
            rows.append((int(cells[0]), int(cells[2]), float(cells[5]), float(cells[7])))  # PP, B, S_PP, S_TG
    return rows


def batched_bench(
    peers: Path, model: Path, sizes: Sequence[int], prompt: int, tokens: int
) -> dict[int, float]:
    """Decode tokens/s of ``llama-batched-bench`` (S_TG) for each batch size."""
    return {b: s_tg for _, b, _, s_tg in batched_bench_rows(peers, model, sizes, [prompt], tokens)}


def capacity_points(name: str) -> tuple[list[int], list[int]]:
    """The prompt lengths and decoder counts a run of suite ``name`` is priced at: prompts up
    to its longest (the 8,000-token one alone takes a minute), and every decoder count, which
    guard_bound also reads as the step of a batch that wide (a prompt token beside the chats
    is a batch column like a decode token)."""
    runs = load_suite(SCENARIOS / f"{name}.json").runs
    longest = max((c.prompt_tokens for run in runs for c in run.expanded().clients), default=128)
    lengths = [n for n in (128, 512, 2048, 8000) if n < 2 * longest] or [128]
    return lengths, [1, 2, 3, 4, 5, 6, 8, 16]


def capacity_pass(peers: Path, model: Path, lengths: Sequence[int], sizes: Sequence[int]) -> Capacity:
    """One ``llama-batched-bench`` pass: prefill tokens/s by prompt length at one sequence,
    decode tokens/s by sequences decoding together."""
    prefill = {pp: s_pp for pp, _, s_pp, _ in batched_bench_rows(peers, model, [1], lengths, 1)}
    decode = batched_bench(peers, model, sizes, prompt=32, tokens=128)
    return Capacity(prefill=prefill, decode=decode)


def write_capacity(capacity: Capacity, out: Path) -> None:
    rows = [{"kind": "prefill", "n": n, "tok_s": v} for n, v in capacity.prefill.items()]
    rows += [{"kind": "decode", "n": n, "tok_s": v} for n, v in capacity.decode.items()]
    write_csv(out / "capacity.csv", rows, ["kind", "n", "tok_s"])


def efficiency_table(reps: Sequence[Rep]) -> str:
    """Per run and target, the engine time its work needs (at that run's own capacity) over
    the time it had work; with several repetitions a line each, then their median."""
    lines = [
        "\n| run | target | busy s | ideal s (batched-bench) | scheduler efficiency |",
        "| --- | --- | --- | --- | --- |",
    ]
    shares: dict[tuple[str, str], list[float]] = {}
    for index, rep in enumerate(reps):
        capacity = rep.capacity
        for result in rep.results:
            prompts = {c.name: c.prompt_tokens for c in result.scenario.expanded().clients}
            busy = busy_seconds(result.records)
            ideal = ideal_seconds(result.records, capacity, prompts)
            share = efficiency(result.records, capacity, prompts)
            if share is not None:
                shares.setdefault((result.scenario.name, result.target), []).append(share)
            run = result.scenario.name if len(reps) == 1 else f"{result.scenario.name} (run {index + 1})"
            lines.append(f"| {run} | {result.target} | {busy:.2f} | {ideal:.2f} | {share} |")
    if len(reps) > 1:
        for (run, target), values in shares.items():
            lines.append(f"| {run} (median) | {target} | | | {statistics.median(values):.3f} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Rep:
    """One run of a scenario on freshly started servers."""

    results: list[ScenarioResult]
    steal: str
    rss: dict[str, int]
    gc: str
    out: Path  # where its results and uma-trio's tick trace are
    capacity: Capacity  # the engine's, measured just before and just after this run


def guard_bound_table(runs: Sequence[Path]) -> str:
    """For each run of a scenario with background prompts, the most of them any schedule within
    the latency guard reads by each one's deadline (twice llama-server's completion of it), the
    chats kept at their pace (benches/guard_bound.py)."""
    lines = [
        "\nWhat the latency guard leaves the background prompts by 2 × llama-server's completion "
        "(`benches/guard_bound.py`: every figure in the scheduler's favour but the chats' own pace; "
        '"short": no scheduler within the guard that keeps the chats at that pace meets the deadline '
        "on this machine):\n",
        "| run | deadline | prompt tokens due | the most any schedule reads | of which beside the chats "
        "| verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for index, run in enumerate(runs):
        try:
            rows = guard_bound.compare_rows(run)
        except Exception as exc:
            lines.append(f"| {index + 1} | | | | | not computed: {exc!r} |")
            continue
        for r in rows:
            lines.append(
                f"| {index + 1} | {r['deadline']} | {r['needed_tokens']} | {r['room_tokens']} "
                f"| {r['beside_chats_gain']} | {r['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def deadline_table(reps: Sequence[Rep], ratio: float = 2.0) -> str:
    """For each run, what the background deadline (``ratio`` × llama-server's completion of the
    prompt uma-trio finished last) asks of the whole run: where that prompt cannot be read
    beside the chats (the guard-bound table's "beside the chats" is short of it), it ends after
    them, so the whole load is due by then: its engine time at the run's capacity over the time
    to the deadline is the efficiency a server needs (uma_trio/loadgen/efficiency.py
    ``needed_for``), set beside what each server achieved."""
    lines = [
        f"\nWhat the background deadline ({ratio:g} × llama-server's completion of the prompt that "
        "ends last) asks of the whole run, if that prompt ends after the chats: the load's engine "
        "time at capacity over the time from the first request to the deadline (above 1.0 no "
        "scheduler on this engine meets it):\n",
        "| run | due (s after the first request) | the load at capacity (s) | efficiency needed "
        "| uma-trio's | llama-server's | background completion, uma-trio / llama-server |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, rep in enumerate(reps):
        mixed = [r for r in rep.results if not r.scenario.name.endswith("-alone")]
        uma = next((r for r in mixed if r.target == "uma-trio"), None)
        peer = next((r for r in mixed if r.target == "llama-server"), None)
        if uma is None or peer is None:
            continue
        prompts = {c.name: c.prompt_tokens for c in uma.scenario.expanded().clients}
        ended = [r for r in uma.records if r.lane == "background" and r.ok and r.ended is not None]
        theirs = {(r.client, r.index): r for r in peer.records if r.ok and r.ended is not None}
        last = max(ended, key=lambda r: r.ended or 0.0, default=None)
        match = theirs.get((last.client, last.index)) if last is not None else None
        if last is None or last.ended is None or match is None or match.ended is None:
            lines.append(f"| {index + 1} | | | | | | not computed: no prompt both servers completed |")
            continue
        peer_s = match.ended - match.sent
        due = last.sent + ratio * peer_s
        done = [r for r in uma.records if r.ended is not None]  # as needed_for counts them
        first = min(r.sent for r in done)
        ideal = ideal_seconds(done, rep.capacity, prompts)
        figures = (
            needed_for(uma.records, rep.capacity, prompts, due),
            efficiency(uma.records, rep.capacity, prompts),
            efficiency(peer.records, rep.capacity, prompts),
        )
        shown = " | ".join("—" if f is None else str(f) for f in figures)
        took = (last.ended - last.sent) / peer_s  # not `ratio`: the next run's deadline reads it
        lines.append(f"| {index + 1} | {due - first:.2f} | {ideal:.2f} | {shown} | {took:.2f} |")
    return "\n".join(lines) + "\n"


def run_servers(name: str, args: argparse.Namespace, model: Path, out: Path, rep: int) -> Rep:
    """Scenario ``name`` on a fresh uma-trio and llama-server (and llama-cpp-python's server
    where it applies), the targets' order alternating from one repetition to the next so
    neither always runs first; results under ``out`` (``out/run-K`` with several)."""
    setup = SETUPS[name]
    if args.reps > 1:
        out = out / f"run-{rep + 1}"
    # The engine's capacity on both sides of the run, so its efficiency is priced at the
    # machine's speed of those minutes: this VM drifts by tens of percent over a command, and
    # one capacity measured at the start read a slower VM as a scheduler's idle time.
    lengths, sizes = capacity_points(name)
    before = capacity_pass(args.peers, model, lengths, sizes)
    with tempfile.TemporaryDirectory(prefix="uma-cmp-") as tmp, ExitStack() as stack:
        sock, uma_port, peer_port = Path(tmp) / "u.sock", free_port(), free_port()
        uma_url, peer_url = f"http://127.0.0.1:{uma_port}", f"http://127.0.0.1:{peer_port}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "ticks.jsonl").unlink(missing_ok=True)  # the trace appends
        command = uma_command(setup, sock, uma_port, out / "ticks.jsonl")
        uma = stack.enter_context(running(command, uma_url, "uma-trio", out / "uma.log"))
        peer = stack.enter_context(
            running(llama_server_command(args.peers, model, setup, peer_port), peer_url, "llama-server",
                    out / "llama-server.log")
        )  # fmt: skip
        targets: list[Target] = [UmaTarget(sock, "uma-trio")]
        if name == "ipc":
            targets.append(OpenAITarget(uma_url, "uma-trio-http"))
        targets.append(OpenAITarget(peer_url, "llama-server"))
        rss_of = {"uma-trio": uma, "llama-server": peer}
        if name in LLAMA_CPP_PYTHON_SCENARIOS and (args.peers / "lcp-venv").is_dir():
            lcp_port = free_port()
            lcp_url = f"http://127.0.0.1:{lcp_port}"
            rss_of["llama-cpp-python"] = stack.enter_context(
                running(llama_cpp_python_command(args.peers, model, setup, lcp_port), lcp_url,
                        "llama-cpp-python server", out / "llama-cpp-python.log")
            )  # fmt: skip
            targets.append(OpenAITarget(lcp_url, "llama-cpp-python"))
        order = targets if rep % 2 == 0 else targets[::-1]
        results, steal = run_suite(name, order)
        # The tables keep uma-trio first whichever ran first.
        results.sort(key=lambda r: [t.label for t in targets].index(r.target))
        rss = {label: rss_bytes(process) for label, process in rss_of.items()}
        gc = gc_line(uma_url)
    capacity = best_of([before, capacity_pass(args.peers, model, lengths, sizes)])
    write_capacity(capacity, out)
    write_results(results, out)
    if args.reps > 1:
        steal = f"run {rep + 1}: {steal}"
    return Rep(results=results, steal=steal, rss=rss, gc=gc, out=out, capacity=capacity)


def run_suite(suite_name: str, targets: list[Target]) -> tuple[list[ScenarioResult], str]:
    """The suite on the targets (each scenario on every one in turn), and a line saying how
    much CPU time the hypervisor took during each run (a step 4x its usual length with nothing
    in it is usually that)."""
    suite = load_suite(SCENARIOS / f"{suite_name}.json")

    async def bench() -> tuple[list[ScenarioResult], float]:
        # The loadgen's times are trio's clock: perf_counter plus an offset of trio's own.
        offset = trio.current_time() - time.perf_counter()
        return await run_bench(suite, targets), offset

    with StealSampler() as steal:
        results, offset = trio.run(bench)
    parts = []
    for r in results:
        seconds = steal.during(r.started - offset, r.finished - offset)
        share = seconds / max((r.finished - r.started) * THREADS, 1e-9)
        parts.append(f"{r.target} {r.scenario.name} {seconds:.2f} s ({100 * share:.1f} %)")
    head = "CPU steal (taken by the hypervisor, of all cores' time) during each run: "
    return results, head + ", ".join(parts) + "\n"


async def run_separate(scenario: Scenario, targets: Sequence[Target]) -> ScenarioResult:
    """Each client of ``scenario`` on its own target (its own server process), all at once."""
    clients = scenario.expanded().clients
    parts: list[ScenarioResult] = []

    async def one(index: int) -> None:
        alone = msgspec.structs.replace(scenario, name=scenario.name, clients=[clients[index]])
        parts.append(await run_scenario(targets[index], alone))

    async with trio.open_nursery() as nursery:
        for index in range(len(clients)):
            nursery.start_soon(one, index)
    records = [r for part in parts for r in part.records]
    return ScenarioResult(
        scenario=scenario, started=min(p.started for p in parts), finished=max(p.finished for p in parts),
        records=records, target="separate",
    )  # fmt: skip


def table_markdown(title: str, rows: list[dict[str, Any]]) -> str:
    header, body = side_by_side(rows)
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    choices = [*SETUPS, "each_app_separate", "long_ctx"]
    parser.add_argument("--scenarios", nargs="+", default=choices, choices=choices)
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "compare")
    parser.add_argument(
        "--reps", type=int, default=1,
        help="run each scenario this many times on fresh servers; the tables give each figure's median",
    )  # fmt: skip
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if not (args.peers / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.peers}: run `bash benches/peers/build.sh` first")
    model = ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    tables: list[str] = [
        f"Machine: {THREADS} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; model {model.name}; "
        f"peers: {(args.peers / 'VERSION').read_text().splitlines()[0]}\n"
    ]
    for name in args.scenarios:
        print(f"== {name}", flush=True)
        if name == "long_ctx":
            message = (
                "long_ctx (the seeds' benchmark B) sweeps KV types and context depths on the engine "
                "itself: run `python benches/long_ctx.py` (docs/BENCHMARKS.md)."
            )
            print(message)
            tables.append(f"### long_ctx\n\n{message}\n")
            continue
        if name == "each_app_separate":
            tables.append(each_app_separate(args.peers, model, args.out))
            continue
        reps = [run_servers(name, args, model, args.out / name, rep) for rep in range(args.reps)]
        per_rep_rows = [summary_rows(rep.results) for rep in reps]
        rows = per_rep_rows[0] if args.reps == 1 else median_rows(per_rep_rows)
        if args.reps > 1:
            write_csv(args.out / name / "summary.csv", rows, SUMMARY_FIELDS)
        rss, gc, steal = reps[-1].rss, reps[-1].gc, "".join(rep.steal for rep in reps)
        extra = efficiency_table(reps)
        if args.reps > 1:
            extra += "\n" + spread_line(
                rep_ratios(per_rep_rows, "uma-trio", "llama-server"), "uma-trio / llama-server tokens/s"
            )
        if name in ("mixed", "storm"):
            extra += guard_bound_table([rep.out for rep in reps]) + deadline_table(reps)
        if name in ("scaling", "scaling_background"):
            sizes = [len(r.scenario.expanded().clients) for r in reps[0].results if r.target == "uma-trio"]
            ceiling = batched_bench(args.peers, model, sizes, prompt=32, tokens=128)
            extra += "\n| streams | uma-trio tok/s | llama-server tok/s | llama-batched-bench S_TG tok/s |" \
                    "\n| --- | --- | --- | --- |\n"  # fmt: skip
            for size in sizes:
                got = {r["target"]: r["tokens_per_s"] for r in rows
                       if r["scenario"] == f"streams-{size}" and r["lane"] == "all"}  # fmt: skip
                extra += (
                    f"| {size} | {got.get('uma-trio')} | {got.get('llama-server')} | {ceiling.get(size)} |\n"
                )
            ceiling_rows = [{"streams": k, "s_tg_tok_s": v} for k, v in ceiling.items()]
            write_csv(args.out / name / "batched_bench.csv", ceiling_rows, ["streams", "s_tg_tok_s"])
        rss_line = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in rss.items())
        title = name if args.reps == 1 else f"{name} (medians of {args.reps} runs)"
        tables.append(table_markdown(title, rows) + f"\nRSS at the end: {rss_line}\n{gc}{steal}{extra}")
        print(tables[-1], flush=True)
    (args.out / "tables.md").write_text("\n".join(tables))
    print(f"wrote {args.out / 'tables.md'}")


def each_app_separate(peers: Path, model: Path, out_root: Path) -> str:
    """The mixed load (3 chats + 1 background job) served by one uma-trio, then by one
    llama-server per client (each loading the model), all clients at once."""
    scenario = load_suite(SCENARIOS / "mixed.json").runs[0]
    clients = scenario.expanded().clients
    setup = Setup(slots=len(clients), n_ctx=4096)
    out = out_root / "each_app_separate"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="uma-cmp-") as tmp, ExitStack() as stack:
        sock, port = Path(tmp) / "u.sock", free_port()
        uma = stack.enter_context(
            running(uma_command(setup, sock, port), f"http://127.0.0.1:{port}", "uma-trio", out / "uma.log")
        )
        shared = trio.run(run_scenario, UmaTarget(sock, "uma-trio (one, shared)"), scenario)
        shared_rss = rss_bytes(uma)
    with ExitStack() as stack:
        ports = [free_port() for _ in clients]
        servers = [
            stack.enter_context(
                running(
                    llama_server_command(peers, model, setup, p, slots=1),
                    f"http://127.0.0.1:{p}",
                    f"llama-server {i}",
                    out / f"llama-server-{i}.log",
                )
            )
            for i, p in enumerate(ports)
        ]
        targets = [OpenAITarget(f"http://127.0.0.1:{p}", f"llama-server-{i}") for i, p in enumerate(ports)]
        separate = trio.run(run_separate, scenario, targets)
        separate = msgspec.structs.replace(separate, target=f"{len(clients)} x llama-server -np 1")
        separate_rss = sum(rss_bytes(s) for s in servers)
    results = [shared, separate]
    rows = summary_rows(results)
    write_results(results, out)
    totals = [r for r in rows if r["lane"] == "all"]
    ratio = totals[0]["tokens_per_s"] / totals[1]["tokens_per_s"] if totals[1]["tokens_per_s"] else math.nan
    summary = (
        f"\nAggregate tokens/s: shared {totals[0]['tokens_per_s']}, separate {totals[1]['tokens_per_s']} "
        f"(shared / separate = {ratio:.2f}). Total RSS: shared {shared_rss / 2**20:.0f} MiB, "
        f"separate {separate_rss / 2**20:.0f} MiB ({separate_rss / max(shared_rss, 1):.2f} x).\n"
    )
    text = table_markdown("each_app_separate", rows) + summary
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
