"""llama.cpp's built-in chat formatting (``llama_chat_apply_template``): what a model gets
whose template Jinja cannot compile.  It knows its families' turn markers and nothing of
tools."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Tools
from .libllama import llama


def builtin_chat_text(template: bytes, turns: Sequence[Mapping[str, Any]], tools: Tools = None) -> str:
    """The chat ``turns`` (role and content, each) as llama.cpp's built-in formatter writes
    them for ``template``, with the assistant's turn opened; ValueError where it cannot
    (tools, or turns with tool calls)."""
    if tools or any("tool_calls" in t for t in turns):
        raise ValueError(
            "llama.cpp's built-in chat formatter cannot render tool calls; give a Jinja "
            "template that can (--chat-template)"
        )
    keep = [(str(t["role"]).encode(), str(t["content"]).encode()) for t in turns]
    messages = [llama.llama_chat_message(role=r, content=c) for r, c in keep]
    chat = (llama.llama_chat_message * len(keep))(*messages)
    size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama.llama_chat_apply_template(template, chat, len(keep), True, buf, size)
        if n < 0:
            raise ValueError("the model's chat template is not supported by llama.cpp")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise ValueError("chat template output kept growing")  # pragma: no cover
