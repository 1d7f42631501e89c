"""Two models on one machine: chats on model A while a background job runs on model B.

Issue 22's benchmark.  The same load runs on one uma-trio serving both models (``--models-dir``;
both loaded before the runs) and on the status quo for two models, one llama-server per model
(the same build as benches/compare.py's, same slots, context and threads each):

* ``alone``: three chat clients on model A (64-token prompts, 96 tokens each, 4 requests, 0.3 s
  think time), nothing else;
* ``mixed``: the same chats, and from t = 1 s one background client on model B with a
  2,000-token prompt (16 tokens).

With ``--job-lane interactive`` model B's job is a chat instead: a long pasted prompt (3,000
tokens), whose reading must fit the gaps of model A's streams as a new chat's prompt fits
between one model's streams (docs/SCHEDULER.md "Several models"; its TTFT is reported too).

Model B is a copy of the default model under another name, so both systems load two models of
the same size.  Figures: the chats' inter-token gaps (p50 / p95 / max) against their own alone
run, their TTFT, the background job's completion time, aggregate tokens/s, and the resident
memory of everything serving (uma-trio's one process; the two llama-servers together).
Writes ``OUT/multi_model.csv``, ``OUT/multi_model.md`` and ``OUT/multi_model.png``
(``multi_model_interactive.*`` with ``--job-lane interactive``).

    python benches/multi_model.py [--peers DIR] [--out DIR] [--job-lane interactive]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from bench_output import free_port, save_figure, write_csv
from compare import DEFAULT_PEERS, Setup, llama_server_command, rss_bytes, run_separate, running, uma_command

from uma_trio.loadgen import Scenario, ScenarioResult, lane_stats, run_scenario
from uma_trio.loadgen.scenario import ClientSpec, Lane
from uma_trio.loadgen.stats import tokens_per_s
from uma_trio.loadgen.targets import OpenAITarget
from uma_trio.model_files import ensure_default_model

SETUP = Setup(slots=4, n_ctx=4096)
MODEL_B = "SmolLM2-second"  # the default model's copy, under its own name


def scenarios(model_a: str, job_lane: Lane = "background") -> tuple[Scenario, Scenario]:
    chats = ClientSpec(
        name="chat", prompt_tokens=64, max_tokens=96, requests=4, think_s=0.3, copies=3, stagger_s=0.2,
        model=model_a,
    )  # fmt: skip
    prompt = 2000 if job_lane == "background" else 3000
    bulk = ClientSpec(
        name="bulk", lane=job_lane, prompt_tokens=prompt, max_tokens=16, start_s=1.0, model=MODEL_B
    )
    return Scenario(name="alone", clients=[chats]), Scenario(name="mixed", clients=[chats, bulk])


def of_clients(result: ScenarioResult, chats: bool) -> ScenarioResult:
    """The records of model A's chats (``chats``) or of model B's job: with an interactive job
    both are in the interactive lane."""
    records = [r for r in result.records if (r.client != "bulk") == chats]
    return msgspec.structs.replace(result, records=records)


def figures(system: str, alone: ScenarioResult, mixed: ScenarioResult, rss: int) -> dict[str, Any]:
    base, chats = lane_stats(alone, "interactive"), lane_stats(of_clients(mixed, True), "interactive")
    job = of_clients(mixed, False)
    bulk = lane_stats(job, job.records[0].lane)
    return {
        "system": system,
        "chat_gap_p50_ms": round(chats.gap_p50 * 1e3, 2),
        "chat_gap_p95_ms": round(chats.gap_p95 * 1e3, 2),
        "chat_gap_max_ms": round(chats.gap_max * 1e3, 2),
        "alone_gap_p95_ms": round(base.gap_p95 * 1e3, 2),
        "p95_over_alone": round(chats.gap_p95 / base.gap_p95, 3),
        "max_over_alone_p95": round(chats.gap_max / base.gap_p95, 3),
        "chat_ttft_p50_ms": round(chats.ttft_p50 * 1e3, 1),
        "alone_ttft_p50_ms": round(base.ttft_p50 * 1e3, 1),
        "bulk_ttft_s": round(bulk.ttft_p50, 3),
        "bulk_completion_s": round(bulk.completion_max, 3),
        "chats_failed": chats.failed,
        "bulk_failed": bulk.failed,
        "agg_tok_s": round(tokens_per_s(mixed), 2),
        "rss_mib": round(rss / 2**20, 1),
    }


def run_uma(model: Path, models_dir: Path, out: Path, alone: Scenario, mixed: Scenario) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="uma-mm-") as tmp, ExitStack() as stack:
        sock, port = Path(tmp) / "u.sock", free_port()
        command = [*uma_command(SETUP, sock, port), "--model", str(model), "--models-dir", str(models_dir),
                   "--keep-alive", "3600"]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        uma = stack.enter_context(running(command, url, "uma-trio", out / "uma.log"))
        httpx.post(f"{url}/load", json={"model": MODEL_B}, timeout=120).raise_for_status()
        target = OpenAITarget(url, "uma-trio")
        first = trio.run(run_scenario, target, alone)
        second = trio.run(run_scenario, target, mixed)
        return figures("uma-trio, one daemon, two models", first, second, rss_bytes(uma))


def run_llama_servers(
    peers: Path, model: Path, copy: Path, out: Path, alone: Scenario, mixed: Scenario
) -> dict[str, Any]:
    with ExitStack() as stack:
        ports = free_port(), free_port()
        servers, targets = [], []
        for path, port, name in ((model, ports[0], "llama-server-a"), (copy, ports[1], "llama-server-b")):
            url = f"http://127.0.0.1:{port}"
            command = llama_server_command(peers, path, SETUP, port)
            servers.append(stack.enter_context(running(command, url, name, out / f"{name}.log")))
            targets.append(OpenAITarget(url, name))
        a, b = targets
        first = trio.run(run_scenario, a, alone)
        clients = mixed.expanded().clients
        second = trio.run(run_separate, mixed, [a if c.model != MODEL_B else b for c in clients])
        return figures("two llama-servers, one per model", first, second, sum(rss_bytes(s) for s in servers))


def plot(rows: list[dict[str, Any]], path: Path, job: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r["system"].split(",")[0] for r in rows]
    for ax, key, title in (
        (axes[0], "p95_over_alone", "chat gap p95 / alone p95"),
        (axes[1], "max_over_alone_p95", "chat gap max / alone p95"),
        (axes[2], "bulk_completion_s", "model B's job completion (s)"),
    ):
        ax.bar(names, [r[key] for r in rows], color=["tab:blue", "tab:orange"])
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"Chats on model A, {job} on model B, one machine")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "multi_model"
    )
    parser.add_argument(
        "--job-lane", choices=("background", "interactive"), default="background",
        help="model B's job: a 2,000-token background job, or a chat with a 3,000-token prompt",
    )  # fmt: skip
    args = parser.parse_args()
    stem = "multi_model" if args.job_lane == "background" else "multi_model_interactive"
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_default_model()
    with tempfile.TemporaryDirectory(prefix="uma-models-") as tmp:
        models_dir = Path(tmp)
        copy = models_dir / f"{MODEL_B}.gguf"
        shutil.copyfile(model, copy)
        alone, mixed = scenarios(model.name.removesuffix(".gguf"), args.job_lane)
        rows = [
            run_uma(model, models_dir, args.out, alone, mixed),
            run_llama_servers(args.peers, model, copy, args.out, alone, mixed),
        ]
    fields = list(rows[0])
    write_csv(args.out / f"{stem}.csv", rows, fields)
    lines = ["| " + " | ".join(fields) + " |", "|" + " --- |" * len(fields)]
    lines += ["| " + " | ".join(str(r[f]) for f in fields) + " |" for r in rows]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    uma, peers = rows
    ratios = {
        key: uma[key] / peers[key]
        for key in ("chat_gap_p95_ms", "chat_gap_max_ms", "bulk_ttft_s", "bulk_completion_s", "rss_mib")
    }
    print("\numa-trio / two llama-servers: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    job = "a 2,000-token background job" if args.job_lane == "background" else "a 3,000-token chat"
    plot(rows, args.out / f"{stem}.png", job)


if __name__ == "__main__":
    main()
