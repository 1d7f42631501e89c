"""Ollama's native API (issue 21, point 1) through the official ``ollama`` Python client,
unchanged, against the gateway on the default model."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import openai
import pydantic
import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ConfigError, ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .conftest import running_server

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture
async def open_server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    """The gateway without a key: Ollama's clients send none."""
    async with running_server(llama_model, server_config, http="127.0.0.1:0") as server:
        yield server


def client(server: Server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=str(server.http_url))


async def test_the_model_is_listed_shown_and_running(open_server: Server) -> None:
    api = client(open_server)
    listed = await api.list()
    assert [m.model for m in listed.models] == [MODEL]
    assert listed.models[0].size and listed.models[0].details and listed.models[0].details.format == "gguf"
    shown = await api.show(MODEL)
    assert shown.modelinfo and shown.modelinfo["llama.context_length"] == open_server.loop.engine.n_ctx_seq
    assert shown.capabilities and "completion" in shown.capabilities and "insert" not in shown.capabilities
    running = await api.ps()
    assert running.models[0].model == MODEL and running.models[0].expires_at is not None
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        assert (await http.get("/")).text == "Ollama is running"
        assert (await http.get("/api/version")).json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        await api.show("llama3:8b")
    assert missing.value.status_code == 404 and "llama3:8b" in missing.value.error


async def test_chat_whole_and_streamed(open_server: Server) -> None:
    api = client(open_server)
    whole = await api.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 24})
    assert whole.done and whole.done_reason in ("stop", "length") and "Paris" in (whole.message.content or "")
    assert (
        whole.prompt_eval_count
        and whole.eval_count
        and whole.total_duration
        and whole.eval_duration is not None
    )
    greedy = {"temperature": 0, "num_predict": 24}
    parts = [part async for part in await api.chat(model=MODEL, messages=ASK, stream=True, options=greedy)]
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    # num_ctx caps this request's context; it never reloads the model.
    capped = await api.chat(
        model=MODEL, messages=ASK, options={"temperature": 0, "num_ctx": whole.prompt_eval_count + 3}
    )
    assert capped.eval_count is not None and capped.eval_count <= 3 and capped.done_reason == "length"


async def test_chat_with_a_schema_and_with_tools(open_server: Server) -> None:
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    api = client(open_server)
    structured = await api.chat(
        model=MODEL,
        messages=ASK,
        format=City.model_json_schema(),
        options={"temperature": 0, "num_predict": 64},
    )
    City.model_validate_json(structured.message.content or "")

    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
          city: The city's name
        """
        return "sunny"

    called = await api.chat(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[get_weather],
        options={"temperature": 0, "num_predict": 80},
    )  # fmt: skip
    message = called.message
    assert message.tool_calls or message.content  # the model chose (auto); either way it parsed
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "get_weather"
        assert isinstance(message.tool_calls[0].function.arguments, dict)
    # The tool's answer goes back as a `tool` message, and the conversation goes on.
    follow: list[Any] = [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]  # fmt: skip
    answered = await api.chat(model=MODEL, messages=follow, options={"temperature": 0, "num_predict": 16})
    assert answered.done


async def test_generate_raw_templated_and_errors(open_server: Server) -> None:
    api = client(open_server)
    question, system = "What is the capital of France?", "You are a helpful assistant."
    templated = await api.generate(
        model=MODEL, prompt=question, system=system, options={"temperature": 0, "num_predict": 24}
    )
    assert "Paris" in (templated.response or "") and templated.done
    raw = await api.generate(model=MODEL, prompt="The capital of France is", raw=True,
                             options={"temperature": 0, "num_predict": 8})  # fmt: skip
    assert raw.prompt_eval_count is not None and raw.prompt_eval_count < (templated.prompt_eval_count or 0)
    pieces = await api.generate(
        model=MODEL,
        prompt="The capital of France is",
        raw=True,
        stream=True,
        options={"temperature": 0, "num_predict": 8},
    )
    streamed = [p async for p in pieces]
    assert "".join(p.response or "" for p in streamed) == raw.response
    with pytest.raises(ollama.ResponseError) as no_fim:
        await api.generate(model=MODEL, prompt="def f(", suffix="):\n", options={"num_predict": 4})
    assert no_fim.value.status_code == 400 and "fill-in-the-middle" in no_fim.value.error
    with pytest.raises(ollama.ResponseError) as images:
        await api.generate(model=MODEL, prompt="What is this?", images=[b"\x89PNG"])
    assert images.value.status_code == 400 and "images" in images.value.error
    loaded = await api.generate(model=MODEL, prompt="")  # Ollama's "load the model" call
    assert loaded.done and loaded.done_reason == "load"
    # Ollama's -1s: a random seed, and penalties over the whole context (both were 400s).
    minus_one = await api.generate(
        model=MODEL,
        prompt="Hi",
        options={"seed": -1, "repeat_last_n": -1, "repeat_penalty": 1.1, "num_predict": 4},
    )
    assert minus_one.done and 0 < minus_one.eval_count <= 4  # sampled: it may end sooner
    chat_loaded = await api.chat(model=MODEL, messages=[])  # /api/chat's, the same
    assert chat_loaded.done and chat_loaded.done_reason == "load" and chat_loaded.message.content == ""
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        bad = await http.post("/api/chat", json={"model": MODEL, "messages": "hi"})
        assert bad.status_code == 400 and isinstance(bad.json()["error"], str)
        # A refusal of an option names it as sent, not as the daemon's field (`$.temperature`).
        for options, words in [
            ({"temperature": -1}, "`$.options.temperature`"),
            ({"stop": [""]}, "`$.options.stop[0]`"),
            ({"num_ctx": 2.5}, "options.num_ctx must be a whole number"),
        ]:  # fmt: skip
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": options}
            refused = await http.post("/api/chat", json=body)
            assert refused.status_code == 400 and words in refused.json()["error"], refused.text


async def test_ollama_openai_and_socket_clients_share_the_daemon_under_the_guard(open_server: Server) -> None:
    """Issue 21: under a background socket request prefilling a long prompt, an Ollama
    /api/chat client and an OpenAI client stream beside it.  They start before it ends, and
    the guard keeps their token gaps far under the stall the prefill would be in one piece
    (seconds here: 1,500 tokens on this CPU)."""
    long_prompt = "Summarize this text. " + "The quick brown fox jumps over the lazy dog. " * 150
    story = [ASK[0], {"role": "user", "content": "Write a long story about a dragon."}]
    times: dict[str, list[float]] = {"ollama": [], "openai": [], "background": []}

    async def background() -> None:
        async with UmaClient.connect(open_server.config.socket_path) as socket_client:
            async with socket_client.stream(prompt=long_prompt, max_tokens=48, temperature=0.0,
                                            priority="background") as events:  # fmt: skip
                async for _event in events:
                    times["background"].append(trio.current_time())

    async def ollama_chat() -> None:
        async for _ in await client(open_server).chat(
            model=MODEL, messages=story, stream=True, options={"temperature": 0, "num_predict": 48}
        ):
            times["ollama"].append(trio.current_time())

    async def openai_chat() -> None:
        sdk = openai.AsyncOpenAI(base_url=f"{open_server.http_url}/v1", api_key="none", max_retries=0)
        async with sdk:
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=story, stream=True, max_tokens=48, temperature=0
            )  # type: ignore[arg-type]
            async for _ in stream:
                times["openai"].append(trio.current_time())

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(background)
            await trio.sleep(0.3)  # the long prompt is being prefilled by now
            nursery.start_soon(ollama_chat)
            nursery.start_soon(openai_chat)
    for name in ("ollama", "openai"):
        stamps = times[name]
        gaps = sorted(b - a for a, b in itertools.pairwise(stamps[1:-1]))  # token chunks only
        assert stamps[0] < times["background"][0], name  # not queued behind the background's prefill
        assert len(gaps) >= 30, (name, len(gaps))
        assert gaps and gaps[int(0.95 * (len(gaps) - 1))] < 0.25, (name, gaps[-5:])


async def test_ollama_on_a_port_of_its_own(llama_model: LlamaModel, server_config: ServerConfig) -> None:
    """``--ollama PORT`` serves the same API on a second address (Ollama's own port, for apps
    that look there); alone it starts the gateway too; a bad value is a start-up error."""
    async with running_server(llama_model, server_config, http="127.0.0.1:0", ollama="127.0.0.1:0") as both:
        assert len(both.http_urls) == 2 and both.http_urls[0] == both.http_url
        listed = await ollama.AsyncClient(host=both.http_urls[1]).list()
        assert [m.model for m in listed.models] == [MODEL]
    async with running_server(llama_model, server_config, ollama="127.0.0.1:0") as alone:
        assert alone.http_url is not None
        assert (await ollama.AsyncClient(host=alone.http_url).list()).models
    with pytest.raises(ConfigError, match="--ollama"):
        ServerConfig(ollama="localhost:eleven")


def test_minus_one_means_what_ollama_and_llama_server_say() -> None:
    from uma_trio.protocol import ollama as protocol
    from uma_trio.protocol.llama_server import InfillBody, infill_request

    body = protocol.ChatBody(
        model="m", messages=[protocol.OllamaMessage(role="user", content="hi")],
        options=protocol.Options(seed=-1, repeat_last_n=-1),
    )  # fmt: skip
    for request in (
        protocol.chat_request(body, "r1"),
        infill_request(
            InfillBody(input_prefix="def f(", input_suffix=")", seed=-1, repeat_last_n=-1), "r2", 128
        ),
    ):
        assert request.seed is None and request.repeat_last_n == protocol.WHOLE_CONTEXT


def test_unset_options_take_ollama_s_defaults_not_the_socket_s() -> None:
    """Found by review: with no options, /api/chat sampled with the socket's top_p 0.95 and
    min_p 0.05; Ollama's are 0.9 and 0 (its DefaultOptions; no penalty, as its Go sampler)."""
    from uma_trio.protocol import ollama as protocol

    def request(**options: Any) -> Any:
        messages = [protocol.OllamaMessage(role="user", content="hi")]
        body = protocol.GenerateBody(model="m", prompt="hi", options=protocol.Options(**options))
        chat = protocol.ChatBody(model="m", messages=messages, options=protocol.Options(**options))
        return protocol.generate_request(body, "g"), protocol.chat_request(chat, "c")

    for unset in request():
        assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p) == (0.8, 40, 0.9, 0.0)
        assert unset.repeat_penalty == 1.0
    for sent in request(top_p=0.5, min_p=0.1, top_k=7, temperature=0.2, repeat_penalty=1.1):
        assert (sent.temperature, sent.top_k, sent.top_p, sent.min_p, sent.repeat_penalty) == (
            0.2,
            7,
            0.5,
            0.1,
            1.1,
        )


async def test_refusals_before_a_route_come_in_each_api_s_shape(open_server: Server) -> None:
    """Found by review: a 403 (Host, Origin), a 415 and Starlette's 404/405 under /api/ came as
    OpenAI's error object (the ollama client raised its dict's repr), and /v1/messages' 403
    and 415 as OpenAI's too."""
    with pytest.raises(ollama.ResponseError) as unserved:
        await client(open_server).delete(MODEL)  # /api/delete: not served
    assert unserved.value.status_code == 404 and unserved.value.error.startswith("DELETE /api/delete")
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        for answer in (
            await http.post("/api/tags"),  # 405
            await http.post("/api/chat", content=b"{}", headers={"content-type": "text/plain"}),
            await http.post("/api/chat", json={}, headers={"host": "evil.example"}),
        ):
            assert answer.status_code in (403, 405, 415) and isinstance(answer.json()["error"], str), (
                answer.text
            )
        for headers in ({"content-type": "text/plain"}, {"origin": "https://evil.example"}):
            refused = await http.post("/v1/messages", content=b"{}", headers=headers)
            assert refused.status_code in (403, 415) and refused.json()["type"] == "error", refused.text
        openai_shape = await http.post(
            "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}
        )
        assert (
            openai_shape.status_code == 415
            and openai_shape.json()["error"]["code"] == "unsupported_media_type"
        )


async def test_a_format_schema_gives_only_the_keys_it_lists_as_ollama_s(open_server: Server) -> None:
    """Ollama (llama.cpp's converter) closes an object schema that lists its properties; here it
    was left open, and at temperature 1 the default model wrote keys of its own (`{"a": 1, "b":
    2, "c": 2}` for a schema naming `a`), which could run on to num_predict as invalid JSON."""

    class Answer(pydantic.BaseModel):  # model_json_schema() leaves additionalProperties unsaid
        a: int

    api = client(open_server)
    for seed in range(4):
        reply = await api.chat(
            model=MODEL, messages=[{"role": "user", "content": "Give JSON with many keys."}],
            format=Answer.model_json_schema(), options={"num_predict": 40, "temperature": 1.0, "seed": seed},
        )  # fmt: skip
        assert reply.done_reason == "stop" and set(json.loads(reply.message.content or "")) == {"a"}, reply


async def test_a_request_without_a_model_is_ollama_s_400(open_server: Server) -> None:
    """`"model": ""` served the default model and answered `"model": ""`; `/api/show {}`
    described the default model.  Ollama answers 400 `model is required`; with no `model` at
    all too (it said "Object missing required field `model`"), and on the embedding routes."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": False}
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        for path, body in [
            ("/api/generate", {"prompt": "hi", "stream": False}),
            ("/api/chat", chat),
            ("/api/embed", {"input": "hi"}),
            ("/api/embeddings", {"prompt": "hi"}),
            ("/api/show", {}),
        ]:
            for named in ({}, {"model": ""}):
                answer = await http.post(path, json={**body, **named})
                assert (answer.status_code, answer.json()) == (400, {"error": "model is required"}), (
                    path,
                    named,
                )
        shown = await http.post("/api/show", json={"name": MODEL})  # Ollama's older field still names it
        assert shown.status_code == 200
