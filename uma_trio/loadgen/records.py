"""What a client saw of one request: the record both the runner and the targets write."""

from __future__ import annotations

import msgspec

from ..protocol.messages import FinishReason
from .scenario import Lane

__all__ = ["RequestRecord"]


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one client saw of one request; all times are ``clock()`` values."""

    client: str
    lane: Lane
    index: int  # position in the client's chain, from 0
    sent: float
    token_times: list[float] = msgspec.field(default_factory=list)  # one per token event
    ended: float | None = None  # when the eos (or error) arrived
    eos_reason: FinishReason | str | None = None  # the daemon's reason, or an OpenAI finish_reason
    error_code: str | None = None
    error_message: str | None = None  # the client's own failures' (CONNECT_FAILED: the OS error)
    prompt_tokens: int | None = None  # from the eos usage
    completion_tokens: int | None = None  # from the eos usage (a token event may carry several)

    @property
    def ok(self) -> bool:
        """Ended normally: by a stop or by reaching ``max_tokens``."""
        return self.error_code is None and self.eos_reason in ("stop", "length")
