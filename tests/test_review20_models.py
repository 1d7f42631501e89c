"""Review 20, several models: a file added under a name an alias has, a request whose model
loads while the daemon begins to drain, memory counted free before a model's engine was,
keep_alive 0 while a model loads, /api/ps while the store forgets a model, and a model whose
decode loop cannot start.  Simulated engines; the loads and closes that must block do so in
their worker thread, on an event the test sets (so these tests run on the real clock)."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
from starlette.requests import Request

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.http import ollama as ollama_api
from uma_trio.http.flight import GatewayCore
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.model_store import ModelStore, StoreEntry
from uma_trio.observability.metrics import Metrics
from uma_trio.protocol.errors import ErrorCode, UmaError
from uma_trio.runtime.models import REAP_EVERY_S, LoadedModel, Loading, ModelHost

from .helpers import ids
from .test_models import Shelf, daemon, sim_model, states, two_other_models


def slow_shelf() -> tuple[Shelf, threading.Event]:
    """A shelf whose loads wait (in their worker thread) until the event is set."""
    release, shelf = threading.Event(), Shelf()
    plain_load = shelf.load

    def slow_load(entry: StoreEntry) -> LoadedModel:
        release.wait(10)
        return plain_load(entry)

    shelf.load = slow_load  # type: ignore[method-assign]
    return shelf, release


# -- 3. a file added later whose id or file name is already an alias --------------------------


def test_a_file_added_under_a_name_an_alias_has_is_left_out_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``coder.gguf`` pulled beside ``--alias coder=qwen.gguf`` was listed as ``coder`` while
    ``coder`` went on naming qwen: a model the list offered and no request could reach."""
    primary, shelf = tmp_path / "main.gguf", tmp_path / "shelf"
    shelf.mkdir()
    for path in (primary, shelf / "qwen.gguf"):
        path.write_bytes(b"GGUF")
    store = ModelStore.scan(primary, shelf, ["coder=qwen.gguf", "q.gguf=qwen"])
    for name in ("coder.gguf", "q.gguf", "new.gguf"):  # copied or pulled in since
        (shelf / name).write_bytes(b"GGUF")
    with caplog.at_level(logging.WARNING, logger="uma_trio.model_store"):
        again = store.rescanned().rescanned()
    assert ids(again) == ["main", "qwen", "new"]
    assert all(again.resolve(model) == model for model in ids(again))  # the list and resolve agree
    assert again.resolve("coder") == again.resolve("q.gguf") == "qwen" and again.resolve("q") is None
    warned = sorted(r.getMessage() for r in caplog.records if "skipping" in r.getMessage())
    assert len(warned) == 2, warned  # once per file, not per rescan
    assert "coder.gguf" in warned[0] and "'coder' is an --alias of the model 'qwen'" in warned[0]
    assert "q.gguf" in warned[1] and "'q.gguf' is an --alias of the model 'qwen'" in warned[1]


# -- 4. a request waiting for its model's load when the drain begins --------------------------


async def test_a_request_whose_model_loads_as_shutdown_begins_ends_shutting_down() -> None:
    """b's load ended after the drain had stopped the loops there were: b's new loop took
    the request, outside the drain, and its connection was cut after the flush timeout with
    no final event (or the request ran on during shutdown)."""
    shelf, release = slow_shelf()
    ends: list[str] = []
    async with daemon(shelf) as (server, _), UmaClient.connect(server.config.socket_path) as client:

        async def ask() -> None:
            try:
                done = await client.complete(prompt="word " * 20, max_tokens=4000, model="b")
                ends.append(f"eos {done.eos.reason}")
            except RequestFailed as failed:
                ends.append(failed.event.code)
            except Exception as exc:  # the connection cut: what the test rules out
                ends.append(f"{type(exc).__name__}: {exc}")

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                while states(server)["b"] != "loading":
                    await trio.sleep(0.01)
                server.request_shutdown()
                while server.loop.accepting:  # the drain has begun
                    await trio.sleep(0.01)
                release.set()
    assert ends == [ErrorCode.SHUTTING_DOWN]
    assert shelf.closed == ["b"]  # loaded all the same, and freed at shutdown


# -- 5. a model's memory counts until its engine is freed -------------------------------------


@pytest.mark.parametrize("limit", [{"max_loaded": 2}, {"budget_bytes": 3}])
async def test_a_model_being_freed_still_counts_against_the_limits(limit: dict[str, int]) -> None:
    """The reaper forgot b, then freed it in a worker thread: a load of c meanwhile saw b's
    bytes (and place) free and both were in memory at once, past the budget."""
    freeing, free = threading.Event(), threading.Event()
    live: set[str] = set()  # loaded and not yet freed
    most: list[int] = []  # how many were in memory at each load

    def load(entry: StoreEntry) -> LoadedModel:
        live.add(entry.id)
        most.append(len(live))

        def close() -> None:
            if entry.id == "b":
                freeing.set()
                free.wait(10)
            live.discard(entry.id)

        return sim_model(close)

    config = replace(SIM_CONFIG, keep_alive_s=0.0, max_loaded=limit.get("max_loaded", SIM_CONFIG.max_loaded))
    loading = Loading(load, budget_bytes=limit.get("budget_bytes"))
    host = ModelHost(two_other_models(), loading, config, Metrics(60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        host.release(await host.acquire("b"))  # keep-alive 0: the reaper frees it
        with trio.fail_after(10):
            while not freeing.is_set():
                await trio.sleep(0.01)
        try:
            async with trio.open_nursery() as requests:
                requests.start_soon(host.acquire, "c")
                await trio.sleep(0.3)
                loaded_meanwhile = "c" in host.units
                free.set()
        finally:
            free.set()
        assert "c" in host.units  # once b was freed
        nursery.cancel_scope.cancel()
    assert not loaded_meanwhile and most == [1, 1]


# -- 6. keep_alive 0 while the model loads -----------------------------------------------------


async def test_an_unload_asked_while_the_model_loads_unloads_it_after_its_request() -> None:
    """``unload`` (Ollama's keep_alive 0) of a model being loaded was dropped: it stayed
    for the loading request's keep-alive (here 300 s: the later word is the unload's)."""
    shelf, release = slow_shelf()
    async with (
        daemon(shelf) as (server, _),
        UmaClient.connect(server.config.socket_path) as client,
        UmaClient.connect(server.config.socket_path) as control,
    ):
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                ask = partial(client.complete, prompt="word " * 20, max_tokens=4, model="b", keep_alive=300)
                nursery.start_soon(ask)
                while states(server)["b"] != "loading":
                    await trio.sleep(0.01)
                await control.models("unload", "b")
                release.set()
            await trio.sleep(3 * REAP_EVERY_S)
        assert states(server)["b"] == "unloaded" and shelf.closed == ["b"]
        # The next load of b is not unloaded by that old request.
        await client.complete(prompt="hi", max_tokens=2, model="b")
        await trio.sleep(3 * REAP_EVERY_S)
        assert states(server)["b"] == "loaded"


# -- 7. /api/ps while a rescan forgets a model it listed --------------------------------------


async def test_api_ps_leaves_out_a_model_the_store_forgot_while_it_read_the_cards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ps read one card after another; meanwhile c's file was deleted, c unloaded and a
    listing rescanned: ``store.entry("c")`` raised KeyError, a 500."""
    primary, shelf = tmp_path / "main.gguf", tmp_path / "shelf"
    shelf.mkdir()
    for path in (primary, shelf / "b.gguf", shelf / "c.gguf"):
        path.write_bytes(b"GGUF")
    loading = Loading(lambda entry: sim_model())
    host = ModelHost(ModelStore.scan(primary, shelf), loading, SIM_CONFIG, Metrics(60.0))
    reading, go_on = threading.Event(), threading.Event()

    def card_of(path: Path) -> None:
        if path.name == "b.gguf":
            reading.set()
            go_on.wait(10)

    monkeypatch.setattr(ollama_api, "card_of", card_of)
    engine = {"model": {"weight_bytes": 4, "description": "sim"}, "gpu_layers": {"offloaded": 1, "total": 1}}
    primary_loop = SimpleNamespace(engine=SimpleNamespace(n_ctx_seq=64))
    ready = SimpleNamespace(describe_engine=lambda: engine, models=host, loop=primary_loop)
    api = ollama_api.OllamaApi(cast(GatewayCore, SimpleNamespace(_ready=lambda: ready, model="main")))
    answer: dict[str, Any] = {}

    async def ps() -> None:
        answer.update(json.loads(bytes((await api.ps(cast(Request, None))).body)))

    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        for model in ("b", "c"):
            await host.load(model, -1)
        with trio.fail_after(10):
            try:
                async with trio.open_nursery() as requests:
                    requests.start_soon(ps)
                    while not reading.is_set():
                        await trio.sleep(0.01)
                    (shelf / "c.gguf").unlink()
                    assert await host.unload("c", reason="test")
                    assert "c" not in [m["id"] for m in host.describe()]  # a listing meanwhile rescans
                    go_on.set()
            finally:
                go_on.set()
        nursery.cancel_scope.cancel()
    assert [m["name"] for m in answer["models"]] == ["main", "b"]


# -- 8. a model whose decode loop cannot start ------------------------------------------------


async def test_a_model_whose_loop_cannot_start_is_a_load_error_and_frees_its_engine(tmp_path: Path) -> None:
    """--tick-trace's per-model file that cannot be opened raised IsADirectoryError out of
    the request (not an UmaError) and left b's engine loaded for good."""
    (tmp_path / "trace.b.jsonl").mkdir()  # where b's steps would go
    closed: list[str] = []
    config = replace(SIM_CONFIG, tick_trace=tmp_path / "trace.jsonl")
    loading = Loading(lambda entry: sim_model(close=lambda: closed.append(entry.id)))
    host = ModelHost(two_other_models(), loading, config, Metrics(60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        with pytest.raises(UmaError) as refused:
            await host.acquire("b")
        assert closed == ["b"] and "b" not in host.units
        unit = await host.acquire("c")  # the others load as before
        assert unit.id == "c" and host.state("b") == "unloaded"
        nursery.cancel_scope.cancel()
    assert refused.value.code == ErrorCode.MODEL_LOAD
    assert "cannot start model 'b'" in refused.value.message and "trace.b.jsonl" in refused.value.message
