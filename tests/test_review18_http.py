"""The HTTP transport's review (eighteenth session): the gateway serves HTTP/1.1 only, so an
HTTP/2 client that grants no flow-control window cannot hold connection slots past every
timeout (and after it left), which had taken the gateway down for good."""

from __future__ import annotations

import json
import socket

import h2.config
import h2.connection
import h2.settings
import httpx
import pytest
import trio

from uma_trio.daemon import http_gateway
from uma_trio.sched.cost import CostCoefficients

from .helpers import sim_daemon
from .test_http_hardening import gateway_on_sim


def http2_with_no_window(port: int) -> bytes:
    """An HTTP/2 client (prior knowledge, as `curl --http2-prior-knowledge`) that opens a
    stream and grants no window; what the server sent before closing, within 10 s."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    request = [(":method", "GET"), (":path", "/v1/models"), (":scheme", "http"), (":authority", "127.0.0.1")]
    client.send_headers(1, request, end_stream=True)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(client.data_to_send())
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


async def test_http2_is_not_served_and_holds_no_slot() -> None:
    async with gateway_on_sim(http_max_connections=2) as (_, _, url):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(4):  # twice the slots: each one is closed at once and gives its slot back
            with trio.fail_after(15):
                answered = await trio.to_thread.run_sync(http2_with_no_window, port)
            assert answered == b""  # closed, not an HTTP/2 answer (a SETTINGS frame first)
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            assert (await http.get("/health")).status_code == 200


async def test_an_upgrade_to_h2c_is_answered_in_http_1_1() -> None:
    """hypercorn answered `101 Switching Protocols` and went on in HTTP/2 (`curl --http2`
    on an http:// URL asks for it)."""
    async with gateway_on_sim() as (_, _, url):
        port = int(url.rsplit(":", 1)[1])
        request = (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        )

        def ask() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                return sock.recv(65536)

        answer = await trio.to_thread.run_sync(ask)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]


SLOW = CostCoefficients(fixed_s=0.01, decode_s=0.0, prefill_s=0.0, ctx_s_per_kcell=0.0)  # 100 tokens/s


@pytest.mark.parametrize("after_body", [b"\r\n", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"])
async def test_a_hang_up_cancels_a_request_with_bytes_after_its_body(after_body: bytes) -> None:
    """h11 pauses once a request is read whole and bytes follow it (a stray CRLF, the next
    request pipelined), and hypercorn then read nothing more: the hang-up went unseen, and a
    request not streamed generated its 1,500 tokens for nobody."""
    async with (
        sim_daemon(cost=SLOW, http="127.0.0.1:0") as server,
        http_gateway(server.config, "sim.gguf") as gateway,
    ):
        assert gateway is not None and gateway.url is not None
        gateway.attach(server)
        port = int(gateway.url.rsplit(":", 1)[1])
        body = json.dumps({"model": "sim", "prompt": "Once upon a time", "max_tokens": 1500}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await sock.send(head + body + after_body)
        with trio.fail_after(10):
            while not server.loop.gauges()["sessions"]["active"]:
                await trio.sleep(0.05)
        sock.close()  # the client hangs up before its answer
        with trio.fail_after(5):
            while server.loop.gauges()["sessions"]["active"]:
                await trio.sleep(0.05)
        assert server.metrics_snapshot()["cancels"].get("disconnect") == 1
