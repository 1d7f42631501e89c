"""The XML tool-call family (Qwen3-Coder, Qwen 3.5, Nemotron 3 Nano, StepFun 3.5): a call is

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

with each value written as bare text where its schema allows a string, else as JSON (as
llama.cpp's ``qwen3-coder`` parser and vLLM's ``qwen3_coder`` read them).  Its grammar rules,
for a call the request forces, and its reading; protocol/tools.py and protocol/tool_text.py
call these.  Pure: no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# The text a template of this family writes a call in: nothing else has all three.
TEMPLATE_MARKS = ("<tool_call>", "<function=", "<parameter=")

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# A value ends at a closing tag followed by the next parameter or the call's end (one inside
# the value, as code can hold, is its text), or where the next one opens (a tag left out).
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>\s*(?=<parameter=|\Z)|(?=<parameter=)|\Z)", re.S
)
_VALUE_END = "\n</parameter>\n"
_END = json.dumps(_VALUE_END)  # as a grammar item


def is_xml_template(template: str) -> bool:
    """Whether a chat template writes its calls in this family's format."""
    return all(mark in template for mark in TEMPLATE_MARKS)


def written_as_text(schema: Any) -> bool:
    """Whether a value of ``schema`` is written as bare text: wherever it may be a string
    (an unknown or composite schema too); JSON only where the schema rules strings out."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind == "string"
    if isinstance(kind, list):
        return "string" in kind
    if "enum" in schema and isinstance(schema["enum"], list):
        return any(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return True


def function_rules(
    index: int, name: str, parameters: Mapping[str, Any], json_value: Callable[[Any], str]
) -> list[str]:
    """The Lark rules of a call of tool ``index`` (``fn_INDEX``), from ``<function=`` to its
    last parameter: each parameter in the schema's order, the required ones always and the
    others at most once; ``json_value`` makes a JSON value's rule body from its schema."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    body, rules = [json.dumps(f"<function={name}>\n")], []
    for k, (key, schema) in enumerate(properties.items()):
        rule = f"arg_{index}_{k}"
        value = _text_value(schema) if written_as_text(schema) else f"{json_value(schema)} {_END}"
        opening = json.dumps(f"<parameter={key}>\n")
        rules.append(f"{rule}: {opening} {value}")
        body.append(rule if key in required else f"{rule}?")
    return [f"fn_{index}: {' '.join(body)}", *rules]


def _text_value(schema: Any) -> str:
    """A text value's rule body: one of its strings where the schema lists them, else any
    text up to the closing tag (its other keywords, a length or a pattern, are not kept)."""
    values = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return f"({' | '.join(json.dumps(v) for v in values)}) {_END}"
    return "xml_text"


def call_grammar(count: int, rules: Sequence[str], opens: str, closes: str, many: str, formatted: str) -> str:
    """The grammar of calls of ``count`` tools whose ``rules`` (:func:`function_rules`) are
    given, each call between the markers ``opens`` and ``closes`` (as grammar items)."""
    functions = " | ".join(f"fn_{i}" for i in range(count))
    return "\n".join(
        [
            f"start: call{many}{formatted}",
            f'call: {opens} "\\n" ({functions}) "</function>\\n" {closes} "\\n"?',
            *rules,
            # Text up to the first "\n</parameter>\n", which it ends with (llguidance's suffix).
            f"xml_text[suffix={_END}]: /(.|\\n)*/",
            "",
        ]
    )


def read_call(body: str, schemas: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The tool's name and its arguments from the text of one ``<tool_call>`` block; None when
    it is not a whole call (no ``</function>``: cut off) of one of ``schemas``' tools."""
    found = _FUNCTION.match(body.strip())
    if found is None or (name := found.group(1).strip()) not in schemas:
        return None
    parameters = schemas[name] if isinstance(schemas[name], Mapping) else {}
    properties = parameters.get("properties") or {}
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(found.group(2)):
        key = parameter.group(1).strip()
        text = parameter.group(2).removeprefix("\n").removesuffix("\n")
        arguments[key] = _value(text, properties.get(key))
    return name, arguments


def _value(text: str, schema: Any) -> Any:
    """A parameter's value: its text where its schema takes only strings; else the JSON it
    holds (a string in quotes stays text, as llama.cpp reads it), or the text if none."""
    if schema is not None and _only_strings(schema):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _only_strings(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    if kind == "string" or kind == ["string"]:
        return True
    values = schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)
