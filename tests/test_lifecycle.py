"""A request's phases and their guarded transitions (issue 18), alone."""

from __future__ import annotations

import pytest

from uma_trio.runtime.lifecycle import ALLOWED, IllegalTransition, Phase, advance


def test_the_normal_life_and_every_early_end() -> None:
    assert advance(advance(advance(Phase.WAITING, Phase.PREFILL), Phase.DECODE), Phase.DONE) is Phase.DONE
    for phase in (Phase.WAITING, Phase.PREFILL, Phase.DECODE):
        assert advance(phase, Phase.DONE) is Phase.DONE


@pytest.mark.parametrize(
    ("current", "to"),
    [
        (Phase.WAITING, Phase.DECODE),  # decoding before its prompt was read
        (Phase.DECODE, Phase.PREFILL),
        (Phase.PREFILL, Phase.WAITING),
        (Phase.DONE, Phase.DONE),  # finished twice
        (Phase.DONE, Phase.DECODE),
    ],
)
def test_moves_outside_the_table_are_refused(current: Phase, to: Phase) -> None:
    with pytest.raises(IllegalTransition, match=f"from {current.value} to {to.value}"):
        advance(current, to)


def test_every_phase_is_in_the_table_and_done_is_final() -> None:
    assert set(ALLOWED) == set(Phase)
    assert ALLOWED[Phase.DONE] == frozenset()
