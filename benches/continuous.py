"""Does a background prompt advance while interactive chats stream without a pause?

    python benches/continuous.py [--rounds 2] [--seconds 30] [--baseline REV] [--no-llama-server]

Three chat clients stream one request after another with no think time (each a socket, or an
HTTP connection to llama-server), first alone for ``--seconds``, then again with a
background prompt of ``--prompt-tokens`` sent 2 s in.  Issue 19 asks that under continuous
interactive load a background request still advances at the rate the guard's budget allows,
while the chats' gaps stay within 1.2 × their p95 alone at p95 and 2 × at most.  Per server
and round it reports the chats' gaps (alone and beside the prompt), their tokens/s, and the
background prompt: how many of its tokens were read while the chats streamed (uma-trio's
metrics, ``in_flight[].prefilled`` and ``held``, read 0.3 s before the chats stop), and its
completion.
For uma-trio also the rescue ticks and the p95 slack (SCHEDULER.md "The p95 slack as an
error budget").  ``--baseline REV`` runs uma-trio at that revision too (a git worktree), each
server alone on the machine in turn.  CSV and a plot go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_output import free_port, save_figure, write_csv
from compare import DEFAULT_PEERS, ROOT, Setup, llama_server_command, running, uma_command
from one_stream import checkout

from uma_trio.model_files import ensure_default_model
from uma_trio.protocol.framing import FrameDecoder, encode_frame

SETUP = Setup(slots=4, n_ctx=4096)
CHATS = 3
BACKGROUND_AT_S = 2.0
MAX_FRAME_BYTES = 1 << 24  # a metrics snapshot is the largest event read here


def chat_prompt(chat: int, turn: int) -> str:
    return "hello " * 30 + f"chat {chat} turn {turn}"


def frames(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """The daemon's events on ``sock``, parsed, until it closes."""
    decoder = FrameDecoder(MAX_FRAME_BYTES)
    while data := sock.recv(65536):
        yield from (json.loads(frame) for frame in decoder.feed(data))


def send(sock: socket.socket, body: dict[str, Any]) -> None:
    sock.sendall(encode_frame(json.dumps(body).encode()))


@dataclass
class Phase:
    """What one phase (chats alone, or beside the background prompt) measured."""

    gaps: list[float] = field(default_factory=list)  # between two tokens both after gaps_from
    gaps_from: float = 0.0  # beside the background prompt: from its send on
    tokens: int = 0
    errors: list[BaseException] = field(default_factory=list)  # a client's, raised after the phase
    background_read: int | None = None  # prompt tokens read while the chats streamed
    background_of: int | None = None  # of its prompt's tokens (as the server counted them)
    background_held: str | None = None  # what held it then (uma-trio's in_flight[].held)
    background_s: float | None = None  # the background request's completion, from its send
    scheduler: dict[str, Any] = field(default_factory=dict)

    def took_token(self, lock: threading.Lock, last: float | None) -> float:
        """A chat's token arrived now (its previous one at ``last``); returns now."""
        now = time.monotonic()
        with lock:
            self.tokens += 1
            if last is not None and last >= self.gaps_from:
                self.gaps.append(now - last)
        return now


def guarded(work: Callable[..., None], phase: Phase) -> Callable[..., None]:
    """``work`` in a thread: what it raises is kept for the phase to raise, not lost with the
    thread (a phase carrying on with fewer chats would measure something else)."""

    def run(*args: Any) -> None:
        try:
            work(*args)
        except BaseException as exc:
            phase.errors.append(exc)

    return run


ChatFn = Callable[[int, int, float, Phase, threading.Lock], None]  # chat, round, until, into


@dataclass(frozen=True)
class Target:
    """One server: how a chat streams, how the background prompt is sent, what it reports."""

    name: str
    chat: ChatFn
    background: Callable[[int, Phase], None]
    metrics: Callable[[], dict[str, Any]] | None


def uma_target(name: str, sock_path: Path, prompt_tokens: int) -> Target:
    def chat(i: int, round_: int, until: float, phase: Phase, lock: threading.Lock) -> None:
        turn = 0
        while time.monotonic() < until:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(60.0)
                s.connect(str(sock_path))
                send(s, {"type": "generate", "id": f"c{i}", "prompt": chat_prompt(i, round_ * 1000 + turn),
                         "max_tokens": 400, "temperature": 0.0, "priority": "interactive"})  # fmt: skip
                last = None
                for event in frames(s):
                    if event.get("event") == "error":
                        raise RuntimeError(f"chat {i}: {event}")
                    if event.get("event") == "eos" or time.monotonic() >= until:
                        break
                    if event.get("event") == "token":
                        last = phase.took_token(lock, last)
            turn += 1

    def background(round_: int, phase: Phase) -> None:
        sent = time.monotonic()
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(600.0)
            s.connect(str(sock_path))
            send(s, {"type": "generate", "id": "bulk", "prompt": f"{round_} " + "data " * prompt_tokens,
                     "max_tokens": 8, "temperature": 0.0, "priority": "background"})  # fmt: skip
            for event in frames(s):
                if event.get("event") == "error":
                    raise RuntimeError(f"background: {event}")
                if event.get("event") == "eos":
                    break
        phase.background_s = time.monotonic() - sent

    def metrics() -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock_path))
            send(s, {"type": "metrics", "id": "m"})
            return next(frames(s))["metrics"]  # type: ignore[no-any-return]

    return Target(name, chat, background, metrics)


def llama_server_target(url: str, prompt_tokens: int) -> Target:
    def chat(i: int, round_: int, until: float, phase: Phase, lock: threading.Lock) -> None:
        turn = 0
        while time.monotonic() < until:
            body = {"prompt": chat_prompt(i, round_ * 1000 + turn), "n_predict": 400, "temperature": 0,
                    "stream": True}  # fmt: skip
            last = None
            # A connection each: llama-server's HTTP library closes kept-alive ones on its own.
            with (
                httpx.Client(timeout=120) as client,
                client.stream("POST", f"{url}/completion", json=body) as sse,
            ):
                for line in sse.iter_lines():
                    if time.monotonic() >= until:
                        break
                    # A token with text, as uma-trio sends one (it sends none for an empty piece).
                    if line.startswith("data: ") and json.loads(line[6:]).get("content"):
                        last = phase.took_token(lock, last)
            turn += 1

    def background(round_: int, phase: Phase) -> None:
        sent = time.monotonic()
        body = {"prompt": f"{round_} " + "data " * prompt_tokens, "n_predict": 8, "temperature": 0}
        httpx.post(f"{url}/completion", json=body, timeout=600).raise_for_status()
        phase.background_s = time.monotonic() - sent

    return Target("llama-server", chat, background, None)


def run_phase(target: Target, round_: int, seconds: float, with_background: bool) -> Phase:
    phase, lock = Phase(), threading.Lock()
    start = time.monotonic()
    until = start + seconds
    chats = [threading.Thread(target=guarded(target.chat, phase), args=(i, round_, until, phase, lock))
             for i in range(CHATS)]  # fmt: skip
    for thread in chats:
        thread.start()
    bulk = None
    if with_background:
        time.sleep(BACKGROUND_AT_S)
        phase.gaps_from = time.monotonic()
        bulk = threading.Thread(target=guarded(target.background, phase), args=(round_, phase))
        bulk.start()
        time.sleep(max(0.0, until - 0.3 - time.monotonic()))
        if target.metrics is not None:
            snapshot = target.metrics()
            rows = [r for r in snapshot.get("in_flight", []) if r.get("lane") == "background"]
            phase.background_read = rows[0]["prefilled"] if rows else None
            phase.background_of = rows[0]["prompt_tokens"] if rows else None
            phase.background_held = rows[0].get("held") if rows else None
            phase.scheduler = snapshot.get("scheduler", {})
    for thread in chats:
        thread.join()
    if not with_background and target.metrics is not None:  # counters to subtract from the next phase's
        phase.scheduler = target.metrics().get("scheduler", {})
    if bulk is not None:
        bulk.join()
        done = phase.background_s is not None and phase.background_s < seconds - BACKGROUND_AT_S
        if phase.background_read is None and done:
            phase.background_read = -1  # finished while the chats streamed: all of it
    if phase.errors:
        raise phase.errors[0]
    return phase


def quantile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[int(q * (len(ranked) - 1))] if ranked else float("nan")


def row_of(
    name: str, round_: int, alone: Phase, mixed: Phase, seconds: float, prompt_tokens: int
) -> dict[str, Any]:
    alone_p95, p95 = quantile(alone.gaps, 0.95), quantile(mixed.gaps, 0.95)
    worst = max(mixed.gaps, default=float("nan"))
    read = mixed.background_read
    slack = mixed.scheduler.get("slack", {})
    rescues = ""  # the mixed phase's own (the daemon counts from its start)
    if "rescue_ticks" in mixed.scheduler:
        rescues = mixed.scheduler["rescue_ticks"] - alone.scheduler.get("rescue_ticks", 0)
    return {
        "round": round_, "target": name,
        "alone_gap_p50_ms": round(1000 * quantile(alone.gaps, 0.5), 2),
        "alone_gap_p95_ms": round(1000 * alone_p95, 2),
        "gap_p50_ms": round(1000 * quantile(mixed.gaps, 0.5), 2), "gap_p95_ms": round(1000 * p95, 2),
        "gap_max_ms": round(1000 * worst, 2),
        "p95_over_alone": round(p95 / alone_p95, 3), "max_over_alone": round(worst / alone_p95, 3),
        "chat_tok_s_over_alone": round(mixed.tokens / max(1, alone.tokens), 3),
        "background_read": prompt_tokens if read == -1 else read,
        "background_of": mixed.background_of or prompt_tokens,
        "background_held": mixed.background_held or "",
        "background_s": round(mixed.background_s, 2) if mixed.background_s is not None else None,
        "rescue_ticks": rescues, "slack_used": slack.get("used", ""),
        "seconds": seconds,
    }  # fmt: skip


def plot(rows: list[dict[str, Any]], names: list[str], prompt_tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (read, gaps) = plt.subplots(1, 2, figsize=(10, 4))
    for i, name in enumerate(names):
        mine = [r for r in rows if r["target"] == name]
        measured = [float(r["background_read"]) for r in mine if r["background_read"] is not None]
        read.bar([i], [statistics.median(measured or [0.0])])
        for shift, key, label, colour in (
            (-0.2, "p95", "p95", "tab:blue"),
            (0.2, "max", "max", "tab:orange"),
        ):
            ratio = statistics.median(float(r[f"{key}_over_alone"]) for r in mine)
            gaps.bar([i + shift], [ratio], width=0.4, label=label if i == 0 else None, color=colour)
    for ax in (read, gaps):
        ax.set_xticks(range(len(names)), names, fontsize=8)
    read.set_ylabel(f"background prompt tokens read while the chats streamed (of {prompt_tokens})")
    gaps.axhline(1.2, color="tab:blue", linestyle=":")
    gaps.axhline(2.0, color="tab:orange", linestyle=":")
    gaps.set_yscale("log")
    gaps.set_ylabel("chats' gap / their p95 alone")
    gaps.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--baseline", metavar="REV", help="also run uma-trio at this git revision")
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "continuous")
    args = parser.parse_args()
    model = ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    names = ["uma-trio", *([f"uma-trio@{args.baseline}"] if args.baseline else [])]
    names += [] if args.no_llama_server else ["llama-server"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="uma-cont-") as tmp, ExitStack() as trees:
        base_tree = trees.enter_context(checkout(args.baseline)) if args.baseline else None
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:  # alternate who runs first
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                log = args.out / f"{name.replace('@', '-at-')}-{round_}.log"
                with ExitStack() as stack:
                    if name == "llama-server":
                        command = llama_server_command(args.peers, model, SETUP, port)
                        stack.enter_context(running(command, url, name, log))
                        target = llama_server_target(url, args.prompt_tokens)
                    else:
                        sock = Path(tmp) / f"{round_}-{len(rows)}.sock"
                        tree = base_tree if name != "uma-trio" else None
                        stack.enter_context(running(uma_command(SETUP, sock, port), url, name, log, cwd=tree))
                        target = uma_target(name, sock, args.prompt_tokens)
                    alone = run_phase(target, round_, args.seconds, with_background=False)
                    mixed = run_phase(target, round_ + 100, args.seconds, with_background=True)
                row = row_of(name, round_, alone, mixed, args.seconds, args.prompt_tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n| target (medians of {args.rounds} rounds) | gap p95 / alone p95 | max / alone p95 "
          "| chats' tokens beside / alone | background prompt tokens read while the chats streamed "
          f"(of {args.prompt_tokens}) | background completion s | rescue ticks | slack used |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        mine = [r for r in rows if r["target"] == name]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> str:
            values = [float(r[key]) for r in mine if r[key] not in ("", None)]
            return f"{statistics.median(values):.3g}" if values else "-"

        keys = ["p95_over_alone", "max_over_alone", "chat_tok_s_over_alone", "background_read",
                "background_s", "rescue_ticks", "slack_used"]  # fmt: skip
        print(f"| {name} | " + " | ".join(med(key) for key in keys) + " |")
    write_csv(args.out / "continuous.csv", rows, list(rows[0]))
    plot(rows, names, args.prompt_tokens, args.out / "continuous.png")


if __name__ == "__main__":
    main()
