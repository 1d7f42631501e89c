"""A request's stream ends with a typed StreamEnd through its own channel (issue 18), and a
parked stream (a client that stopped reading) can still end: one slot is kept for it."""

from __future__ import annotations

import trio

from uma_trio.protocol.messages import EosEvent, GenerateRequest, TokenEvent
from uma_trio.runtime.session import StreamEnd

from .helpers import assert_nothing_held, sim_daemon


async def test_a_parked_stream_is_cancelled_and_its_reader_still_gets_the_end() -> None:
    async with sim_daemon(stream_buffer=3) as server:
        request = GenerateRequest(id="slow-reader", prompt="a b c", max_tokens=50, stream=True)
        session, receive = await server.open_request(request, trio.current_time(), connection=1)
        with trio.fail_after(30):
            while not session.parked:  # nobody reads: the buffer fills, the session sits out
                await trio.sleep(0.01)
            assert receive.statistics().current_buffer_used == 3 - 1  # one slot kept for the end
            server.loop.cancel(session, "client")
            items = [item async for item in receive]
        assert all(isinstance(item, TokenEvent) for item in items[:-1]) and len(items) == 3
        end = items[-1]
        assert isinstance(end, StreamEnd) and isinstance(end.final, EosEvent) and end.error is None
        assert end.final.reason == "cancelled" and end.final.cancel_reason == "client"
        await server.loop.wait_idle()
        assert_nothing_held(server)


async def test_a_finished_stream_ends_with_its_eos_after_every_token() -> None:
    async with sim_daemon() as server:
        request = GenerateRequest(id="reader", prompt="a b c", max_tokens=5, stream=True)
        session, receive = await server.open_request(request, trio.current_time(), connection=1)
        with trio.fail_after(30):
            items = [item async for item in receive]
        tokens = [i for i in items if isinstance(i, TokenEvent)]
        assert isinstance(items[-1], StreamEnd) and items[-1].final.reason == "length"
        assert len(tokens) == 5 and items[-1].final.usage.completion_tokens == 5
        assert session.finished
