"""One stream, interleaved: uma-trio against llama-server, one request at a time in rotation.

``compare.py``'s scaling figure for one stream is a single 128-token request per server,
and on a 2-core VM it moves ±10 % from run to run, more than the targets it is read
against (issue 16: ≥ 0.95× llama-server).  Here every server is up at once and idle
while another is measured; each round sends one streamed greedy request of ``--tokens``
tokens to each target in turn, and a request's rate is its decode phase: the tokens after
the first over the time from the first to the last (TTFT is ``compare.py``'s
``ttft_long``).  The medians over ``--rounds`` rounds, and each round's ratio to
llama-server (the neighbouring requests share the machine's state of the moment), are
printed and written to ``OUT/one_stream.csv`` and ``OUT/one_stream.png``.
``--streams N`` sends N requests to each target together each round (a thread each) and
times them together: the tokens after each one's first over the time from the last first
token to the last token (compare.py's scaling, at 2-16 streams, with the same interleaving).
``--http`` drives uma-trio over its OpenAI gateway (``/v1/completions``, SSE, httpx) like
llama-server, instead of its socket; ``--lane background`` sends uma-trio's requests in the
background lane (interactive by default).  ``--baseline REV`` adds a uma-trio run from another
git revision (checked out into a temporary worktree), for A/B runs of a change against the
code before it.  For every uma-trio the table also gives its event loop's CPU time per
streamed token (the main thread's, from ``/proc``; Linux only): the host work that, on a
2-core machine, runs beside the decode's threads.

uma-trio is driven over its Unix socket (its native path) with a minimal reader that only
splits frames, llama-server over HTTP with httpx: the clients' own work per token is then
alike (tens of µs) and small beside a step.  ``--variant NAME=FLAGS`` adds a uma-trio
started with extra flags (e.g. ``--variant serial=--no-run-ahead``), for A/B runs of a
change.

    python benches/one_stream.py [--rounds 12] [--tokens 256] [--streams 1] [--variant NAME=FLAGS ...]
                                 [--baseline REV] [--lane background]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from bench_output import free_port, save_figure, write_csv
from compare import DEFAULT_PEERS, ROOT, Setup, llama_server_command, running, uma_command

from uma_trio.model_files import ensure_default_model


def prompt(round_: int, stream: int = 0) -> str:
    # The same prompt each round but its last words: both servers reuse the cached prefix.
    return "hello " * 32 + f"{round_} {stream}"


def uma_times(sock: Path, round_: int, stream: int, tokens: int, lane: str = "interactive") -> list[float]:
    """Arrival times of one streamed request's tokens over uma-trio's socket (frames split,
    not parsed), in ``lane``."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        body = {"type": "generate", "id": f"r{round_}-{stream}", "prompt": prompt(round_, stream),
                "max_tokens": tokens, "temperature": 0.0, "priority": lane}  # fmt: skip
        payload = json.dumps(body).encode()
        s.sendall(struct.pack("<I", len(payload)) + payload)
        buffer, times, done = b"", [], False
        while not done and (data := s.recv(65536)):
            buffer += data
            while len(buffer) >= 4 and len(buffer) >= 4 + (size := struct.unpack_from("<I", buffer)[0]):
                frame, buffer = buffer[4 : 4 + size], buffer[4 + size :]
                times.append(time.perf_counter())
                done = done or b'"eos"' in frame
    return times[:-1]  # the last frame is the eos


def sse_times(endpoint: str, body: dict[str, object], headers: dict[str, str] | None = None) -> list[float]:
    """Arrival times of one streamed request's token events from an SSE endpoint."""
    times = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", endpoint, json=body, headers=headers) as sse,
    ):
        for line in sse.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    # The last event carries no token: uma-trio's the finish reason, llama-server's the timings.
    return times[:-1]


def uma_http_times(
    url: str, model: str, round_: int, stream: int, tokens: int, lane: str = "interactive"
) -> list[float]:
    """Token arrival times from uma-trio's /v1/completions, in ``lane``."""
    body = {"model": model, "prompt": prompt(round_, stream), "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    return sse_times(f"{url}/v1/completions", body, {"x-uma-priority": lane})


def llama_server_times(url: str, round_: int, stream: int, tokens: int) -> list[float]:
    """Token arrival times from llama-server's /completion."""
    body = {"prompt": prompt(round_, stream), "n_predict": tokens, "temperature": 0, "stream": True}
    return sse_times(f"{url}/completion", body)


def rate(streams: list[list[float]]) -> float:
    """Decode tok/s of requests sent together: the tokens after each one's first, over the
    time from the last first token to the last token (every stream decoding)."""
    if any(len(times) < 2 for times in streams):
        raise SystemExit("a request streamed under 2 tokens; cannot time its decode")
    start, end = max(t[0] for t in streams), max(t[-1] for t in streams)
    return sum(len(t) - 1 for t in streams) / (end - start)


def together(measure: Callable[[int, int], list[float]], round_: int, streams: int) -> tuple[float, int]:
    """``streams`` requests sent at once (a thread each): their decode rate together, and the
    tokens they streamed."""
    if streams == 1:
        times = [measure(round_, 0)]
    else:
        with ThreadPoolExecutor(streams) as pool:
            times = list(pool.map(lambda i: measure(round_, i), range(streams)))
    return rate(times), sum(len(t) for t in times)


def main_thread_cpu_s(pid: int) -> float:
    """CPU time (user + system) of the process's main thread, which runs uma-trio's event loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """``rev`` of this repository in a temporary git worktree, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="uma-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                       check=True, capture_output=True)  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def plot(rows: list[dict[str, object]], names: list[str], streams: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.plot([r["round"] for r in rows if r["target"] == name],
                [r["tok_s"] for r in rows if r["target"] == name], marker="o", label=name)  # fmt: skip
    ax.set_xlabel("round")
    ax.set_ylabel(f"decode tok/s ({streams} stream{'s' if streams > 1 else ''})")
    ax.set_title(f"{streams} stream{'s' if streams > 1 else ''} a round, servers interleaved")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=1, help="requests sent together each round")
    parser.add_argument("--http", action="store_true", help="drive uma-trio over its HTTP gateway")
    parser.add_argument("--lane", choices=["interactive", "background"], default="interactive",
                        help="uma-trio's lane for the requests")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS")
    parser.add_argument("--baseline", metavar="REV", help="also run uma-trio at this git revision")
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "one_stream")
    args = parser.parse_args()
    model = ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(slots=max(4, args.streams), n_ctx=2048)
    variants: list[tuple[str, list[str], Path | None]] = [("uma-trio", [], None)]
    variants += [(v.split("=", 1)[0], v.split("=", 1)[1].split(), None) for v in args.variant]
    with tempfile.TemporaryDirectory(prefix="uma-one-") as tmp, ExitStack() as stack:
        if args.baseline:
            variants.append((f"uma-trio@{args.baseline}", [], stack.enter_context(checkout(args.baseline))))
        targets: list[tuple[str, Callable[[int, int], list[float]]]] = []
        pids: dict[str, int] = {}  # uma-trio targets: their event loop's CPU time is read
        for name, flags, tree in variants:
            sock, port = Path(tmp) / f"{len(pids)}.sock", free_port()
            command = [*uma_command(setup, sock, port), *flags]
            log = args.out / f"{name.replace('@', '-at-')}.log"
            process = stack.enter_context(running(command, f"http://127.0.0.1:{port}", name, log, cwd=tree))
            pids[name] = process.pid
            if args.http:
                uma_url = f"http://127.0.0.1:{port}"
                targets.append(
                    (
                        name,
                        lambda r, i, url=uma_url: uma_http_times(
                            url, model.stem, r, i, args.tokens, args.lane
                        ),
                    )
                )
            else:
                targets.append((name, lambda r, i, sock=sock: uma_times(sock, r, i, args.tokens, args.lane)))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = llama_server_command(args.peers, model, setup, port)
        stack.enter_context(running(command, url, "llama-server", args.out / "llama-server.log"))
        targets.append(("llama-server", lambda r, i: llama_server_times(url, r, i, args.tokens)))
        for _, measure in targets:  # warm-up, not reported
            together(measure, -1, args.streams)
        rows: list[dict[str, object]] = []
        for round_ in range(args.rounds):
            got: dict[str, float] = {}
            loop_ms: dict[str, float | str] = {}
            for name, measure in targets:
                before = main_thread_cpu_s(pids[name]) if name in pids else 0.0
                got[name], tokens = together(measure, round_, args.streams)
                if name in pids:
                    loop_ms[name] = round(1000.0 * (main_thread_cpu_s(pids[name]) - before) / tokens, 3)
            for name, tok_s in got.items():
                ratio = round(tok_s / got["llama-server"], 4)
                rows.append({"round": round_, "target": name, "tok_s": round(tok_s, 2), "ratio": ratio,
                             "loop_cpu_ms_per_token": loop_ms.get(name, "")})  # fmt: skip
            print(" ".join(f"{n} {v:.1f}" for n, v in got.items()), flush=True)
    names = [name for name, _ in targets]
    print("\n| target | median decode tok/s | median / llama-server | median of the rounds' ratios "
          "| event loop CPU per token (median) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    base = statistics.median(float(r["tok_s"]) for r in rows if r["target"] == "llama-server")  # type: ignore[arg-type]
    for name in names:
        mine = [r for r in rows if r["target"] == name]
        median = statistics.median(float(r["tok_s"]) for r in mine)  # type: ignore[arg-type]
        ratios = statistics.median(float(r["ratio"]) for r in mine)  # type: ignore[arg-type]
        loop = (f"{statistics.median(float(r['loop_cpu_ms_per_token']) for r in mine):.3f} ms"  # type: ignore[arg-type]
                if name in pids else "")  # fmt: skip
        print(f"| {name} | {median:.1f} | {median / base:.3f} | {ratios:.3f} | {loop} |")
    columns = ["round", "target", "tok_s", "ratio", "loop_cpu_ms_per_token"]
    write_csv(args.out / "one_stream.csv", rows, columns)
    plot(rows, names, args.streams, args.out / "one_stream.png")


if __name__ == "__main__":
    main()
