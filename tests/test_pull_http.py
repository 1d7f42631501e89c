"""``POST /api/pull`` on a live gateway (simulated engine), the hub's pull replaced: how many
pulls run at once, and what a failed one tells the client (the rest goes to the log).  The
pull itself, against a local hub, is tests/test_hub.py's."""

from __future__ import annotations

import errno
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


async def test_at_most_two_pulls_run_at_once_and_the_same_one_is_not_counted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: each request started a thread of its own, counted nowhere, so clients that
    hung up and asked for other repositories filled the disk with downloads."""
    release = threading.Event()
    started: list[str] = []

    def held(reference: str, store: Path, report: Progress) -> Path:
        started.append(reference)
        release.wait(10)
        raise PullError("the hub went away", 502)

    monkeypatch.setattr(pull_module, "pull", held)
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
    assert answer.status_code == status
    assert answer.json() == {"error": f"{message}; see the daemon's log"}
    assert streamed.text.splitlines()[-1] == f'{{"error":"{message}; see the daemon\'s log"}}'
    for text in (answer.text, streamed.text):
        assert "private-store" not in text and str(failure.args[-1]) not in text
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert str(failure.args[-1]) in logged and (str(store) in logged or not isinstance(failure, OSError))
