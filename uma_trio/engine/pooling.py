"""An input's embedding from the hidden states of its tokens, however its prompt was chunked.

A generative model's GGUF usually names no pooling (llama.cpp's ``NONE``): the context then
returns every output token's final hidden state, and uma-trio pools them here.  The context
is always made with ``NONE`` (engine/llama.py), whatever the GGUF says, and the GGUF's
``<arch>.pooling_type`` picks :data:`PoolingMode`: llama.cpp's own pooling works on one
micro-batch at a time, while a long input here is prefilled in chunks over several ticks
beside other requests (the KV cache carries the causal context between them).

Each step hands back, per embedding sequence, a :class:`PooledPart` (the sum of its rows for
``mean``, the first token's row for ``first``, the last row for ``last``); the session folds
the parts in an :class:`EmbeddingPool` and ends with :meth:`EmbeddingPool.result`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

PoolingMode = Literal["mean", "first", "last"]
Vector = npt.NDArray[np.float64]

# llama.cpp's enum llama_pooling_type (llama.h) as the GGUF stores it; RANK (a reranker's
# score) has no embedding to give, and NONE means "per token": both pool as the mean.
_GGUF_POOLING: dict[int, PoolingMode] = {1: "mean", 2: "first", 3: "last"}


def pooling_mode(gguf_pooling_type: int | None) -> PoolingMode:
    """How to pool a model whose GGUF says ``<arch>.pooling_type`` (None: it does not)."""
    return _GGUF_POOLING.get(gguf_pooling_type if gguf_pooling_type is not None else 0, "mean")


@dataclass(frozen=True, slots=True)
class PooledPart:
    """What one step adds to a sequence's embedding: ``vector`` pools ``rows`` tokens."""

    seq_id: int
    mode: PoolingMode
    vector: Vector
    rows: int


def pool_rows(seq_id: int, mode: PoolingMode, rows: npt.NDArray[np.float32], pos0: int) -> PooledPart | None:
    """The part of ``rows`` (hidden states of a chunk starting at position ``pos0``, one row a
    token) that the pool keeps; None when it keeps nothing (``first`` after the first chunk)."""
    if len(rows) == 0 or (mode == "first" and pos0 != 0):
        return None
    if mode == "mean":
        return PooledPart(seq_id, mode, rows.sum(axis=0, dtype=np.float64), len(rows))
    row = rows[0] if mode == "first" else rows[-1]
    return PooledPart(seq_id, mode, row.astype(np.float64), 1)


class EmbeddingPool:
    """One input's parts, folded as they come (in prompt order: the loop prefills in order)."""

    def __init__(self) -> None:
        self._vector: Vector | None = None
        self._rows = 0

    def add(self, part: PooledPart) -> None:
        if part.mode == "mean" and self._vector is not None:
            self._vector = self._vector + part.vector
            self._rows += part.rows
        elif part.mode != "first" or self._vector is None:  # "last": the latest row wins
            self._vector, self._rows = part.vector, part.rows

    def result(self, *, normalize: bool) -> list[float]:
        """The embedding: the pooled vector, scaled to unit length if ``normalize``."""
        if self._vector is None:
            raise ValueError("no token of the input was pooled")
        vector = self._vector / max(self._rows, 1)
        if normalize:
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        values: list[float] = vector.astype(np.float32).tolist()  # what a float32 client reads
        return values
