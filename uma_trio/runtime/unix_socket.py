"""The daemon's Unix socket: created 0600 in a private directory, stale files removed, live
daemons respected."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
import sys
from pathlib import Path

import trio


class SocketInUseError(Exception):
    """Another daemon answers on the socket path, or the path is not ours to replace (or it
    cannot be a Unix socket's path at all)."""


# A Unix socket's path, its terminating NUL included (``sun_path``): 104 bytes on macOS, 108
# on Linux.  The socket is bound under a staging name first, ``.NAME.`` and 8 hex digits.
SUN_PATH_BYTES = 104 if sys.platform == "darwin" else 108
STAGING_EXTRA = len("..") + 8


def staging_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}")


def check_socket_path(path: Path) -> None:
    """A path the socket can be bound at, its staging name included; SocketInUseError if not
    (it failed after the model had loaded, with a traceback)."""
    most = SUN_PATH_BYTES - 1 - STAGING_EXTRA
    if len(os.fsencode(path)) > most:
        raise SocketInUseError(
            f"--socket {path} is {len(os.fsencode(path))} bytes long; a Unix socket's path may have "
            f"at most {most} here (with its {STAGING_EXTRA}-byte staging name while it binds)"
        )


class UnsafeSocketDirError(SocketInUseError):
    """The socket's directory is not private to us: another user could replace the socket."""


def ensure_private_dir(directory: Path, *, allow_sticky: bool = True) -> None:
    """Make sure ``directory`` (the socket's parent) is ours alone, creating it 0700 if it
    is missing (its own parent must exist).  It must be a real directory, not a symbolic
    link, owned by our effective uid and writable by nobody else (or sticky and owned by root
    or us, like /tmp, where others cannot remove or rename our socket); otherwise another
    local user could remove our socket and put theirs in its place.  Without ``allow_sticky``
    (a directory whose files we read, where others must not even create names) a sticky one
    is refused too.  Raise
    :class:`UnsafeSocketDirError` naming what is wrong and what to do."""
    shown = os.path.abspath(directory)
    old_umask = os.umask(0o077)  # exactly 0700 whatever the umask, and no chmod to race with
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeSocketDirError(
            f"cannot create the socket directory {shown}: {exc.strerror or exc}; "
            "create it (mode 0700) or choose another --socket"
        ) from None
    finally:
        os.umask(old_umask)
    try:
        info = directory.lstat()
    except OSError as exc:
        raise UnsafeSocketDirError(f"cannot check the socket directory {shown}: {exc.strerror}") from None
    euid = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "it is a symbolic link, and the socket needs a real directory"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "it is not a directory"
    elif allow_sticky and mode & stat.S_ISVTX and info.st_uid in (0, euid):
        # Sticky and owned by root or us, like /tmp: others may create names here but not
        # remove or rename ours, and a name they took first is refused (remove_stale_socket).
        pass
    elif info.st_uid != euid:
        problem = f"it is owned by uid {info.st_uid} (mode {mode:04o}), not by this user (uid {euid})"
    elif mode & 0o022:
        problem = (
            f"its mode is {mode:04o}: other users can write to it, so they could replace the socket; "
            f"`chmod go-w {shown}` fixes that"
        )
    if problem is not None:
        raise UnsafeSocketDirError(
            f"refusing to serve in {shown}: {problem}. Fix or remove it, or give --socket a path "
            "in a directory only you can write to"
        )


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


def refuse_taken_socket(path: Path) -> bool:
    """SocketInUseError where ``path`` is not ours to bind (a live daemon's socket, another
    user's, not a socket); True where a stale socket of ours is there to replace."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    if info.st_uid != os.geteuid():
        raise SocketInUseError(
            f"{path} belongs to uid {info.st_uid}, not to this user; refusing to replace it"
        )
    if _probe_live(path):
        raise SocketInUseError(f"another daemon is already listening on {path}")
    return True


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file no daemon listens on; refuse a live one or a non-socket."""
    if refuse_taken_socket(path):
        path.unlink(missing_ok=True)


async def bind_unix_listener(path: Path, backlog: int = 128) -> tuple[trio.SocketListener, int]:
    """Bind and listen with mode 0600 in a private directory (:func:`ensure_private_dir`);
    return the listener and the file's inode.

    The socket is bound under a temporary name and renamed into place once it listens, so
    a client that sees ``path`` exist never meets "connection refused" (the window between
    ``bind`` and ``listen``)."""
    check_socket_path(path)
    ensure_private_dir(path.parent)
    remove_stale_socket(path)
    staging = staging_path(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # no window in which the socket is world-accessible
    try:
        await sock.bind(str(staging))
        os.chmod(staging, 0o600)
        sock.listen(backlog)
        os.link(staging, path)  # unlike rename, refuses a socket that appeared meanwhile
        staging.unlink()
    except OSError as exc:
        sock.close()
        staging.unlink(missing_ok=True)
        raise _cannot_create(path, exc) from exc
    finally:
        os.umask(old_umask)
    return trio.SocketListener(sock), os.stat(path).st_ino


def _cannot_create(path: Path, exc: OSError) -> SocketInUseError:
    return SocketInUseError(
        f"cannot create the socket {path}: {exc.strerror or exc}; give --socket a path in a "
        "directory this user can write to"
    )


def probe_socket_dir(path: Path) -> None:
    """Bind a socket under ``path``'s staging name and remove it: SocketInUseError where
    none can be created there (a read-only file system, /proc).  At start-up, so that fails
    in a second; the directory's other checks passed, and the bind itself failed only after
    the model had loaded, with a traceback."""
    staging = staging_path(path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(str(staging))
    except OSError as exc:
        raise _cannot_create(path, exc) from None
    finally:
        probe.close()
        with contextlib.suppress(OSError):
            staging.unlink()


def unlink_if_ours(path: Path, inode: int) -> None:
    """Remove the socket file unless something else has replaced it meanwhile."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass
