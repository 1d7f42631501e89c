"""Review 17, the Anthropic and Responses routes: what Claude Code and Codex send (max_tokens
past --max-tokens, system blocks, thinking, replayed items) and the errors they read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from starlette.requests import Request

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.http.responses import http_error_response, unexpected_error_response
from uma_trio.http.responses_api import ResponsesApi
from uma_trio.protocol import anthropic as anth
from uma_trio.protocol import responses_api as resp
from uma_trio.protocol.messages import EosEvent, ErrorEvent, Timings, Usage
from uma_trio.protocol.openai import ApiError
from uma_trio.runtime.server import Server

from .conftest import API_KEY, openai_sdk, running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK: list[Any] = [{"role": "user", "content": "Write a long story about a dragon."}]
CAP = 8  # the daemon's --max-tokens here


@pytest.fixture
async def server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(
        llama_model, server_config, http="127.0.0.1:0", api_key=API_KEY, max_tokens=CAP
    ) as srv:
        yield srv


def sdk(server: Server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key=API_KEY, max_retries=0)


# -- 1. max_tokens is a ceiling ---------------------------------------------------------


@pytest.mark.model
async def test_claude_code_s_max_tokens_is_cut_to_the_daemon_s(server: Server) -> None:
    async with sdk(server) as client:
        # Non-streaming, the SDK refuses more than ~21000 itself (it would take too long).
        whole = await client.messages.create(
            model=MODEL, messages=ASK, max_tokens=16000, extra_body={"temperature": 0}
        )
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == CAP
        async with client.messages.stream(
            model=MODEL, messages=ASK, max_tokens=32000, extra_body={"temperature": 0}
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == CAP


def test_max_tokens_is_cut_to_the_room_the_context_leaves() -> None:
    from uma_trio.protocol.ollama import Limits

    body = anth.MessagesBody(model="m", messages=ASK, max_tokens=32000)
    request = anth.messages_request(body, "r", limits=Limits(max_tokens=2048, context=1024))
    assert (request.max_tokens, request.max_context) == (2048, 1024)


# -- 2. text blocks are paragraphs -------------------------------------------------------


def test_text_blocks_are_joined_as_paragraphs() -> None:
    system = [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "You are…"}]
    user = [{"type": "text", "text": "<system-reminder>x</system-reminder>"}, {"type": "text", "text": "hi"}]
    body = anth.MessagesBody(
        model="m", system=system, messages=[{"role": "user", "content": user}], max_tokens=4
    )
    turns = anth.messages_request(body, "r").messages or []
    assert turns[0].content == "You are Claude Code.\n\nYou are…"
    assert turns[1].content == "<system-reminder>x</system-reminder>\n\nhi"
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    asked = resp.ResponsesBody(model="m", input=[{"role": "user", "content": parts}])
    assert (resp.responses_request(asked, "r", None)[0].messages or [])[0].content == "a\n\nb"


# -- 3. a Responses stream that fails midway --------------------------------------------


async def test_a_responses_stream_failing_midway_ends_with_response_failed() -> None:
    async def failing(flight: object) -> AsyncIterator[object]:
        yield ErrorEvent(id="r", code="E_RUNTIME_001", message="decode failed")

    gateway = SimpleNamespace(_beating_events=failing)
    flight = SimpleNamespace(stream=SimpleNamespace(tool_format=None))
    api = ResponsesApi(gateway)  # type: ignore[arg-type]
    body = resp.ResponsesBody(model="m", input="hi")
    chunks = [c async for c in api._events(flight, body, "resp_1", 0)]  # type: ignore[arg-type]
    last = json.loads(chunks[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.failed"
    event = openai.types.responses.ResponseFailedEvent.model_validate(last)
    assert event.response.status == "failed" and event.response.error is not None
    assert event.response.error.code == "server_error" and "decode failed" in event.response.error.message


async def test_a_responses_stream_cut_by_the_shutdown_says_the_daemon_s_code() -> None:
    """HTTP.md: the failed response's message begins with the daemon's code.  A stream cut by
    the shutdown's grace (or a stalled reader) said only "the request was cancelled"."""

    async def cut(flight: object) -> AsyncIterator[object]:
        yield EosEvent(
            id="r",
            reason="cancelled",
            usage=Usage(1, 0, 1),
            timings=Timings(queue_ms=0.0, total_ms=1.0),
            cancel_reason="shutdown",
        )

    api = ResponsesApi(SimpleNamespace(_beating_events=cut))  # type: ignore[arg-type]
    flight = SimpleNamespace(stream=SimpleNamespace(tool_format=None))
    chunks = [c async for c in api._events(flight, resp.ResponsesBody(model="m", input="hi"), "resp_1", 0)]  # type: ignore[arg-type]
    last = openai.types.responses.ResponseFailedEvent.model_validate(
        json.loads(chunks[-1].split(b"data: ", 1)[1])
    )
    assert last.response.error is not None
    assert (
        last.response.error.message.startswith("E_LIMIT_008: ") and "shutdown" in last.response.error.message
    )


# -- 4. Codex's replayed input ------------------------------------------------------------


def test_replayed_items_keep_one_assistant_turn_and_one_system_turn() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    body = resp.ResponsesBody(model="m", instructions="inst", input=items)
    turns = resp.responses_request(body, "r", None)[0].messages or []
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool"]
    assert turns[0].content == "inst\n\ndev" and turns[2].content == "Looking."
    calls = turns[2].tool_calls or []
    # 6. arguments sent as an object are its JSON text, never a Python repr
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Oslo"}


# -- 5. errors on Anthropic's paths in Anthropic's shape -----------------------------------


@pytest.mark.model
async def test_errors_outside_the_route_come_in_anthropic_s_shape(server: Server) -> None:
    async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
        ask = {"model": MODEL, "messages": ASK, "max_tokens": 4}
        bad = await http.post("/v1/messages", json=ask, headers={"x-api-key": "wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        keyed = {"x-api-key": API_KEY}
        missing = await http.post("/v1/messages/nope", json=ask, headers=keyed)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        wrong = await http.get("/v1/messages", headers=keyed)
        assert wrong.status_code == 405 and wrong.json()["type"] == "error"
        openai_bad = await http.post("/v1/chat/completions", json=ask, headers={"x-api-key": "wrong"})
        assert openai_bad.json()["error"]["code"] == "invalid_api_key"


async def test_a_bug_on_an_anthropic_path_is_an_api_error() -> None:
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": [], "query_string": b""}
    answer = await unexpected_error_response(Request(scope), RuntimeError("bug"))
    assert msgspec.json.decode(answer.body)["error"]["type"] == "api_error"
    assert http_error_response  # the 404/405 handler: checked on the daemon above
    too_large = ApiError(413, "too large")
    too_large.shape = "anthropic"
    assert too_large.body()["error"]["type"] == "request_too_large"


# -- 6, 7, 8. inputs checked by the client's own fields; thinking accepted ------------------


@pytest.mark.model
async def test_bad_anthropic_inputs_are_refused_by_their_own_names(server: Server) -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": "Oslo"}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"messages": [*ASK, {"role": "assistant", "content": [use]}]}, "input"),
        ({"messages": ASK, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool"),
        ({"messages": ASK, "stop_sequences": [""]}, "stop_sequences[0]"),
    ]
    async with sdk(server) as client:
        for fields, named in refused:
            messages = fields.pop("messages")
            with pytest.raises(anthropic.BadRequestError) as error:
                await client.messages.create(model=MODEL, messages=messages, max_tokens=4, extra_body=fields)
            assert named in error.value.body["error"]["message"]  # type: ignore[index]


@pytest.mark.model
async def test_max_output_tokens_0_names_max_output_tokens(server: Server) -> None:
    async with openai_sdk(server) as client:
        with pytest.raises(openai.BadRequestError) as error:
            await client.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    assert error.value.param == "max_output_tokens"


@pytest.mark.model
async def test_thinking_and_replayed_thinking_blocks_are_accepted(server: Server) -> None:
    thought = [
        {"type": "thinking", "thinking": "Hmm.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "text", "text": "Once upon a time"},
    ]
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": thought},
        {"role": "user", "content": "Go on."},
    ]
    async with sdk(server) as client:
        answer = await client.messages.create(
            model=MODEL,
            messages=history,
            max_tokens=16000,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")


def test_a_tool_s_image_is_a_placeholder_and_a_user_s_is_refused() -> None:
    """Claude Code's Read tool returns an image file as an image block in a tool_result: refused,
    it stayed in the history and every later request of the session got the same 400."""
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.png"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [picture, {"type": "text", "text": "a.png"}],
    }
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    body = anth.MessagesBody(model="m", messages=history, max_tokens=4)
    turns = anth.messages_request(body, "r").messages or []
    assert turns[-1].role == "tool"
    assert turns[-1].content == "[image omitted: this model reads text only]\n\na.png"
    looked = [*ASK[:0], {"role": "user", "content": [picture]}]
    with pytest.raises(ApiError, match="'image' block is not supported"):
        anth.messages_request(anth.MessagesBody(model="m", messages=looked, max_tokens=4), "r")
