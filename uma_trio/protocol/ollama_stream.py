"""A streamed ``/api/chat`` or ``/api/generate`` answer as Ollama's NDJSON chunks.  Pure.

With tools offered, content streams as the OpenAI route's does (protocol/tool_text.py's
:class:`ToolTextFilter`): it is sent until it may be the start of a call, the rest at the
end; then the calls in a chunk of their own (Ollama's ``message.tool_calls`` chunk, which
clients collect as they go), and the last line, ``done``, with no content: everything was
said in the chunks before it."""

from __future__ import annotations

from typing import Any

from .messages import EosEvent, TokenLogprob
from .ollama import AssistantMessage, Chunk, final_chunk, logprobs_of, ollama_call, text_chunk
from .tool_text import ToolTextFilter
from .tools import ToolFormat


class Lines:
    """An answer without tools: each token's text in a chunk of its own as it comes."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> list[Chunk]:
        return [text_chunk(self.model, text, self.chat, logprobs_of(logprobs))]

    def end(self, eos: EosEvent) -> list[Chunk]:
        return [final_chunk(self.model, eos, self.chat)]


class ToolChatLines(Lines):
    """A chat answer whose request offered tools.  A token's logprobs go with the chunk that
    sends its text's start; those of text held back (the calls' too) with the last chunks."""

    def __init__(self, model: str, fmt: ToolFormat, formatted: bool = False) -> None:
        super().__init__(model, chat=True)
        self._filter = ToolTextFilter(fmt, formatted)
        self._fed = 0  # characters fed to the filter
        self._held: list[tuple[int, list[TokenLogprob]]] = []  # logprobs not sent, by their text's start

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> list[Chunk]:
        if logprobs:
            self._held.append((self._fed, logprobs))
        self._fed += len(text)
        if not (content := self._filter.feed(text)):
            return []
        return [text_chunk(self.model, content, True, self._release(self._filter.accounted))]

    def end(self, eos: EosEvent) -> list[Chunk]:
        # Sent with or without calls: a Hermes model may write on after its calls.
        rest = self._filter.rest(eos.content or "")
        held = self._release(self._fed + 1)
        chunks = [text_chunk(self.model, rest, True, held)] if rest else []
        if eos.tool_calls or (held and not rest):  # held and no text: a generic answer's JSON
            calls = text_chunk(self.model, "", True, None if rest else held)
            if eos.tool_calls:
                calls.message = AssistantMessage("", tool_calls=[ollama_call(c) for c in eos.tool_calls])
            chunks.append(calls)
        final = final_chunk(self.model, eos, True)
        final.message = AssistantMessage("")  # the content and the calls went in the chunks before
        return [*chunks, final]

    def _release(self, sent: int) -> list[dict[str, Any]] | None:
        """The held logprobs of tokens whose text starts before ``sent`` characters."""
        ready = [entry for start, entries in self._held if start < sent for entry in entries]
        self._held = [(start, entries) for start, entries in self._held if start >= sent]
        return logprobs_of(ready)
