"""Every bad input gets an error event with its code; nobody else notices."""

from __future__ import annotations

import itertools
import struct
from typing import Any

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .conftest import running_server
from .helpers import RawClient, frame, slow_grammar

pytestmark = pytest.mark.model

OK = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (frame(b"{oops"), "E_PROTO_001"),
        (frame({"id": "t", "prompt": 42}), "E_PROTO_002"),
        (frame({"id": "t", "prompt": "p", "colour": "red"}), "E_PROTO_002"),
        (frame(b'{"id": "t", "prompt": "\xc3\x28"}'), "E_PROTO_003"),
        (frame({"type": "shutdown", "id": "t"}), "E_PROTO_005"),
        (frame({"type": "cancel", "id": "nobody"}), "E_PROTO_007"),
        (frame({"id": "t", "prompt": "word " * 300, "max_tokens": 4}), "E_LIMIT_001"),
        (frame({"id": "t", "prompt": "p", "max_tokens": 100000}), "E_LIMIT_003"),
        (frame({"id": "t", "prompt": "word " * 100, "max_tokens": 1000}), "E_LIMIT_002"),
    ],
)
async def test_bad_message_gets_code_and_connection_keeps_working(
    llama_model: LlamaModel, server_config: ServerConfig, raw: bytes, code: str
) -> None:
    async with running_server(
        llama_model, server_config, n_ctx=1024, max_prompt_tokens=256, max_tokens=1000
    ) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send_bytes(raw)
        with trio.fail_after(30):
            error = await client.next_event()
            assert error is not None and error["event"] == "error", error
            assert error["code"] == code and error["message"]
            # The same connection still serves a good request afterwards.
            await client.send({"id": "after", **OK})
            events = await client.until_end("after")
        assert events[-1]["event"] == "eos"
        assert server.metrics.errors[code] == 1


async def test_duplicate_id_in_flight_is_refused(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    await client.send({"id": "dup", **OK, "max_tokens": 64})
    await client.send({"id": "dup", **OK})
    seen: list[dict[str, Any]] = []
    with trio.fail_after(30):
        while not any(e["event"] == "eos" for e in seen):
            event = await client.next_event()
            assert event is not None
            seen.append(event)
    errors = [e for e in seen if e["event"] == "error"]
    assert [e["code"] for e in errors] == ["E_PROTO_006"] and errors[0]["id"] == "dup"
    assert sum(e["event"] == "eos" for e in seen) == 1


async def test_an_id_is_free_again_as_soon_as_its_eos_is_read(server: Server) -> None:
    # The client may reuse an id in the frame right after its eos; the daemon must not
    # still count the ended request as in flight (it once freed the id a few steps later).
    client = await RawClient.connect(server.config.socket_path)
    with trio.fail_after(60):
        for _ in range(30):
            await client.send({"id": "again", **OK, "max_tokens": 1})
            events = await client.until_end("again")
            assert [e["event"] for e in events][-1] == "eos", events
            assert not [e for e in events if e["event"] == "error"], events
    assert server.metrics.errors.get("E_PROTO_006", 0) == 0


async def test_oversized_frame_closes_only_that_connection(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, max_frame_bytes=1024) as server:
        bystander = await RawClient.connect(server.config.socket_path)
        await bystander.send({"id": "b", **OK, "max_tokens": 32})
        offender = await RawClient.connect(server.config.socket_path)
        await offender.send_bytes(struct.pack("<I", 10_000_000) + b"{")
        with trio.fail_after(30):
            error = await offender.next_event()
            assert error is not None and error["code"] == "E_PROTO_004"
            assert await offender.next_event() is None  # closed after the error
            events = await bystander.until_end("b")
        assert events[-1]["event"] == "eos" and events[-1]["reason"] in ("stop", "length")


async def test_full_daemon_says_busy(llama_model: LlamaModel, server_config: ServerConfig) -> None:
    async with running_server(llama_model, server_config, max_sessions=1, max_queue=0) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "one", **OK, "max_tokens": 64})
        first = await client.next_event()
        assert first is not None and first["event"] == "token"
        await client.send({"id": "two", **OK})
        with trio.fail_after(30):
            events = await client.until_end("two")
        assert events[-1]["code"] == "E_LIMIT_004"


async def test_requests_beyond_sessions_wait_in_the_queue(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, max_sessions=1) as server:
        results: list[Any] = []

        async def one(i: int) -> None:
            async with UmaClient.connect(server.config.socket_path) as client:
                results.append(await client.complete(id=f"q{i}", **OK))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
        assert len(results) == 3
        assert max(r.eos.timings.queue_ms for r in results) > 0


async def test_a_chat_of_many_empty_turns_is_refused_or_rendered_off_the_loop(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Empty turns counted as no text, so 40,000 of them were rendered and tokenized on the
    event loop (33 s, every other client waiting) before the token count refused them."""
    async with running_server(llama_model, server_config, max_prompt_tokens=16384) as server:
        hog = await RawClient.connect(server.config.socket_path)
        other = await RawClient.connect(server.config.socket_path)
        await hog.send({"id": "huge", "messages": [{"role": "user"}] * 16385, "max_tokens": 1})
        with trio.fail_after(5):
            refused = await hog.next_event()
        assert refused is not None and refused["code"] == "E_LIMIT_001"
        assert "16385 messages" in refused["message"]

        # Under the limit (16,000 turns render in ~4 s here): in a worker thread, so the loop
        # goes on answering another client meanwhile.
        answered: list[float] = []

        async def ping() -> None:
            for n in range(10**6):
                await other.send({"type": "metrics", "id": f"p{n}"})
                event = await other.next_event()
                assert event is not None and event["event"] == "metrics"
                answered.append(trio.current_time())
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping)
            await trio.sleep(0.1)
            await hog.send({"id": "many", "messages": [{"role": "user"}] * 16000, "max_tokens": 1})
            with trio.fail_after(60):
                ended = await hog.next_event()
            answered.append(trio.current_time())  # the pings' last stretch: up to its end
            nursery.cancel_scope.cancel()
        assert ended is not None and ended["code"] == "E_LIMIT_001"  # by its tokens, once rendered
        longest = max(b - a for a, b in itertools.pairwise(answered))
        assert longest < 1.0, longest


async def test_a_cancel_is_not_held_behind_another_requests_admission(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """The reader admitted each request itself: behind a 4,090-rule grammar's compile (tens
    of seconds) the client's cancel of its running stream waited, and the stream ran on."""
    grammar = slow_grammar()
    async with running_server(llama_model, server_config) as server:
        client = await RawClient.connect(server.config.socket_path)
        story = [{"role": "user", "content": "Write a long story about a dragon."}]
        await client.send({"id": "s", "messages": story, "max_tokens": 400, "temperature": 0})
        with trio.fail_after(30):
            first = await client.next_event()
        assert first is not None and first["event"] == "token"
        await client.send({"id": "g", "prompt": "x", "max_tokens": 1, "grammar": grammar})
        await client.send({"type": "priority", "id": "g", "priority": "background"})  # applied once admitted
        await client.send({"type": "cancel", "id": "s"})
        asked = trio.current_time()
        with trio.fail_after(60):
            while (event := await client.next_event()) is not None and event["event"] != "eos":
                assert event["id"] == "s", event  # no error for the priority message
        assert event is not None and event["id"] == "s" and event["reason"] == "cancelled"
        assert trio.current_time() - asked < 2.0, trio.current_time() - asked
        await client.aclose()  # the grammar's compile is abandoned with its connection
