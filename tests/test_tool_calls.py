"""Tool calls (issue 20, point 2): the families' formats read back, the grammars that make a
model call a tool, and the whole round trip through the openai SDK, LangChain and the socket
on the default model (whose template cannot render tools: the generic format)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import numpy as np
import openai
import pydantic
import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.constraints import lark_constraint
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.sampling import SamplingParams
from uma_trio.protocol.messages import EosEvent, Timings, ToolCall, ToolCallFunction, Usage
from uma_trio.protocol.openai import ToolChatStream, chat_completion
from uma_trio.protocol.tool_text import ToolTextFilter, parse_tool_calls
from uma_trio.protocol.tools import NamedToolChoice, Tool, ToolFormat, tool_call_grammar, tool_format_of
from uma_trio.runtime.server import Server

from .conftest import API_KEY, openai_sdk, running_server
from .helpers import draw_until_end, grammar_accepts, taught_to_call

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


class WeatherArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=30)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WeatherArgs.model_json_schema(),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}
TOOLS = [msgspec.convert(WEATHER, Tool), msgspec.convert(TIME, Tool)]
NAMES = ["get_weather", "get_time"]
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris, in celsius?"},
]


# -- reading calls back ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        ("hermes",
         'Let me look.<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
         "Let me look.", [("get_time", {"zone": "CET"})]),
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "A"}}</tool_call>\n'
                   '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>',
         "", [("get_time", {"zone": "A"}), ("get_weather", {"city": "B"})]),
        ("hermes", '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', []),
        ("llama3", '{"name": "get_time", "parameters": {"zone": "UTC"}}', "",
         [("get_time", {"zone": "UTC"})]),
        ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "",
         [("get_time", {"zone": "UTC"})]),
        ("llama3", "It is sunny.", "It is sunny.", []),
        ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "X"}}]', "",
         [("get_time", {"zone": "X"})]),
        ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}', "",
         [("get_weather", {"city": "Oslo"})]),
        ("generic", '{"response": "Hello!"}', "Hello!", []),
        # Cut off (max_tokens) inside the answer: its text, never the JSON around it.
        ("generic", '{"response": "Paris is', "Paris is", []),
        ("generic", '{"response": "a \\"b\\" \\u00e9t\\u00', 'a "b" \u00e9t', []),
        ("generic", '{"response": "done"', "done", []),
        ("generic", '{"tool_calls": [{"name": "get_weath', "", []),  # a call cut short: no JSON as content
        ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "A"}}, {"name": "get_t',
         "", [("get_time", {"zone": "A"})]),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"na', "", [("get_time", {})]),
        ("xml", "Let me look.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
                "</function>\n</tool_call>", "Let me look.", [("get_time", {"zone": "CET"})]),
        # Two calls, the second as Hermes' JSON (the block is the same).
        ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
                '<tool_call>\n{"name": "get_time", "arguments": {"zone": "A"}}\n</tool_call>',
         "", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "A"})]),
        ("xml", "<tool_call>\n<function=launch_rocket>\n</function>\n</tool_call>",
         "<tool_call>\n<function=launch_rocket>\n</function>\n</tool_call>", []),
        # Cut off (max_tokens) before </function>: not a whole call, so no call with half a value.
        ("xml", "<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Ber",
         "<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Ber", []),
    ],
)  # fmt: skip
def test_each_family_s_calls_are_read_back(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse_tool_calls(text, fmt, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_family_comes_from_the_template() -> None:
    assert tool_format_of((TEMPLATES / "qwen2.5-instruct.jinja").read_text()) == "hermes"
    assert tool_format_of((TEMPLATES / "qwen3.jinja").read_text()) == "hermes"
    # Qwen3-Coder's and Qwen 3.5's <tool_call> blocks hold XML; they were read as Hermes' JSON.
    assert tool_format_of((TEMPLATES / "qwen3-coder.jinja").read_text()) == "xml"
    assert tool_format_of((TEMPLATES / "qwen3.5.jinja").read_text()) == "xml"
    assert tool_format_of((TEMPLATES / "llama-3.1-instruct.jinja").read_text()) == "llama3"
    assert tool_format_of("{{ messages }}") == "generic"
    assert tool_format_of(None) == "generic"


@pytest.mark.parametrize(
    ("fmt", "pieces", "streamed"),
    [
        ("hermes", ["Sure", ". <tool", "_call>\n{", '"name"'], ["Sure", "."]),
        ("hermes", ["a <tool", "box> b"], ["a", " <toolbox> b"]),
        ("hermes", ["Hi \n", "there\n"], ["Hi", " \nthere"]),  # whitespace waits: it may be trimmed
        ("xml", ["Sure", ". <tool", "_call>\n<function=get_time>\n"], ["Sure", "."]),
        ("llama3", ['{"name"', ": 1}"], []),
        ("llama3", ["Hi {", "x}"], ["Hi {", "x}"]),
        ("generic", ['{"response": ', '"hi"}'], ["hi"]),
        ("generic", ['{"', 'tool_calls": [{"name": "get_time", ', '"arguments": {}}]}'], []),
    ],
)
def test_streamed_content_stops_where_a_call_may_start(
    fmt: ToolFormat, pieces: list[str], streamed: list[str]
) -> None:
    text_filter = ToolTextFilter(fmt)
    assert [out for piece in pieces if (out := text_filter.feed(piece))] == streamed


@pytest.mark.parametrize(
    "pieces",
    [
        ["Let me check.", "\n<tool_call>\n", '{"name": "get_time", "arguments": {"zone": "A"}}',
         "\n</tool_call>\n"],
        [" Hi", " there.\n", "<tool_call>", '{"name": "get_time", "arguments": {}}</tool_call>'],
        ["\n", "<tool_call>", '{"name": "get_time", "arguments": {}}</tool_call>\n', "Done. "],
    ],
)  # fmt: skip
def test_streamed_hermes_content_is_the_whole_answer_s(pieces: list[str]) -> None:
    """What a stream sends as it goes, and its rest at the end, make the content parsed from
    the whole answer: the text after a call was lost (sent only without calls), and the
    whitespace the parse strips was already sent."""
    text_filter = ToolTextFilter("hermes")
    streamed = "".join(text_filter.feed(piece) for piece in pieces)
    content, _ = parse_tool_calls("".join(pieces), "hermes", NAMES)
    assert streamed + text_filter.rest(content) == content


TRICKY = json.dumps({"response": 'He said "hi"\n\tthen left: caf\u00e9 \U0001f600 end'})


@pytest.mark.parametrize("cut", [len(TRICKY), len(TRICKY) - 2, 40, 31])
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_a_generic_direct_answer_streams_its_text_as_it_decodes(cut: int, step: int) -> None:
    """A generic answer was held whole to its end: an agent offering tools to a model whose
    template has none (the default model) saw no token until the last.  Its text now
    streams, an escape or a surrogate pair cut between tokens waiting for its end, and
    makes, with the rest, the content read from the whole answer (also one cut short)."""
    text = TRICKY[:cut]
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    text_filter = ToolTextFilter("generic")
    shown = [text_filter.feed(piece) for piece in pieces]
    content, calls = parse_tool_calls(text, "generic", NAMES)
    streamed = "".join(shown)
    assert not calls and streamed + text_filter.rest(content) == content
    assert content.startswith(streamed) and len([s for s in shown if s]) > 1
    assert all(not ("\ud800" <= c <= "\udfff") for c in streamed)
    assert text_filter.accounted == len(text) or not shown[-1]


@pytest.mark.parametrize(
    "text",
    [
        '{"response": "hi \\ud83d\\ude',  # cut between a pair's halves (max_tokens)
        '{"response": "hi \\ud83dx"}',  # a lone half, as a model may write one
        '{"response": "hi \\ud83d"}',
        '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "\\udc00"}}]}',
    ],
)
def test_a_lone_surrogate_in_a_generic_answer_can_still_be_sent(text: str) -> None:
    """A lone surrogate decoded from the answer's JSON (half a pair, cut or written so) made
    the content unencodable: no UTF-8 encoder takes one, and the answer failed to go out."""
    content, calls = parse_tool_calls(text, "generic", NAMES)
    msgspec.json.encode([content, [c.arguments for c in calls]])  # raised UnicodeEncodeError
    text_filter = ToolTextFilter("generic")
    streamed = "".join(text_filter.feed(c) for c in text)
    assert streamed + text_filter.rest(content) == content
    msgspec.json.encode(streamed)


@pytest.mark.parametrize(
    ("formatted", "pieces", "streamed"),
    [
        (True, ['{"', 'answer": ', "1}"], ['{"answer": ', "1}"]),
        (True, ['{"', 'tool_calls": [', "]}"], []),
        (True, ["[1", ", 2]"], ["[1", ", 2]"]),
        (False, ['{"', 'answer": ', "1}"], []),
    ],
)
def test_a_formatted_generic_answer_streams_as_it_comes(
    formatted: bool, pieces: list[str], streamed: list[str]
) -> None:
    text_filter = ToolTextFilter("generic", formatted)
    assert [out for piece in pieces if (out := text_filter.feed(piece))] == streamed
    content, _ = parse_tool_calls("".join(pieces), "generic", NAMES, formatted)
    assert "".join(streamed) + text_filter.rest(content) == content


# -- grammars -------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_under_the_grammar_any_draw_is_a_valid_call(
    llama_model: LlamaModel, fmt: ToolFormat, choice: str
) -> None:
    """Random logits sampled under each family's grammar always read back as calls of the
    offered tools whose arguments validate.  (One call each: random draws would rarely end a
    list of them.)"""
    chosen: Any = choice
    if choice == "named":
        chosen = msgspec.convert({"function": {"name": "get_weather"}}, NamedToolChoice)
    grammar = tool_call_grammar(fmt, TOOLS, chosen, parallel=False)
    assert grammar is not None
    assert (tool_call_grammar(fmt, TOOLS, "auto", parallel=True) is None) == (fmt != "generic")
    rng = np.random.default_rng(1)
    for seed in range(3):
        sampler = llama_model.vocabulary.sampler(
            SamplingParams(temperature=1.0, seed=seed), lark_constraint(grammar, "tools")
        )
        text = draw_until_end(llama_model, sampler, rng, limit=600, scale=3)
        content, calls = parse_tool_calls(text.decode(), fmt, NAMES)
        assert len(calls) == 1 and content == "", text
        for call in calls:
            assert choice != "named" or call.name == "get_weather"
            if call.name == "get_weather":
                WeatherArgs.model_validate_json(call.arguments)
            else:
                assert set(json.loads(call.arguments)) == {"zone"}


class Place(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=20)


class Trip(pydantic.BaseModel):
    """Nested models: pydantic writes them under "$defs", referenced as "#/$defs/Place"."""

    model_config = pydantic.ConfigDict(extra="forbid")
    start: Place
    stops: list[Place] = pydantic.Field(max_length=2)


TRIP = msgspec.convert(
    {"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}}, Tool
)
# A recursive definition: a list of lists of integers, or an integer.
NESTED = msgspec.convert(
    {"type": "function", "function": {"name": "nest", "parameters": {
        "type": "object", "properties": {"value": {"$ref": "#/$defs/node"}}, "required": ["value"],
        "additionalProperties": False,
        "$defs": {"node": {"anyOf": [{"type": "integer"}, {"type": "array", "maxItems": 2,
                                                            "items": {"$ref": "#/$defs/node"}}]}},
    }}},
    Tool,
)  # fmt: skip


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_tools_whose_schemas_use_defs_are_constrained_by_them(
    llama_model: LlamaModel, fmt: ToolFormat
) -> None:
    """A tool's "$ref": "#/$defs/..." pointed at the call grammar's root once the parameters
    were nested in it: every request offering such a tool (pydantic's nested models) was
    refused, "Pointer '/$defs/Place' does not exist"."""
    tools = [TRIP, NESTED]
    grammar = tool_call_grammar(fmt, tools, "required", parallel=False)
    assert grammar is not None
    rng = np.random.default_rng(2)
    for seed in range(3):
        sampler = llama_model.vocabulary.sampler(
            SamplingParams(temperature=1.0, seed=seed), lark_constraint(grammar, "tools")
        )
        text = draw_until_end(llama_model, sampler, rng, limit=800, scale=3)
        _, calls = parse_tool_calls(text.decode(), fmt, ["plan_trip", "nest"])
        assert len(calls) == 1, text
        if calls[0].name == "plan_trip":
            Trip.model_validate_json(calls[0].arguments)
        else:
            assert isinstance(json.loads(calls[0].arguments)["value"], int | list)


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 60}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}
FAMILY_CALLS: dict[ToolFormat, str] = {
    "hermes": f"<tool_call>\n{json.dumps(WEATHER_CALL)}\n</tool_call>\n",
    "llama3": json.dumps({"name": "get_weather", "parameters": WEATHER_CALL["arguments"]}),
    "mistral": "[TOOL_CALLS]" + json.dumps([WEATHER_CALL]),
    "generic": json.dumps({"tool_calls": [WEATHER_CALL]}),
    "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n",
}


@pytest.mark.parametrize("fmt", ["hermes", "xml", "llama3", "mistral", "generic"])
def test_with_a_response_format_the_answer_is_a_call_or_the_format(fmt: ToolFormat) -> None:
    """Tools with a response_format were refused (OpenAI takes both: the Agents SDK's
    output_type, codex exec --output-schema); the format is the direct answer's, and a
    forced call is not bound by it."""
    grammar = tool_call_grammar(fmt, TOOLS, "auto", parallel=True, answer=ANSWER)
    assert grammar is not None
    compiled = lark_constraint(grammar, "tools").grammar
    direct = '{"answer": "Sunny.", "confident": true}'
    assert grammar_accepts(compiled, FAMILY_CALLS[fmt]) and grammar_accepts(compiled, direct)
    assert not grammar_accepts(compiled, "It is sunny.")
    assert not grammar_accepts(compiled, '{"answer": "Sunny.", "confident": "yes"}')
    assert parse_tool_calls(direct, fmt, NAMES, formatted=True) == (direct, [])
    content, calls = parse_tool_calls(FAMILY_CALLS[fmt], fmt, NAMES, formatted=True)
    assert [c.name for c in calls] == ["get_weather"] and content == ""
    forced = tool_call_grammar(fmt, TOOLS, "required", parallel=True, answer=ANSWER)
    assert forced == tool_call_grammar(fmt, TOOLS, "required", parallel=True)
    # A formatted generic answer is the format's JSON as it is, even one shaped like
    # generic's own {"response": ...}, or holding a key named tool_calls.
    for own in ('{"response": "hi"}', '{"tool_calls": 3}', "[1, 2]"):
        assert parse_tool_calls(own, "generic", NAMES, formatted=True) == (own, [])
    # Cut by max_tokens before a call was whole: no content, never the call's start (it
    # leaked as '{"tool_' with a format).
    for cut in ('{"tool', '{"tool_calls":', '{"tool_calls": [{"name": "get_'):
        assert parse_tool_calls(cut, "generic", NAMES, formatted=True) == ("", [])


# -- end to end ------------------------------------------------------------------------


@pytest.mark.model
async def test_openai_sdk_required_tool_call_validates_and_streams_the_same(
    keyed_http_server: Server,
) -> None:
    async with openai_sdk(keyed_http_server) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",  # type: ignore[list-item]
            temperature=0, max_tokens=80,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and calls[0].id.startswith("call_") and calls[0].type == "function"
        assert calls[0].function.name in NAMES
        if calls[0].function.name == "get_weather":
            WeatherArgs.model_validate_json(calls[0].function.arguments)
        stream = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",  # type: ignore[list-item]
            temperature=0, max_tokens=80, stream=True,
        )  # fmt: skip
        assembled: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = assembled.setdefault(delta_call.index, {"name": "", "arguments": ""})
                entry["name"] += delta_call.function.name or "" if delta_call.function else ""
                entry["arguments"] += delta_call.function.arguments or "" if delta_call.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(e["name"], json.loads(e["arguments"])) for e in assembled.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]


@pytest.mark.model
async def test_named_auto_and_none_tool_choices(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        named = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )  # fmt: skip
        calls = named.choices[0].message.tool_calls
        assert calls and {c.function.name for c in calls} == {"get_time"}
        auto = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,  # type: ignore[list-item]
        )  # fmt: skip
        message = auto.choices[0].message
        assert message.tool_calls or message.content  # the model chose; either way it parsed
        assert auto.choices[0].finish_reason == ("tool_calls" if message.tool_calls else "stop")
        none = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8,  # type: ignore[list-item]
        )  # fmt: skip
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
        for bad, what in (
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
            ({"tool_choice": "required", "tools": []}, "required"),
            ({"extra_body": {"grammar": 'root ::= "a"'}}, "not both"),
        ):
            fields: dict[str, Any] = {"tools": [WEATHER], **bad}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
            assert what in str(refused.value)


@pytest.mark.model
async def test_a_hermes_template_renders_the_tools_and_its_calls_are_read(
    model_path: Path, server_config: ServerConfig
) -> None:
    """With a template that renders tools (Qwen 2.5's), the tools reach the prompt and the
    forced answer is a ``<tool_call>`` block the server reads back."""
    model = LlamaModel(model_path)
    try:
        model.use_chat_template((TEMPLATES / "qwen2.5-instruct.jinja").read_text())
        rendered = model.apply_chat_template(ASK, [WEATHER])
        assert "<tools>" in rendered and '"get_weather"' in rendered
        async with (
            running_server(model, server_config, http="127.0.0.1:0", api_key="k") as server,
            openai_sdk(server) as client,
        ):
            reply = await client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                tool_choice="required", temperature=0, max_tokens=80,
            )  # fmt: skip
            calls = reply.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather"
            WeatherArgs.model_validate_json(calls[0].function.arguments)
    finally:
        model.close()


@pytest.mark.model
async def test_the_socket_eos_carries_the_tool_calls(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        async with client.stream(
            messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80
        ) as events:  # fmt: skip
            last = [event async for event in events][-1]
    assert last.event == "eos" if hasattr(last, "event") else True
    assert getattr(last, "tool_calls", None), last
    WeatherArgs.model_validate_json(last.tool_calls[0].function.arguments)  # type: ignore[union-attr]


@pytest.mark.model
async def test_langchain_bind_tools_and_structured_output(keyed_http_server: Server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    class GetWeather(pydantic.BaseModel):
        """The current weather in a city."""

        city: str = pydantic.Field(max_length=30)

    class Answer(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=30)
        sunny: bool

    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{keyed_http_server.http_url}/v1",
        api_key="k",
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )
    # LangChain's async API needs asyncio: its sync API, in a thread.
    bound = llm.bind_tools([GetWeather], tool_choice="required")
    message = await trio.to_thread.run_sync(bound.invoke, "Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(message.tool_calls[0]["args"])
    parser = llm.with_structured_output(Answer, method="json_schema")
    structured = await trio.to_thread.run_sync(parser.invoke, "Is it sunny in Rome?")
    assert isinstance(structured, Answer)


@pytest.mark.model
async def test_the_cli_sends_tools_and_prints_the_calls(server: Server, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, TIME]))
    done = await trio.run_process(
        [sys.executable, "-m", "uma_trio", "generate", "--prompt", "Weather in Paris?", "--temp", "0",
         "--max-tokens", "80", "--tools", str(tools), "--tool-choice", "get_weather",
         "--socket", str(server.config.socket_path)],
        capture_stdout=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    calls = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert calls[0]["function"]["name"] == "get_weather"
    WeatherArgs.model_validate_json(calls[0]["function"]["arguments"])


@pytest.mark.model
async def test_n_choices_each_call_tools_whole_and_streamed(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        fields: dict[str, Any] = dict(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            n=2,
            temperature=0.8,
            seed=3,
            max_tokens=80,
        )
        whole = await client.chat.completions.create(**fields)
        assert [c.finish_reason for c in whole.choices] == ["tool_calls", "tool_calls"]
        stream = await client.chat.completions.create(**fields, stream=True)
        calls: dict[int, list[str]] = {0: [], 1: []}
        async for chunk in stream:
            for choice in chunk.choices:
                assert not choice.delta.content  # the call's text is never sent as content
                calls[choice.index] += [
                    c.function.name or "" for c in choice.delta.tool_calls or [] if c.function
                ]
        assert calls == {
            i: [c.function.name for c in whole.choices[i].message.tool_calls or []] for i in (0, 1)
        }


def test_a_generic_history_shows_the_model_its_calls_and_their_results(llama_model: LlamaModel) -> None:
    """The default model's template cannot render tools: an assistant turn that only called
    one rendered empty, and the model never saw its call."""
    from uma_trio.protocol.messages import GenerateRequest
    from uma_trio.runtime.tool_use import chat_turns

    request = msgspec.convert(
        {
            "id": "r",
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
                ]},
                {"role": "tool", "content": "rain, 7C", "tool_call_id": "c1", "name": "get_weather"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
            ],
        },
        GenerateRequest,
    )  # fmt: skip
    turns, no_tools = chat_turns(request, "generic", "generic")
    assert no_tools is None  # described in the system message instead
    called, answered = turns[2], turns[3]
    assert json.loads(called["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    assert json.loads(answered["content"]) == {
        "tool_response": {"tool": "get_weather", "content": "rain, 7C"}
    }
    prompt = llama_model.apply_chat_template([(t["role"], t["content"]) for t in turns])
    assert '"tool_calls"' in prompt and "rain, 7C" in prompt


OSLO_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}
    ]},
    {"role": "tool", "content": "rain, 7C", "tool_call_id": "c1", "name": "get_weather"},
]  # fmt: skip


@pytest.mark.model
@pytest.mark.parametrize("offered", [{}, {"tools": [WEATHER], "tool_choice": "none"}])
async def test_a_generic_history_shows_its_calls_without_tools_offered(
    server: Server, offered: dict[str, Any]
) -> None:
    """Sent without tools (or with ``tool_choice: none``), the earlier call was left to a
    template that cannot render it: the prompt had as many tokens as with an empty turn."""
    empty = [*OSLO_HISTORY[:1], {"role": "assistant", "content": ""}, *OSLO_HISTORY[2:]]
    async with UmaClient.connect(server.config.socket_path) as client:
        called = await client.complete(messages=OSLO_HISTORY, max_tokens=1, temperature=0, **offered)
        bare = await client.complete(messages=empty, max_tokens=1, temperature=0, **offered)
    # The call, its name and its arguments are in the prompt: a dozen tokens at least.
    assert called.eos.usage.prompt_tokens >= bare.eos.usage.prompt_tokens + 12


def test_calls_cut_off_by_max_tokens_finish_with_length() -> None:
    """Cut off inside the second call: the whole first one is kept, and finish_reason says
    ``length`` (it said ``tool_calls``, and the cut call vanished), whole and streamed.  (This
    ran on the real model until its answers stopped after one call: objects that list their
    properties are closed now, and the model no longer wrote keys of its own into a second.)"""
    first = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    cut = '{"tool_calls": [' + first + ', {"name": "get_weather", "argu'
    content, parsed = parse_tool_calls(cut, "generic", NAMES)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris"})
    ]
    calls = [
        ToolCall(id="call_1", function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in parsed
    ]
    eos = EosEvent(
        id="x",
        reason="length",
        usage=Usage(1, 70, 71),
        timings=Timings(0.0, 1.0),
        content=content,
        tool_calls=calls,
    )
    whole = chat_completion("c", 0, MODEL, eos)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.tool_calls == calls
    stream = ToolChatStream("c", 0, MODEL, False, "generic")
    chunks = [*stream.token(cut), *stream.end(eos)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [json.loads(t.function.arguments) for t in streamed] == [{"city": "Paris"}]


@pytest.mark.parametrize("cut", ["{", '{"', '{"to', '{"tool_calls"', '{"tool_calls":', ' { "tool_calls" : '])
def test_a_generic_answer_cut_before_its_first_call_shows_no_json(cut: str) -> None:
    """Cut off (max_tokens) before the list of calls had begun, the JSON written so far was
    the answer's content in every API (`{"tool_calls":` as the text of a message)."""
    assert parse_tool_calls(cut, "generic", NAMES) == ("", [])
    assert parse_tool_calls('{"resp', "generic", NAMES) == ("", [])
    assert parse_tool_calls('{"response": "Hel', "generic", NAMES) == ("Hel", [])
    assert parse_tool_calls("not json", "generic", NAMES) == ("not json", [])  # no grammar held it


@pytest.mark.model
async def test_a_forced_call_cut_short_leaks_no_json_in_any_api(keyed_http_server: Server) -> None:
    """tool_choice required / any, max_tokens 5: the answer ends before any call is whole."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ask = [{"role": "user", "content": "Forecast Paris"}]
    async with openai_sdk(keyed_http_server) as client:
        tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=ask,
            tools=[tool],
            tool_choice="required",
            max_tokens=5,  # type: ignore[list-item]
        )
        assert chat.choices[0].finish_reason == "length"
        assert not chat.choices[0].message.content and not chat.choices[0].message.tool_calls
        tool_r = {"type": "function", "name": "forecast", "parameters": schema}
        response = await client.responses.create(
            model=MODEL,
            input="Forecast Paris",
            tools=[tool_r],
            tool_choice="required",
            max_output_tokens=5,  # type: ignore[list-item]
        )
        assert response.status == "incomplete" and "{" not in response.output_text, response.output
    claude = anthropic.AsyncAnthropic(base_url=str(keyed_http_server.http_url), api_key="k", max_retries=0)
    tool_a = {"name": "forecast", "input_schema": schema}
    message = await claude.messages.create(
        model=MODEL,
        max_tokens=5,
        messages=ask,
        tools=[tool_a],
        tool_choice={"type": "any"},  # type: ignore[list-item,arg-type]
    )
    assert message.stop_reason == "max_tokens"
    assert all(block.type != "text" or not block.text for block in message.content), message.content


@pytest.mark.model
async def test_a_tool_stream_carries_the_logprobs_of_the_whole_answer(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Offered tools (the generic format holds the whole answer back), a stream with
    ``logprobs: true`` sent none.  ``--deterministic``: the stream's prompt is a cache hit,
    whose greedy answer equals the cold one only in that mode (SCHEDULER.md)."""
    fields: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
    )
    exact = replace(server_config, deterministic=True)
    async with running_server(llama_model, exact, http="127.0.0.1:0", api_key=API_KEY) as server:
        async with openai_sdk(server) as client:
            whole = await client.chat.completions.create(**fields)
            expected = whole.choices[0].logprobs
            assert expected is not None and expected.content and len(expected.content) == 12
            streamed = []
            async for chunk in await client.chat.completions.create(**fields, stream=True):
                for choice in chunk.choices:
                    streamed += choice.logprobs.content or [] if choice.logprobs else []
    # The same tokens (their logprobs vary a little from run to run).
    assert [t.token for t in streamed] == [t.token for t in expected.content]


@pytest.mark.model
async def test_a_hermes_stream_sends_the_text_after_a_call_and_the_logprobs(
    model_path: Path, server_config: ServerConfig
) -> None:
    """A Hermes model that writes on after its ``<tool_call>`` block (taught so by the
    history): the stream lost that text, which the whole answer has, and sent no logprobs."""
    model = LlamaModel(model_path)
    try:
        model.use_chat_template((TEMPLATES / "qwen2.5-instruct.jinja").read_text())
        messages = taught_to_call(after="\nI will tell you soon.")
        fields: dict[str, Any] = dict(
            model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60, logprobs=True
        )
        async with (
            running_server(model, server_config, http="127.0.0.1:0", api_key="k") as server,
            openai_sdk(server) as client,
        ):
            whole = await client.chat.completions.create(**fields)
            message, logprobs = whole.choices[0].message, whole.choices[0].logprobs
            assert message.tool_calls and message.content == "Let me check.\n\nI will tell you soon."
            assert whole.choices[0].finish_reason == "tool_calls"
            content, streamed, calls = "", [], []
            async for chunk in await client.chat.completions.create(**fields, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    streamed += choice.logprobs.content or [] if choice.logprobs else []
                    calls += [c.function.arguments for c in choice.delta.tool_calls or [] if c.function]
            assert content == message.content
            assert calls == [c.function.arguments for c in message.tool_calls]
            assert logprobs is not None and logprobs.content
            assert [t.token for t in streamed] == [t.token for t in logprobs.content]

            # Anthropic's and OpenAI's Responses streams: the text after the call too.
            function = WEATHER["function"]
            claude = anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key="k", max_retries=0)
            asked: dict[str, Any] = dict(
                model=MODEL, messages=messages, extra_body={"temperature": 0}, max_tokens=60,
                tools=[{"name": function["name"], "input_schema": function["parameters"]}],
            )  # fmt: skip
            said_whole = await claude.messages.create(**asked)
            async with claude.messages.stream(**asked) as stream:
                said_streamed = "".join([text async for text in stream.text_stream])
            assert said_streamed == "".join(b.text for b in said_whole.content if b.type == "text")
            assert "I will tell you soon." in said_streamed and said_whole.stop_reason == "tool_use"
            tools: Any = [{"type": "function", **function}]
            answered: dict[str, Any] = dict(
                model=MODEL, input=messages, tools=tools, temperature=0, max_output_tokens=60, store=False
            )
            replied = await client.responses.create(**answered)
            async with client.responses.stream(**answered) as events:
                deltas = [e.delta async for e in events if e.type == "response.output_text.delta"]
            assert "".join(deltas) == replied.output_text and "I will tell you soon." in replied.output_text
    finally:
        model.close()


def test_a_strict_tools_objects_are_closed_in_its_grammar() -> None:
    """function.strict was read and ignored: the arguments could carry keys it does not name.
    A tool that is not strict left every object open, and the default model wrote keys of its
    own into its calls (`"description": "Paris is a beautiful city..."`)."""
    loose = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def parameters(strict: bool) -> Any:
        tool = msgspec.convert(
            {"type": "function", "function": {"name": "f", "parameters": loose, "strict": strict}}, Tool
        )
        grammar = tool_call_grammar("generic", [tool], "required", parallel=False)
        assert grammar is not None
        return json.loads(grammar.removeprefix("start: %json ").strip())["$defs"]["uma_tool_0"]

    assert parameters(True)["additionalProperties"] is False
    # Not strict: closed as llama.cpp's converter closes it (llama-server, Ollama), since it
    # lists its properties; a bare object stays any object unless strict.
    assert parameters(False)["additionalProperties"] is False
    loose = {"type": "object"}
    assert (
        "additionalProperties" not in parameters(False) and parameters(True)["additionalProperties"] is False
    )


@pytest.mark.parametrize(
    ("parameters", "arguments"),
    [
        ({"type": "object", "properties": {"c": {"$ref": "#"}}, "additionalProperties": False},
         {"c": {"c": {}}}),
        ({"$id": "https://example.com/t.json", "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
          "required": ["p"], "$defs": {"P": {"type": "integer"}}}, {"p": 1}),
        ({"type": "object", "properties": {"p": {"$ref": "#pint"}}, "required": ["p"],
          "$defs": {"P": {"$anchor": "pint", "type": "integer"}}}, {"p": 1}),
        ({"type": "object", "properties": {"r": {"const": {"$ref": "#/a"}}}, "required": ["r"]},
         {"r": {"$ref": "#/a"}}),
    ],
    ids=["own-root", "own-id", "anchor", "data-that-looks-like-a-ref"],
)  # fmt: skip
def test_a_tools_references_keep_their_meaning_in_the_call_grammar(parameters: Any, arguments: Any) -> None:
    """Rebased under the grammar's $defs, a tool's refs must still point where they pointed:
    its own root ("#"), a schema with its own $id (refs relative to it), an anchor, and a
    const that merely holds a "$ref" key (data, not a reference)."""
    tool = msgspec.convert({"type": "function", "function": {"name": "f", "parameters": parameters}}, Tool)
    grammar = tool_call_grammar("generic", [tool], "required", parallel=False)
    assert grammar is not None
    answer = json.dumps({"tool_calls": [{"name": "f", "arguments": arguments}]})
    assert grammar_accepts(lark_constraint(grammar, "tools").grammar, answer)


SEARCH = msgspec.convert(
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
            "mode": {"enum": ["fast", "deep"]}, "filters": {"type": "object", "properties": {
                "lang": {"type": "string"}}, "required": ["lang"], "additionalProperties": False},
            "exact": {"type": "boolean"}, "code": {"type": ["string", "integer"]},
        },
        "required": ["query", "limit"],
    }}},
    Tool,
)  # fmt: skip


def xml_call(name: str, **values: str) -> str:
    """A call as Qwen3-Coder writes it."""
    elements = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{elements}</function>\n</tool_call>"


def test_xml_values_are_text_or_json_as_their_schemas_say() -> None:
    """Qwen3-Coder / Qwen 3.5 write each argument as an XML element: a string's value is bare
    text (newlines, quotes and angle brackets as they are), anything else JSON."""
    schemas = {"search": msgspec.to_builtins(SEARCH.function.parameters)}
    text = xml_call(
        "search", query='a <b> "c"\n  d', limit="5", mode="deep", filters='{"lang": "en"}', exact="true",
        code="42", unknown="[1, 2]",
    )  # fmt: skip
    content, calls = parse_tool_calls(text, "xml", ["search"], schemas=schemas)
    assert content == "" and len(calls) == 1
    assert json.loads(calls[0].arguments) == {
        "query": 'a <b> "c"\n  d', "limit": 5, "mode": "deep", "filters": {"lang": "en"}, "exact": True,
        "code": 42, "unknown": [1, 2],
    }  # fmt: skip
    # A string that looks like a number stays text; JSON that does not parse stays text too.
    _, calls = parse_tool_calls(
        xml_call("search", query="007", limit="ten"), "xml", ["search"], schemas=schemas
    )
    assert json.loads(calls[0].arguments) == {"query": "007", "limit": "ten"}
    # A closing </parameter> the model left out: the value ends where the next one opens.
    loose = "<tool_call>\n<function=search>\n<parameter=query>\nx\n<parameter=limit>\n2\n</function>\n"
    loose += "</tool_call>"
    _, calls = parse_tool_calls(loose, "xml", ["search"], schemas=schemas)
    assert json.loads(calls[0].arguments) == {"query": "x", "limit": 2}
    # A closing tag inside a value (code can hold one) is the value's text, as the grammar has it.
    inside = xml_call("search", query="if a </parameter> b", limit="1")
    _, calls = parse_tool_calls(inside, "xml", ["search"], schemas=schemas)
    assert json.loads(calls[0].arguments) == {"query": "if a </parameter> b", "limit": 1}


def test_a_forced_xml_call_is_held_to_each_value_s_schema() -> None:
    """Under tool_choice required the XML family's grammar writes its format, not Hermes' JSON:
    text values up to their closing tag, JSON values against their schemas, required ones
    present, a listed string one of the list."""
    grammar = tool_call_grammar("xml", [SEARCH, TOOLS[1]], "required", parallel=True)
    assert grammar is not None
    compiled = lark_constraint(grammar, "tools").grammar
    good = xml_call("search", query="x </parameter> y\nz", limit="3", mode="fast", filters='{"lang": "de"}')
    assert grammar_accepts(compiled, good)
    assert grammar_accepts(compiled, good + "\n" + xml_call("get_time", zone="UTC"))  # parallel calls
    assert not grammar_accepts(compiled, xml_call("search", query="x"))  # limit is required
    assert not grammar_accepts(compiled, xml_call("search", query="x", limit="0"))  # minimum 1
    assert not grammar_accepts(compiled, xml_call("search", query="x", limit="3", mode="slow"))
    assert not grammar_accepts(compiled, xml_call("search", query="x", limit="3", filters="{}"))
    assert not grammar_accepts(compiled, FAMILY_CALLS["hermes"])
    named = msgspec.convert({"function": {"name": "get_time"}}, NamedToolChoice)
    once = tool_call_grammar("xml", [SEARCH, TOOLS[1]], named, parallel=True)
    assert once is not None
    compiled = lark_constraint(once, "tools").grammar
    assert grammar_accepts(compiled, xml_call("get_time", zone="UTC"))
    assert not grammar_accepts(compiled, good)
    assert not grammar_accepts(
        compiled, xml_call("get_time", zone="UTC") + "\n" + xml_call("get_time", zone="A")
    )


def test_a_tool_nested_too_deeply_to_rewrite_is_a_grammar_error() -> None:
    """Rebasing a tool's refs is Python recursion: a nesting msgspec accepts could raise
    RecursionError from the grammar's construction, an internal error for the client."""
    from uma_trio.protocol.errors import UmaError
    from uma_trio.protocol.messages import GenerateRequest
    from uma_trio.runtime.tool_use import tool_constraint

    depth = sys.getrecursionlimit() * 7 // 10  # msgspec takes it; two Python frames a level do not
    deep = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    body = (
        '{"id": "r", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": '
        '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": '
        '{"x": ' + deep + "}}}}]}"
    )
    request = msgspec.json.decode(body, type=GenerateRequest)
    with pytest.raises(UmaError) as refused:
        tool_constraint(request, "generic")
    assert refused.value.code == "E_GRAMMAR_001" and "nested too deeply" in refused.value.message


# After the tool's result the model may answer; the default model calls again and again, so
# the tokens that start the calls' key are banned (no_call_bias): the grammar's other branch,
# a direct answer, is left.
PARIS = '{"city": "Paris"}'
TOLD = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
]  # fmt: skip


def no_call_bias(server: Server) -> dict[str, int]:
    starts = [
        server.engine.tokenize(key) for key in ("t", "to", "too", "tool", "tool_", "tool_c", "tool_calls")
    ]
    no_call = {str(int(t[0])): -100 for t in starts if len(t) == 1}
    assert len(no_call) >= 2  # "t" and "tool" at least
    return no_call


@pytest.mark.model
async def test_a_direct_answer_beside_tools_streams_token_by_token(keyed_http_server: Server) -> None:
    """With tools offered, the default model's answer (the generic format's JSON) came in one
    chunk at its end; its text now streams as it is written, the same as the whole answer."""
    asked: dict[str, Any] = {
        "model": MODEL, "messages": TOLD, "tools": [WEATHER], "temperature": 0, "max_tokens": 60,
        "logit_bias": no_call_bias(keyed_http_server),
    }  # fmt: skip
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.chat.completions.create(**asked)
        content = whole.choices[0].message.content
        assert content and whole.choices[0].message.tool_calls is None
        stream = await client.chat.completions.create(**asked, stream=True, logprobs=True)
        chunks = [c async for c in stream if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == content and len(pieces) > 3
    # Every token's logprobs came, the JSON's opening's with the first text.
    tokens = [lp.token for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content or ()]
    assert len(tokens) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(tokens).startswith('{"response": "')


@pytest.mark.model
async def test_tools_with_a_response_format_call_or_answer_in_the_format(keyed_http_server: Server) -> None:
    """Chat, Responses and Ollama's chat take tools and a format together (they were 400s):
    the model calls the tool, or answers in the format."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER}}
    asked = {"model": MODEL, "tools": [WEATHER], "response_format": fmt, "temperature": 0, "max_tokens": 80}
    told, no_call = TOLD, no_call_bias(keyed_http_server)
    async with openai_sdk(keyed_http_server) as client:
        called = await client.chat.completions.create(messages=ASK, **asked)
        assert called.choices[0].finish_reason == "tool_calls"
        assert called.choices[0].message.tool_calls
        answered = await client.chat.completions.create(messages=told, logit_bias=no_call, **asked)
        choice = answered.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content is not None
        assert set(json.loads(choice.message.content)) == {"answer", "confident"}
        stream = await client.chat.completions.create(messages=told, logit_bias=no_call, stream=True, **asked)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == choice.message.content
        response = await client.responses.create(
            model=MODEL, input="Weather in Paris?", temperature=0, max_output_tokens=80,
            tools=[{"type": "function", "name": "get_weather", "parameters": ANSWER}],
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}},
        )  # fmt: skip
        assert response.status == "completed" and response.output
    # A new grammar compiles before the answer: under the whole suite, past httpx's 5 s default.
    async with httpx.AsyncClient(
        base_url=str(keyed_http_server.http_url), headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as http:
        ollama_chat = await http.post("/api/chat", json={
            "model": MODEL, "messages": ASK[1:], "tools": [WEATHER], "format": ANSWER, "stream": False,
            "options": {"temperature": 0, "num_predict": 80},
        })  # fmt: skip
        assert ollama_chat.status_code == 200, ollama_chat.text
        message = ollama_chat.json()["message"]
        assert message.get("tool_calls") or set(json.loads(message["content"])) == {"answer", "confident"}


@pytest.mark.model
async def test_a_logit_bias_that_bans_what_the_grammar_needs_says_so(keyed_http_server: Server) -> None:
    """A forced call whose every opening token logit_bias bans: the request fails
    (E_RUNTIME_003, HTTP.md), and said "forced bytes: got 't'" where it now names the bias."""
    async with openai_sdk(keyed_http_server) as client:
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                max_tokens=20, temperature=0, logit_bias=no_call_bias(keyed_http_server),
            )  # fmt: skip
    assert "logit_bias bans every token the grammar allows next" in str(failed.value)
    assert failed.value.code == "E_RUNTIME_003"
