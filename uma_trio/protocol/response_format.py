"""A request's ``response_format``, OpenAI's tagged union on ``"type"``: free text, one JSON
object, or one JSON value matching a schema (docs/PROTOCOL.md "Structured output")."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct


class JsonSchemaSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's ``response_format.json_schema``: the schema the output must match."""

    name: Annotated[str, Meta(max_length=256)] = "response"
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class TextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """Free text: no constraint."""


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    """One JSON object; with ``schema`` (llama-server's extension), one matching it."""

    schema: dict[str, Any] | None = None


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
