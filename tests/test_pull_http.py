"""``POST /api/pull`` on a live gateway (simulated engine), the hub's pull replaced: how many
pulls run at once, and what a failed one tells the client (the rest goes to the log).  The
pull itself, against a local hub, is tests/test_hub.py's."""

from __future__ import annotations

import errno
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from uma_trio.http import pull as pull_module
from uma_trio.hub import Progress, PullError

from .test_http_hardening import gateway_on_sim

Pull = Callable[[str, Path, Progress], Path]


def held_pulls(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Pulls that wait (up to 10 s) for the returned event, then fail as a hub gone away; the
    references they were started for, in order."""
    release = threading.Event()
    started: list[str] = []

    def held(reference: str, store: Path, report: Progress) -> Path:
        started.append(reference)
        release.wait(10)
        raise PullError("the hub went away", 502)

    monkeypatch.setattr(pull_module, "pull", held)
    return release, started


async def test_at_most_two_pulls_run_at_once_and_the_same_one_is_not_counted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: each request started a thread of its own, counted nowhere, so clients that
    hung up and asked for other repositories filled the disk with downloads."""
    release, started = held_pulls(monkeypatch)
    async with gateway_on_sim() as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        server.models.store.directory = tmp_path
        try:
            with trio.fail_after(5):
                for reference in ("a/one:Q4_K_M", "b/two"):  # each client hangs up at once
                    async with http.stream("POST", "/api/pull", json={"model": reference}) as first:
                        assert first.status_code == 200
                refused = await http.post("/api/pull", json={"model": "c/three", "stream": False})
                assert refused.status_code == 429 and refused.headers["retry-after"]
                assert refused.json() == {
                    "error": "2 pulls are under way, the most at once; try again when one has ended"
                }
                async with http.stream("POST", "/api/pull", json={"model": "hf.co/a/one:q4_k_m"}) as again:
                    assert again.status_code == 200  # the same pull: it waits for the first
        finally:
            release.set()
        with trio.fail_after(5):
            while (
                after := await http.post("/api/pull", json={"model": "c/three", "stream": False})
            ).status_code == 429:
                await trio.sleep(0.05)
        assert after.status_code == 502 and after.json() == {"error": "the hub went away"}
        assert sorted(started) == ["a/one:Q4_K_M", "b/two", "c/three", "hf.co/a/one:q4_k_m"]


@pytest.mark.parametrize(
    ("failure", "status", "message"),
    [
        (OSError(errno.EACCES, "Permission denied"), 500, "the model store could not be written"),
        (OSError(errno.ENOSPC, "No space left on device"), 507, "the model store is full"),
        (RuntimeError("a bug, with its detail"), 500, "internal error while pulling"),
    ],
)
async def test_a_failed_pull_tells_the_kind_and_logs_the_detail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    failure: Exception, status: int, message: str,
) -> None:  # fmt: skip
    """Review: the store's path and the exception's text went to the HTTP client."""
    store = tmp_path / "private-store"
    if isinstance(failure, OSError):
        failure.filename = str(store / ".pull" / "x.gguf")

    def failing(reference: str, store: Path, report: Progress) -> Path:
        raise failure

    monkeypatch.setattr(pull_module, "pull", failing)
    caplog.set_level(logging.WARNING, logger=pull_module.__name__)
    async with gateway_on_sim() as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        server.models.store.directory = store
        answer = await http.post("/api/pull", json={"model": "a/one", "stream": False})
        streamed = await http.post("/api/pull", json={"model": "a/one"})
        failed_pulls = server.metrics.errors["pull_failed"]
    assert failed_pulls == 2  # counted as refusals are (they were not)
    assert answer.status_code == status
    assert answer.json() == {"error": f"{message}; see the daemon's log"}
    assert streamed.text.splitlines()[-1] == f'{{"error":"{message}; see the daemon\'s log"}}'
    for text in (answer.text, streamed.text):
        assert "private-store" not in text and str(failure.args[-1]) not in text
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert str(failure.args[-1]) in logged and (str(store) in logged or not isinstance(failure, OSError))


async def test_at_most_eight_requests_wait_on_one_pull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the same reference asked again is not counted against MAX_PULLS (it waits for
    the first), but each was a thread of its own without a cap: clients that hang up and ask
    again piled threads up.  Past MAX_WAITERS for one reference, a 429."""
    release, started = held_pulls(monkeypatch)
    assert pull_module.MAX_WAITERS == 8
    async with gateway_on_sim() as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        server.models.store.directory = tmp_path
        try:
            with trio.fail_after(5):
                for _ in range(pull_module.MAX_WAITERS):  # each client hangs up at once
                    async with http.stream("POST", "/api/pull", json={"model": "a/one"}) as first:
                        assert first.status_code == 200
                refused = await http.post("/api/pull", json={"model": "hf.co/a/one", "stream": False})
                assert refused.status_code == 429 and refused.headers["retry-after"]
                assert refused.json() == {
                    "error": "8 requests for this pull are under way, the most at once; "
                    "try again when it has ended"
                }
                async with http.stream("POST", "/api/pull", json={"model": "b/two"}) as other:
                    assert other.status_code == 200  # another reference is counted apart
        finally:
            release.set()
        with trio.fail_after(5):
            while (
                again := await http.post("/api/pull", json={"model": "a/one", "stream": False})
            ).status_code == 429:
                await trio.sleep(0.05)
        assert again.status_code == 502 and len(started) == pull_module.MAX_WAITERS + 2


@pytest.mark.parametrize(
    ("file", "answer"),
    [
        ("coder.gguf", "'coder' is an --alias of the model 'sim'"),
        ("sim.gguf", "'sim' is already the name of the model 'sim'"),
    ],
)
async def test_a_pulled_file_the_store_leaves_out_is_a_409_not_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, answer: str
) -> None:
    """Review: a new file whose id or file name is already another model's alias or id is
    left out by the store's rescan, yet /api/pull answered ``success`` with a ``model`` that
    named the other model.  Now a 409 saying which name and which model; a file of a free
    name is served under its id."""
    from dataclasses import replace

    from uma_trio.model_store import ModelStore

    def landing(reference: str, store: Path, report: Progress) -> Path:
        path = store / (reference.partition("/")[2] + ".gguf")
        path.write_bytes(b"GGUF pulled")
        return path

    monkeypatch.setattr(pull_module, "pull", landing)
    async with gateway_on_sim() as (server, _, url), httpx.AsyncClient(base_url=url) as http:
        entries = [replace(e, aliases=("coder",)) for e in server.models.store.entries()]
        server.models.store = ModelStore(entries, tmp_path)
        name = file.removesuffix(".gguf")
        refused = await http.post("/api/pull", json={"model": f"someone/{name}", "stream": False})
        streamed = await http.post("/api/pull", json={"model": f"someone/{name}"})
        served = await http.post("/api/pull", json={"model": "someone/fresh", "stream": False})
    message = (
        f"{file} is in the model store, but {answer}, which that name keeps serving; "
        "rename the file to serve it"
    )
    assert refused.status_code == 409 and refused.json() == {"error": message}
    assert json.loads(streamed.text.splitlines()[-1]) == {"error": message}
    assert served.status_code == 200 and served.json() == {"status": "success", "model": "fresh"}
    assert server.models.store.resolve("fresh") == "fresh" and server.models.store.resolve(name) == "sim"


async def test_pulling_a_model_the_store_serves_is_a_success_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama review: `/api/pull` of the served model was a 400 "give a repository as
    user/repo", where scripts pull to make sure a model is there.  A name the store serves
    answers success, whole or streamed, and nothing is fetched; another bare name is the 400."""
    fetched: list[str] = []

    def never(reference: str, store: Path, report: Progress) -> Path:
        fetched.append(reference)
        raise AssertionError("nothing is to be fetched")

    monkeypatch.setattr(pull_module, "pull", never)
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as http:
        whole = await http.post("/api/pull", json={"model": "sim:latest", "stream": False})
        streamed = await http.post("/api/pull", json={"model": "sim"})
        monkeypatch.undo()  # the hub's own check of a reference, which needs no network
        unknown = await http.post("/api/pull", json={"model": "nothing-here", "stream": False})
    assert whole.status_code == 200 and whole.json() == {"status": "success", "model": "sim"}
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert lines == [{"status": "success", "model": "sim"}]
    assert fetched == [] and unknown.status_code == 400 and "user/repo" in unknown.json()["error"]
