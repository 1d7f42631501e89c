"""Time to first token with and without the prefix cache, side by side in one run.

Two workloads on the default model, each on a daemon with the cache on and on
one with it off (``--prefix-cache-cells 0``), same settings otherwise:

* **shared system prompt**: a ~1,000-token system prompt, then several
  different questions under it.  The first request is cold in both daemons;
  with the cache every later one reuses the system prompt's KV cells.  Each
  round starts with a fresh system prompt (a round number at its start), so
  every round has one cold request.
* **5-turn chat**: a chat under the same kind of system prompt, each turn
  sending the whole history back (as every chat client does) with the model's
  own previous answers; with the cache each turn continues the previous turn's
  sequence.

TTFT is measured by the client, from sending the request to its first token.
Prints both tables with the ratios, writes ``OUT/prefix_cache.csv`` and
``OUT/prefix_cache.png`` (``--out``, by default ``benches/results``).  Both daemons run the
default settings of the code checked out.

    python benches/prefix_cache.py [--rounds 3] [--questions 4] [--turns 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from bench_output import write_csv

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.daemon import serving
from uma_trio.engine.llama import LlamaModel
from uma_trio.model_files import ensure_default_model
from uma_trio.protocol.messages import EosEvent, TokenEvent

ROOMS = [
    ("reading room", "history"), ("children's corner", "animals"), ("basement", "maps"),
    ("music room", "jazz"), ("study hall", "mathematics"), ("garden annex", "plants"),
    ("east wing", "travel"), ("west wing", "cooking"), ("attic", "old newspapers"),
    ("media lab", "computers"), ("gallery", "painting"), ("quiet room", "poetry"),
]  # fmt: skip
QUESTIONS = [
    "Where are the maps?", "When does the music room open?", "Can I borrow a cookbook?",
    "Is the attic open on Monday?", "Where do I find books about plants?", "Who can use the media lab?",
]  # fmt: skip
CHAT_TURNS = [
    "Hi! I am looking for a book about jazz.", "Which room is that in?", "And when does it open?",
    "Can my kids come along?", "Thanks. Anything about painting there too?",
]  # fmt: skip


def system_prompt(round_no: int, rules: int = 23) -> str:
    """About 1,000 tokens of library rules; the round number makes each round's prompt new."""
    lines = [f"Session {round_no}. You are the help desk of a public library. Answer briefly."]
    for i in range(rules):
        room, topic = ROOMS[i % len(ROOMS)]
        lines.append(
            f"Rule {i + 1}: the {room} is open from {8 + i % 3} to {17 + i % 4} o'clock on weekdays; "
            f"books about {topic} are kept there, and visitors must return them within {7 + i % 14} days."
        )
    return " ".join(lines)


@dataclass
class Sample:
    workload: str
    cache: str
    index: int  # round for the system-prompt workload, turn for the chat
    position: int  # 0 for a round's first request
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int


async def timed(
    client: UmaClient, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, EosEvent]:
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    async with client.stream(messages=messages, max_tokens=max_tokens, temperature=0.0) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                first = first or time.perf_counter()
                parts.append(event.text)
            elif isinstance(event, EosEvent):
                assert first is not None, "no token before the end"
                return (first - started) * 1000.0, "".join(parts), event
    raise RuntimeError("the stream ended without an eos event")


async def run_daemon(model: LlamaModel, cache: bool, args: argparse.Namespace) -> list[Sample]:
    label = "on" if cache else "off"
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="uma-bench-") as tmp:
        config = ServerConfig(
            socket_path=Path(tmp) / "uma.sock", n_ctx=4096, metrics_interval_s=3600.0,
            prefix_cache_cells=None if cache else 0, bmt_budget_gbps=0.0,
        )  # fmt: skip
        async with serving(model, config), UmaClient.connect(config.socket_path) as client:
            await timed(client, [{"role": "user", "content": "Hello"}], 2)  # warm-up (threads, caches)
            for round_no in range(args.rounds):
                system = {"role": "system", "content": system_prompt(round_no)}
                for position, question in enumerate(QUESTIONS[: args.questions]):
                    ttft, _, eos = await timed(client, [system, {"role": "user", "content": question}], 8)
                    samples.append(
                        Sample("system prompt", label, round_no, position, ttft, eos.usage.prompt_tokens,
                               eos.usage.cached_tokens)
                    )  # fmt: skip
            history: list[dict[str, str]] = [{"role": "system", "content": system_prompt(1000)}]
            for turn, text in enumerate(CHAT_TURNS[: args.turns]):
                history.append({"role": "user", "content": text})
                ttft, answer, eos = await timed(client, history, args.answer_tokens)
                history.append({"role": "assistant", "content": answer})
                samples.append(
                    Sample(
                        "5-turn chat",
                        label,
                        turn + 1,
                        turn,
                        ttft,
                        eos.usage.prompt_tokens,
                        eos.usage.cached_tokens,
                    )
                )
    return samples


def report(samples: list[Sample]) -> list[dict[str, Any]]:
    """Print both tables; return the summary rows."""

    def median(cache: str, cold: bool) -> float:
        return statistics.median(
            s.ttft_ms for s in samples
            if s.workload == "system prompt" and s.cache == cache and (s.position == 0) == cold
        )  # fmt: skip

    tokens = statistics.median(s.prompt_tokens for s in samples if s.workload == "system prompt")
    print(f"\nShared system prompt (~{tokens:.0f} prompt tokens), TTFT median over rounds, ms")
    print(f"{'request':<28}{'cache on':>10}{'cache off':>11}{'off / on':>10}")
    rows = []
    for name, cold in (("first of a round (cold)", True), ("later ones (warm)", False)):
        on, off = median("on", cold), median("off", cold)
        print(f"{name:<28}{on:>10.0f}{off:>11.0f}{off / on:>9.1f}x")
        rows.append({"workload": "system prompt", "request": name, "cache_on_ms": on, "cache_off_ms": off})
    cold_on, warm_on = median("on", True), median("on", False)
    print(f"cold / warm with the cache: {cold_on / warm_on:.1f}x (goal: at least 5x)")

    print("\n5-turn chat, TTFT per turn, ms")
    print(f"{'turn':<6}{'prompt':>8}{'reused':>8}{'cache on':>10}{'cache off':>11}{'off / on':>10}")
    for turn in sorted({s.index for s in samples if s.workload == "5-turn chat"}):
        on, off = (
            next(s for s in samples if s.workload == "5-turn chat" and s.cache == c and s.index == turn)
            for c in ("on", "off")
        )
        print(f"{turn:<6}{on.prompt_tokens:>8}{on.cached_tokens:>8}{on.ttft_ms:>10.0f}{off.ttft_ms:>11.0f}"
              f"{off.ttft_ms / on.ttft_ms:>9.1f}x")  # fmt: skip
        rows.append({"workload": "5-turn chat", "request": f"turn {turn}", "cache_on_ms": on.ttft_ms,
                     "cache_off_ms": off.ttft_ms})  # fmt: skip
    return rows


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for cache, colour in (("on", "tab:green"), ("off", "tab:red")):
        shared = [s for s in samples if s.workload == "system prompt" and s.cache == cache]
        left.plot(range(len(shared)), [s.ttft_ms for s in shared], "o-", color=colour, label=f"cache {cache}")
        chat = [s for s in samples if s.workload == "5-turn chat" and s.cache == cache]
        right.plot(
            [s.index for s in chat], [s.ttft_ms for s in chat], "o-", color=colour, label=f"cache {cache}"
        )
    left.set(
        title="Shared 1,000-token system prompt", xlabel="request (rounds back to back)", ylabel="TTFT (ms)"
    )
    right.set(title="5-turn chat", xlabel="turn", ylabel="TTFT (ms)")
    for axis in (left, right):
        axis.set_yscale("log")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=4, help="requests per round (the first is cold)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = LlamaModel(ensure_default_model())
    samples: list[Sample] = []
    for cache in (True, False):
        samples += trio.run(run_daemon, model, cache, args)
    rows = report(samples)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "prefix_cache.csv", [vars(s) for s in samples], list(vars(samples[0])))
    write_csv(out / "prefix_cache_summary.csv", rows, list(rows[0]))
    plot(samples, out / "prefix_cache.png")
    print(f"wrote {out / 'prefix_cache.png'}")


if __name__ == "__main__":
    main()
