"""Log-probabilities of the tokens a request draws, and of the most likely alternatives.

Taken from the model's own distribution: the row as the model produced it, before penalties,
biases, a grammar's mask or the truncation samplers (as OpenAI and vLLM report them).  The
sampler records one entry per drawn token, on the compute thread; the decode loop takes them
in the same order as it takes the tokens (a step run ahead may have drawn the next already).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .sampling import Sampler


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class DrawnLogprob:
    """One drawn token's log-probability and the ``top`` most likely tokens' (best first)."""

    drawn: Logprob
    top: tuple[Logprob, ...]


class LogprobSampler(Sampler):
    """Wraps a request's sampler and records its draws' log-probabilities."""

    def __init__(self, inner: Sampler, top_n: int, piece: Callable[[int], bytes]) -> None:
        super().__init__(inner.params)
        self.inner = inner
        self._top_n = top_n
        self._piece = piece
        self.records: deque[DrawnLogprob] = deque()

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        logprobs = log_softmax(logits)  # before the inner sampler changes the row
        token = self.inner.sample(logits)
        top: tuple[Logprob, ...] = ()
        if self._top_n:
            best = np.argpartition(logprobs, -self._top_n)[-self._top_n :]
            best = best[np.argsort(logprobs[best])[::-1]]
            top = tuple(self._entry(int(t), logprobs) for t in best)
        self.records.append(DrawnLogprob(self._entry(token, logprobs), top))
        return token

    def _entry(self, token: int, logprobs: npt.NDArray[np.float64]) -> Logprob:
        return Logprob(token, self._piece(token), float(logprobs[token]))

    def take(self) -> DrawnLogprob | None:
        """The oldest draw's record, in draw order."""
        return self.records.popleft() if self.records else None


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    shifted = logits.astype(np.float64) - float(np.max(logits))
    result: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum())
    return result
