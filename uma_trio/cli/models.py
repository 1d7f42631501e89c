"""``uma-trio ps|load|unload|pull``: the daemon's models, their state, and new ones from a hub
(docs/MODELS.md)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import anyio

from ..client import ConnectionLost, RequestFailed, UmaClient
from ..config import DEFAULT_SOCKET
from ..hub import PullError
from ..hub import pull as hub_pull
from ..model_store import default_models_dir, model_id
from ..protocol.messages import ModelsEvent
from .common import EXIT_SERVER_ERROR, EXIT_USAGE, SocketPath, daemon_failure

_NEWLINE = {True: "\n", False: ""}  # ends a progress line before an error, so it has a line of its own


def ps(*, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """List the daemon's models: loaded, loading or not, with their files and sizes.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    """
    return _models(socket, "list", None, None)


def load(model: str, *, keep_alive: float | None = None, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Load a model of the daemon's store now, before a request needs it.

    Parameters
    ----------
    model
        The model's id, file name or alias.
    keep_alive
        Seconds it stays loaded once idle (negative or inf: for good); default the daemon's --keep-alive.
    socket
        Unix socket path of the daemon.
    """
    if keep_alive is not None and math.isnan(keep_alive):  # JSON has no NaN: it was sent as null
        print("error: --keep-alive must be a number of seconds (negative or inf: for good)", file=sys.stderr)
        return EXIT_USAGE
    if keep_alive is not None and math.isinf(keep_alive):  # JSON has no infinity either
        keep_alive = -1.0
    return _models(socket, "load", model, keep_alive)


def unload(model: str, *, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Unload a model (at once if idle, else when its requests are done); --model's stays.

    Parameters
    ----------
    model
        The model's id, file name or alias.
    socket
        Unix socket path of the daemon.
    """
    return _models(socket, "unload", model, None)


def _models(socket: Path, op: str, model: str | None, keep_alive: float | None) -> int:
    async def ask() -> ModelsEvent:
        async with UmaClient.connect(socket) as client:
            fields = {} if keep_alive is None else {"keep_alive": keep_alive}
            return await client.models(op, model, **fields)

    try:
        event = anyio.run(ask)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    for m in event.models:
        note = " (--model)" if m["primary"] else ""
        aliases = f", also {', '.join(m['aliases'])}" if m["aliases"] else ""
        print(f"{m['id']:<40} {m['state']:<9} {m['bytes'] / 2**20:8.0f} MiB  {m['file']}{note}{aliases}")
    return 0


def pull(reference: str, *, models_dir: Path | None = None) -> int:
    """Download a GGUF from the Hugging Face hub (or HF_ENDPOINT) into the model store.

    Parameters
    ----------
    reference
        user/repo, or user/repo:QUANT to pick the file of that quantization (e.g. :Q4_K_M).
    models_dir
        The store (a daemon's --models-dir); default ~/.local/share/uma-trio/models.
    """
    store = models_dir or default_models_dir()
    shown = [0.0]
    mid_line = [False]  # a progress line is drawn, its newline not yet written

    def progress(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if what == "downloading" and now - shown[0] > 0.5:
            shown[0], mid_line[0] = now, True
            share = f"{100 * done / total:5.1f} %" if total else ""
            print(f"\rdownloading {done / 2**20:8.1f} MiB {share}", end="", file=sys.stderr, flush=True)
        elif what == "verifying":
            mid_line[0] = False
            print("\nverifying sha256", file=sys.stderr, flush=True)

    try:
        store.mkdir(parents=True, exist_ok=True)
        path = hub_pull(reference, store, progress)
    except PullError as exc:  # every hub failure is one (uma_trio/hub.py)
        print(f"{_NEWLINE[mid_line[0]]}error: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.status == 400 else EXIT_SERVER_ERROR  # 400: the reference
    except OSError as exc:
        print(f"{_NEWLINE[mid_line[0]]}error: the model store {store}: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB): a request may name it {model_id(path.name)}")
    return 0
