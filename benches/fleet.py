"""Daemons behind LiteLLM's proxy (issue 23): the same load on one daemon directly, on one
daemon through the proxy (the proxy's own cost per request), and on two daemons through the
proxy (docs/fleet/litellm-config.yaml as shipped; its second entry gets the second daemon, or
the same daemon twice for the one-daemon run).

Load: six chat clients (64-token prompts, 48 tokens, 3 requests each, 0.2 s think time) and
two background clients (1,000-token prompts, 32 tokens), all at once, through
``/v1/completions``.  On one machine two daemons share its cores (``--threads`` split between
them), so this measures what the proxy and the split cost here; on a LAN each daemon has a
machine of its own.  Writes ``OUT/fleet.csv``, ``OUT/fleet.md`` and ``OUT/fleet.png``.

    python benches/fleet.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

import trio
from bench_output import free_port, save_figure, write_csv
from compare import running, wait_healthy

from uma_trio.loadgen import Scenario, lane_stats, run_scenario
from uma_trio.loadgen.scenario import ClientSpec
from uma_trio.loadgen.stats import tokens_per_s
from uma_trio.loadgen.targets import OpenAITarget

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "docs" / "fleet" / "litellm-config.yaml"
MASTER_KEY = "sk-fleet-bench-0123456789abcdef"
CORES = os.cpu_count() or 1
SCENARIO = Scenario(
    name="fleet",
    clients=[
        ClientSpec(
            name="chat", prompt_tokens=64, max_tokens=48, requests=3, think_s=0.2, copies=6, stagger_s=0.1
        ),
        ClientSpec(
            name="bulk", lane="background", prompt_tokens=1000, max_tokens=32, copies=2, stagger_s=0.5
        ),
    ],
)


def daemon(tmp: Path, name: str, port: int, threads: int) -> list[str]:
    return [
        sys.executable, "-m", "uma_trio", "serve", "--socket", str(tmp / f"{name}.sock"),
        "--http", f"127.0.0.1:{port}", "--threads", str(threads), "--max-sessions", "8",
        "--n-ctx", "2048", "--log-level", "warning",
    ]  # fmt: skip


def proxy(port: int, a: int, b: int) -> tuple[list[str], dict[str, str]]:
    litellm = shutil.which("litellm")
    if litellm is None:
        raise SystemExit("LiteLLM's proxy is not installed: pip install 'uma-trio[fleet]'")
    env = {
        **os.environ, "UMA_A_URL": f"http://127.0.0.1:{a}/v1", "UMA_B_URL": f"http://127.0.0.1:{b}/v1",
        "UMA_API_KEY": "none", "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }  # fmt: skip
    return [litellm, "--config", str(CONFIG), "--port", str(port)], env


def figures(label: str, result: Any) -> dict[str, Any]:
    chats, bulk = lane_stats(result, "interactive"), lane_stats(result, "background")
    return {
        "setup": label,
        "agg_tok_s": round(tokens_per_s(result), 2),
        "chat_ttft_p50_ms": round(chats.ttft_p50 * 1e3, 1),
        "chat_gap_p95_ms": round(chats.gap_p95 * 1e3, 2),
        "chat_gap_max_ms": round(chats.gap_max * 1e3, 2),
        "chat_completion_p50_s": round(chats.completion_p50, 3),
        "bulk_completion_max_s": round(bulk.completion_max, 3),
        "failed": chats.failed + bulk.failed,
    }


def run(out: Path) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="uma-fleet-") as tmp_name:
        tmp = Path(tmp_name)
        # One daemon, every core: directly, then through the proxy (both entries on it).
        with ExitStack() as stack:
            port, gate = free_port(), free_port()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(running(daemon(tmp, "one", port, CORES), url, "uma-trio", out / "one.log"))
            rows.append(
                figures("1 daemon, direct", trio.run(run_scenario, OpenAITarget(url, "direct"), SCENARIO))
            )
            command, env = proxy(gate, port, port)
            with (out / "proxy-one.log").open("wb") as log:
                stack.enter_context(_proxy(command, env, gate, log))
                target = OpenAITarget(f"http://127.0.0.1:{gate}", "proxy", api_key=MASTER_KEY, model="smol")
                rows.append(figures("1 daemon, through LiteLLM", trio.run(run_scenario, target, SCENARIO)))
        # Two daemons, the cores split between them, through the proxy.
        with ExitStack() as stack:
            a, b, gate = free_port(), free_port(), free_port()
            share = max(1, CORES // 2)
            for name, port in (("a", a), ("b", b)):
                url = f"http://127.0.0.1:{port}"
                stack.enter_context(running(daemon(tmp, name, port, share), url, name, out / f"{name}.log"))
            command, env = proxy(gate, a, b)
            with (out / "proxy-two.log").open("wb") as log:
                stack.enter_context(_proxy(command, env, gate, log))
                target = OpenAITarget(f"http://127.0.0.1:{gate}", "proxy", api_key=MASTER_KEY, model="smol")
                rows.append(figures("2 daemons, through LiteLLM", trio.run(run_scenario, target, SCENARIO)))
    return rows


@contextmanager
def _proxy(
    command: list[str], env: dict[str, str], port: int, log: IO[bytes]
) -> Iterator[subprocess.Popen[bytes]]:
    """LiteLLM's proxy, once it answers its liveness check."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, "LiteLLM's proxy", 90, path="/health/liveliness")
        yield process
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fleet")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args.out)
    fields = list(rows[0])
    write_csv(args.out / "fleet.csv", rows, fields)
    lines = ["| " + " | ".join(fields) + " |", "|" + " --- |" * len(fields)]
    lines += ["| " + " | ".join(str(r[f]) for f in fields) + " |" for r in rows]
    (args.out / "fleet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    direct, proxied, two = rows
    overhead = proxied["chat_ttft_p50_ms"] - direct["chat_ttft_p50_ms"]
    print(f"\nproxy overhead on a chat's TTFT p50: {overhead:+.1f} ms; "
          f"2 daemons / 1 daemon through the proxy: tok/s {two['agg_tok_s'] / proxied['agg_tok_s']:.2f}x, "
          f"chat gap p95 {two['chat_gap_p95_ms'] / proxied['chat_gap_p95_ms']:.2f}x")  # fmt: skip
    plot(rows, args.out / "fleet.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r["setup"].replace(", ", "\n") for r in rows]
    for ax, key, title in (
        (axes[0], "agg_tok_s", "aggregate tokens/s"),
        (axes[1], "chat_ttft_p50_ms", "chat TTFT p50 (ms)"),
        (axes[2], "chat_gap_p95_ms", "chat gap p95 (ms)"),
    ):
        ax.bar(names, [r[key] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("uma-trio behind LiteLLM's proxy, one 2-core machine")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
