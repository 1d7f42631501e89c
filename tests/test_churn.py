"""Churn: hundreds of clients connect, start a stream and hang up at random points.

Afterwards the daemon holds nothing for them: no session, no KV cell reserved or held by
a request (cached prefixes aside, which belong to nobody), no connection, no file
descriptor more than before, and its memory back within a small bound.  Run on the
simulated engine (virtual time, 400 clients) and on the real model (100 clients).
"""

from __future__ import annotations

import gc
import os
import random
from collections import Counter
from dataclasses import dataclass, replace

import psutil
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.daemon import serving
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .helpers import RawClient, assert_nothing_held, frame, sim_daemon

WHEN = ("before the request", "mid-frame", "while waiting or prefilling", "mid-decode", "after eos")


@dataclass(frozen=True)
class Shape:
    parallel: int  # clients at once
    words: tuple[int, int]  # prompt length range
    max_tokens: int


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def phase_of(server: Server, rid: str) -> str | None:
    return next((row["phase"] for row in server.loop.gauges()["in_flight"] if row["id"] == rid), None)


async def churner(
    server: Server, rng: random.Random, rid: str, words: int, max_tokens: int, seen: Counter[str]
) -> None:
    """One client: connects, maybe starts a stream, hangs up at a random point; records the
    request's phase on the daemon at the moment it hung up."""
    when = rng.choice(WHEN)
    client = await RawClient.connect(server.config.socket_path)
    request = {
        "id": rid,
        "prompt": " ".join(f"w{rng.randrange(50)}" for _ in range(words)),
        "max_tokens": max_tokens,
    }
    try:
        if when == "before the request":
            return
        if when == "mid-frame":
            data = frame(request)
            await client.send_bytes(data[: rng.randrange(1, len(data))])
            return
        await client.send(request)
        if when == "while waiting or prefilling":
            await trio.sleep(rng.random() * 0.2)
        elif when == "mid-decode":
            for _ in range(rng.randrange(1, max_tokens)):
                event = await client.next_event()
                assert event is not None and event["event"] in ("token", "eos"), event
                if event["event"] == "eos":  # the model had said all it had to say
                    break
        else:
            events = await client.until_end(rid)
            assert events[-1]["event"] == "eos" and events[-1]["reason"] in ("stop", "length")
        seen[phase_of(server, rid) or "ended"] += 1
    finally:
        await client.aclose()


async def churn(server: Server, n_clients: int, shape: Shape, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    seen: Counter[str] = Counter()
    numbers = iter(range(n_clients))

    async def lane() -> None:
        for n in numbers:
            await churner(server, rng, f"c{n}", rng.randrange(*shape.words), shape.max_tokens, seen)

    async with trio.open_nursery() as nursery:
        for _ in range(shape.parallel):
            nursery.start_soon(lane)
    return seen


async def settle(server: Server) -> None:
    """Let the daemon notice every hang-up and end every request."""
    with trio.fail_after(30):
        while server.metrics.connections_open or server.loop.gauges()["sessions"]["active"]:
            await trio.sleep(0.05)
        await server.loop.wait_idle()


async def churn_and_check(server: Server, n_clients: int, shape: Shape, *, rss_bound_mb: float) -> None:
    await churn(server, 40, shape, seed=1)  # warm-up: buffers, caches, lazily made objects
    await settle(server)
    gc.collect()
    fds, rss = open_fds(), rss_mb()
    seen = await churn(server, n_clients, shape, seed=2)
    await settle(server)
    gc.collect()
    assert_nothing_held(server)
    assert server.metrics.connections_open == 0
    assert open_fds() <= fds, (fds, open_fds())
    assert rss_mb() - rss < rss_bound_mb, (rss, rss_mb())
    # Every point was hit: queued or prefilling, decoding, and already ended.
    assert seen["prefill"] + seen["waiting"] > 0 and seen["decode"] > 0 and seen["ended"] > 0, seen
    print(f"churned {n_clients} clients, daemon-side phase at hang-up {dict(seen)}: ", end="")
    print(f"fds {fds} -> {open_fds()}, RSS {rss:.1f} -> {rss_mb():.1f} MB")


async def test_churn_on_the_simulated_engine(autojump_clock: trio.abc.Clock) -> None:
    async with sim_daemon(prefix_cache_cells=None, max_sessions=6) as server:
        await churn_and_check(server, 400, Shape(16, (20, 400), 64), rss_bound_mb=8.0)
    assert server.metrics.cancels["disconnect"] > 0


@pytest.mark.model
async def test_churn_on_the_real_model(llama_model: LlamaModel, server_config: ServerConfig) -> None:
    async with serving(llama_model, replace(server_config, max_sessions=4)) as server:
        await churn_and_check(server, 100, Shape(8, (10, 120), 24), rss_bound_mb=16.0)


async def test_a_request_cancelled_while_a_job_runs_is_never_admitted(autojump_clock: trio.abc.Clock) -> None:
    """A cancel that arrives while the decode task awaits a job (a snapshot's save or restore)
    takes effect before admission: the request claimed no sequence and no prefill ran for it."""
    async with sim_daemon(run_ahead=True, prefix_cache_cells=None) as server:
        loop = server.loop
        client = await RawClient.connect(server.config.socket_path)

        async def job() -> None:
            await client.send_bytes(frame({"id": "r", "prompt": "w " * 300, "max_tokens": 5}))
            while not loop._waiting:  # its connection queues it while the job runs
                await trio.lowlevel.checkpoint()
            loop.cancel(loop._waiting[0], "client")

        steps_before = len(server.engine.steps)
        await loop.exclusive(job)
        events = await client.until_end("r")
        assert events[-1]["reason"] == "cancelled"
        assert server.engine.steps[steps_before:] == []
        assert loop.kv.cached() == {}
