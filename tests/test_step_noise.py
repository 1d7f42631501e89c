"""The simulated machine's spread around the cost model and its time outside the engine
(engine/sim.py StepNoise), used by benches/sim_vs_real.py to make the simulated engine this
machine."""

from __future__ import annotations

import pytest
import trio

from uma_trio.engine.sim import StepNoise
from uma_trio.loadgen.scenario import ClientSpec, Scenario
from uma_trio.loadgen.simulate import simulate
from uma_trio.loadgen.stats import lane_stats
from uma_trio.sched.cost import CostCoefficients


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


async def test_a_requests_time_outside_the_engine_comes_before_its_first_token(
    autojump_clock: trio.abc.Clock,
) -> None:
    """StepNoise.request_s: the simulated clients wait it out after their ``sent`` time, so
    it adds to every TTFT (and to nothing else: the steps are the same)."""
    chats = Scenario(
        name="chats",
        clients=[
            ClientSpec(name=f"c{i}", prompt_tokens=30, max_tokens=20, requests=3, think_s=0.2)
            for i in range(2)
        ],
    )
    plain, _ = await simulate(chats, CostCoefficients(), machine=StepNoise())
    outside, _ = await simulate(chats, CostCoefficients(), machine=StepNoise(request_s=0.04))
    before, after = lane_stats(plain, "interactive"), lane_stats(outside, "interactive")
    assert after.ttft_p50 == pytest.approx(before.ttft_p50 + 0.04, abs=0.002)
    assert after.gap_p95 == pytest.approx(before.gap_p95)


def test_each_kind_of_step_draws_its_own_measured_spread() -> None:
    """Steps carrying prompt tokens and steps run ahead spread around the model otherwise than
    planned decode steps (on the 2-core CPU: 0.61-0.91 and 0.97 against 1.19)."""
    noise = StepNoise(ratios=[2.0], ahead_ratios=[0.5], prompt_ratios=[0.25])
    assert noise.step_seconds(0.04) == pytest.approx(0.08)
    assert noise.step_seconds(0.04, ahead=True) == pytest.approx(0.02)
    assert noise.step_seconds(0.04, prompt=True) == pytest.approx(0.01)
    assert noise.step_seconds(0.04, streaming=False, prompt=True) == pytest.approx(0.01)
    plain = StepNoise(ratios=[2.0])  # no spread of their own: as before
    assert (
        plain.step_seconds(0.04, ahead=True) == plain.step_seconds(0.04, prompt=True) == pytest.approx(0.08)
    )
    assert plain.step_seconds(0.04, streaming=False, prompt=True) == pytest.approx(0.04)
