"""A burst over HTTP shares its first tick, even where a client opens a connection per
request (http/fresh.py, DecodeLoop._gather_burst): the real gateway on the simulated engine."""

from __future__ import annotations

import json

import pytest
import trio

from uma_trio.http.fresh import FreshConnections

from .test_http_hardening import gateway_on_sim


def raw_request(prompt: str) -> bytes:
    body = json.dumps(
        {"id": prompt.replace(" ", "-"), "prompt": prompt, "max_tokens": 2, "stream": False}
    ).encode()
    head = "POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return head.encode() + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


async def send_and_read(stream: trio.SocketStream, prompt: str) -> bytes:
    await stream.send_all(raw_request(prompt))
    reply = b""
    while chunk := await stream.receive_some(1 << 16):
        reply += chunk
    return reply


@pytest.mark.parametrize("watch", [True, False])
async def test_a_connection_still_to_send_its_request_joins_the_first_tick(watch: bool) -> None:
    """Connection B is open but sends its request only 0.1 s after A's (as a client still
    connecting its pool would, a few ms later): A's request waits for it, and both prompts
    prefill in the first step.  Without the connection counted as arriving, A starts alone."""
    # Wide margins (window, wait, delay) so a slow test machine cannot change the outcome.
    async with gateway_on_sim(burst_max_ms=2000.0) as (server, gateway, url):
        gateway.fresh = FreshConnections(window_s=1.0 if watch else 0.0)
        port = int(url.rsplit(":", 1)[1])
        late = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.sleep(0.05)  # accepted: its watch has begun
        assert gateway.fresh.pending == (1 if watch else 0)
        first = await trio.open_tcp_stream("127.0.0.1", port)
        replies: list[bytes] = []

        async def run(stream: trio.SocketStream, prompt: str, delay: float) -> None:
            await trio.sleep(delay)
            replies.append(await send_and_read(stream, prompt))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, first, "a b c d", 0.0)
            nursery.start_soon(run, late, "e f g h", 0.1)
        assert all(r.startswith(b"HTTP/1.1 200") for r in replies), replies
        steps = server.engine.steps  # type: ignore[attr-defined]
        prompt_tokens = len(server.engine.tokenize("a b c d"))
        assert steps[0][1] == (2 * prompt_tokens if watch else prompt_tokens)
        assert gateway.fresh.pending == 0


async def test_a_connection_that_never_sends_holds_nothing_past_its_window() -> None:
    async with gateway_on_sim() as (server, gateway, url):
        port = int(url.rsplit(":", 1)[1])
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.sleep(0.01)
        assert server.loop.arrivals.count == 1
        await trio.sleep(gateway.fresh.window_s + 0.1)
        assert server.loop.arrivals.count == 0 and gateway.fresh.pending == 0
        await idle.aclose()
