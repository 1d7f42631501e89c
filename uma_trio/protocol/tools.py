"""Tool calls: how a model family writes them, the grammar that makes a model write one, and
reading them back out of the generated text.  Pure: no I/O.

Four families, told apart by the chat template's source:

* ``hermes`` (Hermes, Qwen 2.5/3, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``llama3`` (Llama 3.1+): one JSON object ``{"name": ..., "parameters": {...}}``, perhaps after
  ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``;
* ``generic``, for a template that cannot render tools (the default model's): the tools are
  described in a system message and the model answers with one JSON object,
  ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"response": "..."}`` (llama.cpp's
  generic format), always under a grammar, so even a small model's answer parses.

With ``tool_choice`` ``required`` or a named function (and always for ``generic``) the answer
is constrained by a Lark grammar whose calls are JSON schemas (llguidance's ``%json``): the
name is one of the tools' and the arguments validate against that tool's ``parameters``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .strict_schema import closed

ToolFormat = Literal["hermes", "llama3", "mistral", "generic"]
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}\Z")]


class FunctionSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool the model may call (OpenAI's ``tools[i]``)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChosenFunction(Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"] = "function"
    function: ChosenFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice

# JSON as models write it, no free whitespace (engine/constraints.py says why).
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def tool_format_of(template: str | None) -> ToolFormat:
    """The family a chat template's tool calls belong to, from its source."""
    if not template or "tools" not in template:
        return "generic"  # it does not render tools: describe them in a system message
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "generic"


def chosen_tools(tools: Sequence[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the model may call under ``choice``."""
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return [] if choice == "none" else list(tools)


def generic_instructions(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """The system text that describes the tools to a model whose template cannot."""
    listed = json.dumps([msgspec.to_builtins(t.function) for t in chosen_tools(tools, choice)], indent=1)
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    if choice == "auto":
        how = f'To call tools, answer {calls}. To answer directly, answer {{"response": "<your answer>"}}.'
    else:
        how = f"Call a tool: answer {calls}."
    return f"You can call these tools:\n{listed}\nAnswer with one JSON object. {how}"


def _call_schema(index: int, tool: Tool, arguments_key: str) -> dict[str, Any]:
    """A call of ``tool`` (the ``index``-th offered): its arguments are its parameters, kept
    under the grammar's root ``$defs`` (:func:`_tool_defs`)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            arguments_key: {"$ref": f"#/$defs/{_def(index)}"},
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _def(index: int) -> str:
    return f"uma_tool_{index}"


def _tool_defs(tools: Sequence[Tool]) -> dict[str, Any]:
    """Each tool's parameters as a definition of the call grammar's root schema.  A tool's
    own references (``#/$defs/...``, ``#/definitions/...``, ``#`` itself) point at its
    parameters' root; nested in the call's schema they pointed at the grammar's, and a tool
    whose schema used ``$defs`` (as pydantic writes nested models) was refused ("Pointer
    '/$defs/A' does not exist").  Moved under ``#/$defs/uma_tool_N``, they are rewritten to
    match.  A ``strict`` tool's objects are closed (protocol/strict_schema.py)."""
    defs = {}
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        defs[_def(i)] = _rebased(
            closed(parameters) if tool.function.strict else parameters, f"#/$defs/{_def(i)}"
        )
    return defs


_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: kept as they are


def _rebased(node: Any, root: str) -> Any:
    """``node`` with every pointer ``$ref`` into its own document (``#``, ``#/...``) moved under
    ``root``.  Left alone: anchors (``#name``), other documents' refs, data (``const``,
    ``enum``...), and a schema with its own ``$id``, whose refs are relative to it anyway."""
    if isinstance(node, dict):
        if "$id" in node:
            return node
        return {
            key: value if key in _DATA else _moved(value, root) if key == "$ref" else _rebased(value, root)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rebased(item, root) for item in node]
    return node


def _moved(ref: Any, root: str) -> Any:
    return root + ref[1:] if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) else ref


def _json(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": _JSON_STYLE, **schema, "$defs": defs})


def tool_call_grammar(
    fmt: ToolFormat, tools: Sequence[Tool], choice: ToolChoice, parallel: bool
) -> str | None:
    """A Lark grammar (llguidance's dialect) for the answer, or None to leave it free."""
    chosen = chosen_tools(tools, choice)
    must_call = choice == "required" or isinstance(choice, NamedToolChoice)
    if not chosen or (fmt != "generic" and not must_call):
        return None
    parallel = parallel and not isinstance(choice, NamedToolChoice)  # the named call, once
    key = "parameters" if fmt == "llama3" else "arguments"
    defs = _tool_defs(chosen)
    one_of = [_call_schema(i, t, key) for i, t in enumerate(chosen)]
    call = _json({"anyOf": one_of}, defs)
    many = "+" if parallel else ""
    if fmt == "hermes":
        return f'start: call{many}\ncall: "<tool_call>\\n" {call} "\\n</tool_call>\\n"?\n'
    if fmt == "llama3":
        return f"start: {call}\n"
    items: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    if fmt == "mistral":
        return f'start: "[TOOL_CALLS]"? {_json(items, defs)}\n'
    calls = {
        "type": "object",
        "properties": {"tool_calls": items},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if must_call:
        return f"start: {_json(calls, defs)}\n"
    answer = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return f"start: {_json({'anyOf': [calls, answer]}, defs)}\n"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# What a generic answer opens with (tool_call_grammar), without whitespace: an answer cut off
# (max_tokens) before its first call or its text began is one of their prefixes.
_GENERIC_CALLS = '{"tool_calls":['
_GENERIC_ANSWER = '{"response":"'

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def parse_tool_calls(text: str, fmt: ToolFormat, names: Sequence[str]) -> tuple[str, list[ParsedCall]]:
    """The content outside tool calls and the calls, from a generated text.  A whole call that
    does not parse, or names no tool of the request, stays content: nothing is lost.  A
    generic answer cut off (max_tokens) inside its ``{"tool_calls": [`` list keeps the calls
    written whole; the one being written is dropped, and there is no content."""
    if fmt == "hermes":
        blocks = list(_HERMES.finditer(text))
        calls = [c for c in (_call(_load(m.group(1)), names) for m in blocks) if c]
        if not calls:
            return text, calls
        # Trimmed as ToolTextFilter streams it, so streamed content is this too: whitespace at
        # the end, and before the first call if nothing else is (it held both back).
        content = _HERMES.sub("", text).rstrip()
        return (content if text[: blocks[0].start()].strip() else content.lstrip()), calls
    stripped = text.strip()
    opened = False  # a generic answer cut off inside its calls: no text of its own to show
    if fmt == "llama3":
        body = stripped.removeprefix("<|python_tag|>")
        value = _load(body)
        objects = value if isinstance(value, list) else [value]
    elif fmt == "mistral":
        body = stripped.removeprefix("[TOOL_CALLS]").lstrip()
        value = _load(body)
        objects = value if isinstance(value, list) else _leading_items(body, 1)
    else:
        value = _load(stripped)
        if isinstance(value, dict) and isinstance(value.get("response"), str) and len(value) == 1:
            return value["response"], []
        if isinstance(value, dict):
            objects = value.get("tool_calls", [])
        elif answer := re.match(r'\{\s*"response"\s*:\s*"', stripped):
            # Cut off (max_tokens) inside the answer: its text, not the JSON around it.
            return _cut_string(stripped[answer.end() :]), []
        elif _GENERIC_ANSWER.startswith(compact := re.sub(r"\s+", "", stripped)) and compact:
            return "", []  # cut off before the answer's text began
        else:  # cut off in the middle of a list: the calls written whole
            opening = re.match(r'\{\s*"tool_calls"\s*:\s*\[', stripped)
            objects = _leading_items(stripped, opening.end()) if opening else []
            # Or before the list began ('{"tool_calls":'): a call, none of it written yet.
            opened = opening is not None or _GENERIC_CALLS.startswith(compact)
    calls = [c for c in (_call(o, names) for o in objects) if c] if isinstance(objects, list) else []
    # The call being written when it was cut is lost (docs/HTTP.md), not shown as its JSON.
    return ("" if (calls or opened) and len(calls) == len(objects) else text), calls


def _leading_items(text: str, start: int) -> list[Any]:
    """The JSON values that stand whole at ``start`` and after, separated by commas (a list
    whose end was cut off: its complete items)."""
    decoder, at = json.JSONDecoder(), start
    items: list[Any] = []
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
        rest = text[at:].lstrip()
        if not rest.startswith(","):
            return items
        at = len(text) - len(rest[1:].lstrip())


def _cut_string(body: str) -> str:
    """The text of a JSON string from after its opening quote, whose end may be missing: up
    to its closing quote, or all that decodes (an escape cut short is dropped)."""
    decoder = json.JSONDecoder(strict=False)
    try:
        text: str = decoder.raw_decode('"' + body)[0]
        return text
    except ValueError:
        pass
    for end in range(len(body), max(len(body) - len("\\uXXXX"), 0) - 1, -1):
        try:
            cut: str = decoder.decode('"' + body[:end] + '"')
            return cut
        except ValueError:
            continue
    return ""


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(value: Any, names: Sequence[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _load(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(str(value["name"]), json.dumps(arguments, ensure_ascii=False))


_MARKERS: dict[ToolFormat, str] = {
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3": "<|python_tag|>",
}


class ToolTextFilter:
    """Streams the content of an answer that may hold tool calls: text is passed on until it
    could be the start of a call, and from a call's marker on held until the end, when the
    parsed answer says what it was (a generic answer is JSON: held from its start).  Hermes
    content is trimmed around its calls (parse_tool_calls): whitespace is held until text
    follows it, as it may be what is trimmed."""

    def __init__(self, fmt: ToolFormat) -> None:
        self._fmt = fmt
        self._held = ""
        self._holding = fmt == "generic"
        self.sent = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` to send as content now."""
        if self._holding:
            self._held += text
            return ""
        pending = self._held + text
        start, whole = self._call_start(pending)
        if self._fmt == "hermes":
            start = len(pending[:start].rstrip())
        out, self._held = pending[:start], pending[start:]
        self._holding = whole
        self.sent += out
        return out

    def _call_start(self, text: str) -> tuple[int, bool]:
        """Where a call may begin (``len(text)``: nowhere), and whether it surely does."""
        if self._fmt == "llama3" and not self.sent.strip() and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip()), True  # Llama 3 answers a call with bare JSON
        marker = _MARKERS.get(self._fmt, "")
        at = text.find(marker) if marker else -1
        if at >= 0:
            return at, True
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker cut at the end
            if text.endswith(marker[:k]):
                return len(text) - k, False
        return len(text), False

    def rest(self, content: str) -> str:
        """At the end: what of the answer's ``content`` has not been sent yet (with or without
        calls: a Hermes answer may go on after them)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""
