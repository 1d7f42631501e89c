"""The seeds' benchmark C: what the HTTP gateway costs over the Unix socket, one stream.

One daemon (``uma-trio serve --http``, a subprocess, so the clients do not share its
event loop) serves the same greedy chat request, one at a time, over three paths,
interleaved round by round in a shuffled order so drift hits all of them alike:

* ``socket``: uma_trio.client.UmaClient over the Unix socket (length-prefixed JSON);
* ``http``:   httpx streaming ``POST /v1/chat/completions`` and parsing the SSE itself;
* ``sdk``:    the official ``openai`` AsyncOpenAI client, streaming.

Per path it reports, from the client's clock: TTFT and the gap between streamed
tokens (p50/p95/mean), and from /proc: the daemon's CPU time per request and per
token, and the client's own.  Ratios are against ``socket``.  Writes
``benches/results/http_overhead.csv`` (one row per request) and
``benches/results/http_overhead_summary.csv``.

    python benches/http_overhead.py [--rounds 30] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import trio
from bench_output import free_port, write_csv

from uma_trio.client import UmaClient
from uma_trio.protocol.messages import TokenEvent

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
RESULTS = Path(__file__).parent / "results"


@dataclass
class Sample:
    path: str
    round: int
    ttft_ms: float
    gaps_ms: list[float] = field(repr=False)
    tokens: int
    daemon_cpu_ms: float
    client_cpu_ms: float


class Paths:
    def __init__(self, sock: Path, url: str, tokens: int) -> None:
        self.sock, self.url, self.tokens = sock, url, tokens
        self.sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.http = httpx.AsyncClient(base_url=url, timeout=60)
        self.model = ""

    async def socket(self, stamp: Callable[[], None]) -> int:
        n = 0
        async with UmaClient.connect(self.sock) as client:
            async with client.stream(messages=PROMPT, max_tokens=self.tokens, temperature=0) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        stamp()
                        n += 1
        return n

    async def raw_http(self, stamp: Callable[[], None]) -> int:
        body = {"model": self.model, "messages": PROMPT, "max_tokens": self.tokens, "temperature": 0,
                "stream": True}  # fmt: skip
        n = 0
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if "content" in delta and "role" not in delta:
                    stamp()
                    n += 1
        return n

    async def openai_sdk(self, stamp: Callable[[], None]) -> int:
        stream = await self.sdk.chat.completions.create(
            model=self.model, messages=PROMPT, max_tokens=self.tokens,  # type: ignore[arg-type]
            temperature=0, stream=True,
        )  # fmt: skip
        n = 0
        async for chunk in stream:
            if (
                chunk.choices
                and chunk.choices[0].delta.content is not None
                and not chunk.choices[0].delta.role
            ):
                stamp()
                n += 1
        return n


async def measure(
    name: str, run: Callable[[Callable[[], None]], Awaitable[int]], daemon: psutil.Process, round_: int
) -> Sample:
    times: list[float] = []

    def stamp() -> None:
        times.append(time.perf_counter())

    cpu0, own0 = sum(daemon.cpu_times()[:2]), time.process_time()
    start = time.perf_counter()
    tokens = await run(stamp)
    cpu1, own1 = sum(daemon.cpu_times()[:2]), time.process_time()
    stamps = np.asarray(times)
    return Sample(
        name, round_, (stamps[0] - start) * 1000, list(np.diff(stamps) * 1000), tokens,
        (cpu1 - cpu0) * 1000, (own1 - own0) * 1000,
    )  # fmt: skip


async def wait_healthy(url: str, proc: trio.Process) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        with trio.fail_after(60):
            while True:
                if proc.returncode is not None:
                    raise SystemExit(f"the daemon exited with {proc.returncode}")
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)


async def bench(rounds: int, tokens: int) -> list[Sample]:
    with tempfile.TemporaryDirectory(prefix="uma-bench-") as tmp:
        sock = Path(tmp) / "d.sock"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "uma_trio", "serve", "--socket", str(sock), "--http", f"127.0.0.1:{port}",
            "--bmt-budget-gbps", "0", "--log-level", "warning",
        ]  # fmt: skip
        proc = await trio.lowlevel.open_process(command)
        try:
            await wait_healthy(url, proc)
            paths = Paths(sock, url, tokens)
            paths.model = (await paths.sdk.models.list()).data[0].id
            daemon = psutil.Process(proc.pid)
            runs = {"socket": paths.socket, "http": paths.raw_http, "sdk": paths.openai_sdk}
            for name, run in runs.items():  # warm-up: connections, caches, first-use imports
                await measure(name, run, daemon, -1)
            samples = []
            order = list(runs)
            for r in range(rounds):
                random.shuffle(order)
                for name in order:
                    samples.append(await measure(name, runs[name], daemon, r))
            await paths.http.aclose()
            await paths.sdk.close()
            return samples
        finally:
            proc.terminate()
            with trio.move_on_after(30):
                await proc.wait()


def summarize(samples: list[Sample]) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name in ("socket", "http", "sdk"):
        mine = [s for s in samples if s.path == name]
        ttft = np.asarray([s.ttft_ms for s in mine])
        gaps = np.concatenate([s.gaps_ms for s in mine])
        tokens = sum(s.tokens for s in mine)
        rows.append({
            "path": name, "requests": len(mine), "tokens": tokens,
            "ttft_p50_ms": float(np.median(ttft)), "ttft_p95_ms": float(np.percentile(ttft, 95)),
            "ttft_mean_ms": float(ttft.mean()),
            "gap_p50_ms": float(np.median(gaps)), "gap_p95_ms": float(np.percentile(gaps, 95)),
            "gap_mean_ms": float(gaps.mean()),
            "daemon_cpu_ms_per_request": sum(s.daemon_cpu_ms for s in mine) / len(mine),
            "daemon_cpu_ms_per_token": sum(s.daemon_cpu_ms for s in mine) / tokens,
            "client_cpu_ms_per_token": sum(s.client_cpu_ms for s in mine) / tokens,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    samples = trio.run(bench, args.rounds, args.tokens)
    rows = summarize(samples)
    base = rows[0]
    print(f"{os.cpu_count()} CPUs, {args.rounds} rounds x 3 paths, {args.tokens} tokens each, greedy, serial")
    header = ("path", "TTFT p50", "p95", "mean", "gap p50", "p95", "mean", "daemon CPU/tok", "client CPU/tok")
    print("{:<7}{:>10}{:>8}{:>8}{:>10}{:>8}{:>8}{:>16}{:>16}".format(*header))
    for row in rows:
        print(
            f"{row['path']:<7}{row['ttft_p50_ms']:>10.1f}{row['ttft_p95_ms']:>8.1f}{row['ttft_mean_ms']:>8.1f}"
            f"{row['gap_p50_ms']:>10.2f}{row['gap_p95_ms']:>8.2f}{row['gap_mean_ms']:>8.2f}"
            f"{row['daemon_cpu_ms_per_token']:>13.2f} ms{row['client_cpu_ms_per_token']:>13.2f} ms"
        )
    print("ratios against socket (HTTP / socket):")
    for row in rows[1:]:
        ratios = {
            key: float(row[key]) / float(base[key])
            for key in ("ttft_p50_ms", "ttft_mean_ms", "gap_p50_ms", "gap_mean_ms",
                        "daemon_cpu_ms_per_token", "client_cpu_ms_per_token")
        }  # fmt: skip
        print(
            f"  {row['path']:<7}" + "  ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in ratios.items())
        )
        row.update({f"ratio_{k}": round(v, 4) for k, v in ratios.items()})
    per_request = [{k: v for k, v in asdict(s).items() if k != "gaps_ms"} for s in samples]
    write_csv(RESULTS / "http_overhead.csv", per_request, list(per_request[0]))
    write_csv(RESULTS / "http_overhead_summary.csv", rows, list(rows[-1]))


if __name__ == "__main__":
    main()
