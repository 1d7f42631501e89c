"""The models a daemon serves, loaded and unloaded while it runs.

The primary model (``--model``) is the server's own: loaded at start-up, decoded by the
server's decode loop, never unloaded.  Every other model of the store (model_store.py) is a
:class:`ModelUnit` loaded when a request first names it: its own engine (a context over its
own weights) and its own :class:`~.decode_loop.DecodeLoop`, run in this host's nursery under
a cancel scope of its own, so unloading it is cancelling that scope and freeing the engine.
Only the request that needs a model waits for it to load; everybody else goes on.

A unit goes when it has been idle (nothing waiting or running) for its keep-alive (Ollama's
semantics: ``keep_alive`` seconds of the last request that named it, ``--keep-alive`` by
default, 0 for "unload after this request", negative for "never"), or when a request needs
room for another model and at most ``--max-loaded`` may be loaded: the least recently used
idle unit goes first, and a unit with requests in flight never goes.  A unit being freed
still counts against both limits until its engine is.

Over 400 lines: the host is one state machine (loading, serving, freeing, and the limits
that tie them together) whose races are easier to read in one place than split apart.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from ..config import ServerConfig
from ..engine.base import Engine
from ..model_store import ModelStore, StoreEntry
from ..observability.metrics import Metrics
from ..protocol.errors import ErrorCode, UmaError
from ..sched.policy import Policy
from .clients import Clients
from .decode_loop import DecodeLoop
from .machine import Machine

log = logging.getLogger(__name__)

# A load that needs room while every loaded model is busy waits this long for one to go idle
# (checked this often), then is refused with E_LIMIT_004.
ROOM_WAIT_S = 60.0
ROOM_POLL_S = 0.05

REAP_EVERY_S = 0.5  # how often idle units are checked against their keep-alive


@dataclass(frozen=True)
class LoadedModel:
    """What a loader hands back: the engine, its policy and how to free it all."""

    engine: Engine
    policy: Policy | None = None
    close: Callable[[], None] = lambda: None
    describe: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Loading:
    """How models are loaded and how much memory they may take.  ``load`` and ``footprint``
    block (they run in a worker thread); ``load`` raises on a bad file."""

    load: Callable[[StoreEntry], LoadedModel]
    footprint: Callable[[StoreEntry], int] = lambda entry: entry.size  # weights + KV cache bytes
    budget_bytes: int | None = None  # what the loaded models may take together (None: no limit)
    primary_bytes: int = 0  # what --model's model takes of it


@dataclass(eq=False)
class ModelUnit:
    """A loaded model other than the primary one."""

    id: str
    loaded: LoadedModel
    loop: DecodeLoop
    keep_alive_s: float
    last_used: float
    footprint: int = 0  # bytes of weights and KV cache, counted against --memory-budget
    pending: int = 0  # requests handed this unit and not yet in its loop's queue
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def engine(self) -> Engine:
        return self.loaded.engine

    def expired(self, now: float) -> bool:
        """Idle for its whole keep-alive."""
        idle = self.loop.idle and not self.pending
        return idle and now >= max(self.loop.idle_since, self.last_used) + self.keep_alive_s


class ModelHost:
    """The store's models other than the primary one, loaded on demand (module doc)."""

    def __init__(
        self,
        store: ModelStore,
        loading: Loading | None,
        config: ServerConfig,
        metrics: Metrics,
        clock: Callable[[], float] = trio.current_time,
        machine: Machine | None = None,
        clients: Clients | None = None,
    ) -> None:
        self.store = store
        self._machine = machine  # the turns every model's steps take (runtime/machine.py)
        self._clients = clients  # the daemon's open connections, for every model's loop
        self.loading = loading
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self.units: dict[str, ModelUnit] = {}
        self._loading: dict[str, trio.Lock] = {}
        # Requests waiting for their model to be loaded, by model id: they hold no session
        # yet, and a router must still see them queued (docs/FLEET.md).
        self.awaiting_load: dict[str, int] = {}
        # Loads of different models take turns: each makes room counting the ones loaded
        # before it (two at once both saw room for one and overshot --max-loaded / the budget).
        self._room = trio.Lock()
        # Units whose engine a worker thread is freeing: their memory is not free until it has.
        self._closing: set[ModelUnit] = set()
        self._closed = trio.Event()  # set (and replaced) each time one of them is freed
        # keep_alive 0 asked of a model while it loads, by id: applied once it has.
        self._keep_after_load: dict[str, float] = {}
        # False once the daemon drains (runtime/server.py): a unit whose load ends later takes
        # no request, which is then refused as every other is at shutdown.
        self.accepting = True
        self._nursery: trio.Nursery | None = None
        self.loads = self.unloads = 0
        self.primary_loop: DecodeLoop | None = None  # --model's, the server's own: for describe

    # -- the request path --------------------------------------------------------------

    def resolve(self, name: str | None) -> str:
        """The id a request's ``model`` names; E_MODEL_002 naming the store's ids if none."""
        model_id = self.store.resolve(name, loaded=self.units)
        if model_id is None:  # copied or pulled into the directory since?
            self.store = self.store.rescanned(loaded=self.units)
            model_id = self.store.resolve(name, loaded=self.units)
        if model_id is None:
            available = ", ".join(self.store.offered())
            message = f"model {name!r} is not here; this daemon has {available}"
            raise UmaError(ErrorCode.MODEL_NOT_FOUND, message)
        return model_id

    async def acquire(self, model_id: str, keep_alive_s: float | None = None) -> ModelUnit:
        """The unit of ``model_id`` (not the primary), loaded first if need be; marks it used
        and sets its keep-alive (``keep_alive_s``, negative: for good).  The unit stays
        until :meth:`release`, which the caller owes once the request is in its loop."""
        lock = self._loading.setdefault(model_id, trio.Lock())
        self.awaiting_load[model_id] = self.awaiting_load.get(model_id, 0) + 1
        asked_meanwhile = None
        try:
            async with lock:  # a second request for a model being loaded waits for that load
                if (unit := self.units.get(model_id)) is None:
                    try:
                        unit = await self._load(model_id)
                    finally:  # a keep_alive 0 that came during this load: it is the later word
                        asked_meanwhile = self._keep_after_load.pop(model_id, None)
        finally:
            if (left := self.awaiting_load[model_id] - 1) > 0:
                self.awaiting_load[model_id] = left
            else:
                del self.awaiting_load[model_id]
        unit.pending += 1
        unit.last_used = self._clock()
        for keep in (keep_alive_s, asked_meanwhile):
            if keep is not None:
                unit.keep_alive_s = math.inf if keep < 0 else keep
        return unit

    def release(self, unit: ModelUnit) -> None:
        unit.pending -= 1
        unit.last_used = self._clock()

    def state(self, model_id: str) -> str:
        """``loaded``, ``loading`` or ``unloaded`` (the primary is always loaded)."""
        if self.store.entry(model_id).primary or model_id in self.units:
            return "loaded"
        lock = self._loading.get(model_id)
        return "loading" if lock is not None and lock.locked() else "unloaded"

    def describe(self) -> list[dict[str, Any]]:
        """Every model of the store and its state (metrics, /v1/models, /api/tags, /api/ps, the
        socket's ``models``): the directory is read again first, so a model pulled or copied in
        since is listed (a picker filled from the list could not name it otherwise) and one
        deleted since is not."""
        self.store = self.store.rescanned(loaded=self.units)
        now, described = self._clock(), []
        for entry in self.store.entries():
            unit = self.units.get(entry.id)
            loop = unit.loop if unit is not None else self.primary_loop if entry.primary else None
            item: dict[str, Any] = {
                "id": entry.id, "state": self.state(entry.id), "primary": entry.primary,
                "file": entry.path.name, "bytes": entry.size, "aliases": list(entry.aliases),
                # A loaded model's engine says what a request may hold (all the cells, with
                # --kv-unified); before, every model gets --n-ctx.  Each serves both kinds.
                "context_length": loop.engine.n_ctx_seq if loop is not None else self._config.n_ctx,
                "capabilities": ["completion", "embedding"],
            }  # fmt: skip
            if unit is not None:
                item["footprint_bytes"] = unit.footprint
                item["keep_alive_s"] = None if math.isinf(unit.keep_alive_s) else unit.keep_alive_s
                item["busy"] = not unit.loop.idle or unit.pending > 0
                item["idle_s"] = round(now - max(unit.loop.idle_since, unit.last_used), 3)
            elif entry.primary and self.primary_loop is not None:  # loaded for good
                item["keep_alive_s"] = None
                item["busy"] = not self.primary_loop.idle
                item["idle_s"] = 0.0 if item["busy"] else round(now - self.primary_loop.idle_since, 3)
            described.append(item)
        return described

    def units_gauges(self) -> dict[str, dict[str, Any]]:
        """Each loaded unit's decode-loop gauges (sessions, in flight, KV), by model id."""
        return {unit.id: unit.loop.gauges() for unit in list(self.units.values())}

    def loops(self) -> Iterator[DecodeLoop]:
        return (unit.loop for unit in list(self.units.values()))

    # -- tasks -------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the units' decode loops and unload the expired ones, until cancelled; then
        free every unit's engine."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    await trio.sleep(REAP_EVERY_S)
                    for unit in [u for u in self.units.values() if u.expired(self._clock())]:
                        # Freeing one awaits a thread: a request may take the next meanwhile.
                        if unit.expired(self._clock()):
                            reason = f"idle for {unit.keep_alive_s:g} s, its keep-alive"
                            await self.unload(unit.id, reason=reason)
        finally:
            self._nursery = None
            for unit in list(self.units.values()):  # shutting down: the loops are idle by now
                self._forget(unit)
                unit.loaded.close()

    async def load(self, model_id: str, keep_alive_s: float | None = None) -> None:
        """Load ``model_id`` now, if it is not (``POST /load``, a ``models`` load request)."""
        if not self.store.entry(model_id).primary:
            self.release(await self.acquire(model_id, keep_alive_s))

    async def unload_when_idle(self, model_id: str) -> None:
        """Unload ``model_id`` now if idle, else as soon as it is (Ollama's keep_alive 0); a
        model still loading is unloaded once the request that loads it is done."""
        unit = self.units.get(model_id)
        if unit is None:
            if (lock := self._loading.get(model_id)) is not None and lock.locked():
                self._keep_after_load[model_id] = 0.0
            return
        unit.keep_alive_s = 0.0
        if unit.loop.idle and not unit.pending:
            await self.unload(model_id, reason="asked to")

    async def unload(self, model_id: str, reason: str) -> bool:
        """Stop an idle unit's loop and free its engine; False (and nothing done) if it is not
        loaded or a request has it (every caller picked an idle one, but before an await)."""
        unit = self.units.get(model_id)
        if unit is None or unit.pending or not unit.loop.idle:
            return False
        unit.loop.stop_accepting()
        self._forget(unit)
        log.info("unloaded %s (%s)", model_id, reason)
        await self._close(unit)
        return True

    # -- loading -----------------------------------------------------------------------

    async def _load(self, model_id: str) -> ModelUnit:
        loading = self.loading
        if loading is None or self._nursery is None:
            raise UmaError(ErrorCode.MODEL_LOAD, f"model {model_id!r} cannot be loaded by this daemon")
        try:
            entry = self.store.entry(model_id)
        except KeyError:  # its file was deleted since the request named it (a listing rescans)
            raise UmaError(ErrorCode.MODEL_NOT_FOUND, f"model {model_id!r} is not here any more") from None
        try:
            need = await trio.to_thread.run_sync(loading.footprint, entry)
        except Exception as exc:  # not a GGUF llama.cpp can read: refused before making room
            log.warning("cannot read %s: %s", model_id, exc)
            raise UmaError(ErrorCode.MODEL_LOAD, f"cannot load model {model_id!r}: {exc}") from None
        async with self._room:
            await self._make_room(model_id, need)
            began = self._clock()
            log.info("loading %s (%s, %d MiB with its KV cache)", model_id, entry.path, need >> 20)
            if not self.accepting:  # the daemon began draining while this request waited
                raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            try:
                loaded = await trio.to_thread.run_sync(loading.load, entry)
            except Exception as exc:  # a corrupt or unloadable file: this request fails, the rest go on
                log.warning("cannot load %s: %s", model_id, exc)
                raise UmaError(ErrorCode.MODEL_LOAD, f"cannot load model {model_id!r}: {exc}") from None
            try:
                return self._start_unit(model_id, loaded, need, began)
            except Exception as exc:  # say, --tick-trace's file for it cannot be opened
                log.warning("cannot start %s: %s", model_id, exc)
                if self._machine is not None:  # its loop may have joined before it failed
                    self._machine.arbiter.leave(model_id)
                await trio.to_thread.run_sync(loaded.close)  # still under _room: nothing loads meanwhile
                message = f"cannot start model {model_id!r} after loading it: {exc}"
                raise UmaError(ErrorCode.MODEL_LOAD, message) from None

    def _start_unit(self, model_id: str, loaded: LoadedModel, need: int, began: float) -> ModelUnit:
        """A loaded model's unit, registered and its decode loop started."""
        assert self._nursery is not None
        share = None
        if self._machine is not None:
            share = self._machine.share(model_id)
            primary = self.primary_loop
            if primary is not None and primary.sharing is None:  # the first other model
                primary.join(self._machine.share(self.store.primary.id))
        config = self._config
        if (trace := config.tick_trace) is not None:  # each model's steps in a file of their own
            config = replace(config, tick_trace=trace.with_name(f"{trace.stem}.{model_id}{trace.suffix}"))
        loop = DecodeLoop(
            loaded.engine, config, self._metrics, clock=self._clock, policy=loaded.policy, sharing=share,
            clients=self._clients,
        )  # fmt: skip
        if not self.accepting:  # loaded after the drain began: the requests waiting for it are refused
            loop.stop_accepting()
        unit = ModelUnit(model_id, loaded, loop, self._config.keep_alive_s, self._clock(), footprint=need)
        self._nursery.start_soon(self._run_unit, unit)
        self.units[model_id] = unit
        self.loads += 1
        log.info("loaded %s in %.1f s", model_id, self._clock() - began)
        return unit

    def used_bytes(self) -> int:
        """What the loaded models take of ``--memory-budget``, counting those being freed."""
        primary = self.loading.primary_bytes if self.loading is not None else 0
        return primary + sum(u.footprint for u in [*self.units.values(), *self._closing])

    async def _make_room(self, model_id: str, need: int) -> None:
        """Unload least recently used idle units until one more model of ``need`` bytes fits
        ``--max-loaded`` (the primary counts) and the memory budget, waiting up to
        :data:`ROOM_WAIT_S` for a busy one to go idle (then E_LIMIT_004); E_MODEL_003 when it
        cannot fit even alone."""
        budget = self.loading.budget_bytes if self.loading is not None else None
        primary = self.loading.primary_bytes if self.loading is not None else 0
        if self._config.max_loaded <= 1:  # no retry can help: say so, not "busy"
            raise UmaError(
                ErrorCode.MODEL_LOAD,
                f"--max-loaded {self._config.max_loaded} leaves room for --model's model only: "
                f"{model_id!r} cannot be loaded by this daemon",
            )
        if budget is not None and primary + need > budget:
            raise UmaError(
                ErrorCode.MODEL_LOAD,
                f"model {model_id!r} needs {_gib(need)} (weights and KV cache) and the memory budget is "
                f"{_gib(budget)}, of which --model's model takes {_gib(primary)}: it does not fit even "
                "alone (--memory-budget, or a smaller --n-ctx / --max-sessions)",
            )
        deadline = trio.current_time() + ROOM_WAIT_S
        while True:
            too_many = len(self.units) + len(self._closing) + 1 >= self._config.max_loaded
            too_big = budget is not None and self.used_bytes() + need > budget
            if not (too_many or too_big):
                return
            idle = [u for u in self.units.values() if u.loop.idle and not u.pending]
            if not idle and self._closing:  # one being freed (the reaper's): room once it is
                await self._closed.wait()
                continue
            if not self.accepting:  # the daemon began draining while this request waited
                raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            if not idle and trio.current_time() < deadline:
                # Queued, as Ollama queues a model's load: a busy model's requests end (a chat
                # turn takes seconds), and a refusal the client must retry helps nobody.
                await trio.sleep(ROOM_POLL_S)
                continue
            if not idle:
                limit = (
                    f"{len(self.units) + 1} models are loaded (--max-loaded {self._config.max_loaded})"
                    if too_many
                    else f"{_gib(self.used_bytes())} of the {_gib(budget or 0)} memory budget is in use"
                )
                raise UmaError(
                    ErrorCode.SERVER_BUSY,
                    f"{limit} and every loaded model stayed busy for {ROOM_WAIT_S:g} s; {model_id!r} "
                    "cannot load now, try again later",
                )
            victim = min(idle, key=lambda u: u.last_used)
            await self.unload(victim.id, reason=f"room for {model_id}")

    async def _run_unit(self, unit: ModelUnit) -> None:
        try:
            with unit.scope:
                await unit.loop.run()
        except Exception as exc:  # raised through our nursery, it stopped --model's model too
            log.exception("model %s failed; unloading it", unit.id)
            await self._drop_failed(unit, exc)

    async def _drop_failed(self, unit: ModelUnit, exc: Exception) -> None:
        """End the requests a unit whose loop died still holds, and free it: the next
        request that names its model loads it afresh."""
        unit.loop.stop_accepting()
        message = f"model {unit.id!r} failed ({exc}) and was unloaded; a new request loads it again"
        unit.loop.fail_all(ErrorCode.MODEL_LOAD, message)  # its waiting and running requests
        self._forget(unit)
        await self._close(unit)

    async def _close(self, unit: ModelUnit) -> None:
        """Free a forgotten unit's engine in a worker thread; its bytes and its place count
        against the limits until that returns (a load meanwhile would overshoot them)."""
        self._closing.add(unit)
        try:
            await trio.to_thread.run_sync(unit.loaded.close)
        finally:
            self._closing.discard(unit)
            self._closed.set()
            self._closed = trio.Event()

    def _forget(self, unit: ModelUnit) -> None:
        if self._machine is not None:  # the others no longer wait for its streams
            self._machine.arbiter.leave(unit.id)
        if self.units.get(unit.id) is unit:
            del self.units[unit.id]
            self.unloads += 1
        unit.scope.cancel()


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
