"""A request's sampler as a llama.cpp sampler chain, for what the numpy sampler does not do:
repetition, frequency and presence penalties, logit biases, typical-p, DRY, XTC, Mirostat.

The chain is built as llama-server builds its own (common/sampling.cpp), in the same order:
logit bias, penalties, DRY, top-k, typical, top-p, min-p, XTC, temperature, then a seeded
draw (or greedy at temperature 0, or Mirostat instead of the truncation samplers).  Each row
is copied into a ``llama_token_data`` array that the chain filters in C; the drawn token is
then accepted into the chain's history, so the penalties and DRY see the generated text.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from .libllama import llama
from .sampling import Sampler, SamplingParams

# llama_token_data, as numpy sees it: the chain works on this array in place.
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
DRY_BREAKERS = ["\n", ":", '"', "*"]  # llama-server's default sequence breakers
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed


def chain_seed(seed: int) -> int:
    """A request's seed as llama.cpp's 32-bit one: every bit of it counts (seeds differing
    above bit 31 drew alike), and never DEFAULT_SEED, which llama.cpp takes as "random" (a
    seed of 4294967295 did not repeat)."""
    folded = int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])
    return folded if folded != DEFAULT_SEED else 0


class ChainSampler(Sampler):
    """A request's sampler, run by llama.cpp; freed with the request."""

    def __init__(self, params: SamplingParams, vocab: Any, n_vocab: int) -> None:
        super().__init__(params)
        self._n_vocab = n_vocab
        self._data = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        # llama_cpp types the field as an array; ctypes takes the pointer to our buffer
        self._start: Any = ctypes.cast(self._data.ctypes.data, ctypes.POINTER(llama.llama_token_data))
        self._array = llama.llama_token_data_array(
            data=self._start, size=n_vocab, selected=-1, sorted=False,
        )  # fmt: skip
        self._keep: list[Any] = []  # ctypes buffers the chain's samplers point into
        self._chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        for sampler in self._samplers(params, vocab):
            llama.llama_sampler_chain_add(self._chain, sampler)

    def _samplers(self, p: SamplingParams, vocab: Any) -> list[Any]:
        seed = DEFAULT_SEED if p.seed is None else chain_seed(p.seed)
        chain = []
        if p.logit_bias:
            biases = (llama.llama_logit_bias * len(p.logit_bias))(
                *(llama.llama_logit_bias(token=t, bias=b) for t, b in p.logit_bias)
            )
            self._keep.append(biases)
            chain.append(llama.llama_sampler_init_logit_bias(self._n_vocab, len(p.logit_bias), biases))
        if p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            chain.append(
                llama.llama_sampler_init_penalties(
                    self._n_vocab, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
                )
            )
        if p.dry_multiplier > 0.0:
            breakers = (ctypes.c_char_p * len(DRY_BREAKERS))(*(b.encode() for b in DRY_BREAKERS))
            self._keep.append(breakers)
            chain.append(
                llama.llama_sampler_init_dry(
                    vocab,
                    p.dry_multiplier,
                    p.dry_base,
                    p.dry_allowed_length,
                    p.dry_penalty_last_n,
                    breakers,
                    len(DRY_BREAKERS),
                )
            )
        if p.greedy:
            return [*chain, llama.llama_sampler_init_greedy()]
        if p.mirostat == 1:
            mirostat = llama.llama_sampler_init_mirostat(
                self._n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100
            )
            return [*chain, llama.llama_sampler_init_temp(p.temperature), mirostat]
        if p.mirostat == 2:
            mirostat = llama.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta)
            return [*chain, llama.llama_sampler_init_temp(p.temperature), mirostat]
        if 0 < p.top_k < self._n_vocab:
            chain.append(llama.llama_sampler_init_top_k(p.top_k))
        if p.typical_p < 1.0:
            chain.append(llama.llama_sampler_init_typical(p.typical_p, 1))
        if p.top_p < 1.0:
            chain.append(llama.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            chain.append(llama.llama_sampler_init_min_p(p.min_p, 1))
        if p.xtc_probability > 0.0:
            chain.append(llama.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed))
        return [*chain, llama.llama_sampler_init_temp(p.temperature), llama.llama_sampler_init_dist(seed)]

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        self._data["logit"] = logits
        self._data["id"] = self._ids  # the chain reorders the array in place
        array = self._array
        array.size, array.selected, array.sorted = self._n_vocab, -1, False
        try:
            llama.llama_sampler_apply(self._chain, ctypes.byref(array))
            if not 0 <= array.selected < array.size:
                raise RuntimeError("llama.cpp's sampler chain selected no token")
            token = int(array.data[array.selected].id)
        finally:
            # XTC cuts the candidates by moving the array's data pointer past them: left so,
            # the next token's chain ran on a window past the buffer's end (a flaky test drew
            # token 0, a read of memory after it).
            array.data = self._start
        llama.llama_sampler_accept(self._chain, token)
        return token

    def close(self) -> None:
        if self._chain:
            llama.llama_sampler_free(self._chain)  # frees the samplers it holds
            self._chain = None

    def __del__(self) -> None:
        self.close()
