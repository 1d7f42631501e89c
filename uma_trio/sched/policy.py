"""The scheduling policy: a pure pipeline from a state snapshot to a plan.

Theory of operation
-------------------
Every tick the decode task hands :meth:`Policy.plan` a :class:`SchedulerState`
and runs the :class:`Plan` it gets back as one ``llama_batch``; afterwards it
reports the measured time to :meth:`Policy.observe`.  Nothing here reads a
clock, does I/O or imports trio or llama_cpp, so every stage is tested alone
with hand-built states and the whole policy runs unchanged in simulations.

The stages, in order (each a function below):

1. **Tick budget** (:func:`tick_budget`).  The baseline is the predicted time
   of a decode-only tick for the interactive sessions now decoding; the budget
   is ``latency_cap × baseline`` (at least ``tick_min_s``).  With no
   interactive decoder the budget is the throughput tick (:func:`throughput_tick`):
   ``tick_background_s``, or longer where a step's own cost would be more than
   ``step_share`` of it.
2. **Decode first.**  Every interactive decoder gets its token every tick.
3. **Interactive prefill** fills up to ``max_pause ×`` the decode tick the
   interactive clients will see once the waiting prompts decode too (water-filled,
   shortest prompt first), so a new interactive request joins on the very next
   tick (token-boundary preemption: it never waits behind a background chunk,
   which only ever gets headroom) and a burst of requests is let in at the pace
   the burst will decode at, not a few tokens a tick.  Beside another model's
   streams (``SchedulerState.beside_s``) that pace holds a tick of each model.
   With no stream decoding, such a first tick is the new requests' own: background
   work takes only what adds nothing to it, and no rescue rides on it (time to
   first token first).
4. **Background decoders** fill the headroom, longest-waiting first, at most
   ``background_limit`` of them (the sweet-spot auto-tuner's setting); with no
   interactive session at all (a quiet tick) every one of them, whatever the budget.
5. **Background prefill** fills what is still left (in a quiet tick, the budget's
   room whatever the decoders took), shortest remaining prompt
   first and whole (:func:`shortest_first`), scaled by the hysteresis ramp:
   after a tick overran its budget, prefill is held off for ``hold_ticks``
   ticks and then re-enabled over ``ramp_ticks`` ticks.
6. **Rescue.**  On a machine where one token costs a large part of a tick the
   headroom can stay below one token for as long as interactive streams run.
   So a runnable session that has waited ``starve_ticks`` ticks is served
   anyway, at most once every ``rescue_every`` ticks and only as far as the
   tick stays within ``rescue_pause × baseline``.  This bounds both the worst
   pause interactive streams see and how long background work can starve.
   Then, where the engine captures a step's graph on its second run in a row (CUDA),
   a tick carrying prompt tokens is moved one token off the shape that would be
   captured (:mod:`.graph_shapes`).
7. **ΣBMT guard** (:mod:`.bmt`): if the estimated bytes moved exceed
   bandwidth × budget, prefill is trimmed first, then background decoders.

Parked sessions (clients not reading) sit out and are never dropped.

Over 400 lines: the pipeline's stages read best in order in one place; the ΣBMT guard
(bmt.py), the cost model (cost.py) and the state types (state.py) are apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import ServerConfig
from .autotune import HillClimber
from .bmt import BmtGuard
from .cost import CostCoefficients, TickCostModel, kv_cells_read
from .graph_shapes import steer_clear
from .slack import SlackBudget
from .state import Plan, SchedulerState, SessionState, SkipReason


@dataclass(frozen=True)
class PolicyConfig:
    latency_cap: float = 1.2  # tick budget over the interactive decode-only baseline
    # Aim this far under the cap: the baseline is a prediction, and background work fills
    # the budget to the brim, so without a margin p95 lands just above the cap.
    cap_margin: float = 0.95
    tick_min_s: float = 0.005  # budget floor, so tiny ticks still carry some work
    tick_background_s: float = 0.050  # budget with no interactive decoder (throughput mode)
    # ...at least long enough that what every step costs whatever it carries (the cost
    # model's fixed part and a prompt tick's step) is at most this share of it.
    step_share: float = 0.25
    # New-prompt ticks stay within this × baseline: the 2× target, less a margin for
    # prediction error.
    max_pause: float = 1.8
    # Rescue ticks spend the same 2× allowance on background work, with a wider margin: the
    # first chunk of a prompt that reuses a cached prefix also pays for copying it, which the
    # cost model does not price (a storm rescue tick predicted at 21 ms ran 43 ms).
    rescue_pause: float = 1.5
    starve_ticks: int = 25  # ticks a runnable session may wait before it is rescued
    rescue_every: int = 25  # at most one rescue tick per this many ticks
    hold_ticks: int = 4  # prefill held off this long after an over-budget tick...
    ramp_ticks: int = 4  # ...then re-enabled over this many ticks
    overrun_tolerance: float = 0.25  # a tick is over budget above budget × (1 + this)
    autotune_period: int = 16  # ticks per hill-climbing step
    background_limit: int | None = None  # a static decoders-per-tick limit instead of auto-tune
    # Quiet ticks (no interactive session, on an engine that can preempt a step) double the
    # throughput tick each, up to 2**this × it: the engine's efficient unit for background
    # prompts, at no cost to an interactive request, which stops such a tick when it arrives.
    background_growth: int = 6
    # With no stream decoding, interactive prompts (a burst arriving at an idle daemon) may
    # take a tick up to this long, or one micro-batch if that is longer: what a request
    # arriving meanwhile waits at most.  On a GPU a burst of 16 × 128 tokens fits one such
    # tick; taken one micro-batch at a time, the rest would join at the pace of the first
    # ones' streams, a few dozen tokens a tick.
    burst_tick_s: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.step_share <= 1.0:
            raise ValueError("step_share must be in (0, 1]")
        if min(self.latency_cap, self.max_pause, self.rescue_pause) < 1.0:
            raise ValueError("latency_cap, max_pause and rescue_pause must be at least 1")
        if min(self.starve_ticks, self.rescue_every, self.autotune_period) < 1:
            raise ValueError("starve_ticks, rescue_every and autotune_period must be positive")


# -- stage 1: the budget --------------------------------------------------------


def tick_budget(
    sessions: Sequence[SessionState], config: PolicyConfig, cost: CostCoefficients, beside_s: float = 0.0
) -> tuple[float, float]:
    """``(budget_s, baseline_s)`` for this tick; see the module docstring.  ``beside_s``:
    other models' stream ticks, whose gaps a tick here lands in (SchedulerState.beside_s)."""
    decoders = [s for s in sessions if s.interactive and s.decoding and not s.parked]
    if not decoders and beside_s > 0.0:
        # No stream here, but another model's: this tick only stretches their gaps, so it
        # gets their cap headroom, as a background model's tick costs no share within it.
        headroom = max(0.0, (config.latency_cap * config.cap_margin - 1.0) * beside_s)
        return headroom, headroom
    if not decoders:
        throughput = throughput_tick(config, cost)
        return throughput, throughput
    baseline = cost.predict(len(decoders), 0, sum(s.n_past for s in decoders))
    return interactive_budget(baseline, config), baseline


def throughput_tick(config: PolicyConfig, cost: CostCoefficients) -> float:
    """The budget with no interactive decoder: ``tick_background_s``, or longer where one
    step's own cost (``fixed_s``, and ``prompt_tick_s``, the step a tick with prompt tokens
    pays) would be more than ``step_share`` of it.  Such short ticks would spend the engine on
    steps, not tokens: on Vulkan on the H100 a prompt tick paid ~35 ms whatever it carried,
    and 50 ms ticks read a background prompt 12-30 tokens at a time, 200 tok/s against
    llama-server's 1,640 (BENCHMARKS.md "Vulkan on a real GPU").  On the CPU and on CUDA
    the step is a few ms and the throughput tick stays ``tick_background_s``."""
    return max(config.tick_background_s, (cost.fixed_s + cost.prompt_tick_s) / config.step_share)


def interactive_budget(baseline_s: float, config: PolicyConfig) -> float:
    """The tick budget while interactive streams decode at ``baseline_s`` a tick."""
    return max(config.latency_cap * config.cap_margin * baseline_s, config.tick_min_s)


def joined_baseline(
    decoders: Sequence[SessionState], prompts: Sequence[SessionState], cost: CostCoefficients
) -> float:
    """The predicted decode-only tick once ``prompts`` decode beside ``decoders``."""
    if not decoders and not prompts:
        return 0.0
    cells = sum(s.n_past for s in decoders) + sum(s.n_past + s.prompt_remaining for s in prompts)
    return cost.predict(len(decoders) + len(prompts), 0, cells)


# -- the batch being built --------------------------------------------------------


@dataclass
class _Batch:
    cost: CostCoefficients
    max_batch: int
    decode: list[SessionState] = field(default_factory=list)
    prefill: list[tuple[SessionState, int]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def kv_cells(self) -> int:
        return kv_cells_read([s.n_past for s in self.decode], [(s.n_past, n) for s, n in self.prefill])

    def predicted(self, extra_decode: Sequence[SessionState] = (), extra_prefill: int = 0) -> float:
        decode = [*self.decode, *extra_decode]
        prefill_tokens = sum(n for _, n in self.prefill) + extra_prefill
        cells = self.kv_cells + sum(s.n_past for s in extra_decode)
        return self.cost.predict(len(decode), prefill_tokens, cells)

    def prefill_room(self, limit_s: float, candidates: Sequence[SessionState]) -> int:
        """Prompt tokens that still fit under ``limit_s`` (priced at the deepest context,
        as one chunk: its tokens also attend to each other, which several shorter chunks do
        less).  The cost only grows with tokens, so binary-search the largest count: under a
        knee (:class:`CostCoefficients` ``flat_tokens``) tokens are free, past it linear."""
        if not candidates:
            return 0
        deepest = max(s.n_past for s in candidates)
        decode = len(self.decode)
        prefill = sum(n for _, n in self.prefill)
        cells = kv_cells_read([s.n_past for s in self.decode], [(s.n_past, n) for s, n in self.prefill])
        lo, hi = 0, max(0, self.max_batch - self.n_tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.predict(decode, prefill + mid, cells + mid * (deepest + mid // 2)) <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


# -- stages 2-5 -------------------------------------------------------------------


def water_fill(candidates: Sequence[SessionState], room: int) -> list[tuple[SessionState, int]]:
    """Max-min fair split of ``room`` prompt tokens, shortest remaining prompt first."""
    chunks: list[tuple[SessionState, int]] = []
    ordered = sorted(candidates, key=lambda s: (s.prompt_remaining, s.key))
    for i, session in enumerate(ordered):
        if room <= 0:
            break
        share = max(1, room // (len(ordered) - i))
        take = min(session.prompt_remaining, share)
        chunks.append((session, take))
        room -= take
    return chunks


Chunks = list[tuple[SessionState, int]]


def first_ends(chunks: Chunks, nobody_decodes: bool) -> Chunks:
    """With no stream decoding, a tick in which some interactive prompts end carries those
    alone: their first tokens come out at once, where the rest of a longer prompt's
    micro-batch beside them held them back a whole micro-batch (a chat sent while a
    1,500-token interactive prompt was read waited two: 4-5 s on this CPU).  The longer
    prompt goes on in the next ticks, beside their streams as any prompt does."""
    if not nobody_decodes:
        return chunks
    ending = [(s, n) for s, n in chunks if n >= s.prompt_remaining]
    return ending if ending and len(ending) < len(chunks) else chunks


def shortest_first(candidates: Sequence[SessionState], room: int) -> list[tuple[SessionState, int]]:
    """``room`` prompt tokens to the shortest remaining prompts, each whole before the next:
    the order that finishes background prompts soonest on average (shortest remaining
    processing time); a fair split would finish them all at the end, together."""
    chunks: list[tuple[SessionState, int]] = []
    for session in sorted(candidates, key=lambda s: (s.prompt_remaining, s.key)):
        if room <= 0:
            break
        take = min(session.prompt_remaining, room)
        chunks.append((session, take))
        room -= take
    return chunks


def add_decoders(
    batch: _Batch, candidates: Iterable[SessionState], limit_s: float, most: int | None
) -> list[SessionState]:
    """Add decoders longest-waiting first while they fit; return those left out."""
    ordered = sorted(candidates, key=lambda s: (-s.ticks_waiting, s.key))
    left: list[SessionState] = []
    for session in ordered:
        room_left = most is None or len(batch.decode) < most
        fits = batch.predicted([session]) <= limit_s and batch.n_tokens < batch.max_batch
        if room_left and fits:
            batch.decode.append(session)
        else:
            left.append(session)
    return left


@dataclass(frozen=True)
class Controls:
    """The policy's slow state, carried from one tick to the next by :class:`Policy`."""

    hold_left: int = 0  # ticks prefill stays held off
    ramp: float = 1.0  # share of the headroom background prefill may use
    background_limit: int | None = None  # background decoders per tick (None: no limit)
    last_rescue_tick: int = -(10**9)
    quiet_ticks: int = 0  # consecutive ticks with no interactive session (reset by a preemption)
    # The p95 slack (sched/slack.py) left for a rescue tick past the cap; new interactive
    # prompts stretch ticks whatever is left (time to first token comes first).
    slack_for_rescue: bool = True
    # While it is spent, the fewest ticks before it may allow a rescue again (Plan.stands_for).
    rescue_slack_in: int = 0


def plan_tick(
    state: SchedulerState,
    config: PolicyConfig,
    cost: CostCoefficients,
    controls: Controls = Controls(),
) -> Plan:
    """Stages 1-6 of the module docstring (the ΣBMT guard is applied by :class:`Policy`)."""
    if (steady := steady_decode_plan(state, config, cost)) is not None:
        return steady
    return plan_pipeline(state, config, cost, controls)


def plan_pipeline(
    state: SchedulerState,
    config: PolicyConfig,
    cost: CostCoefficients,
    controls: Controls = Controls(),
) -> Plan:
    """Every stage, in order, for any state (:func:`plan_tick` takes a short cut for one)."""
    skipped: dict[int, SkipReason] = {s.key: "parked" for s in state.sessions if s.parked}
    runnable = [s for s in state.sessions if not s.parked]
    budget, baseline = tick_budget(runnable, config, cost, state.beside_s)
    if quiet_tick(state):  # no interactive session: tick_budget gave the throughput tick
        growth = 2 ** min(controls.quiet_ticks, config.background_growth) if growing_tick(state) else 1
        budget = baseline = budget * growth
    if state.foreign_cap_s is not None:  # inside another model's stream gap (sched/arbiter.py)
        budget = min(budget, state.foreign_cap_s)
    batch = _Batch(cost, state.max_batch)

    interactive_decoders = [s for s in runnable if s.interactive and s.decoding]
    batch.decode.extend(interactive_decoders[: state.max_batch])

    # New interactive work may stretch the tick up to the pause limit: a prompt token can
    # cost more than the whole headroom, and a new request must still join on the next tick.
    # The limit is taken against the tick the interactive clients will run at once the
    # waiting prompts decode too: that is their own pace (the "alone" the guard compares
    # with), which admitting them sets anyway.  Against today's smaller tick a burst of
    # requests would trickle in a few tokens a tick (on a GPU, in waves over seconds).
    # Beside other models' streams that pace holds a tick of each model (``beside_s``), and
    # so does every gap the tick stretches.
    interactive_prompts = [s for s in runnable if s.interactive and not s.decoding]
    joined = joined_baseline(interactive_decoders, interactive_prompts, cost)
    beside = state.beside_s
    pause_limit = max(budget, config.max_pause * (joined + beside) - beside)
    room = batch.prefill_room(pause_limit, interactive_prompts)
    # With no stream decoding, here or on another model, there is no gap to protect: prompts
    # take a whole micro-batch (work-conserving: the engine's efficient unit, as llama-server
    # prefills), or as many as fit the burst tick where that is more, so a request arriving
    # meanwhile waits for the one running, then has the next to itself where its prompt ends
    # in it (first_ends).  The budget covers what is planned.
    nobody_decodes = not any(s.decoding for s in runnable)
    if nobody_decodes and interactive_prompts and beside <= 0.0:
        whole = min(state.micro_batch, state.max_batch - batch.n_tokens)
        room = max(room, whole, batch.prefill_room(config.burst_tick_s, interactive_prompts))
    room = max(room, min(1, len(interactive_prompts), state.max_batch - batch.n_tokens))
    batch.prefill.extend(first_ends(water_fill(interactive_prompts, room), nobody_decodes))
    # A new interactive request's first tick with no stream decoding: time to first token
    # comes first, so background work only takes what adds nothing to it (under a GPU's
    # knee), not the throughput tick: on the CPU a chat's 16 ms first tick was filled with
    # background prompt tokens to 50 ms, a TTFT of 62 ms against 26 ms alone.
    first_tokens = bool(interactive_prompts) and not interactive_decoders
    if first_tokens:
        budget = min(budget, batch.predicted())

    # With no interactive session every background decoder joins (up to the tuner's limit):
    # one step gives each its token for one step's fixed cost, and a chat arriving stops it
    # at once (quiet_tick).  Held to the throughput tick, 16 streams on this CPU decoded ~6 a
    # tick in turns, 0.70-0.82x llama-server's tokens/s (BENCHMARKS.md "Background chains
    # handed back together").  Inside another model's stream gap the gap still bounds it.
    background_decoders = [s for s in runnable if not s.interactive and s.decoding]
    quiet = quiet_tick(state)
    every_decoder = quiet and state.foreign_cap_s is None
    background_prompts = [s for s in runnable if not s.interactive and not s.decoding]
    # The prompts' room, before the decoders: beside every decoder they still get the budget
    # (or every new stream would wait for a rescue, one each 25 ticks).
    open_room = batch.prefill_room(budget, background_prompts) if every_decoder else 0
    left = add_decoders(batch, background_decoders, math.inf if every_decoder else budget,
                        _decoder_cap(batch, controls))  # fmt: skip
    skipped.update((s.key, "budget") for s in left)

    # With no interactive session at all the tick grows (stage 1: quiet ticks) and the hold
    # and ramp, which protect interactive gaps, do not apply.  Where the engine cannot stop
    # a step midway, background prompts keep the throughput tick even with nobody decoding:
    # an interactive request arriving meanwhile would wait all of it.
    held = controls.hold_left > 0 and not quiet
    if not every_decoder:
        open_room = batch.prefill_room(budget, background_prompts)  # unheld, before the ramp
    if held:
        skipped.update((s.key, "hold") for s in background_prompts)
    else:
        room = open_room
        if quiet:  # at most one micro-batch: what a preemption can waste
            room = min(room, max(0, state.micro_batch - batch.n_tokens))
        else:
            room = int(room * controls.ramp)
        batch.prefill.extend(shortest_first(background_prompts, room))

    if not batch.decode and not batch.prefill and runnable:
        # Never idle with work waiting: a hold only matters while something else runs, and
        # an empty plan would put the decode task to sleep until the next request.
        waiting = sorted(runnable, key=lambda s: (-s.ticks_waiting, s.key))
        _rescue(batch, waiting[:1], budget)
        skipped.pop(waiting[0].key, None)

    served = {s.key for s in batch.decode} | {s.key for s, _ in batch.prefill}
    rescue = False
    spaced = state.tick - controls.last_rescue_tick >= config.rescue_every
    if spaced and not first_tokens and (controls.slack_for_rescue or not interactive_decoders):
        starving = [s for s in runnable if s.key not in served and s.ticks_waiting >= config.starve_ticks]
        rescue = _rescue(batch, starving, max(budget, config.rescue_pause * baseline))
        served = {s.key for s in batch.decode} | {s.key for s, _ in batch.prefill}

    # One token more or less keeps llama.cpp from capturing a CUDA graph for this tick only.
    room = state.max_batch - batch.n_tokens
    batch.prefill = steer_clear(len(batch.decode), batch.prefill, state.capture_shape, room)

    for s in runnable:
        if s.key not in served:
            skipped.setdefault(s.key, "budget")
        else:
            skipped.pop(s.key, None)
    if nobody_decodes:
        budget = max(budget, batch.predicted())
    left_out = [s for s in runnable if s.key not in served]
    stands_for = 0
    if batch.decode and left_out and not prompts_in(batch) and not rescue:
        gates = bool(interactive_decoders)  # the slack gates rescues beside interactive decoders
        stands_for = _stands_for(
            left_out, batch.decode, state, config, controls, open_room=open_room, slack_gates=gates
        )
    return Plan(
        decode=tuple(s.key for s in batch.decode),
        prefill=tuple((s.key, n) for s, n in batch.prefill if n > 0),
        skipped=tuple(sorted(skipped.items())),
        budget_s=budget,
        predicted_s=batch.predicted(),
        rescue=rescue,
        # The gap the guard allows this tick: against the pace the interactive clients set once
        # the waiting prompts decode too (the "alone" it compares with; stage 3).
        cap_s=config.latency_cap * max(baseline, joined) if interactive_decoders else 0.0,
        kv_cells=batch.kv_cells,
        preemptible=state.preemptible and not any(s.interactive for s in [*batch.decode, *prompts_in(batch)]),
        stands_for=stands_for,
    )


def _stands_for(
    left_out: Sequence[SessionState], decode: Sequence[SessionState], state: SchedulerState,
    config: PolicyConfig, controls: Controls, *, open_room: int, slack_gates: bool,
) -> int:  # fmt: skip
    """Ticks after a decode-only plan that leaves ``left_out`` out for which the pipeline
    would plan alike while only the tick count moves (Plan.stands_for): each left out is
    background work the budget has no room for (a prompt, or a decoder when none fits: those
    that fit take turns), or a prompt the hold and the ramp keep out a while longer, and the
    next rescue tick, once spaced, starving and (beside interactive decoders) allowed by the
    slack, is not due before then."""
    if any(s.interactive for s in left_out):
        return 0
    if any(s.decoding for s in left_out) and any(not s.interactive for s in decode):
        return 0  # background decoders rotate through the room there is
    if open_room > 0 and quiet_tick(state):
        return 0  # quiet ticks are not ramped: only the micro-batch kept them out
    prompts_in_after = _ticks_until_prompts_fit(open_room, controls, config)
    spacing_left = config.rescue_every - (state.tick - controls.last_rescue_tick)
    starving_left = min(config.starve_ticks - s.ticks_waiting for s in left_out)
    slack_left = controls.rescue_slack_in if slack_gates else 0
    rescue_due = max(1, spacing_left, starving_left, slack_left)  # the first later tick that may rescue
    return max(0, min(prompts_in_after, rescue_due) - 1)


def _ticks_until_prompts_fit(open_room: int, controls: Controls, config: PolicyConfig) -> int:
    """The first later tick whose plan gives background prompts a token, each tick observed on
    budget (Policy.observe: the hold counts down, then the ramp climbs back): ``open_room`` ×
    the ramp reaches one token.  Never, with no room at all."""
    if open_room <= 0:
        return 10**9
    hold, ramp, ticks = controls.hold_left, controls.ramp, 0
    while True:
        ticks += 1
        if hold > 0:
            hold -= 1
        elif ramp < 1.0:
            ramp = min(1.0, ramp + 1.0 / config.ramp_ticks)
        if hold == 0 and int(open_room * ramp) >= 1:
            return ticks


def steady_decode_plan(state: SchedulerState, config: PolicyConfig, cost: CostCoefficients) -> Plan | None:
    """The plan :func:`plan_tick` makes when every session is an interactive stream that
    decodes and reads its stream (the steady state of chat traffic), built directly; None
    otherwise.  Stages 3-6 have nothing to place then, so the plan is every decoder, the
    budget and the cap; it is the same plan (tests/test_policy.py checks they agree).  It
    runs every tick, right after a step has pushed the interpreter out of the CPU caches,
    where the whole pipeline took ~80 µs of a 6.5 ms one-stream tick."""
    sessions = state.sessions
    if not sessions or len(sessions) > state.max_batch:
        return None
    cells = 0
    for s in sessions:
        if s.parked or s.prompt_remaining or s.lane != "interactive":
            return None
        cells += s.n_past
    baseline = cost.predict(len(sessions), 0, cells)
    budget = interactive_budget(baseline, config)
    if state.foreign_cap_s is not None:
        budget = min(budget, state.foreign_cap_s)
    return Plan(
        decode=tuple(s.key for s in sessions), budget_s=budget, predicted_s=baseline,
        cap_s=config.latency_cap * baseline, kv_cells=cells,
    )  # fmt: skip


def quiet_tick(state: SchedulerState) -> bool:
    """No interactive session at all, on an engine that can stop a step for one that arrives."""
    return state.preemptible and not any(s.interactive for s in state.sessions)


def growing_tick(state: SchedulerState) -> bool:
    """A quiet tick with only prompts to read: it may grow.  A background decoder gets one
    token a tick, so beside one the tick stays the throughput tick: in the storm a grown
    tick of 8,000-token prefill held a finished prompt's 32 tokens to one every 3.3 s."""
    return quiet_tick(state) and not any(s.decoding for s in state.sessions if not s.parked)


def prompts_in(batch: _Batch) -> list[SessionState]:
    return [s for s, n in batch.prefill if n > 0]


def _background_only(state: SchedulerState) -> bool:
    """No interactive session at all: the auto-tuner may set the background decoder limit."""
    return not any(s.interactive for s in state.sessions)


def _decoder_cap(batch: _Batch, controls: Controls) -> int | None:
    if controls.background_limit is None:
        return None
    return len(batch.decode) + controls.background_limit


def _rescue(batch: _Batch, starving: Sequence[SessionState], limit_s: float) -> bool:
    """Serve starving sessions, longest-waiting first, while the tick stays under ``limit_s``;
    the first one always gets at least one token."""
    rescued = False
    for session in sorted(starving, key=lambda s: (-s.ticks_waiting, s.key)):
        if batch.n_tokens >= batch.max_batch:  # a batch over n_batch fails the whole step
            break
        if session.decoding:
            if rescued and batch.predicted([session]) > limit_s:
                break
            batch.decode.append(session)
        else:
            take = min(session.prompt_remaining, batch.prefill_room(limit_s, [session]))
            if take <= 0:
                if rescued:
                    break
                take = 1
            batch.prefill.append((session, min(take, batch.max_batch - batch.n_tokens)))
        rescued = True
    return rescued


# -- the stateful wrapper ----------------------------------------------------------------


@dataclass
class PolicyGauges:
    ticks_over_budget: int = 0
    rescue_ticks: int = 0
    last_budget_s: float = 0.0
    last_predicted_s: float = 0.0
    last_decode_tokens: int = 0
    last_prefill_tokens: int = 0
    served_decoders: int = 0
    parked_sessions: int = 0
    bmt_estimate_last: int = 0  # bytes the last batch was estimated to move (0: guard off)
    bmt_budget_last: int = 0  # bytes the guard allowed for it
    preempted_ticks: int = 0  # steps stopped midway for an arriving interactive request


class Policy:
    """:func:`plan_tick` plus the state that outlives a tick: the learning cost model,
    the prefill hysteresis, the rescue spacing and the sweet-spot auto-tuner."""

    def __init__(
        self,
        config: PolicyConfig,
        cost: TickCostModel,
        bmt_guard: BmtGuard | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.bmt_guard = bmt_guard
        self.controls = Controls()
        self.slack = SlackBudget()
        self.gauges = PolicyGauges()
        self.tuner = HillClimber(period=config.autotune_period)

    @property
    def prefill_guard_active(self) -> bool:
        return self.controls.hold_left > 0 or self.controls.ramp < 1.0

    def plan(self, state: SchedulerState) -> Plan:
        controls = self.controls
        limit = self.config.background_limit
        if limit is None and _background_only(state):
            limit = self.tuner.limit
        if limit is None:
            limit = controls.background_limit
        rescue = self.slack.for_rescue
        slack_in = 0 if rescue else self.slack.ticks_until_allows(self.slack.rescue_share)
        # Replaced only where a field differs: this runs every tick, right after a step has
        # pushed the interpreter out of the CPU caches (dataclasses.replace is not cheap then).
        if (limit, rescue, slack_in) != (
            controls.background_limit, controls.slack_for_rescue, controls.rescue_slack_in
        ):  # fmt: skip
            controls = replace(
                controls, background_limit=limit, slack_for_rescue=rescue, rescue_slack_in=slack_in
            )
        plan = plan_tick(state, self.config, self.cost.coefficients, controls)
        if self.bmt_guard is not None and plan:
            if not self.bmt_guard.trims:
                return replace(plan, bmt_bytes=self.bmt_guard.estimate(plan, state))
            self.gauges.bmt_budget_last = self.bmt_guard.budget_bytes(plan)
            guarded = self.bmt_guard.apply(plan, state)
            # Liveness beats the guard: a tick over the bandwidth budget is slow, an empty
            # plan would stall (the decode task sleeps until the next request).
            plan = guarded if guarded else replace(plan, bmt_bytes=guarded.bmt_bytes)
        return plan

    def snapshot(self) -> dict[str, Any]:
        """The policy's figures for the metrics snapshot (docs/METRICS.md)."""
        g, c = self.gauges, self.cost.coefficients
        return {
            "decode_ms_last": round(self.cost.last_s * 1000.0, 3),
            "decode_ms_ewma": round(self.cost.ewma_s * 1000.0, 3),
            "budget_ms_last": round(g.last_budget_s * 1000.0, 3),
            "predicted_ms_last": round(g.last_predicted_s * 1000.0, 3),
            "tokens_per_tick": {"decode": g.last_decode_tokens, "prefill": g.last_prefill_tokens},
            "served_decoders": g.served_decoders,
            "parked_sessions": g.parked_sessions,
            "prefill_guard_active": self.prefill_guard_active,
            "ticks_over_budget": g.ticks_over_budget,
            "rescue_ticks": g.rescue_ticks,
            "preempted_ticks": g.preempted_ticks,
            "slack": {
                "window_ticks": self.slack.window, "over_cap": self.slack.over_cap,
                "used": round(self.slack.used, 4), "budget": self.slack.share,
            },
            "quiet_ticks": self.controls.quiet_ticks,
            "background_limit": self.tuner.limit,
            "bmt_estimate_last": g.bmt_estimate_last,
            "bmt_budget": g.bmt_budget_last,
            "cost_model": {
                "fixed_ms": round(c.fixed_s * 1000.0, 4), "decode_ms": round(c.decode_s * 1000.0, 4),
                "prefill_ms": round(c.prefill_s * 1000.0, 4),
                "ctx_ms_per_kcell": round(c.ctx_s_per_kcell * 1000.0, 4),
                "prompt_tick_ms": round(c.prompt_tick_s * 1000.0, 4), "source": c.source,
            },
        }  # fmt: skip

    def preempted(self) -> None:
        """The engine stopped the last plan midway for an interactive request: nothing of it
        happened, and quiet ticks start over."""
        self.gauges.preempted_ticks += 1
        self.controls = replace(self.controls, quiet_ticks=0)

    def observe(self, plan: Plan, state: SchedulerState, seconds: float) -> None:
        """Learn from the tick just run: cost model, hysteresis, rescue spacing, tuner."""
        self.cost.observe(len(plan.decode), plan.prefill_tokens, plan.kv_cells, seconds)
        if plan.cap_s > 0:  # interactive streams decoded: their gap is this tick
            self.slack.record(seconds > plan.cap_s)
        g = self.gauges
        g.last_budget_s, g.last_predicted_s = plan.budget_s, plan.predicted_s
        g.last_decode_tokens, g.last_prefill_tokens = len(plan.decode), plan.prefill_tokens
        g.served_decoders = len(plan.decode)
        g.parked_sessions = sum(s.parked for s in state.sessions)
        g.bmt_estimate_last = plan.bmt_bytes
        quiet = quiet_tick(state)
        c = self.controls
        quiet_ticks = c.quiet_ticks + 1 if growing_tick(state) else 0
        if quiet_ticks != c.quiet_ticks:
            c = replace(c, quiet_ticks=quiet_ticks)
        if plan.rescue:
            g.rescue_ticks += 1
            c = replace(c, last_rescue_tick=state.tick)
        elif quiet:
            pass  # no interactive gap to protect: the hold is for ticks that have some
        elif seconds > plan.budget_s * (1.0 + self.config.overrun_tolerance):
            g.ticks_over_budget += 1
            c = replace(c, hold_left=self.config.hold_ticks, ramp=0.0)
        elif c.hold_left > 0:
            c = replace(c, hold_left=c.hold_left - 1)
        elif c.ramp < 1.0:
            c = replace(c, ramp=min(1.0, c.ramp + 1.0 / self.config.ramp_ticks))
        self.controls = c
        background_decoders = sum(1 for s in state.sessions if s.decoding and not s.parked)
        if _background_only(state) and not plan.prefill:
            # Decode-only ticks: a prompt's tokens cost a fraction of a decoder's, so a
            # period that read one would seem faster whatever its decoder limit.
            self.tuner.observe(plan.n_tokens, seconds, background_decoders)
        else:
            self.tuner.reset()


def default_policy(
    config: ServerConfig, bmt_guard: BmtGuard | None = None, prior: CostCoefficients | None = None
) -> Policy:
    """The policy the daemon's settings describe; the cost prior is ``prior``, else the
    ``--cost-model`` file, else the built-in coefficients."""
    if prior is None:
        prior = CostCoefficients.load(config.cost_model) if config.cost_model else CostCoefficients()
    policy_config = PolicyConfig(
        latency_cap=config.latency_cap,
        tick_min_s=config.tick_ms_min / 1000.0,
        tick_background_s=config.tick_ms / 1000.0,
    )
    return Policy(policy_config, TickCostModel(prior), bmt_guard)
