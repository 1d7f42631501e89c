"""End to end: real daemon, real model, real Unix socket."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest
import trio
import trio.testing

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import EosEvent, TokenEvent
from uma_trio.runtime.server import Server
from uma_trio.runtime.unix_socket import SocketInUseError, bind_unix_listener

from .conftest import running_server
from .helpers import RawClient, frame

pytestmark = pytest.mark.model

# With a system turn of its own: under the template's default one ("You are a helpful AI
# assistant named SmolLM...") this 135M model answers this question in French drivel.
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


async def test_seeds_request_streams_tokens_then_eos(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    # The seeds' request, exactly as written there.
    await client.send(
        {"id": "quickstart-1", "prompt": "Hello, UMA Serve!", "max_tokens": 20, "stream": True,
         "temperature": 0.0, "top_p": 1.0}
    )  # fmt: skip
    events = await client.until_end("quickstart-1")
    assert [e["event"] for e in events[:-1]] == ["token"] * (len(events) - 1)
    eos = events[-1]
    assert eos["event"] == "eos" and eos["reason"] in ("stop", "length")
    assert eos["usage"]["completion_tokens"] >= len(events) - 1 > 0
    assert eos["timings"]["ttft_ms"] > 0
    assert all(isinstance(e["token_id"], int) for e in events[:-1])


async def test_chat_answer_is_coherent(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        done = await client.complete(messages=QUESTION, max_tokens=24, temperature=0.0)
    assert "Paris" in done.text
    assert done.eos.reason == "stop"


async def test_four_concurrent_clients_complete(server: Server) -> None:
    prompts = ["Name a color.", "Count to five.", "Say hello.", "Name a fruit."]
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        async with UmaClient.connect(server.config.socket_path) as client:
            results[i] = await client.complete(messages=chat(prompts[i]), max_tokens=24, temperature=0.0)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
    assert sorted(results) == [0, 1, 2, 3]
    for done in results.values():
        assert done.eos.reason in ("stop", "length") and done.text.strip()
    assert sum(server.metrics.requests["interactive"][r] for r in ("stop", "length")) == 4


async def test_short_request_gets_first_token_before_long_one_finishes(server: Server) -> None:
    long_prompt = "Summarize this text. " + "The quick brown fox jumps over the lazy dog. " * 120
    order: list[str] = []

    async def run(rid: str, request: dict[str, Any]) -> None:
        async with UmaClient.connect(server.config.socket_path) as client:
            async with client.stream(id=rid, **request) as events:
                async for event in events:
                    if isinstance(event, TokenEvent) and f"{rid}:first" not in order:
                        order.append(f"{rid}:first")
                    if isinstance(event, EosEvent):
                        order.append(f"{rid}:eos")

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", {"prompt": long_prompt, "max_tokens": 16, "temperature": 0.0})
            await trio.sleep(0.3)  # the long prompt is being prefilled by now
            nursery.start_soon(run, "short", {"messages": chat("Hi!"), "max_tokens": 4, "temperature": 0.0})
    assert order.index("short:first") < order.index("long:eos"), order
    assert order.index("short:first") < order.index("long:first"), order


async def test_disconnect_mid_stream_frees_kv_and_spares_others(server: Server) -> None:
    loop = server.loop
    engine = server.engine
    survivor_result: list[Any] = []

    async def survivor() -> None:
        async with UmaClient.connect(server.config.socket_path) as client:
            survivor_result.append(
                await client.complete(messages=chat("Tell me a story."), max_tokens=40, temperature=0.0)
            )

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor)
            quitter = await RawClient.connect(server.config.socket_path)
            await quitter.send(
                {"id": "q", "messages": chat("Write a long essay."), "max_tokens": 500, "temperature": 0}
            )
            first = await quitter.next_event()
            assert first is not None and first["event"] == "token"
            session = next(s for s in loop._active.values() if s.id == "q")
            seq_id = session.seq_id
            assert seq_id is not None and engine.seq_cells(seq_id) > 0
            await quitter.aclose()  # hang up mid-stream
            while not session.finished:
                await trio.sleep(0.01)
    assert session.final is not None and session.final.reason == "cancelled"
    assert session.final.cancel_reason == "disconnect"
    assert survivor_result[0].eos.reason in ("stop", "length")
    await loop.wait_idle()
    # No request holds cells any more; what the quitter computed stays in the prefix cache, and
    # the engine holds exactly that (checked through the engine, not by timing).
    cached = loop.kv.cached()
    assert seq_id in cached and engine.seq_cells(seq_id) == len(cached[seq_id]) > 0
    assert server.metrics.cancels["disconnect"] == 1
    gauges = loop.gauges()
    assert gauges["kv"]["seqs_free"] + gauges["prefix_cache"]["sequences"] == gauges["kv"]["seqs_total"]
    assert gauges["kv"]["cells_used"] == 0


async def test_two_requests_multiplexed_on_one_connection(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    await client.send({"id": "a", "messages": chat("Name a color."), "max_tokens": 12, "temperature": 0})
    await client.send({"id": "b", "messages": chat("Name an animal."), "max_tokens": 12, "temperature": 0})
    ended: dict[str, dict[str, Any]] = {}
    tokens: dict[str, int] = {"a": 0, "b": 0}
    with trio.fail_after(60):
        while len(ended) < 2:
            event = await client.next_event()
            assert event is not None
            if event["event"] == "token":
                tokens[event["id"]] += 1
            elif event["event"] == "eos":
                ended[event["id"]] = event
    assert set(ended) == {"a", "b"}
    assert tokens["a"] > 0 and tokens["b"] > 0


async def test_explicit_cancel_ends_with_cancelled_eos(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    await client.send(
        {"id": "c", "messages": chat("Write a long essay about rivers."), "max_tokens": 400, "temperature": 0}
    )
    first = await client.next_event()
    assert first is not None and first["event"] == "token"
    await client.send({"type": "cancel", "id": "c"})
    with trio.fail_after(30):
        events = await client.until_end("c")
    eos = events[-1]
    assert eos["event"] == "eos" and eos["reason"] == "cancelled" and eos["cancel_reason"] == "client"
    assert eos["usage"]["completion_tokens"] < 400
    await server.loop.wait_idle()
    assert server.loop.gauges()["kv"]["cells_used"] == 0


async def test_non_stream_request_gets_one_final_event(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    await client.send({"id": "n", "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": False})
    events = await client.until_end("n")
    assert len(events) == 1 and events[0]["event"] == "eos"
    assert "Paris" in events[0]["text"]


async def test_stop_string_ends_generation_and_is_never_sent(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        plain = await client.complete(messages=QUESTION, max_tokens=24, temperature=0.0)
        assert "Paris" in plain.text
        stopped = await client.complete(messages=QUESTION, max_tokens=24, temperature=0.0, stop=["aris"])
    assert stopped.eos.reason == "stop"
    assert stopped.text == plain.text[: plain.text.index("aris")]


async def test_greedy_tokens_same_alone_and_beside_three_others(server: Server) -> None:
    prompts = [
        "Explain what a CPU does.",
        "Write a poem about the sea.",
        "List three fruits.",
        "Describe a cat.",
    ]

    def request(i: int) -> dict[str, Any]:
        return {"id": f"r{i}", "messages": chat(prompts[i]), "max_tokens": 40, "temperature": 0.0}

    client = await RawClient.connect(server.config.socket_path)
    with trio.fail_after(120):
        alone = {}
        for i in range(4):
            await client.send(request(i))
            alone[i] = [e["token_id"] for e in await client.until_end(f"r{i}") if e["event"] == "token"]
        # All four in one write: they are admitted together and share every tick.
        await client.send_bytes(b"".join(frame(request(i)) for i in range(4)))
        together: dict[int, list[int]] = {i: [] for i in range(4)}
        ended = 0
        while ended < 4:
            event = await client.next_event()
            assert event is not None
            if event["event"] == "token":
                together[int(event["id"][1:])].append(event["token_id"])
            elif event["event"] == "eos":
                ended += 1
            else:
                raise AssertionError(f"unexpected event {event}")
    assert all(len(ids) > 10 for ids in alone.values())
    assert together == alone


async def test_slow_reader_is_parked_not_dropped(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, stream_buffer=4) as server:
        # A lockstep stream: the daemon's writes block until this client reads,
        # like a socket whose buffers are full.
        client_end, daemon_end = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._handle, daemon_end)
            slow = RawClient(client_end)  # type: ignore[arg-type]
            await slow.send({"id": "slow", "messages": chat("Write a long story."), "max_tokens": 120,
                             "temperature": 0})  # fmt: skip
            with trio.fail_after(60):
                while True:  # the daemon parks it once its channel is full
                    session = next((s for s in server.loop._active.values() if s.id == "slow"), None)
                    if session is not None and session.parked:
                        break
                    await trio.sleep(0.02)
                async with UmaClient.connect(server.config.socket_path) as fast:
                    other = await fast.complete(messages=QUESTION, max_tokens=24, temperature=0.0)
            assert "Paris" in other.text  # the batch did not wait for the slow reader
            assert session.parked and not session.finished
            assert session.generated < 120
            # Now read everything: nothing was lost.
            with trio.fail_after(120):
                events = await slow.until_end("slow")
            eos = events[-1]
            assert eos["event"] == "eos" and eos["reason"] in ("stop", "length")
            streamed = "".join(e["text"] for e in events if e["event"] == "token")
            assert len(streamed) > 0 and eos["usage"]["completion_tokens"] > 20
            await slow.aclose()


async def test_idle_connection_is_closed_with_an_error(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, idle_timeout_s=0.3) as server:
        client = await RawClient.connect(server.config.socket_path)
        with trio.fail_after(10):
            event = await client.next_event()
            assert event is not None and event["code"] == "E_LIMIT_007"
            assert await client.next_event() is None


async def test_connections_beyond_the_limit_are_refused(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, max_connections=1) as server:
        first = await RawClient.connect(server.config.socket_path)
        await first.send({"type": "metrics", "id": "m"})
        assert (await first.next_event() or {}).get("event") == "metrics"
        second = await RawClient.connect(server.config.socket_path)
        event = await second.next_event()
        assert event is not None and event["code"] == "E_LIMIT_006"
        assert await second.next_event() is None


async def test_socket_is_private_and_a_second_daemon_refuses(server: Server) -> None:
    mode = os.stat(server.config.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    with pytest.raises(SocketInUseError, match="already listening"):
        await bind_unix_listener(server.config.socket_path)
    # The live daemon was not disturbed.
    async with UmaClient.connect(server.config.socket_path) as client:
        assert (await client.metrics())["sessions"]["active"] == 0


async def test_stale_socket_file_is_replaced(llama_model: LlamaModel, server_config: ServerConfig) -> None:
    import socket as pysocket

    stale = pysocket.socket(pysocket.AF_UNIX)
    stale.bind(str(server_config.socket_path))
    stale.close()  # the file stays, nobody listens
    async with running_server(llama_model, server_config) as server:
        async with UmaClient.connect(server.config.socket_path) as client:
            assert (await client.metrics())["sessions"]["active"] == 0
    assert not server_config.socket_path.exists()


async def test_metrics_request_answers_while_decoding(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    await client.send(
        {"id": "busy", "messages": chat("Write a long essay."), "max_tokens": 100, "temperature": 0}
    )
    first = await client.next_event()
    assert first is not None and first["event"] == "token"
    async with UmaClient.connect(server.config.socket_path) as other:
        snapshot = await other.metrics()
    assert snapshot["sessions"]["active"] == 1
    assert snapshot["kv"]["cells_used"] > 0
    assert snapshot["model"].endswith(".gguf")


async def test_priority_message_moves_a_running_request_to_another_lane(server: Server) -> None:
    client = await RawClient.connect(server.config.socket_path)
    request = {
        "id": "job",
        "messages": chat("Write a long story."),
        "max_tokens": 60,
        "temperature": 0,
        "priority": "background",
    }
    await client.send(request)
    with trio.fail_after(60):
        first = await client.next_event()
        assert first is not None and first["event"] == "token"
        session = next(s for s in server.loop._active.values() if s.id == "job")
        assert session.lane == "background"
        await client.send({"type": "priority", "id": "job", "priority": "interactive"})
        events = await client.until_end("job")
    assert events[-1]["event"] == "eos" and session.lane == "interactive"
    snapshot = server.metrics_snapshot()
    assert snapshot["lane_changes"] == 1
    # An unknown id is an error with a code, and the connection keeps working.
    await client.send({"type": "priority", "id": "nobody", "priority": "background"})
    with trio.fail_after(10):
        error = await client.next_event()
    assert error is not None and error["code"] == "E_PROTO_007"
    await client.aclose()


async def test_metrics_snapshot_reports_the_policy(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        await client.complete(messages=QUESTION, max_tokens=8, temperature=0.0)
        snapshot = await client.metrics()
    scheduler = snapshot["scheduler"]
    for key in ("decode_ms_last", "decode_ms_ewma", "tokens_per_tick", "served_decoders", "parked_sessions",
                "prefill_guard_active", "ticks_over_budget", "bmt_estimate_last", "bmt_budget"):  # fmt: skip
        assert key in scheduler, key
    assert scheduler["decode_ms_ewma"] > 0 and scheduler["bmt_budget"] > 0
