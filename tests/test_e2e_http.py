"""The HTTP gateway against a real daemon, driven by the official ``openai`` SDK (sync,
in a worker thread, and async, on this trio run), plus raw httpx for what the SDK
cannot send (bad JSON, no key)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import TokenEvent
from uma_trio.runtime.server import Server

from .conftest import running_server

pytestmark = pytest.mark.model

KEY = "sk-test-key"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture
async def http_server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", api_key=KEY) as server:
        yield server


def base_url(server: Server) -> str:
    assert server.http_url is not None
    return f"{server.http_url}/v1"


def sync_client(server: Server, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server), api_key=KEY, max_retries=0, **kwargs)


def async_client(server: Server, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key=KEY, max_retries=0, **kwargs)


async def in_thread(fn: Any) -> Any:
    return await trio.to_thread.run_sync(fn)


async def wait_until_idle(server: Server) -> None:
    with trio.fail_after(10):
        while server.loop.gauges()["sessions"]["active"] or server.loop.gauges()["kv"]["cells_used"]:
            await trio.sleep(0.01)


async def test_models_health_and_metrics(http_server: Server) -> None:
    models = await in_thread(lambda: sync_client(http_server).models.list())
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient(base_url=http_server.http_url or "") as http:
        health = await http.get("/health")  # open without the key, which it says nothing more to
        assert health.status_code == 200 and health.json() == {"status": "ok", "model": MODEL}
        wrong = await http.get("/health", headers={"authorization": "Bearer not-the-key"})
        assert wrong.status_code == 200 and "engine" not in wrong.json()
        keyed = await http.get("/health", headers={"authorization": f"Bearer {KEY}"})
        body = keyed.json()
        assert keyed.status_code == 200 and (body["status"], body["model"]) == ("ok", MODEL)
        engine = body["engine"]  # what it runs on (engine/summary.py), for a key holder
        assert engine["backends"] == ["CPU"] and engine["gpu_layers"]["offloaded"] == 0
        assert engine["kv"]["type"] == "f16" and engine["settings"]["n_ubatch"] == 512
        assert engine["settings"]["cuda_graphs"] is False
        assert engine["flash_attn"] in ("on", "off") and engine["kv"]["bytes"] > 0
        metrics = await http.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
        assert metrics.status_code == 200 and "uma_requests_total" in metrics.text
        http_server.loop.stop_accepting()  # what a shutdown does first
        draining = await http.get("/health")
        assert draining.status_code == 503 and draining.json() == {"status": "draining"}


async def test_chat_sync_and_async_stream_agree_and_count_tokens(http_server: Server) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": STORY, "max_tokens": 24, "temperature": 0}
    reply = await in_thread(lambda: sync_client(http_server).chat.completions.create(**request))
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL and reply.created > 0
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    # usage equals the daemon's own count: its chat template and tokenizer, then max_tokens
    turns = [(m["role"], m["content"]) for m in STORY]
    prompt_tokens = len(http_server.engine.tokenize(http_server.engine.apply_chat_template(turns)))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 24)
    assert reply.usage.total_tokens == prompt_tokens + 24

    before = http_server.metrics_snapshot()["tokens"]
    stream = await async_client(http_server).chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    after = http_server.metrics_snapshot()["tokens"]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streamed and whole answers agree
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == after["prompt"]["interactive"] - before["prompt"]["interactive"]
    assert usage.completion_tokens == after["generated"]["interactive"] - before["generated"]["interactive"]


async def test_completion_stop_strings_and_length(http_server: Server) -> None:
    client = sync_client(http_server)
    prompt = "The three primary colors are"
    full = await in_thread(
        lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    )
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 30
    text = full.choices[0].text
    stop = text.strip().split()[2]  # a word from the middle of the greedy answer
    cut = await in_thread(
        lambda: client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
        )
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.usage is not None and cut.usage.completion_tokens < 30

    stream = await async_client(http_server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_streamed_text_offsets_after_held_back_text_are_the_whole_answer_s(
    http_server: Server,
) -> None:
    """Streamed ``text_offset`` were counted from the text sent: " United" may start the stop
    string, so its chunk sent " " with its entry, and every offset after it was shifted.  (A
    character cut between chunks: test_openai_protocol.py, as the model's answer cannot be
    chosen.)"""
    client = async_client(http_server)
    fields: dict[str, Any] = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, logprobs=1,
        stop=["United Kingdom"],
    )  # fmt: skip
    whole = (await client.completions.create(**fields)).choices[0]
    assert whole.logprobs is not None and whole.logprobs.tokens and whole.logprobs.text_offset
    assert " United" in whole.logprobs.tokens  # the case is met
    tokens: list[str] = []
    offsets: list[int] = []
    text = ""
    async for chunk in await client.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens or [] if choice.logprobs else []
            offsets += choice.logprobs.text_offset or [] if choice.logprobs else []
    assert (text, tokens) == (whole.text, whole.logprobs.tokens)
    assert offsets == whole.logprobs.text_offset
    for token, at in zip(tokens, offsets, strict=True):
        assert "\ufffd" in token or text[at : at + len(token)] == token


async def test_default_completion_length_is_openais_16(http_server: Server) -> None:
    prompt = "The three primary colors are"  # greedy, it goes on for 30 tokens and more
    reply = await in_thread(
        lambda: sync_client(http_server).completions.create(model=MODEL, prompt=prompt, temperature=0)
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


async def test_usage_key_is_null_or_absent_on_the_wire(http_server: Server) -> None:
    """The SDK reads an absent key and a null alike; check the raw SSE."""
    body = {"model": MODEL, "messages": STORY, "max_tokens": 3, "temperature": 0, "stream": True}
    auth = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        for include_usage in (False, True):
            reply = await http.post(
                "/v1/chat/completions", json={**body, "stream_options": {"include_usage": include_usage}}
            )
            assert reply.status_code == 200
            lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [openai_json(line) for line in lines[:-1]]
            if include_usage:
                assert (
                    all(c["usage"] is None for c in chunks[:-1])
                    and chunks[-1]["usage"]["completion_tokens"] == 3
                )
            else:
                assert all("usage" not in c for c in chunks)


async def test_closing_a_stream_midway_cancels_it_and_frees_kv(http_server: Server) -> None:
    client = async_client(http_server)
    stream = await client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=400, temperature=0, stream=True
    )
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    assert http_server.loop.gauges()["kv"]["cells_used"] > 0
    await stream.close()
    await wait_until_idle(http_server)
    snapshot = http_server.metrics_snapshot()
    assert snapshot["cancels"] == {"disconnect": 1}
    assert snapshot["requests"]["interactive"] == {"cancelled": 1}
    assert snapshot["tokens"]["generated"]["interactive"] < 400
    assert snapshot["in_flight"] == []


async def test_non_streamed_request_is_cancelled_when_the_client_gives_up(http_server: Server) -> None:
    client = async_client(http_server, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=1000, temperature=0)
    await wait_until_idle(http_server)
    assert http_server.metrics_snapshot()["cancels"] == {"disconnect": 1}


async def test_max_tokens_past_the_limits_is_a_ceiling(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """OpenAI's max_tokens is an upper bound, and agents ask for 32,000 (OpenCode): past
    --max-tokens, or past the room the prompt leaves, the answer is cut there and ends with
    ``length``, as llama-server's and Ollama's; not refused (it was a 400, E_LIMIT_003)."""
    limit = 12
    config = dataclasses.replace(server_config, max_tokens=limit)
    async with running_server(llama_model, config, http="127.0.0.1:0", api_key=KEY) as server:
        client = async_client(server)
        cut = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10**6, temperature=0
        )
        chat = await client.chat.completions.create(
            model=MODEL, messages=STORY, max_completion_tokens=32000, temperature=0
        )
        for answer in (cut, chat):
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage is not None and answer.usage.completion_tokens == limit
        response = await client.responses.create(
            model=MODEL, input="Tell a long story.", max_output_tokens=10**6, temperature=0
        )
        assert response.status == "incomplete" and response.usage is not None
        assert response.usage.output_tokens == limit
        assert server.metrics_snapshot()["errors"] == {}


async def test_errors_have_the_right_status_and_error_object(http_server: Server) -> None:
    client = async_client(http_server)
    chat: dict[str, Any] = {"model": MODEL, "messages": STORY, "max_tokens": 4}

    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(**{**chat, "model": "gpt-4o"})
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    assert missing.value.param == "model"

    with pytest.raises(openai.BadRequestError) as many:
        await client.chat.completions.create(**chat, n=17)
    assert many.value.param == "n" and many.value.type == "invalid_request_error"

    with pytest.raises(openai.BadRequestError) as wrong_type:
        await client.chat.completions.create(**chat, extra_body={"temperature": "hot"})
    assert wrong_type.value.param == "temperature" and wrong_type.value.code == "E_PROTO_002"

    with pytest.raises(openai.BadRequestError) as unsupported:
        await client.completions.create(model=MODEL, prompt="hi", echo=True)
    assert unsupported.value.param == "echo"

    with pytest.raises(openai.AuthenticationError) as bad_key:
        await openai.AsyncOpenAI(
            base_url=base_url(http_server), api_key="sk-wrong", max_retries=0
        ).models.list()
    assert bad_key.value.status_code == 401 and bad_key.value.code == "invalid_api_key"

    async with httpx.AsyncClient(base_url=http_server.http_url or "") as http:
        no_key = await http.post("/v1/chat/completions", json=chat)
        assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == "Bearer"
        assert no_key.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        form = await http.post(
            "/v1/chat/completions", content=b'{"model": ', headers={**auth, "content-type": "text/plain"}
        )
        assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
        bad_json = await http.post("/v1/chat/completions", content=b'{"model": ', headers=auth)
        assert bad_json.status_code == 400
        assert bad_json.json()["error"] == {
            "message": bad_json.json()["error"]["message"], "type": "invalid_request_error",
            "param": None, "code": "E_PROTO_001",
        }  # fmt: skip
        too_big = await http.post("/v1/completions", content=b"x" * (2 << 20), headers=auth)
        assert too_big.status_code == 413
        unknown = await http.get("/v2/anything", headers=auth)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        wrong_method = await http.get("/v1/chat/completions", headers=auth)
        assert wrong_method.status_code == 405

    # Nothing of the above reached the decode loop; the refusals are counted by code
    # (unknown paths and methods are not).
    snapshot = http_server.metrics_snapshot()
    assert snapshot["requests"] == {"interactive": {}, "background": {}}
    assert snapshot["errors"] == {
        "model_not_found": 1, "invalid_request_error": 2, "E_PROTO_002": 1,
        "invalid_api_key": 2, "E_PROTO_001": 1, "E_PROTO_004": 1, "unsupported_media_type": 1,
    }  # fmt: skip


async def test_lanes_from_header_field_and_service_tier(http_server: Server) -> None:
    client = async_client(http_server)
    chat: dict[str, Any] = {"model": MODEL, "messages": STORY, "max_tokens": 2, "temperature": 0}
    await client.chat.completions.create(**chat, extra_headers={"X-Uma-Priority": "background"})
    await client.chat.completions.create(**chat, extra_body={"priority": "background"})
    await client.chat.completions.create(**chat, service_tier="flex")
    await client.chat.completions.create(**chat)
    async with httpx.AsyncClient(base_url=http_server.http_url or "") as http:
        headers = {"authorization": f"Bearer {KEY}", "x-uma-priority": "background"}
        body = {"prompt": "Hi", "max_tokens": 2, "stream": False, "temperature": 0}
        assert (await http.post("/generate", json=body, headers=headers)).status_code == 200
    requests = http_server.metrics_snapshot()["requests"]
    assert requests == {"interactive": {"length": 1}, "background": {"length": 4}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": STORY, "n": 2}),
        ("/v1/messages", {"messages": STORY}),
        ("/v1/responses", {"input": "Write a long story about a dragon.", "max_output_tokens": 300}),
    ],
)
async def test_priority_finds_a_stream_by_its_request_id(
    http_server: Server, path: str, body: dict[str, Any]
) -> None:
    """/priority takes the X-Request-Id every endpoint answers with: with n > 1 it moves every
    choice; Anthropic's and the Responses API's ids were the daemon's own, and a 404."""
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        request = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 300, "temperature": 0, "stream": True}
        async with http.stream("POST", path, json=request | body) as response:
            assert response.status_code == 200
            rid = response.headers["x-request-id"]

            def mine() -> list[dict[str, Any]]:
                return [r for r in http_server.metrics_snapshot()["in_flight"] if r["id"].startswith(rid)]

            async for _ in response.aiter_lines():
                if len(mine()) == body.get("n", 1):  # every choice started (the others after the first)
                    moved = await http.post("/priority", json={"id": rid, "priority": "background"})
                    assert moved.status_code == 200, moved.text
                    assert {r["lane"] for r in mine()} == {"background"}
                    break
            else:
                raise AssertionError("the request ended before all its choices were seen in flight")
        await wait_until_idle(http_server)


async def test_a_move_before_the_later_choices_start_moves_them_too(http_server: Server) -> None:
    """Scheduler review: with n > 1 the later choices start once choice 0's first token is
    out; a /priority move that came before that moved choice 0 only, and the others were
    created in the lane the request first asked for (HTTP.md: it moves every choice)."""
    auth = {"authorization": f"Bearer {KEY}", "x-uma-priority": "background"}
    long_story = [{"role": "user", "content": "Write a long story about a dragon. " * 40}]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": long_story, "n": 3, "max_tokens": 40}
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        streamed = body | {"stream": True, "seed": 3}
        async with http.stream("POST", "/v1/chat/completions", json=streamed) as response:
            assert response.status_code == 200
            rid = response.headers["x-request-id"]  # choice 0 is admitted; its prompt is being read
            in_flight = [r for r in http_server.metrics_snapshot()["in_flight"] if r["id"].startswith(rid)]
            assert len(in_flight) == 1  # the move comes before the other choices exist
            moved = await http.post("/priority", json={"id": rid, "priority": "interactive"})
            assert moved.status_code == 200, moved.text
            lanes: dict[str, str] = {}
            async for _ in response.aiter_lines():
                for r in http_server.metrics_snapshot()["in_flight"]:
                    if r["id"].startswith(rid):
                        lanes[r["id"]] = r["lane"]
        assert len(lanes) == 3 and set(lanes.values()) == {"interactive"}, lanes
        await wait_until_idle(http_server)


async def test_every_whole_answer_carries_its_request_id(http_server: Server) -> None:
    """Found by review: whole answers with n > 1, /generate's and Ollama's came without the
    X-Request-Id HTTP.md promises for every answer (streamed ones had it)."""
    auth = {"authorization": f"Bearer {KEY}"}
    chat = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 2, "temperature": 0, "stream": False}
    short = {"num_predict": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "messages": STORY, "n": 2}),
        ("/v1/completions", {**chat, "prompt": "Once upon a time", "n": 2}),
        ("/v1/chat/completions", {**chat, "messages": STORY}),
        ("/generate", {"id": "whole-1", "prompt": "Hi", "max_tokens": 2, "stream": False}),
        ("/api/chat", {"model": chat["model"], "messages": STORY, "stream": False, "options": short}),
        ("/api/generate", {"model": chat["model"], "prompt": "Hi", "stream": False, "options": short}),
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        for path, body in cases:
            answer = await http.post(path, json=body)
            assert answer.status_code == 200, (path, answer.text)
            assert answer.headers.get("x-request-id"), (path, body)
        whole = await http.post("/generate", json=cases[3][1])
        assert whole.headers["x-request-id"] == "whole-1"


async def test_generate_sse_and_priority(http_server: Server) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        body = {"id": "g1", "messages": STORY, "max_tokens": 300, "temperature": 0}
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(openai_json(line))
                if len(events) == 2:
                    moved = await http.post("/priority", json={"id": "g1", "priority": "background"})
                    assert moved.status_code == 200
                    in_flight = http_server.metrics_snapshot()["in_flight"]
                    assert [r["lane"] for r in in_flight if r["id"] == "g1"] == ["background"]
                    cancel = await http.post("/priority", json={"id": "nobody", "priority": "background"})
                    assert cancel.status_code == 404 and cancel.json()["error"]["code"] == "E_PROTO_007"
                    twin = await http.post("/generate", json={**body, "stream": False})
                    assert twin.status_code == 409 and twin.json()["error"]["code"] == "E_PROTO_006"
                    break
        await wait_until_idle(http_server)
        assert [e["event"] for e in events] == ["token", "token"]
        assert events[0]["id"] == "g1"

        whole = await http.post(
            "/generate", json={"prompt": "Hello", "max_tokens": 3, "stream": False, "temperature": 0}
        )
        assert whole.status_code == 200
        eos = whole.json()
        assert eos["event"] == "eos" and eos["usage"]["completion_tokens"] == 3 and eos["text"]
    snapshot = http_server.metrics_snapshot()
    assert snapshot["lane_changes"] == 1 and snapshot["cancels"] == {"disconnect": 1}


def openai_json(line: str) -> dict[str, Any]:
    import json

    value: dict[str, Any] = json.loads(line.removeprefix("data: "))
    return value


async def test_socket_and_http_clients_share_batches(http_server: Server) -> None:
    """One socket stream and one HTTP stream at once: the metrics show both decoding in
    the same ticks (about two decode tokens per tick), not taking turns."""
    assert http_server.config.socket_path is not None
    n = 60
    before = http_server.metrics_snapshot()
    both_decoding: list[dict[str, Any]] = []

    async def socket_side() -> None:
        async with UmaClient.connect(http_server.config.socket_path) as client:
            async with client.stream(id="sock", messages=STORY, max_tokens=n, temperature=0) as events:
                async for event in events:
                    if isinstance(event, TokenEvent) and not both_decoding:
                        in_flight = http_server.metrics_snapshot()["in_flight"]
                        if sum(r["phase"] == "decode" for r in in_flight) == 2:
                            both_decoding.append({r["id"]: r for r in in_flight})

    async def http_side() -> None:
        stream = await async_client(http_server).chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=n, temperature=0, stream=True
        )
        async for _ in stream:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(http_side)
        nursery.start_soon(socket_side)
    after = http_server.metrics_snapshot()
    assert both_decoding, "the two requests never decoded at the same time"
    ids = set(both_decoding[0])
    assert "sock" in ids and any(i.startswith("chatcmpl-") for i in ids)
    decode_tokens = after["batch_tokens"]["decode"] - before["batch_tokens"]["decode"]
    ticks = after["ticks"] - before["ticks"]
    assert decode_tokens >= 2 * (n - 1)
    assert decode_tokens / ticks > 1.5, (decode_tokens, ticks)


async def test_shutdown_mid_stream_ends_http_streams_with_an_error_event(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", shutdown_grace_s=0) as server:
        stream = await async_client(server).chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=400, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError) as ended:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    server.request_shutdown()
        assert "shutdown" in ended.value.message
        async with httpx.AsyncClient(base_url=server.http_url or "") as http:
            health = await http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert server.metrics_snapshot()["cancels"] == {"shutdown": 1}


async def test_http_requests_in_flight_are_limited(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", max_connections=1) as server:
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=400, temperature=0, stream=True
        )
        async for _ in stream:
            break
        with pytest.raises(openai.RateLimitError) as busy:
            await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2)
        assert busy.value.code == "E_LIMIT_006" and busy.value.response.headers["retry-after"] == "1"
        await stream.close()
        await wait_until_idle(server)
        reply = await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 2


async def test_a_non_latin1_or_crlf_id_is_refused_and_leaks_nothing(http_server: Server) -> None:
    """Issue 17: a `/generate` id that is not latin-1 got a 500 after the request was
    registered; it was never released (its id then answered 409, four of them made every
    request 429).  Now the id is refused while decoding, before anything is registered."""
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
        for bad in ["日本-1", "a\r\nX-Injected: 1"] * 3:
            refused = await http.post("/generate", json={"id": bad, "prompt": "Hello", "max_tokens": 2})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "E_PROTO_002"
        assert http_server.metrics_snapshot()["in_flight"] == []
        fine = await http.post(
            "/generate",
            json={"id": "ok-1", "prompt": "Hello", "max_tokens": 2, "stream": False, "temperature": 0},
        )
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2


async def test_an_overlong_prompt_is_refused_before_it_is_tokenized(http_server: Server) -> None:
    """Issue 17: a prompt was tokenized whole before its length was checked.  No token is
    longer than the vocabulary's longest, so past limit × that many bytes it is refused
    unread, with the limit in the message."""
    longest = http_server.engine.max_token_bytes
    assert 8 <= longest <= 256
    limit = http_server.config.max_prompt_tokens
    calls = 0
    real = http_server.engine.tokenize

    def counting(text: str) -> Any:
        nonlocal calls
        calls += 1
        return real(text)

    http_server.engine.tokenize = counting  # type: ignore[method-assign]
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=http_server.http_url or "", headers=auth) as http:
            huge = "a" * (limit * longest + 1)
            refused = await http.post("/generate", json={"prompt": huge, "max_tokens": 2, "stream": False})
            assert (
                refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
            ), refused.text
            assert refused.json()["error"]["param"] == "prompt"  # it was null
            assert calls == 0
            fine = await http.post("/generate", json={"prompt": "Hello", "max_tokens": 2, "stream": False})
            assert fine.status_code == 200 and calls == 1
    finally:
        del http_server.engine.tokenize


async def test_a_request_abandoned_right_after_it_was_sent_is_cancelled(http_server: Server) -> None:
    """An editor sends a completion per keystroke and drops the last one at once.  Hung up
    before its answer began, such a request could run to its end for nobody (a review: 10
    of 20 `/infill` requests ran 48 tokens each, `/v1/completions` alike): the hang-up was
    taken by the watcher around its admission (test_http_hardening.py)."""
    assert http_server.http_url is not None
    host, port = http_server.http_url.removeprefix("http://").rsplit(":", 1)

    async def keystroke(i: int) -> None:
        body = json.dumps({"model": MODEL, "prompt": f"def f{i}(", "max_tokens": 48, "stream": i % 2 == 0})
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        client = await trio.open_tcp_stream(host, int(port))
        await client.send_all(request)
        await trio.sleep(0.002 * (i % 6))  # hang-ups from before its admission to after it
        await client.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(24):
            nursery.start_soon(keystroke, i)
            await trio.sleep(0.03)  # the next keystroke, the one before still on its way in
    await trio.sleep(0.5)  # the last ones reach the loop (or not)
    with trio.fail_after(60):
        while http_server.loop.gauges()["in_flight"]:
            await trio.sleep(0.05)
    snapshot = http_server.metrics_snapshot()
    ran = {k: v for k, v in snapshot["requests"]["interactive"].items() if k in ("stop", "length")}
    assert not any(ran.values()), (ran, snapshot["cancels"])  # none ran on for nobody
