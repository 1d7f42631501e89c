"""Tool calls read back out of a generated text (protocol/tools.py has the families and
their grammars): whole, at the end of an answer, and streamed, where content is held back
from where a call may begin.  Pure: no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import xml_calls
from .tools import ToolFormat


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# What a generic answer opens with (tool_call_grammar), without whitespace: an answer cut off
# (max_tokens) before its first call or its text began is one of their prefixes.
_GENERIC_CALLS = '{"tool_calls":['
_GENERIC_ANSWER = '{"response":"'

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def parse_tool_calls(
    text: str, fmt: ToolFormat, names: Sequence[str], formatted: bool = False,
    schemas: Mapping[str, Any] | None = None,
) -> tuple[str, list[ParsedCall]]:  # fmt: skip
    """The content outside tool calls and the calls, from a generated text.  A whole call that
    does not parse, or names no tool of the request, stays content: nothing is lost.  A
    generic answer cut off (max_tokens) inside its ``{"tool_calls": [`` list keeps the calls
    written whole; the one being written is dropped, and there is no content.  ``formatted``:
    a direct answer is the response format's JSON itself (tool_call_grammar's ``answer``),
    not generic's ``{"response": ...}``.  ``schemas``: each tool's parameters by name, which
    type the XML family's values (without them, a value is the JSON it holds, or its text)."""
    if fmt in ("hermes", "xml"):
        blocks = list(_HERMES.finditer(text))
        calls = [c for c in (_block_call(m.group(1), fmt, names, schemas or {}) for m in blocks) if c]
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
        wrapped = not formatted  # a direct answer is {"response": "<text>"}
        if wrapped and isinstance(value, dict) and isinstance(value.get("response"), str) and len(value) == 1:
            return _no_lone_surrogates(value["response"]), []
        if isinstance(value, dict):
            objects = value.get("tool_calls", [])
            if not isinstance(objects, list):  # a formatted answer's own key of that name
                return text, []
        elif value is not None:  # a formatted answer that is no object
            return text, []
        elif wrapped and (answer := re.match(r'\{\s*"response"\s*:\s*"', stripped)):
            # Cut off (max_tokens) inside the answer: its text, not the JSON around it.
            return _cut_string(stripped[answer.end() :]), []
        elif wrapped and _GENERIC_ANSWER.startswith(compact := re.sub(r"\s+", "", stripped)) and compact:
            return "", []  # cut off before the answer's text began
        else:  # cut off in the middle of a list: the calls written whole
            opening = re.match(r'\{\s*"tool_calls"\s*:\s*\[', stripped)
            objects = _leading_items(stripped, opening.end()) if opening else []
            # Or before the list began ('{"tool_calls":'): a call, none of it written yet (a
            # formatted answer cut as early is no JSON either way: never the call's start).
            opened = opening is not None or _GENERIC_CALLS.startswith(re.sub(r"\s+", "", stripped))
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
    to its closing quote, or all that decodes (an escape cut short is dropped, and so is a
    surrogate pair's first half at the end: its second may be what was cut)."""
    decoder = json.JSONDecoder(strict=False)
    text = ""
    try:
        text = decoder.raw_decode('"' + body)[0]
    except ValueError:
        for end in range(len(body), max(len(body) - len("\\uXXXX"), 0) - 1, -1):
            try:
                text = decoder.decode('"' + body[:end] + '"')
                break
            except ValueError:
                continue
    return _no_lone_surrogates(text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text)


def _no_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (a JSON escape of half a pair: the model may write
    one) as U+FFFD: no UTF-8 encoder takes one, and the answer's encoding failed."""
    return _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _block_call(
    body: str, fmt: ToolFormat, names: Sequence[str], schemas: Mapping[str, Any]
) -> ParsedCall | None:
    """A ``<tool_call>`` block's call: Hermes' JSON, or the XML family's elements (an XML
    block holding JSON instead is read as Hermes')."""
    if fmt == "hermes" or body.lstrip().startswith("{"):
        return _call(_load(body), names)
    read = xml_calls.read_call(body, {name: schemas.get(name, {}) for name in names})
    return None if read is None else _call({"name": read[0], "arguments": read[1]}, names)


def _call(value: Any, names: Sequence[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _load(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(str(value["name"]), _no_lone_surrogates(json.dumps(arguments, ensure_ascii=False)))


_MARKERS: dict[ToolFormat, str] = {
    "hermes": "<tool_call>",
    "xml": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3": "<|python_tag|>",
}


# How a call opens when it comes with no marker text at the answer's start, as
# parse_tool_calls reads it too: Llama 3 answers a call with bare JSON; Mistral's [TOOL_CALLS]
# is a control token, written as no text, so its calls come as a bare JSON list.
_BARE_OPENINGS: dict[ToolFormat, str] = {"llama3": "{", "mistral": "["}


class ToolTextFilter:
    """Streams the content of an answer that may hold tool calls: text is passed on until it
    could be the start of a call, and from a call's marker on held until the end, when the
    parsed answer says what it was.  Hermes (and XML) content is trimmed around its calls
    (parse_tool_calls): whitespace is held until text follows it, as it may be what is
    trimmed.  A generic answer is JSON (:class:`GenericAnswer` streams its text)."""

    def __init__(self, fmt: ToolFormat, formatted: bool = False) -> None:
        self._fmt = fmt
        self._held = ""
        self._holding = False
        self._generic = GenericAnswer(formatted) if fmt == "generic" else None
        self.sent = ""

    @property
    def accounted(self) -> int:
        """How many of the characters fed are behind what was sent (sent, or known to be no
        content): a token's log-probabilities go out once its text's start is."""
        return self._generic.accounted if self._generic is not None else len(self.sent)

    def feed(self, text: str) -> str:
        """The part of ``text`` to send as content now."""
        if self._generic is not None:
            out = self._generic.feed(text)
        elif self._holding:
            self._held += text
            return ""
        else:
            pending = self._held + text
            start, whole = self._call_start(pending)
            if self._fmt in ("hermes", "xml"):
                start = len(pending[:start].rstrip())
            out, self._held = pending[:start], pending[start:]
            self._holding = whole
        self.sent += out
        return out

    def _call_start(self, text: str) -> tuple[int, bool]:
        """Where a call may begin (``len(text)``: nowhere), and whether it surely does."""
        opening = _BARE_OPENINGS.get(self._fmt)
        if opening and not self.sent.strip() and text.lstrip().startswith(opening):
            return len(text) - len(text.lstrip()), True
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


# How tool_call_grammar's generic answers open (its JSON has no free whitespace).
_TEXT_OPENING = '{"response": "'
_CALLS_OPENING = '{"tool_calls":'


class GenericAnswer:
    """A generic answer's content as it is written: held while it may be calls; a direct
    answer, ``{"response": "<text>"}``, streams its text as far as it decodes (an escape or a
    surrogate pair cut between tokens waits for its end), as parse_tool_calls reads it at
    the end.  ``formatted`` (a response_format): the direct answer is that JSON itself,
    streamed as it comes.  Calls are held to the end (it was the whole answer, so an agent
    offering tools to a model without a tool template saw no token until the last)."""

    def __init__(self, formatted: bool) -> None:
        self._formatted = formatted
        self._fed = ""
        self._sent = ""
        self._mode: str | None = None  # None: undecided; "calls", "text" or "json"
        self.accounted = 0

    def feed(self, text: str) -> str:
        self._fed += text
        if self._mode is None:
            self._mode = self._decided()
        if self._mode == "json":
            shown = self._fed
        elif self._mode == "text":
            shown = _cut_string(self._fed[len(_TEXT_OPENING) :])
        else:
            return ""
        if not shown.startswith(self._sent):  # not expected of a JSON string; the end says
            self._mode = "calls"
            return ""
        out, self._sent, self.accounted = shown[len(self._sent) :], shown, len(self._fed)
        return out

    def _decided(self) -> str | None:
        fed, formatted = self._fed, self._formatted
        if fed.startswith(_CALLS_OPENING):
            return "calls"
        if not formatted and fed.startswith(_TEXT_OPENING):
            return "text"
        if _CALLS_OPENING.startswith(fed) or (not formatted and _TEXT_OPENING.startswith(fed)):
            return None  # '{"' opens both
        return "json" if formatted else "calls"
