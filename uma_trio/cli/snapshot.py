"""``uma-trio snapshot save|restore|list``: named KV snapshots, through the daemon."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import anyio
import cyclopts
from cyclopts import Parameter

from ..client import ConnectionLost, RequestFailed, UmaClient
from ..config import DEFAULT_SOCKET
from ..protocol.messages import SnapshotEvent, SnapshotRequest
from .common import (
    EXIT_USAGE,
    SocketPath,
    daemon_failure,
)
from .request_check import option_problem

snapshot_app = cyclopts.App(
    name="snapshot",
    help="Save a prompt's KV cache under a name, restore it after a restart, or list snapshots.",
)


@snapshot_app.command(name="save")
def snapshot_save(
    name: str,
    *,
    prompt: Annotated[str | None, Parameter(allow_leading_hyphen=True)] = None,
    file: Path | None = None,
    system: bool = False,
    socket: SocketPath = DEFAULT_SOCKET,
) -> int:
    """Prefill a prompt and write its KV cells to the daemon's snapshot directory.

    Parameters
    ----------
    name
        Snapshot name: letters, digits, '.', '_' and '-'.
    prompt
        The prompt text.
    file
        Read the prompt text from this file instead.
    system
        Treat the text as a chat's system message (formatted with the model's chat template),
        so chats that start with it reuse the snapshot.
    socket
        Unix socket path of the daemon.
    """
    if (prompt is None) == (file is None):
        print("error: give exactly one of --prompt and --file", file=sys.stderr)
        return EXIT_USAGE
    try:
        text = prompt if prompt is not None else Path(file or "").read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # not UTF-8 is a ValueError: it was a traceback
        print(f"error: cannot read {file}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    fields: dict[str, Any] = {"prompt": text}
    if system:
        fields = {"messages": [{"role": "system", "content": text}]}
    return _snapshot(socket, "save", name, fields)


@snapshot_app.command(name="restore")
def snapshot_restore(name: str, *, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Load a saved snapshot into the prefix cache (checked against the loaded model).

    Parameters
    ----------
    name
        Snapshot name.
    socket
        Unix socket path of the daemon.
    """
    return _snapshot(socket, "restore", name, {})


@snapshot_app.command(name="list")
def snapshot_list(*, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """List the daemon's snapshots.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    """
    return _snapshot(socket, "list", None, {})


def _snapshot(socket: Path, op: str, name: str | None, fields: dict[str, Any]) -> int:
    request = {"type": "snapshot", "op": op, "name": name, **fields}
    if (problem := option_problem(request, SnapshotRequest, {"name": "snapshot name"})) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE

    async def ask() -> SnapshotEvent:
        async with UmaClient.connect(socket) as client:
            return await client.snapshot(op, name, **fields)

    try:
        event = anyio.run(ask)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    verb = {"save": "saved", "restore": "restored", "list": ""}[op]
    for info in event.snapshots:
        print(f"{verb + ' ' if verb else ''}{info.name}: {info.tokens} tokens, {info.bytes / 1e6:.1f} MB, "
              f"{info.model}, KV {info.kv_type}")  # fmt: skip
    return 0
