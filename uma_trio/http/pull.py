"""Ollama's ``POST /api/pull``: a GGUF from the hub into the model store (uma_trio/hub.py).

``{"model": "user/repo:QUANT", "stream": true}`` answers NDJSON as Ollama's does: ``pulling
manifest``, then ``downloading`` lines with ``total`` and ``completed`` bytes (at most four a
second), ``verifying sha256 digest``, and ``success``, or one ``{"error"}`` line; with
``"stream": false`` only the last of them, an error with its status (400 a bad reference, 404
nothing to pull there, 409 another file of that name in the store, 502 the hub unreachable or
its file wrong, 507 too little disk, 500 anything else; the store's and internal failures in
detail in the daemon's log only).  The download runs in a thread of its own and goes on if the
client hangs up (the same pull asked again waits for it and finds the file); at most
:data:`MAX_PULLS` references are pulled at once, and at most :data:`MAX_WAITERS` requests wait
on one of them; another is a 429 before anything streams.  The daemon's store then lists the
model, and a request may name it by its file name without ``.gguf``; a file the store leaves
out (its name already another model's alias or id) is a 409 saying so, not a ``success``.  A
name the store already serves (no ``user/``) answers ``success`` at once: scripts pull to make
sure a model is there.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Container
from pathlib import Path
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..hub import PullError, parse_reference, pull
from ..model_store import ModelStore, default_models_dir, model_id
from ..protocol.openai import ApiError
from .flight import GatewayCore, decode_body, ollama_route
from .responses import json_response

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 0.25
MAX_PULLS = 2  # references pulled at once: each is a thread, a download and its disk space
MAX_WAITERS = 8  # requests for one reference at once (each a thread, most waiting on the first)


class PullBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older field name
    stream: bool = True
    insecure: bool = False  # accepted: the hub is reached as HF_ENDPOINT says


class PullApi:
    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway
        self._lock = threading.Lock()  # the pull threads, ending, take themselves off
        self._under_way: dict[str, int] = {}  # a reference being pulled → its threads

    def routes(self) -> list[Route]:
        return [Route("/api/pull", ollama_route(self.gateway, self.pull), methods=["POST"])]

    async def pull(self, request: Request) -> Response:
        body = decode_body(await self.gateway._body(request) or b"{}", PullBody)
        reference = body.model or body.name or ""
        models = self.gateway._ready().models
        if reference and "/" not in reference and (known := models.store.resolve(reference)) is not None:
            # A name the store already serves: scripts pull to make sure a model is there
            # (Ollama then checks its registry); there is no hub repository to ask.
            done = {"status": "success", "model": known}
            if body.stream:
                return StreamingResponse(_ndjson(_once(done)), media_type="application/x-ndjson")
            return json_response(done)
        store = models.store.directory or default_models_dir()
        outcome: dict[str, Any] = {}
        # Started here, before the response: a 429 has its status, and a client gone before
        # the first line leaves no count behind.
        thread, progress = self._start(reference, store, outcome)
        lines = self._pulling(thread, progress, outcome)
        if body.stream:
            return StreamingResponse(_ndjson(lines), media_type="application/x-ndjson")
        last: dict[str, Any] = {}
        async for line in lines:
            last = line
        return json_response(last, status=outcome.get("status", 200))

    def _start(
        self, reference: str, store: Path, outcome: dict[str, Any]
    ) -> tuple[threading.Thread, queue.SimpleQueue[dict[str, Any]]]:
        """``pull`` in a thread of its own, reporting to the queue; ``outcome`` gets the pulled
        ``path``, or the ``error`` and its HTTP ``status``.  A 429 past :data:`MAX_PULLS`
        (the same reference again waits for its pull, uncounted there), or past
        :data:`MAX_WAITERS` requests for one reference."""
        key = _key(reference)
        with self._lock:
            waiting = self._under_way.get(key, 0)
            if not waiting and len(self._under_way) >= MAX_PULLS:
                full = f"{MAX_PULLS} pulls are under way, the most at once; try again when one has ended"
            elif waiting >= MAX_WAITERS:
                full = (
                    f"{MAX_WAITERS} requests for this pull are under way, the most at once; "
                    "try again when it has ended"
                )
            else:
                full = None
            if full is not None:
                raise ApiError(429, full, type="rate_limit_error", code="too_many_pulls")
            self._under_way[key] = waiting + 1
        progress: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        last = [0.0]

        def report(what: str, done: int, total: int) -> None:
            if what == "downloading":
                now = time.monotonic()
                if now - last[0] < _REPORT_EVERY_S and done < total:
                    return
                last[0] = now
                progress.put({"status": "downloading", "total": total, "completed": done})
            elif what == "verifying":
                progress.put({"status": "verifying sha256 digest"})

        def work() -> None:
            try:
                store.mkdir(parents=True, exist_ok=True)
                outcome["path"] = pull(reference, store, report)
            except PullError as exc:
                outcome.update(error=str(exc), status=exc.status)
            except OSError as exc:  # the store: the client learns which kind, the log the rest
                log.warning("pull of %r into %s failed: %s", reference, store, exc)
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                kind = "is full" if full else "could not be written"
                outcome.update(
                    error=f"the model store {kind}; see the daemon's log", status=507 if full else 500
                )
            except Exception:  # a bug: an error line, not a thread dying in silence
                log.exception("pull of %r failed", reference)
                outcome.update(error="internal error while pulling; see the daemon's log", status=500)
            finally:
                self._done(key)

        thread = threading.Thread(target=work, name="uma-pull", daemon=True)
        try:
            thread.start()
        except BaseException:
            self._done(key)
            raise
        return thread, progress

    def _done(self, key: str) -> None:
        with self._lock:
            self._under_way[key] -= 1
            if not self._under_way[key]:
                del self._under_way[key]

    async def _pulling(
        self, thread: threading.Thread, progress: queue.SimpleQueue[dict[str, Any]], outcome: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Progress lines while the pull's ``thread`` runs; then the store learns the file.
        A pull that fails counts in the daemon's errors (``pull_failed``) as a refusal does."""
        try:
            async for line in self._lines(thread, progress, outcome):
                yield line
        finally:
            if "error" in outcome:
                status = int(outcome.get("status", 500))
                self.gateway._count_error(ApiError(status, str(outcome["error"]), code="pull_failed"))

    async def _lines(
        self, thread: threading.Thread, progress: queue.SimpleQueue[dict[str, Any]], outcome: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        while thread.is_alive() or not progress.empty():
            while not progress.empty():
                yield progress.get()
            if thread.is_alive():
                await trio.sleep(_REPORT_EVERY_S / 2)
        if "path" not in outcome:  # the thread ended with neither a file nor an error
            outcome.setdefault("error", "internal error: the pull ended without a file")
            outcome.setdefault("status", 500)
            yield {"error": outcome["error"]}
            return
        models = self.gateway._ready().models
        models.store = models.store.rescanned(loaded=models.units)
        path = Path(outcome["path"])
        if (refused := _not_served(models.store, path, models.units)) is not None:
            outcome.update(error=refused, status=409)
            yield {"error": refused}
            return
        yield {"status": "success", "model": model_id(path.name)}


def _not_served(store: ModelStore, path: Path, loaded: Container[str]) -> str | None:
    """None when ``store`` serves the pulled file at ``path`` under its id; else why not.
    The rescan leaves out a new file whose id or file name already names another model (an
    ``--alias``, the ``--model`` file's id): a ``success`` would name that other model."""
    pulled = model_id(path.name)
    served = store.resolve(pulled, loaded=loaded)
    if served is not None and _same_file(store.entry(served).path, path):
        return None
    for name in (pulled, path.name):
        owner = store.resolve(name, loaded=loaded)
        if owner is not None and not _same_file(store.entry(owner).path, path):
            what = "an --alias of" if name in store.entry(owner).aliases else "already the name of"
            return (
                f"{path.name} is in the model store, but {name!r} is {what} the model {owner!r}, "
                "which that name keeps serving; rename the file to serve it"
            )
    return f"{path.name} was pulled but is no longer in the model store"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _key(reference: str) -> str:
    """A reference as pulls share it: ``hf.co/A/B:q4_k_m`` and ``A/B:Q4_K_M`` are one pull."""
    try:
        repo, quant = parse_reference(reference)
    except PullError:  # refused at once, in its thread
        return reference
    return f"{repo}:{quant or ''}".lower()


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for line in lines:
        yield msgspec.json.encode(line) + b"\n"


async def _once(line: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield line
