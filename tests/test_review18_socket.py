"""The socket protocol's review (eighteenth session), on the real model: a cancel stops a
request still being admitted, grammar compiles have threads of their own, a grammar that
matches nothing is refused before it takes a session, and `generate | head` is no daemon
failure."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.off_loop import COMPILES_AT_ONCE, compile_limiter

from .conftest import running_server
from .helpers import RawClient

pytestmark = pytest.mark.model
YES_OR_NO = 'root ::= "yes" | "no"'


def chain_grammar(rules: int) -> str:
    """A GBNF chain that takes llguidance a while to compile (1,000 rules: ~0.7 s here)."""
    lines = [
        "root ::= r0",
        *(f'r{i} ::= "x{i}" r{i + 1} | "y{i}"' for i in range(rules)),
        f'r{rules} ::= "z"',
    ]
    return "\n".join(lines)


async def test_a_cancel_stops_a_request_still_being_admitted(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """A cancel sent while its grammar compiled waited for the compile, and the next request
    on the connection waited behind it: 11.7 s for a one-token answer (a 1,500-rule grammar)."""
    async with running_server(llama_model, server_config) as server:
        limiter = compile_limiter()
        holders = [object() for _ in range(COMPILES_AT_ONCE)]
        for holder in holders:  # every compile thread busy: "g" stays in its admission
            await limiter.acquire_on_behalf_of(holder)
        try:
            client = await RawClient.connect(server.config.socket_path)
            await client.send({"id": "g", "prompt": "hi", "max_tokens": 2, "grammar": chain_grammar(50)})
            await trio.sleep(0.2)
            await client.send({"type": "cancel", "id": "g"})
            await client.send({"id": "p", "prompt": "Hello", "max_tokens": 1, "temperature": 0})
            with trio.fail_after(30):
                ends = {rid: events[-1] for rid, events in (await client.until_all_end(["g", "p"])).items()}
            await client.aclose()
        finally:
            for holder in holders:
                limiter.release_on_behalf_of(holder)
        cancels = server.metrics_snapshot()["cancels"]
    assert (ends["g"]["event"], ends["g"]["reason"]) == ("eos", "cancelled")
    assert ends["g"]["cancel_reason"] == "client" and cancels["client"] == 1
    assert (ends["p"]["event"], ends["p"]["reason"]) == ("eos", "length")


async def test_grammar_compiles_take_threads_of_their_own(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """An abandoned compile runs on to its end; in trio's shared pool, clients that sent big
    grammars and hung up could take every thread and stall everyone's long prompts."""
    async with running_server(llama_model, server_config) as server:
        limiter = compile_limiter()
        holders = [object() for _ in range(COMPILES_AT_ONCE)]
        for holder in holders:
            await limiter.acquire_on_behalf_of(holder)
        async with UmaClient.connect(server.config.socket_path) as client:
            long_prompt = "The quick brown fox jumps over the lazy dog. " * 120  # tokenized off the loop
            with trio.fail_after(60):
                plain = await client.complete(prompt=long_prompt, max_tokens=2)
            assert plain.eos.reason == "length"
            with trio.move_on_after(1.0) as waited:  # its compile waits for a thread
                await client.complete(prompt="hi", max_tokens=2, grammar=YES_OR_NO)
            assert waited.cancelled_caught
            for holder in holders:
                limiter.release_on_behalf_of(holder)
            with trio.fail_after(60):
                constrained = await client.complete(
                    prompt="hi", max_tokens=4, grammar='root ::= "yes" | "no"', temperature=0
                )
            assert constrained.text in ("yes", "no")


async def test_a_grammar_that_matches_nothing_is_refused_before_it_runs(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """`root ::= root` compiled, took a session and failed at its first token with
    E_RUNTIME_003 and 451 characters of llguidance's parser state."""
    async with running_server(llama_model, server_config) as server:
        client = await RawClient.connect(server.config.socket_path)
        for i, constraint in enumerate(
            [
                {"grammar": "root ::= root"},
                {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
            ]
        ):
            rid = f"r{i}"
            await client.send({"id": rid, "prompt": "x", "max_tokens": 3, **constraint})
            with trio.fail_after(30):
                (event,) = await client.until_end(rid)
            assert event["event"] == "error" and event["code"] == "E_GRAMMAR_001", event
            assert "<state>" not in event["message"], event["message"]
        await client.aclose()
        requests = server.metrics_snapshot()["requests"]
        assert not any(requests.values()), requests  # none took a session and ended


async def test_generate_into_a_closed_pipe_is_no_daemon_failure(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config) as server:
        generate = (
            f"{sys.executable} -m uma_trio generate --socket {server.config.socket_path} --raw "
            "--prompt 'Once upon a time' --max-tokens 200 --temp 0 | head -c 5; exit ${PIPESTATUS[0]}"
        )
        ran = await trio.to_thread.run_sync(
            lambda: subprocess.run(["bash", "-c", generate], capture_output=True, text=True, timeout=120)
        )
    assert ran.returncode == 141 and ran.stderr == "", (ran.returncode, ran.stderr)
    assert len(ran.stdout) == 5
