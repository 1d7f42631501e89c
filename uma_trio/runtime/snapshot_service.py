"""KV snapshots: save a prompt's cells to a file, list them, restore one into the prefix cache.

The service owns the snapshot store and nothing else; it reaches the decode task only
through the loop's public operations (``exclusive``, ``restore``, ``cancel``, ``unpin``)
and opens its fill request through the same desk (:class:`~.desk.RequestDesk`) as any front end.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import trio

from ..engine.base import Engine, KvState
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import GenerateRequest, SnapshotEvent, SnapshotInfo, SnapshotRequest
from .decode_loop import DecodeLoop
from .desk import RequestDesk
from .off_loop import off_loop, run_limiter
from .session import StreamEnd
from .snapshots import SnapshotHeader, SnapshotStore
from .stream import RequestStream

R = TypeVar("R")

# Snapshot files read or written at once, daemon-wide.  A restore abandoned on cancel (its
# client gone) keeps its thread, and the whole snapshot it reads, until the read ends: without
# a bound, clients that ask and hang up could pile up threads each holding gigabytes, and take
# trio's default thread pool from tokenizing.
SNAPSHOT_FILE_IO = 2
_FILE_IO: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("uma_trio_snapshot_file_io")


def file_io_limiter() -> trio.CapacityLimiter:
    """The run's one limiter on snapshot file I/O (one per trio run, as trio's own default)."""
    return run_limiter(_FILE_IO, SNAPSHOT_FILE_IO)


async def file_io(fn: Callable[[], R], *, abandon: bool = False) -> R:
    """``fn()`` (snapshot file I/O) in a worker thread, within :func:`file_io_limiter`."""
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=abandon, limiter=file_io_limiter())


class SnapshotService:
    """``snapshot`` requests (list, save, restore) on one engine's store."""

    def __init__(
        self,
        engine: Engine,
        loop: DecodeLoop,
        store: SnapshotStore,
        desk: RequestDesk,
    ) -> None:
        self.engine, self.loop, self.store, self.desk = engine, loop, store, desk
        self._stores: dict[str, SnapshotStore] = {}  # other principals' (store_for)

    def store_for(self, owner: str) -> SnapshotStore:
        """The snapshots ``owner`` may list, restore and overwrite: the daemon's own user's are
        the directory's; another principal's (an --allow-uid user, docs/SECURITY.md) are a
        private subdirectory of it, so none of them reads, restores or replaces another's."""
        if owner in ("", f"uid:{os.geteuid()}"):
            return self.store
        if (store := self._stores.get(owner)) is None:
            folder = re.sub(r"[^A-Za-z0-9_-]", "-", owner)  # uid:1001 -> uid-1001
            store = self._stores[owner] = SnapshotStore(self.store.directory / folder, self.store.max_bytes)
        return store

    async def handle(self, request: SnapshotRequest, connection: int, owner: str = "") -> SnapshotEvent:
        """Carry out a snapshot request (docs/PROTOCOL.md); :class:`UmaError` on failure."""
        try:
            if request.op == "list":
                infos = await file_io(self.store_for(owner).list, abandon=True)
            elif request.op == "save":
                infos = [await self._save_snapshot(request, connection, owner)]
            else:
                infos = [await self._restore_snapshot(request, owner)]
        except UmaError as exc:
            exc.request_id = request.id  # the client routes by it; never another request's id
            raise
        return SnapshotEvent(op=request.op, snapshots=infos, id=request.id)

    async def _save_snapshot(self, request: SnapshotRequest, connection: int, owner: str) -> SnapshotInfo:
        """Prefill the prompt as a one-token greedy request whose sequence stays cached and
        pinned, copy its cells out between two ticks, and write them to disk."""
        assert request.name is not None
        fill = GenerateRequest(
            id=request.id or f"snapshot:{request.name}", prompt=request.prompt, messages=request.messages,
            max_tokens=1, temperature=0.0, stream=False,
        )  # fmt: skip
        arrived = trio.current_time()
        stream = await self.desk.open_request(
            fill, arrived, connection=connection, owner=owner, pin_on_finish=True
        )
        end: StreamEnd | None = None
        try:
            async for item in stream.receive:  # a non-stream request sends nothing but its end
                end = item if isinstance(item, StreamEnd) else None
            if end is None:  # pragma: no cover - every stream ends with a StreamEnd
                raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            if end.error is not None:
                raise UmaError(ErrorCode(end.error.code), end.error.message)
            if end.pinned is None:  # cancelled: the daemon is stopping
                raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            pinned = end.pinned
            state = await self.loop.exclusive(partial(self._read_cells, pinned.seq_id, pinned.cells))
        finally:
            stream.cancel("disconnect")  # still running (we were cancelled): it will not be pinned
            end = end or _end_if_sent(stream)
            stream.receive.close()
            if end is not None and end.pinned is not None:
                self.loop.unpin(end.pinned.seq_id)
        header = SnapshotHeader(
            name=request.name, model=self.engine.model_name, model_sha256=await self._fingerprint(),
            kv_type=self.engine.kv_type, tokens=pinned.tokens.tolist(), created_unix=time.time(),
            kv_layout=self.engine.kv_layout,
        )  # fmt: skip
        try:
            return await file_io(partial(self.store_for(owner).write, header, state))
        except OSError as exc:
            raise UmaError(
                ErrorCode.SNAPSHOT_INVALID, f"cannot write snapshot {request.name!r}: {exc}"
            ) from None

    async def _read_cells(self, seq_id: int, n_cells: int) -> KvState:
        # A context rebuilt since the fill finished holds nothing for it any more.
        if self.engine.seq_cells(seq_id) != n_cells:
            raise UmaError(ErrorCode.CONTEXT_LOST, "the context was rebuilt before the snapshot was read")
        return await self.engine.save_seq(seq_id)

    async def _restore_snapshot(self, request: SnapshotRequest, owner: str) -> SnapshotInfo:
        """Check the snapshot was made by this model file and cache layout, then load it
        into a free sequence of the prefix cache between two ticks."""
        assert request.name is not None
        fingerprint = await self._fingerprint()
        # The header is checked before the KV bytes are read: another model's are not.
        # Abandoned on cancel: a read stuck in the filesystem must not hold up a shutdown.
        read = partial(self.store_for(owner).read, request.name, partial(self._check_header, fingerprint))
        header, state, file_bytes = await file_io(read, abandon=True)
        tokens = np.asarray(header.tokens, dtype=np.int32)
        await self.loop.exclusive(partial(self.loop.restore, tokens, state, owner, request.name))
        return header.info(file_bytes)  # the file's, as save and list report it (KV bytes only, it differed)

    def _check_header(self, fingerprint: str, header: SnapshotHeader) -> None:
        """Refuse a snapshot of another model file, KV type or layout, or too long a context
        (run in the reading thread: it reads only the engine's fixed properties)."""
        problem, engine = None, self.engine
        if header.model_sha256 != fingerprint:
            problem = (
                f"it was saved from another model file ({header.model}, sha256 {header.model_sha256[:12]}…) "
                f"and this daemon serves {engine.model_name} (sha256 {fingerprint[:12]}…)"
            )
        elif header.kv_type != engine.kv_type:
            problem = f"it holds a {header.kv_type} KV cache and this daemon runs --kv-type {engine.kv_type}"
        elif header.kv_layout and header.kv_layout != engine.kv_layout:
            problem = (
                f"it was saved with {header.kv_layout} and this daemon has {engine.kv_layout} "
                "(--max-sessions, --kv-unified and --flash-attn set them)"
            )
        elif len(header.tokens) >= engine.n_ctx_seq:
            problem = f"it holds {len(header.tokens)} tokens and a request's context is {engine.n_ctx_seq}"
        if problem is not None:
            raise UmaError(
                ErrorCode.SNAPSHOT_MISMATCH, f"snapshot {header.name!r} cannot be restored: {problem}"
            )

    async def _fingerprint(self) -> str:
        try:
            return await off_loop(self.engine, self.engine.fingerprint)
        except OSError as exc:
            raise UmaError(
                ErrorCode.SNAPSHOT_INVALID, f"cannot identify the model file for snapshots: {exc}"
            ) from None


def _end_if_sent(stream: RequestStream) -> StreamEnd | None:
    """The end already in ``stream``'s channel, if the loop sent it before we stopped reading."""
    while True:
        try:
            item = stream.receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None
        if isinstance(item, StreamEnd):
            return item
