"""What the runtime needs from an engine, and the data crossing that boundary.

The decode task is the only caller of :meth:`Engine.step` and of the methods
that touch the KV cache, so engines need no locks.  ``tokenize`` and friends
read only the immutable vocabulary and may run in any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .constraints import ModelVocabulary
from .pooling import PooledPart
from .sampling import Sampler

TokenArray = npt.NDArray[np.int32]
# One chat turn for the engine: (role, content), or the template's message dict (role, content
# and what else the turn has: tool_calls, tool_call_id, name).
ChatTurn = tuple[str, str] | Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]] | None  # OpenAI's `tools`, as the chat template reads them
TemplateArgs = Mapping[str, Any] | None  # more variables for the chat template (chat_template_kwargs)


def turn_fields(turn: ChatTurn) -> dict[str, Any]:
    """A chat turn as the template's message dict."""
    if isinstance(turn, tuple):
        role, content = turn
        return {"role": role, "content": content}
    return dict(turn)


def split_prefill(turns: Sequence[Mapping[str, Any]]) -> tuple[Sequence[Mapping[str, Any]], str]:
    """A chat whose last message is the assistant's own text (no tool calls, after at least
    one other message) asks for that text to be *continued*: Anthropic's prefill, and what
    llama-server and Ollama do with such a chat.  The turns before it, and its text ("" and
    the chat unchanged where there is none).  An empty one continues nothing: it is left out
    (Anthropic takes it so; rendered, it was an empty answer the model then answered after)."""
    if len(turns) < 2:
        return turns, ""
    last = turns[-1]
    content = last.get("content")
    if last.get("role") != "assistant" or last.get("tool_calls") or not isinstance(content, str):
        return turns, ""
    return turns[:-1], content


# A sequence's saved KV cells: llama.cpp writes them into a bytearray, not copied into bytes
# (a snapshot's state may be gigabytes).
KvState = bytes | bytearray


@dataclass(slots=True)
class BatchEntry:
    """A run of tokens for one sequence, placed at positions ``pos0 ...``.

    With a ``sampler`` the last token's logits are requested and one next
    token is sampled for this sequence; without one (a middle prompt chunk)
    no logits are computed at all.
    """

    seq_id: int
    tokens: TokenArray
    pos0: int
    sampler: Sampler | None
    # An embedding request's chunk: every token's hidden state is pooled (engine/pooling.py)
    # into the step result's ``pooled``; it is never sampled.
    embed: bool = False


@dataclass(frozen=True, slots=True)
class Sampled:
    seq_id: int
    token_id: int
    piece: bytes
    is_eog: bool


@dataclass(frozen=True, slots=True)
class SampleFailure:
    """Choosing ``seq_id``'s next token raised; the batch itself decoded."""

    seq_id: int
    message: str


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: list[Sampled]
    n_tokens: int
    decode_s: float  # wall time of the decode call (plus sampling)
    failed: list[SampleFailure] = field(default_factory=list)
    pooled: list[PooledPart] = field(default_factory=list)  # one per embedding entry
    # How long the engine kept the result before handing it back (``step(..., hold=True)``):
    # it was ready that long before its caller saw it.
    held_s: float = 0.0

    def __add__(self, other: StepResult) -> StepResult:
        """Two steps' results as one (a batch decoded in parts)."""
        return StepResult(
            self.sampled + other.sampled, self.n_tokens + other.n_tokens,
            self.decode_s + other.decode_s, self.failed + other.failed, self.pooled + other.pooled,
        )  # fmt: skip


# Run-ahead: given the batch a step just ran and its result, the next batch to decode at once
# (on the engine's own thread, before the event loop has seen the result), or None to stop.
# Called on the compute thread: it may read only what its maker prepared for it.
Follow = Callable[[Sequence[BatchEntry], StepResult], Sequence[BatchEntry] | None]


class EngineError(Exception):
    """``llama_decode`` returned ``status`` (llama.h): 1, no KV slot for the batch; -1, an
    invalid batch; 2, aborted; below -1, a fatal error.  After 1 and -1 llama.cpp has
    changed nothing (:attr:`rejected`); after the others, ubatches already processed stay
    in the KV cache, so the context no longer matches anybody's bookkeeping."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def kv_full(self) -> bool:
        return self.status == 1

    @property
    def rejected(self) -> bool:
        """The batch was refused before anything ran: it may be retried in parts."""
        return self.status in (1, -1)

    @property
    def preempted(self) -> bool:
        """A preemptible step stopped early at :meth:`Engine.preempt`; the engine has undone
        all of it (every entry's sequence is back at its ``pos0``), so nothing changed."""
        return self.status == 2


class Engine(Protocol):
    """A model plus one context: the runtime's view of llama.cpp (or a simulation)."""

    @property
    def n_ctx(self) -> int:
        """KV cells in the whole context."""
        ...

    @property
    def n_ctx_seq(self) -> int:
        """KV cells one sequence may hold: its prompt plus every token it generates."""
        ...

    @property
    def n_seq_max(self) -> int: ...

    @property
    def n_batch(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer_blocks(self) -> bool:
        """Whether tokenizing takes real time (then the server runs it in a thread)."""
        ...

    @property
    def step_frees_host(self) -> bool:
        """Whether a step leaves the host's cores idle (every layer on a GPU), so delivering
        the last step's tokens can overlap the next; on a CPU the step needs every core."""
        ...

    @property
    def captures_graphs(self) -> bool:
        """Whether a step's second run in a row at the same batch shape is captured as a graph
        and later ones replayed (llama.cpp's CUDA backend): the policy keeps prompt ticks off
        the shape that would be captured for nothing (sched/graph_shapes.py)."""
        ...

    @property
    def splits_at_seq_gaps(self) -> bool:
        """Whether a step decodes in one pass per run of consecutive sequence ids (llama.cpp
        with a KV stream per sequence), so the runtime keeps running ids together."""
        ...

    def tokenize(self, text: str) -> TokenArray: ...

    @property
    def max_token_bytes(self) -> int:
        """The longest token's text in bytes: a text of N bytes has at least
        N / max_token_bytes tokens (the server refuses an overlong prompt before tokenizing)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> str:
        """The chat as text, with ``tools`` (OpenAI's ``tools``) for the template to render."""
        ...

    @property
    def chat_template_source(self) -> str | None:
        """The Jinja chat template in use (None: llama.cpp's built-in formatting or none),
        from which the runtime tells how the model writes tool calls."""
        ...

    @property
    def tool_template_source(self) -> str | None:
        """The Jinja template a request that offers tools is rendered with: the GGUF's named
        ``tool_use`` template where it has one (Hermes 2 Pro / 3, Command-R), else
        :attr:`chat_template_source`."""
        ...

    @property
    def vocabulary(self) -> ModelVocabulary | None:
        """The vocabulary for constrained decoding (engine/constraints.py); None where the
        engine has no real vocabulary (the simulation)."""
        ...

    def tokenize_infill(
        self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
        budget: int | None = None,
    ) -> TokenArray:  # fmt: skip
        """A fill-in-the-middle prompt (engine/infill.py): ``extra`` is (file name, text) of
        other files; with ``budget``, cut to that many tokens where it can be (as llama-server
        cuts an infill); ``NoFimTokens`` (a ValueError) for a model without FIM tokens."""
        ...

    def tokenize_chat(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> TokenArray:
        """The chat as tokens, control tokens only where the template put them: a message's
        content is plain text whatever it contains."""
        ...

    @property
    def can_preempt(self) -> bool:
        """Whether :meth:`preempt` can stop a step midway (llama.cpp's CPU backend polls an
        abort flag between graph nodes; GPU backends run a graph to its end)."""
        ...

    def preempt(self) -> None:
        """Stop the step in flight if it was started ``preemptible``: it raises an
        :class:`EngineError` whose ``preempted`` holds, having changed nothing.  A no-op
        otherwise.  Called from the event loop while the compute thread decodes."""
        ...

    def went_idle(self) -> None:
        """The caller has no step to run now: the time until the next one is not per-step
        overhead (``step_overhead``)."""
        ...

    async def step(
        self, entries: Sequence[BatchEntry], follow: Follow | None = None, *, preemptible: bool = False,
        hold: bool = False,
    ) -> StepResult:  # fmt: skip
        """Decode one batch and sample where asked.  Cancellation waits for the step.

        Raises :class:`EngineError` when the decode fails.  A sampler that raises fails
        only its own entry: it is listed in ``StepResult.failed``.

        With ``follow``, an engine may run ahead: right after sampling it asks ``follow``
        for the next batch and starts it without waiting for its caller; the caller then
        collects those steps with :meth:`next_ahead` while :attr:`running_ahead` holds.  An
        engine that does not run ahead ignores ``follow``.  With ``hold`` as well, it may
        keep the results of a chain (this step's included) and hand them back together,
        each marked with how long it was kept (``StepResult.held_s``): one wake-up of the
        caller for several steps, where nobody watches their tokens one by one."""
        ...

    @property
    def running_ahead(self) -> bool:
        """A step started by ``follow`` has not been collected yet."""
        ...

    async def next_ahead(self) -> tuple[Sequence[BatchEntry], StepResult]:
        """The oldest step started by ``follow``: its batch and its result (or its
        :class:`EngineError`).  Only while :attr:`running_ahead`."""
        ...

    async def rebuild(self) -> None:
        """Replace the context with a fresh one (every sequence empty), after a failure
        that left it in an unknown state."""
        ...

    def free_seq(self, seq_id: int) -> None:
        """Drop every KV cell of ``seq_id`` so the id can be reused."""
        ...

    def seq_cells(self, seq_id: int) -> int:
        """KV cells ``seq_id`` occupies now (0 once freed)."""
        ...

    def trim_seq(self, seq_id: int, keep: int) -> None:
        """Drop every cell of ``seq_id`` at position ``keep`` or later."""
        ...

    def copy_seq(self, src: int, dst: int, keep: int) -> None:
        """Make ``dst`` (holding no cells) hold ``src``'s first ``keep`` cells."""
        ...

    @property
    def kv_type(self) -> str:
        """The KV cache's element type (``f16``, ``q8_0`` or ``q4_0``)."""
        ...

    @property
    def kv_layout(self) -> str:
        """How a sequence's saved KV state is laid out beyond its type (llama.cpp refuses to
        load one saved under another): its streams, and whether V is stored transposed."""
        ...

    def fingerprint(self) -> str:
        """The model's identity for snapshots (the file's sha256); blocking, cached."""
        ...

    async def save_seq(self, seq_id: int) -> KvState:
        """``seq_id``'s KV cells as bytes (``llama_state_seq_get_data``)."""
        ...

    async def load_seq(self, seq_id: int, data: KvState) -> None:
        """Fill ``seq_id`` (holding no cells) from :meth:`save_seq`'s bytes; raises
        :class:`EngineError` when llama.cpp refuses them."""
        ...
