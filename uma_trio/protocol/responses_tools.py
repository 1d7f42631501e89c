"""The tools of OpenAI's Responses API as chat tools, and their calls back.  Pure.

As Codex sends them: ``function``; ``namespace`` (its functions, shown to the model under a
flat name, :func:`flat_name`, which the answer splits back into ``name`` and ``namespace``);
``custom`` (free-form text in, such as Codex's ``apply_patch``: a function of one string
parameter, :data:`CUSTOM_INPUT`, whose description carries the tool's grammar; its call
comes back as a ``custom_tool_call``).  Hosted tools, which OpenAI runs on its side, are left
out: the daemon runs none of them.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from .messages import EosEvent
from .openai_errors import bad_request

Names = dict[str, str]  # a daemon request's field → the body's field it came from


# Tools the model is not shown: OpenAI's hosted ones (run on OpenAI's side; the daemon runs
# none), and client-run ones whose calls have item shapes of their own (local_shell, shell,
# apply_patch, computer_use).  Codex sends web_search by default: refused, none of its
# requests would be served.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer_use", "computer_use_preview", "mcp",
    "local_shell", "shell", "apply_patch", "tool_search",
})  # fmt: skip
CUSTOM_INPUT = "input"  # the one parameter a custom (free-form) tool's function takes


def flat_name(namespace: str, name: str) -> str:
    """The name the model calls a namespace's function by (``mcp__fs__`` + ``read``)."""
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


def _custom(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A free-form tool as a function of one string; its grammar, if any, told in words."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name: a custom tool needs a name", f"{where}.name")
    about = tool.get("description") or ""
    if not isinstance(about, str):
        raise bad_request(f"{where}.description: a custom tool's description is text", f"{where}.description")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = f"{fmt['syntax']} " if isinstance(fmt.get("syntax"), str) else ""
        about += f"\n\nThe input follows this {syntax}grammar:\n{fmt['definition']}"
    parameters = {
        "type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT], "additionalProperties": False,
    }  # fmt: skip
    return {"type": "function", "function": {"name": tool["name"], "description": about.strip(),
                                             "parameters": parameters}}  # fmt: skip


@dataclass(frozen=True)
class Shown:
    """A tool the model is shown: the chat tool, what the client calls it, where it came from."""

    tool: dict[str, Any]  # chat's {"type": "function", "function": {...}}
    kind: str  # "function" or "custom": the item a call comes back as
    namespace: str | None  # a namespace's function: the call's `namespace`
    where: str  # the client's field (tools[i], tools[i].tools[j])


def shown_tools(given: list[dict[str, Any]] | None) -> list[Shown]:
    """The tools the model is shown for the Responses ``tools`` ``given``: functions, a
    namespace's functions (flat names), custom tools as one-string functions; hosted tools
    left out.  A 400 naming the client's field for a tool that cannot be shown."""
    shown: list[Shown] = []
    for i, tool in enumerate(given or ()):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind in HOSTED_TOOLS:
            continue
        if kind == "function":
            shown.append(Shown(_named(tool, where), "function", None, where))
        elif kind == "namespace":
            shown += _namespace(tool, where)
        elif kind == "custom":
            shown.append(Shown(_custom(tool, where), "custom", None, where))
        else:
            raise bad_request(
                f"{where}: a {kind!r} tool is not supported (function, namespace, custom, or a hosted "
                "tool, which is left out)",
                f"{where}.type",
            )
    seen: dict[str, str] = {}
    for s in shown:
        name = s.tool["function"]["name"]
        if name in seen:
            raise bad_request(f"{s.where}: its name {name!r} is {seen[name]}'s too", f"{s.where}.name")
        seen[name] = s.where
    return shown


def _namespace(tool: dict[str, Any], where: str) -> list[Shown]:
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise bad_request(f"{where}.name: a namespace needs a name", f"{where}.name")
    if not isinstance(inner, list):
        raise bad_request(f"{where}.tools: a namespace's tools are a list", f"{where}.tools")
    shown = []
    for j, tool in enumerate(inner):
        at = f"{where}.tools[{j}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            shown.append(Shown(_named(tool, at, namespace), "function", namespace, at))
        elif not (isinstance(kind, str) and kind in HOSTED_TOOLS):
            raise bad_request(f"{at}: a namespace holds function tools, not {kind!r}", f"{at}.type")
    return shown


def _named(tool: dict[str, Any], where: str, namespace: str = "") -> dict[str, Any]:
    """A function tool (of ``namespace``, if given) as chat's."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name: a function tool needs a name", f"{where}.name")
    spec = {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
    name = flat_name(namespace, tool["name"]) if namespace else tool["name"]
    return {"type": "function", "function": {"name": name, **spec}}


def kinds_of(shown: list[Shown]) -> dict[str, tuple[str, str | None]]:
    """Each name the model may call → how the client calls it: ``(kind, namespace)``."""
    return {s.tool["function"]["name"]: (s.kind, s.namespace) for s in shown}


_CHOICES = 'none, auto, required, {"type": "function", "name": ...} or {"type": "custom", "name": ...}'


def chat_tool_choice(choice: Any, kinds: dict[str, tuple[str, str | None]]) -> Any:
    """OpenAI's ``tool_choice`` of the Responses API as chat's (a namespace's function by its
    flat name), for the tools :func:`kinds_of` gives; others (``allowed_tools``, hosted
    tools' types) are refused by name."""
    if choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("function", "custom"):
        what = f"a {kind!r} tool_choice is not supported" if kind else f"tool_choice {choice!r} is not one"
        raise bad_request(f"{what}; give {_CHOICES}", "tool_choice")
    name, namespace = choice.get("name"), choice.get("namespace")
    if isinstance(name, str) and isinstance(namespace, str) and namespace:
        name = flat_name(namespace, name)
    if not isinstance(name, str) or name not in kinds:
        raise bad_request(f"tool_choice names {name!r}, which is not one of `tools`", "tool_choice.name")
    if kinds[name][0] != kind:
        raise bad_request(
            f"tool_choice: {name!r} is a {kinds[name][0]} tool, not a {kind} one", "tool_choice.type"
        )
    return {"type": "function", "function": {"name": name}}


def new_id(prefix: str) -> str:
    """An item's or response's id (``fc_...``, ``resp_...``)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def call_items(eos: EosEvent, given: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The answer's calls as items: a ``function_call`` (with its ``namespace`` and own name
    for a namespace's function), or a ``custom_tool_call`` whose ``input`` is the text the
    model gave its one parameter (``given``: the request's tools)."""
    kinds = kinds_of(shown_tools(given))  # refused before a call could come, if they were bad
    items = []
    for c in eos.tool_calls or ():
        kind, namespace = kinds.get(c.function.name, ("function", None))  # the model's own word
        if kind == "custom":
            items.append({
                "type": "custom_tool_call", "id": new_id("ctc"), "call_id": c.id,
                "name": c.function.name, "input": custom_input(c.function.arguments), "status": "completed",
            })  # fmt: skip
            continue
        item = {
            "type": "function_call", "id": new_id("fc"), "call_id": c.id, "name": c.function.name,
            "arguments": c.function.arguments, "status": "completed",
        }  # fmt: skip
        if namespace is not None:
            item["name"] = c.function.name.removeprefix(flat_name(namespace, ""))
            item["namespace"] = namespace
        items.append(item)
    return items


def custom_input(arguments: str) -> str:
    """The text of a custom tool's call: its one parameter's, or what the model wrote."""
    try:
        given = json.loads(arguments)
    except ValueError:
        return arguments
    text = given.get(CUSTOM_INPUT) if isinstance(given, dict) else given  # a bare JSON string: its text
    return text if isinstance(text, str) else arguments
