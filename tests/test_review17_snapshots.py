"""Review 17: snapshots that could be saved and never restored, restores that read another
model's KV bytes whole and piled up without bound, a model fingerprint taken from a file
replaced after the load, and temporary files that a crashed write left for good."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import trio

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.base import Engine
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.llama_model import FileFingerprint, ModelFileChanged
from uma_trio.engine.sim import SimEngine
from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.protocol.messages import SnapshotRequest
from uma_trio.runtime.snapshot_service import SNAPSHOT_FILE_IO, file_io_limiter
from uma_trio.runtime.snapshots import STALE_TMP_S, SUFFIX, SnapshotHeader, SnapshotStore, encode

from .conftest import running_server
from .helpers import assert_nothing_held, sim_daemon

MB = 1 << 20
Read = tuple[SnapshotHeader, bytes]


def header(name: str, sha: str = "0" * 64) -> SnapshotHeader:
    # kv_type and kv_layout are the simulated engine's: only the sha256 decides a mismatch.
    return SnapshotHeader(name=name, model="m.gguf", model_sha256=sha, kv_type="q8_0", tokens=[1, 2, 3],
                          created_unix=time.time(), kv_layout="sim")  # fmt: skip


# -- 1a. a snapshot that could never be restored is not saved ------------------------------


def test_an_oversized_snapshot_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", max_bytes=1 * MB)
    store.write(header("a"), b"old KV")
    with pytest.raises(UmaError, match="could never be restored") as refused:
        store.write(header("a"), bytes(2 * MB))
    assert refused.value.code == ErrorCode.SNAPSHOT_INVALID  # as read's refusal of such a file
    assert sorted(p.name for p in store.directory.iterdir()) == [f"a{SUFFIX}"]  # no temporary left
    assert store.read("a")[1] == b"old KV"  # the saved one is kept
    limit = header("b")
    # The header written carries the state's length (7 digits here) and sha256 (64 hex digits).
    sealed = msgspec.structs.replace(limit, state_bytes=10**6, state_sha256="0" * 64)
    fits = 1 * MB - len(encode(sealed, b""))
    store.write(limit, bytes(fits))  # exactly the limit: saved, and it reads back
    assert len(store.read("b")[1]) == fits


# -- 1b, 1c. the header before the KV bytes, and no whole-state copies ----------------------


def allocated_peak(call: object) -> int:
    """The most memory Python held above the start while ``call()`` ran."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def test_writing_and_reading_a_snapshot_copy_its_state_no_more_than_once(tmp_path: Path) -> None:
    """encode() joined the header to the state (a second copy while writing) and read sliced
    the KV bytes out of the whole file (a second copy while restoring)."""
    store = SnapshotStore(tmp_path / "snaps")
    state = bytes(32 * MB)
    assert allocated_peak(lambda: store.write(header("big"), state)) < 4 * MB
    assert allocated_peak(lambda: store.read("big")) < 36 * MB  # the state it returns, once


def test_a_header_check_that_refuses_stops_the_read_before_the_kv_bytes(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    store.write(header("a"), bytes(32 * MB))
    seen: list[str] = []

    def refuse(found: SnapshotHeader) -> None:
        seen.append(found.name)
        raise UmaError(ErrorCode.SNAPSHOT_MISMATCH, "another model")

    def read() -> None:
        with pytest.raises(UmaError, match="another model"):
            store.read("a", refuse)

    assert allocated_peak(read) < 4 * MB and seen == ["a"]


async def test_restoring_another_models_snapshot_does_not_read_its_kv_bytes(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    snaps = tmp_path / "snaps"
    SnapshotStore(snaps).write(header("other"), bytes(48 * MB))
    async with (
        sim_daemon(snapshot_dir=snaps) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        tracemalloc.start()
        try:
            with pytest.raises(RequestFailed) as refused:
                await client.snapshot("restore", "other")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert refused.value.event.code == ErrorCode.SNAPSHOT_MISMATCH
    assert "another model file" in refused.value.event.message
    assert peak < 16 * MB  # the 48 MB of KV bytes were never read


# -- 1d. snapshot file I/O is bounded daemon-wide ---------------------------------------------


async def test_restores_whose_clients_left_hold_at_most_two_threads(tmp_path: Path) -> None:
    """Each restore abandoned on cancel kept a thread reading a whole snapshot, without bound,
    from trio's default pool (which tokenizing uses too)."""
    snaps = tmp_path / "snaps"
    SnapshotStore(snaps).write(header("a", sha="sim"), b"KV")
    release, lock = threading.Event(), threading.Lock()
    entered = [0]

    async with sim_daemon(snapshot_dir=snaps) as server:
        store = server.snapshots.store
        read = store.read

        def stuck_read(name: str, check: Callable[[SnapshotHeader], None] | None = None) -> Read:
            with lock:
                entered[0] += 1
            release.wait(10)  # a filesystem that hangs
            return read(name, check)

        store.read = stuck_read  # type: ignore[method-assign]
        request = SnapshotRequest(type="snapshot", op="restore", name="a")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for connection in range(6):
                    nursery.start_soon(server.snapshots.handle, request, connection)
                while entered[0] < SNAPSHOT_FILE_IO:
                    await trio.sleep(0.01)
                await trio.sleep(0.2)  # time for more to start, were they let
                nursery.cancel_scope.cancel()  # every client hangs up
            assert entered[0] == SNAPSHOT_FILE_IO
            assert file_io_limiter().borrowed_tokens == SNAPSHOT_FILE_IO  # abandoned, still counted
            release.set()
            while file_io_limiter().borrowed_tokens:
                await trio.sleep(0.01)


# -- 2. the fingerprint is the loaded file's ------------------------------------------------


def test_a_model_file_replaced_or_rewritten_after_the_load_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights one")
    replaced = FileFingerprint(path)
    path.with_name("new").write_bytes(b"weights two")
    os.replace(path.with_name("new"), path)  # `uma-trio pull` of the same name
    with pytest.raises(ModelFileChanged, match="replaced or changed since the daemon loaded it"):
        replaced.sha256()

    rewritten = FileFingerprint(path)
    with path.open("r+b") as file:  # the same size and inode
        file.write(b"W")
    os.utime(path, ns=(time.time_ns(), rewritten.loaded[1] + 1_000_000))
    with pytest.raises(ModelFileChanged):
        rewritten.sha256()

    kept = FileFingerprint(path)
    assert kept.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_concurrent_first_fingerprints_hash_the_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights")
    hashed = []
    digest = hashlib.file_digest

    def slow_digest(*args: object, **kwargs: object) -> object:
        hashed.append(1)
        time.sleep(0.05)
        return digest(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hashlib, "file_digest", slow_digest)  # as llama_model calls it
    fingerprint = FileFingerprint(path)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(fingerprint.sha256())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(hashed) == 1 and len(set(results)) == 1 and len(results) == 8


@pytest.mark.model
async def test_a_snapshot_save_after_the_model_file_was_replaced_is_refused(
    model_path: Path, server_config: ServerConfig, tmp_path: Path
) -> None:
    """The sha256 was read lazily from the path: a snapshot of the loaded weights was saved
    under the replacing file's sha256, and would be restored into a daemon that runs those."""
    copy = tmp_path / "model.gguf"
    shutil.copyfile(model_path, copy)
    model = LlamaModel(copy)
    try:
        other = tmp_path / "other.gguf"
        shutil.copyfile(model_path, other)
        with other.open("r+b") as file:  # other weights, the same size
            file.seek(-7, 2)
            byte = file.read(1)
            file.seek(-7, 2)
            file.write(bytes([byte[0] ^ 0x01]))
        os.replace(other, copy)
        with trio.fail_after(120):
            async with running_server(model, server_config, snapshot_dir=tmp_path / "snaps") as server:
                async with UmaClient.connect(server.config.socket_path) as client:
                    with pytest.raises(RequestFailed) as refused:
                        await client.snapshot("save", "sys", prompt="You are a librarian.")
    finally:
        model.close()
    assert refused.value.event.code == ErrorCode.SNAPSHOT_INVALID
    assert "replaced or changed since the daemon loaded it" in refused.value.event.message
    assert not (tmp_path / "snaps").exists()  # nothing written


# -- 3. a crashed write's temporary file is removed at start ---------------------------------


async def test_stale_temporary_files_are_removed_when_the_daemon_starts(
    autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snaps = tmp_path / "snaps"
    SnapshotStore(snaps).write(header("a"), b"KV")
    old = time.time() - STALE_TMP_S - 10
    crashed = [snaps / ".a.x1y2z3.tmp", snaps / ".b.q9w8e7.tmp"]
    writing = snaps / ".c.r5t6y7.tmp"  # another daemon's write in progress: recent
    others = [snaps / ".notes.tmp", snaps / "keep.txt"]
    for path in [*crashed, writing, *others]:
        path.write_bytes(b"partial")
    (snaps / ".d.dir.tmp").mkdir()
    for path in [*crashed, *others, snaps / ".d.dir.tmp"]:
        os.utime(path, (old, old))
    with caplog.at_level(logging.INFO, logger="uma_trio.runtime.snapshots"):
        async with (
            sim_daemon(snapshot_dir=snaps) as server,
            UmaClient.connect(server.config.socket_path) as client,
        ):
            listed = await client.snapshot("list")
    assert [s.name for s in listed.snapshots] == ["a"]
    left = sorted(p.name for p in snaps.iterdir())
    assert left == sorted([f"a{SUFFIX}", writing.name, ".notes.tmp", "keep.txt", ".d.dir.tmp"])
    assert "removed 2 stale snapshot temporary file(s)" in caplog.text


# -- review 20: a restore that fails in an unexpected way gives its sequence id back ----------


async def test_a_restore_failing_unexpectedly_gives_its_sequence_back(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Only an EngineError released the id the restore had claimed: any other failure left
    it counted as running for good, one sequence fewer for every later request."""
    snaps = tmp_path / "snaps"
    async with (
        sim_daemon(snapshot_dir=snaps, prefix_cache_cells=None) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        await client.snapshot("save", "a", prompt="word " * 20)

    def failing_loads(sim: SimEngine) -> Engine:
        async def load_seq(seq_id: int, data: bytes) -> None:
            raise RuntimeError("injected: the load broke")

        sim.load_seq = load_seq  # type: ignore[method-assign]
        return sim

    async with (
        sim_daemon(failing_loads, snapshot_dir=snaps, prefix_cache_cells=None) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        with pytest.raises(RequestFailed) as failed:
            await client.snapshot("restore", "a")
        assert "injected" in failed.value.event.message
        assert_nothing_held(server)


async def test_each_principal_lists_restores_and_overwrites_only_its_own_snapshots(tmp_path: Path) -> None:
    """Found by review: with --allow-uid, another user's connection listed the daemon user's
    snapshots, restored one (then probed its secret through the prefix cache) and overwrote
    it with its own.  The daemon's own user keeps the directory; another uid gets its own."""
    snaps = tmp_path / "snaps"
    me, other = f"uid:{os.geteuid()}", "uid:4242"

    def ask(op: str, name: str | None = None, prompt: str | None = None) -> SnapshotRequest:
        return SnapshotRequest(type="snapshot", op=op, name=name, prompt=prompt)  # type: ignore[arg-type]

    async with sim_daemon(snapshot_dir=snaps, prefix_cache_cells=None) as server:
        service = server.snapshots
        with trio.fail_after(20):
            await service.handle(ask("save", "notes", "the PIN is 7351"), 1, me)
            mine = (snaps / f"notes{SUFFIX}").read_bytes()
            assert (await service.handle(ask("list"), 2, other)).snapshots == []
            with pytest.raises(UmaError) as missing:
                await service.handle(ask("restore", "notes"), 2, other)
            assert missing.value.code is ErrorCode.SNAPSHOT_NOT_FOUND
            await service.handle(ask("save", "notes", "00000"), 2, other)  # its own, beside mine
            assert (snaps / f"notes{SUFFIX}").read_bytes() == mine
            assert (snaps / "uid-4242" / f"notes{SUFFIX}").is_file()
            assert (snaps / "uid-4242").stat().st_mode & 0o077 == 0
            for owner in (me, other):
                listed = await service.handle(ask("list"), 3, owner)
                assert [s.name for s in listed.snapshots] == ["notes"]
                await service.handle(ask("restore", "notes"), 3, owner)


async def test_a_snapshot_longer_than_the_prefix_cache_may_keep_is_refused_by_name(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Restored into a daemon whose --prefix-cache-cells is under the snapshot's tokens: the
    refusal said how many tokens and cells but not which snapshot (a review's note)."""
    snaps = tmp_path / "snaps"
    async with (
        sim_daemon(snapshot_dir=snaps, prefix_cache_cells=None) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        saved = await client.snapshot("save", "long-one", prompt="word " * 40)
    async with (
        sim_daemon(snapshot_dir=snaps, prefix_cache_cells=8) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        with pytest.raises(RequestFailed) as failed:
            await client.snapshot("restore", "long-one")
        event = failed.value.event
        assert event.code == ErrorCode.SNAPSHOT_MISMATCH.value
        assert "'long-one'" in event.message and "--prefix-cache-cells" in event.message
        assert saved.snapshots and str(saved.snapshots[0].tokens) in event.message
        assert_nothing_held(server)
