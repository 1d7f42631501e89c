"""OpenAI's ``strict: true`` for a JSON schema: an object has the properties it names and no
others.  OpenAI refuses a strict schema whose objects leave ``additionalProperties`` open; the
daemon closes them instead, so a strict schema means here what it means there.  Left open,
llguidance allows any further key, the same one again too: a small model repeated ``"s": "x"``
until ``max_tokens``, and the answer was not JSON.  Pure."""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not
    say otherwise, nested ones and definitions included; anything else as it was."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(item) for item in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
