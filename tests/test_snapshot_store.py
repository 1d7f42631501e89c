"""Issue 17: the snapshot directory is checked like the socket's and its files opened
safely: a planted, linked, special or oversized file is never read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.runtime.snapshots import SUFFIX, SnapshotHeader, SnapshotStore, encode


def header(name: str) -> SnapshotHeader:
    return SnapshotHeader(name=name, model="m.gguf", model_sha256="0" * 64, kv_type="f16", tokens=[1, 2, 3],
                          created_unix=time.time())  # fmt: skip


def code_of(call: object) -> ErrorCode:
    with pytest.raises(UmaError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code


def test_a_saved_snapshot_reads_back_and_lists(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "state" / "snapshots")
    assert store.list() == []  # no directory yet: nothing, and nothing created
    assert not (tmp_path / "state").exists()
    store.write(header("a"), b"KV")
    assert (store.directory.stat().st_mode & 0o777) == 0o700
    assert store.read("a")[1] == b"KV"
    assert [i.name for i in store.list()] == ["a"]


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_directory_others_can_write_is_refused_for_every_operation(tmp_path: Path, mode: int) -> None:
    """A planted file would be restored as a cached prefix (the audit restored France's
    prompt with Italy's KV); even a sticky shared directory lets others create names."""
    shared = tmp_path / "shared"
    shared.mkdir()
    SnapshotStore(shared).write(header("a"), b"KV")
    shared.chmod(mode)
    store = SnapshotStore(shared)
    assert code_of(store.list) == ErrorCode.SNAPSHOT_INVALID
    assert code_of(lambda: store.read("a")) == ErrorCode.SNAPSHOT_INVALID
    assert code_of(lambda: store.write(header("b"), b"KV")) == ErrorCode.SNAPSHOT_INVALID
    with pytest.raises(UmaError, match="other users can write"):
        store.list()


def test_a_linked_directory_or_file_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    SnapshotStore(real).write(header("a"), b"KV")
    (tmp_path / "link").symlink_to(real)
    assert code_of(SnapshotStore(tmp_path / "link").list) == ErrorCode.SNAPSHOT_INVALID
    store = SnapshotStore(real)
    (real / f"b{SUFFIX}").symlink_to(real / f"a{SUFFIX}")
    assert code_of(lambda: store.read("b")) == ErrorCode.SNAPSHOT_INVALID
    assert [i.name for i in store.list()] == ["a"]


async def test_a_fifo_neither_hangs_list_nor_restore(tmp_path: Path) -> None:
    """A FIFO named `*.umakv` blocked `list` and `restore` for good (and with them SIGTERM)."""
    store = SnapshotStore(tmp_path / "snaps")
    store.write(header("a"), b"KV")
    os.mkfifo(store.path("fifo"))
    with trio.fail_after(2):
        infos = await trio.to_thread.run_sync(store.list)
        failed = await trio.to_thread.run_sync(lambda: code_of(lambda: store.read("fifo")))
    assert [i.name for i in infos] == ["a"] and failed == ErrorCode.SNAPSHOT_INVALID


def test_an_oversized_file_or_header_is_not_read(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", max_bytes=1 << 20)
    store.write(header("a"), b"KV")
    with store.path("big").open("wb") as file:  # sparse: no disk used
        file.truncate(2 << 20)
    assert code_of(lambda: store.read("big")) == ErrorCode.SNAPSHOT_INVALID
    blob = encode(header("h"), b"KV")
    store.path("h").write_bytes(blob[:21] + (1 << 30).to_bytes(4, "big") + blob[25:])  # claims a 1 GiB header
    assert code_of(lambda: store.read("h")) == ErrorCode.SNAPSHOT_INVALID
    assert [i.name for i in store.list()] == ["a"]


async def test_a_connection_waiting_for_a_snapshot_is_not_idle_and_counts_in_flight(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Issue 17: a connection waiting only for a snapshot answer was cut as idle
    (E_LIMIT_007), and snapshot saves bypassed --max-in-flight."""
    from .helpers import RawClient, sim_daemon

    prompt = " ".join(["word"] * 2000)  # ~4.6 s of prefill on the simulated engine's costs
    async with sim_daemon(snapshot_dir=tmp_path / "snaps", idle_timeout_s=2.0, max_in_flight=1) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"type": "snapshot", "op": "save", "name": "long", "prompt": prompt, "id": "s1"})
        await client.send({"prompt": "a b", "max_tokens": 2, "id": "g1"})
        refused = await client.next_event()
        assert refused is not None and refused["id"] == "g1" and refused["code"] == "E_LIMIT_005"
        answer = await client.next_event()
        assert answer is not None and answer["event"] == "snapshot", answer
        assert answer["id"] == "s1" and answer["snapshots"][0]["tokens"] == 2000
        assert trio.current_time() - server.metrics.started > 2.0  # it did outlast the idle timeout


async def test_a_snapshot_request_s_id_is_in_flight_until_answered(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A review: a generate and a snapshot request (or two snapshot requests) with one id were
    both taken, and their answers came back under that id, which a client cannot tell apart.
    Any id in flight on the connection is E_PROTO_006, as between two generates."""
    from .helpers import RawClient, sim_daemon

    prompt = " ".join(["word"] * 2000)  # seconds of prefill on the simulated engine's costs
    async with sim_daemon(snapshot_dir=tmp_path / "snaps") as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"type": "snapshot", "op": "save", "name": "long", "prompt": prompt, "id": "sv"})
        await client.send({"prompt": "a b", "max_tokens": 2, "id": "sv"})
        await client.send({"type": "snapshot", "op": "list", "id": "sv"})
        await client.send({"prompt": "a b", "max_tokens": 2, "id": "g"})
        await client.send({"type": "snapshot", "op": "list", "id": "g"})
        refused, ends = [], {}
        while len(refused) + len(ends) < 5:
            event = await client.next_event()
            assert event is not None
            if event["event"] == "error":
                refused.append((event["id"], event["code"]))
            elif event["event"] in ("eos", "snapshot"):
                ends[event["id"]] = event["event"]
        assert sorted(refused) == [("g", "E_PROTO_006"), ("sv", "E_PROTO_006"), ("sv", "E_PROTO_006")]
        assert ends == {"sv": "snapshot", "g": "eos"}
        await client.send({"type": "snapshot", "op": "list", "id": "sv"})  # answered: free again
        answer = await client.next_event()
        assert answer is not None and answer["event"] == "snapshot" and answer["id"] == "sv", answer


def test_a_header_with_bytes_that_are_not_utf8_is_a_corrupt_snapshot(tmp_path: Path) -> None:
    """One flipped byte in a header string made msgspec raise UnicodeDecodeError: listing
    failed for every snapshot, and reading it was no E_SNAPSHOT_003."""
    store = SnapshotStore(tmp_path / "snapshots")
    store.write(header("good"), b"KV")
    store.write(header("bad"), b"KV")
    blob = bytearray(store.path("bad").read_bytes())
    blob[blob.index(b'"m.gguf"') + 1] = 0xE1
    store.path("bad").write_bytes(bytes(blob))
    assert [info.name for info in store.list()] == ["good"]
    assert code_of(lambda: store.read("bad")) == ErrorCode.SNAPSHOT_INVALID


def test_the_kv_bytes_are_sealed_by_length_and_digest(tmp_path: Path) -> None:
    """A file from before the seal (no state_bytes/state_sha256) is read unchecked, as then."""
    store = SnapshotStore(tmp_path)
    info = store.write(header("a"), b"KV bytes")
    raw = store.path("a").read_bytes()
    assert b'"state_bytes":8' in raw and info.bytes == len(raw)
    store.path("b").write_bytes(raw[:-1] + b"X")
    assert code_of(lambda: store.read("b")) == ErrorCode.SNAPSHOT_INVALID
    store.path("c").write_bytes(raw[:-1])
    assert [i.name for i in store.list()] == ["a", "b"]  # the short one is left out
    with pytest.raises(UmaError, match="truncated or damaged: 7 KV bytes where it saved 8"):
        store.read("c")
    store.path("old").write_bytes(encode(header("old"), b"anything"))
    assert store.read("old")[1] == b"anything"
