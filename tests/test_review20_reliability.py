"""Review 20: a request still being admitted when the daemon drains, and a metrics figure that
cannot be read, each of which ended more than it should have."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import uma_trio.runtime.intake as intake
from uma_trio.engine.base import Engine
from uma_trio.engine.sampling import Sampler
from uma_trio.protocol.messages import GenerateRequest

from .helpers import RawClient, sim_daemon


async def test_a_request_being_admitted_at_shutdown_is_answered(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose grammar was still compiling when the drain began: the drain's last wait
    counted only requests already queued, so its connection closed with no answer at all."""
    real = intake.sampler_for

    async def compiling(engine: Engine, request: GenerateRequest, *args: Any) -> Sampler:
        await trio.sleep(2.0)  # a grammar compile takes seconds
        return await real(engine, request, *args)

    monkeypatch.setattr(intake, "sampler_for", compiling)
    async with sim_daemon(shutdown_grace_s=10.0) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "g", "prompt": "hi there", "max_tokens": 5})
        await trio.sleep(0.5)
        server.request_shutdown()
        last = await client.next_event()
    assert last is not None and last["event"] == "error" and last["code"] == "E_LIMIT_008", last


async def test_a_metrics_figure_that_cannot_be_read_fails_one_answer_not_the_daemon(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psutil out of file descriptors: the metrics task's exception stopped the daemon, and a
    metrics request's closed its client's connection unanswered."""
    async with sim_daemon(metrics_interval_s=0.5) as server:
        real = server.scorecard
        broken = [True]

        def scorecard(*args: Any, **kwargs: Any) -> Any:
            if broken[0]:
                raise OSError(24, "Too many open files")
            return real(*args, **kwargs)

        monkeypatch.setattr(server, "scorecard", scorecard)
        client = await RawClient.connect(server.config.socket_path)
        await trio.sleep(2.0)  # a few metrics ticks, each failing
        await client.send({"type": "metrics", "id": "m"})
        failed = await client.next_event()
        broken[0] = False
        await client.send({"id": "r", "prompt": "hi there", "max_tokens": 5})
        served = await client.until_end("r")
        await client.send({"type": "metrics", "id": "m2"})
        answered = await client.next_event()
    assert failed is not None and (failed["event"], failed["code"]) == ("error", "E_RUNTIME_005"), failed
    assert served[-1]["event"] == "eos" and served[-1]["reason"] == "length"
    assert answered is not None and answered["event"] == "metrics"


@pytest.mark.parametrize(
    ("max_context", "says"),
    [
        (64, "leave no room for an answer in 64 (the request's max_context)"),
        (256, "leave no room for an answer in 256 (the per-request context)"),
        (260, "leave no room for an answer in 256 (the per-request context)"),
    ],
)
async def test_a_prompt_past_max_context_names_the_limit_that_applies(
    autojump_clock: trio.abc.Clock, max_context: int, says: str
) -> None:
    """A max_context at or past the per-request context (/infill sets it so, Ollama's
    num_ctx may) read "N maximum (the request's max_context)", a field those clients never
    sent, and N was not always the limit that stopped the prompt."""
    async with sim_daemon(n_ctx=256) as server:
        client = await RawClient.connect(server.config.socket_path)
        prompt = "word " * (server.engine.n_ctx_seq + 10)
        await client.send({"id": "p", "prompt": prompt, "max_tokens": 1, "max_context": max_context})
        refused = await client.next_event()
    assert refused is not None and refused["code"] == "E_LIMIT_002" and says in refused["message"], refused


async def test_a_max_context_past_the_engine_s_cuts_at_the_engine_s(autojump_clock: trio.abc.Clock) -> None:
    """A route's ceiling reads --n-ctx for a model not loaded yet, which may load with a
    smaller context: the answer is cut at the engine's room, not refused for prompt +
    max_tokens over the context (found by review, session 21)."""
    async with sim_daemon(n_ctx=256) as server:
        client = await RawClient.connect(server.config.socket_path)
        prompt = "word " * (server.engine.n_ctx_seq - 20)
        await client.send({"id": "p", "prompt": prompt, "max_tokens": 100, "max_context": 100_000})
        events = await client.until_end("p")
    assert events[-1]["event"] == "eos" and events[-1]["reason"] == "length", events[-1]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.engine.n_ctx_seq
