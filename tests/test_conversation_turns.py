"""Conversations into prompts, as the twenty-seventh session's review found them: tool calls
and results in the order OpenAI's and Anthropic's APIs require (protocol/tool_turns.py), a
result's tool named, an empty last assistant turn, Anthropic's empty and consecutive turns,
Codex's results that answer no call, and ``oneOf`` in a tool's schema (Qwen Code's)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.errors import UmaError
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.protocol.openai_errors import ApiError, validation_error
from uma_trio.protocol.tool_turns import name_results, tool_turn_fault

MODEL = "m"
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TIME = {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
ASKED = {"role": "user", "content": "Weather in Paris, time in Rome?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL, TIME]}


def result(call_id: str, text: str = "ok") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


@pytest.mark.parametrize(
    ("turns", "fault"),
    [
        ([ASKED, CALLED, result("c2"), result("c1"), {"role": "user", "content": "thanks"}], None),
        ([ASKED, result("c1")], (1, "must follow the assistant turn")),
        ([ASKED, CALLED, result("c1"), result("c9")], (3, "made no call with id 'c9'")),
        ([ASKED, CALLED, result("c1"), result("c1")], (3, "'c1' is answered twice")),
        ([ASKED, {**CALLED, "tool_calls": [CALL, CALL]}], (1, "two tool calls have the id 'c1'")),
        ([ASKED, CALLED, result("c1"), ASKED], (1, "not answered: c2")),
        ([ASKED, CALLED], (1, "the last message is an assistant turn with tool calls")),
        ([ASKED, {**CALLED, "tool_calls": [{**CALL, "id": ""}]}, result("x")], None),  # no ids: unchecked
        ([ASKED, {"role": "tool", "content": "goal"}], None),  # a result tied to no call
    ],
)  # fmt: skip
def test_tool_turn_order_faults(turns: list[dict[str, Any]], fault: tuple[int, str] | None) -> None:
    found = tool_turn_fault(turns)
    if fault is None:
        assert found is None
    else:
        assert found is not None and found[0] == fault[0] and fault[1] in found[1]


def test_results_are_named_after_the_calls_they_answer() -> None:
    """Review: the generic format wrote `{"tool": ""}` beside each result, so two results
    could not be told apart (the model saw the same prompt whatever their order)."""
    named = name_results([ASKED, CALLED, result("c2"), result("c1"), {**result("c1"), "name": "own"}])
    assert [t.get("name") for t in named[2:]] == ["get_time", "get_weather", "own"]


def openai_refusal(messages: list[dict[str, Any]]) -> ApiError:
    from uma_trio.protocol import openai as openai_protocol

    body = msgspec.json.encode({"model": MODEL, "messages": messages})
    with pytest.raises(ApiError) as refused:
        openai_protocol.translate(
            openai_protocol.decode_body(body, openai_protocol.ChatBody),
            request_id="r", lane_header=None, max_tokens_limit=8,
        )  # fmt: skip
    return refused.value


def test_openai_chat_refuses_a_history_out_of_order_as_openai_does() -> None:
    """Review: a chat ending on an assistant's calls was continued as if it were a prefill (the
    model wrote on after the calls' JSON); a result with no call, or for an unknown id, was
    taken.  OpenAI answers each with a 400."""
    at_end = openai_refusal([ASKED, CALLED])
    assert at_end.status == 400 and at_end.param == "messages[1]" and "not answered: c1, c2" in at_end.message
    stray = openai_refusal([ASKED, result("c1")])
    assert stray.param == "messages[1]" and "must follow" in stray.message
    unknown = openai_refusal([ASKED, CALLED, result("c1"), result("zz")])
    assert unknown.param == "messages[3]" and "'zz'" in unknown.message


def anthropic(messages: list[dict[str, Any]]) -> GenerateRequest:
    from uma_trio.protocol.anthropic import MessagesBody, messages_request

    body = {"model": MODEL, "max_tokens": 8, "messages": messages}
    return messages_request(msgspec.convert(body, MessagesBody), "r")


def anthropic_refusal(messages: list[dict[str, Any]]) -> ApiError:
    with pytest.raises(ApiError) as refused:
        anthropic(messages)
    return refused.value


USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}


def test_anthropic_refuses_what_anthropic_refuses_and_merges_what_it_merges() -> None:
    """Review: a `tool_result` for no `tool_use`, a `tool_use` with no result, and a message
    whose content is `[]` (or thinking only) were taken; the empty one vanished, so the answer
    before it became a prefill ("b" continued as "blessed").  A prefill ending in whitespace
    was taken (Anthropic refuses it), and consecutive user turns stayed two turns."""
    wrong_id = anthropic_refusal(
        [{"role": "user", "content": "hi"}, USE,
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]
    )  # fmt: skip
    assert wrong_id.param == "messages[2].content[0].tool_use_id" and "'t9'" in wrong_id.message
    unanswered = anthropic_refusal(
        [{"role": "user", "content": "hi"}, USE, {"role": "user", "content": "go on"}]
    )
    assert unanswered.param == "messages[1]" and "not answered: t1" in unanswered.message
    no_id = anthropic_refusal(
        [{"role": "user", "content": "hi"}, USE, {"role": "user", "content": [{"type": "tool_result"}]}]
    )
    assert no_id.param == "messages[2].content[0].tool_use_id"
    for empty in ([], [{"type": "thinking", "thinking": "hm", "signature": "s"}]):
        gone = anthropic_refusal(
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": empty},
            ]
        )
        assert gone.param == "messages[2].content" and "needs content" in gone.message
    spaced = anthropic_refusal([{"role": "user", "content": "a"}, {"role": "assistant", "content": "Sure "}])
    assert spaced.param == "messages[1].content" and "whitespace" in spaced.message
    merged = anthropic([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert [(m.role, m.content) for m in merged.messages or ()] == [("user", "one\n\ntwo")]
    prefill_free = anthropic([{"role": "user", "content": "a"}, {"role": "assistant", "content": []}])
    assert [m.role for m in prefill_free.messages or ()] == ["user"]


def test_a_codex_output_that_answers_no_call_is_a_named_result_and_a_call_needs_its_output() -> None:
    """Review: Codex adds its goal as a `function_call_output` with no `call_id`
    (`name: goal_objective`); the 400 it got ended Codex's run.  A call item with no output
    after it is refused, as OpenAI refuses it."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    call = {"type": "function_call", "call_id": "k1", "name": "create_goal", "arguments": "{}"}
    answered = {"type": "function_call_output", "call_id": "k1", "output": "done"}
    goal = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
            "output": "create_goal"}  # fmt: skip
    tools = [{"type": "function", "name": "create_goal", "parameters": {"type": "object"}}]
    body = {
        "model": MODEL,
        "tools": tools,
        "input": [{"role": "user", "content": "go"}, call, answered, goal],
    }
    request, _ = responses_request(msgspec.convert(body, ResponsesBody), "r", None)
    turns = [(m.role, m.name, m.tool_call_id, m.content) for m in request.messages or ()]
    assert turns[-2:] == [("tool", None, "k1", "done"), ("tool", "goal_objective", None, "create_goal")]
    lone = msgspec.convert({**body, "input": [{"role": "user", "content": "go"}, call]}, ResponsesBody)
    with pytest.raises(ApiError) as refused:
        responses_request(lone, "r", None)
    assert refused.value.param == "input[1]" and "not answered: k1" in refused.value.message


def test_a_chat_ending_on_its_own_calls_is_refused_on_the_socket_and_ollama_too() -> None:
    """The routes that take no call ids (the socket, Ollama's): not continued either."""
    from uma_trio.runtime.tool_use import chat_turns

    request = msgspec.convert({"id": "r", "messages": [ASKED, {**CALLED, "content": ""}]}, GenerateRequest)
    with pytest.raises(UmaError, match="assistant turn with tool calls"):
        chat_turns(request, None, "generic")
    answered = msgspec.convert(
        {
            "id": "r",
            "messages": [ASKED, {**CALLED, "content": ""}, result("c2", "noon"), result("c1", "sun")],
        },
        GenerateRequest,
    )
    turns, _ = chat_turns(answered, None, "generic")
    assert '"tool": "get_time"' in turns[2]["content"] and '"tool": "get_weather"' in turns[3]["content"]


def test_an_empty_last_assistant_turn_continues_nothing(llama_model: LlamaModel) -> None:
    """Review: `[user, assistant ""]` was rendered as an empty answer the model then answered
    after (37 tokens, "I'm glad you're enjoying"); Anthropic and llama-server treat it as an
    empty prefill: the prompt of the user's turn alone."""
    alone = llama_model.tokenize_chat([("user", "hi")])
    assert llama_model.tokenize_chat([("user", "hi"), ("assistant", "")]).tolist() == alone.tolist()


def test_a_tool_schema_with_one_of_is_taken_as_any_of() -> None:
    """Review: Qwen Code's `agent` tool has a `oneOf` property; llguidance refused it, and
    with it every request of Qwen Code (400 E_GRAMMAR_001).  Read as `anyOf`, as llama.cpp's
    and Ollama's converters read it."""
    from uma_trio.engine.constraints import check_alone, json_schema_constraint
    from uma_trio.runtime.tool_use import tool_constraint

    one_of = {"oneOf": [{"type": "string", "enum": ["all"]}, {"type": "string", "pattern": "^[1-9][0-9]*$"}]}
    schema = {"type": "object", "properties": {"fork_turns": one_of}}
    tool = {"type": "function", "function": {"name": "agent", "parameters": schema}}
    fields = {"id": "r", "messages": [ASKED], "tools": [tool]}
    try:
        request = msgspec.convert(fields, GenerateRequest)
    except msgspec.ValidationError as exc:  # pragma: no cover - shown as the API would
        raise AssertionError(validation_error(exc).message) from None
    constraint = tool_constraint(request, "generic")
    assert constraint is not None
    check_alone(constraint)  # raised ConstraintError: "oneOf constraints are not supported"
    check_alone(json_schema_constraint(schema))  # a response_format's schema alike


@pytest.mark.parametrize("text", [rb"\ud800", rb"x\ud83dy"])
def test_a_lone_surrogate_escape_is_named_not_called_truncated(text: bytes) -> None:
    """Review: msgspec refused a lone `\\ud800` as "Input data was truncated" on every route
    and the socket, though the body was whole; a body really cut off still says so."""
    from uma_trio.protocol.codec import decode_client_message
    from uma_trio.protocol.openai_errors import decode_json

    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + text + b'"}]}'
    with pytest.raises(ApiError, match="invalid utf-16 surrogate pair") as refused:
        decode_json(body, dict)
    assert refused.value.status == 400 and "truncated" not in refused.value.message
    with pytest.raises(UmaError, match="invalid utf-16 surrogate pair"):
        decode_client_message(b'{"id": "r", "prompt": "' + text + b'"}')
    with pytest.raises(ApiError, match="truncated"):
        decode_json(b'{"model": "m", "messages": [', dict)
