"""apply_step (issue 18): a step's result turned into plain events, with no channel, engine
or KV manager involved."""

from __future__ import annotations

import numpy as np
import trio

from uma_trio.engine.base import Sampled, SampleFailure, StepResult
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.runtime.lifecycle import Phase
from uma_trio.runtime.session import Session, StreamItem
from uma_trio.runtime.step_apply import Ended, Failed, Overran, Token, apply_step
from uma_trio.sched.state import Plan


def session(seq_id: int, *, prompt: int = 4, max_tokens: int = 8, stop: list[str] | None = None) -> Session:
    send, _ = trio.open_memory_channel[StreamItem](4)
    request = GenerateRequest(id=f"r{seq_id}", prompt="x", max_tokens=max_tokens, stop=stop or [])
    s = Session(
        request, np.arange(prompt, dtype=np.int32), Sampler(SamplingParams(temperature=0.0)), send, 0.0
    )
    s.seq_id = seq_id
    s.move_to(Phase.PREFILL)
    return s


def token(seq_id: int, token_id: int, piece: bytes, eog: bool = False) -> Sampled:
    return Sampled(seq_id, token_id, piece, eog)


def test_a_prompt_read_whole_starts_decoding_and_yields_its_first_token() -> None:
    a = session(0, prompt=4)
    events = apply_step(
        Plan(prefill=((0, 4),)), StepResult([token(0, 7, b"hi")], 4, 0.01), {0: a}, tick=3, now=1.0
    )
    assert events == [Token(a, "hi", 7, 1.0, None)]
    assert a.phase is Phase.DECODE and a.n_past == 4 and a.pending_token == 7 and a.last_served_tick == 3
    assert a.generated == 1 and a.output_ids == [7] and a.computed_tokens == 4


def test_length_stop_string_and_end_of_generation_end_the_request() -> None:
    long, stopped, eog = session(0, max_tokens=1), session(1, stop=["!"]), session(2)
    for s in (long, stopped, eog):
        s.move_to(Phase.DECODE)
        s.n_past = 4
    result = StepResult([token(0, 5, b"a"), token(1, 6, b"b!"), token(2, 2, b"", eog=True)], 3, 0.01)
    events = apply_step(Plan(decode=(0, 1, 2)), result, {0: long, 1: stopped, 2: eog}, tick=1, now=2.0)
    assert [type(e).__name__ for e in events] == ["Token", "Ended", "Token", "Ended", "Ended"]
    assert [e.reason for e in events if isinstance(e, Ended)] == ["length", "stop", "stop"]
    assert events[2] == Token(stopped, "b", 6, 2.0, None)  # the stop string itself is held back
    assert eog.generated == 0 and eog.pending_token is None


def test_a_failed_sampler_a_cancelled_request_and_an_ended_sequence() -> None:
    failing, cancelled = session(0), session(1)
    cancelled.abort = "client"
    for s in (failing, cancelled):
        s.move_to(Phase.DECODE)
    result = StepResult([token(1, 5, b"x"), token(9, 5, b"y")], 3, 0.01, [SampleFailure(0, "boom")])
    events = apply_step(Plan(decode=(0, 1, 9)), result, {0: failing, 1: cancelled}, tick=1, now=2.0)
    assert events == [Failed(failing, "boom"), Overran(9)]  # the cancelled one delivers nothing
    assert cancelled.n_past == 1 and cancelled.generated == 0  # its cell is still booked
