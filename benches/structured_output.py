"""What a JSON schema costs: 8 streams with and without one, uma-trio beside llama-server.

Both servers run the same model with 8 slots; each run sends 8 chat requests at once
(different topics, greedy, ``max_tokens`` 192) as free text and again under a JSON schema
that cannot close before the budget (an array of at least 40 notes), so every request
generates the same number of tokens either way.  Aggregate completion tok/s, median of
``--reps`` runs; the figure that matters is each server's own schema / free-text ratio
(issue 20's target: at least 0.9 for uma-trio).  Also the per-token cost of the mask alone,
measured in-process on the same model.

    python benches/structured_output.py [--peers DIR] [--out DIR] [--reps 3]

Writes ``OUT/structured_output.csv`` and ``OUT/structured_output.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_output import free_port, write_csv
from compare import DEFAULT_PEERS, Setup, llama_server_command, running, uma_command

from uma_trio.engine.constraints import json_schema_constraint
from uma_trio.engine.llama_model import LlamaModel
from uma_trio.engine.sampling import SamplingParams
from uma_trio.model_files import ensure_default_model

STREAMS = 8
MAX_TOKENS = 192
SETUP = Setup(slots=STREAMS, n_ctx=1024)
TOPICS = [
    "a lighthouse",
    "a desert city",
    "a clockmaker",
    "a river",
    "a winter market",
    "a robot",
    "a ship",
    "a forest",
]
SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 40}},
    "required": ["notes"],
    "additionalProperties": False,
}


async def one_run(url: str, schema: bool) -> tuple[int, float]:
    """Completion tokens and wall seconds of 8 requests sent at once."""

    async def one(client: httpx.AsyncClient, model: str, topic: str) -> int:
        body: dict[str, Any] = {
            "model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Write notes for a long story about {topic}."},
            ],
        }  # fmt: skip
        if schema:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "notes", "schema": SCHEMA},
            }
        answer = await client.post(f"{url}/v1/chat/completions", json=body)
        answer.raise_for_status()
        return int(answer.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, model, topic) for topic in TOPICS[:STREAMS]))
        return sum(tokens), time.perf_counter() - started


def mask_cost_us(model_path: Path, tokens: int = 400) -> float:
    """Median microseconds to mask one logits row under SCHEMA (random logits, greedy)."""
    model = LlamaModel(model_path)
    try:
        sampler = model.vocabulary.sampler(SamplingParams(temperature=0.0), json_schema_constraint(SCHEMA))
        rng = np.random.default_rng(0)
        times = []
        for _ in range(tokens):
            row = rng.standard_normal(model.n_vocab).astype(np.float32)
            started = time.perf_counter()
            sampler.sample(row)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e6
    finally:
        model.close()


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r["system"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, mode in enumerate(("free text", "JSON schema")):
        values = [
            statistics.median(r["tok_s"] for r in rows if r["system"] == s and r["mode"] == mode)
            for s in systems
        ]
        ax.bar([x + 0.4 * i for x in range(len(systems))], values, width=0.4, label=mode)
    ax.set_xticks([x + 0.2 for x in range(len(systems))], systems)
    ax.set_ylabel(f"aggregate tok/s, {STREAMS} streams")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_output")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_default_model()
    mask_us = mask_cost_us(model)
    print(f"mask + sample, one row of the default model under the schema: {mask_us:.0f} us (median)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="uma-so-") as tmp:
        port = free_port()
        servers = [("uma-trio", uma_command(SETUP, Path(tmp) / "d.sock", port), port)]
        if (args.peers / "llama-server").is_file():
            peer_port = free_port()
            servers.append(
                ("llama-server", llama_server_command(args.peers, model, SETUP, peer_port), peer_port)
            )
        else:
            print(f"no llama-server in {args.peers}: uma-trio alone", file=sys.stderr)
        for system, command, p in servers:
            url = f"http://127.0.0.1:{p}"
            with running(command, url, system, args.out / f"{system}.log"):
                asyncio.run(one_run(url, schema=False))  # warm-up
                for rep in range(args.reps):
                    for mode, schema in (("free text", False), ("JSON schema", True)):
                        tokens, wall = asyncio.run(one_run(url, schema))
                        row = {"system": system, "mode": mode, "rep": rep, "tokens": tokens,
                               "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2)}  # fmt: skip
                        print(row, flush=True)
                        rows.append(row)
    write_csv(
        args.out / "structured_output.csv", rows, ["system", "mode", "rep", "tokens", "wall_s", "tok_s"]
    )
    plot(rows, args.out / "structured_output.png")
    for system in sorted({r["system"] for r in rows}):
        free = statistics.median(
            r["tok_s"] for r in rows if r["system"] == system and r["mode"] == "free text"
        )
        fixed = statistics.median(
            r["tok_s"] for r in rows if r["system"] == system and r["mode"] == "JSON schema"
        )
        print(f"{system}: free text {free:.1f} tok/s, JSON schema {fixed:.1f} tok/s: {fixed / free:.2f}x")


if __name__ == "__main__":
    main()
