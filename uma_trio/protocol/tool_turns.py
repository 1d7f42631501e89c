"""Tool calls and their results in a chat history, in the order OpenAI's and Anthropic's APIs
require: the results of an assistant turn's calls come right after it, one per call, each
naming its call's id.  A history out of that order is refused there (a 400), and a model
shown it here would read a result with no call, or a call with no result.  Also, what a
result's tool was called: its call names it.  Pure: no I/O."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

UNANSWERED_AT_END = "the last message is an assistant turn with tool calls: send each call's result after it"


def tool_turn_fault(turns: Sequence[Mapping[str, Any]]) -> tuple[int, str] | None:
    """The first turn out of order, and why; None for a history in order.  A call without an
    id (an API that has none) leaves the results after its turn unchecked; a result without
    one answers no call and is not checked either."""
    waiting: dict[str, None] | None = None  # the calls of the assistant turn before, unanswered
    checked, answered, caller = True, set[str](), -1
    for i, turn in enumerate(turns):
        if turn.get("role") == "tool":
            call_id = str(turn.get("tool_call_id") or "")
            if not call_id:  # a result tied to no call (Codex's goal): it may stand anywhere
                continue
            if waiting is None:
                return i, "a tool result must follow the assistant turn whose call it answers"
            if checked and call_id in answered:
                return i, f"the call {call_id!r} is answered twice"
            if checked and call_id not in waiting:
                return i, f"the assistant turn before it made no call with id {call_id!r}"
            waiting.pop(call_id, None)
            answered.add(call_id)
            continue
        if checked and waiting:
            return caller, _unanswered(waiting, at_end=False)
        waiting = None
        calls = turn.get("tool_calls") or ()
        if turn.get("role") == "assistant" and calls:
            ids = [str(call.get("id") or "") for call in calls]
            checked, answered, caller = all(ids), set(), i
            if checked and len(set(ids)) < len(ids):
                return i, f"two tool calls have the id {next(x for x in ids if ids.count(x) > 1)!r}"
            waiting = dict.fromkeys(ids)
    if waiting and checked:
        return caller, _unanswered(waiting, at_end=True)
    return None


def _unanswered(waiting: Mapping[str, None], at_end: bool) -> str:
    if at_end:
        return f"{UNANSWERED_AT_END} (not answered: {', '.join(waiting)})"
    return f"each tool call needs its result right after its turn (not answered: {', '.join(waiting)})"


def name_results(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns, each tool result without a ``name`` given the name of the call it answers
    (OpenAI's and Anthropic's results carry only the call's id; the generic format and some
    templates write the tool's name beside the result)."""
    names: dict[str, str] = {}
    out = []
    for turn in turns:
        for call in turn.get("tool_calls") or ():
            names[str(call.get("id") or "")] = str((call.get("function") or {}).get("name") or "")
        if turn.get("role") == "tool" and not turn.get("name"):
            named = names.get(str(turn.get("tool_call_id") or ""))
            if named:
                turn = {**turn, "name": named}
        out.append(turn)
    return out


_NINE = re.compile(r"[A-Za-z0-9]{9}")


def nine_character_ids(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns with every tool call id as Mistral's templates demand it, nine letters or
    digits ("Tool call IDs should be alphanumeric strings with length 9!"): an id already
    so is kept, another becomes the first nine hex digits of its sha256, in its call and in
    the result that answers it alike (OpenAI's ids, ``call_`` and 24 more, were refused)."""

    def nine(call_id: Any) -> Any:
        if not isinstance(call_id, str) or _NINE.fullmatch(call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    out = []
    for turn in turns:
        if turn.get("tool_calls"):
            calls = [{**c, "id": nine(c["id"])} if "id" in c else c for c in turn["tool_calls"]]
            turn = {**turn, "tool_calls": calls}
        if turn.get("role") == "tool" and "tool_call_id" in turn:
            turn = {**turn, "tool_call_id": nine(turn["tool_call_id"])}
        out.append(turn)
    return out
