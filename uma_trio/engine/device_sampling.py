"""Greedy sampling where the logits are computed: llama.cpp's backend samplers.

A sequence with a backend sampler attached gets its next token picked inside the model's
graph (an argmax over the vocabulary on the device) and read back as one token id; when
every output of a micro-batch has one, llama.cpp copies no logits to the host at all.  At
16 streams of a 128k vocabulary that is 8 MB a step not copied and an argmax the compute
thread no longer runs.  llama-server does the same per slot (``--backend-sampling``).

Attaching or detaching a sampler makes llama.cpp re-reserve its compute graph on the next
decode, so each sequence id keeps its sampler from one request to the next and only a
non-greedy request on that id takes it off (:meth:`DeviceGreedy.route`).  Everything here
runs on the compute thread, like every other call on the context.
"""

from __future__ import annotations

import logging
from typing import Any

from .libllama import llama

log = logging.getLogger(__name__)


class DeviceGreedy:
    """Which sequence ids have a greedy backend sampler attached to the context."""

    def __init__(self, ctx: Any, enabled: bool) -> None:
        self._ctx = ctx
        self.enabled = enabled
        self._chains: dict[int, Any] = {}  # seq id -> its greedy chain (kept: attached or not)
        self._attached: set[int] = set()
        self.attach_changes = 0  # each one costs llama.cpp a graph re-reserve

    def route(self, seq_id: int, greedy: bool) -> bool:
        """Make ``seq_id``'s next output come back as a device-picked token (True) or as a
        logits row (False); returns which."""
        want = self.enabled and greedy
        if want == (seq_id in self._attached):
            return want
        if want:
            chain = self._chains.get(seq_id)
            if chain is None:
                chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
                self._chains[seq_id] = chain
            if not llama.llama_set_sampler(self._ctx, seq_id, chain):
                # The backend cannot run it (e.g. --split-mode tensor): sample on the host.
                log.warning("llama.cpp cannot sample on the device here; greedy rows come back as logits")
                self.enabled = False
                return False
            self._attached.add(seq_id)
        else:
            llama.llama_set_sampler(self._ctx, seq_id, None)
            self._attached.discard(seq_id)
        self.attach_changes += 1
        return want

    def token(self, batch_index: int) -> int | None:
        """The token the device picked for the output at ``batch_index`` (None: it picked none)."""
        token = int(llama.llama_get_sampled_token_ith(self._ctx, batch_index))
        return None if token == llama.LLAMA_TOKEN_NULL else token

    def free(self) -> None:
        """Free the chains; only after the context that holds them is freed."""
        for chain in self._chains.values():
            llama.llama_sampler_free(chain)
        self._chains.clear()
        self._attached.clear()
