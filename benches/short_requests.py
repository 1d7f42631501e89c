"""Short requests in a row, as an agent or an indexer sends them: what a request costs.

Each round sends ``--requests`` short greedy requests (an 18-token prompt, ``--tokens``
generated) one after another over one connection (kept alive, opened for the round and
closed after it: one client's session) to each target in turn, all servers up at once:
uma-trio over its Unix socket and over HTTP (``/v1/completions``), the same at
``--baseline REV`` (a temporary git worktree) if asked, and llama-server (``/completion``).
Per round and target: TTFT p50 (send to first token), completion p50, requests per second,
and for uma-trio its event loop's CPU time per request (the main thread's, from /proc): the
host work a request costs beside the decode's threads.  Medians over the rounds and their
ratio to llama-server are printed and written to ``OUT/short_requests.csv`` and
``OUT/short_requests.png``.

    python benches/short_requests.py [--rounds 5] [--requests 200] [--tokens 1] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
from bench_output import free_port, save_figure, write_csv
from compare import DEFAULT_PEERS, ROOT, Setup, llama_server_command, running, uma_command
from one_stream import checkout, main_thread_cpu_s

from uma_trio.model_files import ensure_default_model

PROMPT = "hello " * 18
Timing = tuple[float, float]  # (TTFT, completion) in seconds
Block = Callable[[int], list[Timing]]  # n requests in a row -> each one's timing


def socket_block(path: Path, tokens: int) -> Block:
    """Requests in a row on one connection to uma-trio's socket (frames split, not parsed),
    opened for the block and closed after it."""
    sent = 0

    def block(n: int) -> list[Timing]:
        nonlocal sent
        timings, buffer = [], b""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(path))
            for _ in range(n):
                sent += 1
                body = {"type": "generate", "id": f"s{sent}", "prompt": PROMPT, "max_tokens": tokens,
                        "temperature": 0.0}  # fmt: skip
                payload = json.dumps(body).encode()
                start, first, done = time.perf_counter(), 0.0, False
                conn.sendall(struct.pack("<I", len(payload)) + payload)
                while not done:
                    buffer += conn.recv(65536)
                    while len(buffer) >= 4 and len(buffer) >= 4 + (
                        size := struct.unpack_from("<I", buffer)[0]
                    ):
                        frame, buffer = buffer[4 : 4 + size], buffer[4 + size :]
                        first = first or time.perf_counter()
                        done = done or b'"eos"' in frame
                timings.append((first - start, time.perf_counter() - start))
        return timings

    return block


def http_block(url: str, path: str, body: dict[str, object]) -> Block:
    """Requests in a row on one kept-alive HTTP connection, SSE read to the end; the client
    (and its connection) opened for the block and closed after it."""

    def block(n: int) -> list[Timing]:
        with httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:

            def one() -> Timing:
                start, first = time.perf_counter(), 0.0
                with client.stream("POST", path, json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:") and not first:
                            first = time.perf_counter()
                return first - start, time.perf_counter() - start

            timings = []
            for _ in range(n):
                try:
                    timings.append(one())
                except httpx.RemoteProtocolError:  # llama-server closed the kept-alive connection
                    timings.append(one())
            return timings

    return block


def plot(rows: list[dict[str, object]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    medians = [statistics.median(float(r["ttft_p50_ms"]) for r in rows if r["target"] == n) for n in names]  # type: ignore[arg-type]
    ax.bar(names, medians)
    ax.set_ylabel("TTFT p50 (ms), median of the rounds")
    ax.set_title("short requests in a row, one connection each")
    ax.tick_params(axis="x", labelrotation=20)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="requests in a row per target and round")
    parser.add_argument("--tokens", type=int, default=1, help="tokens generated per request")
    parser.add_argument("--baseline", metavar="REV", help="also run uma-trio at this git revision")
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "short_requests")
    args = parser.parse_args()
    model = ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(slots=4, n_ctx=1024)
    umas: list[tuple[str, Path | None]] = [("uma-trio", None)]
    with tempfile.TemporaryDirectory(prefix="uma-short-") as tmp, ExitStack() as stack:
        if args.baseline:
            umas.append((f"uma-trio@{args.baseline}", stack.enter_context(checkout(args.baseline))))
        blocks: list[tuple[str, Block, int | None]] = []  # (name, block, pid of an event loop to read)
        for index, (name, tree) in enumerate(umas):
            sock, port = Path(tmp) / f"{index}.sock", free_port()
            url = f"http://127.0.0.1:{port}"
            log = args.out / f"{name.replace('@', '-at-')}.log"
            process = stack.enter_context(running(uma_command(setup, sock, port), url, name, log, cwd=tree))
            body = {"model": model.stem, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0,
                    "stream": True}  # fmt: skip
            blocks.append((f"{name} socket", socket_block(sock, args.tokens), process.pid))
            blocks.append((f"{name} HTTP", http_block(url, "/v1/completions", body), process.pid))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(
            running(llama_server_command(args.peers, model, setup, port), url, "llama-server",
                    args.out / "llama-server.log")
        )  # fmt: skip
        body = {"prompt": PROMPT, "n_predict": args.tokens, "temperature": 0, "stream": True}
        blocks.append(("llama-server", http_block(url, "/completion", body), None))
        for _, block, _ in blocks:  # warm-up, not reported
            block(5)
        rows: list[dict[str, object]] = []
        for round_ in range(args.rounds):
            for name, block, pid in blocks:
                cpu = main_thread_cpu_s(pid) if pid is not None else 0.0
                started = time.perf_counter()
                timings = block(args.requests)
                elapsed = time.perf_counter() - started
                loop_ms = 1000.0 * (main_thread_cpu_s(pid) - cpu) / args.requests if pid is not None else None
                rows.append({
                    "round": round_, "target": name,
                    "ttft_p50_ms": round(1000.0 * statistics.median(t for t, _ in timings), 3),
                    "completion_p50_ms": round(1000.0 * statistics.median(c for _, c in timings), 3),
                    "requests_per_s": round(args.requests / elapsed, 2),
                    "loop_cpu_ms_per_request": "" if loop_ms is None else round(loop_ms, 3),
                })  # fmt: skip
            print(
                " | ".join(f"{r['target']} {r['ttft_p50_ms']} ms" for r in rows[-len(blocks) :]), flush=True
            )
    names = [name for name, _, _ in blocks]

    def median(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in rows if r["target"] == name)  # type: ignore[arg-type]

    base_ttft, base_rate = median("llama-server", "ttft_p50_ms"), median("llama-server", "requests_per_s")
    print("\n| target | TTFT p50 (ms) | / llama-server | completion p50 (ms) | requests/s | / llama-server "
          "| event loop CPU per request |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        loop = f"{median(name, 'loop_cpu_ms_per_request'):.3f} ms" if name != "llama-server" else ""
        ttft, rate = median(name, "ttft_p50_ms"), median(name, "requests_per_s")
        print(f"| {name} | {ttft:.2f} | {ttft / base_ttft:.2f} | {median(name, 'completion_p50_ms'):.2f} "
              f"| {rate:.1f} | {rate / base_rate:.2f} | {loop} |")  # fmt: skip
    columns = [
        "round",
        "target",
        "ttft_p50_ms",
        "completion_p50_ms",
        "requests_per_s",
        "loop_cpu_ms_per_request",
    ]
    write_csv(args.out / "short_requests.csv", rows, columns)
    plot(rows, names, args.out / "short_requests.png")


if __name__ == "__main__":
    main()
