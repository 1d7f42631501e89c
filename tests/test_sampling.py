from __future__ import annotations

import numpy as np

from uma_trio.engine.sampling import Sampler, SamplingParams


def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=1000).astype(np.float32)


def test_greedy_is_argmax() -> None:
    row = logits()
    assert Sampler(SamplingParams(temperature=0.0)).sample(row) == int(np.argmax(row))


def test_top_k_one_is_argmax_at_any_temperature() -> None:
    row = logits()
    assert Sampler(SamplingParams(temperature=5.0, top_k=1, seed=1)).sample(row) == int(np.argmax(row))


def test_same_seed_same_draws() -> None:
    row = logits()
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    assert [a.sample(row) for _ in range(20)] == [b.sample(row) for _ in range(20)]


def test_min_p_removes_unlikely_tokens() -> None:
    row = np.full(100, -10.0, dtype=np.float32)
    row[[3, 7]] = [5.0, 4.9]
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=3))
    assert {sampler.sample(row) for _ in range(50)} == {3, 7}


def test_a_tiny_temperature_samples_greedily() -> None:
    """Issue 17: 1e-310 overflowed logits / temperature to inf and failed the request (NaN)."""
    logits = np.array([0.5, 2.0, 1.0, -3.0], dtype=np.float32)
    for temperature in (1e-310, 1e-9, 5e-5):
        assert Sampler(SamplingParams(temperature=temperature, seed=1)).sample(logits) == 1


def test_a_zero_bias_changes_nothing_not_even_the_sampler_that_draws() -> None:
    """``logit_bias: {"99": 0}`` is no bias: a seeded request must draw as without it (kept,
    it moved the request onto llama.cpp's chain, whose draws differ from numpy's)."""
    from uma_trio.protocol.messages import GenerateRequest
    from uma_trio.runtime.samplers import sampling_params

    def params(bias: dict[str, float]) -> SamplingParams:
        return sampling_params(GenerateRequest(id="r", prompt="hi", seed=5, temperature=1.0, logit_bias=bias))

    assert params({"99": 0}) == params({}) and not params({"99": 0.0}).needs_chain
    assert params({"99": 0, "5": 2.5}).logit_bias == ((5, 2.5),) and params({"5": 2.5}).needs_chain
