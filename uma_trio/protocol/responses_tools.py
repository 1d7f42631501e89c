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
from typing import Any

from .openai_errors import bad_request

Names = dict[str, str]  # a daemon request's field → the body's field it came from


# Tools OpenAI runs on its side; the daemon runs none, so the model is not shown them (Codex
# sends web_search by default: refused, no request of Codex's would be served).
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
    about = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        about += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    parameters = {
        "type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT], "additionalProperties": False,
    }  # fmt: skip
    return {"type": "function", "function": {"name": tool["name"], "description": about.strip(),
                                             "parameters": parameters}}  # fmt: skip


def chat_tools(given: list[dict[str, Any]] | None, names: Names) -> list[dict[str, Any]]:
    """The chat tools the model is shown for the Responses ``tools`` ``given``: functions, a
    namespace's functions (flat names), custom tools as one-string functions; hosted tools
    left out.  ``names`` learns which of ``given`` each came from."""
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(given or ()):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            continue
        if kind == "function":
            tools.append(_named(tool, where, names, len(tools)))
        elif kind == "namespace" and isinstance(tool.get("name"), str) and tool["name"]:
            for j, inner in enumerate(tool.get("tools") or ()):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    tools.append(_named(inner, f"{where}.tools[{j}]", names, len(tools), tool["name"]))
        elif kind == "custom":
            names[f"tools[{len(tools)}].function"] = where
            tools.append(_custom(tool, where))
        else:
            raise bad_request(
                f"{where}: a {kind!r} tool is not supported (function, namespace, custom, or a hosted "
                "tool, which is left out)",
                f"{where}.type",
            )
    return tools


def _named(tool: dict[str, Any], where: str, names: Names, index: int, namespace: str = "") -> dict[str, Any]:
    """A function tool (of ``namespace``, if given), as chat's ``tools[index]``."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name: a function tool needs a name", f"{where}.name")
    names[f"tools[{index}].function"] = where
    spec = {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
    name = flat_name(namespace, tool["name"]) if namespace else tool["name"]
    return {"type": "function", "function": {"name": name, **spec}}


def tool_kinds(given: list[dict[str, Any]] | None) -> dict[str, tuple[str, str | None]]:
    """Each flat name the model may call → how the answer names the call: ``("custom", None)``
    for a custom tool, ``("function", namespace)`` for a namespace's function (plain functions
    are left out: their calls are what they were)."""
    kinds: dict[str, tuple[str, str | None]] = {}
    for tool in given or ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "custom" and isinstance(tool.get("name"), str):
            kinds[tool["name"]] = ("custom", None)
        elif kind == "namespace" and isinstance(tool.get("name"), str):
            for inner in tool.get("tools") or ():
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    kinds[flat_name(tool["name"], inner["name"])] = ("function", tool["name"])
    return kinds


_CHOICES = 'none, auto, required, {"type": "function", "name": ...} or {"type": "custom", "name": ...}'


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    """OpenAI's ``tool_choice`` of the Responses API as chat's (a namespace's function by its
    flat name); others (``allowed_tools``, hosted tools' types) are refused by name."""
    if choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("function", "custom"):
        what = f"a {kind!r} tool_choice is not supported" if kind else f"tool_choice {choice!r} is not one"
        raise bad_request(f"{what}; give {_CHOICES}", "tool_choice")
    name, namespace = choice.get("name"), choice.get("namespace")
    if isinstance(name, str) and isinstance(namespace, str) and namespace:
        name = flat_name(namespace, name)
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not one of `tools`", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def custom_input(arguments: str) -> str:
    """The text of a custom tool's call: its one parameter's, or what the model wrote."""
    try:
        given = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(given, dict) and isinstance(given.get(CUSTOM_INPUT), str):
        return str(given[CUSTOM_INPUT])
    return arguments
