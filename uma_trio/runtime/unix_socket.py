"""The daemon's Unix socket: created 0600, stale files removed, live daemons respected."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import trio


class SocketInUseError(Exception):
    """Another daemon answers on the socket path, or the path is not ours to replace."""


def _probe_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    else:
        return True
    finally:
        probe.close()


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file no daemon listens on; refuse a live one or a non-socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    if _probe_live(path):
        raise SocketInUseError(f"another daemon is already listening on {path}")
    path.unlink(missing_ok=True)


async def bind_unix_listener(path: Path, backlog: int = 128) -> tuple[trio.SocketListener, int]:
    """Bind and listen with mode 0600; return the listener and the file's inode."""
    remove_stale_socket(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # no window in which the socket is world-accessible
    try:
        await sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return trio.SocketListener(sock), os.stat(path).st_ino


def unlink_if_ours(path: Path, inode: int) -> None:
    """Remove the socket file unless something else has replaced it meanwhile."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass
