"""How a connection writes its events: a frame the socket can take goes out at once, without
a pass through trio's scheduler; one it cannot take waits for the reader, behind the same
lock, so frames never interleave and nothing is lost or reordered.

Simulated engine on virtual time; the sockets and connections are the real ones.
"""

from __future__ import annotations

import pytest
import trio

from .helpers import RawClient, sim_daemon, stream_one, text_of


async def test_a_reader_that_keeps_up_gets_every_frame_written_at_once(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited: list[int] = []
    send_all = trio.SocketStream.send_all

    async def counting_send_all(self: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
        waited.append(len(data))
        await send_all(self, data)

    async with sim_daemon() as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "r", "prompt": "tell me everything", "max_tokens": 200})
        monkeypatch.setattr(trio.SocketStream, "send_all", counting_send_all)  # the daemon's writes
        events = await client.until_end("r")
        await client.aclose()
    assert events[-1]["event"] == "eos" and len(text_of(events).split()) == 200
    assert waited == []  # no frame needed the waiting path


async def test_frames_that_wait_for_a_paused_reader_arrive_whole_and_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with sim_daemon() as server:
        # What each request streams to a reader that keeps up (the simulated engine's text
        # depends on the request alone).
        expected = {rid: text_of(await stream_one(server, rid, 3000)) for rid in ("a", "b", "c")}

        paused = await RawClient.connect(server.config.socket_path)
        for rid in expected:  # far more than the socket buffers hold, on one connection
            await paused.send({"id": rid, "prompt": "tell me everything", "max_tokens": 3000})
        await trio.sleep(5.0)  # reads nothing meanwhile: writes fill the socket and wait
        got = await paused.until_all_end(list(expected))
        await paused.aclose()
    for rid, text in expected.items():
        assert got[rid][-1]["event"] == "eos", got[rid][-1]
        assert text_of(got[rid]) == text
