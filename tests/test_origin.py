"""Issue 17: web pages in the user's browser cannot make the daemon generate (Host, Origin
and Content-Type checks; http/origin.py)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from uma_trio.daemon import _serve as serve_daemon
from uma_trio.http.origin import (
    DEFAULT_CORS_ORIGINS,
    allowed_hosts,
    check,
    host_name,
    origin_pattern,
)
from uma_trio.loadgen.simulate import SIM_CONFIG

from .helpers import sim_server
from .test_http_hardening import gateway_on_sim

ORIGINS = origin_pattern(DEFAULT_CORS_ORIGINS)
HOSTS = allowed_hosts("127.0.0.1", ())
BODY = {"model": "sim", "prompt": "a b c", "max_tokens": 3}


@pytest.mark.parametrize(
    ("header", "name"),
    [("localhost:8080", "localhost"), ("[::1]:8080", "::1"), ("::1", "::1"), ("Example.COM", "example.com")],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    "origin",
    ["http://localhost:3000", "http://localhost", "https://127.0.0.1:8443", "http://[::1]:5173",
     "app://obsidian.md", "tauri://localhost", "vscode-webview://1abc"],
)  # fmt: skip
def test_default_origins_allow_local_pages_and_app_webviews(origin: str) -> None:
    assert ORIGINS.fullmatch(origin)


@pytest.mark.parametrize(
    "origin",
    ["http://evil.example", "null", "http://localhost.evil.example", "https://evil.example:443",
     "http://127.0.0.1.nip.io:8080", "file://"],
)  # fmt: skip
def test_default_origins_refuse_other_sites(origin: str) -> None:
    assert not ORIGINS.fullmatch(origin)


def test_a_port_wildcard_also_matches_no_port() -> None:
    """`--cors-origins 'http://localhost:*'` refused `http://localhost` (a page on port 80,
    which browsers write without a port); a host wildcard stays within its dots' place."""
    allowed = origin_pattern(["http://localhost:*", "https://*.corp.example:*"])
    for origin in (
        "http://localhost",
        "http://localhost:80",
        "http://localhost:5173",
        "https://a.corp.example",
    ):
        assert allowed.fullmatch(origin), origin
    for origin in (
        "http://localhostx",
        "http://localhost.evil",
        "https://corp.example",
        "https://a.corp.examplex",
    ):
        assert not allowed.fullmatch(origin), origin


def test_check_host_origin_and_content_type() -> None:
    def refused(**kw: object) -> int | None:
        args = {
            "method": "POST",
            "host": "127.0.0.1:8080",
            "origin": None,
            "content_type": "application/json",
        }
        error = check(**{**args, **kw}, hosts=HOSTS, origins=ORIGINS)  # type: ignore[arg-type]
        return None if error is None else error.status

    assert refused() is None
    assert refused(content_type="application/json; charset=utf-8") is None
    assert refused(host="evil.example:8080") == 403  # DNS rebinding
    assert refused(host="192.168.1.5:8080") is None  # an address, not a name
    assert refused(host=None) == 403
    assert refused(origin="http://evil.example") == 403
    assert refused(origin="null") == 403
    assert refused(content_type="text/plain") == 415  # a "simple" cross-origin request
    assert refused(content_type="application/x-www-form-urlencoded") == 415
    # No type and no Origin: a tool's (LiteLLM's Ollama provider sends none), read as JSON.
    # A page always sends an Origin with a POST: without a type it is refused as any other.
    assert refused(content_type=None) is None
    assert refused(content_type=None, origin="http://localhost:3000") == 415
    # Raw bytes from a tool, the same (LiteLLM's async Ollama calls: every one was a 415).
    assert refused(content_type="application/octet-stream") is None
    assert refused(content_type="application/octet-stream", origin="http://localhost:3000") == 415
    assert refused(content_type="application/xml") == 415
    assert refused(method="GET", content_type=None) is None
    anywhere = check(
        method="GET",
        host="evil.example",
        origin=None,
        content_type=None,
        hosts=frozenset({"*"}),
        origins=ORIGINS,
    )
    assert anywhere is None


async def test_a_page_from_another_site_cannot_generate_or_read() -> None:
    """Live gateway: each way a web page reaches a local server is refused before routing,
    and nothing is generated; local origins get CORS headers and their preflight answered."""
    async with gateway_on_sim() as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        evil = {"origin": "http://evil.example"}
        assert (await http.post("/v1/completions", json=BODY, headers=evil)).status_code == 403
        form = await http.post("/generate", content=b'{"prompt": "a", "max_tokens": 2}',
                               headers={"content-type": "text/plain", "origin": "null"})  # fmt: skip
        assert form.status_code == 403 and form.json()["error"]["code"] == "origin_not_allowed"
        plain = await http.post("/generate", content=b'{"prompt": "a", "max_tokens": 2}',
                                headers={"content-type": "text/plain"})  # fmt: skip
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
        rebound = await http.get("/metrics", headers={"host": "evil.example:8091"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        preflight = await http.options(
            "/v1/completions",
            headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
        assert server.metrics.tokens_generated == {}  # nothing ran

        local = {"origin": "http://localhost:5173"}
        preflight = await http.options(
            "/v1/completions",
            headers={**local, "access-control-request-method": "POST",
                     "access-control-request-headers": "content-type,authorization"},
        )  # fmt: skip
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:5173"
        answered = await http.post("/v1/completions", json=BODY, headers=local)
        assert answered.status_code == 200
        assert answered.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # a tool: no Origin


async def test_allowed_hosts_and_origins_are_configurable() -> None:
    async with (
        gateway_on_sim(allowed_hosts=("llm.lan",), cors_origins=("https://chat.example",)) as (_, _, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        ok = await http.post("/v1/completions", json=BODY,
                             headers={"host": "llm.lan:8080", "origin": "https://chat.example"})  # fmt: skip
        assert ok.status_code == 200
        local = await http.post("/v1/completions", json=BODY, headers={"origin": "http://localhost:3000"})
        assert local.status_code == 403  # the list replaces the defaults


async def test_the_metrics_port_refuses_a_rebinding_host_too(tmp_path: Path) -> None:
    """Review: ``--metrics-port`` had no Host check, so a DNS-rebinding page read it while
    the gateway's own ``/metrics`` was a 403."""
    config = replace(SIM_CONFIG, socket_path=tmp_path / "d.sock", metrics_port=0, allowed_hosts=("llm.lan",))
    server = sim_server(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_daemon, server, None, handle_signals=False))
        url = server.metrics_url
        assert url is not None
        try:
            async with httpx.AsyncClient() as http:
                rebound = await http.get(url, headers={"host": "evil.example:9100"})
                assert (
                    rebound.status_code == 403 and "'evil.example:9100' is not this server's" in rebound.text
                )
                for host in ("llm.lan:9100", "localhost"):  # --allowed-hosts, loopback
                    assert (await http.get(url, headers={"host": host})).status_code == 200
                assert (await http.get(url)).status_code == 200  # 127.0.0.1:PORT
        finally:
            server.request_shutdown(force=True)


async def test_a_request_line_in_absolute_form_is_served_and_its_authority_checked() -> None:
    """Found by review: ``GET http://host/path`` (RFC 9112 §3.2.2: servers must accept it; a
    client told the daemon is its proxy sends it) was a 404 naming the URL, and its Host
    check read the Host header, which the RFC says to ignore for the target's authority."""
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(proxy=url) as via:
        answered = await via.post(f"{url}/v1/completions?x=1", json=BODY)
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["text"]
        assert (await via.get(f"{url}/health")).status_code == 200
        rebound = await via.get("http://evil.example/health")
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        assert (await via.get(f"{url}/nowhere")).json()["error"]["message"] == "GET /nowhere: Not Found"
