"""A request's tools on their way through the daemon: into the prompt, into its grammar, and
back out of the generated text (the families and formats are protocol/tools.py's, the
reading protocol/tool_text.py's)."""

from __future__ import annotations

import json
import secrets
from typing import Any

import msgspec

from ..engine.base import Engine
from ..engine.constraints import ConstraintError, ModelVocabulary, OutputConstraint, lark_constraint
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import GenerateRequest, ToolCall, ToolCallFunction
from ..protocol.tool_text import parse_tool_calls
from ..protocol.tool_turns import UNANSWERED_AT_END, name_results, nine_character_ids
from ..protocol.tools import (
    CALL_MARKERS,
    TOOL_GRAMMAR_ERROR,
    TOOL_GRAMMAR_KIND,
    ToolFormat,
    generic_instructions,
    tool_call_grammar,
    tool_format_of,
)
from .samplers import format_schema, formatted


def tool_format(engine: Engine, request: GenerateRequest) -> ToolFormat | None:
    """How the model writes tool calls, for a request that offers it tools; else None."""
    return template_family(engine, request) if request.uses_tools else None


def template_source(engine: Engine, request: GenerateRequest) -> str | None:
    """The chat template ``request`` is rendered with: for a request that offers tools, the
    GGUF's ``tool_use`` one where it has one in a family read back (Hermes 2 Pro / 3; the
    engine renders it when given the tools); else the default, and a family not read back
    (Command-R's) gets the generic format with it."""
    tools = engine.tool_template_source
    if request.uses_tools and tool_format_of(tools) != "generic":
        return tools
    return engine.chat_template_source


def template_family(engine: Engine, request: GenerateRequest) -> ToolFormat | None:
    """The family the request's chat template writes tool calls in, offered tools or not."""
    return tool_format_of(template_source(engine, request))


def template_format(engine: Engine, request: GenerateRequest) -> ToolFormat | None:
    """``generic`` when the request's chat template cannot render earlier tool calls itself
    (its source never reads ``tool_calls``), whatever the request offers; else None.  A
    template may render calls and results without rendering a tools list."""
    source = template_source(engine, request)
    return "generic" if not source or "tool_calls" not in source else None


def generic_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """A turn for a template that cannot render tools: the calls an assistant made, and a
    tool's result, written into the text as the generic format's JSON (llama.cpp's
    ``{"tool_calls": ...}`` and ``{"tool_response": ...}``); the template rendered an
    assistant turn that only called a tool as an empty one."""
    if turn.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in turn["tool_calls"]
        ]
        said = turn.get("content") or ""
        content = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        rest = {k: v for k, v in turn.items() if k not in ("tool_calls", "content")}
        return {**rest, "content": f"{said}\n{content}" if said else content}
    if turn["role"] == "tool":
        response = {"tool": turn.get("name") or "", "content": turn.get("content") or ""}
        return {**turn, "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
    return turn


def chat_turns(
    request: GenerateRequest, fmt: ToolFormat | None, template: ToolFormat | None = None,
    family: ToolFormat | None = None,
) -> tuple[list[dict[str, Any]], list[Any] | None]:  # fmt: skip
    """The turns and the tools for the chat template.  A template that cannot render tools
    (``generic``) gets them described in the system message instead.  ``template``:
    ``generic`` when the template cannot render earlier calls (``template_format``): they and
    their results are then written into the turns' text whether or not this request offers
    tools, or the model would not see them.  ``family``: the template's (``tool_format_of``),
    whose history may need its own call ids (Mistral's: nine characters)."""
    assert request.messages is not None
    last = request.messages[-1]
    if last.role == "assistant" and last.tool_calls:  # it was continued as the answer's start
        raise UmaError(ErrorCode.SCHEMA, UNANSWERED_AT_END, request_id=request.id)
    turns = name_results([m.template_fields() for m in request.messages])
    if template == "generic":  # one that renders calls itself gets them as they are (llama.cpp too)
        turns = [generic_turn(turn) for turn in turns]
    if "mistral" in (fmt, family):
        turns = nine_character_ids(turns)
    if fmt is None or request.tools is None:
        return turns, None
    if fmt != "generic":
        return turns, [_template_tool(tool) for tool in msgspec.to_builtins(request.tools)]
    instructions = generic_instructions(request.tools, request.tool_choice, formatted(request))
    if turns and turns[0]["role"] == "system":
        turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{instructions}"}
    else:
        turns.insert(0, {"role": "system", "content": instructions})
    return turns, None


def _template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the template is given it: without ``strict`` unless the client set it (a
    template writing the whole tool out wrote ``"strict": null`` into every prompt)."""
    function = tool["function"]
    if function.get("strict") is None:
        tool = {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
    return tool


def tool_constraint(
    request: GenerateRequest, fmt: ToolFormat | None, vocabulary: ModelVocabulary | None = None
) -> OutputConstraint | None:
    """The grammar a tool-calling answer must follow, where it must follow one: a call, or
    (with a ``response_format``) a direct answer in that format.  ``vocabulary``: the
    model's, whose special tokens the grammar names where the family's markers are ones."""
    if fmt is None or request.tools is None:
        return None
    special = {}
    if vocabulary is not None:
        for text in CALL_MARKERS.get(fmt, ()):
            if (token := vocabulary.special_token(text)) is not None:
                special[text] = token
    try:
        answer = (format_schema(request) or {"type": "object"}) if formatted(request) else None
        grammar = tool_call_grammar(
            fmt, request.tools, request.tool_choice, request.parallel_tool_calls, answer, special
        )
    except ConstraintError as exc:
        raise UmaError(ErrorCode.GRAMMAR, str(exc), request_id=request.id) from None
    except RecursionError:  # schemas rewritten in Python: a nesting msgspec took can be too deep
        message = f"{TOOL_GRAMMAR_ERROR}: a tool's parameters are nested too deeply"
        raise UmaError(ErrorCode.GRAMMAR, message, request_id=request.id) from None
    return lark_constraint(grammar, TOOL_GRAMMAR_KIND) if grammar is not None else None


def answer_with_tools(text: str, request: GenerateRequest, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """The answer's content and its tool calls, each with a fresh id."""
    names = [t.function.name for t in request.tools or ()]
    schemas = {t.function.name: t.function.parameters or {} for t in request.tools or ()}  # XML values' types
    content, parsed = parse_tool_calls(text, fmt, names, formatted(request), schemas)
    calls = [
        ToolCall(
            id=f"call_{secrets.token_hex(12)}", function=ToolCallFunction(name=c.name, arguments=c.arguments)
        )
        for c in parsed
    ]
    return content, calls
