"""One request's life inside the daemon, and the figures it reports at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import trio

from ..engine.base import TokenArray
from ..engine.logprobs import DrawnLogprob, Logprob
from ..engine.pooling import EmbeddingPool
from ..engine.sampling import Sampler
from ..protocol.messages import (
    CancelReason,
    EosEvent,
    ErrorEvent,
    FinishReason,
    GenerateRequest,
    Lane,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ..protocol.textstream import TextStream
from ..protocol.tools import ToolFormat
from .lifecycle import Phase, advance
from .tool_use import answer_with_tools


@dataclass(frozen=True, slots=True)
class PinnedSequence:
    """A finished request's sequence left cached and pinned (a snapshot's fill): read its
    cells, then ``loop.unpin(seq_id)``."""

    seq_id: int
    cells: int
    tokens: TokenArray


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The last item of a request's stream: its error, if it failed, then its eos (whose
    timings the front end fills in as it writes it), with the loop's figures for them."""

    final: EosEvent
    error: ErrorEvent | None = None
    admitted: float | None = None  # when it got a sequence (None: it never did)
    generated: int = 0
    generated_at: TokenTimes = field(default_factory=lambda: TokenTimes())  # when each was sampled
    pinned: PinnedSequence | None = None


# What a request's channel carries: its tokens, then exactly one StreamEnd.
StreamItem = TokenEvent | StreamEnd
END_SLOTS = 1  # the channel keeps this room for the StreamEnd: a parked stream can still end


def parks(used: int, size: int) -> bool:
    """Whether a stream buffer holding ``used`` of ``size`` events leaves no room for one
    more token and the end (``END_SLOTS``): the decode loop then leaves the stream out."""
    return size - used - END_SLOTS < 2


@dataclass(eq=False)
class Session:
    """A request's sequence state, owned by the decode task once submitted.  Front ends
    never read it: they hold a :class:`~.stream.RequestStream`.

    Token events go out through ``events`` (a bounded memory channel drained by the front
    end), and then one :class:`StreamEnd`.  The channel holds ``END_SLOTS`` more than the
    stream buffer, and a session is parked while only that room is left, so the end always
    fits.  ``error`` and ``final`` stay on the session for the loop's own use.
    """

    request: GenerateRequest
    prompt: TokenArray
    sampler: Sampler
    events: trio.MemorySendChannel[StreamItem]
    created: float  # when the request's frame arrived
    connection: int = 0  # the connection's number, for the live view
    # Who sent it (docs/SECURITY.md "Prefix cache"): "uid:N" on the socket, "http" on the
    # gateway.  Only the same principal's requests reuse each other's cached prefixes.
    owner: str = ""
    text: TextStream = field(init=False)
    phase: Phase = Phase.WAITING
    seq_id: int | None = None
    n_past: int = 0  # tokens of this sequence in the KV cache
    pending_token: int | None = None  # sampled, to be fed next tick
    last_token_id: int = -1  # the latest sampled token (tags held-back text sent at the end)
    generated: int = 0
    output_ids: list[int] = field(default_factory=list)  # generated tokens, end-of-generation excluded
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (never prefilled)
    pin_on_finish: bool = False  # keep its KV cached and pinned at the end (a snapshot is taken)
    computed_tokens: int = 0  # prompt and fed-back tokens this request put through the engine
    lane: Lane = "interactive"  # from the request's priority; a priority message moves it
    last_served_tick: int = -1  # the last tick this session was in the batch
    admitted_tick: int = 0
    parked: bool = False
    abort: CancelReason | None = None
    admitted: float | None = None
    generated_at: TokenTimes = field(default_factory=lambda: TokenTimes())  # when sampled
    pieces: list[str] = field(default_factory=list)  # whole text: non-stream, or with tools
    tool_format: ToolFormat | None = None  # how the model writes tool calls, when offered tools
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with `logprobs`: not yet sent
    logprobs_kept: list[TokenLogprob] = field(default_factory=list)  # not streamed: in its text
    pool: EmbeddingPool | None = None  # an embedding request's pooled hidden states so far
    error: ErrorEvent | None = None
    final: EosEvent | None = None
    stop_sequence: str | None = None  # the stop string that ended it

    def __post_init__(self) -> None:
        self.text = TextStream(self.request.stop)
        self.lane = self.request.priority
        if self.request.embed:
            self.pool = EmbeddingPool()

    def move_to(self, phase: Phase) -> None:
        """The one way ``phase`` changes (:mod:`.lifecycle` lists the allowed moves)."""
        self.phase = advance(self.phase, phase)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def reserved_cells(self) -> int:
        """KV cells this request may come to need: its prompt plus max_tokens (an
        embedding generates nothing)."""
        return len(self.prompt) + (0 if self.request.embed else self.request.max_tokens)

    def pins_on(self, reason: FinishReason) -> bool:
        """Whether ending with ``reason`` leaves its sequence cached and pinned: a snapshot
        save's fill that completed while its requester was still there."""
        return self.pin_on_finish and reason in ("stop", "length") and self.abort is None

    def kv_tokens(self) -> TokenArray:
        """The tokens whose KV cells this session's sequence holds, in position order."""
        n_prompt = len(self.prompt)
        if self.n_past <= n_prompt:
            return self.prompt[: self.n_past]
        fed = np.asarray(self.output_ids[: self.n_past - n_prompt], dtype=np.int32)
        return np.concatenate([self.prompt, fed])

    @property
    def prompt_remaining(self) -> int:
        return len(self.prompt) - self.n_past if self.phase is Phase.PREFILL else 0

    @property
    def finished(self) -> bool:
        return self.final is not None

    @property
    def last_token(self) -> float | None:
        return self.generated_at.last

    def record_logprob(self, record: DrawnLogprob) -> None:
        """Keep a generated token's log-probabilities until its text is sent."""
        self.logprobs.append(
            TokenLogprob(
                *_described(record.drawn), top_logprobs=[TopLogprob(*_described(t)) for t in record.top]
            )
        )

    def keep_logprobs(self) -> None:
        """Not streamed: the records so far are of tokens whose text is now the answer's."""
        if self.logprobs:  # per token of every non-streamed request: nothing to move, no new list
            self.logprobs_kept += self.logprobs
            self.logprobs = []

    def whole_logprobs(self, reason: FinishReason) -> list[TokenLogprob] | None:
        """Not streamed: the answer's records.  The tokens of a stop string that ended it are
        not in its text, nor their records (as streamed, and as llama-server answers)."""
        if not self.request.logprobs:
            return None
        cut = reason == "stop" and self.stop_sequence is not None
        return [*self.logprobs_kept, *([] if cut else self.logprobs)]

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities to send with the next text (None without `logprobs`)."""
        if not self.request.logprobs:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken

    def eos_event(self, reason: FinishReason, cancel_reason: CancelReason | None) -> EosEvent:
        """The last event, without its timings: the front end fills those in as it writes it."""
        usage = Usage(len(self.prompt), self.generated, len(self.prompt) + self.generated, self.cached_tokens)
        eos = EosEvent(
            id=self.id,
            reason=reason,
            usage=usage,
            timings=Timings(queue_ms=0.0, total_ms=0.0),
            text="".join(self.pieces) if not self.request.stream else None,
            cancel_reason=cancel_reason,
            stop_sequence=self.stop_sequence if reason == "stop" else None,
            logprobs=self.whole_logprobs(reason) if not self.request.stream else None,
        )
        if self.pool is not None and reason == "stop":
            eos.embedding = self.pool.result(normalize=self.request.normalize)
        if self.tool_format is not None and reason in ("stop", "length"):
            eos.content, calls = answer_with_tools("".join(self.pieces), self.request, self.tool_format)
            eos.tool_calls = calls or None
        return eos


@dataclass
class TokenTimes:
    """When a request's tokens happened: the first, the last, and every gap between."""

    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def record(self, now: float, created: float) -> tuple[float | None, float | None]:
        """Note one token; returns ``(ttft, None)`` for the first, ``(None, gap)`` after."""
        ttft = gap = None
        if self.first is None:
            self.first = now
            ttft = now - created
        elif self.last is not None:
            gap = now - self.last
            self.gaps.append(gap)
        self.last = now
        return ttft, gap


def _described(entry: Logprob) -> tuple[str, float, list[int]]:
    """A token as OpenAI's logprobs describe it: its text, its log-probability, its bytes."""
    return entry.piece.decode("utf-8", errors="replace"), entry.logprob, list(entry.piece)
