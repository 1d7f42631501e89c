"""The simulated machine's spread around the cost model (engine/sim.py StepNoise), used by
benches/sim_vs_real.py to make the simulated engine this machine."""

from __future__ import annotations

import pytest

from uma_trio.engine.sim import StepNoise


def test_no_noise_by_default_every_step_takes_its_prediction() -> None:
    assert StepNoise().step_seconds(0.02) == 0.02


def test_measured_ratios_scale_each_step_and_the_overhead_is_added() -> None:
    assert StepNoise(ratios=[2.0], overhead_s=0.001).step_seconds(0.02) == pytest.approx(0.041)
    prompt_only = StepNoise(ratios=[2.0], overhead_s=0.001).step_seconds(0.02, streaming=False)
    assert prompt_only == pytest.approx(0.021)  # no clients streaming beside it
    noise = StepNoise(ratios=[1.0, 1.5], seed=7)
    drawn = [noise.step_seconds(0.01) for _ in range(200)]
    assert set(map(lambda s: round(s, 6), drawn)) == {0.01, 0.015}  # both ratios, nothing else
    again = StepNoise(ratios=[1.0, 1.5], seed=7)
    assert [again.step_seconds(0.01) for _ in range(200)] == drawn  # seeded: repeatable
