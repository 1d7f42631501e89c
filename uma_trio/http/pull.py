"""Ollama's ``POST /api/pull``: a GGUF from the hub into the model store (uma_trio/hub.py).

``{"model": "user/repo:QUANT", "stream": true}`` answers NDJSON as Ollama's does: ``pulling
manifest``, then ``downloading`` lines with ``total`` and ``completed`` bytes (at most four a
second), ``verifying sha256 digest``, and ``success``, or one ``{"error"}`` line; with
``"stream": false`` only the last of them, an error with its status (400 a bad reference, 404
nothing to pull there, 502 the hub unreachable or its file wrong, 500 anything else).  The
download runs in a thread of its own and goes on if the client hangs up (the same pull asked
again waits for it and finds the file); the daemon's store then lists the model, and a request
may name it by its file name without ``.gguf``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..hub import PullError, pull
from ..model_store import default_models_dir, model_id
from .flight import GatewayCore, answering_as, decode_body
from .responses import json_response

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 0.25


class PullBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older field name
    stream: bool = True
    insecure: bool = False  # accepted: the hub is reached as HF_ENDPOINT says


class PullApi:
    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [Route("/api/pull", answering_as("ollama", self.pull), methods=["POST"])]

    async def pull(self, request: Request) -> Response:
        body = decode_body(await self.gateway._body(request) or b"{}", PullBody)
        reference = body.model or body.name or ""
        models = self.gateway._ready().models
        store = models.store.directory or default_models_dir()
        outcome: dict[str, Any] = {}
        lines = self._pulling(reference, store, outcome)
        if body.stream:
            return StreamingResponse(_ndjson(lines), media_type="application/x-ndjson")
        last: dict[str, Any] = {}
        async for line in lines:
            last = line
        return json_response(last, status=outcome.get("status", 200))

    async def _pulling(
        self, reference: str, store: Path, outcome: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Progress lines while ``pull`` runs in a thread; then the store learns the file.
        ``outcome`` gets the pulled ``path``, or the ``error`` and its HTTP ``status``."""
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
            except OSError as exc:  # the store: not writable, full
                outcome.update(error=f"the model store {store}: {exc}", status=500)
            except Exception as exc:  # a bug: an error line, not a thread dying in silence
                log.exception("pull of %r failed", reference)
                outcome.update(error=f"internal error: {type(exc).__name__}: {exc}", status=500)

        yield {"status": "pulling manifest"}
        thread = threading.Thread(target=work, name="uma-pull", daemon=True)
        thread.start()
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
        yield {"status": "success", "model": model_id(Path(outcome["path"]).name)}


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for line in lines:
        yield msgspec.json.encode(line) + b"\n"
