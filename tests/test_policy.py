"""The scheduling policy's stages, on hand-built states (pure: no trio, no model)."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from uma_trio.sched.autotune import HillClimber
from uma_trio.sched.bmt import BmtGuard, MemoryProfile
from uma_trio.sched.cost import CostCoefficients, TickCostModel, solve_positive_definite
from uma_trio.sched.policy import (
    Controls,
    Policy,
    PolicyConfig,
    plan_pipeline,
    plan_tick,
    shortest_first,
    steady_decode_plan,
    tick_budget,
    water_fill,
)
from uma_trio.sched.state import Plan, SchedulerState, SessionState

# Round numbers: 4 ms per tick plus 3 ms per token, no context cost.
COST = CostCoefficients(fixed_s=0.004, decode_s=0.003, prefill_s=0.003, ctx_s_per_kcell=0.0)
CONFIG = PolicyConfig()


def interactive(key: int, prompt: int = 0, **kw: object) -> SessionState:
    return SessionState(key=key, lane="interactive", prompt_remaining=prompt, **kw)  # type: ignore[arg-type]


def background(key: int, prompt: int = 0, **kw: object) -> SessionState:
    return SessionState(key=key, lane="background", prompt_remaining=prompt, **kw)  # type: ignore[arg-type]


def plan(*sessions: SessionState, tick: int = 100, controls: Controls | None = None, **cfg: object) -> Plan:
    config = PolicyConfig(**cfg) if cfg else CONFIG  # type: ignore[arg-type]
    return plan_tick(SchedulerState(tuple(sessions), tick=tick), config, COST, controls or Controls())


# -- stage 1: budget -------------------------------------------------------------


def test_budget_is_latency_cap_times_interactive_decode_baseline() -> None:
    budget, baseline = tick_budget([interactive(1), interactive(2), background(3)], CONFIG, COST)
    assert baseline == pytest.approx(0.004 + 2 * 0.003)
    assert budget == pytest.approx(1.2 * CONFIG.cap_margin * baseline)


def test_budget_has_a_floor_and_a_throughput_mode() -> None:
    tiny = CostCoefficients(fixed_s=0.0005, decode_s=0.0005, prefill_s=0.001, ctx_s_per_kcell=0.0)
    assert tick_budget([interactive(1)], CONFIG, tiny)[0] == CONFIG.tick_min_s
    assert tick_budget([background(1)], CONFIG, COST)[0] == CONFIG.tick_background_s
    # A parked interactive stream does not set the pace.
    assert tick_budget([interactive(1, parked=True)], CONFIG, COST)[0] == CONFIG.tick_background_s


def test_decode_baseline_grows_with_context() -> None:
    deep = CostCoefficients(fixed_s=0.004, decode_s=0.003, prefill_s=0.003, ctx_s_per_kcell=0.001)
    shallow = tick_budget([interactive(1, n_past=100)], CONFIG, deep)[1]
    assert tick_budget([interactive(1, n_past=4000)], CONFIG, deep)[1] > shallow


# -- stages 2-5 --------------------------------------------------------------------


def test_every_interactive_decoder_gets_its_token_every_tick() -> None:
    sessions = [interactive(k) for k in range(6)] + [background(10 + k) for k in range(4)]
    result = plan(*sessions)
    assert set(range(6)) <= set(result.decode)


def test_background_only_gets_the_headroom() -> None:
    # 3 interactive: baseline 13 ms, budget 14.8 ms: 1.8 ms left, less than a token.
    result = plan(interactive(1), interactive(2), interactive(3), background(4), background(5, prompt=500))
    assert result.decode == (1, 2, 3) and result.prefill == ()
    assert dict(result.skipped) == {4: "budget", 5: "budget"}
    assert result.predicted_s <= result.budget_s


def test_background_runs_at_full_batch_without_interactive_work() -> None:
    result = plan(*[background(k) for k in range(8)], background(9, prompt=500))
    assert len(result.decode) == 8
    assert result.prefill and result.predicted_s <= CONFIG.tick_background_s
    assert result.predicted_s > 0.8 * CONFIG.tick_background_s  # the budget is used, not wasted


def test_the_throughput_tick_grows_where_every_step_costs_much() -> None:
    """Vulkan on the H100: a prompt tick paid ~35 ms whatever it carried.  Held to 50 ms, a
    background prompt went 12-30 tokens a tick; the throughput tick is long enough that the
    step is at most a quarter of it, and the prompt takes the room that leaves."""
    steppy = msgspec.structs.replace(COST, prompt_tick_s=0.035, prefill_s=0.0004)
    budget, _ = tick_budget([background(1, prompt=8000)], CONFIG, steppy)
    assert budget == pytest.approx((0.004 + 0.035) / CONFIG.step_share)
    assert tick_budget([background(1)], CONFIG, COST)[0] == CONFIG.tick_background_s  # a small step
    result = plan_tick(SchedulerState((background(1, prompt=8000),), tick=100), CONFIG, steppy, Controls())
    read = sum(n for _, n in result.prefill)
    assert result.predicted_s <= budget
    assert read == pytest.approx((budget - 0.039) / 0.0004, abs=2)  # 292 tokens, not 27
    with pytest.raises(ValueError, match="step_share"):
        PolicyConfig(step_share=0.0)


def test_new_interactive_prompt_joins_on_the_next_tick_ahead_of_background() -> None:
    result = plan(background(1, prompt=2000), interactive(2, prompt=30), background(3))
    prefill = dict(result.prefill)
    assert prefill[2] > 0
    assert next(iter(dict(result.prefill))) == 2  # interactive chunk first
    assert prefill.get(1, 0) < 2000


def test_a_first_tick_with_no_stream_decoding_carries_no_background_work() -> None:
    """A chat's turn arriving while only background work runs: its first tick is its own.
    Filled to the throughput tick with background prompt tokens, a chat's 16 ms first tick
    took 50 ms on the CPU (mixed scenario: TTFT p50 62 ms against 26 ms alone); no rescue
    rides on it either."""
    starving = background(3, ticks_waiting=CONFIG.starve_ticks)
    result = plan(interactive(1, prompt=4), background(2, prompt=1500, n_past=300), starving, background(4))
    assert dict(result.prefill) == {1: 4} and result.decode == () and not result.rescue
    assert result.predicted_s == pytest.approx(COST.predict(0, 4, 8))
    # Where extra tokens cost nothing (a GPU under its knee) background work still rides along.
    flat = msgspec.structs.replace(COST, flat_tokens=64)
    state = SchedulerState((interactive(1, prompt=4), background(2, prompt=1500)), tick=100)
    free = plan_tick(state, CONFIG, flat, Controls())
    assert dict(free.prefill) == {1: 4, 2: 60} and free.predicted_s == pytest.approx(0.004)


def test_new_interactive_prompt_joins_beside_a_decoding_stream() -> None:
    # One decoder: the headroom under the cap is smaller than one prompt token...
    result = plan(interactive(1), interactive(2, prompt=20))
    assert result.decode == (1,) and dict(result.prefill)[2] >= 1
    # ...so the prompt may stretch the tick, but only up to the pause limit, taken against the
    # tick both streams will run at once the prompt decodes too.
    _, joined = tick_budget([interactive(1), interactive(2)], CONFIG, COST)
    assert result.predicted_s <= CONFIG.max_pause * joined
    _, alone = tick_budget([interactive(1)], CONFIG, COST)
    assert result.predicted_s > CONFIG.max_pause * alone  # more than the one stream's own tick


def test_a_burst_of_interactive_prompts_is_let_in_at_its_own_pace() -> None:
    """One stream decodes and fifteen requests arrive at once (on the H100 this came in
    waves over seconds): the pause limit is the sixteen streams' own tick."""
    # What the start-up calibration measured on the H100 (docs/BENCHMARKS.md, GPU).
    h100 = CostCoefficients(
        fixed_s=0.00462, decode_s=0.000515, prefill_s=0.000153, flat_tokens=1, ctx_s_per_kcell=0.0
    )
    burst = [interactive(k, prompt=128) for k in range(1, 16)]
    result = plan_tick(SchedulerState((interactive(0), *burst), max_batch=2048), CONFIG, h100)
    _, joined = tick_budget([interactive(k) for k in range(16)], CONFIG, h100)
    assert result.predicted_s <= CONFIG.max_pause * joined
    assert {k for k, _ in result.prefill} == set(range(1, 16))  # water-filled over the burst
    # Against the one stream's own tick, the burst would get under a quarter of that room.
    _, alone = tick_budget([interactive(0)], CONFIG, h100)
    assert result.prefill_tokens > 4 * (CONFIG.max_pause - 1) * alone / h100.prefill_s


def test_background_prompts_go_shortest_first_each_whole() -> None:
    candidates = [background(1, prompt=100), background(2, prompt=3), background(3, prompt=50)]
    chunks = shortest_first(candidates, 60)
    assert [(s.key, n) for s, n in chunks] == [(2, 3), (3, 50), (1, 7)]
    # A throughput tick's ~15 tokens all go to the shorter prompt, none to the longer one.
    result = plan(background(1, prompt=2000), background(2, prompt=500))
    assert [key for key, _ in result.prefill] == [2] and result.prefill[0][1] > 1


def test_water_fill_is_max_min_fair_shortest_first() -> None:
    chunks = water_fill([background(1, prompt=100), background(2, prompt=3), background(3, prompt=50)], 60)
    assert [(s.key, n) for s, n in chunks] == [(2, 3), (3, 28), (1, 29)]


def test_background_decoders_rotate_longest_waiting_first() -> None:
    # Budget for one background decoder only: the one that waited longest wins.
    sessions = [interactive(1)] + [background(10 + k, ticks_waiting=w) for k, w in enumerate([1, 5, 3])]
    result = plan(*sessions, latency_cap=1.6)
    assert result.decode == (1, 11)


def test_parked_sessions_sit_out() -> None:
    result = plan(interactive(1, parked=True), interactive(2))
    assert result.decode == (2,) and dict(result.skipped) == {1: "parked"}


def test_hysteresis_hold_keeps_background_prefill_off() -> None:
    held = plan(interactive(2), background(1, prompt=300), controls=Controls(hold_left=3))
    assert held.prefill == () and dict(held.skipped) == {1: "hold"}
    # Beside a decoding stream (with none decoding, prompts take the whole batch).
    ramping = plan(background(1, prompt=300), background(2), controls=Controls(ramp=0.5))
    full = plan(background(1, prompt=300), background(2))
    assert 0 < dict(ramping.prefill)[1] < dict(full.prefill)[1]


def test_plan_is_never_empty_while_work_waits() -> None:
    # A hold with nothing else to run would stall the daemon: the decode task sleeps on
    # an empty plan until the next request arrives.
    alone = plan(background(1, prompt=300), controls=Controls(hold_left=3))
    assert dict(alone.prefill)[1] > 0 and alone.skipped == ()


# -- stage 6: rescue --------------------------------------------------------------


def test_starving_session_is_rescued_within_the_pause_limit() -> None:
    streams = [interactive(k) for k in range(3)]
    starving = background(9, prompt=2000, ticks_waiting=CONFIG.starve_ticks)
    result = plan(*streams, starving, tick=1000, controls=Controls(last_rescue_tick=0))
    assert result.rescue and dict(result.prefill)[9] >= 1
    _, baseline = tick_budget(streams, CONFIG, COST)
    # Within the rescue's own limit, under the pause limit new prompts may stretch a tick to:
    # its prompt chunk may also pay for an unpriced prefix copy.
    assert CONFIG.rescue_pause < CONFIG.max_pause
    limit = CONFIG.rescue_pause * baseline
    assert limit - COST.prefill_s < result.predicted_s <= limit


def test_rescue_ticks_are_spaced() -> None:
    starving = background(9, prompt=2000, ticks_waiting=100)
    recent = Controls(last_rescue_tick=95)
    result = plan(interactive(1), interactive(2), interactive(3), starving, tick=100, controls=recent)
    assert not result.rescue and result.prefill == ()


# -- the stateful policy -------------------------------------------------------------


def test_overrun_holds_prefill_then_ramps_back() -> None:
    policy = Policy(CONFIG, TickCostModel(COST))
    state = SchedulerState((background(1, prompt=5000),), tick=0)
    first = policy.plan(state)
    policy.observe(first, state, seconds=first.budget_s * 3)  # a tick ran far over
    assert policy.controls.hold_left == CONFIG.hold_ticks and policy.prefill_guard_active
    assert policy.snapshot()["ticks_over_budget"] == 1
    for _ in range(CONFIG.hold_ticks + CONFIG.ramp_ticks):
        p = policy.plan(state)
        policy.observe(p, state, seconds=p.predicted_s)
    assert not policy.prefill_guard_active


def test_cost_model_fits_fixed_and_per_token_costs_jointly() -> None:
    model = TickCostModel(COST)
    for i in range(60):
        d = 1 + i % 8
        model.observe(d, 0, 0, 0.005 + d * 0.006)  # fixed 5 ms, decode really 6 ms a token
    c = model.coefficients
    assert c.decode_s == pytest.approx(0.006, rel=0.02) and c.fixed_s == pytest.approx(0.005, rel=0.05)
    assert c.prefill_s == COST.prefill_s  # no prompt token seen yet: the prior's
    for i in range(60):
        n = 10 * (1 + i % 5)
        model.observe(2, n, 0, 0.005 + 2 * 0.006 + n * 0.002)
    assert model.coefficients.prefill_s == pytest.approx(0.002, rel=0.02)
    assert model.coefficients.decode_s == pytest.approx(0.006, rel=0.05)


def test_time_every_tick_shares_goes_to_the_fixed_cost_not_the_tokens() -> None:
    """Issue 17: waiting for cores on a busy machine is the same for any batch, so a joint
    fit puts it in fixed_s; fitted per token kind it inflated the prompt-token cost."""
    model = TickCostModel(COST)
    for i in range(80):
        d, n = 1 + i % 4, 20 * (i % 3)
        model.observe(d, n, 0, 0.011 + d * COST.decode_s + n * COST.prefill_s)  # + 7 ms contention
    c = model.coefficients
    assert c.fixed_s == pytest.approx(0.011, rel=0.05)
    assert c.decode_s == pytest.approx(COST.decode_s, rel=0.1)
    assert c.prefill_s == pytest.approx(COST.prefill_s, rel=0.1)


def test_a_tick_with_prompt_tokens_pays_the_step_once() -> None:
    stepped = msgspec.structs.replace(COST, prompt_tick_s=0.004)
    assert stepped.predict(3, 0, 0) == COST.predict(3, 0, 0)
    assert stepped.predict(3, 2, 0) == pytest.approx(COST.predict(3, 2, 0) + 0.004)
    assert stepped.predict(3, 64, 0) - stepped.predict(3, 2, 0) == pytest.approx(62 * COST.prefill_s)


def test_the_online_fit_learns_the_step_a_prompt_token_adds() -> None:
    """The H100's mixed trace (run M): 3 decoders 5.4 ms a tick, 3.7 ms more with any prompt
    token; a line would price the first few prompt tokens at a fraction of that."""
    model = TickCostModel(COST)
    for i in range(140):
        d, n = 1 + i % 3, (0, 0, 2, 0, 16, 0, 64)[i % 7]
        model.observe(d, n, 0, 0.003 + 0.0008 * d + (0.0037 + n * 0.001 if n else 0.0))
    c = model.coefficients
    assert c.prompt_tick_s == pytest.approx(0.0037, rel=0.1)
    assert c.predict(3, 0, 0) == pytest.approx(0.0054, rel=0.05)
    assert c.predict(3, 2, 0) == pytest.approx(0.0111, rel=0.05)


def test_the_learned_step_is_bounded_like_every_other_cost() -> None:
    model = TickCostModel(COST)
    for i in range(80):
        model.observe(2, 8 * (i % 2), 0, 0.010 + (1.0 if i % 2 else 0.0))  # prompt ticks stalled 1 s
    assert model.coefficients.prompt_tick_s <= 4.0 * COST.fixed_s


def test_no_sliver_of_a_prompt_rides_a_tick_that_cannot_pay_its_step() -> None:
    """3 interactive decoders leave 1.8 ms of their 14.8 ms budget: at 0.2 ms a prompt token a
    line fits 8 tokens there, but not a 4 ms step, so the tick stays decode-only."""
    cheap = CostCoefficients(fixed_s=0.004, decode_s=0.003, prefill_s=0.0002, ctx_s_per_kcell=0.0)
    sessions = (interactive(1), interactive(2), interactive(3), background(5, prompt=500))
    state = SchedulerState(sessions, tick=100)
    line = plan_tick(state, CONFIG, cheap, Controls())
    assert dict(line.prefill).get(5, 0) >= 4
    stepped = plan_tick(state, CONFIG, msgspec.structs.replace(cheap, prompt_tick_s=0.004), Controls())
    assert stepped.decode == (1, 2, 3) and stepped.prefill == ()
    assert stepped.predicted_s <= stepped.budget_s


def test_bmt_guard_trims_prefill_before_background_decoders() -> None:
    # Weights 1000 B per micro-batch, 10 B per KV cell read.
    profile = MemoryProfile(weight_bytes=1000, kv_bytes_per_cell=10, n_ubatch=32)
    state = SchedulerState((interactive(1, n_past=100), background(2, n_past=100), background(3, prompt=200)))
    base = Plan(decode=(1, 2), prefill=((3, 40),), budget_s=0.05)

    def guard(budget_bytes: int) -> BmtGuard:
        return BmtGuard(profile, bandwidth_gbps=budget_bytes / 1e9 / 0.05)

    untouched = guard(10**6).apply(base, state)
    assert (untouched.decode, untouched.prefill) == (base.decode, base.prefill) and untouched.bmt_bytes > 0
    # 3000 B: one micro-batch of both decoders (1000 + 2×100×10) fits, the prompt does not.
    no_prefill = guard(3000).apply(base, state)
    assert no_prefill.decode == (1, 2) and no_prefill.prefill == () and dict(no_prefill.skipped)[3] == "bmt"
    assert no_prefill.kv_cells == 200  # what the trimmed batch reads, for the cost model
    # 2500 B: the background decoder goes too; the interactive one never does.
    only_interactive = guard(2500).apply(base, state)
    assert only_interactive.decode == (1,) and dict(only_interactive.skipped)[2] == "bmt"
    assert guard(1).apply(base, state).decode == (1,)


def test_bmt_guard_never_empties_a_plan() -> None:
    profile = MemoryProfile(weight_bytes=10**9, kv_bytes_per_cell=10, n_ubatch=32)
    policy = Policy(CONFIG, TickCostModel(COST), BmtGuard(profile, bandwidth_gbps=0.001))
    assert policy.plan(SchedulerState((background(1, prompt=100),)))


def test_policy_reports_the_bmt_estimate() -> None:
    profile = MemoryProfile(weight_bytes=1000, kv_bytes_per_cell=10, n_ubatch=32)
    policy = Policy(CONFIG, TickCostModel(COST), BmtGuard(profile, bandwidth_gbps=1.0))
    state = SchedulerState((interactive(1, n_past=100),))
    result = policy.plan(state)
    policy.observe(result, state, result.predicted_s)
    snap = policy.snapshot()
    assert snap["bmt_estimate_last"] == 2000 and snap["bmt_budget"] == int(1e9 * result.budget_s)


def test_hill_climber_finds_the_best_batch_and_stays() -> None:
    def rate(k: int) -> float:  # throughput peaks at 5 decoders
        return 100.0 - 10.0 * (k - 5) ** 2

    tuner = HillClimber(period=1)
    for _ in range(200):
        k = tuner.limit or 8
        tuner.observe(int(rate(k) * 10), 10.0, candidates=8)
    visits = []
    for _ in range(100):
        k = tuner.limit or 8
        visits.append(k)
        tuner.observe(int(rate(k) * 10), 10.0, candidates=8)
    assert max(set(visits), key=visits.count) == 5
    assert visits.count(5) > 70  # probes away from the optimum are rare


def test_hill_climber_keeps_every_decoder_where_more_are_faster() -> None:
    """Where tokens/s grows with each decoder (a CPU's linear step: 8 ms fixed, 2 ms a
    decoder, so under 1 % from 15 to 16), noise (±6 % a period) does not shrink the batch,
    and a limit learned while fewer streams ran does not hold more back: after two
    streams, sixteen decoded 2-5 a tick (BENCHMARKS.md "Background chains handed back
    together")."""
    rng = random.Random(7)

    def rate(k: int) -> float:
        return k / (0.008 + 0.002 * k) * rng.uniform(0.94, 1.06)

    tuner = HillClimber(period=1)
    for _ in range(40):  # two streams first
        tuner.observe(int(rate(min(tuner.limit or 2, 2)) * 10), 10.0, candidates=2)
    visits = []
    for _ in range(400):
        k = min(tuner.limit or 16, 16)
        visits.append(k)
        tuner.observe(int(rate(k) * 10), 10.0, candidates=16)
    assert visits[0] == 16
    assert visits.count(16) > 300 and min(visits) >= 14, (visits.count(16), min(visits))


def test_a_quiet_tick_decodes_every_background_stream_at_once() -> None:
    """With no interactive session, on an engine a chat arriving can stop, every background
    decoder joins the tick, however far past the throughput tick: one step gives each its
    token for one step's fixed cost.  Held to the 50 ms tick, 16 streams on the CPU decoded
    ~6 a tick in turns, 0.70-0.82x llama-server's tokens/s (BENCHMARKS.md "Background chains
    handed back together").  An engine that cannot stop a step, another model's stream gap,
    and an interactive session keep the budget."""
    streams = tuple(background(k, n_past=40) for k in range(16))  # 16 decoders: 52 ms predicted

    def decoders(preemptible: bool = True, *extra: SessionState, foreign_cap_s: float | None = None) -> int:
        state = SchedulerState(
            (*streams, *extra), tick=100, max_batch=2048, preemptible=preemptible, foreign_cap_s=foreign_cap_s
        )
        return sum(1 for key in plan_tick(state, CONFIG, COST).decode if key < 16)

    fit = int((CONFIG.tick_background_s - COST.fixed_s) / COST.decode_s)  # 15 in 50 ms
    assert decoders() == 16
    assert decoders(False) == fit
    assert decoders(True, foreign_cap_s=0.020) == int((0.020 - COST.fixed_s) / COST.decode_s)
    assert decoders(True, interactive(99, n_past=40)) < 16
    # New streams' prompts still get the throughput tick's room beside them all, or each
    # would wait for a rescue (one every 25 ticks: 16 streams took 8 s to all decode).
    state = SchedulerState((*streams, background(20, prompt=10), background(21, prompt=10)), tick=100,
                           max_batch=2048, preemptible=True)  # fmt: skip
    both = plan_tick(state, CONFIG, COST)
    assert len(both.decode) == 16 and sum(dict(both.prefill).values()) == 15  # 50 ms of prompt tokens


def test_with_nobody_decoding_prompts_take_a_whole_micro_batch() -> None:
    """Work-conserving: no stream's gap to protect, so prompts take the engine's efficient
    unit; not more, so a request arriving meanwhile waits one micro-batch at most."""
    state = SchedulerState(
        tuple(interactive(k, prompt=128) for k in range(16)), max_batch=2048, micro_batch=512
    )
    burst = plan_tick(state, CONFIG, COST)
    assert sum(n for _, n in burst.prefill) == 512
    # A background prompt keeps the throughput tick: an interactive request could arrive.
    lone = plan(background(16, prompt=3000))
    assert lone.predicted_s <= CONFIG.tick_background_s
    assert burst.budget_s >= burst.predicted_s  # not an overrun to hold prefill back for
    beside = plan(interactive(0), *(interactive(k, prompt=128) for k in range(1, 16)))
    assert sum(n for _, n in beside.prefill) < 512  # a decoding stream keeps its pause limit


def test_beside_another_models_streams_a_chats_long_prompt_fits_their_gaps() -> None:
    """Nobody decodes here, but another model's streams do, 20 ms a tick: a gap of theirs holds
    this model's tick whole, so a long chat prompt is read at most ``max_pause`` × the pace
    the streams will have once it decodes too (a tick of each model), not in one micro-batch
    (a 3,000-token chat held a stream on another model for 1.7-3.0 s a gap).  Background work
    beside it gets what stretches their gap no more than the cap."""
    beside = 0.020
    prompt, bulk = interactive(1, prompt=3000), background(2, prompt=3000)
    alone = plan_tick(SchedulerState((prompt,), max_batch=2048, micro_batch=512), CONFIG, COST)
    assert alone.prefill_tokens == 512  # no stream anywhere: the whole micro-batch
    state = SchedulerState((prompt, bulk), max_batch=2048, micro_batch=512, beside_s=beside)
    fitted = plan_tick(state, CONFIG, COST)
    joined = COST.predict(1, 0, 3000)
    assert 0 < fitted.prefill_tokens < 512
    assert dict(fitted.prefill).keys() == {1}  # the chat's first token comes first
    assert fitted.predicted_s <= CONFIG.max_pause * (joined + beside) - beside
    # With the chat decoding, the background prompt gets its share of the headroom only.
    decoding = SchedulerState((interactive(1, n_past=100), bulk), beside_s=beside)
    assert plan_tick(decoding, CONFIG, COST).predicted_s <= CONFIG.latency_cap * COST.predict(1, 0, 100)
    # Background work beside a parked chat stretches their gap at most to the cap; where not
    # even one token fits there, one token (a plan is never empty with work waiting).
    parked = interactive(1, n_past=5, parked=True)
    for beside_s in (0.2, 0.02):
        fill = plan_tick(SchedulerState((parked, bulk), beside_s=beside_s), CONFIG, COST)
        headroom = (CONFIG.latency_cap * CONFIG.cap_margin - 1.0) * beside_s
        assert fill.prefill_tokens == max(1, int((headroom - COST.fixed_s) / COST.prefill_s))


def test_a_prompt_that_ends_in_a_tick_has_that_tick_to_itself() -> None:
    """A chat sent while a long interactive prompt was read (nobody decoding) shared its first
    tick with the rest of a micro-batch of the long one, so its first token waited two
    micro-batches (4-5 s on this CPU; 18-41 s on a loaded one, in a review's run).  Where a
    prompt ends in the tick, the tick carries the prompts that end; the long one goes on
    after, beside the new stream."""
    chat, long_one = interactive(1, prompt=30), interactive(2, prompt=1500, n_past=512)
    state = SchedulerState((chat, long_one), max_batch=2048, micro_batch=512)
    first = plan_tick(state, CONFIG, COST)
    assert dict(first.prefill) == {1: 30}
    # Both ending: both go; none ending (a lone long prompt): the whole micro-batch, as before.
    short_rest = interactive(2, prompt=100, n_past=1400)
    both = plan_tick(replace(state, sessions=(chat, short_rest)), CONFIG, COST)
    assert dict(both.prefill) == {1: 30, 2: 100}
    assert plan_tick(replace(state, sessions=(long_one,)), CONFIG, COST).prefill_tokens == 512
    # With a stream decoding its pause limit decides, unchanged: the prompts share it.
    decoding = interactive(3, n_past=40)
    beside = plan_tick(replace(state, sessions=(chat, long_one, decoding)), CONFIG, COST)
    assert set(dict(beside.prefill)) == {1, 2} and 3 in beside.decode


def test_with_nobody_decoding_a_burst_takes_what_fits_the_burst_tick() -> None:
    """On a GPU a micro-batch of 512 prompt tokens is a fraction of the burst tick: sixteen
    128-token requests arriving at an idle daemon all prefill in one tick (as llama-server's
    2,048-token batch takes them), instead of four, with twelve joining at the pace of four
    decoding streams, a few dozen tokens a tick (ramp to 16 streams: 231-582 ms on the H100)."""
    h100 = CostCoefficients(
        fixed_s=0.00462, decode_s=0.000515, prefill_s=0.000105, flat_tokens=1, ctx_s_per_kcell=0.0
    )
    burst = tuple(interactive(k, prompt=128) for k in range(16))
    plan_all = plan_tick(SchedulerState(burst, max_batch=2048, micro_batch=512), CONFIG, h100)
    assert plan_all.prefill_tokens == 16 * 128 and plan_all.predicted_s <= CONFIG.burst_tick_s
    assert plan_all.budget_s >= plan_all.predicted_s
    # Where the burst tick holds less than the burst, it takes what fits, water-filled.
    short = replace(CONFIG, burst_tick_s=0.1)
    part = plan_tick(SchedulerState(burst, max_batch=2048, micro_batch=512), short, h100)
    assert 512 < part.prefill_tokens < 16 * 128 and part.predicted_s <= 0.1
    assert len(part.prefill) == 16
    # Never more than the batch holds, and on this CPU a micro-batch outlasts the burst tick.
    assert (
        plan_tick(SchedulerState(burst, max_batch=1024, micro_batch=512), CONFIG, h100).prefill_tokens == 1024
    )
    assert COST.predict(0, 512, 0) > CONFIG.burst_tick_s


def test_contention_cannot_inflate_the_learned_costs_without_bound() -> None:
    """Issue 17: on a busy CPU every tick also waited for cores, the online model put all of
    it on the prompt tokens (19-1,942 ms a token against a prior of 2.3), and a lone prompt
    then moved one token a tick.  Learned costs stay within 4x of the prior either way."""
    model = TickCostModel(COST)
    for _ in range(50):
        model.observe(1, 1, 0, 2.0)  # two tokens, two seconds: contention, not token cost
        _ = model.coefficients  # each tick's plan reads the fit
    c = model.coefficients
    assert c.prefill_s == pytest.approx(4 * COST.prefill_s)
    for _ in range(50):
        model.observe(8, 0, 0, 1e-6)  # impossibly fast ticks
    assert model.coefficients.decode_s == pytest.approx(COST.decode_s / 4)
    # And a lone prompt still takes a whole micro-batch a tick (nobody decodes).
    state = SchedulerState((interactive(1, prompt=600),), max_batch=2048, micro_batch=512)
    assert sum(n for _, n in plan_tick(state, CONFIG, model.coefficients).prefill) == 512


def test_one_stalled_step_barely_moves_the_fit() -> None:
    """compare.py mixed, run BE: one 83 ms step among 10-14 ms ones (the VM stopped it) lifted
    the predicted three-chat tick from 14 to 34 ms, and the tick budget with it for ~30 ticks:
    room for background prompt tokens the chats would have waited out.  A stall is learned
    as STALL_FACTOR × its prediction; what was measured stays in last_s."""
    model = TickCostModel(COST)
    for i in range(200):
        d = 1 + i % 3
        model.observe(d, 0, d * 40 + i, 1.05 * COST.predict(d, 0, d * 40 + i))
        _ = model.coefficients
    before = model.coefficients.predict(3, 0, 300)
    stalled = 8.6 * COST.predict(2, 0, 200)
    model.observe(2, 0, 200, stalled)
    after = model.coefficients.predict(3, 0, 300)
    assert model.last_s == stalled
    assert after < 1.3 * before  # folded in whole: 2.3x
    # A real change of pace is learned all the same, STALL_FACTOR × the prediction a tick at most.
    for _ in range(60):
        model.observe(3, 0, 300, 3.0 * before)
        _ = model.coefficients
    assert model.coefficients.predict(3, 0, 300) > 2.5 * before


def test_a_model_that_predicts_nothing_still_learns() -> None:
    """A cost-model file of zeros predicts 0 s: the stall rule must not hold it there."""
    zeros = CostCoefficients(fixed_s=0.0, decode_s=0.0, prefill_s=0.0, ctx_s_per_kcell=0.0)
    model = TickCostModel(zeros)
    for _ in range(40):
        model.observe(2, 0, 0, 0.010)
        _ = model.coefficients
    assert model.coefficients.predict(2, 0, 0) > 0.005


def test_a_plan_carries_the_kv_cells_its_batch_reads() -> None:
    """observe() learns from the plan alone (issue 18: no state rebuilt between plan and observe)."""
    state = SchedulerState((interactive(1, n_past=300), interactive(2, prompt=64, n_past=0)))
    plan = plan_tick(state, CONFIG, COST)
    chunk = dict(plan.prefill)[2]
    assert plan.decode == (1,) and plan.kv_cells == 300 + chunk * (chunk // 2)
    model = TickCostModel(COST)
    policy = Policy(CONFIG, model)
    policy.observe(plan, SchedulerState(()), seconds=0.05)  # the state is not needed for the cells
    assert model.last_s == 0.05


# -- quiet ticks: work-conserving background prompts (issue 19) ---------------------


def quiet_state(*sessions: SessionState, micro_batch: int = 512) -> SchedulerState:
    return SchedulerState(tuple(sessions), tick=0, max_batch=2048, micro_batch=micro_batch, preemptible=True)


def test_quiet_ticks_double_the_background_tick_up_to_the_growth_limit() -> None:
    """With no interactive session and an engine that can stop a step, every quiet tick
    doubles the budget; background prompts take at most a micro-batch a tick."""
    state = quiet_state(background(1, prompt=50_000))
    budgets, chunks = [], []
    for quiet in range(CONFIG.background_growth + 3):
        p = plan_tick(state, CONFIG, COST, Controls(quiet_ticks=quiet))
        budgets.append(p.budget_s)
        chunks.append(p.prefill_tokens)
        assert p.preemptible
    growth = 2**CONFIG.background_growth
    assert budgets[0] == pytest.approx(CONFIG.tick_background_s)
    assert budgets[3] == pytest.approx(8 * CONFIG.tick_background_s)
    assert budgets[-1] == pytest.approx(growth * CONFIG.tick_background_s)  # capped
    assert chunks[0] == int((CONFIG.tick_background_s - 0.004) / 0.003)  # the throughput tick's room
    assert chunks == sorted(chunks) and max(chunks) == 512  # one micro-batch at most


def test_without_preemption_or_with_an_interactive_session_the_tick_does_not_grow() -> None:
    job = background(1, prompt=50_000)
    unstoppable = SchedulerState((job,), tick=0, max_batch=2048, micro_batch=512, preemptible=False)
    p = plan_tick(unstoppable, CONFIG, COST, Controls(quiet_ticks=5))
    assert p.budget_s == pytest.approx(CONFIG.tick_background_s) and not p.preemptible
    waiting_chat = quiet_state(job, interactive(2, prompt=30))
    p = plan_tick(waiting_chat, CONFIG, COST, Controls(quiet_ticks=5))
    assert not p.preemptible  # the chat's prompt is in it
    assert p.budget_s < 2 * CONFIG.tick_background_s


def test_a_background_decoder_keeps_the_quiet_tick_at_the_throughput_tick() -> None:
    """It gets one token a tick: a grown tick of prefill beside it would starve it."""
    state = quiet_state(background(1, prompt=50_000), background(2, n_past=2000))
    p = plan_tick(state, CONFIG, COST, Controls(quiet_ticks=5))
    assert p.budget_s == pytest.approx(CONFIG.tick_background_s) and p.preemptible
    assert p.decode == (2,) and p.prefill
    policy = Policy(CONFIG, TickCostModel(COST))
    policy.observe(policy.plan(state), state, seconds=0.05)
    assert policy.controls.quiet_ticks == 0  # growth starts over once only prompts are left


def test_a_batch_without_interactive_sessions_is_preemptible_beside_a_parked_one() -> None:
    state = quiet_state(background(1, prompt=5000), interactive(2, parked=True, n_past=40))
    p = plan_tick(state, CONFIG, COST, Controls(quiet_ticks=3))
    assert p.preemptible and p.prefill and not p.decode
    assert p.budget_s == pytest.approx(CONFIG.tick_background_s)  # a session is interactive: no growth


def test_quiet_ticks_count_up_reset_on_preemption_and_never_hold() -> None:
    policy = Policy(CONFIG, TickCostModel(COST))
    state = quiet_state(background(1, prompt=50_000))
    for _ in range(3):
        p = policy.plan(state)
        policy.observe(p, state, seconds=p.budget_s * 3)  # far over budget: no hold while quiet
    assert policy.controls.quiet_ticks == 3 and policy.controls.hold_left == 0
    policy.preempted()
    assert policy.controls.quiet_ticks == 0 and policy.snapshot()["preempted_ticks"] == 1
    chat = quiet_state(background(1, prompt=50_000), interactive(2, n_past=40))
    p = policy.plan(chat)
    policy.observe(p, chat, seconds=p.predicted_s)
    assert policy.controls.quiet_ticks == 0


# -- the p95 slack as an error budget (issue 19) -------------------------------------


def test_the_slack_budget_counts_ticks_past_the_cap_over_its_window() -> None:
    from uma_trio.sched.slack import SlackBudget

    slack = SlackBudget(share=0.05, rescue_share=0.03, window=100)
    assert slack.for_rescue and slack.used == 0.0
    for _ in range(2):
        slack.record(True)
    assert slack.for_rescue  # a third stretched tick keeps 3 of 100
    slack.record(True)
    assert not slack.for_rescue and slack.used == pytest.approx(0.03)
    for _ in range(100):
        slack.record(False)  # the stretched ticks leave the window
    assert slack.over_cap == 0 and slack.for_rescue


def test_rescues_wait_while_the_slack_is_spent_but_new_prompts_do_not() -> None:
    starving = background(1, prompt=800, ticks_waiting=CONFIG.starve_ticks)
    chat = interactive(2, n_past=50)
    newcomer = interactive(3, prompt=30)
    spent = Controls(slack_for_rescue=False)
    assert plan(chat, starving, controls=spent).rescue is False
    assert plan(chat, starving).rescue is True
    with_prompt = plan(chat, newcomer, controls=spent)
    assert dict(with_prompt.prefill)[3] > 1  # stretched past the budget all the same


def test_the_policy_feeds_its_slack_from_measured_interactive_ticks() -> None:
    policy = Policy(CONFIG, TickCostModel(COST))
    state = SchedulerState((interactive(1, n_past=50),), tick=0)
    p = policy.plan(state)
    policy.observe(p, state, seconds=p.cap_s * 1.5)
    policy.observe(p, state, seconds=p.cap_s * 0.9)
    assert policy.slack.over_cap == 1 and policy.snapshot()["slack"]["over_cap"] == 1


@given(
    st.lists(st.integers(min_value=0, max_value=5_000), min_size=1, max_size=20),
    st.sampled_from([None, 0.004, 0.5]),
    st.sampled_from([1, 4, 512]),
)
def test_the_steady_decode_short_cut_is_the_pipelines_plan(
    n_past: list[int], foreign_cap_s: float | None, max_batch: int
) -> None:
    """Every session an interactive stream that decodes: the short cut plan_tick takes each
    tick of steady chat traffic is exactly the plan the whole pipeline makes."""
    sessions = tuple(SessionState(key=i, n_past=n, ticks_waiting=i % 3) for i, n in enumerate(n_past))
    state = SchedulerState(sessions, tick=40, max_batch=max_batch, foreign_cap_s=foreign_cap_s)
    cost = msgspec.structs.replace(COST, ctx_s_per_kcell=0.002)  # the cells read count too
    steady = steady_decode_plan(state, CONFIG, cost)
    if len(sessions) > max_batch:
        assert steady is None
    else:
        assert steady == plan_pipeline(state, CONFIG, cost, Controls())


def test_the_short_cut_is_not_taken_where_the_pipeline_has_work_to_place() -> None:
    decoding = SessionState(key=0, n_past=10)
    for other in (
        SessionState(key=1, prompt_remaining=5),
        SessionState(key=1, lane="background", n_past=4),
        SessionState(key=1, n_past=4, parked=True),
    ):
        assert steady_decode_plan(SchedulerState((decoding, other)), CONFIG, COST) is None
    assert steady_decode_plan(SchedulerState(()), CONFIG, COST) is None


@given(st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=25, max_size=25), st.integers(1, 5))
def test_the_fits_own_solve_agrees_with_numpy(values: list[float], n: int) -> None:
    """The cost model solves its 5×5 system in plain floats (cheaper than numpy's wrappers
    right after a step); on any symmetric positive definite system it is numpy's answer."""
    import numpy as np

    m = np.array(values[: n * n]).reshape(n, n)
    a = m @ m.T + 0.01 * np.eye(n)
    b = np.array(values[:n]) + 0.5
    assert np.allclose(
        solve_positive_definite(a.tolist(), b.tolist()), np.linalg.solve(a, b), rtol=1e-6, atol=1e-9
    )


def test_the_fits_own_solve_refuses_a_matrix_that_is_not_positive_definite() -> None:
    with pytest.raises(ValueError, match="positive definite"):
        solve_positive_definite([[1.0, 2.0], [2.0, 1.0]], [1.0, 1.0])


# -- how long a decode-only plan stands (Plan.stands_for) -------------------------------


def advanced(
    state: SchedulerState, controls: Controls, k: int, served: tuple[int, ...]
) -> tuple[SchedulerState, Controls]:
    """``k`` ticks on, each run as planned (``served`` decoding) and on budget: what the
    loop's view and the policy's controls (Policy.observe) would then be."""
    sessions = tuple(
        replace(s, ticks_waiting=0) if s.key in served else replace(s, ticks_waiting=s.ticks_waiting + k)
        for s in state.sessions
    )
    hold, ramp = controls.hold_left, controls.ramp
    for _ in range(k):  # as Policy.observe, each tick on budget: the hold counts down, then the ramp climbs
        if hold > 0:
            hold -= 1
        elif ramp < 1.0:
            ramp = min(1.0, ramp + 1.0 / CONFIG.ramp_ticks)
    slack_in = max(0, controls.rescue_slack_in - k)  # at best: no tick past the cap meanwhile
    later = replace(
        controls, hold_left=hold, ramp=ramp, rescue_slack_in=slack_in,
        slack_for_rescue=controls.slack_for_rescue or slack_in == 0,
    )  # fmt: skip
    return replace(state, sessions=sessions, tick=state.tick + k), later


def test_a_decode_only_plan_stands_until_the_next_rescue_is_due() -> None:
    streams = [interactive(k, n_past=50) for k in range(3)]
    starving = background(9, prompt=2000, ticks_waiting=10)
    controls = Controls(last_rescue_tick=95)
    state = SchedulerState((*streams, starving), tick=100)
    first = plan_tick(state, CONFIG, COST, controls)
    assert first.prefill == () and not first.rescue
    # Spaced 20 ticks on, starving 15 ticks on: the rescue may come 20 ticks on at the earliest.
    assert first.stands_for == CONFIG.rescue_every - 5 - 1
    later_state, later_controls = advanced(state, controls, first.stands_for + 1, first.decode)
    later = plan_tick(later_state, CONFIG, COST, later_controls)
    assert later.rescue and dict(later.prefill)[9] >= 1
    # With nothing left out there is nothing to stand for; a prompt the budget has room for
    # (or an interactive one) may join at any tick.
    assert plan(*streams).stands_for == 0
    roomy = CostCoefficients(fixed_s=0.004, decode_s=0.003, prefill_s=0.0001, ctx_s_per_kcell=0.0)
    with_room = plan_tick(SchedulerState((*streams, starving), tick=100), CONFIG, roomy, controls)
    assert with_room.prefill and with_room.stands_for == 0
    held = plan_tick(
        SchedulerState((*streams, starving), tick=100), CONFIG, roomy, replace(controls, hold_left=4)
    )
    assert held.prefill == () and held.stands_for == 3  # the hold keeps it out 3 ticks more


@given(
    st.integers(1, 4),
    st.lists(st.integers(0, 40), min_size=1, max_size=5),
    st.integers(0, 40),
    st.integers(0, 6),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from([0.003, 0.0005, 0.00005]),
    st.integers(0, 60),
    st.sampled_from([0.003, 0.0003]),
)
def test_a_plan_stands_for_as_many_ticks_as_it_says(
    streams: int, waited: list[int], since_rescue: int, hold: int, ramp: float, prefill_s: float,
    slack_in: int, decode_s: float,
) -> None:  # fmt: skip
    """For every tick a decode-only plan says it stands for, the pipeline run on the state
    that many ticks on plans the same decoders, no prompt token and no rescue."""
    cost = CostCoefficients(fixed_s=0.004, decode_s=decode_s, prefill_s=prefill_s, ctx_s_per_kcell=0.0)
    sessions = [interactive(k, n_past=40) for k in range(streams)]
    sessions += [
        background(10 + i, prompt=3000 * (i % 2), n_past=3000, ticks_waiting=w) for i, w in enumerate(waited)
    ]  # prompts and decoders
    state = SchedulerState(tuple(sessions), tick=200)
    controls = Controls(
        hold_left=hold, ramp=ramp, last_rescue_tick=200 - since_rescue,
        slack_for_rescue=slack_in == 0, rescue_slack_in=slack_in,
    )  # fmt: skip
    first = plan_tick(state, CONFIG, cost, controls)
    if first.prefill or first.rescue:
        assert first.stands_for == 0
    for k in range(1, first.stands_for + 1):
        later_state, later_controls = advanced(state, controls, k, first.decode)
        later = plan_tick(later_state, CONFIG, cost, later_controls)
        assert (sorted(later.decode), later.prefill, later.rescue) == (sorted(first.decode), (), False), k


def test_the_slack_says_how_many_on_cap_ticks_it_needs_before_it_allows_a_rescue() -> None:
    from uma_trio.sched.slack import SlackBudget

    slack = SlackBudget(share=0.05, rescue_share=0.03, window=100)  # a rescue needs over_cap <= 2
    assert slack.ticks_until_allows(0.03) == 0
    for over in (True, False, False, True, True, False):
        slack.record(over)
    # 3 over the cap: the first must leave the window, after 94 more ticks fill it and one more.
    assert slack.over_cap == 3 and slack.ticks_until_allows(0.03) == 94 + 1
    for _ in range(94):
        slack.record(False)
    assert not slack.for_rescue and slack.ticks_until_allows(0.03) == 1
    slack.record(False)
    assert slack.for_rescue and slack.ticks_until_allows(0.03) == 0


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 600), st.integers(0, 2 * CONFIG.starve_ticks)),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 3),
)
def test_a_plan_never_holds_more_tokens_than_the_batch(
    sessions: list[tuple[bool, int, int]], spare: int
) -> None:
    """With --n-batch at --max-sessions, a new chat's forced first token and a starving
    session's rescue token went past n_batch: the step failed, and with it every running
    request (E_RUNTIME_004, the context rebuilt)."""
    states = tuple(
        SessionState(key=k, lane="interactive" if chat else "background", prompt_remaining=prompt,
                     n_past=0 if prompt else 30, ticks_waiting=waiting)
        for k, (chat, prompt, waiting) in enumerate(sessions)
    )  # fmt: skip
    max_batch = len(states) + spare
    result = plan_tick(SchedulerState(states, max_batch=max_batch, micro_batch=max_batch), CONFIG, COST)
    assert len(result.decode) + result.prefill_tokens <= max_batch
