"""OpenAI's ``strict: true`` for a JSON schema: an object has the properties it names and no
others.  OpenAI refuses a strict schema whose objects leave ``additionalProperties`` open; the
daemon closes them instead, so a strict schema means here what it means there.  Left open,
llguidance allows any further key, the same one again too: a small model repeated ``"s": "x"``
until ``max_tokens``, and the answer was not JSON.  Pure.

Only a whole object schema is closed, one whose properties are all its own.  A part of a
composed one is left as it is, since closing it would forbid the keys the other parts bring
and a schema that worked would match nothing: an ``allOf`` member and a definition some
``allOf`` names (a base an object extends), the branches beside a node's own ``properties``,
and a node that takes properties from ``$ref`` or from its branches.

Without ``strict``, a schema is closed as llama.cpp's converter closes it (llama-server's
``json_schema``, Ollama's ``format``; vLLM's xgrammar alike): an object that lists
``properties`` and says nothing of others has only those, while a bare ``{"type": "object"}``
stays any object (:func:`closed` with ``bare=False``)."""

from __future__ import annotations

import re
from typing import Any

_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas")
_WHOLE = ("items", "additionalProperties", "contains", "propertyNames")  # one whole subschema
_DEFS = ("$defs", "definitions")
_LOCAL_DEF = re.compile(r"#/(?:\$defs|definitions)/([^/]+)\Z")


def closed(schema: Any, *, bare: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every whole object schema that does
    not say otherwise, nested ones and definitions included; anything else as it was.
    ``bare``: an object schema that lists no ``properties`` is closed too (strict: it then
    holds no key at all, as OpenAI's strict mode means it)."""
    return _close(schema, _extended(schema), bare)


def _close(node: Any, extended: set[str], bare: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _WHOLE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], extended, bare)
    for key in ("items", "prefixItems"):  # a tuple: each position is a whole schema
        if isinstance(out.get(key), list):
            out[key] = [_close(item, extended, bare) for item in out[key]]
    for key in ("properties", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, extended, bare) for name, sub in out[key].items()}
    for key in _DEFS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _parts_closed(sub, extended, bare) if name in extended else _close(sub, extended, bare)
                for name, sub in out[key].items()
            }
    if "properties" not in out:  # a union of whole alternatives: each branch is an object
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list):
                out[key] = [_close(branch, extended, bare) for branch in out[key]]
    kinds = out.get("type")
    is_object = "properties" in out or (
        bare and (kinds == "object" or (isinstance(kinds, list) and "object" in kinds))
    )
    if is_object and "additionalProperties" not in out and not any(k in out for k in _COMPOSED):
        out["additionalProperties"] = False
    return out


def _parts_closed(node: Any, extended: set[str], bare: bool) -> Any:
    """A definition another schema extends: its own level stays open, what it nests is closed."""
    inner = _close(node, extended, bare)
    if isinstance(node, dict) and isinstance(inner, dict) and "additionalProperties" not in node:
        inner.pop("additionalProperties", None)
    return inner


def _extended(schema: Any) -> set[str]:
    """The local definitions an ``allOf`` names: bases that other properties extend."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for member in node.get("allOf") or []:
                ref = member.get("$ref") if isinstance(member, dict) else None
                if isinstance(ref, str) and (match := _LOCAL_DEF.match(ref)):
                    found.add(match.group(1))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
