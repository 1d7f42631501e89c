"""The load generator's OpenAI target against servers that close kept-alive connections.

llama-server's HTTP library closes an idle kept-alive connection on its own; the next request
sent on it fails before any answer.  compare.py's `ipc` scenario (20 requests in a row on
one connection) lost llama-server after 2-6 requests that way, and its figures came from
those few.  These tests serve real HTTP/1.1 over TCP from a minimal server that does the
same, so the client's retry is exercised end to end.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio

from uma_trio.loadgen import CONNECTION_LOST, TIMEOUT, Scenario, run_scenario, scenario_from_dict
from uma_trio.loadgen.targets import STALE_CONNECTION_RETRIES, OpenAITarget

TOKENS = 3


def sse_body() -> bytes:
    chunks = [{"choices": [{"text": "hello", "finish_reason": None}]} for _ in range(TOKENS)]
    chunks.append({"choices": [{"text": "", "finish_reason": "length"}]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def read_request(stream: trio.SocketStream, buffer: bytearray) -> bool:
    """Read one request (headers and a Content-Length body) from ``stream``; False at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return False
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return False
        rest += data
    buffer[:] = rest[length:]
    return True


class ForgetfulServer:
    """Answers ``per_connection`` requests on a connection, then closes it without saying so
    (no ``Connection: close``) as the next request comes in, unanswered: a server whose
    keep-alive ran out while the client was already sending.  (Closed while idle, the
    connection would be dropped by the client's pool before use.)  With ``cut_mid_answer``
    it instead closes every connection halfway through its first answer."""

    def __init__(self, per_connection: int, *, cut_mid_answer: bool = False) -> None:
        self.per_connection, self.cut_mid_answer = per_connection, cut_mid_answer
        self.connections = 0
        self.requests = 0  # answered (or begun, with cut_mid_answer)
        self.dropped = 0  # connections closed on a request that came in

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        body = sse_body()
        async with stream:
            for _ in range(self.per_connection):
                if not await read_request(stream, buffer):
                    return
                self.requests += 1
                head = (
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
                )
                if self.cut_mid_answer:
                    await stream.send_all(head + body[: len(body) // 2])
                    return
                await stream.send_all(head + body)
            await stream.receive_some(65536)  # the next request arrives; closed unanswered
            self.dropped += 1


def chain(requests: int) -> Scenario:
    return scenario_from_dict(
        {
            "name": "chain",
            "clients": [{"name": "one", "prompt_tokens": 4, "max_tokens": TOKENS, "requests": requests}],
        }
    )


async def serve(server: ForgetfulServer, nursery: trio.Nursery) -> OpenAITarget:
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return OpenAITarget(f"http://127.0.0.1:{port}", "forgetful", model="m")


async def test_a_request_on_a_connection_the_server_closed_is_sent_again_on_a_new_one() -> None:
    server = ForgetfulServer(per_connection=2)
    async with trio.open_nursery() as nursery:
        target = await serve(server, nursery)
        result = await run_scenario(target, chain(7))
        nursery.cancel_scope.cancel()
    assert [r.error_code for r in result.records] == [None] * 7
    assert all(r.ok and len(r.token_times) == TOKENS for r in result.records)
    # Every third request went out on a connection the server then closed unanswered, and
    # again on a fresh one.
    assert server.requests == 7
    assert server.dropped == 3
    assert server.connections == 4


async def test_a_connection_lost_after_the_answer_began_is_not_sent_again() -> None:
    server = ForgetfulServer(per_connection=1, cut_mid_answer=True)
    async with trio.open_nursery() as nursery:
        target = await serve(server, nursery)
        result = await run_scenario(target, chain(2))
        nursery.cancel_scope.cancel()
    record = result.records[0]
    assert record.error_code == CONNECTION_LOST
    assert len(record.token_times) < TOKENS
    # The server had the request: sending it again would run it twice.  A lost connection
    # ends the client's chain (runner.py), so nothing else was sent.
    assert server.requests == 1


async def test_the_retries_are_bounded() -> None:
    server = ForgetfulServer(per_connection=0)  # closes every connection before answering
    async with trio.open_nursery() as nursery:
        target = await serve(server, nursery)
        result = await run_scenario(target, chain(1))
        nursery.cancel_scope.cancel()
    assert result.records[0].error_code == CONNECTION_LOST
    assert server.connections == 1 + STALE_CONNECTION_RETRIES


async def test_a_server_that_stops_answering_times_out_and_is_not_retried(
    autojump_clock: trio.abc.Clock,
) -> None:
    """`uma-trio bench --timeout` reaches the HTTP target: a stall past it is TIMEOUT (not
    CONNECTION_LOST), and the request is not sent again as a stale connection's is."""
    requests = 0

    async def stall(stream: trio.SocketStream) -> None:
        nonlocal requests
        if await read_request(stream, bytearray()):
            requests += 1
            body = sse_body()
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
            first = body.index(b"\n\n") + 2  # one token, then nothing
            await stream.send_all(head % len(body) + body[:first])
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, stall, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        target = OpenAITarget(f"http://127.0.0.1:{port}", "stalls", model="m", timeout_s=5.0)
        result = await run_scenario(target, chain(2))
        nursery.cancel_scope.cancel()
    (only,) = result.records  # the chain stops there
    assert only.error_code == TIMEOUT and len(only.token_times) == 1
    assert only.ended == pytest.approx(only.token_times[0] + 5.0, abs=0.01)
    assert requests == 1
