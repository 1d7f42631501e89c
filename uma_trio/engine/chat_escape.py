"""Client text through a chat template as plain text, whatever it holds.

A chat is rendered whole with the clients' real text, so the template can trim it, split a
``</think>`` off it, move a system message into the first user turn or leave a turn out, and
the rendered prompt is tokenized whole, as llama-server, Ollama and transformers tokenize it
(a message that opens with a newline or indented code gets the template's merges around it).
Only one thing must not survive: text a client typed that spells a control token
(``<|im_end|>``), which tokenized with the template's own control tokens would close its turn
and open another.  Before the render each such spelling in the clients' strings becomes a
private-use escape; after it, the rendered text is cut at the escapes, and each one is
tokenized as plain text, the rest with control tokens parsed.

An escape is ``U+E000``, the control text's index in decimal, ``U+E001``; a ``U+E000`` the
client typed is ``U+E000 U+E001`` (no digits), so a client's private-use text cannot forge one.

Pure: no I/O, no llama.cpp.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"
_ESCAPE = re.compile(f"{_OPEN}(\\d*){_CLOSE}")


class ControlTextEscaper:
    """Escapes the spellings of a vocabulary's control tokens (``controls``) in client text."""

    def __init__(self, controls: Sequence[str]) -> None:
        self.controls = [text for text in controls if text]
        index = {text: i for i, text in enumerate(self.controls)}
        self._index = index
        # Longest first, so a control text that begins another is not matched inside it.
        spelled = sorted(index, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, [_OPEN, *spelled])))

    def escape(self, value: Any) -> Any:
        """``value`` with every string in it escaped: dicts' keys and values (a tool's schema,
        a call's arguments: a template writes them with ``tojson``) and lists' items too."""
        if isinstance(value, str):
            return self._pattern.sub(self._escape_one, value)
        if isinstance(value, dict):
            return {self.escape(key): self.escape(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(item) for item in value]
        return value

    def _escape_one(self, match: re.Match[str]) -> str:
        text = match[0]
        return f"{_OPEN}{_CLOSE}" if text == _OPEN else f"{_OPEN}{self._index[text]}{_CLOSE}"

    def pieces(self, rendered: str) -> Iterator[tuple[str, bool]]:
        """The rendered text, unescaped, as ``(text, template)`` pieces: ``template`` text may
        hold control tokens; a client's control spelling comes alone, as plain text."""
        start, plain = 0, ""
        for match in _ESCAPE.finditer(rendered):
            digits = match[1]
            if not digits or int(digits) >= len(self.controls):  # U+E000 typed: plain text
                plain += rendered[start : match.end()] if digits else rendered[start : match.start()] + _OPEN
            else:
                yield plain + rendered[start : match.start()], True
                plain = ""
                yield self.controls[int(digits)], False
            start = match.end()
        yield plain + rendered[start:], True
