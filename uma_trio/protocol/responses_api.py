"""OpenAI's Responses API, stateless (``POST /v1/responses``): its body as a daemon request, the
response object and its stream events.  Pure.

``input`` is a string or items: messages (``input_text`` / ``output_text`` parts), the
model's earlier ``function_call`` items and their ``function_call_output`` items, which map
onto chat turns, tool calls and ``tool`` turns.  Nothing is stored: ``previous_response_id``
and ``store: true`` are refused by name (a client sends the whole conversation each time).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec
from msgspec import Struct

from .messages import EosEvent, GenerateRequest
from .openai_errors import bad_request


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
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"{where}[{i}]: a {kind!r} part is not supported; only text", where)
        parts.append(str(part.get("text", "")))
    return "\n\n".join(parts)  # paragraphs: parts must not run together


def _turns(body: ResponsesBody) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    if body.instructions:
        turns.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            _add(turns, _message(item, where))
        elif kind == "function_call":
            _add_call(turns, _call(item))
        elif kind == "function_call_output":
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": _text(item.get("output", ""), f"{where}.output"),
                }
            )
        else:
            raise bad_request(f"{where}: an item of type {kind!r} is not supported", where)
    return turns


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    asked = item.get("role", "")
    role = {"developer": "system"}.get(asked, asked) if isinstance(asked, str) else None
    if role not in ("system", "user", "assistant"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
    return {"role": role, "content": _text(item.get("content", ""), f"{where}.content")}


def _add(turns: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    """Leading system turns (``instructions``, then Codex's developer items) are one: chat
    templates take a single system message, first."""
    if turn["role"] == "system" and turns and all(t["role"] == "system" for t in turns):
        turns[-1]["content"] += "\n\n" + turn["content"]
    else:
        turns.append(turn)


def _call(item: dict[str, Any]) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):  # an object where OpenAI sends its JSON text
        arguments = json.dumps(arguments)
    return {
        "id": str(item.get("call_id", "")),
        "function": {"name": item.get("name", ""), "arguments": arguments},
    }


def _add_call(turns: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call belongs to the assistant turn just before it, text and all: a replayed
    ``message`` then its ``function_call`` items are one turn."""
    if turns and turns[-1]["role"] == "assistant":
        turns[-1].setdefault("tool_calls", []).append(call)
    else:
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})


def responses_request(body: ResponsesBody, request_id: str) -> GenerateRequest:
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id: responses are not stored here; send the whole input",
            "previous_response_id",
        )
    if body.store:
        raise bad_request("store: responses are not stored here (send store: false)", "store")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request("max_output_tokens: must be at least 1", "max_output_tokens")
    fields: dict[str, Any] = {"id": request_id, "stream": True, "messages": _turns(body)}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: only function tools are supported", f"tools[{i}].type")
            tools.append(
                {
                    "type": "function",
                    "function": {
                        k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
                    },
                }
            )
        fields["tools"] = tools
        choice = body.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
        elif choice is not None:
            fields["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p"):
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return msgspec.convert(fields, GenerateRequest)


# -- the response object -------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status != "completed" else [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_items(eos: EosEvent) -> list[dict[str, Any]]:
    return [
        {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": c.id,
            "name": c.function.name,
            "arguments": c.function.arguments,
            "status": "completed",
        }
        for c in eos.tool_calls or ()
    ]


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
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": body.model,
        "status": "in_progress" if eos is None else "incomplete" if incomplete else "completed",
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
