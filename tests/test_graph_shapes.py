"""Prompt ticks stay off the batch shape llama.cpp's CUDA backend would capture as a graph
(sched/graph_shapes.py): unit tests of the pure parts, the policy's use of them, and the
decode loop on the simulated engine posing as a CUDA one."""

from __future__ import annotations

from typing import Any

import trio

from uma_trio.engine.base import Engine
from uma_trio.engine.sim import SimEngine
from uma_trio.sched.cost import CostCoefficients
from uma_trio.sched.graph_shapes import ShapeStreak, plan_shape, shape_of, steer_clear
from uma_trio.sched.policy import PolicyConfig, plan_tick
from uma_trio.sched.state import Plan, SchedulerState, SessionState

from .helpers import RawClient, sim_daemon

# A GPU's step: flat up to a knee, a step up for any prompt token (cost.py).
GPU_COST = CostCoefficients(
    fixed_s=0.004, decode_s=0.0002, prefill_s=0.0002, ctx_s_per_kcell=0.0, flat_tokens=8, prompt_tick_s=0.003
)


def prompt(key: int, remaining: int, lane: Any = "interactive") -> SessionState:
    return SessionState(key=key, lane=lane, prompt_remaining=remaining, n_past=10)


def decoder(key: int) -> SessionState:
    return SessionState(key=key, n_past=50)


def test_a_shape_counts_logits_for_decode_tokens_and_prompts_that_end() -> None:
    assert shape_of(2, [(11, 40)]) == (13, 2)  # a chunk mid-prompt returns no logits
    assert shape_of(2, [(11, 11)]) == (13, 3)  # its last chunk returns one
    assert shape_of(0, [(0, 5)]) == (0, 0)
    assert plan_shape((1, 2), ((3, 4),), [prompt(3, 4)]) == (6, 3)


def test_the_shape_a_step_would_be_captured_at_is_the_last_one_run_once() -> None:
    streak = ShapeStreak()
    assert streak.capturing() is None
    streak.record((13, 2))
    assert streak.capturing() == (13, 2)  # run once: the next step of this shape is captured
    streak.record((13, 2))
    assert streak.capturing() is None  # captured: later ones replay it
    streak.record((3, 3))
    assert streak.capturing() == (3, 3)


def test_steer_clear_moves_a_prompt_tick_one_token_off_the_shape_to_avoid() -> None:
    a, b = prompt(3, 40), prompt(4, 1)
    assert steer_clear(2, [(a, 11)], (13, 2)) == [(a, 10)]  # the chunk one shorter
    assert steer_clear(2, [(a, 11), (b, 1)], (14, 3)) == [(a, 10), (b, 1)]
    assert steer_clear(2, [(a, 1)], (3, 2)) == [(a, 2)]  # one token: one longer instead
    assert steer_clear(2, [(a, 1)], (3, 2), room=0) == [(a, 1)]  # unless the batch is full
    assert steer_clear(2, [(a, 11)], (14, 2)) == [(a, 11)]  # another shape: unchanged
    assert steer_clear(2, [(a, 11)], None) == [(a, 11)]
    assert steer_clear(3, [], (3, 3)) == []  # no prompt token: a decode tick is captured
    assert steer_clear(2, [(b, 1)], (3, 3)) == [(b, 1)]  # nothing can move


def plan_shape_of(plan: Plan, state: SchedulerState) -> tuple[int, int]:
    return plan_shape(plan.decode, plan.prefill, state.sessions)


def test_the_policy_plans_a_prompt_tick_off_the_captured_shape() -> None:
    sessions = (decoder(1), decoder(2), prompt(3, 200))
    state = SchedulerState(sessions, tick=10)
    plain = plan_tick(state, PolicyConfig(), GPU_COST)
    shape = plan_shape_of(plain, state)
    assert plain.prefill and shape[0] > 3
    steered_state = SchedulerState(sessions, tick=10, capture_shape=shape)
    steered = plan_tick(steered_state, PolicyConfig(), GPU_COST)
    assert plan_shape_of(steered, steered_state) != shape
    assert steered.decode == plain.decode
    assert abs(steered.prefill_tokens - plain.prefill_tokens) == 1
    # A decode-only tick keeps its shape: captured, it is replayed for as long as it lasts.
    decoding = SchedulerState((decoder(1), decoder(2)), capture_shape=(2, 2))
    assert plan_tick(decoding, PolicyConfig(), GPU_COST).decode == (1, 2)


async def prompt_tick_shapes(graph_capture: bool) -> list[tuple[tuple[int, int], bool]]:
    """Each planned tick's shape and whether it carried prompt tokens, while two chats
    stream and a third sends a long prompt."""

    def engine(sim: SimEngine) -> Engine:
        sim.graph_capture = graph_capture
        return sim

    ticks: list[tuple[tuple[int, int], bool]] = []
    async with sim_daemon(wrap=engine, cost=GPU_COST) as server:
        loop = server.loop
        plan = loop.policy.plan

        def recording(state: SchedulerState) -> Plan:
            planned = plan(state)
            ticks.append((plan_shape_of(planned, state), bool(planned.prefill)))
            return planned

        loop.policy.plan = recording  # type: ignore[method-assign]
        client = await RawClient.connect(server.config.socket_path)
        for rid in ("a", "b"):
            await client.send({"id": rid, "prompt": "hi", "max_tokens": 400})
        await trio.sleep(0.2)  # both decode
        await client.send({"id": "c", "prompt": "tell me everything " * 60, "max_tokens": 4})
        await client.until_end("c")
        await client.aclose()
    return ticks


def captured_prompt_ticks(ticks: list[tuple[tuple[int, int], bool]]) -> int:
    """Ticks carrying prompt tokens at the shape of the tick before, which ran it first."""
    streak, captured = ShapeStreak(), 0
    for shape, has_prompt in ticks:
        captured += has_prompt and streak.capturing() == shape
        streak.record(shape)
    return captured


async def test_on_an_engine_that_captures_graphs_no_prompt_tick_is_the_one_captured(
    autojump_clock: trio.abc.Clock,
) -> None:
    assert captured_prompt_ticks(await prompt_tick_shapes(graph_capture=False)) > 0  # the case arises
    steered = await prompt_tick_shapes(graph_capture=True)
    assert sum(has_prompt for _, has_prompt in steered) > 3
    assert captured_prompt_ticks(steered) == 0
