"""Who is on the other end of a connected Unix socket: the peer's effective uid, from the
kernel (``SO_PEERCRED`` on Linux, ``LOCAL_PEERCRED`` on macOS).

The kernel records these credentials when the socket is connected (for the daemon: the
client's) or when ``listen`` was called (for a client: the daemon's), so neither side can
forge them.  No trio or anyio here: the daemon and the client both use it.
"""

from __future__ import annotations

import socket
import struct
import sys
from typing import Protocol

# Linux: struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_UCRED = struct.Struct("iII")
# macOS: struct xucred {u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16];}
_XUCRED = struct.Struct("IIh16I")
_SOL_LOCAL = 0  # <sys/un.h>
_LOCAL_PEERCRED = 0x001
_XUCRED_VERSION = 0
_NO_UID = 0xFFFFFFFF  # (uid_t)-1: what Linux reports for a socket without a peer


class _Socket(Protocol):
    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def peer_uid(sock: _Socket) -> int | None:
    """The effective uid of the process at the other end of the connected Unix stream
    socket ``sock`` (a :class:`socket.socket` or a trio socket); None where the platform
    has no way to tell, or the kernel would not say."""
    try:
        if sys.platform == "linux":
            _pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            return None if uid == _NO_UID else uid
        if sys.platform == "darwin":
            raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, _XUCRED.size)
            version, uid = struct.unpack_from("II", raw)
            return uid if version == _XUCRED_VERSION else None
    except (OSError, struct.error):
        return None
    return None
