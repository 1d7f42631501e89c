"""The guard's room for background prompts (uma_trio/loadgen/guard_bound.py), on hand-built traces."""

from __future__ import annotations

import pytest

from uma_trio.loadgen.guard_bound import (
    Background,
    TraceTick,
    beside_gain,
    floors_of,
    last_daemon,
    prefill_seconds,
    room_in,
    step_floor,
    ticks_from_trace,
    verdicts,
)


def chats(start_s: float, n: int, step_s: float = 0.010, decoders: int = 3) -> list[TraceTick]:
    """``n`` back-to-back decode-only ticks of interactive chats from ``start_s``."""
    return [TraceTick(start_s + (i + 1) * step_s, decoders, 0, step_s, True) for i in range(n)]


def prompt_tick(end_s: float, decoders: int, tokens: int, step_s: float, interactive: bool) -> TraceTick:
    return TraceTick(end_s, decoders, tokens, step_s, interactive)


# A machine like the H100 trace: 3 chats 10 ms a tick, any prompt token beside them 5 ms more
# up to ~64 tokens, a 500-token chunk alone 50 ms (10,000 tokens/s at best).
MEASURED = [
    *chats(0.0, 10),
    prompt_tick(1.0, 1, 2, 0.015, True),
    prompt_tick(1.1, 1, 64, 0.016, True),
    prompt_tick(1.2, 0, 500, 0.050, False),
]


def test_a_step_floor_never_falls_with_more_decoders_or_tokens() -> None:
    floors = floors_of(MEASURED)
    assert floors.prefill_rate == pytest.approx(10_000)
    assert step_floor(floors, 3, 0) == pytest.approx(0.010)
    assert step_floor(floors, 3, 1) == pytest.approx(0.010)  # nothing measured says more
    assert step_floor(floors, 3, 2) == pytest.approx(0.015)  # (1 decoder, 2 tokens) took 15 ms
    assert step_floor(floors, 3, 200) == pytest.approx(0.020)  # the fastest prefill rate
    # Measured with fewer decoders and fewer tokens: still a floor for more of both.
    assert step_floor(floors, 1, 64) == pytest.approx(0.016)
    floors_3 = [step_floor(floors, 3, n) for n in range(300)]
    assert floors_3 == sorted(floors_3)


def test_a_floor_never_exceeds_a_measured_step_that_did_as_much() -> None:
    """A single slow sample of a smaller batch (here 2 decoders and 1 token at 30 ms) must not
    lift the floor above a faster step that carried more (3 decoders and 4 tokens at 12 ms)."""
    ticks = [
        *chats(0.0, 10),
        prompt_tick(1.0, 2, 1, 0.030, True),
        prompt_tick(1.1, 3, 4, 0.012, True),
        prompt_tick(1.2, 0, 500, 0.050, False),
    ]
    floors = floors_of(ticks)
    assert step_floor(floors, 3, 1) == pytest.approx(0.012)
    assert step_floor(floors, 3, 4) == pytest.approx(0.012)
    for t in ticks:
        assert step_floor(floors, t.decoders, t.prompt_tokens) <= t.step_s + 1e-12
    floors_3 = [step_floor(floors, 3, n) for n in range(600)]
    assert floors_3 == sorted(floors_3)  # still a floor that only grows with tokens


def test_the_engine_alone_raises_the_floor_by_the_batch_width() -> None:
    """On the CPU a prompt token widens the batch like a decode token: llama-batched-bench's
    step of k + n sequences bounds a step of k decoders and n prompt tokens."""
    floors = floors_of(MEASURED, batch_steps={4: 0.012, 8: 0.030})
    assert step_floor(floors, 3, 1) == pytest.approx(0.012)
    assert step_floor(floors, 3, 5) == pytest.approx(0.030)
    assert step_floor(floors, 3, 0) == pytest.approx(0.010)  # decode-only steps were measured


def test_the_floor_takes_the_faster_of_the_trace_and_the_engine_alone() -> None:
    """A floor must not exceed any real step: the engine alone may read a short prompt faster
    than any chunk the daemon ran."""
    assert floors_of(MEASURED, prefill_rates={128: 20_000.0, 2048: 5_000.0}).prefill_rate == 20_000
    assert floors_of(MEASURED, prefill_rates={2048: 5_000.0}).prefill_rate == 10_000


def test_prompt_tokens_beside_the_chats_count_only_past_the_time_they_take() -> None:
    floors = floors_of(MEASURED)
    # Within 12 ms: one token (the floor says 10 ms), worth 1 token; its time costs nothing.
    assert beside_gain(floors, 3, 0.012) == 1
    # Within 20 ms: up to 200 tokens for 10 ms more, which would read 100 tokens with no chat
    # decoding: 200 - 100 = 100 gained.
    assert beside_gain(floors, 3, 0.020) == 100
    assert beside_gain(floors, 3, 0.009) == 0  # not even the decode-only tick fits
    # Where the time with no chat decoding reads slower (a whole long prompt), the same
    # 10 ms would read 50 tokens: 150 gained.
    assert beside_gain(floors, 3, 0.020, free_rate=5_000.0) == 150


def test_the_room_is_the_free_time_plus_what_the_slack_ticks_add() -> None:
    ticks = [*chats(0.0, 100), *chats(1.5, 100)]  # 1 s of chats, 0.5 s free, 1 s of chats
    floors = floors_of([*ticks, *MEASURED[10:]])
    room = room_in(ticks, floors, alone_p95_s=0.010, start_s=0.0, end_s=2.5)
    assert room.interactive_ticks == 200
    assert room.free_s == pytest.approx(0.5)
    assert room.free_tokens == 5_000  # at 10,000 tokens/s
    # p95 ticks may take 12 ms (1 token each, nothing gained past its time); 5 % = 10 of them
    # may take 20 ms: 100 tokens gained each.
    assert room.beside_gain == 200 + 10 * 99
    assert room.tokens == room.free_tokens + room.beside_gain
    # A prompt read at the engine's own rate for its length: the free time holds less.
    slower = room_in(ticks, floors, alone_p95_s=0.010, start_s=0.0, end_s=2.5, free_rate=5_000.0)
    assert slower.free_tokens == 2_500 and slower.tokens < room.tokens


def test_a_deadline_is_short_only_when_its_tokens_exceed_the_room() -> None:
    ticks = [*chats(0.0, 100), *chats(1.5, 100), *MEASURED[10:]]
    tight = [Background(tokens=8_000, arrival_s=0.0, deadline_s=2.5)]
    loose = [Background(tokens=5_000, arrival_s=0.0, deadline_s=2.5)]
    (v,) = verdicts(ticks, 0.010, tight)
    assert v.short and v.needed == 8_000
    (v,) = verdicts(ticks, 0.010, loose)
    assert not v.short
    # Two prompts: the second deadline counts both, from the first one's arrival.
    both = [Background(1_000, 0.0, 1.0), Background(8_000, 0.5, 2.5)]
    first, second = verdicts(ticks, 0.010, both)
    assert first.needed == 1_000 and second.needed == 9_000
    assert second.room.window_s == pytest.approx(2.5)


def test_the_slack_is_the_whole_runs_and_counted_in_gaps() -> None:
    """The p95 is over all of a run's chat gaps: a schedule may spend the whole run's 5 % in the
    window, and a tick with k chats decoding stretches k gaps."""
    before = chats(0.0, 400)  # 4 s of chats before the window: 1,200 more gaps
    inside = chats(4.0, 100)  # 1 s in the window, 300 gaps
    floors = floors_of([*before, *inside, *MEASURED[10:]])
    own = room_in(inside, floors, alone_p95_s=0.010, start_s=4.0, end_s=5.0)
    assert own.beside_gain == 100 + 5 * 99  # a token a tick within p95; 15 gaps: 5 ticks stretched
    run = room_in([*before, *inside], floors, alone_p95_s=0.010, start_s=4.0, end_s=5.0, slack_gaps=75)
    assert run.beside_gain == 100 + 25 * 99  # 75 gaps: 25 stretched ticks, all in the window
    (v,) = verdicts([*before, *inside, *MEASURED[10:]], 0.010, [Background(3_000, 4.0, 5.0)], run_start_s=0.0)
    assert v.room.beside_gain == run.beside_gain


def test_a_whole_prompt_is_priced_at_the_engine_rate_for_its_length() -> None:
    rates = {128: 520.0, 2048: 420.0, 8000: 250.0}
    assert prefill_seconds(rates, 2048) == pytest.approx(2048 / 420.0)
    assert prefill_seconds(rates, 5024) == pytest.approx(5024 / 335.0)  # halfway: 335 tokens/s
    assert prefill_seconds(rates, 64) == pytest.approx(64 / 520.0)  # below the shortest measured
    assert prefill_seconds(rates, 20_000) == pytest.approx(20_000 / 250.0)


def test_trace_lines_become_ticks() -> None:
    line = {"t": 2.5, "decode": 3, "prefill": 0, "step_ms": 12.5, "cap_ms": 15.0, "skipped": 1}
    (tick,) = ticks_from_trace([line])
    assert tick == TraceTick(2.5, 3, 0, 0.0125, True)
    assert tick.start_s == pytest.approx(2.4875)
    assert not ticks_from_trace([{**line, "cap_ms": 0.0}])[0].interactive


def test_an_appended_trace_is_read_from_its_last_daemon() -> None:
    """Each daemon counts ticks from 0 on a clock of its own, and --tick-trace appends: the
    GPU script's repeated mixed parts share one file, and the bound reads the last run."""
    first = [{"tick": i, "t": 100.0 + i} for i in range(5)]
    second = [{"tick": i, "t": 7.0 + i} for i in range(3)]
    assert last_daemon([*first, *second]) == second
    assert last_daemon(first) == first
    assert last_daemon([]) == []
