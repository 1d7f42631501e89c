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
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment


@dataclass(frozen=True)
class RenderLimits:
    chars: int = 16 << 20  # output characters (and any string or list ``*`` builds)
    range_items: int = 1_000_000  # items every ``range`` of one render hands out together
    seconds: float = 10.0  # from the render's start to its last piece of output
    exponent_bits: int = 4096  # the largest ``**`` result, in bits


LIMITS = RenderLimits()


class ChatTemplateError(ValueError):
    """The template could not be compiled or rendered; the message names the problem."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with ``*``, ``**`` and ``range`` held to :data:`LIMITS`."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, limits: RenderLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.limits = limits
        self._render = threading.local()  # range items left to the render on this thread
        self.globals["range"] = self._range

    def start_render(self) -> None:
        self._render.range_left = self.limits.range_items

    def _range(self, *args: int) -> range:
        items = range(*args)
        left = getattr(self._render, "range_left", self.limits.range_items) - len(items)
        if left < 0:
            raise SecurityError(f"the template's ranges went past {self.limits.range_items:,} items")
        self._render.range_left = left
        return items

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for repeated, times in ((left, right), (right, left)):
                if (
                    isinstance(repeated, str | list | tuple) and isinstance(times, int)
                    and len(repeated) * times > self.limits.chars
                ):  # fmt: skip
                    raise SecurityError(f"the template built a value past {self.limits.chars:,} items")
        elif (
            isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
            and left.bit_length() * right > self.limits.exponent_bits
        ):  # fmt: skip
            raise SecurityError(f"the template raised a number past {self.limits.exponent_bits} bits")
        return super().call_binop(context, operator, left, right)


class JinjaChatTemplate:
    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", limits: RenderLimits = LIMITS
    ) -> None:
        env = _BoundedSandbox(limits)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._env = env
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
            self._env.start_render()
            pieces = self._template.generate(
                messages=messages,  # the sandbox is immutable: the template cannot change them
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
            return self._bounded(pieces)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {_describe(exc)}") from None
        except MemoryError:
            raise ChatTemplateError("the model's chat template ran out of memory") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            raise ChatTemplateError(
                f"the model's chat template failed: {type(exc).__name__}: {exc}"
            ) from None

    def _bounded(self, pieces: Iterator[str]) -> str:
        """``pieces`` joined, stopped past the size limit or the deadline (checked at each
        piece of output the template yields)."""
        limits = self._env.limits
        deadline, size, out = time.monotonic() + limits.seconds, 0, []
        for piece in pieces:
            size += len(piece)
            if size > limits.chars:
                raise SecurityError(f"the rendered prompt went past {limits.chars:,} characters")
            if time.monotonic() > deadline:
                raise SecurityError(f"the render took more than {limits.seconds:g} s")
            out.append(piece)
        return "".join(out)


def _describe(exc: jinja2.TemplateError) -> str:
    line = getattr(exc, "lineno", None)
    where = f" (template line {line})" if line else ""
    return f"{exc.message or type(exc).__name__}{where}"
