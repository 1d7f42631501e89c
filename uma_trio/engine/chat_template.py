"""The model's own chat template (``tokenizer.chat_template``), rendered with Jinja2.

As HF transformers' ``apply_chat_template`` and llama-cpp-python's ``Jinja2ChatFormatter``
do: an immutable sandbox (a template is data from a model file; it may not touch Python
objects' internals or mutate what it is given), ``trim_blocks`` and ``lstrip_blocks``, the
variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
and the helpers ``raise_exception(message)`` and ``strftime_now(format)``; ``tojson`` as
transformers defines it (plain ``json.dumps``, not Jinja's HTML-escaping one).  llama.cpp's
built-in formatter (``llama_chat_apply_template``) knows a fixed list of template families by
their text and cannot render tools; it stays the fallback for a template Jinja cannot compile.

Pure: no I/O, no llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be compiled or rendered; the message names the problem."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class JinjaChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {_describe(exc)}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        try:
            return self._template.render(
                messages=messages,  # the sandbox is immutable: the template cannot change them
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {_describe(exc)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the model's chat template failed: {type(exc).__name__}: {exc}"
            ) from None


def _describe(exc: jinja2.TemplateError) -> str:
    line = getattr(exc, "lineno", None)
    where = f" (template line {line})" if line else ""
    return f"{exc.message or type(exc).__name__}{where}"
