"""The decode task: the only owner of the engine's context.

Theory of operation
-------------------
Connections :meth:`~DecodeLoop.submit` sessions and :meth:`~DecodeLoop.cancel`
them; both only record the wish and wake the loop.  The loop then repeats:

1. apply cancellations (between steps, never during one: vLLM's rule), and
   run snapshot jobs, the only other users of the engine's KV cache;
2. admit waiting sessions while a seq id and enough KV cells are free (each
   admitted session reserves ``prompt + max_tokens`` cells, so a running
   batch can never run out of KV cache).  Interactive requests are admitted
   first, and background ones never take the last ``interactive_reserve``
   seq ids, so a new interactive request joins on the next tick.  The KV
   manager (:mod:`uma_trio.sched.kv_manager`) picks the id and the longest
   cached prefix the request can reuse; a hit simply starts the session's
   prefill further on, and cached sequences yield their ids and cells first;
3. ask the pure policy (:mod:`uma_trio.sched.policy`) for a plan, from a
   :class:`~uma_trio.sched.state.SchedulerState` snapshot;
4. run it as one batch in a worker thread (``engine.step``), so sockets keep
   flowing meanwhile;
5. turn sampled tokens into text and ``send_nowait`` them into each
   session's bounded channel.  A session whose channel is full is *parked*:
   left out of the batch until its connection drains it, so a slow reader
   never stalls anybody else and never loses a token (but one parked for
   long while others wait for a sequence gives its own up: _release_parked).

It never awaits a client.

Over 400 lines: it is the one task that may touch the engine's context, so every engine
call is sequenced here.  The decisions it carries out are made in pure modules beside it:
admission.py (who starts), sched/policy.py (the plan), batch.py (plan and claim to engine
calls), step_apply.py (a step's result to events), lifecycle.py, run_ahead.py; its
gauges are built in loop_gauges.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import outcome
import trio

from ..config import ServerConfig
from ..engine.base import BatchEntry, Engine, EngineError, Follow, StepResult, TokenArray
from ..observability.metrics import Metrics
from ..protocol.errors import ErrorCode, UmaError, too_long, too_many_tokens_asked
from ..protocol.messages import DEFAULT_MAX_TOKENS, CancelReason, ErrorEvent, FinishReason, TokenEvent
from ..sched.graph_shapes import ShapeStreak, plan_shape
from ..sched.kv_manager import Claim, KvManager, common_prefix
from ..sched.policy import Policy, default_policy
from ..sched.state import Lane, Plan, SchedulerState, SessionState, SkipReason
from .admission import (
    Capacity,
    InteractiveDemand,
    Reader,
    Waiting,
    client_of,
    follows,
    next_to_admit,
    spare_places,
)
from .arrivals import Arrivals
from .batch import batch_entries, set_up_sequence
from .clients import Clients
from .lifecycle import Phase
from .loop_gauges import kv_gauges, session_gauges
from .machine import MachineShare
from .run_ahead import AheadChain, RunAhead, ahead_budget
from .session import END_SLOTS, PinnedSequence, Session, StreamEnd, parks
from .step_apply import Embedded, Ended, Failed, Overran, Token, apply_step
from .tick_trace import TickTrace

log = logging.getLogger(__name__)

# A session parked (its reader behind) this long, while requests wait for a sequence, is
# cancelled as ``stalled`` (capped by --stall-timeout): a client reading every 24 s, under the
# 30 s stall timeout, otherwise held every session and kept another client queued for good.
PARKED_HOLD_S = 5.0

# A lone client's follow-up request waits this many passes of trio's scheduler, not
# burst_quiet_ms: each polls the sockets, so its connection's task reads and queues what
# else the client has already written (_gather_burst).
LONE_FOLLOW_UP_PASSES = 3

T = TypeVar("T")


class DecodeLoop:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: Metrics,
        clock: Callable[[], float] = trio.current_time,
        policy: Policy | None = None,
        sharing: MachineShare | None = None,
        clients: Clients | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        # With several models loaded: the machine they take turns on (sched/arbiter.py).
        self._sharing: MachineShare | None = None  # joined at the end, once the rest is set
        self._limited = False  # the tick in flight was granted inside another model's stream gap
        self._clock = clock
        self.kv = KvManager(
            engine.n_seq_max, engine.n_ctx, config.prefix_cache_cells, pack_ids=engine.splits_at_seq_gaps
        )
        self._jobs: list[Callable[[], Awaitable[None]]] = []
        self._unpin: list[int] = []
        self._copies_pending = False  # KV copies queued in llama.cpp until its next decode
        self._parked_since: dict[int, float] = {}  # seq id -> when its session was last seen to park
        self._waiting: deque[Session] = deque()
        self.arrivals = Arrivals()  # requests on their way in (_gather_burst waits for them)
        self.clients = clients if clients is not None else Clients()  # the daemon's open connections
        self._active: dict[int, Session] = {}
        self._aborted: list[Session] = []
        self._reserved_cells = 0
        self._wakeup = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self.idle_since = clock()  # when it last became idle (a model's keep-alive counts from it)
        self._accepting = True
        self._tick = 0
        self.policy = policy or default_policy(config)
        self.max_batch = min(config.n_batch, engine.n_batch)
        # Background sessions never hold the last seq ids (--interactive-reserve), nor those
        # interactive requests needed lately: a chat coming back after its think time finds one.
        self._interactive_demand = InteractiveDemand()
        self._state = SchedulerState(())
        # Why the last plan left each of its sessions out (metrics: in_flight[].held).
        self._skipped: tuple[tuple[int, SkipReason], ...] = ()
        # The shapes the engine ran, where it captures a step's graph (sched/graph_shapes.py).
        self._shapes = ShapeStreak() if engine.captures_graphs else None
        self._last_step_end: float | None = None  # None after the loop slept: no overhead to count
        # Run-ahead (run_ahead.py), on unless --no-run-ahead: a chain of background steps stays
        # preemptible to its end, so an arriving chat stops it as it would a planned step.
        self._may_run_ahead = config.run_ahead
        self._run_ahead = RunAhead()
        # While steps run ahead, KV cells are freed only once the compute thread is idle again.
        self._chain = AheadChain()
        self._trace = TickTrace(config.tick_trace) if config.tick_trace is not None else None
        if sharing is not None:
            self.join(sharing)

    # -- called from connection tasks (synchronous: they only record and wake) --

    def _overflow(self, session: Session) -> str:
        """Why ``session`` cannot fit the per-request context, naming what to cut."""
        n_ctx, prompt = self.engine.n_ctx_seq, len(session.prompt)
        room = f"exceeds the per-request context of {n_ctx} tokens"
        if session.request.embed:
            return too_long(f"the input to embed ({prompt} tokens) {room}")
        asked = session.request.max_tokens
        # A socket request that named none was told of a max_tokens it never sent.
        named = f"{asked}, the default" if asked == DEFAULT_MAX_TOKENS else f"{asked}"
        needs = f"prompt ({prompt} tokens) + max_tokens ({named}) {room}"
        if prompt < n_ctx:  # the prompt fits: what it asks to generate does not
            return too_many_tokens_asked(
                f"{needs}; at most {n_ctx - prompt} can follow this prompt: ask for that many or fewer"
            )
        return too_long(needs)

    @property
    def sharing(self) -> MachineShare | None:
        """Its part of the machine several models' loops take turns on (None: the only one)."""
        return self._sharing

    def join(self, sharing: MachineShare) -> None:
        """Take turns on the machine with other models' loops from now on: at start-up with
        several models in the store, or when a second model loads into a daemon that had one
        (a model pulled or copied in since: it had no turns and no guard across models)."""
        self._sharing = sharing
        sharing.arbiter.join(sharing.name, self._nudge, self._preempt)
        if any(s.lane == "interactive" for s in self._active.values()):  # streaming as it joins
            sharing.arbiter.wants(sharing.name, tick_s=self.policy.cost.last_s)

    def submit(self, session: Session) -> None:
        """Queue an accepted request, or raise :class:`UmaError` if the daemon is full."""
        if not self._accepting:
            raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down", request_id=session.id)
        if session.reserved_cells > self.engine.n_ctx_seq:
            raise UmaError(ErrorCode.CONTEXT_OVERFLOW, self._overflow(session), request_id=session.id)
        if self._queue_full(session):
            raise UmaError(
                ErrorCode.SERVER_BUSY,
                f"{len(self._active)} sessions running and {len(self._waiting)} queued; try again later",
                request_id=session.id,
            )
        self._waiting.append(session)
        if session.lane == "interactive":
            self._preempt()
            if self._sharing is not None:  # the other models' background work makes way too
                self._sharing.arbiter.wants(self._sharing.name)
        self.metrics.on_submitted(session.lane, len(session.prompt))
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self.wake()

    def _queue_full(self, session: Session) -> bool:
        """Waiting requests that free ids will take at the next tick are not queued yet; the
        rest may number at most max_queue, however many arrive within one tick.  An
        interactive request that can start at once still gets in past background ones.  A
        full queue still takes a request of a client with nothing waiting, up to a quarter
        of max_queue more (:func:`spare_places`): one app that fills the queue does not
        shut every other out."""
        limit = self.config.max_queue + self.kv.available_seqs()
        if len(self._waiting) < limit:
            return False
        past_background = session.lane == "interactive" and all(s.lane == "background" for s in self._waiting)
        if past_background and self._capacity().fits(self._waiting_view(session)):
            return False
        if len(self._waiting) < limit + spare_places(self.config.max_queue):
            client = client_of(session.owner, session.connection)
            return any(client_of(s.owner, s.connection) == client for s in self._waiting)
        return True

    def cancel(self, session: Session, reason: CancelReason) -> None:
        """Ask for ``session`` to end with ``eos(cancelled)``; idempotent."""
        if session.finished or session.abort is not None:
            return
        session.abort = reason
        self._aborted.append(session)
        if session.phase is not Phase.WAITING:
            self._preempt()  # it may be in the step now running
        self.wake()

    def set_lane(self, session: Session, lane: Lane) -> None:
        """Promote or demote a request; it takes effect from the next tick."""
        if session.lane != lane and not session.finished:
            session.lane = lane
            self.metrics.lane_changes += 1
            if lane == "interactive":
                self._preempt()
                if self._sharing is not None:
                    self._sharing.arbiter.wants(self._sharing.name)
            self.wake()

    def _preempt(self) -> None:
        """Stop the step now running if it carries no interactive session (Plan.preemptible):
        an interactive request should not wait for background work.  The engine knows whether
        the step in flight (or the chain it started) was started preemptible; else a no-op."""
        self.engine.preempt()

    def wake(self) -> None:
        self._run_ahead.stop()  # whatever woke the loop may change the next plan
        self._wakeup.set()

    @property
    def accepting(self) -> bool:
        """False once the daemon has started to shut down."""
        return self._accepting

    def stop_accepting(self) -> None:
        self._accepting = False

    def cancel_all(self, reason: CancelReason) -> None:
        for session in [*self._waiting, *self._active.values()]:
            self.cancel(session, reason)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """After this loop's task died (only it ends its sessions otherwise): end every
        waiting and running session with ``code``.  One whose own ending raises too (its
        bookkeeping is in doubt) still gets its error and its end, straight into its stream;
        then the loop is idle, so a drain does not wait for it."""
        sessions = [*self._waiting, *self._active.values()]
        self._waiting.clear()
        try:
            for session in sessions:
                try:
                    self._fail(session, code, message)
                except Exception:
                    log.exception("ending %s of a failed loop", session.id)
                    _end_stream(session, code, message)
        finally:
            self._active.clear()
            self._update_idle()

    async def wait_idle(self) -> None:
        """Return once no session is waiting or running."""
        await self._idle.wait()

    async def exclusive(self, job: Callable[[], Awaitable[T]]) -> T:
        """Run ``job`` on the decode task between two ticks, so nothing else touches the
        engine meanwhile; returns its result or raises its exception."""
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        async def run() -> None:
            try:  # Exception only: the decode task's own cancellation must stay its own
                result.append(outcome.Value(await job()))
            except Exception as exc:
                result.append(outcome.Error(exc))
            finally:
                done.set()

        self._jobs.append(run)
        self.wake()
        await done.wait()
        if not result:
            raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        return result[0].unwrap()

    def unpin(self, seq_id: int) -> None:
        """A snapshot of ``seq_id`` is written: its cached prefix may be evicted again."""
        self._unpin.append(seq_id)
        self.wake()

    async def restore(self, tokens: TokenArray, data: bytes, owner: str = "", name: str = "") -> None:
        """Load the saved sequence ``name`` into ``owner``'s part of the prefix cache (a job:
        run it through :meth:`exclusive`)."""
        budget = self.kv.budget_cells
        if budget is not None and len(tokens) > budget:
            raise UmaError(
                ErrorCode.SNAPSHOT_MISMATCH,
                f"snapshot {name!r} cannot be restored: it holds {len(tokens)} tokens and the prefix "
                f"cache may keep {budget} (--prefix-cache-cells)",
            )
        if self.kv.find(tokens, owner) is not None:
            return  # already cached
        claim = self.kv.claim_empty(cells_needed=len(tokens), cells_reserved=self._reserved_cells)
        if claim is None:
            raise UmaError(ErrorCode.SERVER_BUSY, "every KV sequence is in use; try again later")
        seq_id, evicted = claim
        self._free_cells(evicted)
        try:
            await self.engine.load_seq(seq_id, data)
            if self.engine.seq_cells(seq_id) != len(tokens):
                raise EngineError(
                    -1, f"the saved KV state holds {self.engine.seq_cells(seq_id)} cells, not {len(tokens)}"
                )
        except BaseException as exc:  # the id goes back whatever stopped the load
            self._free_cells(self.kv.release(seq_id, tokens[:0]))
            if isinstance(exc, EngineError):
                raise UmaError(ErrorCode.SNAPSHOT_INVALID, str(exc)) from None
            raise
        self._free_cells(self.kv.add(seq_id, tokens, owner))

    # -- the task ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self._trace is not None:
                self._trace.close()

    async def _run(self) -> None:
        while True:
            self._apply_aborts()
            await self._run_jobs()
            self._admit()
            self._release_parked()
            cap, beside = self._turn()
            if cap == 0.0:  # another model's streams decode: wait for a turn, or new work here
                self._skipped = tuple((seq_id, "share") for seq_id in self._active)
                self.engine.went_idle()
                await self._sleep()
                continue
            plan = self._plan(cap, beside)
            self._skipped = plan.skipped
            if not plan:
                if self._sharing is not None:
                    self._sharing.arbiter.quiet(self._sharing.name)
                if self._trace is not None:  # readable while the daemon runs (tail -f)
                    self._trace.flush(self._clock())
                self._update_idle()
                self._last_step_end = None
                self.engine.went_idle()
                if self._jobs and not (self._copies_pending and self._active):
                    continue  # _run_jobs left some for the next round: nothing runs between them now
                await self._sleep()
                await self._gather_burst()
                continue
            await self._run_plan(plan)
            self._tick += 1
            if not self.engine.step_frees_host:
                # The tokens just sent wake the connections' pumps; on a CPU they run now,
                # before the next step takes every core (run beside it, they would slow its
                # threads: 16 HTTP streams on 2 cores stretched gaps to 0.5 s).  On a GPU they
                # run while the next step computes, off the critical path between two decodes.
                await trio.lowlevel.checkpoint()

    async def _sleep(self) -> None:
        """Wait to be woken (or until a parked session has held its sequence too long while
        requests wait for one: :meth:`_release_parked`)."""
        deadline = math.inf
        if self._parked_since and self._waiting_for_room():
            # One already due was drained since (its next plan forgets it): no busy wait on it.
            now, hold = self._clock(), self._parked_hold_s()
            due = min((t + hold for t in self._parked_since.values() if t + hold > now), default=math.inf)
            deadline = trio.current_time() + (due - now)
        with trio.move_on_at(deadline):
            await self._wakeup.wait()
        self._wakeup = trio.Event()

    def _parked_hold_s(self) -> float:
        return min(self.config.stall_timeout_s, PARKED_HOLD_S)

    def _release_parked(self) -> None:
        """While requests wait for a sequence (admission just took every one it could), a
        session parked continuously for longer than :func:`_parked_hold_s` is cancelled as
        ``stalled``, and what waits is admitted in its place.  Its reader keeps the stall
        timeout's per-frame timer alive with a little progress now and then, and meanwhile
        holds a sequence and its KV; with nobody waiting it slows nobody and is left alone."""
        if not self._parked_since or not self._waiting_for_room():
            return
        now, hold = self._clock(), self._parked_hold_s()
        released = False
        for seq_id, since in list(self._parked_since.items()):
            session = self._active.get(seq_id)
            if session is None or now - since < hold or not self._channel_full(session):
                continue
            log.warning(
                "%s parked for %.1f s while %d requests wait; cancelling it as stalled",
                session.id, now - since, len(self._waiting),
            )  # fmt: skip
            self.cancel(session, "stalled")
            released = True
        if released:
            self._apply_aborts()
            self._admit()

    async def _gather_burst(self) -> None:
        """Woken from idle: give requests arriving together a moment to arrive, so they
        share the first tick.  The first of a burst would otherwise start alone, and every
        other one join only at the pace a decoding stream allows: on the H100 four streams
        started over 200 ms.  Waits ``burst_quiet_ms`` after the first arrival, twice that
        after each later one (a burst is forming: a Python HTTP client sends its requests
        0.3-2 ms apart), and while other requests are on their way in (:attr:`arrivals`:
        connecting, being read or tokenized; on a busy CPU an HTTP server takes 5 ms a
        request), at most ``burst_max_ms`` in all; a lone request pays ``burst_quiet_ms``.
        A request from a client sending one request after another on the only connection
        open (runtime/clients.py) waits only ``LONE_FOLLOW_UP_PASSES`` scheduler passes,
        enough for that connection's task to read what else the client has already written
        to it: no other connection can be part of a burst then, and a burst on that one
        shows as more requests waiting, which gets the whole wait."""
        quiet, longest = self.config.burst_quiet_ms / 1000.0, self.config.burst_max_ms / 1000.0
        if quiet <= 0 or not self._waiting:
            return
        deadline = self._clock() + longest
        seen = len(self._waiting)
        if seen == 1 and not self.arrivals.count and self.clients.lone_follow_up():
            # Scheduler passes, not a sleep: epoll's timeout counts whole milliseconds.
            for _ in range(LONE_FOLLOW_UP_PASSES):
                await trio.lowlevel.checkpoint()
            if len(self._waiting) == seen and not self.arrivals.count:
                return
            seen = len(self._waiting)  # a burst after all: it gets the whole wait
        while (left := deadline - self._clock()) > 0:
            await trio.sleep(min(quiet if seen == 1 else 2 * quiet, left))
            if len(self._waiting) == seen and not self.arrivals.count:
                return
            seen = len(self._waiting)

    def _turn(self) -> tuple[float | None, float]:
        """The longest tick this model may take now, beside the other models' streams (None:
        no limit; 0.0: wait for a turn), and, with interactive work here, what the other
        models' stream ticks add to every gap (SchedulerState.beside_s)."""
        if self._sharing is None or not self._active:
            return None, 0.0
        interactive = any(s.lane == "interactive" for s in (*self._active.values(), *self._waiting))
        if interactive:
            self._limited = False
            return None, self._sharing.arbiter.beside(self._sharing.name)
        self._sharing.arbiter.quiet(self._sharing.name)
        # The cheapest step this loop can take (priced only where a grant weighs it): one
        # token at the shortest context it holds.
        smallest = self.policy.cost.predict(1, 0, min((s.n_past for s in self._active.values()), default=0))
        cap = self._sharing.arbiter.grant(self._sharing.name, interactive=False, smallest_s=smallest)
        self._limited = cap is not None and cap > 0
        return cap, 0.0

    def _nudge(self) -> None:
        """Another model's tick ended: this loop's turn may have come."""
        self._wakeup.set()

    async def _run_plan(self, plan: Plan) -> None:
        if self._sharing is None:
            await self._run_plan_alone(plan)
            return
        async with self._sharing.machine:  # the models' steps take turns
            last = self._sharing.last
            if last.model not in (None, self._sharing.name):
                # Another model stepped since this loop's last step: until its step ended the
                # machine was busy, not this loop's overhead (the engine idle share and the
                # engine's step gap read ~50 % with two models streaming).
                if self._last_step_end is not None and last.end is not None:
                    self._last_step_end = max(self._last_step_end, last.end)
                self.engine.went_idle()
            await self._run_plan_alone(plan)
            last.model, last.end = self._sharing.name, self._clock()

    async def _run_plan_alone(self, plan: Plan) -> None:
        entries = batch_entries(plan, self._active)
        whole = True
        try:
            try:
                follow = self._arm_run_ahead(plan)
                hold = follow is not None and self._unwatched(plan)
                result = await self.engine.step(entries, follow, preemptible=plan.preemptible, hold=hold)
            except EngineError as exc:
                if exc.preempted:  # undone by the engine: plan again, with the newcomer
                    self._was_preempted()
                    return
                if not exc.rejected:
                    raise
                whole = False
                result = await self._step_apart(entries, exc)
        except Exception as exc:  # the context is in doubt: only a fresh one can be trusted
            await self._lose_context(exc)
            return
        self._chain.live = self.engine.running_ahead
        self._absorb(plan, result, whole)
        if not self._chain.live:
            return
        held = result.held_s > 0
        # Steps the compute thread ran ahead (run_ahead.py), collected one behind it.
        try:
            while self.engine.running_ahead:
                try:
                    ahead, result = await self.engine.next_ahead()
                except EngineError as exc:
                    if exc.rejected:  # llama.cpp ran none of it: the next plan feeds the same
                        break  # tokens again, and a planned step refused is retried apart
                    if not exc.preempted:
                        raise
                    # Undone, like a planned step: the steps before it stand, delivered.
                    self._was_preempted()
                    break
                self._tick += 1
                self._chain.steps += 1
                ran = replace(
                    plan, decode=tuple(e.seq_id for e in ahead), kv_cells=sum(e.pos0 for e in ahead)
                )
                self._absorb(ran, result, whole=True, ahead=True)
                held = held or result.held_s > 0
        except Exception as exc:
            await self._lose_context(exc)
            return
        self._end_run_ahead()
        if held:
            await self._let_writers_drain()

    async def _let_writers_drain(self) -> None:
        """Results that came back together put a whole chain's tokens in the stream buffers
        at once; the next plan's run-ahead budgets are what those buffers have room for, so
        let the writers take them first (they take all that is queued in one go,
        runtime/delivery.py), or the next chain would be a step or two long."""
        for _ in range(3):  # trio may run the woken writers before or after this task
            if not any(s.events.statistics().current_buffer_used for s in self._active.values()):
                return
            await trio.lowlevel.checkpoint()

    def _was_preempted(self) -> None:
        """A step was stopped for an arriving interactive request: the next plan has it."""
        self._run_ahead.stop()
        self.policy.preempted()
        self._last_step_end = self._clock()

    def _absorb(self, plan: Plan, result: StepResult, whole: bool, *, ahead: bool = False) -> None:
        """Book one step's work (planned, or run ahead by the compute thread) and deliver its
        tokens."""
        self._copies_pending = False  # the step made them
        if whole:  # a batch run in parts says nothing about the cost of the plan
            self.policy.observe(plan, self._state, result.decode_s)
        if self._shapes is not None:  # a batch run in parts ran other shapes: start over
            ran = plan_shape(plan.decode, plan.prefill, self._state.sessions) if whole else (0, 0)
            self._shapes.record(ran)
        # Sessions failed above are gone from _active; the rest ran.
        now = self._clock()
        generated = 0
        for event in apply_step(plan, result, self._active, tick=self._tick, now=now):
            match event:
                case Token(session=session):
                    generated += 1
                    self.metrics.on_generated(session.lane)
                    if not session.request.stream:  # a stream's are taken as its connection writes
                        self.metrics.on_token_latency(
                            session.lane, now, ttft_s=event.ttft_s, gap_s=event.gap_s
                        )
                    self._emit(session, event.text, event.token_id)
                case Ended(session=session, reason=reason):
                    self._finish(session, reason)
                case Embedded(session=session):  # its cells hold no answer worth caching
                    self._finish(session, "stop", keep_kv=False)
                case Failed(session=session, message=message):
                    self._fail(session, ErrorCode.SAMPLING_FAILED, message)
                case Overran(seq_id=seq_id):  # ended while the step ran ahead: trim its cell
                    self._chain.overran(seq_id)
        # Overhead: wall time since the previous step ended, less this step's own time.  A
        # result the engine held (run-ahead's background chains) ended that much earlier.
        ended = now - result.held_s
        since = ended - self._last_step_end if self._last_step_end is not None else result.decode_s
        if self._sharing is not None:
            limited, self._limited = self._limited and not ahead, False
            self._sharing.arbiter.ran(
                self._sharing.name, streams=plan.cap_s > 0, seconds=result.decode_s, limited=limited
            )
        self.metrics.on_tick(
            now, step_s=result.decode_s, overhead_s=max(0.0, since - result.decode_s),
            decode_tokens=len(plan.decode), prefill_tokens=plan.prefill_tokens, generated=generated,
            bmt_bytes=plan.bmt_bytes, cap_s=plan.cap_s,
        )  # fmt: skip
        self._last_step_end = ended
        if self._trace is not None:
            step_s, waiting = result.decode_s, len(self._waiting)
            self._trace.write(t=now, tick=self._tick, plan=plan, step_s=step_s, ahead=ahead, waiting=waiting)

    def _arm_run_ahead(self, plan: Plan) -> Follow | None:
        """Let the compute thread run on after this step when the next plan is sure to be the
        same decoders again: nothing else is pending, and nothing is left out but background
        work the plan stands for (Plan.stands_for), for that many steps.  A queued request
        does not stop it: :meth:`_admit` just took every one it could, and only a session
        ending (which stops the chain) or an arrival (which wakes the loop) frees room for
        the rest.  (The one other change, interactive demand leaving the window of
        :class:`.InteractiveDemand`, waits at most MAX_AHEAD steps.)  Never on a tick granted
        inside another model's gap (``_limited``): the grant is one step's time, and a chain
        would hold the machine for its whole length."""
        leaves_out = len(plan.decode) < len(self._active)
        steady = (
            self._may_run_ahead and not self._limited and plan.decode and not plan.prefill and not plan.rescue
            and not self._aborted and not self._jobs and not self._unpin
            and (not leaves_out or self._only_background_waits(plan))
        )  # fmt: skip
        if not steady:
            return None
        # Background work left out waits no longer than the policy would have it wait.
        limit = plan.stands_for if leaves_out else None
        budgets = {}
        for seq_id in plan.decode:
            session = self._active[seq_id]
            room = self._buffer_room(session)
            budget = ahead_budget(session.request.max_tokens, session.generated, room)
            budgets[seq_id] = budget if limit is None else min(budget, limit)
        # A session leaving may make room for what waits: then the next plan is due at once.
        self._run_ahead.arm(budgets, stop_when_one_leaves=limit is not None or bool(self._waiting))
        return self._run_ahead.follow if self._run_ahead.steady else None

    def _unwatched(self, plan: Plan) -> bool:
        """Nobody watches ``plan``'s tokens one by one: every decoder is background work,
        whose gaps no guard holds, so a chain's results may come back together
        (engine/held_results.py)."""
        return all(self._active[seq_id].lane == "background" for seq_id in plan.decode)

    def _only_background_waits(self, plan: Plan) -> bool:
        """The sessions ``plan`` leaves out are background work it stands for (Plan.stands_for)."""
        if plan.stands_for <= 0:
            return False
        decoding = set(plan.decode)
        return all(s.lane == "background" for seq_id, s in self._active.items() if seq_id not in decoding)

    def _end_run_ahead(self) -> None:
        """The compute thread is idle again: trim what ran past a session's end, free what
        finished meanwhile."""
        self._run_ahead.stop()
        trims, freed = self._chain.end()
        for seq_id, keep in trims.items():
            try:
                if keep is None:
                    raise EngineError(-1, f"seq {seq_id} ran ahead with no known end")
                self.engine.trim_seq(seq_id, keep)
            except EngineError as exc:  # cannot trim (a recurrent model): its cached prefix is in doubt
                log.warning("dropping the cached prefix of seq %d: %s", seq_id, exc)
                freed.extend(self.kv.drop(seq_id))
        self._free_cells(freed)

    async def _lose_context(self, exc: Exception) -> None:
        self._run_ahead.stop()
        while self.engine.running_ahead:  # let queued steps finish before the rebuild
            with contextlib.suppress(Exception):  # the context is being replaced anyway
                await self.engine.next_ahead()
        self._end_run_ahead()
        self._last_step_end = None
        await self._rebuild_context(exc)

    # -- steps of the loop ---------------------------------------------------------

    def _apply_aborts(self) -> None:
        aborted, self._aborted = self._aborted, []
        for session in aborted:
            if session.finished:
                continue
            if session.phase is Phase.WAITING:
                self._waiting.remove(session)
            self._finish(session, "cancelled", cancel_reason=session.abort or "client")

    async def _run_jobs(self) -> None:
        for seq_id in self._unpin:
            self._free_cells(self.kv.unpin(seq_id))
        self._unpin.clear()
        if self._copies_pending and self._active:  # after the step that makes the copies
            return
        # One job a round while sessions run, so every stream gets a tick between two (a save
        # of a 3,490-token prompt takes ~0.35 s: four back to back froze the streams 1.3 s);
        # all of them when nothing else runs.
        take = 1 if self._active else len(self._jobs)
        jobs, self._jobs = self._jobs[:take], self._jobs[take:]
        for job in jobs:
            await job()
        if jobs:  # a request cancelled while a job was awaited must not be admitted next
            self._apply_aborts()

    def _free_cells(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        if self._chain.defer(seq_ids):  # the compute thread may be decoding: the context is its alone
            return
        for seq_id in seq_ids:
            self.engine.free_seq(seq_id)

    def _capacity(self) -> Capacity:
        # Cached prefixes yield their ids and cells to requests; only pinned ones stay.
        running: dict[str, int] = {}
        for s in self._active.values():
            client = client_of(s.owner, s.connection)
            running[client] = running.get(client, 0) + 1
        return Capacity(
            available_seqs=self.kv.available_seqs(),
            room_cells=self.engine.n_ctx - self.kv.pinned_cells,
            reserved_cells=self._reserved_cells,
            background_running=sum(s.lane == "background" for s in self._active.values()),
            background_cap=self._background_seq_cap(),
            running=running,
        )

    def _background_seq_cap(self) -> int:
        now = self._note_interactive_demand()
        kept = max(self.config.interactive_reserve, self._interactive_demand.peak(now))
        return max(1, self.engine.n_seq_max - kept)

    def _note_interactive_demand(self) -> float:
        """Record how many interactive requests run or wait now (every round); returns now."""
        now = self._clock()
        interactive = sum(s.lane == "interactive" for s in (*self._active.values(), *self._waiting))
        self._interactive_demand.note(now, interactive)
        return now

    def _next_admittable(self) -> Session | None:
        """The request :func:`.admission.next_to_admit` picks, if any, among those not waiting
        for a running request to read the prompt prefix they share (:func:`.admission.follows`)."""
        readers = self._readers()
        free = [s for s in self._waiting if not self._follows(s, readers)] if readers else self._waiting
        index = next_to_admit([self._waiting_view(s) for s in free], self._capacity())
        return None if index is None else free[index]

    def _waiting_for_room(self) -> bool:
        """Requests wait for a sequence or cells, not only for a reader of their prefix (whose
        wait no parked session's cancelling would shorten)."""
        readers = self._readers()
        return any(not self._follows(s, readers) for s in self._waiting)

    def _readers(self) -> dict[str, list[Reader]]:
        """Per principal, its running requests still reading a prompt whose prefix a waiting
        request of its may copy (none with the prefix cache off)."""
        by_owner: dict[str, list[Reader]] = {}
        if self.kv.enabled:
            for s in self._active.values():
                if s.phase is Phase.PREFILL and s.pool is None:
                    by_owner.setdefault(s.owner, []).append(Reader(s.lane, s.prompt, s.n_past))
        return by_owner

    def _follows(self, session: Session, readers: dict[str, list[Reader]]) -> bool:
        mine = readers.get(session.owner, [])
        if not mine or session.pool is not None:  # an embedding starts empty: it copies nothing
            return False
        return follows(session.prompt, session.lane, mine, self.kv.min_reuse)

    @staticmethod
    def _waiting_view(session: Session) -> Waiting:
        return Waiting(session.lane, session.reserved_cells, client_of(session.owner, session.connection))

    def _admit(self) -> None:
        if not self._waiting:  # the steady decode's round: nothing to admit
            self._note_interactive_demand()
            return
        # What running sequences hold, and whose they are: built once a round.
        running: dict[int, tuple[str, TokenArray]] | None = None
        # While interactive streams decode, one stream copy a round (_may_copy).
        one_copy, copied = self._streams_decoding(), False
        while (session := self._next_admittable()) is not None:
            if running is None:
                active = self._active.items() if self.kv.enabled else ()
                running = {seq: (s.owner, s.kv_tokens()) for seq, s in active}
            needed, reserved = session.reserved_cells, self._reserved_cells
            mine = {seq: tokens for seq, (owner, tokens) in running.items() if owner == session.owner}
            if one_copy and copied and self._may_copy(session, mine):
                break  # the next round's, one tick later: it is oldest, the rest wait behind it
            claim = self.kv.claim(
                session.prompt, mine, cells_needed=needed, cells_reserved=reserved, owner=session.owner,
                reuse=session.pool is None,
            )  # fmt: skip
            if claim is None:  # pragma: no cover - admission said there was room
                break
            copied = copied or (claim.source is not None and not claim.adopted)
            self._waiting.remove(session)
            session.seq_id = claim.seq_id
            session.n_past = session.cached_tokens = self._set_up_sequence(claim)
            session.move_to(Phase.PREFILL)
            session.admitted = self._clock()
            session.admitted_tick = self._tick
            self.metrics.on_admitted(session.lane, session.admitted - session.created, session.admitted)
            self._reserved_cells += session.reserved_cells
            self._active[session.seq_id] = session
            if self.kv.enabled:  # a source for the rest of this round too
                running[session.seq_id] = (session.owner, session.kv_tokens())

    def _streams_decoding(self) -> bool:
        """Interactive sessions will decode this round (so a request left waiting by
        :meth:`_admit` gets the next round a tick later, not after the loop sleeps)."""
        return any(
            s.lane == "interactive" and s.phase is Phase.DECODE and not self._channel_full(s)
            for s in self._active.values()
        )

    def _may_copy(self, session: Session, mine: dict[int, TokenArray]) -> bool:
        """Whether ``session``'s claim may copy a cached or running prefix into its sequence:
        llama.cpp then copies the whole KV stream at the start of the next step, which every
        decoding stream waits for (six at once stretched a chat's tick to 124 ms), and the cost
        model does not price it.  So while interactive streams decode, :meth:`_admit` takes one
        such request a round.  (Over-cautious: it may turn out adopted, which copies nothing,
        and then waits a tick for nothing.)"""
        if not self.kv.enabled or session.pool is not None:
            return False
        limit = len(session.prompt) - 1
        sources = [*mine.values(), *self.kv.cached().values()]
        return any(min(common_prefix(t, session.prompt), limit) >= self.kv.min_reuse for t in sources)

    def _set_up_sequence(self, claim: Claim) -> int:
        if claim.moved is not None or (claim.source is not None and not claim.adopted):
            # llama.cpp copies between KV streams at its next decode, from what the source
            # holds then: a snapshot restored before it (into a source just evicted, or a
            # move's destination) would be copied instead.  Jobs wait for that step.
            self._copies_pending = True
        reused, evicted = set_up_sequence(self.engine, claim)
        self._free_cells(evicted)
        return reused

    def _plan(self, cap_s: float | None = None, beside_s: float = 0.0) -> Plan:
        now = self._clock()
        views = []
        for seq_id, session in self._active.items():
            session.parked = self._channel_full(session)
            if session.parked:
                self._parked_since.setdefault(seq_id, now)
            else:
                self._parked_since.pop(seq_id, None)
            views.append(
                SessionState(
                    key=seq_id,
                    lane=session.lane,
                    prompt_remaining=session.prompt_remaining,
                    n_past=session.n_past,
                    age_s=now - (session.admitted or now),
                    since_last_token_s=None if session.last_token is None else now - session.last_token,
                    ticks_waiting=self._tick - max(session.last_served_tick, session.admitted_tick),
                    parked=session.parked,
                )
            )
        self._state = SchedulerState(
            tuple(views), tick=self._tick, max_batch=self.max_batch, micro_batch=self.config.engine_n_ubatch,
            preemptible=self.engine.can_preempt, foreign_cap_s=cap_s, beside_s=beside_s,
            capture_shape=self._shapes.capturing() if self._shapes is not None else None,
        )  # fmt: skip
        return self.policy.plan(self._state)

    @staticmethod
    def _channel_full(session: Session) -> bool:
        """Room for a token and its end-of-stream tail, or the session sits out."""
        if not session.request.stream:
            return False
        stats = session.events.statistics()
        return parks(int(stats.current_buffer_used), int(stats.max_buffer_size))

    @staticmethod
    def _buffer_room(session: Session) -> int | None:
        """Events the session's stream buffer can still take (None: not streamed)."""
        if not session.request.stream:
            return None
        stats = session.events.statistics()
        return int(stats.max_buffer_size - stats.current_buffer_used) - END_SLOTS

    def _emit(self, session: Session, text: str, token_id: int) -> None:
        if not text:
            return
        if not session.request.stream or session.tool_format is not None:
            session.pieces.append(text)  # the whole text: the eos carries it, or its tool calls
        if not session.request.stream:
            session.keep_logprobs()
            return
        try:
            event = TokenEvent(id=session.id, text=text, token_id=token_id, logprobs=session.take_logprobs())
            session.events.send_nowait(event)
        except trio.BrokenResourceError:
            # The connection is gone; its cancel arrives through `cancel()` as well.
            self.cancel(session, "disconnect")
        except trio.WouldBlock:  # pragma: no cover - _channel_full keeps room
            log.error("stream buffer of %s overflowed; token text dropped", session.id)

    async def _step_apart(self, entries: list[BatchEntry], exc: EngineError) -> StepResult:
        """llama.cpp refused the batch without running any of it: run each sequence's entry
        alone, so only the requests it refuses again fail.  Batch invariance keeps everyone
        else's tokens what they would have been."""
        log.warning("decode refused a batch of %d sequences (%s); retrying each alone", len(entries), exc)
        result = StepResult([], 0, 0.0)
        for entry in entries:
            try:
                result += await self.engine.step([entry])
            except EngineError as alone:
                if not alone.rejected:
                    raise
                code = ErrorCode.KV_FULL if alone.kv_full else ErrorCode.DECODE_FAILED
                self._fail(self._active[entry.seq_id], code, f"decode failed: {alone}")
        return result

    async def _rebuild_context(self, exc: Exception) -> None:
        """A decode failed after part of it ran (or in a way nobody expected): every running
        request fails, the cache forgets every prefix, and a fresh context replaces the old
        one.  Waiting requests are untouched and start on the new context."""
        running = list(self._active.values())
        log.error("the context failed (%r); failing %d running requests and rebuilding it", exc, len(running))
        for session in running:
            self._fail(session, ErrorCode.CONTEXT_LOST, f"the model context failed ({exc}); retry")
        self.kv.forget_cached()
        await self.engine.rebuild()
        self.metrics.context_rebuilds += 1
        log.info("context rebuilt; serving again")

    def _fail(self, session: Session, code: ErrorCode, message: str) -> None:
        """End ``session`` with an error event; its KV cells are dropped, not cached.  One
        already cancelled ends as that (its client asked first)."""
        if session.abort is not None:
            self._finish(session, "cancelled", cancel_reason=session.abort, keep_kv=False)
            return
        session.error = ErrorEvent(id=session.id, code=code, message=message)
        self.metrics.on_error(code)
        self._finish(session, "error")

    def _finish(
        self,
        session: Session,
        reason: FinishReason,
        *,
        cancel_reason: CancelReason | None = None,
        keep_kv: bool = True,
    ) -> None:
        if reason in ("stop", "length"):
            self._emit(session, session.text.flush(), session.last_token_id)
        self._run_ahead.stop()  # the next plan differs
        pinned = None
        if session.seq_id is not None:
            self._chain.session_ended(session.seq_id, session.n_past)
            self._parked_since.pop(session.seq_id, None)
            # Its KV stays cached for later requests sharing the prefix, unless a failure
            # left it in doubt.
            held = session.kv_tokens() if keep_kv and reason != "error" else session.prompt[:0]
            del self._active[session.seq_id]
            if session.pins_on(reason):  # a snapshot's fill: its reader copies the cells out
                pinned = PinnedSequence(session.seq_id, session.n_past, session.prompt)
            release = self.kv.release(
                session.seq_id, held, pin=pinned is not None, owner=session.owner,
                prompt_len=len(session.prompt),
            )  # fmt: skip
            self._free_cells(release)
            self._reserved_cells -= session.reserved_cells
        now = self._clock()
        session.move_to(Phase.DONE)
        session.pending_token = None
        session.final = session.eos_event(reason, cancel_reason)  # timed as the pump writes it
        end = StreamEnd(
            session.final, session.error, admitted=session.admitted, generated=session.generated,
            generated_at=session.generated_at, pinned=pinned,
        )  # fmt: skip
        try:
            session.events.send_nowait(end)
        except trio.BrokenResourceError:  # nobody is reading any more
            if pinned is not None:  # nor will anybody copy the cells out
                self._unpin.append(pinned.seq_id)
        except trio.WouldBlock:  # pragma: no cover - the END_SLOTS room is kept
            log.error("no room for the end of %s's stream", session.id)
        session.events.close()
        self.metrics.on_finished(
            session.lane, reason, now, computed_tokens=session.computed_tokens, cancel_reason=cancel_reason,
            embed=session.request.embed,
        )  # fmt: skip

    def _update_idle(self) -> None:
        if not self._waiting and not self._active and not self._idle.is_set():
            self._idle.set()
            self.idle_since = self._clock()

    @property
    def idle(self) -> bool:
        """Nothing waiting or running (since :attr:`idle_since`)."""
        return self._idle.is_set()

    # -- observability -----------------------------------------------------------

    @property
    def kv_cells_used(self) -> int:
        """KV cells the running requests hold: each holds exactly its ``n_past`` cells (read
        from the loop's own bookkeeping, not llama.cpp, which a step may be writing)."""
        return sum(s.n_past for s in self._active.values())

    def gauges(self) -> dict[str, Any]:
        engine = self.engine
        kv = kv_gauges(
            self.kv, cells_total=engine.n_ctx, cells_per_seq=engine.n_ctx_seq, cells_used=self.kv_cells_used,
            cells_reserved=self._reserved_cells, seqs_total=engine.n_seq_max, kv_type=engine.kv_type,
        )  # fmt: skip
        return {
            **session_gauges(
                list(self._active.values()),
                list(self._waiting),
                self._clock(),
                self.policy.cost.ewma_s,
                held=dict(self._skipped),
            ),
            "scheduler": self.policy.snapshot(),
            "run_ahead": {
                "enabled": self._may_run_ahead,
                "steps": self._chain.steps,
                "dropped_tokens": self._chain.dropped,
            },
            **kv,
        }


def _end_stream(session: Session, code: ErrorCode, message: str) -> None:
    """``session``'s error and end, sent without the loop's bookkeeping (which failed)."""
    if session.finished:
        return
    try:
        session.error = ErrorEvent(id=session.id, code=code, message=message)
        session.final = session.eos_event("error", None)
        with contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):  # END_SLOTS keeps room
            session.events.send_nowait(StreamEnd(session.final, session.error))
    except Exception:  # its client at least sees its stream end
        log.exception("ending %s", session.id)
    finally:
        session.events.close()
