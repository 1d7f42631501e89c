"""Token sampling on a logits row, in numpy.  Pure: no llama_cpp, no I/O.

The row is a zero-copy view of llama.cpp's logits buffer, so nothing here may
keep a reference to it after :meth:`Sampler.sample` returns.  Filters run in
llama.cpp's default order (top-k, top-p, min-p, temperature, draw), so a
request behaves as it would under llama-server with the same parameters.
"""

from __future__ import annotations

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
