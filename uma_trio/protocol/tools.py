"""Tool calls: how a model family writes them and the grammar that makes a model write one
(protocol/tool_text.py reads them back out of the generated text).  Pure: no I/O.

Five families, told apart by the chat template's source:

* ``hermes`` (Hermes, Qwen 2.5/3, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``xml`` (Qwen3-Coder, Qwen 3.5, Nemotron 3 Nano, StepFun 3.5): ``<tool_call>`` blocks holding
  ``<function=NAME>`` and a ``<parameter=KEY>`` element per argument (protocol/xml_calls.py);
* ``llama3`` (Llama 3.1+): one JSON object ``{"name": ..., "parameters": {...}}``, perhaps after
  ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``;
* ``generic``, for a template that cannot render tools (the default model's): the tools are
  described in a system message and the model answers with one JSON object,
  ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"response": "..."}`` (llama.cpp's
  generic format), always under a grammar, so even a small model's answer parses.

With ``tool_choice`` ``required`` or a named function (and always for ``generic``) the answer
is constrained by a Lark grammar whose calls are JSON schemas (llguidance's ``%json``): the
name is one of the tools' and the arguments validate against that tool's ``parameters``.  With
a JSON ``response_format`` too, the grammar also allows a direct answer in that format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from . import xml_calls
from .strict_schema import closed

ToolFormat = Literal["hermes", "xml", "llama3", "mistral", "generic"]
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
_JSON_STYLE = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "coerce_one_of": True,
}


def tool_format_of(template: str | None) -> ToolFormat:
    """The family a chat template's tool calls belong to, from its source."""
    if not template or "tools" not in template:
        return "generic"  # it does not render tools: describe them in a system message
    if xml_calls.is_xml_template(template):  # <tool_call> blocks too: before Hermes
        return "xml"
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


def generic_instructions(tools: Sequence[Tool], choice: ToolChoice, formatted: bool = False) -> str:
    """The system text that describes the tools to a model whose template cannot.
    ``formatted``: a direct answer is the response format's JSON (tool_call_grammar)."""
    listed = json.dumps([msgspec.to_builtins(t.function) for t in chosen_tools(tools, choice)], indent=1)
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    if choice == "auto":
        direct = (
            "with your answer in the JSON format asked for" if formatted else '{"response": "<your answer>"}'
        )
        how = f"To call tools, answer {calls}. To answer directly, answer {direct}."
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
    return {_def(i): _rebased(tool_schema(tool), f"#/$defs/{_def(i)}") for i, tool in enumerate(tools)}


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


def _xml_rules(index: int, tool: Tool, parameters: dict[str, Any]) -> list[str]:
    """The XML family's rules for a call of ``tool``, whose ``parameters`` are the grammar's
    definition ``_def(index)``: a JSON value's schema points into it, and takes only it."""
    defs = {_def(index): parameters}
    return xml_calls.function_rules(index, tool.function.name, parameters, lambda schema: _json(schema, defs))


def _json(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": _JSON_STYLE, **schema, "$defs": defs})


# The text each family's calls are marked with, which a model's vocabulary may hold as one
# special token (Qwen's <tool_call>, Mistral's [TOOL_CALLS]): a grammar must then name it.
CALL_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "xml": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]",),
}


def tool_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    choice: ToolChoice,
    parallel: bool,
    answer: dict[str, Any] | None = None,
    special: Mapping[str, int] | None = None,
) -> str | None:
    """A Lark grammar (llguidance's dialect) for the answer, or None to leave it free.
    ``answer``: the JSON schema a direct answer (no call) must match, the request's
    ``response_format``; None: free text.  A call, when the model must make one, is never
    bound by it (OpenAI's reading: the format is the final answer's).  ``special``: the
    markers (CALL_MARKERS) the model's vocabulary holds as special tokens, and their ids."""

    def marker(text: str) -> str:
        token = (special or {}).get(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    chosen = chosen_tools(tools, choice)
    must_call = choice == "required" or isinstance(choice, NamedToolChoice)
    if not chosen or (fmt != "generic" and not must_call and answer is None):
        return None
    # Or a direct answer in the format: its own %json document, whose refs stay its own.
    formatted = "" if must_call or answer is None else f" | {_json(answer, answer.get('$defs', {}))}"
    parallel = parallel and not isinstance(choice, NamedToolChoice)  # the named call, once
    key = "parameters" if fmt == "llama3" else "arguments"
    many = "+" if parallel else ""
    defs = _tool_defs(chosen)
    if fmt == "xml":  # each value its own: text, or JSON against its property's schema
        rules = [rule for i, tool in enumerate(chosen) for rule in _xml_rules(i, tool, defs[_def(i)])]
        opens, closes = marker("<tool_call>"), marker("</tool_call>")
        return xml_calls.call_grammar(len(chosen), rules, opens, closes, many, formatted)
    one_of = [_call_schema(i, t, key) for i, t in enumerate(chosen)]
    call = _json({"anyOf": one_of}, defs)
    if fmt == "hermes":
        opens, closes = marker("<tool_call>"), marker("</tool_call>")
        return f'start: call{many}{formatted}\ncall: {opens} "\\n" {call} ("\\n" {closes} "\\n")?\n'
    if fmt == "llama3":
        return f"start: {call}{formatted}\n"
    items: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    if fmt == "mistral":
        return f"start: {marker('[TOOL_CALLS]')}? {_json(items, defs)}{formatted}\n"
    calls = {
        "type": "object",
        "properties": {"tool_calls": items},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if must_call or formatted:
        return f"start: {_json(calls, defs)}{formatted}\n"
    answer = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return f"start: {_json({'anyOf': [calls, answer]}, defs)}\n"


TOOL_GRAMMAR_KIND = "tool call grammar"  # the constraint's kind, in its errors' words
TOOL_GRAMMAR_ERROR = f"invalid {TOOL_GRAMMAR_KIND}"
_LOCATION = re.compile(r"^at \d+\(\d+\): ")  # a place in the grammar text, which is ours


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of ``tool``'s arguments, as the call grammar holds it (objects closed:
    a strict tool's all, another's where they list their properties, as llama.cpp's converter
    reads them), before its move under the grammar's ``$defs``."""
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return closed(parameters, bare=bool(tool.function.strict))  # type: ignore[no-any-return]


def tool_fault(index: int, error: str) -> str:
    """A tool's schema error (compiled alone), naming the request's field; in backticks, so a
    route that calls the field otherwise can rename it."""
    return f"{TOOL_GRAMMAR_ERROR}: `tools[{index}].function.parameters`: {error}"


def tool_error_words(message: str) -> str:
    """A call grammar's compile error when no tool's schema fails alone (those are named by
    :func:`tool_fault`): its first line, without the place in the grammar text (the rest
    quotes the grammar built here, which the request never saw)."""
    head, _, detail = message.strip().splitlines()[0].partition(": ")
    detail = _LOCATION.sub("", detail)
    return f"{head}: {detail}" if detail else head
