"""Token sampling on a logits row, in numpy.  Pure: no llama_cpp, no I/O.

The row is a zero-copy view of llama.cpp's logits buffer, so nothing here may
keep a reference to it after :meth:`Sampler.sample` returns.  Filters run in
llama.cpp's default order (top-k, top-p, min-p, temperature, draw), so a
request behaves as it would under llama-server with the same parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

GREEDY_BELOW = 1e-4  # temperatures under this sample greedily (docs/PROTOCOL.md)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    # The rest run in a llama.cpp sampler chain (engine/sampler_chain.py); these defaults
    # turn each off, and a request that leaves them so samples here, in numpy.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # generated tokens the three penalties look back over
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    typical_p: float = 1.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0  # 1 or 2: that Mirostat version instead of top-k/top-p/min-p
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans the token

    @property
    def needs_chain(self) -> bool:
        """Whether sampling needs more than this module's filters: penalties, biases, typical,
        DRY, XTC or Mirostat (then llama.cpp's sampler chain runs it)."""
        return (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
            or self.typical_p < 1.0 or self.dry_multiplier > 0.0 or self.xtc_probability > 0.0
            or self.mirostat != 0 or bool(self.logit_bias)
        )  # fmt: skip

    @property
    def greedy(self) -> bool:
        # Below this a draw is argmax anyway, and logits / temperature would overflow to inf
        # (1e-310 gave NaN probabilities and failed the request mid-stream).
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Per-request sampler: its parameters and its own random stream."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    @property
    def is_argmax(self) -> bool:
        """Whether :meth:`sample` is a plain argmax, which the engine may run for many
        rows in one call instead (not when a subclass does more in :meth:`sample`)."""
        return self.params.greedy and type(self).sample is Sampler.sample

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        p = self.params
        if p.greedy or logits.shape[0] == 1:  # one candidate (the simulated engine's row): no draw
            return int(np.argmax(logits))
        n_vocab = logits.shape[0]
        k = p.top_k if 0 < p.top_k < n_vocab else n_vocab
        if k < n_vocab:
            candidates = np.argpartition(logits, n_vocab - k)[n_vocab - k :]
        else:
            candidates = np.arange(n_vocab)
        order = np.argsort(logits[candidates])[::-1]
        candidates = candidates[order]
        values = logits[candidates].astype(np.float64)

        probs = _softmax(values)
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            candidates, values, probs = candidates[:keep], values[:keep], probs[:keep]
        if p.min_p > 0.0:
            mask = probs >= p.min_p * probs[0]
            candidates, values = candidates[mask], values[mask]

        final = _softmax(values / p.temperature)
        return int(candidates[self._rng.choice(final.shape[0], p=final)])


def _softmax(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    shifted = np.exp(values - values.max())
    result: npt.NDArray[np.float64] = shifted / shifted.sum()
    return result


def banned(bias: float) -> float:
    """OpenAI's -100 bans a token: as -inf, whatever the logits' scale."""
    return -math.inf if bias <= -100 else bias
