"""``n`` > 1: one OpenAI answer from several daemon requests on the same prompt.  Pure.

Each choice is a request of its own (``ID-i``, seed + i when a seed is given, so seeded
choices differ and repeat).  The gateway starts choice 0 first and the others once its
prompt is in the KV cache, so they copy its cells instead of prefilling it again (the KV
manager reuses a *running* sequence's prefix); their answers are merged here.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .messages import EosEvent, GenerateRequest, ServerEvent, TokenEvent
from .openai import ChatCompletion, Completion, Usage, chat_completion, text_completion, usage_of

MAX_CHOICES = 16


def choice_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The daemon requests for ``n`` choices; each streams, so the gateway sees the first
    token (the prompt is in the KV cache) and assembles the text."""
    return [
        msgspec.structs.replace(
            request,
            id=f"{request.id}-{i}",
            stream=True,
            seed=None if request.seed is None else (request.seed + i) % 2**63,
        )
        for i in range(n)
    ]


def whole_eos(events: Sequence[ServerEvent]) -> EosEvent:
    """A streamed choice's eos as a non-streamed request's: its text and logprobs gathered."""
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    eos = events[-1]
    assert isinstance(eos, EosEvent)
    logprobs = [lp for e in tokens for lp in e.logprobs or ()] if any(e.logprobs for e in tokens) else None
    return msgspec.structs.replace(eos, text="".join(e.text for e in tokens), logprobs=logprobs)


def merged_chat(
    completion_id: str, created: int, model: str, eos: Sequence[EosEvent], legacy: bool = False
) -> ChatCompletion:
    answers = [chat_completion(completion_id, created, model, e, legacy) for e in eos]
    choices = [msgspec.structs.replace(a.choices[0], index=i) for i, a in enumerate(answers)]
    return ChatCompletion(completion_id, created, model, choices, _usage([a.usage for a in answers]))


def merged_text(completion_id: str, created: int, model: str, eos: Sequence[EosEvent]) -> Completion:
    answers = [text_completion(completion_id, created, model, e) for e in eos]
    choices = [msgspec.structs.replace(a.choices[0], index=i) for i, a in enumerate(answers)]
    usages = [a.usage for a in answers if isinstance(a.usage, Usage)]
    return Completion(completion_id, created, model, choices, usage=_usage(usages))


def merged_usage(eos: Sequence[EosEvent]) -> Usage:
    return _usage([usage_of(e) for e in eos])


def _usage(usages: Sequence[Usage]) -> Usage:
    """The prompt counted once, as OpenAI counts it; every choice's completion tokens."""
    prompt, completion = usages[0].prompt_tokens, sum(u.completion_tokens for u in usages)
    return Usage(prompt, completion, prompt + completion, usages[0].prompt_tokens_details)
