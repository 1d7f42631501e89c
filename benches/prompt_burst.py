"""Prompts sharing a long prefix, sent together: uma-trio against llama-server.

An app's burst of one prompt, or an agent fanning one system prompt out to several
questions, reaches a server as requests that arrive together and share a long prefix.
Each round here sends ``--clients`` streamed chat requests at once (a thread each) to
one target, then to the next: a ~``--system-tokens``-token system prompt new to every
round (so nothing is cached from the round before) and a different question each
(``--identical``: the same one).  Per request: time to its first content token and to its
end, and for uma-trio the prompt tokens it reused (``cached_tokens``).  Medians over the
rounds, each target's ratio to llama-server, rows in ``OUT/prompt_burst.csv`` and a plot in
``OUT/prompt_burst.png``.  ``--baseline REV`` adds uma-trio at another git revision (for
the code before a change).  Both servers are driven over HTTP with httpx
(``/v1/chat/completions``, SSE), with the same slots, context and threads.

    python benches/prompt_burst.py [--rounds 3] [--clients 4] [--system-tokens 1000]
                                   [--identical] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from bench_output import free_port, save_figure, write_csv
from compare import DEFAULT_PEERS, ROOT, Setup, llama_server_command, running, uma_command
from one_stream import checkout

from uma_trio.model_files import ensure_default_model

QUESTIONS = [
    "Where are the maps?", "When does the music room open?", "Can I borrow a cookbook?",
    "Is the attic open on Monday?", "Where do I find books about plants?", "Who can use the media lab?",
    "Are dogs allowed?", "How long may I keep a book?",
]  # fmt: skip


def system_prompt(round_: int, tokens: int) -> str:
    """About ``tokens`` tokens of library rules (~20 tokens a rule), new to each round."""
    rules = " ".join(
        f"Rule {i}: room {i % 7} opens at {8 + i % 3} and closes at {17 + i % 4} on weekdays."
        for i in range(max(1, tokens // 20))
    )
    return f"Round {round_}. You are the help desk of a small public library. {rules}"


def one_request(url: str, model: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    """Send one streamed chat; the times (from sending) of its first content token and its end."""
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }  # fmt: skip
    start, first, cached = time.perf_counter(), None, None
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as sse,
    ):
        sse.raise_for_status()
        for line in sse.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    end = time.perf_counter() - start
    return {
        "ttft_s": round(first if first is not None else end, 4),
        "end_s": round(end, 4),
        "cached_tokens": cached,
    }


def burst(url: str, model: str, round_: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    system = system_prompt(round_, args.system_tokens)
    questions = [QUESTIONS[0 if args.identical else i % len(QUESTIONS)] for i in range(args.clients)]
    with ThreadPoolExecutor(args.clients) as pool:
        return list(pool.map(lambda q: one_request(url, model, system, q, args.max_tokens), questions))


def plot(rows: list[dict[str, Any]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, name in enumerate(names):
        mine = [r for r in rows if r["target"] == name]
        ax.scatter([r["round"] + 0.15 * k for r in mine], [r["ttft_s"] for r in mine], label=name, s=18)
    ax.set_xlabel("round")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("requests sharing a prefix, sent together")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="requests sent together each round")
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt's size")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--identical", action="store_true", help="every request the same question")
    parser.add_argument("--baseline", metavar="REV", help="also run uma-trio at this git revision")
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "prompt_burst")
    args = parser.parse_args()
    if not (args.peers / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.peers}: run `bash benches/peers/build.sh` first")
    model = ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(slots=max(4, args.clients), n_ctx=2048)
    variants: list[tuple[str, Path | None]] = [("uma-trio", None)]
    with tempfile.TemporaryDirectory(prefix="uma-burst-") as tmp, ExitStack() as stack:
        if args.baseline:
            variants.append((f"uma-trio@{args.baseline}", stack.enter_context(checkout(args.baseline))))
        urls: dict[str, str] = {}
        for name, tree in variants:
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            command = uma_command(setup, Path(tmp) / f"{len(urls)}.sock", port)
            log = args.out / f"{name.replace('@', '-at-')}.log"
            stack.enter_context(running(command, urls[name], name, log, cwd=tree))
        port = free_port()
        urls["llama-server"] = f"http://127.0.0.1:{port}"
        command = llama_server_command(args.peers, model, setup, port)
        stack.enter_context(
            running(command, urls["llama-server"], "llama-server", args.out / "llama-server.log")
        )
        for url in urls.values():  # warm-up, not reported
            one_request(url, model.stem, "Warm up.", "Hi", 2)
        rows: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            for name, url in urls.items():
                got = burst(url, model.stem, round_, args)
                rows += [{"round": round_, "target": name, "request": i, **r} for i, r in enumerate(got)]
                ttfts = sorted(r["ttft_s"] for r in got)
                print(f"round {round_} {name}: TTFT {ttfts[0]:.2f}-{ttfts[-1]:.2f} s, "
                      f"cached {[r['cached_tokens'] for r in got]}", flush=True)  # fmt: skip
    names = list(urls)

    def median_of(name: str, key: str, pick: Any = statistics.median) -> float:
        """The median over the rounds of each round's ``pick`` of ``key``."""
        rounds = sorted({r["round"] for r in rows})
        return statistics.median(
            pick([r[key] for r in rows if r["target"] == name and r["round"] == k]) for k in rounds
        )

    base = {"ttft_s": median_of("llama-server", "ttft_s"), "end_s": median_of("llama-server", "end_s", max)}
    asked = "one question" if args.identical else "different questions"
    print(f"\n{args.clients} requests at once, a {args.system_tokens}-token shared system prompt ({asked}), "
          f"medians of {args.rounds} rounds:\n")  # fmt: skip
    print("| target | TTFT p50 (s) | TTFT max (s) | all done (s) | TTFT p50 / llama-server "
          "| all done / llama-server |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        p50, worst = median_of(name, "ttft_s"), median_of(name, "ttft_s", max)
        done = median_of(name, "end_s", max)
        ratios = f"{p50 / base['ttft_s']:.2f} | {done / base['end_s']:.2f}"
        print(f"| {name} | {p50:.2f} | {worst:.2f} | {done:.2f} | {ratios} |")
    write_csv(
        args.out / "prompt_burst.csv",
        rows,
        ["round", "target", "request", "ttft_s", "end_s", "cached_tokens"],
    )
    plot(rows, names, args.out / "prompt_burst.png")


if __name__ == "__main__":
    main()
