"""The gateway before a model is attached, and the --http address; no model needed."""

from __future__ import annotations

import socket
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.http import serve
from uma_trio.http.gateway import Gateway, model_id
from uma_trio.http.serve import BindError, bind_tcp, serve_asgi


async def test_while_loading_health_says_503_and_the_rest_waits() -> None:
    gateway = Gateway("Some-Model.Q4_1.gguf", api_key="k", max_body_bytes=1 << 20, max_requests=4)
    sock = bind_tcp("127.0.0.1", 0, "test")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            partial(serve_asgi, gateway.app, sock, name="test_http", max_connections=16)
        )
        async with httpx.AsyncClient(base_url=url) as http:
            health = await http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "loading"}
            assert health.headers["retry-after"] == "1"
            assert (await http.get("/v1/models")).status_code == 401  # the key is checked first
            auth = {"authorization": "Bearer k"}
            for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
                answer = await http.request(method, path, headers=auth, json={})
                assert answer.status_code == 503, path
                assert answer.json()["error"]["code"] == "loading"
        nursery.cancel_scope.cancel()


def test_model_id_drops_the_extension() -> None:
    assert model_id("SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize(
    ("http", "address"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("8080", ("127.0.0.1", 8080)),
        (":0", ("127.0.0.1", 0)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        ("[::1]:8080", ("::1", 8080)),
        ("localhost:1", ("localhost", 1)),
    ],
)
def test_http_address(http: str, address: tuple[str, int]) -> None:
    assert ServerConfig(http=http).http_address == address


@pytest.mark.parametrize("http", ["127.0.0.1", "host:port", "1:99999", "::1"])
def test_bad_http_address(http: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig(http=http)


def test_metrics_address_for_routers() -> None:
    assert ServerConfig(metrics="0.0.0.0:9100").metrics_address == ("0.0.0.0", 9100)
    assert ServerConfig(metrics_port=9100).metrics_address == ("127.0.0.1", 9100)  # loopback only
    assert ServerConfig().metrics_address is None
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(metrics="9100", metrics_port=9100)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig(metrics="host:port")


def test_empty_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match="--api-key"):
        ServerConfig(api_key=" ")


def test_a_taken_port_is_a_bind_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
            bind_tcp("127.0.0.1", port, "the HTTP API")


async def test_a_streamed_body_arrives_whole_and_in_order_whether_written_at_once_or_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Body chunks go straight to the socket while it takes them and wait behind hypercorn's
    lock once it is full (the reader lags): the client must get every byte, in order."""
    chunks, size = 5000, 4096
    writes = short_writes = 0
    write_at_once = serve._EagerTCPServer._write_at_once

    def counted(self: serve._EagerTCPServer, data: bytes) -> int:
        nonlocal writes, short_writes
        sent = write_at_once(self, data)
        writes += 1
        short_writes += sent < len(data)
        return sent

    monkeypatch.setattr(serve._EagerTCPServer, "_write_at_once", counted)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(chunks):
            body = f"{i:08d}".encode().ljust(size, b".")
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sock = bind_tcp("127.0.0.1", 0, "test")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve_asgi, app, sock, name="test_http", max_connections=4))
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for lag_s in (0.0, 0.5):  # the second time the socket's buffers fill first
                async with http.stream("GET", "/") as response:
                    await trio.sleep(lag_s)
                    body = b"".join([part async for part in response.aiter_bytes()])
                assert len(body) == chunks * size
                indices = [int(body[i * size : i * size + 8]) for i in range(chunks)]
                assert indices == list(range(chunks))
        nursery.cancel_scope.cancel()
    assert writes > chunks  # the request read, the chunks were tried at once (both times)
    assert short_writes > 0  # the lagging reader did send the rest through the locked path


async def test_while_loading_ollama_s_routes_wait_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama review: for the first seconds after start `/api/chat` and the other model routes
    answered 503 "still loading" while `GET /` already said "Ollama is running", so a client
    whose readiness probe had passed failed.  Ollama holds a request until its model is in;
    so do they now (up to LOAD_WAIT_S, then the 503, in Ollama's shape)."""
    from uma_trio.daemon import http_gateway
    from uma_trio.http import gateway as gateway_module

    from .helpers import sim_daemon

    async with sim_daemon(http="127.0.0.1:0") as server, http_gateway(server.config, "sim.gguf") as gateway:
        assert gateway is not None and gateway.url is not None
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            root = await http.get("/")
            assert root.status_code == 200 and root.text == "Ollama is running"
            assert (await http.get("/api/version")).status_code == 200
            answers: dict[str, httpx.Response] = {}

            async def ask(path: str, body: dict[str, Any] | None) -> None:
                answers[path] = await (http.get(path) if body is None else http.post(path, json=body))

            chat = {"model": "sim", "messages": [{"role": "user", "content": "a b c"}], "stream": False,
                    "options": {"num_predict": 2}}  # fmt: skip
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "/api/tags", None)
                nursery.start_soon(ask, "/api/chat", chat)
                await trio.sleep(0.5)
                assert answers == {}  # held, not refused
                gateway.attach(server)
            assert answers["/api/tags"].status_code == 200, answers["/api/tags"].text
            assert answers["/api/chat"].status_code == 200 and answers["/api/chat"].json()["done"]
    # A load that takes longer than the wait: the 503, as Ollama says errors.
    monkeypatch.setattr(gateway_module, "LOAD_WAIT_S", 0.2)
    async with sim_daemon(http="127.0.0.1:0") as server, http_gateway(server.config, "sim.gguf") as gateway:
        assert gateway is not None and gateway.url is not None
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            late = await http.get("/api/tags")
    assert late.status_code == 503 and late.json() == {"error": "the model is still loading; retry shortly"}
