"""OpenAI's deprecated function calling (``functions``, ``function_call``, ``role: function``):
served as tools and answered in the old shape, through the official SDK on the real model.
A history in the old shape was a 400 ("a message needs text `content`"), ``functions`` "not
supported" and ``function_call`` silently ignored."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai
import pytest

from uma_trio.protocol.openai import ChatBody, translate
from uma_trio.protocol.openai_errors import ApiError
from uma_trio.runtime.server import Server

from .conftest import openai_sdk

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": WEATHER}
BOTH: dict[str, Any] = {"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"}
UNCALLED = {"role": "function", "name": "get_weather", "content": "x"}
USER_CALL = {"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {"role": "function", "name": "get_weather", "content": "Sunny, 21 C"},
]


def _translated(**fields: Any) -> Any:
    body = msgspec.convert({"model": MODEL, "messages": ASK, **fields}, ChatBody)
    return translate(body, request_id="chatcmpl-x", lane_header=None, max_tokens_limit=64)


def test_functions_become_one_call_tools_and_a_legacy_history_becomes_calls_and_results() -> None:
    done = _translated(functions=[WEATHER], function_call={"name": "get_weather"}, messages=HISTORY)
    request = done.request
    assert done.legacy_functions and request.parallel_tool_calls is False
    assert [t.function.name for t in request.tools or ()] == ["get_weather"]
    assert request.tool_choice is not None and request.tool_choice.function.name == "get_weather"  # type: ignore[union-attr]
    call, result = (request.messages or [])[1:]
    assert call.tool_calls and call.tool_calls[0].function.name == "get_weather"
    assert (
        result.role == "tool"
        and result.tool_call_id == call.tool_calls[0].id
        and result.name == "get_weather"
    )
    assert not _translated(
        tools=[{"type": "function", "function": WEATHER}], messages=HISTORY
    ).legacy_functions


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"functions": [WEATHER], "tools": [TOOL]}, "functions", "not both"),
        ({"function_call": "auto"}, "function_call", "needs `functions`"),
        (BOTH, "function_call", "not both"),
        ({"functions": [WEATHER], "function_call": "sometimes"}, "function_call", '"none", "auto"'),
        ({"functions": ["get_weather"]}, "functions[0]", "an object"),
        ({"functions": [WEATHER], "function_call": {"name": "nope"}}, "function_call", "nope"),
        ({"messages": [*ASK, UNCALLED]}, "messages[1]", "before"),
        ({"messages": [*ASK, {"role": "function", "content": "x"}]}, "messages[1].name", "`name`"),
        ({"messages": [USER_CALL]}, "messages[0].function_call", "only an assistant"),
    ],
)  # fmt: skip
def test_what_the_old_fields_cannot_mean_is_a_400_naming_them(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ApiError) as refused:
        _translated(**fields)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.body()
    assert words in refused.value.message


@pytest.mark.model
async def test_the_sdk_gets_a_function_call_whole_and_streamed(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        forced: dict[str, Any] = {"functions": [WEATHER], "function_call": {"name": "get_weather"}}
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=60,
            **forced,  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
        call = choice.message.function_call
        assert (
            call is not None
            and call.name == "get_weather"
            and isinstance(json.loads(call.arguments)["city"], str)
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=60,
            stream=True,
            **forced,  # type: ignore[arg-type]
        )
        name, arguments, finish = "", "", None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            assert not delta.tool_calls
            if delta.function_call is not None:
                name += delta.function_call.name or ""
                arguments += delta.function_call.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (finish, name, json.loads(arguments)) == (
            "function_call",
            call.name,
            json.loads(call.arguments),
        )

        # The old history is read: the result answers the call, and the model goes on from it.
        after = await client.chat.completions.create(
            model=MODEL, messages=HISTORY, functions=[WEATHER], function_call="none",  # type: ignore[arg-type, list-item]
            temperature=0, max_tokens=12,
        )  # fmt: skip
        assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.content
        assert after.choices[0].message.function_call is None
        longer = await client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=1)  # type: ignore[arg-type]
        shorter = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)  # type: ignore[arg-type]
        assert longer.usage and shorter.usage
        assert longer.usage.prompt_tokens > shorter.usage.prompt_tokens + 10  # the call and its result are in

        with pytest.raises(openai.BadRequestError) as refused:  # completions have no functions
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_body={"functions": [WEATHER]}
            )
        assert "functions" in str(refused.value)
