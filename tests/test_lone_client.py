"""A client sending one request after another on the only connection open pays no burst
wait (runtime/clients.py, DecodeLoop._gather_burst); a first request, or one with another
connection open, still does.  The whole daemon (socket, HTTP gateway, decode loop) on the
simulated engine, with a burst wait long enough (0.4 s) to tell apart on any machine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from uma_trio.client import UmaClient
from uma_trio.protocol.messages import TokenEvent
from uma_trio.runtime.clients import Clients

from .test_http_hardening import gateway_on_sim

WAIT_S = 0.4
BURST = {"burst_quiet_ms": WAIT_S * 1000, "burst_max_ms": 4 * WAIT_S * 1000}


async def socket_ttft(client: UmaClient) -> float:
    started = time.perf_counter()
    first = None
    async with client.stream(prompt="a b c", max_tokens=2, temperature=0.0) as events:
        async for event in events:
            if isinstance(event, TokenEvent) and first is None:
                first = time.perf_counter() - started
    assert first is not None
    return first


async def http_ttft(http: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    reply = await http.post("/v1/completions", json={"model": "sim", "prompt": "a b c", "max_tokens": 2})
    assert reply.status_code == 200
    return time.perf_counter() - started


@asynccontextmanager
async def daemon() -> AsyncIterator[tuple[str, str]]:
    async with gateway_on_sim(**BURST) as (server, _, url):
        yield str(server.config.socket_path), url


async def test_a_lone_socket_client_waits_for_a_burst_only_on_its_first_request() -> None:
    async with daemon() as (sock, _), UmaClient.connect(sock) as client:
        assert await socket_ttft(client) >= WAIT_S  # its first: a burst may be forming
        assert await socket_ttft(client) < WAIT_S / 2
        assert await socket_ttft(client) < WAIT_S / 2
        async with UmaClient.connect(sock):  # another client is connected: it may send too
            await trio.sleep(0.05)
            assert await socket_ttft(client) >= WAIT_S
        await trio.sleep(0.05)  # ... and gone again
        assert await socket_ttft(client) < WAIT_S / 2


async def test_a_lone_http_client_on_a_kept_alive_connection_waits_only_once() -> None:
    limits = httpx.Limits(max_connections=1)
    async with daemon() as (sock, url), httpx.AsyncClient(base_url=url, limits=limits) as http:
        assert await http_ttft(http) >= WAIT_S
        assert await http_ttft(http) < WAIT_S / 2
        async with UmaClient.connect(sock):  # a socket client counts as well
            await trio.sleep(0.05)
            assert await http_ttft(http) >= WAIT_S


async def test_requests_written_together_on_the_lone_connection_still_share_their_first_tick() -> None:
    """After a first request, the same client writes three at once on its one connection:
    the short wait lets the connection's task read them all, and the burst gets the whole
    wait, so their prompts prefill in one step."""
    async with (
        gateway_on_sim(**BURST) as (server, _, _),
        UmaClient.connect(server.config.socket_path) as client,
    ):
        await socket_ttft(client)
        steps = server.engine.steps  # type: ignore[attr-defined]
        before = len(steps)
        prompts = ["d e f g", "h i j k", "l m n o"]

        async def one(prompt: str) -> None:
            async with client.stream(prompt=prompt, max_tokens=2, temperature=0.0) as events:
                async for _ in events:
                    pass

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        first_tick = steps[before]
        assert first_tick[1] == sum(len(server.engine.tokenize(p)) for p in prompts)


def test_the_registry_counts_open_connections_and_their_requests() -> None:
    clients = Clients()
    assert not clients.lone_follow_up()
    with clients.connected("a"):
        clients.sent("a")
        assert clients.open == 1 and not clients.lone_follow_up()  # its first request
        clients.sent("a")
        assert clients.lone_follow_up()
        with clients.connected("b"):
            assert clients.open == 2 and not clients.lone_follow_up()
        clients.sent("gone")  # not counted: not open
        assert clients.lone_follow_up()
    assert clients.open == 0 and not clients.lone_follow_up()


def test_a_connection_closing_late_does_not_remove_a_newer_one_under_its_key() -> None:
    clients = Clients()
    old, new = clients.connected(("127.0.0.1", 5000)), clients.connected(("127.0.0.1", 5000))
    old.__enter__()
    new.__enter__()  # the port is reused before the old connection's watcher has ended
    old.__exit__(None, None, None)
    assert clients.open == 1
    new.__exit__(None, None, None)
    assert clients.open == 0
