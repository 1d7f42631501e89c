"""OpenAI's Responses API, stateless (issue 21, point 3), through the official openai SDK."""

from __future__ import annotations

from typing import Any

import msgspec
import openai
import pydantic
import pytest

from uma_trio.protocol.openai_errors import ApiError
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


async def test_every_answer_and_event_is_valid_under_the_sdk_s_own_types(keyed_http_server: Server) -> None:
    """The SDK builds its objects without validating them, so a field OpenAI always sends
    and this daemon left out went unseen (`usage.input_tokens_details.cache_write_tokens`);
    each answer and each streamed event validated strictly, a tool call's too."""
    import httpx
    from openai.types.responses import Response, ResponseStreamEvent

    from .conftest import API_KEY

    events = pydantic.TypeAdapter(ResponseStreamEvent)
    headers = {"authorization": f"Bearer {API_KEY}"}
    asked: list[dict[str, Any]] = [
        {"model": MODEL, "input": "Say hi.", "max_output_tokens": 8, "top_logprobs": 2,
         "include": ["message.output_text.logprobs"]},
        {"model": MODEL, "input": "Weather in Oslo?", "max_output_tokens": 40, "tools": [WEATHER],
         "tool_choice": "required"},
        {"model": MODEL, "input": "Count to twenty.", "max_output_tokens": 3},
    ]  # fmt: skip
    base = f"{keyed_http_server.http_url}/v1"
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
        for body in asked:
            whole = await http.post("/responses", json=body)
            assert whole.status_code == 200, whole.text
            Response.model_validate(whole.json())
            async with http.stream("POST", "/responses", json={**body, "stream": True}) as streamed:
                kinds = [
                    events.validate_json(line[6:]).type
                    async for line in streamed.aiter_lines()
                    if line.startswith("data: ")
                ]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds


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


def test_the_response_echoes_what_the_request_set() -> None:
    """A Codex review: `user`, `truncation`, `top_logprobs` and `completed_at` were missing
    (the SDK read them as null) though the request set them and the answer had completed."""
    from openai.types.responses import Response

    from uma_trio.protocol.messages import EosEvent, Timings, Usage
    from uma_trio.protocol.responses_api import ResponsesBody, response_object

    body = msgspec.convert(
        {"model": MODEL, "input": "hi", "user": "u-7", "truncation": "auto", "top_logprobs": 3,
         "service_tier": "flex"}, ResponsesBody,
    )  # fmt: skip
    done = EosEvent(id="r", reason="stop", usage=Usage(3, 2, 5), timings=Timings(0.0, 2_400.0))
    echoed = Response.model_validate(response_object("resp_1", 1_700_000_000, body, [], done))
    assert (echoed.user, echoed.truncation, echoed.top_logprobs) == ("u-7", "auto", 3)
    assert echoed.completed_at == 1_700_000_002 and echoed.service_tier == "flex"
    assert echoed.background is False and echoed.previous_response_id is None
    begun = response_object("resp_1", 1_700_000_000, body, [], None)
    assert begun["completed_at"] is None and begun["status"] == "in_progress"
    cut = EosEvent(id="r", reason="length", usage=Usage(3, 2, 5), timings=Timings(0.0, 2_400.0))
    assert response_object("resp_1", 0, body, [], cut)["completed_at"] is None  # incomplete


def sdk_error(error: openai.BadRequestError) -> tuple[str | None, str]:
    return error.param, error.message


BROKEN = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}


async def test_refusals_name_the_fields_the_client_sent(keyed_http_server: Server) -> None:
    """Not the chat request's they become: max_tokens, messages[i], tools[i].function."""
    nameless = {"type": "function", "parameters": {"type": "object", "properties": {}}}
    call = {"type": "function_call", "call_id": "c1", "arguments": "{}"}
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}
    refused: list[tuple[dict[str, Any], str, str]] = [
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": []}, "input", "input is empty"),
        ({"input": "hi", "tools": [nameless]}, "tools[0].name", "name"),
        ({"input": "hi", "tools": [{**WEATHER, "name": "get weather"}]}, "tools[0].name", "$.tools[0].name"),
        ({"input": [{"role": "user", "content": "hi"}, call]}, "input[1].name", "name"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": allowed}, "tool_choice", "'allowed_tools'"),
        # Developer items join the instructions' turn: the daemon's messages[2] is input[2].
        (
            {
                "instructions": "Be brief.",
                "input": [
                    {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "hi"},
                    {**call, "name": "n" * 300},
                ],
            },
            "input[2].name",
            "$.input[2].name",
        ),
        # A tool's schema that does not compile: named as the client's tools[i] (it said
        # `tools[1].function.parameters`, the chat request's field).
        (
            {"input": "hi", "tools": [WEATHER, {**WEATHER, "name": "f", "parameters": BROKEN}],
             "tool_choice": {"type": "function", "name": "f"}},
            "tools", "`tools[1].parameters`: Pointer '/nope'",
        ),
    ]  # fmt: skip
    async with openai_sdk(keyed_http_server) as client:
        for body, param, said in refused:
            with pytest.raises(openai.BadRequestError) as error:
                await client.responses.create(model=MODEL, **body)
            assert error.value.param == param, body
            assert said in error.value.message and "messages" not in error.value.message, body
            assert "max_tokens" not in error.value.message and ".function" not in error.value.message


async def test_text_format_is_text_json_object_or_a_json_schema(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        for fmt in ({"type": "json_schema", "name": "x"}, {"type": "bogus"}, "json"):
            with pytest.raises(openai.BadRequestError) as error:
                await client.responses.create(
                    model=MODEL, input="hi", text={"format": fmt},  # type: ignore[typeddict-item]
                    max_output_tokens=2,
                )  # fmt: skip
            assert error.value.param == "text.format", fmt
        for ok in ({"type": "text"}, {"type": "json_object"}):
            answer = await client.responses.create(
                model=MODEL, input="hi", text={"format": ok},  # type: ignore[typeddict-item]
                max_output_tokens=2,
            )  # fmt: skip
            assert answer.status in ("completed", "incomplete")


async def test_function_call_items_and_outputs_need_their_call_ids(keyed_http_server: Server) -> None:
    ask = {"role": "user", "content": "Weather in Paris?"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    refused: list[tuple[list[dict[str, Any]], str]] = [
        ([ask, call, {**output, "call_id": None}], "input[2].call_id"),  # was tool_call_id ""
        ([ask, {**call, "call_id": ""}, output], "input[1].call_id"),
        ([ask, output], "input[1].call_id"),  # answers no call
        ([ask, call, {**output, "call_id": "c2"}], "input[2].call_id"),
    ]
    async with openai_sdk(keyed_http_server) as client:
        for items, param in refused:
            with pytest.raises(openai.BadRequestError) as error:
                await client.responses.create(model=MODEL, input=items, max_output_tokens=2)  # type: ignore[arg-type]
            assert error.value.param == param, items
        # Arguments that are not JSON are replayed as sent (the model wrote them), as in chat.
        broken = {**call, "arguments": '{"city": "Par'}
        answer = await client.responses.create(model=MODEL, input=[ask, broken, output], max_output_tokens=2)  # type: ignore[list-item]
        assert answer.output


async def test_a_cut_off_message_is_incomplete_whole_and_streamed(keyed_http_server: Server) -> None:
    ask: dict[str, Any] = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 3}
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.responses.create(**ask, temperature=0)
        async with client.responses.stream(**ask, temperature=0) as stream:
            done = [e.item async for e in stream if e.type == "response.output_item.done"]
            final = await stream.get_final_response()
    assert whole.status == final.status == "incomplete"
    assert [i.status for i in whole.output] == [i.status for i in final.output] == ["incomplete"]
    assert [i.status for i in done] == ["incomplete"]
    assert whole.output_text == final.output_text != ""


async def test_an_empty_answer_is_an_empty_message_whole_and_streamed(
    keyed_http_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import aclosing

    from uma_trio.http.gateway import Gateway
    from uma_trio.protocol.messages import EosEvent, TokenEvent

    def silenced(events: Any) -> Any:
        async def silent(self: Gateway, flight: Any) -> Any:  # the model writes nothing
            async with aclosing(events(self, flight)) as real:
                async for event in real:
                    if isinstance(event, EosEvent):
                        yield msgspec.structs.replace(event, text="", content=None)
                    elif not isinstance(event, TokenEvent):
                        yield event

        return silent

    monkeypatch.setattr(Gateway, "_events", silenced(Gateway._events))  # whole
    monkeypatch.setattr(Gateway, "_beating_events", silenced(Gateway._beating_events))  # streamed
    ask: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.responses.create(**ask)
        async with client.responses.stream(**ask) as stream:
            final = await stream.get_final_response()
    texts = [[part["text"] for part in item.model_dump()["content"]] for item in whole.output]
    assert texts == [[part["text"] for part in item.model_dump()["content"]] for item in final.output]
    assert texts == [[""]] and [i.type for i in final.output] == ["message"]  # was [] streamed


async def test_the_lane_comes_from_the_header_or_service_tier(keyed_http_server: Server) -> None:
    ask: dict[str, Any] = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 1}
    async with openai_sdk(keyed_http_server) as client:
        await client.responses.create(**ask, extra_headers={"X-Uma-Priority": "background"})
        await client.responses.create(**ask, service_tier="flex")
        await client.responses.create(**ask)
        with pytest.raises(openai.BadRequestError) as error:
            await client.responses.create(**ask, extra_headers={"X-Uma-Priority": "urgent"})
        assert "X-Uma-Priority" in error.value.message
    lanes = keyed_http_server.metrics_snapshot()["requests"]
    counts = {lane: sum(reasons.values()) for lane, reasons in lanes.items()}
    assert counts == {"interactive": 1, "background": 2}


# Codex's tools (codex-cli 0.171): functions, a namespace of functions, a free-form tool, and
# OpenAI's hosted web search.
READ_FILE = {
    "type": "function", "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20}},
                   "required": ["path"], "additionalProperties": False},
}  # fmt: skip
NAMESPACE = {"type": "namespace", "name": "mcp__fs__", "description": "Files.", "tools": [READ_FILE]}
PATCH = {
    "type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}  # fmt: skip
CODEX_TOOLS: list[Any] = [WEATHER, NAMESPACE, PATCH, {"type": "web_search", "external_web_access": False}]


def test_codex_tools_become_what_the_model_is_shown() -> None:
    """Hosted tools are left out, a namespace's functions get flat names, a custom tool is a
    function of one string that its grammar describes."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    body = msgspec.convert({"model": MODEL, "input": "hi", "tools": CODEX_TOOLS}, ResponsesBody)
    request, _ = responses_request(body, "r", None)
    tools = {t.function.name: t.function for t in request.tools or ()}
    assert list(tools) == ["get_weather", "mcp__fs__read_file", "apply_patch"]
    assert tools["apply_patch"].parameters == {
        "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
        "additionalProperties": False,
    }  # fmt: skip
    assert "*** Begin Patch" in (tools["apply_patch"].description or "")
    unknown = msgspec.convert({"model": MODEL, "input": "hi", "tools": [{"type": "teleport"}]}, ResponsesBody)
    with pytest.raises(ApiError, match=r"a 'teleport' tool is not supported") as refused:
        responses_request(unknown, "r", None)
    assert refused.value.param == "tools[0].type"


def test_codex_history_replays_into_chat_turns() -> None:
    """What Codex sends back: its reasoning and web-search items (skipped), a namespaced call,
    a custom tool's call and output, a tool output holding an image (a placeholder)."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    history: list[Any] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix a.py"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
        {"type": "function_call", "call_id": "c1", "name": "read_file", "namespace": "mcp__fs__",
         "arguments": '{"path": "a.py"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "x = 1"}, {"type": "input_image", "image_url": "data:,"}]},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done"},
    ]  # fmt: skip
    body = msgspec.convert({"model": MODEL, "input": history, "tools": CODEX_TOOLS}, ResponsesBody)
    turns = responses_request(body, "r", None)[0].messages or []
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    calls = [*(turns[2].tool_calls or ()), *(turns[4].tool_calls or ())]
    assert [c.function.name for c in calls] == ["mcp__fs__read_file", "apply_patch"]
    assert msgspec.json.decode(calls[1].function.arguments) == {"input": "*** Begin Patch"}
    assert turns[3].content == "x = 1\n\n[input_image omitted: this model reads text only]"


async def test_codex_calls_come_back_as_codex_reads_them(keyed_http_server: Server) -> None:
    """A namespace's function is called by its own name with its ``namespace``; a custom tool's
    call is a ``custom_tool_call`` whose ``input`` is the text, whole and streamed."""
    ask: list[Any] = [{"role": "user", "content": "Read the file a.py, then patch it."}]
    in_namespace = {"type": "function", "name": "read_file", "namespace": "mcp__fs__"}
    async with openai_sdk(keyed_http_server) as client:
        read = await client.responses.create(
            model=MODEL, input=ask, tools=CODEX_TOOLS, tool_choice=in_namespace,  # type: ignore[arg-type]
            temperature=0, max_output_tokens=60, store=False,
        )  # fmt: skip
        call = next(item for item in read.output if item.type == "function_call").model_dump()
        assert (call["name"], call["namespace"]) == ("read_file", "mcp__fs__")
        assert "path" in msgspec.json.decode(call["arguments"])
        patched = await client.responses.create(
            model=MODEL, input=ask, tools=CODEX_TOOLS, tool_choice={"type": "custom", "name": "apply_patch"},  # type: ignore[arg-type]
            temperature=0, max_output_tokens=40, store=False,
        )  # fmt: skip
        custom = next(item for item in patched.output if item.type == "custom_tool_call")
        assert custom.name == "apply_patch" and custom.call_id and isinstance(custom.input, str)
        async with client.responses.stream(
            model=MODEL, input=ask, tools=CODEX_TOOLS, tool_choice={"type": "custom", "name": "apply_patch"},  # type: ignore[arg-type]
            temperature=0, max_output_tokens=40, store=False,
        ) as stream:  # fmt: skip
            deltas = [e.delta async for e in stream if e.type == "response.custom_tool_call_input.delta"]
            final = await stream.get_final_response()
        streamed = next(item for item in final.output if item.type == "custom_tool_call")
        assert "".join(deltas) == streamed.input == custom.input
        # Only the hosted web search: nothing the model can call, so it answers in text.
        hosted = await client.responses.create(
            model=MODEL, input="Say hi.", tools=[{"type": "web_search"}], max_output_tokens=8, store=False,
        )  # fmt: skip
        assert [item.type for item in hosted.output] == ["message"]


def test_odd_tools_and_items_are_400s_naming_the_field() -> None:
    """Found by review: a list where a type goes was a 500 (unhashable), a namespace whose
    tools are not a list too; two tools the model would know by one name were a 400 naming
    nothing; a tool_choice of the wrong kind was taken."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    def refused(**fields: Any) -> tuple[str | None, str]:
        body = msgspec.convert({"model": MODEL, "input": "hi", **fields}, ResponsesBody)
        with pytest.raises(ApiError) as error:
            responses_request(body, "r", None)
        return error.value.param, error.value.message

    assert refused(input=[{"type": ["x"]}])[0] == "input[0]"
    assert refused(tools=[{"type": ["function"]}])[0] == "tools[0].type"
    assert refused(tools=[{"type": "namespace", "name": "ns", "tools": 5}])[0] == "tools[0].tools"
    assert refused(tools=[{"type": "namespace", "tools": []}])[0] == "tools[0].name"
    clash = [{**READ_FILE, "name": "mcp__fs__read_file"}, NAMESPACE]
    param, said = refused(tools=clash)
    assert param == "tools[1].tools[0].name" and "tools[0]" in said
    assert (
        refused(tools=CODEX_TOOLS, tool_choice={"type": "custom", "name": "get_weather"})[0]
        == "tool_choice.type"
    )
    inner = {"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}
    assert refused(tools=[inner])[0] == "tools[0].tools[0].type"
    hosted_only = [{"type": "web_search"}]
    assert refused(tools=hosted_only, tool_choice="required")[0] == "tool_choice"  # it was dropped
    # A replayed history from an OpenAI model, with hosted tools' calls: skipped.
    shell = {"type": "local_shell_call", "call_id": "c", "status": "completed", "action": {"type": "exec"}}
    body = msgspec.convert(
        {"model": MODEL, "input": [shell, {"role": "user", "content": "hi"}]}, ResponsesBody
    )
    assert [t.role for t in responses_request(body, "r", None)[0].messages or []] == ["user"]


def test_stream_null_is_the_default_and_an_empty_text_input_needs_instructions() -> None:
    """Found by review: ``"stream": null`` was a 400 (OpenAI's spec allows it, as chat does),
    and ``input: ""`` with no instructions was answered as an empty user turn where HTTP.md
    says it is refused naming ``input``."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    def body(**fields: Any) -> ResponsesBody:
        return msgspec.convert({"model": MODEL, **fields}, ResponsesBody)

    assert not body(input="hi", stream=None).stream
    with pytest.raises(ApiError) as refused:
        responses_request(body(input=""), "r", None)
    assert refused.value.param == "input"
    turns = responses_request(body(input="", instructions="be brief"), "r", None)[0].messages or []
    assert [t.role for t in turns] == ["system", "user"]
    # background: true (a response to poll for by id) was taken and answered in the foreground.
    with pytest.raises(ApiError) as background:
        responses_request(body(input="hi", background=True), "r", None)
    assert background.value.param == "background"
    assert responses_request(body(input="hi", background=False), "r", None)[0].messages


def test_a_custom_tool_s_input_is_its_text() -> None:
    from uma_trio.protocol.responses_tools import custom_input

    assert custom_input('{"input": "*** Begin Patch"}') == "*** Begin Patch"
    assert custom_input('"*** Begin Patch"') == "*** Begin Patch"  # a bare JSON string: its text
    assert custom_input("*** Begin Patch") == "*** Begin Patch"  # not JSON: as written


async def test_logprobs_come_with_include_whole_and_streamed(keyed_http_server: Server) -> None:
    """``top_logprobs`` was accepted and every ``logprobs`` list left empty: with include's
    ``message.output_text.logprobs`` each output token's comes, in the part and with the
    delta that carries its text; without it, none."""
    asked: dict[str, Any] = {
        "model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 12,
        "temperature": 0, "top_logprobs": 3, "include": ["message.output_text.logprobs"],
    }  # fmt: skip
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.responses.create(**asked)
        part = whole.output[0].content[0]  # type: ignore[union-attr]
        assert part.type == "output_text" and part.logprobs
        assert len(part.logprobs) == whole.usage.output_tokens  # type: ignore[union-attr]
        assert "".join(p.token for p in part.logprobs) == part.text
        assert all(len(p.top_logprobs) == 3 and p.logprob <= 0 for p in part.logprobs)
        async with client.responses.stream(**asked) as stream:
            deltas = [e async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert [lp.token for d in deltas for lp in d.logprobs] == [p.token for p in part.logprobs]
        assert all("".join(lp.token for lp in d.logprobs) == d.delta for d in deltas)
        assert final.output[0].content[0].logprobs == part.logprobs  # type: ignore[union-attr]
        # Beside tools (the generic format's JSON: its closing tokens show no text), every
        # token's logprobs still come in the deltas (the last ones were only in the part).
        tooled = {**asked, "tools": [WEATHER], "max_output_tokens": 40}
        async with client.responses.stream(**tooled) as stream:
            deltas = [e async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        every = final.output[0].content[0].logprobs  # type: ignore[union-attr]
        assert every and [lp.token for d in deltas for lp in d.logprobs] == [lp.token for lp in every]
        plain = await client.responses.create(**{**asked, "include": []})
        assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(**{**asked, "top_logprobs": 21})
        assert refused.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("field", "value"),
    [("conversation", "conv_abc123"), ("conversation", {"id": "conv_abc123"}), ("prompt", {"id": "pmpt_1"})],
)
def test_stored_conversations_and_prompts_are_refused_by_name(field: str, value: object) -> None:
    """A review: ``conversation`` (OpenAI's Conversations API) and ``prompt`` (a stored prompt
    template) were taken and ignored, the answer made from ``input`` alone, without the
    stored turns or template: the silent loss the refusal of previous_response_id exists to
    prevent.  Both are 400s naming the field now."""
    from uma_trio.protocol.openai import ApiError
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    body = msgspec.convert({"model": MODEL, "input": "Continue.", field: value}, ResponsesBody)
    with pytest.raises(ApiError) as refused:
        responses_request(body, "r-1", None)
    assert refused.value.status == 400 and refused.value.param == field
    assert "nothing is stored" in refused.value.message
