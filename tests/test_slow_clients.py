"""Slow and stuck clients: a reader that stops is parked, then cut off with a reason; a
sender that stops half-way through a frame is timed out; nobody else notices.

Simulated engine on virtual time (MockClock): the daemon's timers of tens of seconds
pass in milliseconds, while the sockets, connections and decode loop are the real ones.
"""

from __future__ import annotations

import json
import socket
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from uma_trio.daemon import http_gateway
from uma_trio.runtime.server import Server
from uma_trio.sched.cost import CostCoefficients

from .helpers import RawClient, frame, sim_daemon, stream_one, text_of

STALL_S = 20.0
FRAME_S = 10.0


def slow_daemon(**overrides: Any) -> AbstractAsyncContextManager[Server]:
    return sim_daemon(stall_timeout_s=STALL_S, frame_timeout_s=FRAME_S, **overrides)


async def test_a_stuck_reader_is_parked_then_cancelled_with_a_reason(autojump_clock: trio.abc.Clock) -> None:
    async with slow_daemon() as server:
        stuck = await RawClient.connect(server.config.socket_path)
        for i in range(4):  # far more than the socket buffers hold
            await stuck.send({"id": f"s{i}", "prompt": "tell me everything", "max_tokens": 4000})
        started = trio.current_time()
        bystander = await stream_one(server, "b", 500)  # runs its course meanwhile
        assert bystander[-1]["event"] == "eos" and len(text_of(bystander).split()) == 500

        # Before the timeout: the stuck requests sit out of the batch with bounded buffers.
        gauges = server.loop.gauges()
        assert trio.current_time() - started < STALL_S
        assert gauges["sessions"]["active"] == gauges["sessions"]["parked"] == 4
        assert all(row["generated"] < 4000 for row in gauges["in_flight"])
        with trio.fail_after(STALL_S + 5):
            while server.metrics.cancels["stalled"] < 4:
                await trio.sleep(0.5)
        assert trio.current_time() - started >= STALL_S

        # The stuck client finds what fitted in the socket, then the end of the connection.
        received: list[dict[str, Any]] = []
        while (event := await stuck.next_event()) is not None:
            received.append(event)
        assert 0 < len(received) < 4 * 4000
        assert {e["event"] for e in received} <= {"token"}
        await stuck.aclose()
    gauges = server.loop.gauges()
    assert gauges["sessions"]["active"] == gauges["kv"]["cells_reserved"] == 0
    assert server.metrics.connections_open == 0


async def test_a_slow_reader_loses_nothing(autojump_clock: trio.abc.Clock) -> None:
    """Reading a little every few seconds is slow, not stuck: every token arrives."""
    async with slow_daemon() as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "slow", "prompt": "tell me everything", "max_tokens": 3000})
        await trio.sleep(STALL_S / 2)  # the socket fills and the session parks
        events: list[dict[str, Any]] = []
        while not events or events[-1]["event"] != "eos":
            event = await client.next_event()
            assert event is not None
            events.append(event)
            if len(events) % 500 == 0:
                await trio.sleep(STALL_S / 4)
        await client.aclose()
    assert len(text_of(events).split()) == 3000 and events[-1]["reason"] == "length"
    assert server.metrics.cancels["stalled"] == 0


async def test_half_a_frame_is_timed_out_even_with_a_request_in_flight(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with slow_daemon() as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "long", "prompt": "tell me everything", "max_tokens": 4000})
        half = frame({"id": "next", "prompt": "and then"})
        sent_at = trio.current_time()
        await client.send_bytes(half[:12])
        events: list[dict[str, Any]] = []
        while (event := await client.next_event()) is not None:
            events.append(event)
        await client.aclose()
        gone_at = trio.current_time()
    errors = [e for e in events if e["event"] == "error"]
    assert [e["code"] for e in errors] == ["E_PROTO_008"] and "12 bytes" in errors[0]["message"]
    assert FRAME_S <= gone_at - sent_at < FRAME_S + 1
    assert server.metrics.cancels["disconnect"] == 1  # the request in flight went with the connection


async def test_a_frame_trickling_in_within_the_timeout_is_served(autojump_clock: trio.abc.Clock) -> None:
    async with slow_daemon() as server:
        client = await RawClient.connect(server.config.socket_path)
        data = frame({"id": "t", "prompt": "slowly typed", "max_tokens": 3})
        for i in range(0, len(data), 8):  # the whole frame over about 0.8 of the timeout
            await client.send_bytes(data[i : i + 8])
            await trio.sleep(FRAME_S * 0.8 / (len(data) / 8))
        events = await client.until_end("t")
        # A second frame gets a fresh allowance: half of one, then the rest after 0.6 of it.
        second = frame({"id": "u", "prompt": "again", "max_tokens": 3})
        await client.send_bytes(second[:10])
        await trio.sleep(FRAME_S * 0.6)
        await client.send_bytes(second[10:])
        more = await client.until_end("u")
        await client.aclose()
    assert events[-1]["event"] == "eos" and more[-1]["event"] == "eos"
    assert not server.metrics.errors


async def test_a_frame_trickling_in_too_slowly_is_timed_out(autojump_clock: trio.abc.Clock) -> None:
    """Each byte resets nothing: the whole frame must be in within the timeout."""
    async with slow_daemon() as server:
        client = await RawClient.connect(server.config.socket_path)
        data = frame({"id": "t", "prompt": "slowly typed", "max_tokens": 3})
        started = trio.current_time()
        with trio.move_on_after(FRAME_S * 2):
            for byte in data:  # one byte every quarter of the timeout, until the daemon hangs up
                try:
                    await client.send_bytes(bytes([byte]))
                except trio.BrokenResourceError:
                    break
                await trio.sleep(FRAME_S / 4)
        event = await client.next_event()
        assert event is not None and event["code"] == "E_PROTO_008"
        assert FRAME_S <= trio.current_time() - started < FRAME_S * 1.3
        await client.aclose()


async def test_a_client_that_only_polls_metrics_is_not_idle(autojump_clock: trio.abc.Clock) -> None:
    """Found by the soak: a connection with no request in flight that sends other messages
    (metrics every few seconds, as `uma-trio top` does) was cut off as idle."""
    idle = 30.0
    async with slow_daemon(idle_timeout_s=idle) as server:
        client = await RawClient.connect(server.config.socket_path)
        for n in range(8):  # 3 idle timeouts' worth
            await client.send({"type": "metrics", "id": f"m{n}"})
            event = await client.next_event()
            assert event is not None and event["event"] == "metrics", event
            await trio.sleep(idle / 2.5)
        await trio.sleep(idle)  # and silence is still idleness
        event = await client.next_event()
        assert event is not None and event["code"] == "E_LIMIT_007"
        await client.aclose()


async def test_a_stuck_http_stream_is_cancelled_with_a_reason() -> None:
    """Real time (hypercorn's own timers): an SSE client that reads nothing has its request
    cancelled as stalled, even though hypercorn's socket write cannot be interrupted."""
    fast = CostCoefficients(fixed_s=0.0001, decode_s=0.00001, prefill_s=0.00001, ctx_s_per_kcell=0.0)
    async with (
        sim_daemon(cost=fast, stall_timeout_s=1.0, http="127.0.0.1:0") as server,
        http_gateway(server.config, "sim.gguf") as gateway,
    ):
        assert gateway is not None and gateway.url is not None
        gateway.attach(server)
        host, port = gateway.url.removeprefix("http://").split(":")
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
        await sock.connect((host, int(port)))
        body = json.dumps({"prompt": "tell me everything", "max_tokens": 4000}).encode()
        head = "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        await sock.send(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        with trio.fail_after(20):
            while server.metrics.cancels["stalled"] < 1:
                await trio.sleep(0.1)
        gauges = server.loop.gauges()
        assert gauges["sessions"]["active"] == gauges["kv"]["cells_reserved"] == 0
        sock.close()


async def test_a_client_pipelining_many_frames_lets_the_others_in_between() -> None:
    """Every frame of one read was dispatched without a checkpoint, and an answer the socket
    takes at once never waits: 64 KiB of small frames held the event loop (another client's
    ping: 0.1 ms, then 5.7 s; a streaming client's gap 45 s)."""
    many = 1000
    async with sim_daemon() as server:
        hog = await RawClient.connect(server.config.socket_path)
        other = await RawClient.connect(server.config.socket_path)
        order: list[str] = []
        answered = trio.Event()

        async def answers(client: RawClient, name: str, count: int) -> None:
            for _ in range(count):
                event = await client.next_event()
                assert event is not None and event["code"] == "E_PROTO_007"
                order.append(name)
                answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answers, hog, "hog", many)
            await hog.send_bytes(b"".join(frame({"type": "cancel", "id": f"n{i}"}) for i in range(many)))
            await answered.wait()  # the hog's frames are being answered: now another client asks
            nursery.start_soon(answers, other, "other", 1)
            await other.send({"type": "cancel", "id": "mine"})
        assert order.index("other") < 50, order.index("other")
