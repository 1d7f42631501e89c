"""Several models in one daemon (issue 22): the store's names, loading on demand, keep-alive,
room made by unloading the least recently used idle model, and refusals that leave the others
serving.  The policy is checked on the simulated engine with trio's test clock (nothing
sleeps), and once on the real engine: the default model beside a tiny random-weight one."""

from __future__ import annotations

import contextlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client import generate_latest

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.sim import SimEngine
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.model_store import ModelStore, StoreEntry, StoreError
from uma_trio.observability.metrics import Metrics
from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.protocol.ollama_durations import keep_alive_seconds
from uma_trio.protocol.openai_errors import ApiError
from uma_trio.runtime import models as models_module
from uma_trio.runtime.models import REAP_EVERY_S, ROOM_WAIT_S, LoadedModel, Loading, ModelHost
from uma_trio.runtime.server import Server
from uma_trio.sched.cost import CostCoefficients

from .conftest import running_server
from .helpers import RawClient, ids, streaming

ROOT = Path(__file__).resolve().parent.parent

# -- the store ------------------------------------------------------------------------------


def test_the_store_names_every_file_and_alias(tmp_path: Path) -> None:
    primary = tmp_path / "main.gguf"
    primary.write_bytes(b"GGUF")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    for file in ("coder.gguf", "embed.gguf", "notes.txt"):
        (shelf / file).write_bytes(b"GGUF....")
    elsewhere = tmp_path / "far" / "big.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"GGUF")
    store = ModelStore.scan(primary, shelf, ["chat=main.gguf", "code=coder.gguf", f"far={elsewhere}"])
    assert sorted(ids(store)) == ["big", "coder", "embed", "main"]
    assert store.primary.id == "main" and store.entry("coder").size == 8
    names: dict[str | None, str | None] = {
        "main": "main", "main.gguf": "main", "chat": "main", "code": "coder", "coder:latest": "coder",
        "far": "big", None: "main", "": "main", "nope": None,
    }  # fmt: skip
    for name, expected in names.items():
        assert store.resolve(name) == expected, name
    assert store.entry("main").aliases == ("chat",)
    # A file outside the store named by its own id: listed once, not as an alias of itself.
    same = ModelStore.scan(primary, shelf, [f"big={elsewhere}"])
    assert same.entry("big").aliases == () and same.resolve("big") == "big"
    with pytest.raises(StoreError, match="NAME=FILE"):
        ModelStore.scan(primary, shelf, ["chat"])
    with pytest.raises(StoreError, match="no model file"):
        ModelStore.scan(primary, shelf, ["x=missing.gguf"])
    with pytest.raises(StoreError, match="--models-dir"):
        ModelStore.scan(primary, tmp_path / "absent")


def test_an_alias_never_points_at_another_file_or_hides_a_model(tmp_path: Path) -> None:
    """A path whose file name the store already has went to the store's file, silently; an
    alias that is another model's id hid that model."""
    primary, shelf, elsewhere = tmp_path / "main.gguf", tmp_path / "shelf", tmp_path / "elsewhere"
    shelf.mkdir()
    elsewhere.mkdir()
    primary.write_bytes(b"GGUF")
    for path in (shelf / "model.gguf", shelf / "aaa.gguf", shelf / "zzz.gguf", elsewhere / "model.gguf"):
        path.write_bytes(b"GGUF" + path.parent.name.encode())
    with pytest.raises(StoreError, match="not the store's"):
        ModelStore.scan(primary, shelf, [f"mine={elsewhere / 'model.gguf'}"])
    with pytest.raises(StoreError, match="already another model's id"):
        ModelStore.scan(primary, shelf, ["main=aaa.gguf"])
    same = ModelStore.scan(primary, shelf, [f"mine={shelf / 'model.gguf'}", "first=aaa.gguf"])
    assert same.resolve("mine") == "model" and same.resolve("first") == "aaa" and same.resolve("zzz") == "zzz"


def test_a_directory_file_a_name_already_holds_or_no_model_is_left_out_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Several-models review: a file copied into --models-dir whose id was an --alias name
    was skipped while the daemon ran, then made the next start fail (exit 2, "already
    another model's id"); ``a.gguf.gguf`` (id ``a.gguf``) beside ``a.gguf`` was listed at
    start, yet its id named model ``a``.  Both are left out with a warning, as a rescan
    leaves them out (tests/test_pull_http.py); an alias that takes the --model's own id is
    still refused (above)."""
    primary, shelf = tmp_path / "main.gguf", tmp_path / "shelf"
    shelf.mkdir()
    primary.write_bytes(b"GGUF")
    for name in ("aaa.gguf", "zzz.gguf", "a.gguf", "a.gguf.gguf"):
        (shelf / name).write_bytes(b"GGUF" + name.encode())
    (shelf / "page.gguf").write_text("<html>404</html>")  # a failed download: no model file
    (shelf / "main.gguf").write_bytes(b"GGUF another main")  # --model's id, another file
    with caplog.at_level("WARNING", logger="uma_trio.model_store"):
        store = ModelStore.scan(primary, shelf, ["zzz=aaa.gguf"])
    assert sorted(ids(store)) == ["a", "aaa", "main"]
    assert store.resolve("zzz") == "aaa" and store.resolve("a.gguf") == "a"
    warned = caplog.text
    assert "zzz.gguf" in warned and "'zzz' is an --alias of the model 'aaa'" in warned
    assert "a.gguf.gguf" in warned and "'a.gguf' is already the name of the model 'a'" in warned
    assert "model file page.gguf in" in warned and "it is not a GGUF file (it starts b'<htm')" in warned
    assert "model file main.gguf in" in warned and "'main' is already the name of the model 'main'" in warned


def test_ollama_keep_alive_is_read_as_ollama_reads_it() -> None:
    cases = {None: None, 0: 0.0, 30: 30.0, -1: -1.0, "5m": 300.0, "1h30m": 5400.0, "-1": -1.0, "250ms": 0.25}
    for value, seconds in cases.items():
        assert keep_alive_seconds(value) == seconds, value
    # Past a year (or not finite) /api/ps's timedelta overflowed for every client after it.
    assert keep_alive_seconds("8760h") == 365 * 86400.0 and keep_alive_seconds(-1e308) == -1e308
    for bad in ("soon", "5x", True, [1], "999999999999h", 1e308, float("inf"), float("nan")):
        with pytest.raises(ApiError) as refused:
            keep_alive_seconds(bad)
        assert refused.value.param == "keep_alive"


# -- loading, keep-alive and eviction, on the simulated engine ------------------------------


class Shelf:
    """A loader of simulated models that remembers what it loaded and closed."""

    def __init__(
        self, fail: set[str] | None = None, cost: CostCoefficients | None = None, budget: int | None = None
    ) -> None:
        self.budget = budget  # bytes; each model's footprint is its file's size (StoreEntry.size)
        self.engines: dict[str, SimEngine] = {}
        self.closed: list[str] = []
        self.fail = fail or set()
        self.cost = cost or CostCoefficients()

    def load(self, entry: StoreEntry) -> LoadedModel:
        if entry.id in self.fail:
            raise ValueError(f"{entry.path}: not a GGUF file")
        engine = SimEngine(self.cost, n_ctx_seq=SIM_CONFIG.n_ctx, n_seq_max=SIM_CONFIG.max_sessions)
        self.engines[entry.id] = engine
        return LoadedModel(engine, close=lambda: self.closed.append(entry.id))


@asynccontextmanager
async def daemon(
    shelf: Shelf, store: ModelStore | None = None, **overrides: Any
) -> AsyncIterator[tuple[Server, SimEngine]]:
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock", **overrides)
        sizes = {"b": 2, "c": 2, "bad": 2, "huge": 10}  # each model's footprint, in bytes
        others = [StoreEntry(name, Path(f"{name}.gguf"), size) for name, size in sizes.items()]
        store = store or ModelStore([StoreEntry("sim", Path("sim.gguf"), 1, primary=True), *others])
        primary = SimEngine(shelf.cost, n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions)
        server = Server(primary, config, store=store, loading=Loading(shelf.load, budget_bytes=shelf.budget))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            yield server, primary
            server.request_shutdown(force=True)


def socket_of(server: Server) -> Path:
    return server.config.socket_path


def states(server: Server) -> dict[str, str]:
    return {m["id"]: m["state"] for m in server.models.describe()}


async def test_requests_to_two_models_run_each_on_its_own(autojump_clock: trio.abc.Clock) -> None:
    shelf = Shelf()
    async with daemon(shelf) as (server, primary), UmaClient.connect(server.config.socket_path) as client:
        assert states(server) == {
            "sim": "loaded",
            "b": "unloaded",
            "c": "unloaded",
            "bad": "unloaded",
            "huge": "unloaded",
        }
        async with trio.open_nursery() as nursery:
            for model in ("b", None, "b", "sim"):
                nursery.start_soon(partial(client.complete, prompt="word " * 20, max_tokens=6, model=model))
        assert list(shelf.engines) == ["b"] and len(shelf.engines["b"].steps) >= 6
        assert states(server)["b"] == "loaded" and server.models.loads == 1  # loaded once, for both
        primary_steps = len(primary.steps)
        await client.complete(prompt="word " * 20, max_tokens=6, model="b.gguf")  # its file name too
        assert len(primary.steps) == primary_steps


async def test_requests_to_other_models_count_in_the_daemons_gauges(autojump_clock: trio.abc.Clock) -> None:
    """A router reads the daemon's queue and its requests in flight: a request to another
    model once left them at 0 (the primary loop's alone), so a busy daemon looked idle."""
    shelf = Shelf()
    async with daemon(shelf) as (server, _), UmaClient.connect(server.config.socket_path) as client:
        seen: list[dict[str, Any]] = []
        texts: list[str] = []

        async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while not seen or not seen[-1]["sessions"]["active"]:
                seen.append(server.metrics_snapshot())
                texts.append(generate_latest(server.registry).decode())
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            await nursery.start(watch)
            await client.complete(prompt="word " * 20, max_tokens=40, model="b")
            nursery.cancel_scope.cancel()
        busy = seen[-1]
        assert [(r["model"], r["lane"]) for r in busy["in_flight"]] == [("b", "interactive")]
        assert busy["sessions"]["active"] + busy["sessions"]["waiting"] == 1
        assert busy["kv_loaded"]["cells_total"] == 2 * busy["kv"]["cells_total"]  # both models'
        assert "uma_num_requests_running 1.0" in texts[-1] or "uma_num_requests_waiting 1.0" in texts[-1]
        # Each loaded model's scheduler, by its label: the primary's alone were exported.
        assert set(busy["by_model"]) == {"sim", "b"} and busy["by_model"]["sim"]["idle"]
        assert 'uma_scheduler_served_decoders{model="b"}' in texts[-1]
        assert 'uma_scheduler_served_decoders{model="sim"} 0.0' in texts[-1]


async def test_a_request_waiting_for_its_model_to_load_is_queued_in_the_gauges() -> None:
    """While another model loads, the request waiting for it held no session and showed
    nowhere: the daemon read idle to a router (queue 0, headroom 1) for the whole load."""
    release = threading.Event()
    shelf = Shelf()
    plain_load = shelf.load

    def slow_load(entry: StoreEntry) -> LoadedModel:
        release.wait(10)
        return plain_load(entry)

    shelf.load = slow_load  # type: ignore[method-assign]
    async with daemon(shelf) as (server, _), UmaClient.connect(server.config.socket_path) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.complete, prompt="word " * 20, max_tokens=4, model="b"))
            while states(server)["b"] != "loading":
                await trio.sleep(0.01)
            snap = server.metrics_snapshot()
            text = generate_latest(server.registry).decode()
            release.set()
        assert snap["sessions"]["waiting"] == 1 and snap["sessions"]["loading"] == 1
        assert "uma_num_requests_waiting 1.0" in text
        assert 'uma_sessions{state="loading"} 1.0' in text
        assert not snap["by_model"]["sim"]["idle"]  # the headroom reads the slack, not "idle: 1"
        assert server.metrics_snapshot()["sessions"]["loading"] == 0


async def test_an_idle_model_unloads_after_its_keep_alive(autojump_clock: trio.abc.Clock) -> None:
    shelf = Shelf()
    async with (
        daemon(shelf, keep_alive_s=10.0) as (server, _),
        UmaClient.connect(server.config.socket_path) as c,
    ):
        await c.complete(prompt="hi", max_tokens=4, model="b")
        done = trio.current_time()
        await trio.sleep(9.0)
        assert states(server)["b"] == "loaded" and not shelf.closed
        await trio.sleep(1.0 + 2 * REAP_EVERY_S)
        assert states(server)["b"] == "unloaded"
        assert trio.current_time() - done < 10.0 + 3 * REAP_EVERY_S
        # keep_alive 0: gone right after its request; negative: for good.
        await c.complete(prompt="hi", max_tokens=4, model="c", keep_alive=0)
        await trio.sleep(2 * REAP_EVERY_S)
        assert states(server)["c"] == "unloaded"
        await c.complete(prompt="hi", max_tokens=4, model="b", keep_alive=-1)
        await trio.sleep(3600)
        assert states(server)["b"] == "loaded"
    assert shelf.closed == ["b", "c", "b"]  # freed in a worker thread: the last at shutdown


async def test_the_least_recently_used_idle_model_makes_room(autojump_clock: trio.abc.Clock) -> None:
    slow = CostCoefficients(fixed_s=0.5, source="test: half a second a step")
    shelf = Shelf(cost=slow)
    async with daemon(shelf, max_loaded=2) as (server, _), UmaClient.connect(server.config.socket_path) as c:
        await c.complete(prompt="hi", max_tokens=2, model="b", keep_alive=-1)
        await c.complete(
            prompt="hi", max_tokens=2, model="c", keep_alive=-1
        )  # only two fit, --model's included
        assert states(server) == {
            "sim": "loaded",
            "b": "unloaded",
            "c": "loaded",
            "bad": "unloaded",
            "huge": "unloaded",
        }
        ended: dict[str, float] = {}

        async def ask(model: str, max_tokens: int) -> None:
            await c.complete(prompt="hi", max_tokens=max_tokens, model=model, keep_alive=-1)
            ended[model] = trio.current_time()

        async with trio.open_nursery() as nursery:  # c is busy: it is not unloaded for b...
            nursery.start_soon(ask, "c", 40)  # 20 s of steps
            await trio.sleep(2.0)
            nursery.start_soon(ask, "b", 2)  # ...which waits for it to end (it was a 429)
        assert ended["c"] < ended["b"]  # (a worker thread's load lets the test clock leap: no bound)
        assert states(server)["b"] == "loaded" and states(server)["c"] == "unloaded"
        async with trio.open_nursery() as nursery:  # b busy for longer than a load waits: the 429
            nursery.start_soon(lambda: c.complete(prompt="hi", max_tokens=200, model="b"))
            await trio.sleep(2.0)
            asked = trio.current_time()
            with pytest.raises(RequestFailed) as busy:
                await c.complete(prompt="hi", max_tokens=2, model="c")
            assert trio.current_time() - asked >= ROOM_WAIT_S
            message = busy.value.event.message
            assert busy.value.event.code == "E_LIMIT_004" and f"stayed busy for {ROOM_WAIT_S:g} s" in message
    assert shelf.closed == ["b", "c", "b"]


async def test_models_share_the_memory_budget(autojump_clock: trio.abc.Clock) -> None:
    shelf = Shelf(budget=5)  # bytes: --model's takes 0 here, b and c 2 each, huge 10
    async with daemon(shelf) as (server, _), UmaClient.connect(socket_of(server)) as c:
        # Kept for good: worker threads (loading) let the test clock leap past any keep-alive.
        await c.complete(prompt="hi", max_tokens=2, model="b", keep_alive=-1)
        await c.complete(prompt="hi", max_tokens=2, model="c", keep_alive=-1)
        assert server.models.used_bytes() == 4 and states(server)["b"] == "loaded"
        with pytest.raises(RequestFailed) as too_big:
            await c.complete(prompt="hi", max_tokens=2, model="huge")
        message = too_big.value.event.message
        assert too_big.value.event.code == "E_MODEL_003" and "does not fit even alone" in message
        assert states(server)["b"] == "loaded"  # nothing was unloaded for a model that cannot fit
    shelf = Shelf(budget=3)
    async with daemon(shelf) as (server, _), UmaClient.connect(socket_of(server)) as c:
        await c.complete(prompt="hi", max_tokens=2, model="b", keep_alive=-1)
        await c.complete(prompt="hi", max_tokens=2, model="c", keep_alive=-1)  # 2 + 2 > 3: b makes room
        assert states(server)["b"] == "unloaded" and server.models.used_bytes() == 2


async def test_an_unknown_or_broken_model_is_refused_and_the_others_serve(
    autojump_clock: trio.abc.Clock,
) -> None:
    shelf = Shelf(fail={"bad"})
    async with daemon(shelf) as (server, _), UmaClient.connect(server.config.socket_path) as c:
        with pytest.raises(RequestFailed) as unknown:
            await c.complete(prompt="hi", max_tokens=2, model="llama3:70b")
        assert unknown.value.event.code == "E_MODEL_002"
        assert all(name in unknown.value.event.message for name in ("sim", "b", "c"))
        with pytest.raises(RequestFailed) as broken:
            await c.complete(prompt="hi", max_tokens=2, model="bad")
        assert broken.value.event.code == "E_MODEL_003" and "not a GGUF" in broken.value.event.message
        assert states(server)["bad"] == "unloaded"
        done = await c.complete(prompt="hi", max_tokens=3)
        assert done.eos.reason == "length"
        assert (await c.complete(prompt="hi", max_tokens=3, model="b")).eos.reason == "length"


async def test_models_are_listed_loaded_and_unloaded_on_request(autojump_clock: trio.abc.Clock) -> None:
    shelf = Shelf(fail={"bad"})
    async with daemon(shelf, idle_timeout_s=1e5) as (server, _), UmaClient.connect(socket_of(server)) as c:
        listed = await c.models()
        assert [(m["id"], m["state"], m["primary"]) for m in listed.models] == [
            ("sim", "loaded", True), ("b", "unloaded", False),
            ("c", "unloaded", False), ("bad", "unloaded", False), ("huge", "unloaded", False),
        ]  # fmt: skip
        loaded = await c.models("load", "c.gguf", keep_alive=-1)  # any of its names
        assert {m["id"]: m["state"] for m in loaded.models}["c"] == "loaded" and shelf.engines.keys() == {"c"}
        assert next(m for m in loaded.models if m["id"] == "c")["keep_alive_s"] is None  # for good
        await trio.sleep(3600)
        unloaded = await c.models("unload", "c")
        assert {m["id"]: m["state"] for m in unloaded.models}["c"] == "unloaded"
        with pytest.raises(RequestFailed) as primary:
            await c.models("unload", "sim")
        assert primary.value.event.code == "E_MODEL_001"
        with pytest.raises(RequestFailed) as unknown:
            await c.models("load", "nope")
        assert unknown.value.event.code == "E_MODEL_002"
        with pytest.raises(RequestFailed) as broken:
            await c.models("load", "bad")
        assert broken.value.event.code == "E_MODEL_003"


async def test_the_list_reads_the_models_directory_again(tmp_path: Path) -> None:
    """A model pulled or copied into --models-dir was listed (/v1/models, /api/tags, ps) only
    once a request had named it, so a picker filled from the list could never offer it; one
    deleted stayed listed.  The primary says it is loaded for good, as a loaded model does."""
    models = tmp_path / "models"
    models.mkdir()
    primary = tmp_path / "sim.gguf"
    primary.write_bytes(b"x")
    (models / "b.gguf").write_bytes(b"GGUFxx")
    store = ModelStore.scan(primary, models)
    async with daemon(Shelf(), store=store) as (server, _), UmaClient.connect(socket_of(server)) as c:
        first = (await c.models()).models
        assert [m["id"] for m in first] == ["sim", "b"]
        main = first[0]
        assert main["keep_alive_s"] is None and main["busy"] is False and main["idle_s"] >= 0
        (models / "new.gguf").write_bytes(b"GGUFxxx")
        (models / "notes.gguf").write_text("not a model\n")  # left out: no model file
        (models / "b.gguf").unlink()
        assert [m["id"] for m in (await c.models()).models] == ["sim", "new"]
        assert [m["id"] for m in server.metrics_snapshot()["models"]] == ["sim", "new"]


async def test_a_model_gone_from_the_store_before_its_load_is_not_found(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A listing reads the directory again, so a model resolved by a request may have left
    the store (its file deleted) by the time its load begins: a KeyError, an internal error."""
    async with daemon(Shelf()) as (server, _):
        with pytest.raises(UmaError) as gone:
            await server.models.acquire("deleted-meanwhile")
        assert gone.value.code == ErrorCode.MODEL_NOT_FOUND


# -- the real engine: the default model and a tiny random one --------------------------------


def two_other_models() -> ModelStore:
    return ModelStore([
        StoreEntry("sim", Path("sim.gguf"), 1, primary=True),
        StoreEntry("b", Path("b.gguf"), 2), StoreEntry("c", Path("c.gguf"), 2),
    ])  # fmt: skip


def sim_model(close: Callable[[], None] = lambda: None) -> LoadedModel:
    engine = SimEngine(CostCoefficients(), n_ctx_seq=SIM_CONFIG.n_ctx, n_seq_max=SIM_CONFIG.max_sessions)
    return LoadedModel(engine, close=close)


@pytest.mark.parametrize("limit", [{"max_loaded": 2}, {"budget_bytes": 3}])
async def test_two_models_loading_at_once_keep_the_limits(
    limit: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads of two models take turns making room: together, both saw room for one (neither
    was loaded yet) and both loaded, past --max-loaded 2 or a 3-byte budget."""
    monkeypatch.setattr(models_module, "ROOM_WAIT_S", 0.5)  # the first is held for good

    def load(entry: StoreEntry) -> LoadedModel:
        time.sleep(0.2)  # a real load takes seconds
        return sim_model()

    config = replace(SIM_CONFIG, max_loaded=limit.get("max_loaded", SIM_CONFIG.max_loaded))
    loading = Loading(load, budget_bytes=limit.get("budget_bytes"))
    host = ModelHost(two_other_models(), loading, config, Metrics(60.0))
    refused: list[ErrorCode] = []

    async def want(name: str) -> None:  # each request holds its model (pending) meanwhile
        try:
            await host.acquire(name, -1)
        except UmaError as exc:
            refused.append(exc.code)

    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        async with trio.open_nursery() as requests:
            requests.start_soon(want, "b")
            requests.start_soon(want, "c")
        loaded = sorted(host.units)
        nursery.cancel_scope.cancel()
    assert len(loaded) == 1 and refused == [ErrorCode.SERVER_BUSY]


async def test_the_keep_alive_reaper_never_unloads_a_model_a_request_took_meanwhile() -> None:
    """Two models expire together; while the first is freed (a thread), a request takes the
    second: it stays loaded, and the request is answered."""
    closing_b = threading.Event()

    def load(entry: StoreEntry) -> LoadedModel:
        def close() -> None:
            if entry.id == "b":
                closing_b.set()
                time.sleep(0.5)  # freeing a big model's weights takes a while

        return sim_model(close)

    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock", keep_alive_s=0.0)
        primary = SimEngine(CostCoefficients(), n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions)
        server = Server(primary, config, store=two_other_models(), loading=Loading(load))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            async with UmaClient.connect(config.socket_path) as client:
                await client.complete(prompt="hi", max_tokens=2, model="b")
                await client.complete(prompt="hi", max_tokens=2, model="c")
                while not closing_b.is_set():
                    await trio.sleep(0.01)
                with trio.fail_after(5):  # it hung for good: c was unloaded under it
                    done = await client.complete(prompt="word " * 50, max_tokens=50, model="c", keep_alive=60)
            assert done.eos.reason == "length" and "c" in server.models.units
            server.request_shutdown(force=True)


async def test_a_request_cancelled_while_its_model_loads_is_cancelled() -> None:
    """A cancel sent while the request's model loaded (a thread, which a cancel cannot stop)
    was lost: once the load was done the request was queued and ran to its end.  It now ends
    as cancelled by its client, with nothing generated, and the model stays loaded."""

    def load(entry: StoreEntry) -> LoadedModel:
        time.sleep(0.5)  # a real load takes seconds
        return sim_model()

    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock")
        primary = SimEngine(CostCoefficients(), n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions)
        server = Server(primary, config, store=two_other_models(), loading=Loading(load))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            client = await RawClient.connect(config.socket_path)
            await client.send({"id": "L", "model": "b", "prompt": "hi", "max_tokens": 40})
            await trio.sleep(0.1)
            await client.send({"type": "cancel", "id": "L"})
            await client.send({"id": "p", "prompt": "hi", "max_tokens": 2})
            with trio.fail_after(10):
                ends = {rid: events[-1] for rid, events in (await client.until_all_end(["L", "p"])).items()}
            await client.aclose()
            assert (ends["L"]["reason"], ends["L"].get("cancel_reason")) == ("cancelled", "client"), ends["L"]
            assert ends["L"]["usage"]["completion_tokens"] == 0 and ends["p"]["reason"] == "length"
            assert "b" in server.models.units
            server.request_shutdown(force=True)


async def test_max_loaded_1_refuses_other_models_for_good() -> None:
    """--max-loaded 1 is --model's model alone: not "busy, try again later"."""
    config = replace(SIM_CONFIG, max_loaded=1)
    host = ModelHost(two_other_models(), Loading(lambda entry: sim_model()), config, Metrics(60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        with pytest.raises(UmaError) as refused:
            await host.acquire("b")
        nursery.cancel_scope.cancel()
    assert refused.value.code == ErrorCode.MODEL_LOAD and "--max-loaded 1" in refused.value.message


@pytest.fixture(scope="module")
def shelf_dir(model_path: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="uma-shelf-") as tmp:
        out = Path(tmp) / "tiny-random.gguf"  # its id: tiny-random
        shape = shlex.split("--layers 2 --embd 64 --heads 4 --kv-heads 2 --ffn 128 --ctx 2048 --name tiny")
        generator = str(ROOT / "benches/gpu/gen_model.py")
        command = [sys.executable, generator, "--vocab", str(model_path), "--out", str(out), *shape]
        subprocess.run(command, check=True, capture_output=True)
        yield Path(tmp)


async def greedy(server: Server, model: str, prompt: str) -> str:
    api = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    answer = await api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    return answer.choices[0].text


@pytest.mark.model
async def test_two_real_models_answer_as_each_does_alone(
    llama_model: LlamaModel, server_config: ServerConfig, shelf_dir: Path
) -> None:
    prompt, tiny = "The capital of France is", "tiny-random"
    tiny_model = LlamaModel(shelf_dir / f"{tiny}.gguf")
    try:
        async with running_server(tiny_model, server_config, http="127.0.0.1:0") as alone:
            tiny_alone = await greedy(alone, tiny, prompt)
    finally:
        tiny_model.close()
    alias = (f"little={tiny}.gguf",)
    async with running_server(
        llama_model, server_config, http="127.0.0.1:0", models_dir=shelf_dir, alias=alias
    ) as server:
        default = server.models.store.primary.id
        async with trio.open_nursery() as nursery:  # interleaved: the tiny one loads meanwhile
            answers: dict[str, str] = {}

            async def ask(model: str) -> None:
                answers[model] = await greedy(server, model, prompt)

            nursery.start_soon(ask, tiny)
            nursery.start_soon(ask, default)
        assert answers[tiny] == tiny_alone and answers[default] != answers[tiny]
        assert "Paris" in answers[default]
        async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
            listed = (await http.get("/v1/models")).json()["data"]
            states = {m["id"]: m["uma"]["state"] for m in listed}
            assert states == {default: "loaded", tiny: "loaded", "little": "loaded"}
            # The alias is an entry of its own there too (it was absent), its model's state shown.
            assert next(m["uma"]["id"] for m in listed if m["id"] == "little") == tiny
            assert (await http.get("/v1/models/little")).json()["id"] == "little"
            running = (await http.get("/api/ps")).json()["models"]
            assert [m["name"] for m in running] == [default, tiny]
            # Every entry says its GPU bytes (none here) and context (the other's lacked both).
            assert [(m["size_vram"], m["context_length"]) for m in running] == [(0, server.config.n_ctx)] * 2
            files = {m["name"]: m["size"] for m in (await http.get("/api/tags")).json()["models"]}
            assert all(m["size"] > files[m["name"]] for m in running)  # weights and KV cache, as Ollama's
            # An --alias is listed as a name of its own, as Ollama lists a copy (it was absent).
            tags = {m["name"]: m["size"] for m in (await http.get("/api/tags")).json()["models"]}
            assert tags.keys() == {default, tiny, "little"} and tags["little"] == tags[tiny]
            gone = await http.post("/api/generate", json={"model": tiny, "keep_alive": 0})
            assert gone.json()["done_reason"] == "unload"
            assert [m["name"] for m in (await http.get("/api/ps")).json()["models"]] == [default]
            # --model's model stays: its unload call said "unload" and nothing was (a review).
            for route in ("/api/generate", "/api/chat"):
                kept = await http.post(route, json={"model": default, "keep_alive": 0})
                assert kept.status_code == 400 and "stays loaded" in kept.json()["error"], kept.text
            assert [m["name"] for m in (await http.get("/api/ps")).json()["models"]] == [default]
            # Kept for longer than a timedelta holds: /api/ps says a year, as for the primary.
            back = (await http.post("/load", json={"model": f"{tiny}.gguf", "keep_alive": 1e300})).json()
            assert back["model"] == tiny and {m["id"]: m["state"] for m in back["models"]}[tiny] == "loaded"
            listed_ps = await http.get("/api/ps")
            assert listed_ps.status_code == 200 and [m["name"] for m in listed_ps.json()["models"]] == [
                default,
                tiny,
            ]
            cli = [sys.executable, "-m", "uma_trio", "ps", "--socket", str(server.config.socket_path)]
            run_cli = partial(subprocess.run, cli, capture_output=True, text=True)
            shown = await trio.to_thread.run_sync(run_cli)
            assert shown.returncode == 0 and tiny in shown.stdout and "loaded" in shown.stdout
            # `load --keep-alive inf` is for good (JSON has no infinity: it was sent as null, the default).
            forever = [*cli[:3], "load", tiny, "--keep-alive", "inf", *cli[4:]]
            loaded = await trio.to_thread.run_sync(
                partial(subprocess.run, forever, capture_output=True, text=True)
            )
            assert loaded.returncode == 0, loaded.stderr
            entry = (await http.get(f"/v1/models/{tiny}")).json()["uma"]
            assert entry["state"] == "loaded" and entry["keep_alive_s"] is None, entry
            assert (await http.post("/unload", json={"model": tiny})).status_code == 200
            refused = await http.post("/unload", json={"model": default})
            assert refused.status_code == 400 and "stays loaded" in refused.json()["error"]["message"]
            missing = await http.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
            assert missing.status_code == 404 and tiny in missing.json()["error"]["message"]
            assert "`little`" in missing.json()["error"]["message"]  # the aliases a request may name too


@pytest.mark.model
async def test_on_the_real_engine_a_model_makes_room_and_expires(
    llama_model: LlamaModel, server_config: ServerConfig, shelf_dir: Path, tmp_path: Path
) -> None:
    for name in ("tiny-a", "tiny-b"):  # two models of the tiny shape (the same weights)
        shutil.copyfile(shelf_dir / "tiny-random.gguf", tmp_path / f"{name}.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(64))  # a header and nothing else
    prompt = "Once upon a time"
    async with running_server(
        llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path, max_loaded=2
    ) as server:
        # Refused at load, the rest go on; a 422, which the SDKs do not retry (a 500 was
        # retried twice, each try loading the file again).
        with pytest.raises(openai.UnprocessableEntityError) as broken:
            await greedy(server, "broken", prompt)
        assert "cannot load model 'broken'" in str(broken.value) and broken.value.code == "E_MODEL_003"
        first = await greedy(server, "tiny-a", prompt)
        assert server.models.state("tiny-a") == "loaded"
        assert await greedy(server, "tiny-b", prompt) == first  # --model's and one more fit
        assert server.models.state("tiny-a") == "unloaded" and server.models.state("tiny-b") == "loaded"
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
            body = {"model": "tiny-b", "prompt": prompt, "raw": True, "stream": False, "keep_alive": "1s",
                    "options": {"num_predict": 2}}  # fmt: skip
            assert (await http.post("/api/generate", json=body)).status_code == 200
        with trio.fail_after(10):
            while server.models.state("tiny-b") == "loaded":
                await trio.sleep(0.1)
        assert server.models.unloads == 2 and server.models.units == {}


@pytest.mark.model
def test_a_model_whose_warm_up_fails_frees_what_it_loaded(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uma_trio import daemon
    from uma_trio.engine.llama import LlamaEngine

    closed: list[str] = []
    real_close = LlamaEngine.close

    def recorded(self: LlamaEngine) -> None:
        closed.append("context")
        real_close(self)

    def broken(*args: object) -> None:
        raise RuntimeError("injected: the cost model failed")

    monkeypatch.setattr(LlamaEngine, "close", recorded)
    monkeypatch.setattr(daemon, "policy_for", broken)
    config = replace(ServerConfig(), n_ctx=256, max_sessions=1, bmt_budget_gbps=0.0)
    with pytest.raises(RuntimeError, match="injected"):
        daemon.load_other_model(StoreEntry("other", model_path, model_path.stat().st_size), config)
    assert closed == ["context"]


async def test_a_latency_cap_over_the_arbiters_pause_serves_several_models(
    autojump_clock: trio.abc.Clock,
) -> None:
    """SCHEDULER.md lets users raise --latency-cap; with a second model in the store a cap
    over 1.8 was a start-up traceback (the arbiter's pause must not be under the cap)."""
    async with daemon(Shelf(), latency_cap=2.0) as (server, _):
        async with UmaClient.connect(socket_of(server)) as client:
            done = await client.complete(prompt="word " * 20, max_tokens=4, model="b")
    assert done.eos.reason == "length"


@pytest.mark.model
async def test_with_no_mmap_a_loaded_model_s_file_may_be_truncated(
    llama_model: LlamaModel, server_config: ServerConfig, model_path: Path, tmp_path: Path
) -> None:
    """Found by review: a loaded model's file copied over or truncated in place killed the whole
    daemon (SIGBUS, exit 135) at the next request, every model's clients with it: its pages
    were mapped.  --no-mmap reads the weights into the daemon's memory (CONFIG.md --mmap)."""
    await trio.to_thread.run_sync(shutil.copyfile, model_path, tmp_path / "other.gguf")
    async with running_server(
        llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path, mmap=False
    ) as server:
        before = await greedy(server, "other", "The capital of France is")
        with open(tmp_path / "other.gguf", "r+b") as file:  # noqa: ASYNC230 - a truncate, at once
            file.truncate(1 << 20)
        assert await greedy(server, "other", "The capital of France is") == before
        assert server.models.state("other") == "loaded"


@pytest.mark.model
def test_a_loaded_model_s_file_truncated_under_mmap_leaves_a_trace_of_the_crash(
    model_path: Path, tmp_path: Path
) -> None:
    """Several-models review: the documented SIGBUS (a loaded model's file truncated in place
    under --mmap, MODELS.md) killed the daemon with no line at all; the operator could not tell
    why it was gone.  Now Python's fault handler writes the fatal error and each thread's stack."""
    served, sock, err = tmp_path / "m.gguf", tmp_path / "d.sock", tmp_path / "serve.err"
    shutil.copyfile(model_path, served)
    serve = [
        sys.executable, "-m", "uma_trio", "serve", "--model", str(served), "--socket", str(sock),
        "--bmt-budget-gbps", "20", "--n-ctx", "512", "--max-sessions", "1",
    ]  # fmt: skip
    generate = [sys.executable, "-m", "uma_trio", "generate", "--prompt", "The capital of France is",
                "--max-tokens", "4", "--socket", str(sock)]  # fmt: skip
    with err.open("w") as stderr:
        daemon = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(generate, capture_output=True, timeout=60).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.5)
        with served.open("r+b") as file:
            file.truncate(1 << 20)
        subprocess.run(generate, capture_output=True, timeout=60)
        code = daemon.wait(timeout=60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert code == -signal.SIGBUS, (code, err.read_text()[-2000:])
    assert "Fatal Python error: Bus error" in err.read_text()


async def test_an_http_request_waiting_for_room_gives_its_place_up_when_its_client_hangs_up() -> None:
    """Review: a request for model c waiting for room (every loaded model busy) kept waiting
    after its client had gone, and once b went idle, b was unloaded and c loaded for nobody."""
    from uma_trio.daemon import http_gateway

    shelf = Shelf(cost=CostCoefficients(fixed_s=0.02, source="test: 20 ms a step"))
    async with daemon(shelf, max_loaded=2, http="127.0.0.1:0") as (server, _):
        async with http_gateway(server.config, "sim.gguf") as gateway:
            assert gateway is not None and gateway.url is not None
            gateway.attach(server)
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
                busy = {"model": "b", "prompt": "go", "max_tokens": 100, "stream": True}
                async with streaming(http, busy):
                    wanted = {"model": "c", "prompt": "hi", "max_tokens": 2}
                    with pytest.raises(httpx.ReadTimeout):  # waits for room, and its client leaves
                        await http.post("/v1/completions", json=wanted, timeout=0.3)
                await trio.sleep(0.5)  # b idle: room, but nobody wants c any more
                assert "c" not in shelf.engines and states(server)["b"] == "loaded"
                answered = await http.post(
                    "/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2}
                )
                assert answered.status_code == 200 and states(server)["c"] == "loaded"


async def test_a_request_waiting_for_room_at_shutdown_is_told_the_daemon_is_stopping(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Docs review: a request waiting for room when the drain began was refused at once with
    E_LIMIT_004 "every loaded model stayed busy for 60 s" (untrue, and not MODELS.md's
    E_LIMIT_008 for a request still waiting for its model at shutdown)."""
    shelf = Shelf(cost=CostCoefficients(fixed_s=0.5, source="test: half a second a step"))
    async with daemon(shelf, max_loaded=2) as (server, _), UmaClient.connect(socket_of(server)) as c:
        codes: list[str] = []

        async def waiting() -> None:
            with pytest.raises(RequestFailed) as refused:
                await c.complete(prompt="hi", max_tokens=2, model="c")
            codes.append(refused.value.event.code)

        async def busy() -> None:  # drained with the daemon, however it ends
            with contextlib.suppress(RequestFailed):
                await c.complete(prompt="hi", max_tokens=40, model="b")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(busy)
            await trio.sleep(2.0)
            nursery.start_soon(waiting)
            await trio.sleep(5.0)
            server.request_shutdown()
    assert codes == ["E_LIMIT_008"] and "c" not in shelf.engines
