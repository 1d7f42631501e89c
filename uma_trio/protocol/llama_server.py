"""llama-server's ``POST /infill``, the endpoint editors' code-completion plugins call
(llama.vim, llama.vscode): its body as a daemon request, its answer and stream chunks.  Pure.

``input_prefix`` and ``input_suffix`` surround the cursor, ``input_extra`` holds other files
(``{"filename", "text"}``; other keys, such as llama.vim's ``time``, are dropped) as context,
and ``prompt`` is the start of the middle already typed.  Sampling fields are the socket's
(llama-server's names); ``n_predict`` is its ``max_tokens``: -1 or unset, up to
``--max-tokens`` (and the context's room); more than those, cut to them (as llama-server cuts
it to the context), never refused; 0, nothing generated (:func:`no_tokens_answer`).
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
    # llama-server's forms: {"id": bias}, or [[id, bias]] where false bans the token.
    logit_bias: dict[str, Any] | list[Any] | None = None
    priority: Literal["interactive", "background"] | None = None


_PASSED = (
    "stream", "stop", "seed", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "repeat_last_n", "frequency_penalty", "presence_penalty", "priority",
)  # fmt: skip
_EXTRA_KEYS = ("filename", "text")  # of an input_extra item, the ones the daemon reads


def n_predict(body: InfillBody) -> int | None:
    """How many tokens to generate: None for llama-server's -1 ("infinity") or no limit given,
    which the gateway caps at ``--max-tokens`` and the context's room; 0 for none."""
    n = body.n_predict if body.n_predict is not None else body.max_tokens
    return None if n is None or n < 0 else n


def infill_request(
    body: InfillBody, request_id: str, max_tokens_limit: int, context: int | None = None
) -> GenerateRequest:
    """The daemon request for an /infill body that generates (``n_predict`` is not 0), its
    answer within ``max_tokens_limit`` (--max-tokens) and ``context`` (the per-request
    context); ``msgspec.ValidationError`` or ``ValueError`` for a bad one (the socket
    protocol's checks)."""
    # Cut to fit, never refused for its length, as llama-server cuts an infill (engine/infill.py).
    fields: dict[str, Any] = {
        "id": request_id, "prompt": body.input_prefix, "suffix": body.input_suffix, "truncate": True
    }  # fmt: skip
    if (n := n_predict(body)) is None:
        fields["max_tokens"] = max_tokens_limit  # the gateway cuts it to the context's room
    else:  # a ceiling, as llama-server's: cut, never refused
        fields["max_tokens"] = min(n, max_tokens_limit)
        if context is not None:  # the daemon cuts max_tokens to max_context less the prompt
            fields["max_context"] = context
    if body.prompt:
        fields["middle"] = body.prompt
    if body.input_extra:
        fields["input_extra"] = [_extra_file(item) for item in body.input_extra]
    for name in _PASSED:
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    if body.logit_bias is not None:
        fields["logit_bias"] = _logit_bias(body.logit_bias)
    return msgspec.convert(minus_one_means(fields), GenerateRequest)


def _logit_bias(value: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """llama-server's ``logit_bias`` as the socket's ``{"id": bias}`` (checked there);
    ``ValueError`` for a pair that is not ``[id, bias]``.  A token given as text (llama-server
    biases each of its tokens) is refused: give its ids."""
    if isinstance(value, dict):
        return value
    biases: dict[str, Any] = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"logit_bias: each item must be [token id, bias], not {pair!r}"[:200])
        token, bias = pair
        if isinstance(token, str):
            raise ValueError("logit_bias: a token given as text is not supported; give token ids")
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"logit_bias: a token id must be an integer, not {token!r}"[:200])
        biases[str(token)] = -100.0 if bias is False else bias
    return biases


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


def _extra_file(item: Any) -> Any:
    """An input_extra item without the keys the daemon does not read (llama.vim sends ``time``;
    llama-server ignores unknown keys, the socket protocol refuses them)."""
    return {k: item[k] for k in _EXTRA_KEYS if k in item} if isinstance(item, dict) else item


def no_tokens_answer(model: str) -> InfillAnswer:
    """The answer to ``n_predict: 0``.  llama-server evaluates the prompt into its cache; the
    daemon has no prefill-only request (``max_tokens`` is at least 1), so nothing runs and
    the cache is not warmed."""
    return InfillAnswer(
        content="", stop=True, model=model, stop_type="limit", tokens_predicted=0, truncated=False
    )


def infill_answer(eos: EosEvent, model: str, content: str) -> InfillAnswer:
    usage = eos.usage
    return InfillAnswer(
        content=content, stop=True, model=model, stop_type="limit" if eos.reason == "length" else "eos",
        tokens_predicted=usage.completion_tokens, tokens_evaluated=usage.prompt_tokens, truncated=False,
    )  # fmt: skip
