"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): its bodies
as daemon requests, its answers and its stream events.  Pure.

Content blocks map onto the daemon's chat turns: ``text`` blocks are a turn's text, an
assistant's ``tool_use`` blocks its tool calls (``input`` as JSON text), a user's
``tool_result`` blocks ``tool`` turns with their ``tool_use_id``. ``tool_choice`` ``auto``,
``any`` (any tool: ``required``), ``tool`` (a named one) and ``none``. Images and documents
are refused by name, but inside a ``tool_result`` they become a placeholder text.
``thinking`` is accepted and ignored (this model does not think aloud), and the ``thinking``
/ ``redacted_thinking`` blocks a client replays are dropped. ``max_tokens`` is a ceiling, as
Ollama's num_predict: past --max-tokens or the room the prompt leaves, the answer is cut and
stops for ``max_tokens``. ``output_config.format`` (or the beta's ``output_format``) is
structured output, a strict JSON schema.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

import msgspec
from msgspec import Struct

from .messages import EosEvent, GenerateRequest
from .ollama import Limits, Options, answer_bounds
from .openai_errors import ApiError, bad_request, client_param
from .tool_turns import tool_turn_fault

# Blocks of a turn's text are paragraphs: Claude Code's system blocks and its
# <system-reminder> before the prompt must not run together.
_JOIN = "\n\n"
_THINKING = ("thinking", "redacted_thinking")  # replayed by clients; nothing to render


class MessagesBody(Struct, kw_only=True):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Structured output: output_config.format (its effort is ignored), or the beta's
    # output_format (structured-outputs-2025-11-13).
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None  # the MCP connector's: refused (no tool would run)


# What a tool's image or document becomes: refused, it stayed in the history and refused every
# later request of the session (Claude Code's Read tool returns an image file as one).
_OMITTED = "[{kind} omitted: this model reads text only]"
TOOL_ERROR = "Error: "  # before a tool_result's text when its is_error is true


def _text_of(content: Any, where: str, *, omit: frozenset[str] = frozenset()) -> str:
    """A string, or text blocks joined; blocks of a kind in ``omit`` become a placeholder."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        kind = kind if isinstance(kind, str) else repr(kind)  # a list is no block type, and unhashable
        if kind in omit:
            parts.append(_OMITTED.format(kind=kind))
            continue
        if kind != "text":
            raise bad_request(f"{where}[{i}]: a {kind!r} block is not supported here; only text", where)
        parts.append(_block_text(block, f"{where}[{i}]"))
    return _JOIN.join(parts)


def _block_text(block: dict[str, Any], where: str) -> str:
    """A text block's ``text``, which Anthropic's API requires (a block without it was read as "")."""
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}: a text block needs `text` (a string)", f"{where}.text")
    return text


_TOOL_MEDIA = frozenset({"image", "document"})


def _turns(body: MessagesBody) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    wheres: list[str] = []  # each turn's place in the request, for a tool-order fault
    if body.system:
        turns.append({"role": "system", "content": _text_of(body.system, "system")})
        wheres.append("system")
    for i, message in enumerate(body.messages):
        role, content, where = message.get("role"), message.get("content"), f"messages[{i}]"
        if content is None:  # Anthropic's API requires it (it was read as an empty turn)
            raise bad_request(f"{where}.content is required", f"{where}.content")
        if role == "system":  # Claude Code sends its environment so, after the prompt
            _add_system(turns, _text_of(content, f"{where}.content"))
            wheres[len(turns) - 1 :] = [where]
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user, assistant or system", f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        text, calls, results = [], [], 0
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(_block_text(block, f"{where}.content[{j}]"))
            elif kind in _THINKING:
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append(_call(block, f"{where}.content[{j}].input"))
            elif kind == "tool_result" and role == "user":
                turns.append(_result(block, f"{where}.content[{j}]"))
                wheres.append(f"{where}.content[{j}].tool_use_id")
                results += 1
            else:
                raise bad_request(
                    f"{where}.content[{j}]: a {kind!r} block is not supported", f"{where}.content"
                )
        last = i == len(body.messages) - 1
        if not (text or calls or results or isinstance(content, str) or (last and role == "assistant")):
            # As Anthropic: a turn vanished, and a user turn's loss made the answer before it a prefill.
            raise bad_request(f"{where}.content: a message needs content (text, tool use or result)",
                              f"{where}.content")  # fmt: skip
        if last and role == "assistant" and _JOIN.join(text) != _JOIN.join(text).rstrip():
            raise bad_request(f"{where}: a final assistant message (a prefill) cannot end with whitespace",
                              f"{where}.content")  # fmt: skip
        if not (text or calls or isinstance(content, str)):
            continue
        turn: dict[str, Any] = {"role": role, "content": _JOIN.join(text)}
        if calls:
            turn["tool_calls"] = calls
        previous = turns[-1] if turns and not results else None
        if previous and previous["role"] == role and not calls and "tool_calls" not in previous:
            previous["content"] += _JOIN + turn["content"]  # as Anthropic, consecutive turns are one
            continue
        turns.append(turn)
        wheres.append(where)
    if fault := tool_turn_fault(turns):  # as Anthropic: a result with no call, a call with no result
        raise bad_request(f"{wheres[fault[0]]}: {fault[1]}", wheres[fault[0]])
    return turns


def _result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_result`` block as a ``tool`` turn.  The model must tell a tool that failed
    from one that answered (``is_error`` was dropped): ``Error:`` before its text."""
    result = _text_of(block.get("content", ""), f"{where}.content", omit=_TOOL_MEDIA)
    failed = block.get("is_error", False)
    if not isinstance(failed, bool):
        raise bad_request(f"{where}.is_error must be true or false", f"{where}.is_error")
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.tool_use_id is required (the id of the tool_use it answers)",
                          f"{where}.tool_use_id")  # fmt: skip
    return {"role": "tool", "tool_call_id": call_id,
            "content": f"{TOOL_ERROR}{result}" if failed else result}  # fmt: skip


def _add_system(turns: list[dict[str, Any]], text: str) -> None:
    """A system message among ``messages`` is a system turn where it stands; one that follows
    only system turns joins them (chat templates take a single system message, first)."""
    if turns and all(t["role"] == "system" for t in turns):
        turns[-1]["content"] += _JOIN + text
    else:
        turns.append({"role": "system", "content": text})


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_use`` block as a chat tool call; its ``input`` must be an object."""
    given = block.get("input", {})
    if not isinstance(given, dict):
        raise bad_request(f"{where} must be an object", where)
    arguments = json.dumps(given)
    return {
        "id": str(block.get("id", "")),
        "function": {"name": block.get("name", ""), "arguments": arguments},
    }


def _client_tools(body: MessagesBody) -> list[dict[str, Any]]:
    """The tools the model is shown: the client's own (``type`` absent or ``custom``).  A typed
    tool is Anthropic's (web search, code execution: run on Anthropic's side; bash, text editor,
    computer: a schema only Anthropic knows), left out as the Responses route leaves OpenAI's
    hosted tools out: shown, the model called a tool the client never runs."""
    shown = []
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object", f"tools[{i}]")
        if tool.get("type", "custom") != "custom":
            continue
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema: an object is required", f"tools[{i}].input_schema")
        shown.append(tool)
    return shown


def _tool_fields(body: MessagesBody) -> dict[str, Any]:
    shown = _client_tools(body)
    if not shown:
        if body.tool_choice and body.tool_choice.get("type") in ("tool", "any"):
            given = "only Anthropic's own `tools` are" if body.tools else "no `tools` are"
            raise bad_request(f"tool_choice asks for a tool, but {given} given", "tool_choice")
        return {}
    tools = [
        {"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": t["input_schema"],
        }}
        for t in shown
    ]  # fmt: skip
    fields: dict[str, Any] = {"tools": tools}
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind == "any":
        fields["tool_choice"] = "required"
    elif kind == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    elif kind in ("auto", "none"):
        fields["tool_choice"] = kind
    else:
        raise bad_request(f"tool_choice.type {kind!r}: auto, any, tool or none", "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    return fields


def _format_fields(body: MessagesBody) -> dict[str, Any]:
    """``output_config.format`` (or the beta's ``output_format``) as a ``response_format``:
    Anthropic's structured output, whose objects are closed (its schemas must say
    ``additionalProperties: false``): a strict schema."""
    given = [
        (where, fmt)
        for where, fmt in (
            ("output_config.format", (body.output_config or {}).get("format")),
            ("output_format", body.output_format),
        )
        if fmt is not None
    ]
    if not given:
        return {}
    if len(given) > 1:
        raise bad_request("give `output_config.format` or `output_format`, not both", "output_format")
    where, fmt = given[0]
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', where)
    spec = {"name": "output", "schema": fmt["schema"], "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _check_fields(body: MessagesBody, count_only: bool) -> None:
    """Refusals named by the client's own fields (the translated request's would name ours),
    in Anthropic's ranges."""
    if body.max_tokens is None and not count_only:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise bad_request("max_tokens: must be at least 1", "max_tokens")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise bad_request("temperature: must be between 0 and 1", "temperature")
    for i, stop in enumerate(body.stop_sequences or ()):
        if not stop:
            raise bad_request(f"stop_sequences[{i}]: must not be empty", f"stop_sequences[{i}]")
    if body.mcp_servers:  # the model would be told of tools nobody runs
        message = "mcp_servers: not supported (no MCP connector runs here); give the tools in `tools`"
        raise bad_request(message, "mcp_servers")


def messages_request(
    body: MessagesBody, request_id: str, *, count_only: bool = False, limits: Limits | None = None
) -> GenerateRequest:
    """The daemon request; a 400 :class:`ApiError` naming the field, or ``msgspec.ValidationError`` /
    ``ValueError`` from the socket protocol's own checks.  With ``limits``, max_tokens is a
    ceiling (cut, never refused); without, it is passed as it is."""
    _check_fields(body, count_only)
    fields: dict[str, Any] = {
        "id": request_id,
        "stream": True,
        "messages": _turns(body),
        **_tool_fields(body),
        **_format_fields(body),
    }
    if body.max_tokens is not None:
        fields["max_tokens"] = body.max_tokens
        fields.update(answer_bounds(Options(num_predict=body.max_tokens), limits))
    for name, field in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if (value := getattr(body, name)) is not None:
            fields[field] = value
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    return msgspec.convert(fields, GenerateRequest)


# -- answers ------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(eos: EosEvent) -> StopReason:
    if eos.tool_calls and eos.reason == "stop":  # calls cut off by max_tokens: "max_tokens"
        return "tool_use"
    if eos.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if eos.reason == "length" else "end_turn"


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def content_blocks(eos: EosEvent, text: str) -> list[dict[str, Any]]:
    """The answer's blocks: its text (if any), then one ``tool_use`` per call."""
    words = eos.content if eos.content is not None else text
    # No text, no block: as the stream sends none (an empty text block, which Anthropic never
    # sends, made the two answers differ).
    blocks: list[dict[str, Any]] = [{"type": "text", "text": words}] if words else []
    for call in eos.tool_calls or ():
        blocks.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.function.name,
                       "input": _input(call.function.arguments)})  # fmt: skip
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def usage_of(eos: EosEvent) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` leaves out the tokens read from the cache (the whole
    prompt is the sum of the three input figures)."""
    cached = eos.usage.cached_tokens
    return {"input_tokens": eos.usage.prompt_tokens - cached, "output_tokens": eos.usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def message(msg_id: str, model: str, eos: EosEvent, text: str) -> dict[str, Any]:
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(eos, text), "stop_reason": stop_reason(eos),
        "stop_sequence": eos.stop_sequence, "usage": usage_of(eos),
    }  # fmt: skip


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event, Anthropic's way: its name, and the type again in the data."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode({"type": name, **data}) + b"\n\n"


def client_error(error: ApiError) -> ApiError:
    """A refusal of the translated request, naming the fields as Anthropic's client sent them:
    ``stop_sequences``, and a tool's ``input_schema`` (the daemon's ``function.parameters``)."""
    error = client_param(error, {"stop": "stop_sequences"})
    for ours, theirs in _TOOL_FIELDS:
        error.message = error.message.replace(ours, theirs)
        error.param = error.param.replace(ours, theirs) if error.param else error.param
    return error


_TOOL_FIELDS = ((".function.parameters", ".input_schema"), (".function.", "."))


def error_body(message_text: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message_text}}
