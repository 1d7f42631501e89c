"""Injected engine failures end only the requests they hit, and the daemon recovers.

The faults come from :class:`~uma_trio.engine.faults.FaultyEngine`, around the simulated
engine (virtual time, so a chaos run of hundreds of requests takes a second) and around
the real llama.cpp engine, where a bad token makes ``llama_decode`` itself refuse the
batch, a sampler raises inside the engine's own sampling loop, and a poisoned context is
really freed and created again.
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.daemon import engine_for, policy_for
from uma_trio.engine.faults import FaultKind, FaultyEngine, seed_is
from uma_trio.engine.llama import LlamaEngine, LlamaModel
from uma_trio.engine.llama_model import ModelLoadError
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.runtime.server import DaemonFailed, Server

from .helpers import RawClient, assert_nothing_held, sim_daemon, sim_server, text_of

Events = list[dict[str, Any]]

# The code each fault gives the request it hits.
CODE = {
    "bad_token": "E_RUNTIME_001",
    "sampling": "E_RUNTIME_003",
    "poison": "E_RUNTIME_004",
    "crash": "E_RUNTIME_004",
}


@asynccontextmanager
async def faulty_sim(**overrides: Any) -> AsyncIterator[tuple[Server, FaultyEngine]]:
    async with sim_daemon(FaultyEngine, **overrides) as server:
        assert isinstance(server.engine, FaultyEngine)
        yield server, server.engine


async def run_request(server: Server, request: dict[str, Any]) -> Events:
    client = await RawClient.connect(server.config.socket_path)
    await client.send(request)
    events = await client.until_end(request["id"])
    await client.aclose()
    return events


def after(position: int) -> Callable[[Any], bool]:
    return lambda entry: entry.pos0 >= position


def both(*tests: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda entry: all(test(entry) for test in tests)


def request(rid: str, seed: int, max_tokens: int = 60) -> dict[str, Any]:
    return {"id": rid, "prompt": f"story number {seed} " * 8, "max_tokens": max_tokens, "seed": seed}


@pytest.mark.parametrize("kind", ["bad_token", "sampling"])
async def test_a_request_fault_ends_only_that_request(
    autojump_clock: trio.abc.Clock, kind: FaultKind
) -> None:
    async with faulty_sim() as (server, engine):
        fault = engine.arm(kind, both(seed_is(99), after(40)))  # mid-decode
        results: dict[str, Events] = {}

        async def one(rid: str, seed: int) -> None:
            results[rid] = await run_request(server, request(rid, seed))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, f"ok{i}", i)
            nursery.start_soon(one, "target", 99)

    assert fault in engine.fired
    target = results.pop("target")
    assert target[-1]["event"] == "error" and target[-1]["code"] == CODE[kind], target[-1]
    assert 0 < len(target) - 1 < 60  # some tokens came before the fault
    for events in results.values():
        assert events[-1]["event"] == "eos" and events[-1]["reason"] == "length"
        assert len(text_of(events).split()) == 60
    assert server.metrics.errors == Counter({CODE[kind]: 1})
    assert server.metrics.context_rebuilds == 0 and engine.inner.rebuilds == 0  # type: ignore[attr-defined]
    assert_nothing_held(server)


@pytest.mark.parametrize("kind", ["poison", "crash"])
async def test_a_poisoned_context_is_rebuilt_and_waiting_requests_go_on(
    autojump_clock: trio.abc.Clock, kind: FaultKind
) -> None:
    async with faulty_sim(max_sessions=2, interactive_reserve=0, prefix_cache_cells=None) as (server, engine):
        engine.arm(kind, both(seed_is(1), after(30)))
        results: dict[str, Events] = {}

        async def one(rid: str, seed: int, delay: float = 0.0) -> None:
            await trio.sleep(delay)
            results[rid] = await run_request(server, request(rid, seed))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", 1)
            nursery.start_soon(one, "b", 2)
            nursery.start_soon(one, "queued", 3, 0.01)  # waits: both sessions are taken
        # The daemon serves on, on the new context.
        results["later"] = await run_request(server, request("later", 1))

    for rid in ("a", "b"):
        assert results[rid][-1]["event"] == "error" and results[rid][-1]["code"] == "E_RUNTIME_004"
    for rid in ("queued", "later"):
        assert results[rid][-1]["event"] == "eos" and len(text_of(results[rid]).split()) == 60
    assert server.metrics.context_rebuilds == 1 and engine.inner.rebuilds == 1  # type: ignore[attr-defined]
    assert server.metrics.errors == Counter({"E_RUNTIME_004": 2})
    assert_nothing_held(server)


class UnrebuildableFaultyEngine(FaultyEngine):
    async def rebuild(self) -> None:
        raise ModelLoadError("injected: llama.cpp could not create a new context")


async def test_a_context_that_cannot_be_rebuilt_ends_every_request_and_stops_the_daemon(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The rebuild's failure went up the daemon's nursery: the running requests had their
    error, the queued one none (its connection just closed), and serve ended with a traceback."""
    results: dict[str, Events] = {}
    failures: list[BaseException] = []
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock", max_sessions=2, interactive_reserve=0)
        server = sim_server(config, UnrebuildableFaultyEngine)
        assert isinstance(server.engine, FaultyEngine)
        server.engine.arm("poison", both(seed_is(1), after(30)))

        async def one(rid: str, seed: int, delay: float = 0.0) -> None:
            await trio.sleep(delay)
            results[rid] = await run_request(server, request(rid, seed))

        began = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                async with trio.open_nursery() as clients:
                    clients.start_soon(one, "a", 1)
                    clients.start_soon(one, "b", 2)
                    clients.start_soon(one, "queued", 3, 0.01)  # waits: both sessions are taken
        except* DaemonFailed as group:
            failures.extend(group.exceptions)
        took = trio.current_time() - began
    assert {rid: events[-1].get("code") for rid, events in results.items()} == dict.fromkeys(
        ("a", "b", "queued"), "E_RUNTIME_004"
    )
    assert "could not create a new context" in results["queued"][-1]["message"]
    assert len(failures) == 1 and "cannot serve" in str(failures[0])
    assert took < 2.0  # the failed loop is idle: the drain does not sit out its 5 s flush timeout


async def test_random_faults_under_load_end_only_what_they_hit(autojump_clock: trio.abc.Clock) -> None:
    """Chaos: 300 requests from 24 clients; 60 faults of every kind aimed at random requests.
    Every request either delivers its whole output or ends with the code of the fault that
    hit it (or, next to a poisoned context, E_RUNTIME_004); nothing is held afterwards."""
    rng = random.Random(11)
    n_requests, n_faults = 300, 60
    targets = rng.sample(range(n_requests), n_faults)
    kinds: list[FaultKind] = ["bad_token", "sampling", "poison", "crash"]
    async with faulty_sim(max_sessions=6, prefix_cache_cells=None) as (server, engine):
        aimed = {
            seed: engine.arm(rng.choice(kinds), both(seed_is(seed), after(rng.randrange(1, 80))))
            for seed in targets
        }
        outcomes: dict[int, Events] = {}
        queue = list(range(n_requests))

        async def client() -> None:
            while queue:
                seed = queue.pop()
                await trio.sleep(rng.random() * 0.05)
                shared = "shared system prompt " * rng.randrange(0, 6)  # prefixes to reuse
                body = {"id": f"r{seed}", "prompt": shared + f"question {seed}", "max_tokens": 40 + seed % 50}
                outcomes[seed] = await run_request(server, {**body, "seed": seed})

        async with trio.open_nursery() as nursery:
            for _ in range(24):
                nursery.start_soon(client)

        fired = {seed: fault.kind for seed, fault in aimed.items() if fault in engine.fired}
        poisons = sum(kind in ("poison", "crash") for kind in fired.values())
        collateral = 0
        for seed, events in outcomes.items():
            last = events[-1]
            if seed in fired:
                # Another fault poisoning the context in the same step may overtake this one.
                expected = {CODE[fired[seed]], "E_RUNTIME_004" if poisons else ""}
                assert last["event"] == "error" and last["code"] in expected, (seed, fired[seed], last)
            elif last["event"] == "error":
                assert last["code"] == "E_RUNTIME_004", last  # a neighbour's poisoned context
                collateral += 1
            else:
                assert last["reason"] == "length" and len(text_of(events).split()) == 40 + seed % 50
        assert len(outcomes) == n_requests
        assert len(fired) >= n_faults * 0.6  # most targets were still running past the fault's position
        assert collateral <= poisons * (server.config.max_sessions - 1)
        assert server.metrics.context_rebuilds == poisons == engine.inner.rebuilds  # type: ignore[attr-defined]
        assert sum(server.metrics.errors.values()) == len(fired) + collateral
        assert_nothing_held(server)


# -- the real engine -----------------------------------------------------------------

BYSTANDERS = ["Name three colours.", "Count from one to ten.", "What is the capital of France?"]


def chat(rid: str, content: str, seed: int, max_tokens: int = 40) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"id": rid, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": seed}


@asynccontextmanager
async def real_daemon(
    model: LlamaModel, config: ServerConfig, **overrides: Any
) -> AsyncIterator[tuple[Server, FaultyEngine, LlamaEngine]]:
    config = replace(config, **overrides)
    llama_engine = engine_for(model, config)
    engine = FaultyEngine(llama_engine)
    try:
        async with trio.open_nursery() as nursery:
            server = Server(engine, config, policy_for(llama_engine, config))
            await nursery.start(server.serve)
            yield server, engine, llama_engine
            server.request_shutdown(force=True)
    finally:
        llama_engine.close()


async def concurrently(jobs: Mapping[str, Callable[[], Awaitable[Events]]]) -> dict[str, Events]:
    results: dict[str, Events] = {}

    async def run(rid: str, job: Callable[[], Awaitable[Events]]) -> None:
        results[rid] = await job()

    async with trio.open_nursery() as nursery:
        for rid, job in jobs.items():
            nursery.start_soon(run, rid, job)
    return results


@pytest.mark.model
@pytest.mark.parametrize("kind", ["bad_token", "sampling"])
async def test_real_engine_fault_leaves_the_others_exact(
    llama_model: LlamaModel, server_config: ServerConfig, kind: FaultKind
) -> None:
    bystanders = {f"b{i}": chat(f"b{i}", content, i) for i, content in enumerate(BYSTANDERS)}
    async with real_daemon(llama_model, server_config, prefix_cache_cells=0) as (server, engine, llama):
        with trio.fail_after(120):
            reference = {rid: text_of(await run_request(server, body)) for rid, body in bystanders.items()}
            engine.arm(kind, both(seed_is(99), after(40)))  # 25 tokens into the target's answer
            jobs = {rid: partial(run_request, server, body) for rid, body in bystanders.items()}
            jobs["target"] = partial(run_request, server, chat("target", "Tell me a long story.", 99, 200))
            results = await concurrently(jobs)
        assert_nothing_held(server)  # while the context still exists
    target = results.pop("target")
    assert target[-1]["event"] == "error" and target[-1]["code"] == CODE[kind]
    assert len(target) > 1  # it had streamed tokens before the fault
    for rid, events in results.items():
        assert events[-1]["event"] == "eos"
        assert text_of(events) == reference[rid]  # decoded apart or not, exactly as before
    assert server.metrics.errors == Counter({CODE[kind]: 1})
    assert llama.rebuilds == 0


@pytest.mark.model
async def test_real_engine_poisoned_context_is_rebuilt(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    overrides = {"max_sessions": 2, "interactive_reserve": 0}
    async with real_daemon(llama_model, server_config, **overrides) as (server, engine, llama):
        with trio.fail_after(120):
            reference = text_of(await run_request(server, chat("ref", BYSTANDERS[2], 3)))
            assert server.loop.gauges()["prefix_cache"]["sequences"] == 1  # the reference's KV is cached
            engine.arm("poison", both(seed_is(1), after(40)))  # 25 tokens into a's answer

            async def queued() -> Events:
                while server.loop.gauges()["sessions"]["active"] < 2:  # a and b hold both sessions
                    await trio.sleep(0.01)
                return await run_request(server, chat("queued", BYSTANDERS[2], 3))

            results = await concurrently(
                {
                    "a": partial(run_request, server, chat("a", "Tell me a long story.", 1, 200)),
                    "b": partial(run_request, server, chat("b", "Write a long poem about the sea.", 2, 200)),
                    "queued": queued,
                }
            )
            later = await run_request(server, chat("later", BYSTANDERS[2], 3))
        assert_nothing_held(server)
    for rid in ("a", "b"):
        assert results[rid][-1]["event"] == "error" and results[rid][-1]["code"] == "E_RUNTIME_004"
    # The waiting request ran on the fresh context, and so did a later one: same text.
    assert text_of(results["queued"]) == text_of(later) == reference
    assert llama.rebuilds == server.metrics.context_rebuilds == 1
