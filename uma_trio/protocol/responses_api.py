"""OpenAI's Responses API, stateless (``POST /v1/responses``): its body as a daemon request, the
response object and its stream events.  Pure.

``input`` is a string or items: messages (``input_text`` / ``output_text`` parts), the
model's earlier ``function_call`` / ``custom_tool_call`` items and their outputs: chat turns,
tool calls and ``tool`` turns (the tools: responses_tools.py).  Hosted tools' calls and
OpenAI's ``reasoning`` items in a replayed history carry nothing for this model: skipped.
Nothing is stored: ``previous_response_id``, ``conversation``, ``prompt`` (a stored template)
and ``store: true`` are refused by name.  A
refusal names the field the client sent (``input[2].call_id``, ``max_output_tokens``), also
for the checks the daemon request goes through after (:func:`as_sent`).

Over 400 lines: the body's translation and the answer's shapes are one API's two halves (its
tools are apart, in responses_tools.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .messages import MOST_TOP_LOGPROBS, EosEvent, GenerateRequest, TokenLogprob
from .openai import lane_from_header
from .openai_errors import ApiError, bad_request, validation_error
from .responses_tools import (
    CUSTOM_INPUT,
    Names,
    call_items,
    chat_tool_choice,
    flat_name,
    kinds_of,
    shown_tools,
)
from .tool_turns import tool_turn_fault


class ResponsesBody(Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # null: the default, as OpenAI's spec allows
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None  # a stored conversation's id: refused, as previous_response_id
    prompt: Any = None  # a stored prompt template: refused likewise
    store: bool | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None  # "flex": the background lane (docs/HTTP.md)
    # Each output token's log-probability comes with include's LOGPROBS, as OpenAI's does.
    include: list[str] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MOST_TOP_LOGPROBS)] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns dropped to fit


LOGPROBS = "message.output_text.logprobs"


def _text(content: Any, where: str, *, tool_output: bool = False) -> str:
    """Text parts joined.  In a tool's output an image or file becomes a placeholder: refused,
    it stayed in the history and refused the session's every later request (Codex's
    ``view_image`` answers with one)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if tool_output and kind in ("input_image", "input_file"):
            parts.append(f"[{kind} omitted: this model reads text only]")
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"{where}[{i}]: a {kind!r} part is not supported; only text", where)
        parts.append(str(part.get("text", "")))
    return "\n\n".join(parts)  # paragraphs: parts must not run together


def _turns(body: ResponsesBody, names: Names) -> list[dict[str, Any]]:
    """The chat turns of ``instructions`` and ``input``; ``names`` learns which item each
    turn (and each call in it) came from."""
    turns: list[dict[str, Any]] = []
    if body.instructions:
        turns.append({"role": "system", "content": body.instructions})
        names.update({"messages[0]": "instructions", "messages[0].content": "instructions"})
    if not body.input and not body.instructions:
        raise bad_request("input is empty: give a text or at least one item to answer", "input")
    if isinstance(body.input, str):
        names.update({f"messages[{len(turns)}]": "input", f"messages[{len(turns)}].content": "input"})
        return [*turns, {"role": "user", "content": body.input}]
    calls: set[str] = set()  # the call_ids of the call items so far
    for i, item in enumerate(body.input):
        kind, where = item.get("type", "message"), f"input[{i}]"
        kind = kind if isinstance(kind, str) else repr(kind)  # a list is no item type, and unhashable
        if kind == "message":
            _add(turns, _message(item, where), names, where)
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where) if kind == "function_call" else _custom_call(item, where)
            _add_call(turns, call, names, where, "arguments" if kind == "function_call" else "input")
            calls.add(call["id"])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _add_output(turns, item, calls, names, where)
        elif kind not in _SKIPPED_ITEMS:
            raise bad_request(f"{where}: an item of type {kind!r} is not supported", where)
    return turns


# Items a replayed history holds that a local model never wrote and cannot read: OpenAI's
# encrypted reasoning, hosted tools' calls (the daemon runs none of them).
_SKIPPED_ITEMS = frozenset({
    "reasoning", "web_search_call", "file_search_call", "image_generation_call",
    "code_interpreter_call", "tool_search_call", "tool_search_output", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "computer_call", "computer_call_output",
})  # fmt: skip


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    asked = item.get("role", "")
    role = {"developer": "system"}.get(asked, asked) if isinstance(asked, str) else None
    if role not in ("system", "user", "assistant"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
    return {"role": role, "content": _text(item.get("content", ""), f"{where}.content")}


def _add(turns: list[dict[str, Any]], turn: dict[str, Any], names: Names, where: str) -> None:
    """Leading system turns (``instructions``, then Codex's developer items) are one: chat
    templates take a single system message, first."""
    if turn["role"] == "system" and turns and all(t["role"] == "system" for t in turns):
        turns[-1]["content"] += "\n\n" + turn["content"]
    else:
        names[f"messages[{len(turns)}]"] = where
        turns.append(turn)


def _add_output(
    turns: list[dict[str, Any]], item: dict[str, Any], calls: set[str], names: Names, where: str
) -> None:
    """A ``function_call_output`` (or ``custom_tool_call_output``) item as a ``tool`` turn; as
    OpenAI, it answers a call the input holds before it (``calls``: their call_ids).  One with
    no ``call_id`` answers no call: Codex adds its goal so (``name: goal_objective``), and a
    refusal ended its run; it is a tool's result under its ``name``."""
    call_id = _call_id(item, where) if "call_id" in item else None
    if call_id is not None and call_id not in calls:
        raise bad_request(f"{where}: no call item before it has call_id {call_id!r}", f"{where}.call_id")
    output = _text(item.get("output", ""), f"{where}.output", tool_output=True)
    t = f"messages[{len(turns)}]"
    names.update({t: where, f"{t}.tool_call_id": f"{where}.call_id", f"{t}.content": f"{where}.output"})
    name = item.get("name") if call_id is None and isinstance(item.get("name"), str) else None
    turns.append({"role": "tool", "content": output, **({"tool_call_id": call_id} if call_id else {}),
                  **({"name": name} if name else {})})  # fmt: skip


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id: a {item.get('type')} item needs its call_id", f"{where}.call_id")
    return call_id


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call.  Its ``arguments`` are replayed as sent,
    JSON or not (the model wrote them; the chat API takes them so too)."""
    call_id, name = _call_id(item, where), _call_name(item, where)
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):  # an object where OpenAI sends its JSON text
        arguments = json.dumps(arguments)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = flat_name(namespace, name)
    return {"id": call_id, "function": {"name": name, "arguments": arguments}}


def _custom_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``custom_tool_call`` item as the call of its one-string function (responses_tools.py)."""
    call_id, name, given = _call_id(item, where), _call_name(item, where), item.get("input", "")
    arguments = json.dumps({CUSTOM_INPUT: given if isinstance(given, str) else json.dumps(given)})
    return {"id": call_id, "function": {"name": name, "arguments": arguments}}


def _call_name(item: dict[str, Any], where: str) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name: a {item.get('type')} item needs the tool's name", f"{where}.name")
    return name


def _add_call(
    turns: list[dict[str, Any]], call: dict[str, Any], names: Names, where: str, arguments: str
) -> None:
    """A call belongs to the assistant turn just before it, text and all: a replayed
    ``message`` then its ``function_call`` items are one turn.  ``arguments``: the item's field
    the call's arguments came from (a custom tool's ``input``)."""
    if turns and turns[-1]["role"] == "assistant":
        turns[-1].setdefault("tool_calls", []).append(call)
    else:
        names[f"messages[{len(turns)}]"] = where
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
    c = f"messages[{len(turns) - 1}].tool_calls[{len(turns[-1]['tool_calls']) - 1}]"
    names.update({
        c: where, f"{c}.id": f"{where}.call_id", f"{c}.function": where,
        f"{c}.function.name": f"{where}.name", f"{c}.function.arguments": f"{where}.{arguments}",
    })  # fmt: skip


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``; None for free text."""
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        'text.format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}} (the schema an object)',
        "text.format",
    )


def responses_request(
    body: ResponsesBody, request_id: str, lane_header: str | None
) -> tuple[GenerateRequest, Names]:
    """The daemon request for ``body`` and the :data:`Names` to refuse it with (:func:`as_sent`);
    :class:`ApiError` naming the body's fields.  The lane: ``lane_header`` (X-Uma-Priority),
    else ``service_tier: flex`` → background, else interactive (as chat completions)."""
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id: responses are not stored here; send the whole input",
            "previous_response_id",
        )
    for name, value in (("conversation", body.conversation), ("prompt", body.prompt)):
        if value is not None:  # answered from `input` alone, it would lose what is stored
            raise bad_request(
                f"{name}: nothing is stored here (conversations, prompt templates); send the whole input",
                name,
            )
    if body.store:
        raise bad_request("store: responses are not stored here (send store: false)", "store")
    if body.background:  # it would be polled for by id, and nothing is stored
        raise bad_request("background: responses run while the client waits here (send background: false)",
                          "background")  # fmt: skip
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request("max_output_tokens: must be at least 1", "max_output_tokens")
    names: Names = {
        "messages": "input", "max_tokens": "max_output_tokens", "tool_choice.function": "tool_choice",
        "response_format": "text.format", "response_format.json_schema": "text.format",
    }  # fmt: skip
    lane = lane_from_header(lane_header) or ("background" if body.service_tier == "flex" else "interactive")
    fields: dict[str, Any] = {"id": request_id, "stream": True, "priority": lane}
    fields["messages"] = _turns(body, names)
    shown = shown_tools(body.tools)
    names.update({f"tools[{i}].function": s.where for i, s in enumerate(shown)})
    tools = [s.tool for s in shown]
    choice = chat_tool_choice(body.tool_choice, kinds_of(shown)) if body.tool_choice is not None else None
    if not tools and choice == "required":  # hosted tools only: nothing the model can call
        raise bad_request(
            "tool_choice: required, but no tool here can be called (hosted tools are left out)", "tool_choice"
        )
    if tools:  # else tool_choice and parallel_tool_calls have nothing to say
        fields["tools"] = tools
        if choice is not None:
            fields["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    if body.truncation == "auto":  # as OpenAI: input too long for the context loses its oldest items
        fields["truncate"] = True
    for name in ("temperature", "top_p"):
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    if LOGPROBS in (body.include or ()):
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    if (response_format := _response_format(body.text)) is not None:
        fields["response_format"] = response_format
    try:
        request = msgspec.convert(fields, GenerateRequest)
    except (msgspec.ValidationError, ValueError) as exc:
        raise as_sent(validation_error(exc), names) from None
    if fault := tool_turn_fault(fields["messages"]):  # as OpenAI: a call with no output, or two
        where = names.get(f"messages[{fault[0]}]", "input")
        raise bad_request(f"{where}: {fault[1]}", where)
    return request, names


# A chat request's field in an error's message: a path ("at `$.messages[1].content`"), a
# quoted name, or max_tokens (the limits' refusals name it bare).  Not "messages" in prose.
_FIELD = re.compile(
    r"(?:(?<=\$\.)|(?<=`))(?:messages|max_tokens|tools|tool_choice|response_format)(?:\[\d+\]|\.\w+)*"
    r"|(?<!\w)max_tokens(?!\w)"
)
_LAST = re.compile(r"(?:\.\w+|\[\d+\])\Z")  # a path's last step


def _renamed(path: str, names: Names) -> str:
    """``path`` as the client's: its longest prefix that ``names`` holds, replaced."""
    head, tail = path, ""
    while head not in names:
        step = _LAST.search(head)
        if step is None:
            return path
        head, tail = head[: step.start()], head[step.start() :] + tail
    return names[head] + tail


def as_sent(error: ApiError, names: Names) -> ApiError:
    """``error`` (of the daemon request's checks: --max-tokens, the body's shape) naming the
    fields the client sent: ``max_tokens`` is ``max_output_tokens``, ``messages[i]`` the input
    item it came from, ``tools[i].function`` ``tools[i]``."""
    if error.param is not None:
        error.param = _renamed(error.param, names)
    error.message = _FIELD.sub(lambda found: _renamed(found.group(0), names), error.message)
    return error


# -- the response object -------------------------------------------------------------


def message_item(
    item_id: str, text: str, status: str = "completed", logprobs: Sequence[TokenLogprob] = ()
) -> dict[str, Any]:
    """The answer's message item: ``in_progress`` (empty, as a stream opens it), ``completed``,
    or ``incomplete`` (cut off by max_output_tokens, as OpenAI marks it)."""
    content = [] if status == "in_progress" else [output_text(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def message_status(eos: EosEvent) -> str:
    return "incomplete" if eos.reason == "length" else "completed"


def answer_items(
    msg_id: str, text: str, eos: EosEvent, body: ResponsesBody, logprobs: Sequence[TokenLogprob] = ()
) -> list[dict[str, Any]]:
    """A whole answer's output: its message (also an empty one, unless calls stand in its
    place), then its calls.  A stream sends the same items."""
    whole = message_item(msg_id, text, message_status(eos), logprobs)
    return ([whole] if text or not eos.tool_calls else []) + call_items(eos, body.tools)


def output_text(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """A text part; ``logprobs``: its tokens' (with include's LOGPROBS; else none)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def response_object(
    response_id: str, created: int, body: ResponsesBody, output: list[dict[str, Any]], eos: EosEvent | None
) -> dict[str, Any]:
    """The response; ``eos`` None: just created (``in_progress``)."""
    incomplete = eos is not None and eos.reason == "length"  # tool calls cut off too
    usage = None
    if eos is not None:
        u = eos.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    status = "in_progress" if eos is None else "incomplete" if incomplete else "completed"
    # Only for a completed one, as OpenAI's: its arrival plus how long it took.
    completed_at = created + int(eos.timings.total_ms // 1000) if eos and status == "completed" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": completed_at,
        "model": body.model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": usage,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "store": False,
        "metadata": body.metadata or {},
        "text": body.text or {"format": {"type": "text"}},
        # The rest of what the request set, echoed as OpenAI's response does.
        "background": False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},  # this model does not reason aloud
        "service_tier": "flex" if body.service_tier == "flex" else "default",
        "top_logprobs": body.top_logprobs,
        "truncation": body.truncation or "disabled",
        "user": body.user,
    }


def failed_object(
    response_id: str,
    created: int,
    body: ResponsesBody,
    output: list[dict[str, Any]],
    status: int,
    message: str,
) -> dict[str, Any]:
    """The response of a stream that failed midway (``response.failed``, of an HTTP ``status``):
    clients such as Codex wait for it, or ``response.completed``, and read ``error``, whose
    ``code`` is one of OpenAI's (the daemon's own is in the message)."""
    code = "rate_limit_exceeded" if status == 429 else "server_error"
    failed = response_object(response_id, created, body, output, None)
    return {**failed, "status": "failed", "error": {"code": code, "message": message}}


def now() -> int:
    return int(time.time())
