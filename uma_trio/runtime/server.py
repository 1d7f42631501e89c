"""The daemon: one nursery supervising the listener, connections, decode and metrics.

Shutdown (the first SIGINT, SIGTERM or SIGHUP: runtime/stop_signals.py; or
:meth:`Server.request_shutdown`): stop accepting connections and requests, remove the socket
file, let running requests finish for ``shutdown_grace_s``, cancel what is left with
``eos(cancelled, cancel_reason=shutdown)``, give the connections a moment to flush those
events (and to answer requests still being admitted, refused as the daemon is shutting
down), then cancel everything.  A second signal skips the grace.

If ``--model``'s decode loop dies (its context cannot be rebuilt, or a bug), the daemon
cannot serve: every request of that loop ends with an error, the daemon drains as above
without the grace, and :meth:`Server.serve` raises :class:`DaemonFailed`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from ..config import ServerConfig
from ..engine.base import Engine
from ..model_store import ModelStore, StoreEntry, model_id
from ..observability.metrics import Metrics
from ..observability.process import ProcessSampler
from ..observability.prometheus import build_registry
from ..observability.scorecard import Scorecard, append_csv_row, scorecard
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import GenerateRequest, ModelsEvent, ModelsRequest, SnapshotEvent, SnapshotRequest
from ..sched.arbiter import Arbiter
from ..sched.policy import Policy
from .accept import accept_forever
from .clients import Clients
from .connection import Connection
from .decode_loop import DecodeLoop
from .intake import open_on, tokenize_request
from .loop_gauges import add_models_sessions
from .machine import Machine
from .models import Loading, ModelHost, ModelUnit
from .peer import peer_uid
from .snapshot_service import SnapshotService
from .snapshots import SnapshotStore, default_snapshot_dir
from .stop_signals import drain_signals
from .stream import RequestStream
from .tool_use import tool_format
from .unix_socket import bind_unix_listener, unlink_if_ours

log = logging.getLogger(__name__)

_FLUSH_TIMEOUT_S = 5.0


class DaemonFailed(Exception):
    """--model's decode loop stopped: the daemon drained and stopped with this error."""


class Server:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        policy: Policy | None = None,
        describe: Callable[[], dict[str, Any]] | None = None,
        *,
        store: ModelStore | None = None,
        loading: Loading | None = None,
    ) -> None:
        """``engine`` is the primary model's; ``store`` names the others, which ``loading``
        loads when a request asks for one (runtime/models.py)."""
        self.engine = engine
        self._describe = describe  # the engine's devices and settings (engine/summary.py)
        self.config = config
        self.metrics = Metrics(config.metrics_window_s)
        if store is None:  # the one model: the engine's
            name = engine.model_name
            store = ModelStore([StoreEntry(model_id(name), Path(name), 0, primary=True)])
        # With other models to load, every loop's steps take turns under one arbiter; a daemon
        # whose store has one model takes turns once a second one loads (runtime/models.py).
        # A cap over the arbiter's 1.8 pause (SCHEDULER.md lets users raise it) raises the pause
        # with it: it was a start-up traceback whenever the store held a second model.
        pause = max(1.8, config.latency_cap)
        machine = Machine(Arbiter(latency_cap=config.latency_cap, max_pause=pause, max_gap=max(2.0, pause)))
        share = machine.share(store.primary.id) if len(store.entries()) > 1 else None
        # Open connections on every front end: a lone client's next request needs no burst wait.
        self.clients = Clients()
        self.loop = DecodeLoop(
            engine, config, self.metrics, policy=policy, sharing=share, clients=self.clients
        )
        self.models = ModelHost(store, loading, config, self.metrics, machine=machine, clients=self.clients)
        self.models.primary_loop = self.loop
        self.process = ProcessSampler()
        self.registry = build_registry(self.metrics.registry, self.metrics_snapshot)
        self.metrics_url: str | None = None  # set by the daemon once --metrics-port serves
        self.http_url: str | None = None  # set by the daemon once the --http gateway serves this server
        self.http_urls: list[str] = []  # every address it serves: --http's, then --ollama's
        self.open_deliveries = 0  # requests whose client has not yet been handed its last event
        saved = SnapshotStore(config.snapshot_dir or default_snapshot_dir())
        self.snapshots = SnapshotService(engine, self.loop, saved, self)
        self._connections: set[Connection] = set()
        self._shutdown = trio.Event()
        self._force = trio.Event()
        self._next_number = 0
        self._failure: Exception | None = None  # what stopped --model's decode loop

    # -- public ------------------------------------------------------------------

    async def serve(
        self, *, handle_signals: bool = False, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until shut down.  ``task_status.started`` fires once the socket accepts."""
        with contextlib.ExitStack() as stack:
            # Taken before the socket exists: a supervisor that sees it may signal at once.
            signals = None
            if handle_signals:
                signals = stack.enter_context(trio.open_signal_receiver(*drain_signals()))
            await self._serve(signals, task_status)

    async def _serve(self, signals: AsyncIterator[int] | None, task_status: trio.TaskStatus[Server]) -> None:
        listener, inode = await bind_unix_listener(self.config.socket_path)
        self.metrics.started = trio.current_time()
        log.info(
            "serving %s on %s (n_ctx=%d per request, max_sessions=%d)",
            self.engine.model_name, self.config.socket_path, self.engine.n_ctx_seq, self.engine.n_seq_max,
        )  # fmt: skip
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_primary)
                await nursery.start(self.models.run)
                nursery.start_soon(self._metrics_task)
                if signals is not None:
                    nursery.start_soon(self._signal_task, signals)
                async with trio.open_nursery() as connections:
                    async with trio.open_nursery() as acceptor:
                        acceptor.start_soon(self._accept_loop, listener, connections)
                        task_status.started(self)
                        await self._shutdown.wait()
                        acceptor.cancel_scope.cancel()
                    await listener.aclose()
                    unlink_if_ours(self.config.socket_path, inode)
                    await self._drain()
                    connections.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        finally:
            unlink_if_ours(self.config.socket_path, inode)
            log.info("stopped")
        if self._failure is not None:
            raise DaemonFailed(f"the daemon cannot serve: {self._failure}") from self._failure

    async def _run_primary(self) -> None:
        """--model's decode loop.  If it dies, its requests end with an error the connections
        still write (the drain's flush), rather than a daemon gone with a traceback."""
        try:
            await self.loop.run()
        except Exception as exc:
            log.exception("the decode loop of %s stopped", self.engine.model_name)
            self._failure = exc
            self.loop.stop_accepting()
            self.loop.fail_all(ErrorCode.CONTEXT_LOST, f"the daemon cannot serve ({exc}) and is stopping")
            self.request_shutdown(force=True)

    def request_shutdown(self, *, force: bool = False) -> None:
        self._shutdown.set()
        if force:
            self._force.set()

    def metrics_snapshot(self) -> dict[str, Any]:
        """Everything docs/METRICS.md lists, as plain JSON-ready data."""
        now = trio.current_time()
        process = self.process.sample()
        snapshot = self.metrics.snapshot(now)
        snapshot["model"] = self.engine.model_name
        snapshot["engine"] = self.describe_engine()
        snapshot.update(self.loop.gauges())
        models = self.models
        add_models_sessions(snapshot, models.store.primary.id, models.units_gauges(), models.awaiting_load)
        snapshot["models"] = self.models.describe()
        snapshot["process"] = msgspec.to_builtins(process)
        snapshot["scorecard"] = msgspec.to_builtins(self.scorecard(now, process.rss_bytes))
        return snapshot

    def describe_engine(self) -> dict[str, Any]:
        """What the engine runs on (docs/METRICS.md "engine"); a simulated engine says so."""
        if self._describe is None:
            return {"backends": ["simulated"], "model": {"file": self.engine.model_name}}
        return self._describe()

    def scorecard(self, now: float, rss_bytes: int | None = None) -> Scorecard:
        rss = self.process.sample().rss_bytes if rss_bytes is None else rss_bytes
        return scorecard(self.metrics, now, latency_cap=self.config.latency_cap, rss_bytes=rss)

    async def open_request(
        self,
        request: GenerateRequest,
        arrived: float,
        *,
        connection: int,
        owner: str = "",
        auto_max_tokens: bool = False,
        pin_on_finish: bool = False,
    ) -> RequestStream:
        """Check ``request`` against the daemon's limits, tokenize it and queue it; its
        events come out of the returned stream (hand it to
        :func:`~uma_trio.runtime.delivery.deliver`).  ``auto_max_tokens``: the request named
        no max_tokens, so it may use what is left of its context, up to ``--max-tokens``.
        Raises :class:`UmaError` for anything that cannot be served.  A request for a model
        other than --model's waits for it to load (runtime/models.py); nobody else does."""
        opened = partial(
            open_on, config=self.config, request=request, arrived=arrived, connection=connection,
            owner=owner, auto_max_tokens=auto_max_tokens, pin_on_finish=pin_on_finish,
        )  # fmt: skip
        with self.loop.arrivals.mark():  # an idle decode task waits for it (burst gathering)
            if not self.loop.accepting:
                raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down", request_id=request.id)
            unit, load_s = await self._unit_for(request)
            if unit is None:
                return await opened(self.engine, self.loop)
        try:
            with unit.loop.arrivals.mark():
                stream = await opened(unit.engine, unit.loop)
                stream.load_s = load_s  # Ollama's load_duration
                return stream
        finally:
            self.models.release(unit)

    async def _unit_for(self, request: GenerateRequest) -> tuple[ModelUnit | None, float]:
        """The model ``request`` names (None: --model's), loaded if need be; the wait for its load."""
        try:
            model_id = self.models.resolve(request.model)
            if self.models.store.entry(model_id).primary:
                return None, 0.0
            asked, loaded = trio.current_time(), model_id in self.models.units
            unit = await self.models.acquire(model_id, request.keep_alive)
            return unit, 0.0 if loaded else trio.current_time() - asked
        except UmaError as exc:
            exc.request_id = request.id
            raise

    async def snapshot(self, request: SnapshotRequest, connection: int, owner: str = "") -> SnapshotEvent:
        """Carry out a snapshot request (docs/PROTOCOL.md); :class:`UmaError` on failure."""
        return await self.snapshots.handle(request, connection, owner)

    async def models_op(self, request: ModelsRequest) -> ModelsEvent:
        """List, load or unload models (docs/MODELS.md); :class:`UmaError` on failure."""
        if request.model is not None:
            try:
                model = self.models.resolve(request.model)
                if request.op == "load":
                    await self.models.load(model, request.keep_alive)
                elif self.models.store.entry(model).primary:
                    raise UmaError(ErrorCode.MODEL, f"{model} is --model's model: it stays loaded")
                else:
                    await self.models.unload_when_idle(model)
            except UmaError as exc:
                exc.request_id = request.id
                raise
        return ModelsEvent(op=request.op, models=self.models.describe(), id=request.id)

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The request's prompt in tokens, as it would be prefilled (template, tools), by the
        tokenizer of the model it names."""
        unit, _ = await self._unit_for(request)
        engine = self.engine if unit is None else unit.engine
        try:
            return len(await tokenize_request(engine, request, tool_format(engine, request)))
        finally:
            if unit is not None:
                self.models.release(unit)

    def next_connection_number(self) -> int:
        """Numbers socket connections and HTTP requests alike, for logs and the live view."""
        self._next_number += 1
        return self._next_number

    # -- tasks -------------------------------------------------------------------

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        error = await accept_forever(listener, self._handle, nursery)
        log.error("the socket %s stopped accepting (%s); shutting down", self.config.socket_path, error)
        self.request_shutdown()

    async def _handle(self, stream: trio.SocketStream) -> None:
        connection = Connection(self, stream, self.next_connection_number(), owner=socket_owner(stream))
        try:
            refusal = self._peer_refusal(stream)
            if refusal is None and len(self._connections) >= self.config.max_connections:
                refusal = UmaError(
                    ErrorCode.TOO_MANY_CONNECTIONS,
                    f"at most {self.config.max_connections} connections are served at once",
                )
            if refusal is not None:
                await connection.reject(refusal)
                return
            self._track(connection, +1)
            try:
                with self.clients.connected(connection):
                    await connection.run()
            finally:
                self._track(connection, -1)
        except Exception:  # a bug in one connection must not take the daemon down
            log.exception("connection %d failed", connection.number)
        finally:
            await trio.aclose_forcefully(stream)

    def _peer_refusal(self, stream: trio.SocketStream) -> UmaError | None:
        """With ``--allow-uid``: E_AUTH_001 for a peer whose uid is not in the list, or
        cannot be told (the list is authoritative; the daemon's own uid is not implied)."""
        allowed = self.config.allowed_uids
        if allowed is None:
            return None
        uid = peer_uid(stream.socket)
        if uid is not None and uid in allowed:
            return None
        log.warning("refused a connection from uid %s: not in --allow-uid", "unknown" if uid is None else uid)
        who = "a peer whose uid cannot be determined is" if uid is None else f"uid {uid} is"
        return UmaError(ErrorCode.PEER_NOT_ALLOWED, f"{who} not allowed to use this daemon")

    def _track(self, connection: Connection, delta: int) -> None:
        if delta > 0:
            self._connections.add(connection)
            self.metrics.connections_total += 1
        else:
            self._connections.discard(connection)
        self.metrics.connections_open = len(self._connections)

    async def _drain(self) -> None:
        # A model whose load ends from now takes no request (its waiting ones are refused).
        self.models.accepting = False
        loops = [self.loop, *self.models.loops()]  # every loaded model's
        for loop in loops:
            loop.stop_accepting()
        with trio.move_on_after(0 if self._force.is_set() else self.config.shutdown_grace_s) as grace:
            with trio.CancelScope() as forced:
                async with trio.open_nursery() as watch:
                    watch.start_soon(self._cancel_on_force, forced)
                    for loop in loops:
                        await loop.wait_idle()
                    watch.cancel_scope.cancel()
        if grace.cancelled_caught or forced.cancelled_caught:
            log.info("grace period over; cancelling the requests still running")
        for loop in loops:
            loop.cancel_all("shutdown")
        with trio.move_on_after(_FLUSH_TIMEOUT_S):
            for loop in loops:
                await loop.wait_idle()
            # Let every front end (socket or HTTP) write each request's final event before the
            # connections are cancelled.
            while self.open_deliveries or any(c.busy for c in self._connections):  # noqa: ASYNC110
                await trio.sleep(0.01)

    async def _cancel_on_force(self, scope: trio.CancelScope) -> None:
        await self._force.wait()
        scope.cancel()

    async def _signal_task(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            first = not self._shutdown.is_set()
            log.info("%s: %s", signal.Signals(signum).name, "draining" if first else "stopping now")
            self.request_shutdown(force=not first)

    async def _metrics_task(self) -> None:
        """Every ``metrics_interval_s``: a scorecard line in the log (only when something
        happened since the last one: an idle daemon stays quiet) and, with
        ``--scorecard-csv``, a CSV row (always: a regular time series)."""
        csv_path = self.config.scorecard_csv
        last_activity = self.metrics.activity
        while True:
            await trio.sleep(self.config.metrics_interval_s)
            now = trio.current_time()
            try:  # a figure that cannot be read (psutil out of file descriptors) skips one line
                card = self.scorecard(now)
            except Exception:
                log.exception("the scorecard failed; trying again in %g s", self.config.metrics_interval_s)
                continue
            if (activity := self.metrics.activity) != last_activity:
                log.info("%s", card.log_line())
                last_activity = activity
            if csv_path is not None:
                row = {"unix_time": round(time.time(), 3), "uptime_s": round(now - self.metrics.started, 3)}
                row.update(msgspec.to_builtins(card))
                try:
                    await trio.to_thread.run_sync(append_csv_row, csv_path, row)
                except OSError as exc:
                    log.warning("cannot append to %s: %s", csv_path, exc)


def socket_owner(stream: trio.abc.Stream) -> str:
    """The principal a socket connection's requests belong to: its peer's uid (the same
    user's processes share cached prefixes; another user's never do).  A stream that is not
    a socket (tests hand in memory streams) has none to tell."""
    sock = getattr(stream, "socket", None)
    uid = peer_uid(sock) if sock is not None else None
    return "uid:?" if uid is None else f"uid:{uid}"
