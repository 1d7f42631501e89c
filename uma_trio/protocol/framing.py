"""Length-prefixed framing: ``uint32 little-endian length | payload``.

Sans-I/O in the h11 style: feed whatever bytes arrived, get back complete
payloads.  The decoder never reads a socket and never blocks, so it can be
tested by feeding one byte at a time.
"""

from __future__ import annotations

import struct

from .errors import ErrorCode, UmaError

_HEADER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Reassembles frames from an arbitrary split of the byte stream.

    A length prefix above ``max_frame_bytes`` raises a fatal :class:`UmaError`:
    after a bogus length nothing that follows can be trusted, so the caller
    reports it and closes the connection.  The check happens as soon as the
    4-byte header is in, so an attacker cannot make us buffer a huge frame.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        """Add ``data`` and return every payload it completed, in order."""
        self._buffer += data
        frames: list[bytes] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER_SIZE:
            (length,) = _HEADER.unpack_from(self._buffer, offset)
            if length > self._max:
                raise UmaError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame length {length} exceeds the limit of {self._max} bytes",
                    fatal=True,
                )
            end = offset + HEADER_SIZE + length
            if len(self._buffer) < end:
                break
            frames.append(bytes(self._buffer[offset + HEADER_SIZE : end]))
            offset = end
        if offset:
            del self._buffer[:offset]
        return frames
