"""The model's own chat template (``tokenizer.chat_template``), rendered with Jinja2.

As HF transformers' ``apply_chat_template`` and llama-cpp-python's ``Jinja2ChatFormatter``
do: an immutable sandbox (a template is data from a model file; it may not touch Python
objects' internals or mutate what it is given), ``trim_blocks`` and ``lstrip_blocks``, the
variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
and the helpers ``raise_exception(message)`` and ``strftime_now(format)``; ``tojson`` as
transformers defines it (plain ``json.dumps``, not Jinja's HTML-escaping one).  llama.cpp's
built-in formatter (``llama_chat_apply_template``) knows a fixed list of template families by
their text and cannot render tools; it stays the fallback for a template Jinja cannot compile.

A template is code from a model file, and Jinja's sandbox keeps it from Python's internals
but not from work without end.  A render here is held to :data:`LIMITS` in the ways a
template usually runs away: ``range`` items over the whole render; strings and lists that
``*``, padding (``center``, ``indent``, ``ljust``...) and format widths (``%``, ``format``,
``str.format``) would build; ``**`` results; the output's size; and a deadline, checked at
every call, attribute and item the template reads and every piece it writes.  ``lipsum`` is
gone.  Best effort, not a proof: loops with nothing in them over data already there,
``replace``, ``join`` and ``~`` escape these checks, so a model file stays trusted input
(SECURITY.md "The model store and pulls").  Each limit is a :class:`ChatTemplateError`.

Pure: no I/O, no llama.cpp.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
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


class _Refused(jinja2.exceptions.TemplateError):
    """The template's own ``raise_exception``: it refuses what it was given."""


def _raise_exception(message: str) -> NoReturn:
    raise _Refused(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """HF transformers' ``{% generation %}...{% endgeneration %}``, which marks the assistant's
    words for training masks: its body is rendered as it is (GLM, LFM2.5, Laguna use it)."""

    tags = {"generation"}  # noqa: RUF012  # jinja2.ext.Extension declares it so

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_PADDING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})  # str methods sized by an argument
# A %-format's field width and precision ("%%" is a percent sign), and a str.format field's.
_PERCENT_FIELD = re.compile(r"%%|%[-+ #0]*(\d*)(?:\.(\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}:]*:[^{}\d.]*(\d*)(?:\.(\d+))?[^{}]*\}")


def _format_size(fmt: str, field: re.Pattern[str]) -> int:
    """The widest field ``fmt`` asks for: its width plus its precision."""
    return max((int(m[1] or 0) + int(m[2] or 0) for m in field.finditer(fmt) if m[0] != "%%"), default=0)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, held to :data:`LIMITS`: ``range``'s items over a render; values
    ``*``, ``**``, padding and ``format`` would build; the deadline, checked at each call,
    attribute and item a template reads (and at each piece of output, by the renderer)."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def __init__(self, limits: RenderLimits) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
        )
        self.limits = limits
        self._render = threading.local()  # this thread's render: range items left, deadline
        self.globals["range"] = self._range
        del self.globals["lipsum"]  # lipsum(10**7) wrote for minutes before its first output
        for name in ("center", "indent", "format"):
            self.filters[name] = self._sized(name, self.filters[name])

    def start_render(self) -> None:
        """Arm this thread's budget: its range items and its deadline."""
        self._render.range_left = self.limits.range_items
        self._render.deadline = time.monotonic() + self.limits.seconds

    def check_deadline(self) -> None:
        if time.monotonic() > getattr(self._render, "deadline", math.inf):
            raise SecurityError(f"the render took more than {self.limits.seconds:g} s")

    def _range(self, *args: int) -> range:
        items = range(*args)
        left = getattr(self._render, "range_left", self.limits.range_items) - len(items)
        if left < 0:
            raise SecurityError(f"the template's ranges went past {self.limits.range_items:,} items")
        self._render.range_left = left
        return items

    def _too_big(self, size: int) -> None:
        if size > self.limits.chars:
            raise SecurityError(f"the template built a value past {self.limits.chars:,} items")

    def _sized(self, name: str, jinja_filter: Any) -> Any:
        """Jinja's ``name`` filter, refused where its width would build an oversized value."""

        def sized(value: Any, *args: Any, **kwargs: Any) -> Any:
            if name == "format" and isinstance(value, str):
                self._too_big(_format_size(value, _PERCENT_FIELD))
            elif (width := args[0] if args else kwargs.get("width")) is not None:  # center, indent
                size = width if isinstance(width, int) else len(str(width))
                lines = str(value).count("\n") + 1 if name == "indent" else 1
                self._too_big(size * lines)
            return jinja_filter(value, *args, **kwargs)

        return sized

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check_deadline()
        padding = isinstance(getattr(__obj, "__self__", None), str) and __obj.__name__ in _PADDING
        if padding and args and isinstance(args[0], int):  # "x".ljust(3_000_000_000)
            __self._too_big(args[0])
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check_deadline()
        if isinstance(obj, str) and attribute in ("format", "format_map"):  # "{:>3000000000}".format
            self._too_big(_format_size(obj, _BRACE_FIELD))
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check_deadline()
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for repeated, times in ((left, right), (right, left)):
                if isinstance(repeated, str | list | tuple) and isinstance(times, int):
                    self._too_big(len(repeated) * times)
        elif operator == "%":
            if isinstance(left, str):  # "%3000000000s" % "x"
                self._too_big(_format_size(left, _PERCENT_FIELD))
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
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as the template writes it; ``extra``: more variables (a request's
        ``template_args``: Qwen 3's ``enable_thinking``), under the ones set here."""
        try:
            return self._render(messages, tools, add_generation_prompt, extra)
        except _Refused as refused:
            # A template that refuses a system message (Gemma's: "System role not supported")
            # gets it at the start of the first user message, as llama-server's and Ollama's
            # templates give it; a refusal for any other reason stands.
            if (folded := _system_folded(messages)) is not None:
                with contextlib.suppress(_Refused):
                    return self._render(folded, tools, add_generation_prompt, extra)
            raise ChatTemplateError(f"the model's chat template failed: {_describe(refused)}") from None

    def _render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool, extra: Mapping[str, Any] | None = None,
    ) -> str:  # fmt: skip
        try:
            self._env.start_render()
            pieces = self._template.generate(
                **(extra or {}),
                messages=messages,  # the sandbox is immutable: the template cannot change them
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
            return self._bounded(pieces)
        except _Refused:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {_describe(exc)}") from None
        except MemoryError:
            raise ChatTemplateError("the model's chat template ran out of memory") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            raise ChatTemplateError(
                f"the model's chat template failed: {type(exc).__name__}: {exc}"
            ) from None

    def _bounded(self, pieces: Iterator[str]) -> str:
        """``pieces`` joined, stopped past the size limit or the render's deadline (checked at
        each piece of output the template yields)."""
        limit, size, out = self._env.limits.chars, 0, []
        for piece in pieces:
            size += len(piece)
            if size > limit:
                raise SecurityError(f"the rendered prompt went past {limit:,} characters")
            self._env.check_deadline()
            out.append(piece)
        return "".join(out)


def _system_folded(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """``messages`` with their system messages' text put before the first user message's (a
    blank line between, as llama.cpp's polyfill does); None without a system message or a
    user message after it to take it."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    first = next((i for i, m in enumerate(rest) if m.get("role") == "user"), None)
    if not system or first is None or not all(isinstance(m.get("content"), str) for m in system):
        return None
    said = "\n\n".join(str(m["content"]) for m in system)
    user = rest[first]
    content = user.get("content")
    rest[first] = {
        **user,
        "content": f"{said}\n\n{content}" if isinstance(content, str) and content else said,
    }
    return rest


def _describe(exc: jinja2.TemplateError) -> str:
    line = getattr(exc, "lineno", None)
    where = f" (template line {line})" if line else ""
    return f"{exc.message or type(exc).__name__}{where}"
