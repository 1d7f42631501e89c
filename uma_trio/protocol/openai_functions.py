"""OpenAI's deprecated function calling (``functions``, ``function_call``, ``role: function``)
read as the tools it became.  Pure: no I/O.

OpenAI's Chat Completions still take these fields, and older apps and libraries still send
them (LangChain's OpenAI functions agents, apps written against the 2023 API).  A request
that offers ``functions`` is served as one that offers the same tools with one call at most,
and answered in the old shape (``message.function_call``, ``finish_reason: function_call``;
openai.py).  A history in the old shape is read as tool calls and results with ids made up
here; it may come beside ``tools`` too (an app that kept its old history)."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, cast

import msgspec

from .openai_errors import ApiError


class _Turn(Protocol):  # openai.py's ChatTurn, which imports this module
    @property
    def role(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def tool_calls(self) -> list[dict[str, Any]] | None: ...
    @property
    def function_call(self) -> dict[str, Any] | None: ...


class _Body(Protocol):  # openai.py's ChatBody
    @property
    def functions(self) -> list[Any] | None: ...
    @property
    def function_call(self) -> Any: ...
    @property
    def tools(self) -> list[Any] | None: ...
    @property
    def tool_choice(self) -> Any: ...
    @property
    def messages(self) -> Any: ...  # list[ChatTurn]: a list is invariant in its items


BodyT = TypeVar("BodyT", bound=_Body)
TurnT = TypeVar("TurnT", bound=_Turn)
T = TypeVar("T")


def _replaced(struct: T, **changes: Any) -> T:
    """msgspec's ``replace`` on a struct these protocols describe."""
    return cast(T, msgspec.structs.replace(cast(Any, struct), **changes))


LEGACY_CALL_ID = "call_function_{}"  # the made-up id of the call in messages[i]


def modernized(body: BodyT) -> tuple[BodyT, bool]:
    """``body`` with its legacy fields as tools, and whether it offered ``functions`` (the
    answer then takes the old shape).  Raises :class:`ApiError` for a mix the two APIs
    cannot both mean."""
    offered = bool(body.functions)
    changes: dict[str, Any] = {}
    if offered:
        if body.tools:
            raise ApiError(400, "give `tools` or the deprecated `functions`, not both", param="functions")
        changes["tools"] = [_tool(f, i) for i, f in enumerate(body.functions or ())]
        changes["functions"] = None
        changes["parallel_tool_calls"] = False  # the old API answers with one call
    if body.function_call is not None:
        if not offered:
            raise ApiError(400, "`function_call` needs `functions`", param="function_call")
        if body.tool_choice is not None:
            raise ApiError(
                400, "give `tool_choice` or the deprecated `function_call`, not both", param="function_call"
            )
        changes["tool_choice"] = _choice(body.function_call)
        changes["function_call"] = None
    if any(turn.role == "function" or turn.function_call is not None for turn in body.messages):
        changes["messages"] = _turns(body.messages)
    return (_replaced(body, **changes) if changes else body), offered


def _tool(function: Any, i: int) -> dict[str, Any]:
    if not isinstance(function, dict):
        raise ApiError(400, "a function is an object with a `name`", param=f"functions[{i}]")
    return {"type": "function", "function": function}


def _choice(choice: Any) -> Any:
    if choice in ("none", "auto"):
        return choice
    if isinstance(choice, dict) and isinstance(name := choice.get("name"), str) and name:
        return {"type": "function", "function": {"name": name}}
    raise ApiError(
        400, "`function_call` is \"none\", \"auto\" or {\"name\": ...}", param="function_call"
    )  # fmt: skip


def _turns(turns: list[TurnT]) -> list[TurnT]:
    """Assistant ``function_call``s as tool calls, each ``role: function`` message as the
    result of the latest call of its name not answered yet."""
    out: list[TurnT] = []
    unanswered: dict[str, list[str]] = {}  # name → ids of its calls, oldest first
    for i, turn in enumerate(turns):
        if turn.function_call is not None:
            if turn.role != "assistant":
                where = f"messages[{i}].function_call"
                raise ApiError(400, "only an assistant message carries a function_call", param=where)
            if turn.tool_calls:
                raise ApiError(
                    400, "give `tool_calls` or the deprecated `function_call`, not both",
                    param=f"messages[{i}].function_call",
                )  # fmt: skip
            call = dict(turn.function_call)
            name = call.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(
                    400, "a function_call needs a `name`", param=f"messages[{i}].function_call.name"
                )
            call_id = LEGACY_CALL_ID.format(i)
            unanswered.setdefault(name, []).append(call_id)
            tool_call = {"id": call_id, "type": "function", "function": call}
            out.append(_replaced(turn, function_call=None, tool_calls=[tool_call]))
        elif turn.role == "function":
            if not turn.name:
                raise ApiError(
                    400, "a function message needs the `name` of the function", param=f"messages[{i}].name"
                )
            ids = unanswered.get(turn.name)
            if not ids:
                raise ApiError(
                    400, f"no assistant function_call named {turn.name!r} before this result",
                    param=f"messages[{i}]",
                )  # fmt: skip
            out.append(_replaced(turn, role="tool", tool_call_id=ids.pop()))
        else:
            out.append(turn)
    return out
