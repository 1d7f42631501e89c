"""Named KV snapshots on disk, so a saved prefix outlives the daemon.

One file per name, ``NAME.umakv``: a magic line, a 4-byte big-endian header
length, the JSON header, then llama.cpp's bytes for the sequence
(``llama_state_seq_get_data``).  The header names the model file's sha256 and
the KV type: llama.cpp only checks tensor shapes, so without it a snapshot of
another model with the same shape would load and silently answer nonsense.
:func:`encode` and :func:`decode` are pure; :class:`SnapshotStore` does the I/O.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec
import platformdirs

from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import SnapshotInfo

MAGIC = b"UMA-TRIO KV SNAPSHOT\n"
SUFFIX = ".umakv"
FORMAT_VERSION = 1
_LENGTH = struct.Struct(">I")


class SnapshotHeader(msgspec.Struct, kw_only=True):
    version: int = FORMAT_VERSION
    name: str
    model: str  # the model file's name, for messages
    model_sha256: str
    kv_type: str
    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]  # what the cells hold, in order
    created_unix: float

    def info(self, size: int) -> SnapshotInfo:
        return SnapshotInfo(
            name=self.name, tokens=len(self.tokens), bytes=size, model=self.model,
            kv_type=self.kv_type, created_unix=self.created_unix,
        )  # fmt: skip


def default_snapshot_dir() -> Path:
    return Path(platformdirs.user_state_dir("uma-trio")) / "snapshots"


def encode(header: SnapshotHeader, state: bytes) -> bytes:
    head = msgspec.json.encode(header)
    return MAGIC + _LENGTH.pack(len(head)) + head + state


_PREFIX = len(MAGIC) + _LENGTH.size


def _header_length(prefix: bytes, name: str) -> int:
    if len(prefix) < _PREFIX or not prefix.startswith(MAGIC):
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} is not a uma-trio KV snapshot file")
    (length,) = _LENGTH.unpack_from(prefix, len(MAGIC))
    return int(length)


def _parse_header(raw: bytes, name: str) -> SnapshotHeader:
    try:
        header = msgspec.json.decode(raw, type=SnapshotHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} has a corrupt header: {exc}") from None
    if header.version != FORMAT_VERSION:
        version = f"format version {header.version}, not {FORMAT_VERSION}"
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} has {version}")
    return header


def decode(blob: bytes, name: str) -> tuple[SnapshotHeader, bytes]:
    """The header and state bytes of a snapshot file; :class:`UmaError` if it is not one."""
    end = _PREFIX + _header_length(blob, name)
    header = _parse_header(blob[_PREFIX:end], name)
    state = blob[end:]
    if not state or not header.tokens:
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} is truncated")
    return header, state


class SnapshotStore:
    """Snapshot files in one directory (created private, 0700, on the first save)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def write(self, header: SnapshotHeader, state: bytes) -> SnapshotInfo:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        blob = encode(header, state)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{header.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(blob)
            os.replace(tmp, self.path(header.name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return header.info(len(blob))

    def read(self, name: str) -> tuple[SnapshotHeader, bytes]:
        try:
            blob = self.path(name).read_bytes()
        except FileNotFoundError:
            raise UmaError(
                ErrorCode.SNAPSHOT_NOT_FOUND, f"no snapshot named {name!r} in {self.directory}"
            ) from None
        except OSError as exc:
            raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"cannot read snapshot {name!r}: {exc}") from None
        return decode(blob, name)

    def list(self) -> list[SnapshotInfo]:
        """Every snapshot whose header reads, by name; other files are left out."""
        infos = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            name = path.name.removesuffix(SUFFIX)
            try:  # the header only: the KV bytes after it may be hundreds of MB
                with path.open("rb") as file:
                    header = _parse_header(file.read(_header_length(file.read(_PREFIX), name)), name)
                infos.append(header.info(path.stat().st_size))
            except (UmaError, OSError):  # unreadable, or removed meanwhile
                continue
        return infos
