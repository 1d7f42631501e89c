"""Sampling parity (issue 20, point 4): llama.cpp's sampler chains for penalties, biases,
typical, DRY, XTC and Mirostat; log-probabilities; through the openai SDK and the socket."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import pytest

from uma_trio.client import UmaClient
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.logprobs import LogprobSampler
from uma_trio.engine.sampler_chain import ChainSampler
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.protocol.messages import EosEvent, TokenEvent
from uma_trio.protocol.openai_choices import whole_eos
from uma_trio.runtime.server import Server

from .conftest import openai_sdk

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colours."},
]


def rows(model: LlamaModel, n: int = 40) -> list[np.ndarray[Any, np.dtype[np.float32]]]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(model.n_vocab).astype(np.float32) * 3 for _ in range(n)]


def draws(model: LlamaModel, rows_: list[Any], **params: Any) -> list[int]:
    sampler = model.vocabulary.sampler(SamplingParams(**params))
    return [sampler.sample(row.copy()) for row in rows_]


@pytest.mark.parametrize(
    "params",
    [
        {"repeat_penalty": 1.3},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"typical_p": 0.5},
        {"dry_multiplier": 0.8},
        {"xtc_probability": 0.5, "xtc_threshold": 0.05},
        {"mirostat": 1},
        {"mirostat": 2},
    ],
)
def test_each_chain_sampler_runs_seeded_and_reproducibly(
    llama_model: LlamaModel, params: dict[str, Any]
) -> None:
    sample_rows = rows(llama_model)
    first = draws(llama_model, sample_rows, temperature=0.9, seed=11, **params)
    assert type(llama_model.vocabulary.sampler(SamplingParams(**params))) is ChainSampler
    assert first == draws(llama_model, sample_rows, temperature=0.9, seed=11, **params)
    assert all(0 <= t < llama_model.n_vocab for t in first)
    assert first != draws(llama_model, sample_rows, temperature=0.9, seed=12, **params)


def test_every_seed_repeats_and_every_bit_of_it_counts(llama_model: LlamaModel) -> None:
    """4294967295 is llama.cpp's "random seed": a request with that seed did not repeat; and
    seeds differing above bit 31 drew alike."""
    sample_rows = rows(llama_model)
    chain = {"temperature": 0.9, "repeat_penalty": 1.3}
    for seed in (4294967295, 2**33 - 1, 0):
        assert draws(llama_model, sample_rows, seed=seed, **chain) == draws(
            llama_model, sample_rows, seed=seed, **chain
        )
    assert draws(llama_model, sample_rows, seed=7, **chain) != draws(
        llama_model, sample_rows, seed=7 + 2**32, **chain
    )


def test_plain_parameters_keep_the_numpy_sampler(llama_model: LlamaModel) -> None:
    assert type(llama_model.vocabulary.sampler(SamplingParams(temperature=0.7))) is Sampler


def test_penalties_bias_and_a_ban_act_as_specified(llama_model: LlamaModel) -> None:
    row = rows(llama_model, 1)[0]
    best, second = (int(t) for t in np.argsort(row)[::-1][:2])
    # A ban (-100 arrives as -inf) and a bias that lifts the second best over the best.
    assert draws(llama_model, [row], temperature=0.0, logit_bias=((best, -math.inf),)) == [second]
    lift = float(row[best] - row[second]) + 1.0
    assert draws(llama_model, [row], temperature=0.0, logit_bias=((second, lift),)) == [second]
    # Greedy on the same row again and again: a frequency penalty moves off a token once it
    # has been drawn; without one, the same token every time.
    assert (
        draws(llama_model, [row] * 3, temperature=0.0, repeat_penalty=1.0, logit_bias=((0, 0.0),))
        == [best] * 3
    )
    penalised = draws(llama_model, [row] * 3, temperature=0.0, frequency_penalty=2.0)
    assert penalised[0] == best and penalised[1] != best


def test_logprobs_are_the_model_s_own_distribution(llama_model: LlamaModel) -> None:
    row = rows(llama_model, 1)[0]
    sampler = llama_model.vocabulary.sampler(SamplingParams(temperature=0.0), top_logprobs=3)
    assert isinstance(sampler, LogprobSampler)
    token = sampler.sample(row.copy())
    record = sampler.take()
    assert record is not None and sampler.take() is None
    expected = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64) - row.max()).sum()) - row.max()
    assert record.drawn.token_id == token == int(np.argmax(row))
    assert record.drawn.logprob == pytest.approx(expected[token])
    assert [t.token_id for t in record.top] == [int(t) for t in np.argsort(row)[::-1][:3]]
    assert record.top[0].logprob >= record.top[1].logprob >= record.top[2].logprob


async def test_openai_sdk_logprobs_streamed_and_whole_agree(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=5,  # type: ignore[arg-type]
        )
        content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and "".join(e.token for e in content) == whole.choices[0].message.content
        for entry in content:
            assert len(entry.top_logprobs) == 5 and entry.logprob <= 0
            assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
            assert bytes(entry.bytes or []) == entry.token.encode()
        stream = await client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=12,
            logprobs=True, top_logprobs=5, stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        streamed = [e async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                    for e in chunk.choices[0].logprobs.content or []]  # fmt: skip
        assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
            (e.token, round(e.logprob, 4)) for e in content
        ]
        legacy = await client.completions.create(
            model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3
        )
        described = legacy.choices[0].logprobs
        assert described is not None and "".join(described.tokens or []) == legacy.choices[0].text
        assert all(len(top) == 3 for top in described.top_logprobs or [])
        assert (described.text_offset or [None])[0] == 0


async def test_a_banned_token_never_appears_and_penalties_change_the_text(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:

        async def answer(messages: list[Any] = ASK, **extra: Any) -> tuple[str, list[str]]:
            reply = await client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=24, logprobs=True, **extra
            )
            tokens = [e.token for e in reply.choices[0].logprobs.content or []]  # type: ignore[union-attr]
            return reply.choices[0].message.content or "", tokens

        plain, tokens = await answer()
        first_id = keyed_http_server.engine.tokenize(tokens[0])  # type: ignore[attr-defined]
        banned_text, banned_tokens = await answer(logit_bias={str(int(first_id[-1])): -100})
        assert tokens[0] not in banned_tokens and banned_text != plain
        # A frequency penalty (OpenAI's, over the generated tokens) breaks a repetition.
        repeat = [ASK[0], {"role": "user", "content": "Count from 1 to 20."}]
        plain, _ = await answer(repeat)  # "1. 1\n2. 2\n...": "." and "\n" again and again
        penalised, _ = await answer(repeat, frequency_penalty=2.0)
        assert penalised.count("\n") < plain.count("\n")


async def test_the_socket_sends_logprobs_with_each_token(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        async with client.stream(
            messages=ASK, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
        ) as events:
            tokens = [e async for e in events if isinstance(e, TokenEvent)]
        assert tokens and all(e.logprobs for e in tokens)
        assert all(len(lp.top_logprobs) == 2 for e in tokens for lp in e.logprobs or [])
        done = await client.complete(messages=ASK, temperature=0, max_tokens=8, stream=False, logprobs=True)
        assert done.eos.logprobs and "".join(lp.token for lp in done.eos.logprobs) == done.text
        # A stop string's tokens are not in the text, nor their logprobs, streamed or not
        # (the whole answer kept them).
        ask = {"prompt": "List the days of the week:\n1. Monday\n2.", "temperature": 0, "max_tokens": 16}
        whole = await client.complete(**ask, stop=["\n"], stream=False, logprobs=True)
        async with client.stream(**ask, stop=["\n"], logprobs=True) as events:
            streamed = [
                lp for e in [e async for e in events] if isinstance(e, TokenEvent) for lp in e.logprobs or []
            ]
        assert whole.eos.stop_sequence == "\n" and "\n" not in whole.text
        assert [lp.token for lp in whole.eos.logprobs or []] == [lp.token for lp in streamed]
        assert "".join(lp.token for lp in streamed) == whole.text


async def test_n_choices_share_the_prompt_and_differ_by_seed(
    keyed_http_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n=3``: three choices, indexed, usage counting the prompt once; choices 1 and 2 start
    once choice 0's prompt is in the KV cache and copy it instead of prefilling it."""
    import uma_trio.http.gateway as gateway

    seen: list[EosEvent] = []

    def spy(events: Any) -> EosEvent:
        eos = whole_eos(events)
        seen.append(eos)
        return eos

    monkeypatch.setattr(gateway, "whole_eos", spy)
    async with openai_sdk(keyed_http_server) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=ASK, n=3, temperature=1.0, seed=5, max_tokens=16
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert all(c.message.content for c in reply.choices)
        assert len({c.message.content for c in reply.choices}) > 1  # three seeds, three draws
        assert reply.usage is not None and reply.usage.prompt_tokens == seen[0].usage.prompt_tokens
        assert reply.usage.completion_tokens == sum(e.usage.completion_tokens for e in seen)
        prompt = seen[0].usage.prompt_tokens
        assert all(e.usage.cached_tokens >= prompt - 1 for e in seen[1:]), [e.usage for e in seen]
        again = await client.chat.completions.create(
            model=MODEL, messages=ASK, n=3, temperature=1.0, seed=5, max_tokens=16
        )
        assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
        text = await client.completions.create(
            model=MODEL, prompt="Once upon a time", n=2, max_tokens=8, seed=1
        )
        assert [c.index for c in text.choices] == [0, 1]


def test_xtc_leaves_the_candidates_where_the_next_token_finds_them(llama_model: LlamaModel) -> None:
    """XTC removes the likeliest candidates by moving the array's data pointer past them; the
    pointer stayed moved, so the next token's chain read a window reaching past the buffer
    (a full run drew token 0 where a rerun with the same seed drew 17676)."""
    sampler = llama_model.vocabulary.sampler(
        SamplingParams(temperature=0.9, seed=1, xtc_probability=1.0, xtc_threshold=0.05)
    )
    assert isinstance(sampler, ChainSampler)
    row = np.full(llama_model.n_vocab, -100.0, dtype=np.float32)
    row[[5, 6]] = [10.0, 9.5]  # both above the threshold: XTC cuts 5, only 6 is left
    for _ in range(3):
        assert sampler.sample(row.copy()) == 6
        start = ctypes.cast(sampler._array.data, ctypes.c_void_p).value
        assert start == sampler._data.ctypes.data  # where the next token's logits are written
