"""Review 17: settings that crashed ``serve`` with a traceback, snapshot names taken from the
file's header instead of its name, and one model's failure stopping the daemon's others."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ConfigError, ServerConfig, parse_gpu_layers, parse_memory_budget
from uma_trio.engine.base import Engine
from uma_trio.engine.faults import FaultyEngine
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.sim import SimEngine
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.model_store import ModelStore, StoreEntry
from uma_trio.protocol.errors import ErrorCode
from uma_trio.runtime.models import LoadedModel, Loading
from uma_trio.runtime.server import Server
from uma_trio.runtime.snapshots import SUFFIX, SnapshotHeader, SnapshotStore
from uma_trio.sched.cost import CostCoefficients

from .conftest import running_server
from .helpers import sim_daemon

ROOT = Path(__file__).resolve().parent.parent

# -- 1. settings that are not numbers are ConfigErrors naming the flag ----------------------


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-inf", "infG", "1e400G", "1e308T", "1e-9K", "١G"])
def test_a_memory_budget_that_is_not_a_finite_size_is_a_config_error(value: str) -> None:
    """int() of infinity or NaN raised OverflowError / ValueError: a traceback at start-up."""
    with pytest.raises(ConfigError, match="--memory-budget"):
        ServerConfig(memory_budget=value)
    with pytest.raises(ConfigError, match="--memory-budget"):
        parse_memory_budget(value, 64 << 30)


def test_memory_budgets_that_were_accepted_still_are() -> None:
    total = 1000
    sizes = {
        "0.8": 800,
        "1": 1000,
        ".5": 500,
        "24G": 24 << 30,
        "512MiB": 512 << 20,
        "8000": 8000,
        "1e3": 1000,
    }
    assert {text: parse_memory_budget(text, total) for text in sizes} == sizes


@pytest.mark.parametrize("value", ["²", "1²", "١"])
def test_a_gpu_layer_count_in_other_digits_is_a_config_error(value: str) -> None:
    """``"²".isdigit()`` is True and ``int("²")`` raises ValueError."""
    with pytest.raises(ConfigError, match="--gpu-layers"):
        parse_gpu_layers(value)
    with pytest.raises(ConfigError, match="--gpu-layers"):
        ServerConfig(gpu_layers=value)


@pytest.mark.parametrize("flag", ["http", "ollama", "metrics"])
@pytest.mark.parametrize("address", ["²", "127.0.0.1:²", "127.0.0.1:1²", "١٢٣"])
def test_a_port_in_other_digits_is_a_config_error(flag: str, address: str) -> None:
    settings: dict[str, Any] = {flag: address}
    with pytest.raises(ConfigError, match=f"--{flag}"):
        ServerConfig(**settings)


def test_serve_with_an_infinite_memory_budget_exits_2_without_a_traceback(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "uma_trio", "serve", "--memory-budget", "inf"]
    command += ["--model", str(tmp_path / "none.gguf"), "--socket", str(tmp_path / "s.sock")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--memory-budget" in done.stderr and "Traceback" not in done.stderr


# -- 2. a snapshot is the file's name ------------------------------------------------------


def header(name: str) -> SnapshotHeader:
    return SnapshotHeader(name=name, model="m.gguf", model_sha256="0" * 64, kv_type="f16", tokens=[1, 2, 3],
                          created_unix=time.time())  # fmt: skip


def test_a_renamed_or_copied_snapshot_lists_and_reads_under_its_file_name(tmp_path: Path) -> None:
    """``list`` showed the header's name: ``one`` after ``mv one.umakv renamed.umakv``, which
    restore could not find, and two copies under one name."""
    store = SnapshotStore(tmp_path / "snaps")
    store.write(header("one"), b"KV")
    store.path("one").rename(store.path("renamed"))
    shutil.copyfile(store.path("renamed"), store.path("copy"))
    shutil.copyfile(store.path("renamed"), store.path("_hidden"))  # a name restore refuses
    assert [info.name for info in store.list()] == ["copy", "renamed"]
    assert store.read("renamed")[0].name == "renamed" and store.read("copy")[0].name == "copy"


async def test_restore_answers_with_the_name_it_was_asked_for(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    snaps = tmp_path / "snaps"
    async with (
        sim_daemon(snapshot_dir=snaps, prefix_cache_cells=None) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        await client.snapshot("save", "one", prompt="word " * 20)
        (snaps / f"one{SUFFIX}").rename(snaps / f"renamed{SUFFIX}")
        listed = await client.snapshot("list")
        restored = await client.snapshot("restore", "renamed")
        with pytest.raises(RequestFailed) as gone:
            await client.snapshot("restore", "one")
    assert [s.name for s in listed.snapshots] == ["renamed"]
    assert [s.name for s in restored.snapshots] == ["renamed"]
    assert gone.value.event.code == ErrorCode.SNAPSHOT_NOT_FOUND


# -- 4. a failing model other than --model's fails its own requests only -------------------


class UnrebuildableEngine(FaultyEngine):
    """A context that cannot be rebuilt: after a crash the model's decode loop itself raises."""

    async def rebuild(self) -> None:
        raise RuntimeError("injected: the context cannot be rebuilt")


class Shelf:
    """Loads simulated models; the first load of ``b`` crashes once its requests decode."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loaded: list[str] = []
        self.closed: list[str] = []

    def load(self, entry: StoreEntry) -> LoadedModel:
        sim = SimEngine(CostCoefficients(), n_ctx_seq=self.config.n_ctx, n_seq_max=self.config.max_sessions)
        engine = UnrebuildableEngine(sim)
        if entry.id not in self.loaded:
            engine.arm("crash", lambda entry: entry.pos0 >= 30)
        self.loaded.append(entry.id)
        # FaultyEngine lacks kv_layout, which only a snapshot restore reads.
        return LoadedModel(cast(Engine, engine), close=lambda: self.closed.append(entry.id))


@asynccontextmanager
async def two_model_daemon(**overrides: Any) -> AsyncIterator[tuple[Server, Shelf]]:
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock", **overrides)
        store = ModelStore(
            [StoreEntry("sim", Path("sim.gguf"), 1, primary=True), StoreEntry("b", Path("b.gguf"), 2)]
        )
        primary = SimEngine(CostCoefficients(), n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions)
        shelf = Shelf(config)
        server = Server(primary, config, store=store, loading=Loading(shelf.load))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            yield server, shelf
            server.request_shutdown(force=True)


async def outcome(client: UmaClient, model: str | None, max_tokens: int) -> str:
    """``eos`` reason, or the error code the request failed with."""
    try:
        done = await client.complete(prompt="word " * 8, max_tokens=max_tokens, model=model)
    except RequestFailed as failed:
        return f"{failed.event.code}: {failed.event.message}"
    return done.eos.reason


@pytest.mark.parametrize("bookkeeping_fails", [False, True])
async def test_a_model_whose_loop_fails_ends_its_requests_and_the_primary_serves_on(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, bookkeeping_fails: bool
) -> None:
    """engine.rebuild() raising in model b's loop went up ModelHost's nursery and stopped
    the daemon, --model's model with it.  Now b's running requests fail as a lost context
    does, its waiting ones with E_MODEL_003, b is unloaded, and a later request loads it."""
    async with two_model_daemon(max_sessions=2) as (server, shelf):
        async with UmaClient.connect(server.config.socket_path) as client:
            await client.models("load", "b", keep_alive=-1)
            if bookkeeping_fails:  # ending a request the usual way raises too: still ended

                def broken(*args: object) -> None:
                    raise RuntimeError("injected: bookkeeping")

                monkeypatch.setattr(server.models.units["b"].loop, "_fail", broken)
            results: dict[str, list[str]] = {"sim": [], "b": []}

            async def ask(model: str, max_tokens: int) -> None:
                results[model].append(await outcome(client, model, max_tokens))

            # Virtual time: while a load or a close runs on a worker thread every task waits, and
            # the autojump clock jumps from one keep-alive check (0.5 s) to the next; 600 s went by
            # within one slow thread in 1 run of 4 (b still "loading").  The bound is for a hang.
            with trio.fail_after(10**5):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, "sim", 300)  # in flight on --model's while b fails
                    for _ in range(4):  # two run (max_sessions 2), two wait
                        nursery.start_soon(ask, "b", 60)
                after = await outcome(client, None, 5)
                again = await outcome(client, "b", 5)
    codes = sorted(result.split(":")[0] for result in results["b"])
    expected = ["E_MODEL_003"] * 4 if bookkeeping_fails else ["E_MODEL_003"] * 2 + ["E_RUNTIME_004"] * 2
    assert codes == expected, results["b"]
    assert all("unloaded" in r for r in results["b"] if r.startswith("E_MODEL_003")), results["b"]
    assert results["sim"] == ["length"] and after == "length"
    assert again == "length" and shelf.loaded == ["b", "b"]  # loaded afresh after the failure
    assert shelf.closed == ["b", "b"]  # the failed one at once, the second at shutdown


@pytest.fixture(scope="module")
def tiny_shelf(model_path: Path) -> Iterator[Path]:
    """A --models-dir holding tiny-random.gguf: random weights, written by the gguf package."""
    with tempfile.TemporaryDirectory(prefix="uma-shelf-") as tmp:
        out = Path(tmp) / "tiny-random.gguf"
        shape = shlex.split("--layers 2 --embd 64 --heads 4 --kv-heads 2 --ffn 128 --ctx 2048 --name tiny")
        generator = str(ROOT / "benches/gpu/gen_model.py")
        command = [sys.executable, generator, "--vocab", str(model_path), "--out", str(out), *shape]
        subprocess.run(command, check=True, capture_output=True)
        yield Path(tmp)


@pytest.mark.model
async def test_on_the_real_engine_a_second_model_failing_leaves_the_first_serving(
    llama_model: LlamaModel,
    server_config: ServerConfig,
    tiny_shelf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: decode")

    async def no_rebuild() -> None:
        raise RuntimeError("injected: the context cannot be rebuilt")

    async with running_server(llama_model, server_config, models_dir=tiny_shelf) as server:
        async with UmaClient.connect(server.config.socket_path) as client:
            await client.models("load", "tiny-random", keep_alive=-1)
            engine = server.models.units["tiny-random"].engine
            monkeypatch.setattr(engine, "step", crash)
            monkeypatch.setattr(engine, "rebuild", no_rebuild)
            results: dict[str | None, str] = {}

            async def ask(model: str | None, max_tokens: int) -> None:
                results[model] = await outcome(client, model, max_tokens)

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, None, 48)  # --model's, in flight meanwhile
                    nursery.start_soon(ask, "tiny-random", 8)
                after = await outcome(client, None, 4)
                again = await outcome(client, "tiny-random", 4)  # loaded afresh
    assert results["tiny-random"].startswith("E_RUNTIME_004"), results
    assert {results[None], after, again} <= {"stop", "length"}, (results, after, again)
