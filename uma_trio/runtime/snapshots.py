"""Named KV snapshots on disk, so a saved prefix outlives the daemon.

One file per name, ``NAME.umakv``: a magic line, a 4-byte big-endian header
length, the JSON header, then llama.cpp's bytes for the sequence
(``llama_state_seq_get_data``).  The header names the model file's sha256 and
the KV type: llama.cpp only checks tensor shapes, so without it a snapshot of
another model with the same shape would load and silently answer nonsense.
The header also carries the KV bytes' length and sha256, checked before llama.cpp sees
them: it accepts altered cells silently (a review flipped 1,000 bytes and got other greedy
answers), and a truncated file whose prefix was already cached read as restored.
A snapshot's name is its file's: a file renamed or copied is listed and restored
under its new name (the header's ``name``, the one it was saved under, is not used),
so ``list`` shows exactly the names ``restore`` accepts.
:func:`encode` is pure; :class:`SnapshotStore` does the I/O, the header before the KV bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated

import msgspec
import platformdirs

from ..engine.base import KvState
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import SnapshotInfo, SnapshotName
from .unix_socket import UnsafeSocketDirError, ensure_private_dir

MAGIC = b"UMA-TRIO KV SNAPSHOT\n"
SUFFIX = ".umakv"
FORMAT_VERSION = 1
_LENGTH = struct.Struct(">I")

log = logging.getLogger(__name__)


class SnapshotHeader(msgspec.Struct, kw_only=True):
    version: int = FORMAT_VERSION
    name: str
    model: str  # the model file's name, for messages
    model_sha256: str
    kv_type: str
    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]  # what the cells hold, in order
    created_unix: float
    kv_layout: str = ""  # Engine.kv_layout ("" in files from before it was recorded)
    # The KV bytes' length and sha256 (-1 and "" in files from before they were recorded,
    # which are restored unchecked).
    state_bytes: int = -1
    state_sha256: str = ""

    def sealed(self, state: KvState) -> SnapshotHeader:
        """This header carrying ``state``'s length and digest (hashlib drops the GIL)."""
        digest = hashlib.sha256(state).hexdigest()
        return msgspec.structs.replace(self, state_bytes=len(state), state_sha256=digest)

    def check_state(self, name: str, size: int, state: bytes | None = None) -> str | None:
        """Why ``size`` KV bytes (and ``state``'s digest, when given) are not what this
        header says; None when they are."""
        if self.state_bytes >= 0 and size != self.state_bytes:
            saved = self.state_bytes
            return f"snapshot {name!r} is truncated or damaged: {size} KV bytes where it saved {saved}"
        if state is not None and self.state_sha256 and hashlib.sha256(state).hexdigest() != self.state_sha256:
            return f"snapshot {name!r} is corrupt: its KV bytes do not match the sha256 it was saved with"
        return None

    def info(self, size: int) -> SnapshotInfo:
        return SnapshotInfo(
            name=self.name, tokens=len(self.tokens), bytes=size, model=self.model,
            kv_type=self.kv_type, created_unix=self.created_unix,
        )  # fmt: skip


def default_snapshot_dir() -> Path:
    return Path(platformdirs.user_state_dir("uma-trio")) / "snapshots"


def _prefix(head: bytes) -> bytes:
    return MAGIC + _LENGTH.pack(len(head)) + head


def encode(header: SnapshotHeader, state: bytes) -> bytes:
    return _prefix(msgspec.json.encode(header)) + state


_PREFIX = len(MAGIC) + _LENGTH.size


def _header_length(prefix: bytes, name: str) -> int:
    if len(prefix) < _PREFIX or not prefix.startswith(MAGIC):
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} is not a uma-trio KV snapshot file")
    (length,) = _LENGTH.unpack_from(prefix, len(MAGIC))
    if length > MAX_HEADER_BYTES:
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} has an oversized header")
    return int(length)


def _parse_header(raw: bytes, name: str) -> SnapshotHeader:
    try:
        header = msgspec.json.decode(raw, type=SnapshotHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
        # msgspec raises UnicodeDecodeError for bad bytes in a string, not a DecodeError.
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} has a corrupt header: {exc}") from None
    if header.version != FORMAT_VERSION:
        version = f"format version {header.version}, not {FORMAT_VERSION}"
        raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} has {version}")
    # The file's name, not the saved one: a renamed file was listed as its old name, which
    # restore then could not find, and two copies were listed under one name.
    return msgspec.structs.replace(header, name=name)


def _read_header(file: IO[bytes], name: str) -> tuple[SnapshotHeader, int]:
    """The header at the start of ``file`` and the offset of the KV bytes after it."""
    length = _header_length(file.read(_PREFIX), name)
    return _parse_header(file.read(length), name), _PREFIX + length


def _untouched_since(path: Path, before: float) -> bool:
    """Whether ``path`` is a regular file (not a link) last written before ``before``."""
    try:
        info = path.lstat()
    except OSError:  # removed meanwhile
        return False
    return stat.S_ISREG(info.st_mode) and info.st_mtime < before


def _restorable(name: str) -> bool:
    """Whether ``restore`` accepts ``name`` (protocol/messages.py's SnapshotName)."""
    try:
        msgspec.convert(name, type=SnapshotName)
    except msgspec.ValidationError:
        return False
    return True


MAX_HEADER_BYTES = 16 << 20  # a header lists the prompt's tokens: 128 K of them is ~1.5 MB
DEFAULT_MAX_BYTES = 8 << 30  # a 32 K-cell f16 KV of an 8B model is 4 GiB
# A ``.NAME.*.tmp`` file untouched this long is a write that died with its daemon; a younger
# one may be another daemon's write in progress (a write touches it at every write call).
STALE_TMP_S = 60.0


class SnapshotStore:
    """Snapshot files in one directory, trusted only as far as it is checked.

    The directory must be private like the socket's (created 0700 on the first save; a real
    directory owned by us that nobody else can write to, not even sticky): a file planted
    there would be restored as a cached prefix and answer other requests.  Files are opened
    without following links and without blocking (a FIFO named ``*.umakv`` hung ``list`` and
    ``restore`` for good), must be regular files, and are read only up to ``max_bytes``;
    a snapshot over it is not written either (it could never be restored).
    """

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Remove the ``.NAME.*.tmp`` files of writes that a crash cut short (the daemon
        opens its store once, at start); each would hold up to ``max_bytes`` of disk for good."""
        try:
            if not self._check_directory():
                return
            before = time.time() - STALE_TMP_S
            stale = [path for path in self.directory.glob(".*.*.tmp") if _untouched_since(path, before)]
            for path in stale:
                path.unlink(missing_ok=True)
        except (UmaError, OSError) as exc:  # an unsafe directory is refused at its first use
            log.warning("stale snapshot temporary files not removed from %s: %s", self.directory, exc)
            return
        if stale:
            log.info("removed %d stale snapshot temporary file(s) from %s", len(stale), self.directory)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def _check_directory(self) -> bool:
        """True when the directory exists and is private; raise if it exists and is not."""
        if not os.path.lexists(self.directory):
            return False
        try:
            ensure_private_dir(self.directory, allow_sticky=False)
        except UnsafeSocketDirError as exc:
            message = str(exc).replace("the socket", "snapshots").replace("--socket", "--snapshot-dir")
            raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot directory refused: {message}") from None
        return True

    def _open(self, path: Path, name: str) -> tuple[int, int]:
        """A descriptor of the regular file at ``path`` (links not followed) and its size."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UmaError(
                ErrorCode.SNAPSHOT_NOT_FOUND, f"no snapshot named {name!r} in {self.directory}"
            ) from None
        except OSError as exc:  # ELOOP: a symbolic link
            raise UmaError(
                ErrorCode.SNAPSHOT_INVALID, f"cannot open snapshot {name!r}: {exc.strerror}"
            ) from None
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = f"belongs to uid {info.st_uid}"
        elif info.st_size > self.max_bytes:
            problem = f"has {info.st_size} bytes, more than the {self.max_bytes} a snapshot may have"
        if problem is not None:
            os.close(fd)
            raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} {problem}")
        return fd, info.st_size

    def _make_directory(self) -> None:
        if not self._check_directory():
            self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            old_umask = os.umask(0o077)
            try:
                self.directory.mkdir(mode=0o700, exist_ok=True)
            finally:
                os.umask(old_umask)
            self._check_directory()

    def _encoded_prefix(self, header: SnapshotHeader, state: KvState) -> bytes:
        """The file's bytes before ``state``; refused when :meth:`read` would refuse the file."""
        head = msgspec.json.encode(header)
        size = _PREFIX + len(head) + len(state)
        problem = None
        if len(head) > MAX_HEADER_BYTES:
            problem = f"a {len(head)}-byte header, more than the {MAX_HEADER_BYTES} a snapshot's may have"
        elif size > self.max_bytes:
            problem = f"{size} bytes, more than the {self.max_bytes} a snapshot may have"
        if problem is not None:
            raise UmaError(
                ErrorCode.SNAPSHOT_INVALID,
                f"snapshot {header.name!r} not saved: it would have {problem}, so it could never be "
                "restored (save a shorter prompt)",
            )
        return _prefix(head)

    def write(self, header: SnapshotHeader, state: KvState) -> SnapshotInfo:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        header = header.sealed(state)
        prefix = self._encoded_prefix(header, state)  # before anything is written
        self._make_directory()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{header.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(prefix)
                file.write(state)  # not joined to the prefix: that copied the whole state
            os.replace(tmp, self.path(header.name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return header.info(len(prefix) + len(state))

    def read(
        self, name: str, check: Callable[[SnapshotHeader], None] | None = None
    ) -> tuple[SnapshotHeader, bytes, int]:
        """The snapshot's header, KV bytes and file size (what ``save`` and ``list`` report as
        its ``bytes``).  ``check`` sees the header first and may raise: a snapshot this daemon
        refuses is not read past its header."""
        if not self._check_directory():
            raise UmaError(ErrorCode.SNAPSHOT_NOT_FOUND, f"no snapshot named {name!r} in {self.directory}")
        fd, size = self._open(self.path(name), name)
        with os.fdopen(fd, "rb") as file:
            try:
                header, start = _read_header(file, name)
                if check is not None:
                    check(header)
                if size <= start or not header.tokens:
                    raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} is truncated")
                state = file.read(size - start + 1)  # one more: a file grown meanwhile is seen
            except OSError as exc:
                raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"cannot read snapshot {name!r}: {exc}") from None
        if len(state) != size - start:
            raise UmaError(ErrorCode.SNAPSHOT_INVALID, f"snapshot {name!r} changed while it was read")
        problem = header.check_state(name, len(state), state)
        if problem is not None:
            raise UmaError(ErrorCode.SNAPSHOT_INVALID, problem)
        return header, state, size

    def list(self) -> list[SnapshotInfo]:
        """Every snapshot whose header reads and whose size matches it, by its file's name;
        other files, and those whose name ``restore`` would refuse (``_x.umakv``), are left
        out (the KV bytes' digest is checked only by ``restore``: they may be gigabytes)."""
        if not self._check_directory():
            return []
        infos = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            name = path.name.removesuffix(SUFFIX)
            if not _restorable(name):
                continue
            try:  # the header only: the KV bytes after it may be hundreds of MB
                fd, size = self._open(path, name)
                with os.fdopen(fd, "rb") as file:
                    header, start = _read_header(file, name)
                if header.check_state(name, size - start) is not None:
                    continue
                infos.append(header.info(size))
            except (UmaError, OSError):  # unreadable, oversized, not a regular file, or removed
                continue
        return infos
