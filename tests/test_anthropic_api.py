"""Anthropic's Messages API (issue 21, point 2) through the official ``anthropic`` SDK,
unchanged, against the gateway on the default model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pydantic
import pytest

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .conftest import API_KEY, running_server

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM = "You are a helpful assistant."
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more; the API still takes them
ASK: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


class WeatherInput(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=30)


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WeatherInput.model_json_schema(),
}


@pytest.fixture
async def server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", api_key=API_KEY) as srv:
        yield srv


def sdk(server: Server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key=API_KEY, max_retries=0)


async def test_messages_whole_and_streamed(server: Server) -> None:
    async with sdk(server) as client:
        whole = await client.messages.create(
            model=MODEL, system=SYSTEM, messages=ASK, max_tokens=24, extra_body=GREEDY
        )
        assert whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens")
        assert whole.content[0].type == "text" and "Paris" in whole.content[0].text
        assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
        assert whole._request_id == whole.id  # the SDK reads Anthropic's request-id header
        async with client.messages.stream(
            model=MODEL, system=SYSTEM, messages=ASK, max_tokens=24, extra_body=GREEDY
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == whole.content[0].text
        # Anthropic's input_tokens leaves out what the cache read: the prompt is the sum.
        assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0

        def prompt(usage: anthropic.types.Usage) -> int:
            return usage.input_tokens + (usage.cache_read_input_tokens or 0)

        assert (
            prompt(final.usage) == prompt(whole.usage) and final.usage.input_tokens < whole.usage.input_tokens
        )
        counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
        assert counted.input_tokens == prompt(whole.usage)


async def test_a_stop_sequence_is_named_as_the_reason(server: Server) -> None:
    async with sdk(server) as client:
        ask = {"model": MODEL, "system": SYSTEM, "messages": ASK, "max_tokens": 24, "extra_body": GREEDY}
        whole = await client.messages.create(**ask, stop_sequences=["Paris", "Lyon"])
        assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "Paris")
        assert whole.content[0].type == "text" and "Paris" not in whole.content[0].text
        async with client.messages.stream(**ask, stop_sequences=["Paris"]) as stream:
            final = await stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")
        ended = await client.messages.create(**ask, stop_sequences=["Lyon"])
        assert ended.stop_reason in ("end_turn", "max_tokens") and ended.stop_sequence is None


async def test_a_forced_tool_use_whole_and_streamed(server: Server) -> None:
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with sdk(server) as client:
        used = await client.messages.create(
            model=MODEL, system=SYSTEM, messages=ask, max_tokens=80, extra_body=GREEDY,
            tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
        )  # fmt: skip
        assert used.stop_reason == "tool_use"
        block = next(b for b in used.content if b.type == "tool_use")
        assert block.name == "get_weather" and block.id.startswith("toolu_")
        WeatherInput.model_validate(block.input)
        async with client.messages.stream(
            model=MODEL, system=SYSTEM, messages=ask, max_tokens=80, extra_body=GREEDY,
            tools=[WEATHER], tool_choice={"type": "any"},  # type: ignore[list-item]
        ) as stream:  # fmt: skip
            final = await stream.get_final_message()
        streamed = next(b for b in final.content if b.type == "tool_use")
        assert final.stop_reason == "tool_use" and streamed.input == block.input
        # The result goes back as a tool_result block, and the conversation goes on.
        result = {"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}
        follow: list[Any] = [
            *ask,
            {"role": "assistant", "content": used.content},
            {"role": "user", "content": [result]},
        ]
        answered = await client.messages.create(
            model=MODEL, system=SYSTEM, messages=follow, max_tokens=80, tools=[WEATHER], extra_body=GREEDY
        )  # type: ignore[list-item]
        assert answered.stop_reason in ("end_turn", "tool_use") and answered.content


async def test_a_stream_splits_its_prompt_from_message_start_on_and_names_its_request(server: Server) -> None:
    """Found by review: message_start counted the whole prompt as input_tokens while the end's
    usage left the cache read out (31 against 1 + 30), no ping came, and the request id was
    only in X-Request-Id, none on an error."""
    body = {"model": MODEL, "system": SYSTEM, "messages": ASK, "max_tokens": 4, "stream": True, **GREEDY}
    split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    headers = {"x-api-key": API_KEY}
    async with httpx.AsyncClient(base_url=str(server.http_url), headers=headers, timeout=60) as http:
        starts = []
        for _ in range(2):  # the second reads its prompt from the cache
            answer = await http.post("/v1/messages", json=body)
            lines = answer.text.splitlines()
            names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
            data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
            assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop", names
            start = data[0]["message"]["usage"]
            end = next(d for d in data if d["type"] == "message_delta")["usage"]
            assert {k: start[k] for k in split} == {k: end[k] for k in split}
            assert answer.headers["request-id"] == data[0]["message"]["id"]
            starts.append(start)
        assert starts[1]["cache_read_input_tokens"] > 0 and starts[0]["cache_read_input_tokens"] == 0
        assert sum(starts[0][k] for k in split) == sum(starts[1][k] for k in split)
        missing = await http.post("/v1/messages", json={**body, "model": "claude-opus-4"})
        assert missing.status_code == 404 and missing.headers["request-id"].startswith("req_")


async def test_errors_come_in_anthropic_s_shape(server: Server) -> None:
    async with sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError) as missing:
            await client.messages.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
                max_tokens=4,
            )  # type: ignore[list-item]
        assert missing.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "image" in json.dumps(missing.value.body)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-opus-4", messages=ASK, max_tokens=4)
    async with anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model=MODEL, messages=ASK, max_tokens=4)
    async with httpx.AsyncClient(base_url=str(server.http_url)) as http:  # no key: name Anthropic's header
        keyless = await http.post("/v1/messages", json={"model": MODEL, "messages": ASK, "max_tokens": 4})
        assert keyless.status_code == 401 and "x-api-key" in keyless.json()["error"]["message"]


def test_refusals_name_anthropic_s_fields_and_required_text_is_required() -> None:
    """Found by review: a message without content and a text block without text were read
    as empty turns (Anthropic's API requires both); an empty stop sequence's message said
    `$.stop`, and a bad input_schema `tools[0].function.parameters`, fields never sent."""
    import msgspec

    from uma_trio.protocol.anthropic import MessagesBody, client_error, messages_request
    from uma_trio.protocol.openai_errors import ApiError, validation_error

    def refusal(**fields: Any) -> ApiError:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
        try:
            messages_request(msgspec.convert(body, MessagesBody), "r")
        except ApiError as exc:
            return exc
        except (msgspec.ValidationError, ValueError) as exc:
            return client_error(validation_error(exc))
        raise AssertionError(f"accepted: {fields}")

    no_content = refusal(messages=[{"role": "user"}])
    assert no_content.param == "messages[0].content" and "is required" in no_content.message
    no_text = refusal(messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert no_text.param == "messages[0].content[0].text" and "needs `text`" in no_text.message
    untexted_system = refusal(system=[{"type": "text"}])
    assert untexted_system.param == "system[0].text"
    empty_stop = refusal(stop_sequences=[""])
    assert empty_stop.param == "stop_sequences[0]" and "$.stop[" not in empty_stop.message
    schema = refusal(tools=[{"name": "f", "input_schema": "x"}])
    assert schema.param == "tools[0].input_schema" and "function" not in schema.message
    # Found by review: is_error was dropped (a failed tool read as one that answered) and
    # mcp_servers accepted, though no tool of theirs would ever run.
    called = [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]
    failed = [{"type": "tool_result", "tool_use_id": "t1", "content": "no such city", "is_error": True}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": called}]
    body = {"model": MODEL, "max_tokens": 8, "messages": [*history, {"role": "user", "content": failed}]}
    tool_turn = messages_request(msgspec.convert(body, MessagesBody), "r").messages[-1]
    assert tool_turn.role == "tool" and tool_turn.content == "Error: no such city"
    odd = refusal(messages=[*history, {"role": "user", "content": [{**failed[0], "is_error": "yes"}]}])
    assert odd.param == "messages[2].content[0].is_error"
    assert refusal(mcp_servers=[{"type": "url", "url": "http://x"}]).param == "mcp_servers"


def test_tool_calls_cut_off_by_max_tokens_stop_for_max_tokens() -> None:
    """An answer whose calls max_tokens cut off said tool_use: a client then ran the calls
    it had and never learnt that the answer was incomplete (Anthropic says max_tokens)."""
    from uma_trio.protocol.anthropic import stop_reason
    from uma_trio.protocol.messages import EosEvent, Timings, ToolCall, ToolCallFunction, Usage

    call = ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Oslo"}'))
    ended = {"id": "r", "usage": Usage(3, 70, 73), "timings": Timings(0.0, 1.0), "tool_calls": [call]}
    assert stop_reason(EosEvent(reason="length", **ended)) == "max_tokens"
    assert stop_reason(EosEvent(reason="stop", **ended)) == "tool_use"


def test_a_system_message_among_the_messages_is_a_system_turn_where_it_stands() -> None:
    """Claude Code (2.1.332) sends its environment as a ``system`` message after the user's
    prompt; one right after ``system`` joins it (templates take one system message, first)."""
    import msgspec

    from uma_trio.protocol.anthropic import MessagesBody, messages_request
    from uma_trio.protocol.openai_errors import ApiError

    environment = [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "system", "content": environment},
    ]  # fmt: skip
    body = msgspec.convert(
        {"model": MODEL, "system": SYSTEM, "messages": messages, "max_tokens": 8}, MessagesBody
    )
    turns = messages_request(body, "r").messages or []
    assert [(t.role, t.content) for t in turns] == [
        ("system", f"{SYSTEM}\n\nBe brief."), ("user", "hi"), ("system", "# Environment"),
    ]  # fmt: skip
    odd = [{"role": "system", "content": [{"type": ["text"]}]}]  # was a 500: an unhashable type
    with pytest.raises(ApiError, match="block is not supported") as unhashable:
        messages_request(
            msgspec.convert({"model": MODEL, "messages": odd, "max_tokens": 8}, MessagesBody), "r"
        )
    assert unhashable.value.status == 400
    tool = {"role": "tool", "content": "x"}
    with pytest.raises(ApiError, match="must be user, assistant or system") as refused:
        messages_request(
            msgspec.convert({"model": MODEL, "messages": [tool], "max_tokens": 8}, MessagesBody), "r"
        )
    assert refused.value.param == "messages[0].role"


def test_anthropic_s_own_tools_are_left_out_and_a_client_tool_needs_its_schema() -> None:
    """Found by review: web_search_20250305 (run on Anthropic's side) and bash_20250124 (a schema
    only Anthropic knows) were shown to the model as client tools, which then called a tool the
    client never runs; a tool with no input_schema was taken."""
    import msgspec

    from uma_trio.protocol.anthropic import MessagesBody, messages_request
    from uma_trio.protocol.openai_errors import ApiError

    def request(tools: list[dict[str, Any]], choice: dict[str, Any] | None = None) -> Any:
        fields = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                  "tools": tools, "tool_choice": choice}  # fmt: skip
        return messages_request(msgspec.convert(fields, MessagesBody), "r")

    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    bash = {"type": "bash_20250124", "name": "bash"}
    weather = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    shown = request([search, bash, weather], {"type": "any"}).tools
    assert [t.function.name for t in shown] == ["get_weather"]
    assert request([search, bash]).tools is None
    with pytest.raises(ApiError, match="only Anthropic's own") as forced:
        request([search], {"type": "any"})
    assert forced.value.param == "tool_choice"
    with pytest.raises(ApiError) as schemaless:
        request([{"name": "f"}])
    assert schemaless.value.status == 400 and schemaless.value.param == "tools[0].input_schema"


class Capital(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=40)
    confident: bool


async def test_structured_output_through_output_config_and_parse(server: Server) -> None:
    """Anthropic's structured output (``output_config.format``, the beta's ``output_format``)
    was ignored: the SDK's ``messages.parse`` got free text and failed to validate it."""
    async with sdk(server) as client:
        parsed = await client.messages.parse(
            model=MODEL, messages=ASK, max_tokens=80, output_format=Capital, extra_body=GREEDY
        )
        assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Capital)
        fmt = {"type": "json_schema", "schema": Capital.model_json_schema()}
        beta = await client.messages.create(
            model=MODEL, messages=ASK, max_tokens=80, extra_body={"output_format": fmt, **GREEDY}
        )
        assert beta.content[0].type == "text"
        Capital.model_validate_json(beta.content[0].text)
        for extra, field in (
            ({"output_config": {"format": {"type": "json"}}}, "output_config.format"),
            ({"output_format": fmt, "output_config": {"format": fmt}}, "not both"),
            ({"output_format": {"type": "json_schema", "schema": {"type": "frob"}}}, "frob"),
        ):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=extra)
            assert field in str(refused.value)


async def test_an_answer_with_no_text_has_no_block_whole_or_streamed(server: Server) -> None:
    """Found by review: a forced call cut off by max_tokens (no call whole, no text) came
    back whole as one empty text block, streamed as none; Anthropic sends no empty block."""
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    cut: dict[str, Any] = {"model": MODEL, "messages": ask, "max_tokens": 5, "extra_body": GREEDY,
                           "tools": [WEATHER], "tool_choice": {"type": "any"}}  # fmt: skip
    async with sdk(server) as client:
        whole = await client.messages.create(**cut)
        async with client.messages.stream(**cut) as stream:
            streamed = await stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert whole.content == streamed.content == []


async def test_a_tool_schema_that_does_not_compile_is_named_as_sent(server: Server) -> None:
    """Found by review: the refusal named `tools[1].function.parameters`, the translated
    request's field, where the client sent `tools[1].input_schema`."""
    broken = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}
    async with sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(
                model=MODEL, messages=ASK, max_tokens=8, tools=[WEATHER, broken],  # type: ignore[list-item]
                tool_choice={"type": "tool", "name": "f"},
            )  # fmt: skip
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    assert "`tools[1].input_schema`: Pointer '/nope'" in message and "function" not in message
