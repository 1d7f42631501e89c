"""Ollama's /api/chat: a history longer than the context loses its oldest messages instead
of being refused (``truncate``, on by default), and a streamed chat offered tools streams
its text as it comes, the calls in a chunk of their own.  Pure parts first, then the
official ``ollama`` client (raw JSON where it cannot send a field) on the default model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.chat_truncate import cut_points, fewest_dropped, kept
from uma_trio.protocol.messages import ChatMessage, EosEvent, Timings, ToolCall, ToolCallFunction, Usage
from uma_trio.protocol.ollama_stream import ToolChatLines
from uma_trio.runtime.server import Server

from .conftest import running_server
from .helpers import taught_to_call

MODEL = "SmolLM2-135M-Instruct.Q4_1"
N_CTX = 128
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def turn(role: str, content: str = "", **fields: Any) -> ChatMessage:
    return ChatMessage(role=role, content=content, **fields)


CALL = [ToolCall(id="c1", function=ToolCallFunction("get_weather", '{"city": "Rome"}'))]


# -- pure: which messages go ------------------------------------------------------------


def test_cuts_keep_the_system_messages_the_last_one_and_a_result_with_its_call() -> None:
    chat = [
        turn("system", "s"), turn("user", "u1"), turn("assistant", tool_calls=CALL),
        turn("tool", "r1"), turn("tool", "r2"), turn("system", "s2"), turn("user", "u2"),
        turn("assistant", tool_calls=CALL), turn("tool", "r3"),
    ]  # fmt: skip
    # Never between a call and its results; the last result comes with its call.
    assert cut_points(chat) == [1, 2, 6, 7]
    assert [m.content for m in kept(chat, 7)] == ["s", "s2", "", "r3"]
    assert [m.content for m in kept(chat, 2)] == ["s", "", "r1", "r2", "s2", "u2", "", "r3"]
    # An orphan result (its call already gone) may be cut at itself.
    assert cut_points([turn("tool", "r"), turn("user", "u")]) == [0, 1]


def test_the_fewest_messages_are_dropped_in_a_logarithmic_number_of_measures() -> None:
    chat = [turn("system", "s"), *(turn("user" if i % 2 else "assistant", "x" * 10) for i in range(200))]
    measured: list[int] = []

    def measure(messages: list[ChatMessage]) -> int:
        measured.append(len(messages))
        return sum(len(m.content) for m in messages)

    found = fewest_dropped(chat, measure, lambda size: size <= 501, first=1)
    assert found is not None
    messages, size = found
    assert messages[0].content == "s" and len(messages) == 51 and size == 501
    assert messages[-1] is chat[-1] and len(measured) <= 9  # log2(200) + 1
    assert fewest_dropped(chat, measure, lambda size: size < 10) is None  # the last alone is too long
    # A cut the template cannot render counts as too long.
    unrendered = fewest_dropped(chat, lambda ms: None if len(ms) > 2 else 0, lambda size: True)
    assert unrendered is not None and unrendered[0] == [chat[0], chat[-1]]


# -- pure: the streamed lines of a chat offered tools ------------------------------------


def eos(content: str, calls: list[ToolCall] | None = None) -> EosEvent:
    return EosEvent(
        id="r", reason="stop", usage=Usage(5, 9, 14), timings=Timings(queue_ms=0, total_ms=1),
        content=content, tool_calls=calls,
    )  # fmt: skip


def test_hermes_text_streams_until_a_call_and_the_call_comes_in_its_own_chunk() -> None:
    lines = ToolChatLines(MODEL, "hermes")
    pieces = ["Sure", ", let", " me check.", "\n<tool", "_call>\n", '{"name": "get_weather"}', "</tool_call>"]
    streamed = [chunk for piece in pieces for chunk in lines.token(piece, None)]
    assert [c.message.content for c in streamed] == ["Sure", ", let", " me check."]  # type: ignore[union-attr]
    *calls, final = lines.end(eos("Sure, let me check.", CALL))
    assert len(calls) == 1 and not calls[0].done
    assert calls[0].message.tool_calls == [  # type: ignore[union-attr]
        {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    ]
    # The last line says nothing again: clients add the chunks up.
    assert final.done and final.message.content == "" and not final.message.tool_calls  # type: ignore[union-attr]
    assert final.eval_count == 9 and final.prompt_eval_count == 5


def test_a_generic_answer_s_text_streams_and_its_calls_are_held() -> None:
    """A generic answer was held whole to its end; its text now streams as it decodes."""
    lines = ToolChatLines(MODEL, "generic")
    streamed = [c for piece in ['{"response": ', '"h', 'i"}'] for c in lines.token(piece, None)]
    assert [c.message.content for c in streamed] == ["h", "i"]  # type: ignore[union-attr]
    (final,) = lines.end(eos("hi"))
    assert final.done and final.message.content == ""  # type: ignore[union-attr]
    calls = ToolChatLines(MODEL, "generic")
    pieces = ['{"tool_calls": [{"name": "f", ', '"arguments": {}}]}']
    assert [c for piece in pieces for c in calls.token(piece, None)] == []


# -- on the daemon: truncation ------------------------------------------------------------


@pytest.fixture
async def small_server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", n_ctx=N_CTX) as server:
        yield server


def long_history() -> list[dict[str, str]]:
    """A system message, twelve exchanges (well past N_CTX tokens) and a question."""
    chat = [SYSTEM]
    for i in range(12):
        chat += [
            {"role": "user", "content": f"Tell me fact number {i} about the sea."},
            {"role": "assistant", "content": f"Fact {i}: the sea is deep, salty and full of fish."},
        ]
    return [*chat, {"role": "user", "content": "What colour is the sky?"}]


def fitted_count(model: LlamaModel, chat: list[dict[str, str]], limit: int) -> int:
    """The prompt tokens of the chat with the fewest oldest exchanges dropped that fits in
    ``limit``, the system message kept: one render per candidate, as an oracle."""
    rest = chat[1:]
    for k in range(len(rest)):
        if (count := len(model.tokenize_chat([chat[0], *rest[k:]]))) <= limit:
            return count
    raise AssertionError("the last message alone does not fit")


async def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
        return await http.post(
            "/api/chat", content=json.dumps(body), headers={"content-type": "application/json"}
        )


@pytest.mark.model
async def test_a_history_past_the_context_loses_its_oldest_messages(
    small_server: Server, llama_model: LlamaModel
) -> None:
    chat, api = long_history(), ollama.AsyncClient(host=str(small_server.http_url))
    assert len(llama_model.tokenize_chat(chat)) > 2 * N_CTX  # overflows: this was a 400
    greedy = {"temperature": 0, "num_predict": 4}
    answer = await api.chat(model=MODEL, messages=chat, options=greedy)
    assert answer.done and answer.eval_count and answer.message.content
    # The fewest messages dropped, room for an answer token, and the system message kept
    # (without it the count would differ: SmolLM2's template then adds its own).
    assert answer.prompt_eval_count == fitted_count(llama_model, chat, N_CTX - 1)
    without_system = len(llama_model.tokenize_chat(chat[-2:]))
    assert answer.prompt_eval_count != without_system
    # num_ctx below the model's context: it bounds the prompt too, streamed the same.
    chunks = [
        c
        async for c in await api.chat(
            model=MODEL, messages=chat, options={**greedy, "num_ctx": 64}, stream=True
        )
    ]
    assert chunks[-1].done and chunks[-1].prompt_eval_count == fitted_count(llama_model, chat, 63)
    # truncate false: refused as before.
    body = {"model": MODEL, "messages": chat, "stream": False, "options": greedy}
    refused = await post(small_server, {**body, "truncate": False})
    assert refused.status_code == 400 and "context" in refused.json()["error"]


@pytest.mark.model
async def test_a_prompt_too_long_alone_keeps_its_start_and_its_end_as_ollama_cuts_it(
    small_server: Server, llama_model: LlamaModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Ollama review: a last message too long alone, and any /api/generate prompt past the
    context, was a 400 where Ollama cuts the prompt's middle and answers (its runner keeps the
    first num_keep tokens, 4, and the last).  Now so here, leaving room for the answer:
    num_predict's tokens, at most half the context; ``truncate: false`` still refuses."""
    caplog.set_level("WARNING", logger="uma_trio.runtime.intake")
    api = ollama.AsyncClient(host=str(small_server.http_url))
    text = "The sea is deep and the sea is wide. " * 40 + "What colour is the sky?"
    assert len(llama_model.tokenize(text)) > 2 * N_CTX
    chat = await api.chat(model=MODEL, messages=[SYSTEM, {"role": "user", "content": text}],
                          options={"temperature": 0, "num_predict": 8})  # fmt: skip
    assert chat.done and chat.eval_count and chat.prompt_eval_count == N_CTX - 8
    raw = await api.generate(model=MODEL, prompt=text, raw=True, options={"temperature": 0, "num_predict": 8})
    assert raw.done and raw.eval_count and raw.prompt_eval_count == N_CTX - 8
    # With no num_predict the answer may take half the context; the prompt the other half.
    templated = await api.generate(model=MODEL, prompt=text, options={"temperature": 0})
    assert templated.done and templated.prompt_eval_count == N_CTX // 2
    # What was kept: the first four tokens and the end, the question with it; the log says so.
    cut = f"truncating its prompt of {len(llama_model.tokenize(text))} tokens to {N_CTX - 8} (the first 4"
    assert cut in caplog.text
    # Past what any tokens could be (--max-prompt-tokens' bytes): cut the same way, not refused unread.
    huge = "x" * 400_000 + " What colour is the sky?"  # more than 4,096 tokens' bytes, under 1 MiB
    big = await api.generate(model=MODEL, prompt=huge, raw=True, options={"num_predict": 2})
    assert big.done and big.prompt_eval_count == N_CTX - 2
    async with httpx.AsyncClient(base_url=str(small_server.http_url), timeout=60) as http:
        body = {"model": MODEL, "prompt": text, "raw": True, "stream": False, "truncate": False}
        refused = await http.post("/api/generate", json=body)
        # A context of one cell holds no prompt and answer: refused, not cut to nothing (an
        # empty prompt stopped the whole daemon: review).
        one_cell = await http.post(
            "/api/generate", json={**body, "truncate": True, "options": {"num_ctx": 1}}
        )
        chat_one = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                    "options": {"num_ctx": 1}}  # fmt: skip
        chat_one_cell = await http.post("/api/chat", json=chat_one)
    assert refused.status_code == 400 and "context" in refused.json()["error"]
    assert one_cell.status_code == 400 and "no room for an answer" in one_cell.json()["error"], one_cell.text
    assert chat_one_cell.status_code == 400, chat_one_cell.text
    assert (
        small_server.loop.accepting
        and (await api.generate(model=MODEL, prompt="hi", options={"num_predict": 2})).done
    )


# -- on the daemon: a streamed chat offered tools ----------------------------------------


@pytest.fixture
async def hermes_server(model_path: Path, server_config: ServerConfig) -> AsyncIterator[Server]:
    """The default model with Qwen 2.5's chat template, which renders tools (the Hermes
    family): its calls are read from ``<tool_call>`` blocks, and plain text can stream."""
    model = LlamaModel(model_path)
    try:
        model.use_chat_template((TEMPLATES / "qwen2.5-instruct.jinja").read_text())
        async with running_server(model, server_config, http="127.0.0.1:0") as server:
            yield server
    finally:
        model.close()


async def streamed(server: Server, **fields: Any) -> list[ollama.ChatResponse]:
    api = ollama.AsyncClient(host=str(server.http_url))
    return [chunk async for chunk in await api.chat(model=MODEL, stream=True, **fields)]


@pytest.mark.model
async def test_a_streamed_chat_with_tools_streams_its_text(hermes_server: Server) -> None:
    chunks = await streamed(
        hermes_server, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        tools=[WEATHER], options={"temperature": 0, "num_predict": 24},
    )  # fmt: skip
    said = [c.message.content for c in chunks[:-1] if c.message.content]
    assert len(said) > 1  # it came whole in the last line
    assert not any(c.message.tool_calls for c in chunks) and chunks[-1].eval_count == 24
    # The last line repeats nothing: a client adding the chunks up gets the answer once.
    assert chunks[-1].done and not chunks[-1].message.content


@pytest.mark.model
async def test_a_streamed_tool_call_comes_in_a_chunk_before_the_last(hermes_server: Server) -> None:
    """The history teaches the model to call (as tests/test_tool_calls.py's Hermes stream)."""
    messages = taught_to_call()
    fields: dict[str, Any] = dict(
        messages=messages, tools=[WEATHER], options={"temperature": 0, "num_predict": 60}
    )
    whole = await ollama.AsyncClient(host=str(hermes_server.http_url)).chat(model=MODEL, **fields)
    assert whole.message.tool_calls and whole.message.tool_calls[0].function.name == "get_weather"
    chunks = await streamed(hermes_server, **fields)
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and chunks[-1].done
    call = with_calls[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and "city" in call.function.arguments
    assert "<tool_call>" not in "".join(c.message.content or "" for c in chunks)  # the call is no text
