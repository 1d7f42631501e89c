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
        stream = await server.open_request(request, trio.current_time(), connection=1)
        with trio.fail_after(30):
            while not server.loop.gauges()["sessions"]["parked"]:  # nobody reads: the buffer fills
                await trio.sleep(0.01)
            assert stream.receive.statistics().current_buffer_used == 3 - 1  # one slot kept for the end
            stream.cancel("client")
            items = [item async for item in stream.receive]
        assert all(isinstance(item, TokenEvent) for item in items[:-1]) and len(items) == 3
        end = items[-1]
        assert isinstance(end, StreamEnd) and isinstance(end.final, EosEvent) and end.error is None
        assert end.final.reason == "cancelled" and end.final.cancel_reason == "client"
        await server.loop.wait_idle()
        assert_nothing_held(server)


async def test_a_finished_stream_ends_with_its_eos_after_every_token() -> None:
    async with sim_daemon() as server:
        request = GenerateRequest(id="reader", prompt="a b c", max_tokens=5, stream=True)
        stream = await server.open_request(request, trio.current_time(), connection=1)
        with trio.fail_after(30):
            items = [item async for item in stream.receive]
        tokens = [i for i in items if isinstance(i, TokenEvent)]
        end = items[-1]
        assert isinstance(end, StreamEnd) and end.final.reason == "length"
        assert len(tokens) == 5 and end.final.usage.completion_tokens == 5
        assert end.generated == 5 and end.admitted is not None and len(end.generated_at.gaps) == 4
        assert server.loop.gauges()["sessions"]["active"] == 0


async def test_a_reader_that_drains_a_parked_stream_wakes_the_loop_and_gets_every_token() -> None:
    """The front end sees parking only through its channel: taking the token that makes room
    wakes the loop (RequestStream.took_one), or a stream whose buffer filled would sit out
    until something else woke the loop."""
    async with sim_daemon(stream_buffer=3) as server:
        request = GenerateRequest(id="slow", prompt="a b c", max_tokens=12, stream=True)
        stream = await server.open_request(request, trio.current_time(), connection=1)
        items = []
        with trio.fail_after(30):
            while not server.loop.gauges()["sessions"]["parked"]:
                await trio.sleep(0.01)
            async for item in stream.receive:
                if isinstance(item, TokenEvent):
                    stream.took_one()
                items.append(item)
        assert isinstance(items[-1], StreamEnd) and items[-1].final.reason == "length"
        assert sum(isinstance(i, TokenEvent) for i in items) == 12
