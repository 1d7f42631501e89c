"""llama-server's ``POST /infill``, the endpoint editors' code-completion plugins call
(llama.vim, llama.vscode): its body as a daemon request, its answer and stream chunks.  Pure.

``input_prefix`` and ``input_suffix`` surround the cursor, ``input_extra`` holds other files
(``{"filename", "text"}``) as context, and ``prompt`` is the start of the middle already
typed.  Sampling fields are the socket's (llama-server's names); ``n_predict`` is its
``max_tokens``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from .messages import EosEvent, GenerateRequest
from .ollama import minus_one_means


class InfillBody(Struct, kw_only=True):
    """Unknown fields are ignored, as llama-server does."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, Any]] | None = None
    prompt: str = ""
    n_predict: int | None = None
    max_tokens: int | None = None
    stream: bool = False
    stop: list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    priority: Literal["interactive", "background"] | None = None


_PASSED = (
    "stream", "stop", "seed", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "repeat_last_n", "frequency_penalty", "presence_penalty", "priority",
)  # fmt: skip
DEFAULT_N_PREDICT = 128


def infill_request(body: InfillBody, request_id: str, max_tokens_limit: int) -> GenerateRequest:
    """The daemon request for an /infill body; ``msgspec.ValidationError`` or ``ValueError``
    for a bad one (the socket protocol's own checks)."""
    n_predict = body.n_predict if body.n_predict is not None and body.n_predict > 0 else body.max_tokens
    fields: dict[str, Any] = {
        "id": request_id, "prompt": body.input_prefix, "suffix": body.input_suffix,
        "max_tokens": n_predict or min(DEFAULT_N_PREDICT, max_tokens_limit),
    }  # fmt: skip
    if body.prompt:
        fields["middle"] = body.prompt
    if body.input_extra:
        fields["input_extra"] = body.input_extra
    for name in _PASSED:
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    return msgspec.convert(minus_one_means(fields), GenerateRequest)


class InfillAnswer(Struct, omit_defaults=True):
    """llama-server's /completion shape: a whole answer, or one stream chunk."""

    content: str
    stop: bool
    index: int = 0
    model: str | None = None
    stop_type: str | None = None  # "eos" (the model ended or a stop string) or "limit"
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    truncated: bool | None = None


def infill_answer(eos: EosEvent, model: str, content: str) -> InfillAnswer:
    usage = eos.usage
    return InfillAnswer(
        content=content, stop=True, model=model, stop_type="limit" if eos.reason == "length" else "eos",
        tokens_predicted=usage.completion_tokens, tokens_evaluated=usage.prompt_tokens, truncated=False,
    )  # fmt: skip
