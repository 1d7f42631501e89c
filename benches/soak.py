"""Soak: mixed, misbehaving load on a real ``uma-trio serve`` for ten minutes or more.

The daemon runs as its own process on the default model (so its RSS and open file
descriptors are its own), and these clients run against it at once:

* **chat** (3): greedy chats from a fixed set of questions, one after another;
* **background** (1): long prompts (~600 tokens) at ``priority: background``;
* **churn** (1): connects, starts a stream, hangs up at a random point;
* **garbage** (1): a malformed frame every second or so (bad JSON, wrong types, unknown
  types, over-limit values), each of which must get its error event;
* **slow reader** (1): streams, reading a few tokens then pausing;
* **snapshots** (1): every ~20 s saves a chat prefix under one of four names, lists the
  snapshots and restores one (issue 17's soak: snapshot saves beside the rest).

Every request is greedy and the daemon runs with ``--deterministic``, so its output does not
depend on batching, chunking or the prefix cache, and **nothing lost** is checked exactly:
each completed request's text must equal the first completion of the same prompt.  Every 10 s
the daemon's RSS, open fds, sessions and KV cells are sampled; at the end (clients stopped)
no session may remain and no KV cell be held by a request (**nothing leaked**), and RSS and
fds are compared with their values after the warm-up (the first fifth of the run).

Prints the summary (requests served by kind, errors by code — expected and not —,
mismatches, RSS and fds at start, peak and end), writes ``benches/results/soak.csv``
(the samples) and ``benches/results/soak.png``.

    python benches/soak.py [--minutes 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio
from bench_output import write_csv

from uma_trio.client import ConnectionLost, RequestFailed, UmaClient
from uma_trio.protocol.messages import TokenEvent

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "Name three colours.",
    "What is the capital of France?",
    "Count from one to ten.",
    "Tell me a short story about a cat.",
    "Why is the sky blue?",
    "Give me two tips for sleeping well.",
]
BACKGROUND = [
    f"Document {n}. " + " ".join(f"Section {i} says the figure was {i * n % 97}." for i in range(60))
    + " Summarise the document."
    for n in range(4)
]  # fmt: skip


@dataclass
class Tally:
    served: Counter[str] = field(default_factory=Counter)  # completed requests by client kind
    errors: Counter[str] = field(default_factory=Counter)  # error codes received, expected ones
    unexpected: list[str] = field(default_factory=list)
    reference: dict[str, str] = field(default_factory=dict)  # prompt -> first completed text
    mismatches: int = 0
    garbage_sent: int = 0
    churned: int = 0

    def check(self, kind: str, key: str, text: str) -> None:
        """Count a completed request and hold its text to the prompt's first one."""
        self.served[kind] += 1
        first = self.reference.setdefault(key, text)
        if text != first:
            self.mismatches += 1
            print(f"MISMATCH for {key!r}: {text!r} != {first!r}", file=sys.stderr)


def chat(question: str, max_tokens: int = 48) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


async def chat_client(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    async with UmaClient.connect(sock) as client:
        while time.monotonic() < until:
            question = rng.choice(QUESTIONS)
            try:
                done = await client.complete(**chat(question))
            except RequestFailed as exc:
                tally.unexpected.append(exc.event.code)
                continue
            tally.check("chat", question, done.text)


async def background_client(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    async with UmaClient.connect(sock) as client:
        while time.monotonic() < until:
            prompt = rng.choice(BACKGROUND)
            body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "priority": "background"}
            try:
                done = await client.complete(**body)
            except RequestFailed as exc:
                tally.unexpected.append(exc.event.code)
                continue
            tally.check("background", prompt, done.text)


async def churn_client(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    while time.monotonic() < until:
        try:
            async with UmaClient.connect(sock) as client:
                with trio.move_on_after(rng.random() * 1.5):
                    async with client.stream(**chat(rng.choice(QUESTIONS), 200)) as events:
                        async for _ in events:
                            pass
        except (ConnectionLost, RequestFailed):
            pass
        tally.churned += 1


def frame(obj: Any) -> bytes:
    payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("<I", len(payload)) + payload


GARBAGE: list[tuple[bytes, str]] = [
    (frame(b"{not json"), "E_PROTO_001"),
    (frame({"id": "g", "prompt": 42}), "E_PROTO_002"),
    (frame({"type": "shutdown", "id": "g"}), "E_PROTO_005"),
    (frame({"id": "g", "prompt": "p", "max_tokens": 10**9}), "E_LIMIT_003"),
    (frame({"type": "cancel", "id": "nobody"}), "E_PROTO_007"),
    (frame(b'{"id": "g", "prompt": "\xff\xfe"}'), "E_PROTO_003"),
]


async def garbage_client(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    stream = await trio.open_unix_socket(str(sock))
    buffer = b""
    async with stream:
        while time.monotonic() < until:
            data, code = rng.choice(GARBAGE)
            await stream.send_all(data)
            tally.garbage_sent += 1
            while len(buffer) < 4 or len(buffer) < 4 + struct.unpack_from("<I", buffer)[0]:
                buffer += await stream.receive_some(65536)
            (n,) = struct.unpack_from("<I", buffer)
            event, buffer = json.loads(buffer[4 : 4 + n]), buffer[4 + n :]
            if event.get("code") == code:
                tally.errors[code] += 1
            else:
                tally.unexpected.append(f"garbage {code}: got {event}")
            await trio.sleep(0.5 + rng.random())


async def slow_reader(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    async with UmaClient.connect(sock) as client:
        while time.monotonic() < until:
            question = rng.choice(QUESTIONS)
            parts: list[str] = []
            async with client.stream(**chat(question)) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        parts.append(event.text)
                        if len(parts) % 8 == 0:
                            await trio.sleep(rng.random() * 2)  # a pause well under the stall timeout
            tally.check("slow reader", question, "".join(parts))


async def snapshot_client(sock: Path, tally: Tally, rng: random.Random, until: float) -> None:
    async with UmaClient.connect(sock) as client:
        while time.monotonic() < until:
            name = f"soak-{rng.randrange(4)}"
            prefix = f"You are assistant number {name[-1]}. " + " ".join(
                rng.choice(QUESTIONS) for _ in range(4)
            )
            try:
                await client.snapshot("save", name, prompt=prefix)
                names = {info.name for info in (await client.snapshot("list")).snapshots}
                if name not in names:
                    tally.unexpected.append(f"snapshot {name} saved but not listed")
                await client.snapshot("restore", rng.choice(sorted(names)))
                tally.served["snapshot"] += 1
            except RequestFailed as exc:
                tally.unexpected.append(f"snapshot: {exc.event.code} {exc.event.message}")
            await trio.sleep(min(15 + 10 * rng.random(), max(0.1, until - time.monotonic())))


async def sampler(sock: Path, daemon: psutil.Process, started: float, until: float) -> list[dict[str, Any]]:
    rows = []
    async with UmaClient.connect(sock) as client:
        while True:
            metrics = await client.metrics()
            requests = metrics["requests"]
            rows.append(
                {
                    "elapsed_s": round(time.monotonic() - started, 1),
                    "rss_mb": round(daemon.memory_info().rss / 2**20, 1),
                    "open_fds": daemon.num_fds(),
                    "connections": metrics["connections"]["open"],
                    "sessions": metrics["sessions"]["active"] + metrics["sessions"]["waiting"],
                    "kv_cells_used": metrics["kv"]["cells_used"],
                    "completed": sum(r.get("stop", 0) + r.get("length", 0) for r in requests.values()),
                    "cancelled": sum(r.get("cancelled", 0) for r in requests.values()),
                    "errors": sum(metrics["errors"].values()),
                }
            )
            if time.monotonic() >= until:
                return rows
            await trio.sleep(min(10.0, max(0.1, until - time.monotonic())))


async def soak(sock: Path, daemon: psutil.Process, minutes: float) -> tuple[Tally, list[dict[str, Any]]]:
    tally = Tally()
    started = time.monotonic()
    until = started + minutes * 60
    rows: list[dict[str, Any]] = []

    async def sample() -> None:
        rows.extend(await sampler(sock, daemon, started, until + 5))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for i in range(3):
            nursery.start_soon(chat_client, sock, tally, random.Random(i), until)
        nursery.start_soon(background_client, sock, tally, random.Random(10), until)
        nursery.start_soon(churn_client, sock, tally, random.Random(11), until)
        nursery.start_soon(garbage_client, sock, tally, random.Random(12), until)
        nursery.start_soon(slow_reader, sock, tally, random.Random(13), until)
        nursery.start_soon(snapshot_client, sock, tally, random.Random(14), until)
    await trio.sleep(2)  # the daemon ends what the clients left (cancels land between ticks)
    rows.extend(await sampler(sock, daemon, started, 0))
    return tally, rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["elapsed_s"] / 60 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [r["completed"] for r in rows], label="completed")
    axes[0].plot(t, [r["errors"] for r in rows], label="error events")
    axes[0].plot(t, [r["cancelled"] for r in rows], label="cancelled")
    axes[0].set_ylabel("requests")
    axes[0].legend()
    axes[1].plot(t, [r["rss_mb"] for r in rows])
    axes[1].set_ylabel("daemon RSS (MB)")
    axes[2].plot(t, [r["open_fds"] for r in rows], label="open fds")
    axes[2].plot(t, [r["connections"] for r in rows], label="connections")
    axes[2].set_ylabel("count")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle("uma-trio soak: mixed load on SmolLM2-135M Q4_1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="uma-soak-") as tmp:
        sock = Path(tmp) / "uma.sock"
        command = [
            "uma-trio", "serve", "--socket", str(sock), "--deterministic",
            "--snapshot-dir", str(Path(tmp) / "snapshots"),
            "--metrics-interval", "60", "--log-level", "warning",
        ]  # fmt: skip
        proc = subprocess.Popen(command, env={**os.environ, "UMA_BMT_BUDGET_GBPS": "20"})
        try:
            deadline = time.monotonic() + 120
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the daemon did not start")
                time.sleep(0.2)
            daemon = psutil.Process(proc.pid)
            tally, rows = trio.run(soak, sock, daemon, args.minutes)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)

    RESULTS.mkdir(exist_ok=True)
    write_csv(RESULTS / "soak.csv", rows, list(rows[0]))
    plot(rows, RESULTS / "soak.png")
    first, last = rows[0], rows[-1]
    peak_rss = max(r["rss_mb"] for r in rows)
    peak_fds = max(r["open_fds"] for r in rows)
    print(f"\nsoak: {last['elapsed_s'] / 60:.1f} min on the default model, daemon pid {proc.pid}")
    print(f"requests completed by the clients: {dict(tally.served)} (total {sum(tally.served.values())})")
    print(
        f"daemon: {last['completed']} completed, {last['cancelled']} cancelled, {last['errors']} error events"
    )
    print(f"churn clients that hung up: {tally.churned}; garbage frames sent: {tally.garbage_sent}")
    print(f"expected error events received: {dict(tally.errors)}")
    print(f"unexpected errors: {len(tally.unexpected)} {tally.unexpected[:5]}")
    print(f"nothing lost: {tally.mismatches} completed requests differed from their prompt's first answer")
    warm = next(r for r in rows if r["elapsed_s"] >= rows[-1]["elapsed_s"] / 5)
    print(
        f"RSS MB: start {first['rss_mb']}, after warm-up {warm['rss_mb']}, peak {peak_rss}, "
        f"end {last['rss_mb']}"
    )
    print(f"open fds: start {first['open_fds']}, after warm-up {warm['open_fds']}, peak {peak_fds}, "
          f"end {last['open_fds']}")  # fmt: skip
    print(
        f"nothing leaked: at the end {last['sessions']} sessions, "
        f"{last['kv_cells_used']} KV cells held by requests"
    )
    print(f"exit code of the daemon after SIGINT: {proc.returncode}")


if __name__ == "__main__":
    main()
