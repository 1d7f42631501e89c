"""OpenAI's Responses API, stateless (issue 21, point 3), through the official openai SDK."""

from __future__ import annotations

from typing import Any

import msgspec
import openai
import pydantic
import pytest

from uma_trio.runtime.server import Server

from .conftest import openai_sdk

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
INSTRUCTIONS = "You are a helpful assistant."
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


async def test_responses_whole_and_streamed(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="What is the capital of France?",
            max_output_tokens=24, temperature=0, store=False,
        )  # fmt: skip
        assert whole.status in ("completed", "incomplete") and "Paris" in whole.output_text
        assert whole.usage is not None and whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
        async with client.responses.stream(
            model=MODEL, instructions=INSTRUCTIONS, input="What is the capital of France?",
            max_output_tokens=24, temperature=0, store=False,
        ) as stream:  # fmt: skip
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == whole.output_text == final.output_text
        async with client.responses.stream(
            model=MODEL, instructions=INSTRUCTIONS, input="What is the capital of France?",
            max_output_tokens=3, temperature=0, store=False,
        ) as stream:  # fmt: skip
            kinds = [e.type async for e in stream]
            cut = await stream.get_final_response()
        # OpenAI ends a cut answer with response.incomplete, but the SDK's get_final_response
        # then raises ("Didn't receive a response.completed event", openai 3.57): the answer's
        # status says it instead.
        assert kinds[-1] == "response.completed"
        assert cut.status == "incomplete" and cut.incomplete_details is not None


async def test_a_forced_function_call_and_its_output(keyed_http_server: Server) -> None:
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with openai_sdk(keyed_http_server) as client:
        called = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input=ask, tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required", temperature=0, max_output_tokens=80, store=False,
        )  # fmt: skip
        call = next(item for item in called.output if item.type == "function_call")
        assert call.name == "get_weather" and call.call_id
        pydantic.TypeAdapter(dict[str, str]).validate_json(call.arguments)
        async with client.responses.stream(
            model=MODEL, instructions=INSTRUCTIONS, input=ask, tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required", temperature=0, max_output_tokens=80, store=False,
        ) as stream:  # fmt: skip
            arguments = [e.delta async for e in stream if e.type == "response.function_call_arguments.delta"]
            final = await stream.get_final_response()
        assert "".join(arguments) == call.arguments
        assert [i.type for i in final.output] == [i.type for i in called.output]
        # Stateless: the whole conversation again, with the call and its output.
        earlier = {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        }
        follow = [*ask, earlier, {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        answered = await client.responses.create(model=MODEL, input=follow, max_output_tokens=16, store=False)  # type: ignore[arg-type]
        assert answered.output
        with pytest.raises(openai.BadRequestError) as stored:
            await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
        assert stored.value.param == "previous_response_id"


def test_function_calls_cut_off_by_max_output_tokens_are_incomplete() -> None:
    from uma_trio.protocol.messages import EosEvent, Timings, ToolCall, ToolCallFunction, Usage
    from uma_trio.protocol.responses_api import ResponsesBody, response_object

    call = ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Oslo"}'))
    usage, timings = Usage(3, 70, 73), Timings(0.0, 1.0)
    cut = EosEvent(id="r", reason="length", usage=usage, timings=timings, tool_calls=[call])
    body = msgspec.convert({"model": MODEL, "input": "Weather in Oslo?"}, ResponsesBody)
    answer = response_object("resp_1", 0, body, [], cut)
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
