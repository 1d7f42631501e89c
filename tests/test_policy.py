from __future__ import annotations

from uma_trio.sched.policy import BudgetController, SessionView, plan_tick


def test_decode_first_then_prefill_with_the_rest() -> None:
    sessions = [SessionView(0, 0), SessionView(1, 0), SessionView(2, 100)]
    plan = plan_tick(sessions, token_budget=20, max_batch=512)
    assert plan.decode == (0, 1)
    assert plan.prefill == ((2, 18),)
    assert plan.n_tokens == 20


def test_short_prompt_is_not_stuck_behind_a_long_one() -> None:
    plan = plan_tick([SessionView(0, 2000), SessionView(1, 5)], token_budget=32, max_batch=512)
    assert dict(plan.prefill) == {1: 5, 0: 27}


def test_prefill_gets_a_minimum_chunk_when_decoders_use_the_budget() -> None:
    sessions = [SessionView(i, 0) for i in range(16)] + [SessionView(99, 500)]
    plan = plan_tick(sessions, token_budget=16, max_batch=512, min_prefill_chunk=8)
    assert len(plan.decode) == 16 and dict(plan.prefill) == {99: 8}


def test_more_decoders_than_budget_rotate_fairly() -> None:
    sessions = [SessionView(i, 0) for i in range(6)]
    served = [plan_tick(sessions, token_budget=4, max_batch=4, tick=t).decode for t in range(6)]
    counts = {i: sum(i in d for d in served) for i in range(6)}
    assert set(counts.values()) == {4}


def test_parked_sessions_sit_out() -> None:
    plan = plan_tick([SessionView(0, 0, parked=True), SessionView(1, 0)], token_budget=8, max_batch=8)
    assert plan.decode == (1,) and plan.skipped == ((0, "parked"),)
    assert not plan_tick([SessionView(0, 0, parked=True)], token_budget=8, max_batch=8)


def test_budget_adapts_toward_the_tick_target() -> None:
    controller = BudgetController(target_s=0.050, floor=4, ceiling=512)
    for _ in range(30):
        n = controller.budget
        controller.observe(n, n * 0.002)  # 2 ms per token
    assert 23 <= controller.budget <= 27
    for _ in range(30):
        n = controller.budget
        controller.observe(n, n * 0.010)  # the machine got slower
    assert 4 <= controller.budget <= 6
