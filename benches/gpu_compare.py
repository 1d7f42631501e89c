"""uma-trio side by side with llama-server on a GPU machine (CUDA, Metal, Vulkan): one command.

Both servers come from the same llama.cpp build (``--bin``: the directory holding
``llama-server`` and ``llama-batched-bench``; uma-trio's llama-cpp-python is pointed at the
same libllama with ``LLAMA_CPP_LIB_PATH``), serve the same model with all layers on the GPU,
the same per-sequence context and the same number of parallel slots.  Four parts:

* ``ceiling``: ``llama-batched-bench`` (no server) at 1/4/8/16 sequences, 128-token prompts,
  256 generated: the engine's ceiling;
* ``streams``: N streamed /v1/completions at once (unique 128-token prompts, 256 tokens,
  greedy), N = 1/4/8/16: aggregate tok/s, TTFT p50, gaps;
* ``mixed``: 3 interactive chats (30-token prompts, 150 tokens, 4 turns, 0.3 s think time)
  with a 2,000-token and an 8,000-token background prompt arriving at 1 s and 2 s, and the
  same chats alone: interactive gap p50/p95/max against alone, background completion time;
* ``long``: one stream decoding 128 tokens after an 8k and a 32k prompt.

Results: ``OUT/gpu.csv`` (one row per system and measurement), ``OUT/gpu.md`` (the tables,
with ratios to llama-server, and after ``mixed`` whether any schedule within the latency guard
could finish its background prompts by 1.5× llama-server's time: benches/guard_bound.py),
``OUT/gpu.png``; raw per-run JSON in ``OUT/runs.jsonl``.

    python benches/gpu_compare.py --bin BUILD/bin --model MODEL.gguf --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import guard_bound  # benches/guard_bound.py: what the latency guard leaves the background prompts
import httpx
from compare import running  # benches/compare.py: start a server, wait for /v1/models, stop it

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "at",
    "be",
    "by",
    "this",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
]
Row = dict[str, Any]
MODEL_ID: dict[str, str] = {}  # server URL -> the model id its /v1/models names


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 2)


# -- servers --------------------------------------------------------------------------------


def llama_server_cmd(args: argparse.Namespace, slots: int, ctx_seq: int, port: int) -> list[str]:
    return [
        str(args.bin / "llama-server"), "-m", str(args.model), "-ngl", "999", "-np", str(slots),
        "-c", str(slots * ctx_seq), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
        *args.llama_arg,
    ]  # fmt: skip


def uma_cmd(args: argparse.Namespace, slots: int, ctx_seq: int, port: int, sock: Path) -> list[str]:
    return [
        sys.executable, "-m", "uma_trio", "serve", "--model", str(args.model), "--socket", str(sock),
        "--http", f"127.0.0.1:{port}", "--max-sessions", str(slots), "--n-ctx", str(ctx_seq),
        "--max-prompt-tokens", str(ctx_seq), "--max-tokens", str(ctx_seq),
        "--log-level", "info", *args.uma_arg,
    ]  # fmt: skip


# -- one streamed request -------------------------------------------------------------------


async def complete(
    client: httpx.AsyncClient, url: str, text: str, max_tokens: int, *, background: bool = False
) -> Row:
    if url not in MODEL_ID:
        MODEL_ID[url] = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    body = {
        "model": MODEL_ID[url], "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    headers = {"X-Uma-Priority": "background"} if background else {}
    sent = time.perf_counter()
    chunks: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}", "sent": sent}
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            now = time.perf_counter()
            usage = obj.get("usage") or usage
            if any(ch.get("text") for ch in obj.get("choices") or []):
                chunks.append(now)
    ended = time.perf_counter()
    return {"sent": sent, "ended": ended, "chunks": chunks, "tokens": usage.get("completion_tokens") or len(chunks),
            "prompt_tokens": usage.get("prompt_tokens")}  # fmt: skip


def gaps_of(rows: Sequence[Row]) -> list[float]:
    return [b - a for r in rows for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]


def decode_rate(r: Row) -> float:
    c = r["chunks"]
    return (len(c) - 1) / (c[-1] - c[0]) if len(c) > 2 else 0.0


# -- the parts ------------------------------------------------------------------------------


async def warm_up(client: httpx.AsyncClient, url: str) -> None:
    """Requests not reported, in the shapes the parts use: a short one, four at once, and a
    prompt of some hundred tokens.  A backend that compiles its kernels on first use
    (Vulkan's pipelines) otherwise charges the compile to the first measured request: on the
    H100 over Vulkan, llama-server's first stream waited 4.9-5.6 s for its first token."""
    rng = random.Random(3)
    await complete(client, url, prompt(rng, 20), 16)
    await asyncio.gather(*(complete(client, url, prompt(rng, 127), 16) for _ in range(4)))
    await complete(client, url, prompt(rng, 400), 4)  # within the streams part's 512 cells


async def streams_part(url: str, system: str, args: argparse.Namespace, log: list[Row]) -> list[Row]:
    rows = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        rng = random.Random(7)
        await warm_up(client, url)
        for n in args.streams:
            for rep in range(args.reps):
                before = await step_overhead(client, url, system)
                t0 = time.perf_counter()
                done = await asyncio.gather(
                    *(complete(client, url, prompt(rng, 127), args.max_tokens) for _ in range(n))
                )
                ok = [r for r in done if "error" not in r]
                wall = max(r["ended"] for r in ok) - t0 if ok else 0.0
                ttfts = [r["chunks"][0] - r["sent"] for r in ok if r["chunks"]]
                gaps = gaps_of(ok)
                row = {
                    "system": system, "part": "streams", "streams": n, "rep": rep,
                    "errors": len(done) - len(ok), "agg_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2),
                    "decode_tok_s": round(sum(decode_rate(r) for r in ok), 2),
                    "ttft_ms_p50": ms(pct(ttfts, 0.5)), "gap_ms_p50": ms(pct(gaps, 0.5)),
                    "gap_ms_p95": ms(pct(gaps, 0.95)), "gap_ms_max": ms(max(gaps, default=0.0)),
                }  # fmt: skip
                row.update(overhead_delta(before, await step_overhead(client, url, system)))
                print(json.dumps(row), flush=True)
                rows.append(row)
                log.append(row)
    return rows


async def step_overhead(client: httpx.AsyncClient, url: str, system: str) -> dict[str, Any]:
    """uma-trio's engine-side step counters (METRICS.md "engine" step_overhead)."""
    if system != "uma-trio":
        return {}
    return (await client.get(url + "/health")).json()["engine"]["step_overhead"] or {}


def overhead_delta(before: dict[str, Any], after: dict[str, Any]) -> Row:
    """Steps, mean step and mean gap (results ready -> next llama_decode) over one run."""
    if not after:
        return {}
    steps = after["steps"] - before.get("steps", 0)
    gaps = after["gaps"] - before.get("gaps", 0)
    step_s = after["step_s_total"] - before.get("step_s_total", 0.0)
    gap_s = after["gap_s_total"] - before.get("gap_s_total", 0.0)
    return {
        "engine_steps": steps,
        "step_ms_mean": ms(step_s / steps) if steps else None,
        "step_gap_ms_mean": ms(gap_s / gaps) if gaps else None,
        "step_gap_share": round(gap_s / gaps / (step_s / steps), 4) if gaps and steps and step_s else None,
    }


async def chat(client: httpx.AsyncClient, url: str, seed: int, start: float) -> list[Row]:
    await asyncio.sleep(start)
    rng = random.Random(seed)
    turns = []
    for _ in range(4):
        turns.append(await complete(client, url, prompt(rng, 30), 150))
        await asyncio.sleep(0.3)
    return turns


async def mixed_part(url: str, system: str, log: list[Row]) -> list[Row]:
    rows: list[Row] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        await warm_up(client, url)
        alone = await asyncio.gather(*(chat(client, url, 100 + i, 0.1 * i) for i in range(3)))
        alone_gaps = gaps_of([t for turns in alone for t in turns])

        async def bulk(n_words: int, start: float, seed: int) -> Row:
            await asyncio.sleep(start)
            return await complete(client, url, prompt(random.Random(seed), n_words), 32, background=True)

        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(chat(client, url, 200 + i, 0.1 * i) for i in range(3)), bulk(2000, 1.0, 5), bulk(8000, 2.0, 6)
        )
        chats = [t for turns in results[:3] for t in turns]  # type: ignore[union-attr]
        gaps = gaps_of(chats)
        ttfts = [r["chunks"][0] - r["sent"] for r in chats if r["chunks"]]
        bulks: list[Row] = list(results[3:])  # type: ignore[arg-type]
        wall = max(r["ended"] for r in [*chats, *bulks]) - t0
        row = {
            "system": system, "part": "mixed",
            "gap_ms_p50": ms(pct(gaps, 0.5)), "gap_ms_p95": ms(pct(gaps, 0.95)), "gap_ms_max": ms(max(gaps)),
            "alone_gap_ms_p50": ms(pct(alone_gaps, 0.5)), "alone_gap_ms_p95": ms(pct(alone_gaps, 0.95)),
            "alone_gap_ms_max": ms(max(alone_gaps)), "ttft_ms_p50": ms(pct(ttfts, 0.5)),
            "bulk2k_s": round(bulks[0]["ended"] - bulks[0]["sent"], 3),
            "bulk8k_s": round(bulks[1]["ended"] - bulks[1]["sent"], 3),
            "bulk_prompt_tokens": [b.get("prompt_tokens") for b in bulks],
            "agg_tok_s": round(sum(r["tokens"] for r in [*chats, *bulks]) / wall, 2),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        log.append(row)
    return rows


async def long_part(url: str, system: str, depths: Sequence[int], log: list[Row]) -> list[Row]:
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await complete(client, url, prompt(random.Random(1), 20), 16)
        for depth in depths:
            r = await complete(client, url, prompt(random.Random(depth), depth - 200), 128)
            row = {
                "system": system, "part": "long", "depth": depth, "prompt_tokens": r.get("prompt_tokens"),
                "decode_tok_s": round(decode_rate(r), 2) if "error" not in r else None,
                "ttft_ms": ms(r["chunks"][0] - r["sent"]) if r.get("chunks") else None, "error": r.get("error"),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            log.append(row)
    return rows


async def run_part(part: str, url: str, system: str, args: argparse.Namespace, log: list[Row]) -> None:
    if part == "streams":
        await streams_part(url, system, args, log)
    elif part == "mixed":
        await mixed_part(url, system, log)
    else:
        await long_part(url, system, args.depths, log)


def ceiling_part(args: argparse.Namespace, log: list[Row]) -> list[Row]:
    """llama-batched-bench twice: one KV stream per sequence (its default, and llama-server's
    with explicit slots: the ceiling the targets use) and one unified stream (`-kvu`,
    uma-trio's layout on a full GPU), so the cost of the layout itself shows."""
    rows = []
    for system, extra in (("llama-batched-bench", []), ("llama-batched-bench-kvu", ["-kvu"])):
        cmd = [
            str(args.bin / "llama-batched-bench"), "-m", str(args.model), "-ngl", "999", "-c", "8192",
            "-npp", "128", "-ntg", str(args.max_tokens), "-npl", ",".join(map(str, args.streams)), "-fa", "on",
            *extra,
        ]  # fmt: skip
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit():
                rows.append(ceiling_row(cells, system))
                log.append(rows[-1])
        print(text[-2000:], flush=True)
    return rows


def ceiling_row(cells: list[str], system: str = "llama-batched-bench") -> Row:
    """One llama-batched-bench line as the servers are measured: generated tokens over the
    whole time (its S t/s counts the prompt tokens too), TTFT = the batch's prompt time."""
    _pp, tg, b, _kv, t_pp, _spp, _ttg, s_tg, t_all, _s_all = cells
    return {
        "system": system, "part": "ceiling", "streams": int(b),
        "agg_tok_s": round(int(b) * int(tg) / float(t_all), 2), "decode_tok_s": float(s_tg),
        "ttft_ms_p50": round(1000.0 * float(t_pp), 2),
    }  # fmt: skip


# -- report ---------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def report(rows: list[Row], out: Path) -> str:
    lines = ["| streams | ceiling tok/s | unified-KV ceiling | llama-server tok/s (TTFT p50 ms) |"
             " uma-trio tok/s (TTFT p50 ms) | uma / llama-server | uma / ceiling | uma / unified ceiling |"
             " TTFT ratio |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def med(system: str, part: str, key: str, **match: Any) -> float | None:
        xs = [r[key] for r in rows if r["system"] == system and r["part"] == part and r.get(key) is not None
              and all(r.get(k) == v for k, v in match.items())]  # fmt: skip
        return statistics.median(xs) if xs else None

    overhead = []
    for n in sorted({r["streams"] for r in rows if r["part"] == "streams"}):
        share = med("uma-trio", "streams", "step_gap_share", streams=n)
        overhead.append(
            f"{n} streams: uma-trio steps {med('uma-trio', 'streams', 'engine_steps', streams=n)}, step "
            f"{med('uma-trio', 'streams', 'step_ms_mean', streams=n)} ms, gap "
            f"{med('uma-trio', 'streams', 'step_gap_ms_mean', streams=n)} ms ({share})"
        )
        ceil = med("llama-batched-bench", "ceiling", "agg_tok_s", streams=n)
        kvu = med("llama-batched-bench-kvu", "ceiling", "agg_tok_s", streams=n)
        ls, us = (
            med("llama-server", "streams", "agg_tok_s", streams=n),
            med("uma-trio", "streams", "agg_tok_s", streams=n),
        )
        lt, ut = (
            med("llama-server", "streams", "ttft_ms_p50", streams=n),
            med("uma-trio", "streams", "ttft_ms_p50", streams=n),
        )
        lines.append(
            f"| {n} | {ceil} | {kvu} | {ls} ({lt}) | {us} ({ut}) | {ratio(us, ls)} | {ratio(us, ceil)} | "
            f"{ratio(us, kvu)} | {ratio(ut, lt)} |"
        )
    lines.append(
        "\nper-step overhead (results ready -> next llama_decode, share of a step):\n" + "\n".join(overhead)
    )
    for r in rows:
        if r["part"] == "mixed":
            lines.append(
                f"\nmixed, {r['system']}: interactive gap p50/p95/max {r['gap_ms_p50']}/{r['gap_ms_p95']}/"
                f"{r['gap_ms_max']} ms (alone {r['alone_gap_ms_p50']}/{r['alone_gap_ms_p95']}/{r['alone_gap_ms_max']}; "
                f"max/alone p95 {ratio(r['gap_ms_max'], r['alone_gap_ms_p95'])}, p95/alone p95 "
                f"{ratio(r['gap_ms_p95'], r['alone_gap_ms_p95'])}), TTFT p50 {r['ttft_ms_p50']} ms, background "
                f"2k {r['bulk2k_s']} s, 8k {r['bulk8k_s']} s, agg {r['agg_tok_s']} tok/s"
            )
    if any(r["part"] == "mixed" for r in rows):
        lines.extend(guard_bound.gpu_lines(out))
    for depth in sorted({r["depth"] for r in rows if r["part"] == "long"}):
        ld, ud = (
            med("llama-server", "long", "decode_tok_s", depth=depth),
            med("uma-trio", "long", "decode_tok_s", depth=depth),
        )
        lines.append(
            f"\nlong context {depth}: decode llama-server {ld} tok/s, uma-trio {ud} tok/s ({ratio(ud, ld)})"
        )
    text = "\n".join(lines)
    (out / "gpu.md").write_text(text + "\n")
    return text


def plot(rows: list[Row], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = dict.fromkeys((r["system"], r["part"]) for r in rows if r["part"] in ("ceiling", "streams"))
    for system, part in curves:
        pts: dict[int, list[float]] = {}
        for r in rows:
            if r["system"] == system and r["part"] == part:
                pts.setdefault(r["streams"], []).append(r["agg_tok_s"])
        xs = sorted(pts)
        ax.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=system)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("GPU: aggregate decode throughput")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "gpu.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("benches/results/gpu"))
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512, help="KV cells per sequence for the streams part")
    ap.add_argument("--parts", default="ceiling,streams,mixed,long")
    ap.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--systems", default="llama-server,uma-trio")
    ap.add_argument("--uma-arg", action="append", default=[], help="extra `uma-trio serve` argument")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (e.g. -sm)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(args.bin)  # uma-trio's llama_cpp loads the peers' libllama
    parts, systems = args.parts.split(","), args.systems.split(",")
    log: list[Row] = []
    sock = Path(f"/tmp/uma-gpu-{os.getpid()}") / "uma.sock"
    sock.parent.mkdir(mode=0o700, exist_ok=True)

    def up(system: str, slots: int, ctx: int, tag: str) -> Any:
        port = 8090 if system == "llama-server" else 8091
        if system == "llama-server":
            cmd = llama_server_cmd(args, slots, ctx, port)
        else:  # with its per-step trace (uma-trio serve --tick-trace) for each part
            cmd = [
                *uma_cmd(args, slots, ctx, port, sock),
                "--tick-trace",
                str(args.out / f"ticks-{tag}.jsonl"),
            ]
        return running(cmd, f"http://127.0.0.1:{port}", system, args.out / f"{system}-{tag}.log"), port

    if "ceiling" in parts:
        ceiling_part(args, log)
    for system in systems:
        for part, slots, ctx in (
            ("streams", max(args.streams), args.ctx),
            ("mixed", 5, 8448),
            ("long", 1, max(args.depths) + 256),
        ):
            if part not in parts:
                continue
            ctx_manager, port = up(system, slots, ctx, part)
            url = f"http://127.0.0.1:{port}"
            try:
                with ctx_manager:
                    asyncio.run(run_part(part, url, system, args, log))
            except SystemExit as exc:  # one server that failed to start ends only its part
                print(f"{system} {part}: {exc}", flush=True)
    with (args.out / "runs.jsonl").open("a") as f:
        for row in log:
            f.write(json.dumps(row) + "\n")
    keys = sorted({k for r in log for k in r})
    with (args.out / "gpu.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(log)
    plot(log, args.out)
    print(report(log, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
