"""Issue 17 on the HTTP edge, against a live gateway on the simulated engine (real time:
hypercorn runs its own timers)."""

from __future__ import annotations

import json
import logging
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

from uma_trio.daemon import http_gateway
from uma_trio.http import gateway as gateway_module
from uma_trio.http.event_stream import sticky_disconnect, until_disconnect
from uma_trio.http.gateway import Gateway, kept_for_others
from uma_trio.runtime.server import Server
from uma_trio.sched.cost import CostCoefficients

from .helpers import sim_daemon, streaming

FAST = CostCoefficients(fixed_s=0.0001, decode_s=0.00001, prefill_s=0.00001, ctx_s_per_kcell=0.0)


@asynccontextmanager
async def gateway_on_sim(
    cost: CostCoefficients = FAST, **overrides: Any
) -> AsyncIterator[tuple[Server, Gateway, str]]:
    async with (
        sim_daemon(cost=cost, http="127.0.0.1:0", **overrides) as server,
        http_gateway(server.config, "sim.gguf") as gateway,
    ):
        assert gateway is not None and gateway.url is not None
        gateway.attach(server)
        yield server, gateway, gateway.url


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_a_failure_after_registration_releases_the_request(
    monkeypatch: pytest.MonkeyPatch, path: str, stream: bool
) -> None:
    """The lifecycle guard: whatever raises between registering a request and its response
    owning it (here the response itself cannot be built), the id, the place among the HTTP
    requests in flight and the session are released; the same id is accepted again."""
    body = {"prompt": "a b c", "max_tokens": 3, "stream": stream}
    body |= {"id": "r-1"} if path == "/generate" else {"model": "sim"}

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: the response could not be built")

    async with gateway_on_sim() as (server, gateway, url), httpx.AsyncClient(base_url=url) as http:
        with monkeypatch.context() as patch:
            patch.setattr(gateway_module.EventStream, "__init__", broken)
            patch.setattr(gateway_module, "json_response", broken)
            for _ in range(gateway.max_requests + 2):  # more than the HTTP in-flight limit
                failed = await http.post(path, json=body)
                assert failed.status_code == 500
        with trio.fail_after(5):
            while server.loop.gauges()["sessions"]["active"] or gateway._flights:
                await trio.sleep(0.01)
        ok = await http.post(path, json=body)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
async def test_a_finished_stream_ends_its_response(connection: str) -> None:
    """After the last event the chunked body is terminated (and with `Connection: close` the
    socket closed): the final empty chunk used to be cancelled by the disconnect watcher, and
    connections stayed open after `[DONE]`."""
    async with gateway_on_sim() as (_, _, url):
        host, port = url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        body = b'{"model": "sim", "prompt": "a b c", "max_tokens": 5, "stream": true}'
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Connection: {connection}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        await stream.send_all(head.encode() + body)
        received = b""
        with trio.fail_after(5):
            while not received.endswith(b"0\r\n\r\n"):  # the chunked body's terminator
                data = await stream.receive_some(65536)
                assert data, f"connection closed before the body ended: {received[-200:]!r}"
                received += data
            assert b"data: [DONE]" in received
            if connection == "close":
                assert await stream.receive_some(65536) == b""  # and the server hangs up
        await stream.aclose()


async def test_an_idle_daemon_logs_no_scorecard_lines(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 17: an idle daemon logged a zero scorecard line every interval; now only an
    interval in which something happened gets one."""
    from uma_trio.client import UmaClient

    caplog.set_level(logging.INFO, logger="uma_trio.runtime.server")
    async with sim_daemon(metrics_interval_s=10.0) as server:
        await trio.sleep(65)  # six intervals of nothing
        idle = [r for r in caplog.records if "scorecard" in r.getMessage()]
        async with UmaClient.connect(server.config.socket_path) as client:
            await client.complete(prompt="a b", max_tokens=3)
        await trio.sleep(25)
        busy = [r for r in caplog.records if "scorecard" in r.getMessage()]
    assert idle == []
    assert len(busy) == 1  # the interval with the request, then quiet again


async def test_client_text_in_errors_and_logs_is_escaped_and_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 17: a model name with a newline and 100 KB reached the error message and the
    log raw, so it could forge a log line."""
    caplog.set_level(logging.DEBUG, logger="uma_trio")
    forged = "x\n2026-11-23 12:00:00 ERROR uma_trio: forged line " + "A" * 100_000
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        refused = await http.post("/v1/completions", json={"model": forged, "prompt": "hi"})
    assert refused.status_code == 404
    message = refused.json()["error"]["message"]
    assert "\n" not in message and len(message) < 300 and "100050 characters" in message
    lines = [r.getMessage() for r in caplog.records if "HTTP 404" in r.getMessage()]
    assert lines and all("\n" not in line and len(line) < 500 for line in lines)


def test_shown_escapes_and_cuts() -> None:
    from uma_trio.protocol.errors import shown

    assert shown("plain") == "plain"
    assert shown("a\r\nb\x1b[31m") == "a\\r\\nb\\x1b[31m"
    assert shown("é\u2028" * 50, limit=3) == "é\\u2028é... (100 characters)"  # letters stay, separators not


async def test_a_body_that_stops_midway_gets_408_and_its_connection_closed() -> None:
    """Issue 17: hypercorn has no deadline once the headers are in, so 20 connections that
    stopped mid-body stayed open for good (descriptors a local user could exhaust)."""
    async with gateway_on_sim(frame_timeout_s=0.5) as (server, _, url):
        host, port = url.removeprefix("http://").split(":")
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        streams = [await trio.open_tcp_stream(host, int(port)) for _ in range(20)]
        for stream in streams:
            await stream.send_all(head + b'{"model": ')
        with trio.fail_after(5):
            for stream in streams:
                received = b""
                while data := await stream.receive_some(65536):
                    received += data
                assert received.startswith(b"HTTP/1.1 408"), received[:200]  # then EOF: closed
                assert b"did not arrive within 0.5 s" in received
                await stream.aclose()
        assert server.metrics.errors["E_PROTO_008"] == 20


async def test_a_connection_whose_headers_never_end_is_closed() -> None:
    """Issue 17, deadlines on every read: until a request's headers are in, hypercorn's
    keep-alive timeout (5 s) runs; its read_timeout stays unset, as it would also cut a
    long SSE response whose client sends nothing more."""
    async with gateway_on_sim() as (_, _, url):
        host, port = url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        with trio.fail_after(8):
            assert await stream.receive_some(65536) == b""  # closed by the server
        await stream.aclose()


async def test_http_connections_beyond_the_cap_wait_until_one_closes() -> None:
    """Issue 17: hypercorn's worker accepts without limit, and every open connection holds a
    descriptor the socket's accept loop needs too."""
    async with gateway_on_sim(http_max_connections=3) as (_, _, url):
        host, port = url.removeprefix("http://").split(":")
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

        async def answered(stream: trio.SocketStream, within: float) -> bool:
            await stream.send_all(request)
            with trio.move_on_after(within):
                return (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
            return False

        held = [await trio.open_tcp_stream(host, int(port)) for _ in range(3)]
        for stream in held:  # served, then kept open (keep-alive)
            assert await answered(stream, 5)
        extra = await trio.open_tcp_stream(host, int(port))  # the kernel queues it
        assert not await answered(extra, 1.0)
        await held.pop().aclose()
        with trio.fail_after(5):
            assert (await extra.receive_some(65536)).startswith(b"HTTP/1.1 200")
        for stream in [*held, extra]:
            await stream.aclose()


async def test_http_clients_and_socket_users_do_not_share_cached_prefixes() -> None:
    """Issue 17: the prefix cache is partitioned by principal (a socket peer's uid; "http"
    for the gateway, which any local user can reach): `cached_tokens` no longer reveals
    another principal's prompt."""
    from uma_trio.client import UmaClient

    secret = "the vault code is 4 7 1 9 and nobody else may know it " * 4  # 52 words
    async with gateway_on_sim(prefix_cache_cells=None) as (server, _, url):
        async with UmaClient.connect(server.config.socket_path) as client:
            first = await client.complete(prompt=secret + " so", max_tokens=2)
            again = await client.complete(prompt=secret + " and", max_tokens=2)
        assert first.eos.usage.cached_tokens == 0 and again.eos.usage.cached_tokens > 10  # same user
        async with httpx.AsyncClient(base_url=url) as http:
            guess = {"prompt": secret + " so", "max_tokens": 2, "stream": False}
            probe = (await http.post("/generate", json=guess)).json()
            assert probe["usage"]["cached_tokens"] == 0  # another principal: nothing to learn
            repeat = (await http.post("/generate", json=guess)).json()
            assert repeat["usage"]["cached_tokens"] > 10  # its own prefixes still serve it


async def test_api_key_file_keys_are_all_accepted_and_do_not_share_prefixes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-alice\n\nsk-bob  # the second\n")
    prompt = " ".join(["shared system prompt words"] * 10)
    async with (
        gateway_on_sim(api_key_file=keys, prefix_cache_cells=None) as (_, _, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        body = {"prompt": prompt, "max_tokens": 2, "stream": False}
        alice = {"authorization": "Bearer sk-alice"}
        assert (await http.post("/generate", json=body, headers=alice)).json()["usage"]["cached_tokens"] == 0
        assert (await http.post("/generate", json=body, headers=alice)).json()["usage"]["cached_tokens"] > 10
        bob = await http.post("/generate", json=body, headers={"x-api-key": "sk-bob"})  # Anthropic's header
        assert bob.status_code == 200 and bob.json()["usage"]["cached_tokens"] == 0  # not alice's prefix
        for wrong in ({"authorization": "Bearer sk-eve"}, {"x-api-key": "sk-alic"}, {}):
            assert (await http.post("/generate", json=body, headers=wrong)).status_code == 401


async def test_one_key_cannot_move_another_key_s_request(tmp_path: Path) -> None:
    """Found by review: with --api-key-file, bob's /priority moved alice's request (and told
    him its id was in flight).  Now only its own principal finds it."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    alice, bob = {"authorization": "Bearer sk-alice"}, {"x-api-key": "sk-bob"}
    body = {
        "id": "nightly-2",
        "prompt": "count",
        "max_tokens": 1000,
        "stream": True,
        "priority": "background",
    }
    slow = CostCoefficients(fixed_s=0.01, decode_s=0.0, prefill_s=0.0, ctx_s_per_kcell=0.0)  # 10 s of steps
    async with (
        gateway_on_sim(slow, api_key_file=keys) as (_, gateway, url),
        httpx.AsyncClient(base_url=url) as http,
        trio.open_nursery() as nursery,
    ):
        reading = trio.Event()

        async def read() -> None:  # alice reads her stream all along: it stays in flight
            async with http.stream("POST", "/generate", json=body, headers=alice) as streamed:
                async for _ in streamed.aiter_lines():
                    reading.set()

        nursery.start_soon(read)
        await reading.wait()
        for who, lane, status in (
            (alice, "background", 200),
            (bob, "interactive", 404),
            (alice, "interactive", 200),
        ):
            assert "nightly-2" in gateway._flights
            moved = await http.post("/priority", json={"id": "nightly-2", "priority": lane}, headers=who)
            assert moved.status_code == status, moved.text
        assert moved.json()["priority"] == "interactive"
        nursery.cancel_scope.cancel()


async def test_answers_sent_before_the_body_is_read_keep_their_connection(tmp_path: Path) -> None:
    """A 401 goes out before the gateway reads the request's body.  Hypercorn closes a
    connection whose request was not read whole when its response ends; the gateway's
    writes at once (http/serve.py) must leave it the checkpoints that let it read the body
    first, or a client's next request on that keep-alive connection finds it gone."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\n")
    body = {"prompt": "shared system prompt words " * 40, "max_tokens": 2, "stream": False}
    async with gateway_on_sim(api_key_file=keys) as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        for _ in range(60):
            answer = await http.post("/generate", json=body, headers={"authorization": "Bearer sk-eve"})
            assert answer.status_code == 401


def test_tls_and_key_file_settings_are_checked(tmp_path: Path) -> None:
    from uma_trio.config import ServerConfig, read_api_keys

    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_cert=tmp_path / "c.pem")
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(tmp_path / "missing")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_the_http_api_serves_https_with_tls_cert_and_key(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await trio.run_process(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        capture_stdout=True, capture_stderr=True,
    )  # fmt: skip
    async with gateway_on_sim(tls_cert=cert, tls_key=key) as (_, _, url):
        assert url.startswith("https://")
        async with httpx.AsyncClient(base_url=url, verify=ssl.create_default_context(cafile=cert)) as https:
            answer = await https.post(
                "/v1/completions", json={"model": "sim", "prompt": "a b", "max_tokens": 2}
            )
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        async with httpx.AsyncClient(base_url=url.replace("https://", "http://")) as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get("/health")
    # A connection that never starts its handshake is idle: closed after 5 s like any idle
    # one, freeing its slot (hypercorn's own handshake timeout held it 60 s).
    async with gateway_on_sim(tls_cert=cert, tls_key=key, http_max_connections=1) as (_, _, url):
        host, port = url.removeprefix("https://").split(":")
        silent = await trio.open_tcp_stream(host, int(port.rstrip("/")))
        await trio.sleep(6.5)
        async with httpx.AsyncClient(base_url=url, verify=ssl.create_default_context(cafile=cert)) as https:
            with trio.fail_after(5):
                assert (await https.get("/health")).status_code == 200
        await silent.aclose()
    # A missing file, or a key that is not the certificate's, is a start-up error naming the
    # flags (it was a traceback from inside the server once it began).
    other = tmp_path / "other.pem"
    await trio.run_process(
        ["openssl", "genrsa", "-out", str(other), "2048"], capture_stdout=True, capture_stderr=True
    )
    from uma_trio.config import ServerConfig
    from uma_trio.daemon import DaemonStartError

    for bad_cert, bad_key in ((tmp_path / "missing.pem", key), (cert, other)):
        config = ServerConfig(http="127.0.0.1:0", tls_cert=bad_cert, tls_key=bad_key)
        with pytest.raises(DaemonStartError, match="--tls-cert"):
            async with http_gateway(config, "sim.gguf"):
                pytest.fail("served with bad TLS files")


async def test_browser_sdks_preflights_from_an_allowed_origin_are_answered() -> None:
    """The OpenAI and Anthropic browser SDKs send headers of their own (x-stainless-*,
    anthropic-version, x-api-key): a 400 "Disallowed CORS headers" kept them off."""
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        for headers in (
            "authorization, content-type, x-stainless-os, x-stainless-lang",
            "x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access, content-type",
        ):
            answer = await http.options("/v1/chat/completions", headers={
                "origin": "http://localhost:3000", "access-control-request-method": "POST",
                "access-control-request-headers": headers,
            })  # fmt: skip
            assert answer.status_code == 200, (headers, answer.text)
        # Chrome's Private Network Access (a public page calling loopback) asks for it: a 400 before.
        answer = await http.options("/v1/chat/completions", headers={
            "origin": "http://localhost:3000", "access-control-request-method": "POST",
            "access-control-request-private-network": "true",
        })  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-private-network"] == "true"


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    from uma_trio.process_setup import raise_fd_limit

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, before[1]), before[1]))
        raised = raise_fd_limit()
        assert raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(256, before[1])
        if before[1] != resource.RLIM_INFINITY:
            assert raised == before[1]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


BAD_BODY_PATHS = [
    "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
    "/api/chat", "/api/generate", "/api/show", "/api/embed", "/generate", "/priority", "/infill",
]  # fmt: skip


async def test_bodies_that_are_not_utf8_or_nest_too_deeply_get_400_everywhere() -> None:
    """msgspec raises UnicodeDecodeError and RecursionError, not DecodeError: each was a 500."""
    not_utf8 = b'{"model": "sim\xff", "messages": []}'
    too_deep = b'{"model": "sim", "prompt": "x", "tools": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        for path in BAD_BODY_PATHS:
            for body, says in ((not_utf8, "not valid UTF-8"), (too_deep, "")):
                answer = await http.post(path, content=body, headers={"content-type": "application/json"})
                # Where "tools" is typed the nesting fails its schema first: a 400 all the same.
                assert answer.status_code == 400 and says in answer.text, (path, answer.text)
        # tool_choice takes any JSON: there the nesting itself is what is refused.
        deep_any = b'{"model": "sim", "prompt": "x", "tool_choice": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        answer = await http.post(
            "/v1/completions", content=deep_any, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400 and "nested too deeply" in answer.text, answer.text


async def test_a_refused_choice_of_n_answers_as_one_request_would() -> None:
    """n > 1, not streamed: a prompt over the context was a 500 (the refusal came wrapped in
    an exception group); it is the 400 that n = 1 gets."""
    body = {"model": "sim", "prompt": "hello " * 5000, "max_tokens": 2}
    async with gateway_on_sim(n_ctx=512) as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        one = await http.post("/v1/completions", json=body)
        two = await http.post("/v1/completions", json=body | {"n": 2})
        assert one.status_code == 400
        assert (
            two.status_code == one.status_code and two.json()["error"]["code"] == one.json()["error"]["code"]
        )
        assert server.loop.gauges()["in_flight"] == []


async def test_a_body_over_the_limit_closes_its_connection() -> None:
    """Its rest is never read, so the connection cannot carry another request."""
    async with gateway_on_sim() as (_, gateway, url), httpx.AsyncClient(base_url=url) as http:
        big = b'{"prompt": "' + b"x" * (gateway.max_body_bytes + 1) + b'"}'
        answer = await http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert answer.status_code == 413
        assert answer.headers.get("connection") == "close"
        after = await http.post("/v1/completions", json={"model": "sim", "prompt": "a", "max_tokens": 1})
        assert after.status_code == 200


async def test_a_responses_input_role_that_is_not_a_string_is_a_400() -> None:
    body = {
        "model": "sim",
        "input": [{"type": "message", "role": [], "content": "hi"}],
        "max_output_tokens": 4,
    }
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        answer = await http.post("/v1/responses", json=body)
        assert answer.status_code == 400 and "role" in answer.text


@pytest.mark.parametrize("n", [1, 4])
async def test_a_stalled_reader_of_streamed_choices_is_parked(n: int) -> None:
    """A client that stops reading is parked (left out of the batch) until the stall timeout;
    with n > 1 the choices' events went through an unbounded channel and every choice ran on
    to max_tokens while nobody read."""
    import json
    import socket

    async with gateway_on_sim(stall_timeout_s=6.0) as (server, _, url):
        host, port = url.removeprefix("http://").split(":")
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port.rstrip("/"))))
        body = json.dumps(
            {"model": "sim", "prompt": "tell me everything", "max_tokens": 3000, "n": n, "stream": True}
        )
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        await sock.send(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        await trio.sleep(4)  # before the stall timeout
        generated = server.metrics_snapshot()["tokens"]["generated"]["interactive"]
        sock.close()
    assert generated < n * 3000 // 2


async def test_clients_that_never_read_their_answers_lose_their_slots() -> None:
    """Two keyless clients pipelining requests and reading nothing held both of two slots for
    good (hypercorn's write waited without a deadline); now a write that waits past the stall
    timeout closes its connection."""
    import socket

    async with gateway_on_sim(http_max_connections=2, api_key="sk-good", stall_timeout_s=2.0) as (_, _, url):
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 4000
        hogs = []
        for _ in range(2):
            hog = socket.socket()
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hog.connect((host, int(port)))
            hog.setblocking(False)
            hogs.append([hog, request])
        began = trio.current_time()
        while any(left for _, left in hogs) and trio.current_time() - began < 3:
            for pair in hogs:
                with suppress(BlockingIOError, ConnectionError):
                    pair[1] = pair[1][pair[0].send(pair[1]) :]
            await trio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer sk-good"}) as http:
            with trio.fail_after(15):
                assert (await http.get("/v1/models")).status_code == 200
        for hog, _ in hogs:
            hog.close()


async def test_more_choices_than_the_http_requests_in_flight_allowed_are_a_400(tmp_path: Path) -> None:
    """Each choice is an HTTP request in flight: n over --max-connections (or, with several
    keys, over one key's share of it) was a 429 with Retry-After on an idle daemon, which the
    SDKs retried for ever.  It is a 400 naming n, as n over sessions and queue is."""
    async with (
        gateway_on_sim(max_connections=2) as (_, _, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        for stream in (False, True):
            body = {"model": "sim", "prompt": "hello", "max_tokens": 4, "n": 3, "stream": stream}
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
            assert "--max-connections" in answer.json()["error"]["message"]
        two = await http.post(
            "/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 4, "n": 2}
        )
        assert two.status_code == 200 and len(two.json()["choices"]) == 2
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    async with (
        gateway_on_sim(max_connections=4, api_key_file=keys) as (_, gateway, url),
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer sk-alice"}) as http,
    ):
        share = gateway.max_requests - kept_for_others(gateway.max_requests)
        body = {"model": "sim", "prompt": "hi", "max_tokens": 4, "n": share + 1}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
        body["n"] = share
        assert (await http.post("/v1/completions", json=body)).status_code == 200


async def test_more_choices_than_the_daemon_can_ever_hold_are_a_400() -> None:
    """n over --max-sessions + --max-queue was a 429 with Retry-After on an idle daemon, for
    ever, each try starting and cancelling its choices; a streamed choice refused once the
    stream had begun was missing from the errors metric."""
    async with (
        gateway_on_sim(max_sessions=2, max_queue=0) as (server, _, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        for stream in (False, True):
            body = {"model": "sim", "prompt": "hello", "max_tokens": 4, "n": 3, "stream": stream}
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
        assert sum(server.metrics_snapshot()["requests"]["interactive"].values()) == 0  # none started
        pair = {"model": "sim", "prompt": "hi", "max_tokens": 4, "n": 2}
        two = await http.post("/v1/completions", json=pair)
        assert two.status_code == 200 and len(two.json()["choices"]) == 2
        # A snapshot's pinned sequence is an id no request gets: two choices can never all run.
        kv = server.loop.kv
        seq = next(iter(kv._free))  # white box: pin a sequence as a saved snapshot does
        kv._free.discard(seq)
        kv.release(seq, np.arange(8, dtype=np.int32), pin=True)
        pinned = await http.post("/v1/completions", json=pair)
        assert pinned.status_code == 400 and pinned.json()["error"]["param"] == "n", pinned.text
        kv.unpin(seq)
        assert (await http.post("/v1/completions", json=pair)).status_code == 200

        busy = {"model": "sim", "prompt": "go", "max_tokens": 400, "stream": True}
        async with streaming(http, busy):  # one session taken: the second choice is refused
            before = server.metrics_snapshot()["errors"].get("E_LIMIT_004", 0)
            body = {"model": "sim", "prompt": "hello", "max_tokens": 50, "n": 2, "stream": True}
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 200 and "E_LIMIT_004" in answer.text
            assert server.metrics_snapshot()["errors"].get("E_LIMIT_004", 0) == before + 1


async def test_a_full_daemon_is_anthropic_s_529_overloaded_on_the_messages_route() -> None:
    """A daemon too busy to take a request answered `/v1/messages` with 429 `rate_limit_error`,
    which Anthropic's API means as an account's rate limit (and Claude Code reports so); its
    overloaded server is 529 `overloaded_error`.  The other routes keep OpenAI's 429."""
    import anthropic

    async with (
        gateway_on_sim(max_sessions=1, max_queue=0) as (_, _, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        busy = {"model": "sim", "prompt": "go", "max_tokens": 400, "stream": True}
        async with streaming(http, busy):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
            with pytest.raises(anthropic.OverloadedError) as overloaded:
                await client.messages.create(
                    model="sim", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )
            openai_shape = await http.post("/v1/completions", json={**busy, "stream": False})
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert overloaded.value.response.headers["retry-after"] == "1"
    assert openai_shape.status_code == 429 and openai_shape.json()["error"]["type"] == "rate_limit_error"


async def test_a_hang_up_during_a_streamed_answer_of_several_choices_cancels_them_all() -> None:
    """The later choices of a streamed `n` > 1 answer are admitted beside the stream, which
    already watches for the hang-up: their admission must not watch too (two readers of one
    connection's messages, and the hang-up reaches only one), or choices run on for nobody."""
    from .helpers import assert_nothing_held

    slow = CostCoefficients(fixed_s=0.02, source="test: 20 ms a step")
    async with gateway_on_sim(slow) as (server, _, url):
        body = {"model": "sim", "prompt": "go", "max_tokens": 400, "n": 3, "stream": True}
        async with (
            httpx.AsyncClient(base_url=url) as http,
            http.stream("POST", "/v1/completions", json=body) as s,
        ):
            seen: set[int] = set()
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(seen) == 3:
                    break  # every choice streams: the client leaves
        with trio.fail_after(5):
            while server.loop.gauges()["in_flight"]:
                await trio.sleep(0.05)
        assert_nothing_held(server)


async def test_a_hang_up_taken_by_one_watcher_is_seen_by_the_next() -> None:
    """Hypercorn says `http.disconnect` once.  The watcher around a request's admission,
    blocked on receive, could be handed it just as the admission ended; the watcher around
    the answer then waited for nothing, and the request ran on for nobody (test_e2e_http.py
    has the editor's burst on the real model).  Through `sticky_disconnect` the next one sees it."""
    send, messages = trio.open_memory_channel[dict[str, Any]](1)

    async def hypercorn_receive() -> dict[str, Any]:
        return await messages.receive()

    for receive, seen in ((hypercorn_receive, False), (sticky_disconnect(hypercorn_receive), True)):

        async def admission() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the watcher blocks on receive
            send.send_nowait({"type": "http.disconnect"})  # handed to it as the admission ends

        await until_disconnect(receive, admission)
        with trio.move_on_after(0.5) as waited:
            await until_disconnect(receive, trio.sleep_forever)  # the answer's watcher
        assert waited.cancelled_caught is not seen


async def test_one_key_cannot_take_every_place_in_flight(tmp_path: Path) -> None:
    """Noisy neighbours: the HTTP requests in flight (--max-connections) were one count for
    every key, so one key's flood made another key's every request a 429.  A quarter of the
    places are now kept for the other principals: the flooding key is refused past three
    quarters, and another key still gets in."""
    keys = tmp_path / "keys"
    keys.write_text("sk-flood\nsk-other\n")
    flood, other = ({"authorization": f"Bearer {key}"} for key in ("sk-flood", "sk-other"))
    busy = {"model": "sim", "prompt": "go", "max_tokens": 4000, "stream": True}
    short = {"model": "sim", "prompt": "hi", "max_tokens": 2}
    async with (
        gateway_on_sim(api_key_file=keys, max_connections=4, max_sessions=8) as (_, gateway, url),
        httpx.AsyncClient(base_url=url, headers=flood, timeout=30) as http,
        streaming(http, busy),
        streaming(http, busy),
        streaming(http, busy),
    ):
        assert gateway.max_requests == 4
        refused = await http.post("/v1/completions", json=short)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "E_LIMIT_006", refused.text
        assert "kept for other keys" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        answer = await http.post("/v1/completions", json=short, headers=other)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
    # With one principal (no keys) nobody else could use them: one client takes every place.
    async with (
        gateway_on_sim(max_connections=4, max_sessions=8) as (_, _, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        streaming(http, busy),
        streaming(http, busy),
        streaming(http, busy),
    ):
        assert (await http.post("/v1/completions", json=short)).status_code == 200


async def test_a_keyless_http_flood_does_not_queue_ahead_of_a_socket_app() -> None:
    """Without keys all HTTP requests are one client together (admission.client_of), not a
    client each: a socket app's request sent after a keyless flood had filled the sessions
    and queued behind them takes the next session freed, before the flood's queue."""
    from .helpers import RawClient

    slow = CostCoefficients(fixed_s=0.004, decode_s=0.001, prefill_s=0.0001, ctx_s_per_kcell=0.0)
    started: list[float] = []
    async with (
        gateway_on_sim(cost=slow, max_sessions=2, interactive_reserve=0) as (server, _, url),
        httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=20)) as http,
        trio.open_nursery() as nursery,
    ):

        async def flood(i: int) -> None:
            body = {"model": "sim", "prompt": f"flood {i}", "max_tokens": 150, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as answer:
                first = True
                async for _ in answer.aiter_lines():
                    if first:  # its first line: it holds a session
                        started.append(trio.current_time())
                        first = False

        for i in range(6):
            nursery.start_soon(flood, i)
        with trio.fail_after(20):
            while server.metrics_snapshot()["sessions"]["waiting"] < 4:
                await trio.sleep(0.01)
        raw = await RawClient.connect(server.config.socket_path)
        await raw.send({"id": "app-1", "prompt": "mine", "max_tokens": 3})
        events = await raw.until_end("app-1")
        done = trio.current_time()
        await raw.aclose()
        assert events[-1]["event"] == "eos", events
        # Two ran when it came; at most one more started beside it, in the other session freed.
        assert len([t for t in started if t < done]) <= 3, (started, done)
