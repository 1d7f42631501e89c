"""The anyio client (uma_trio/client.py): what it sends for a request whose stream ends early."""

from __future__ import annotations

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import SOCKET_ENV, client_socket_path, default_socket_path
from uma_trio.protocol.messages import EosEvent, ErrorEvent, TokenEvent

from .helpers import sim_daemon


async def test_a_request_id_the_daemon_refuses_is_refused_before_it_is_sent(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The daemon refused "job 1" with an error that has no id; every stream of the
    connection took it for its own end."""
    async with sim_daemon() as server, UmaClient.connect(server.config.socket_path) as client:
        for bad in ("job 1", "", "café", "x" * 129):
            with pytest.raises(ValueError, match="request id"):
                await client.complete(id=bad, prompt="hello", max_tokens=2)
            with pytest.raises(ValueError, match="request id"):
                await client.cancel(bad)
        done = await client.complete(id="job-1", prompt="hello", max_tokens=2)
        assert done.eos.reason == "length"


async def test_a_stream_ended_by_a_connection_error_cancels_its_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An error without an id ends every stream of the connection; a stream left that way
    sends its cancel, so the daemon does not go on generating tokens nobody reads."""
    async with sim_daemon() as server, UmaClient.connect(server.config.socket_path) as client:
        async with client.stream(id="long", prompt="hello hello", max_tokens=2000) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    client._deliver(ErrorEvent(id=None, code="E_PROTO_002", message="someone else's"))
                elif isinstance(event, ErrorEvent):
                    assert event.id is None
        await trio.sleep(0.5)
        assert [row["id"] for row in (await client.metrics())["in_flight"]] == []


async def test_an_id_already_in_flight_is_refused_and_the_first_stream_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two streams with one id: the second took over the first's route, and its end removed
    it, so the first never saw its tokens or its end (it waited for good)."""
    async with sim_daemon() as server, UmaClient.connect(server.config.socket_path) as client:
        async with client.stream(id="job-1", prompt="hello", max_tokens=20) as events:
            with pytest.raises(ValueError, match="already in flight"):
                await client.complete(id="job-1", prompt="hello", max_tokens=2)
            with trio.fail_after(30):
                seen = [event async for event in events]
        assert isinstance(seen[-1], EosEvent) and sum(isinstance(e, TokenEvent) for e in seen) == 20


async def test_connect_with_no_path_reaches_the_socket_the_commands_would(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's sample took ``default_socket_path()``, which no variable moves: with
    ``UMA_SOCKET`` set, ``uma-trio generate`` reached the daemon and the sample did not."""
    async with sim_daemon() as server:
        for name in SOCKET_ENV:
            monkeypatch.delenv(name, raising=False)
        assert client_socket_path() == default_socket_path()
        monkeypatch.setenv("UMA_SOCK", str(server.config.socket_path))
        async with UmaClient.connect() as client:  # the seeds' name, as the commands read it
            assert (await client.complete(prompt="hello", max_tokens=2)).eos.reason == "length"
        monkeypatch.setenv("UMA_SOCK", "/nonexistent/uma.sock")
        monkeypatch.setenv("UMA_SOCKET", str(server.config.socket_path))  # read first
        async with UmaClient.connect() as client:
            assert (await client.complete(prompt="hello", max_tokens=2)).eos.reason == "length"
        monkeypatch.setenv("UMA_SOCKET", "")
        with pytest.raises(ValueError, match="UMA_SOCKET is set but empty"):
            async with UmaClient.connect():
                pass
