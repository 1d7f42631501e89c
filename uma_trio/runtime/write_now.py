"""A write that never waits: what the socket and the HTTP server try first for each chunk.

trio's ``send_all`` takes two passes of its scheduler per write (the stream's lock and the
socket's checkpoints); a streamed token's chunk almost always fits the socket buffer, and on
two cores that host work runs beside the decode (BENCHMARKS.md "One stream on the CPU" and
"HTTP: a token's write").  So the writers call this first and hand only what the socket did
not take to ``send_all``.
"""

from __future__ import annotations

import os


def write_now(fd: int, data: bytes) -> int:
    """Bytes of ``data`` the socket ``fd`` takes without waiting (0 for a full buffer);
    OSError if the socket failed (the peer is gone)."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
