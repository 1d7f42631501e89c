"""Pulling a GGUF from a model hub into the model store (``uma-trio pull``, ``POST /api/pull``).

``huggingface_hub`` does the talking: the repository's file list with each file's size and
sha256 (``model_info(files_metadata=True)``), then a cache-aware download
(``hf_hub_download``); ``HF_ENDPOINT`` points it at a mirror or a local server.  A reference is
``user/repo`` or ``user/repo:QUANT`` (Ollama's ``hf.co/user/repo:QUANT`` too): the file whose
name carries that quantization, else the repository's only GGUF, else its Q4_K_M.

Nothing half-written joins the store: the file is downloaded under ``.pull/`` in the store
directory (not a ``*.gguf`` the store lists), checked (GGUF magic, size, and sha256 where the
hub gives one), and only then linked into place; a failed check deletes it.  Each pull has
a staging folder of its own; a pull of a file already being pulled waits for that one, and
staging folders nothing has touched for 10 minutes (a pull whose process ended) are removed.

A file of that name already in the store is never replaced: it counts as pulled when it is
the hub's file (its sha256, or without one its size), and is otherwise a 409.  A file's sha256
is read once: it is kept, in this process, until the file's inode, size, mtime or ctime
changes, so a front end that pulls again does not read a 20 GB file each time.  The disk
check counts the bytes the other pulls of this process have still to write.  Blocking: the
daemon runs it in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model_files import sha256_of

GGUF_MAGIC = b"GGUF"
DISK_MARGIN = 1 << 30  # bytes left free besides the file: the store's disk is the user's too
STALE_S = 600.0  # a staging folder untouched this long is a pull whose process ended
_SILENT = io.StringIO()  # where huggingface_hub's own progress bar is drawn: nowhere
_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # split GGUFs: not supported yet
# A download's OSError that is the store's failure (the daemon's 507/500), not the hub's (502).
_STORE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})
# Network errors that are OSErrors with an errno: ssl.SSLError's is an SSL code (1 is EPERM's).
_NETWORK_ERRORS = (ssl.SSLError, ConnectionError, TimeoutError, socket.gaierror, socket.herror)


class PullError(Exception):
    """The reference, the hub or the file is not right; the message says which, and ``status``
    is the HTTP status ``/api/pull`` answers with (400 the reference, 404 nothing to pull
    there, 409 another file of that name in the store, 502 the hub or what it sent, 507 too
    little disk)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int | None
    sha256: str | None


# (what is happening, bytes done, bytes in all): "downloading", "verifying", "done".
Progress = Callable[[str, int, int], None]


def parse_reference(reference: str) -> tuple[str, str | None]:
    """``user/repo[:QUANT]`` → (repository, quantization or None)."""
    ref = reference.strip().removeprefix("https://").removeprefix("hf.co/").removeprefix("huggingface.co/")
    repo, _, quant = ref.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PullError(f"{reference!r}: give a repository as user/repo, optionally :QUANT (e.g. :Q4_K_M)")
    return repo, quant or None


def choose_file(files: list[HubFile], quant: str | None, repo: str) -> HubFile:
    """The GGUF ``quant`` names (case-insensitive, in the file name), else the only one, else
    the Q4_K_M; split files and multimodal projectors are left out."""
    ggufs = [f for f in files if f.name.endswith(".gguf") and "/" not in f.name and "mmproj" not in f.name]
    whole = [f for f in ggufs if not _PART.search(f.name)]
    if not ggufs:
        raise PullError(f"{repo} has no GGUF file", 404)
    if not whole:
        raise PullError(
            f"{repo} has only split GGUF files ({ggufs[0].name}, ...), which uma-trio cannot pull yet", 404
        )
    if quant is not None:
        matching = [f for f in whole if quant.lower() in f.name.lower()]
        if not matching:
            names = ", ".join(f.name for f in whole)
            raise PullError(f"{repo} has no {quant} GGUF; it has {names}", 404)
        return min(matching, key=lambda f: len(f.name))
    if len(whole) == 1:
        return whole[0]
    preferred = [f for f in whole if "q4_k_m" in f.name.lower()]
    if preferred:
        return preferred[0]
    names = ", ".join(f.name for f in whole)
    raise PullError(f"{repo} has several GGUF files: name one as {repo}:QUANT ({names})")


def hub_files(repo: str) -> list[HubFile]:
    """The repository's files, with sizes and sha256 where the hub has them."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        info = HfApi(endpoint=os.environ.get("HF_ENDPOINT")).model_info(repo, files_metadata=True)
    except RepositoryNotFoundError:
        raise PullError(f"{repo}: no such repository on the hub (or it is private)", 404) from None
    except HFValidationError as exc:  # a ValueError: the id is not one the hub allows
        raise PullError(f"{repo!r} is not a repository id: {exc}") from None
    # huggingface_hub 1.x raises httpx's errors (no OSError) for a hub it cannot reach, and
    # others of its own: every one is the hub's failure, not an internal error.
    except Exception as exc:
        raise PullError(f"{repo}: the hub at {_endpoint()} did not answer ({_reason(exc)})", 502) from None
    files = []
    for sibling in info.siblings or []:
        lfs: Any = sibling.lfs
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        files.append(HubFile(sibling.rfilename, sibling.size, sha))
    return files


_LOCKS_LOCK = threading.Lock()
_LOCKS: dict[Path, threading.Lock] = {}


def _lock_for(target: Path) -> threading.Lock:
    """One lock per file pulled into a store (pulls run in worker threads)."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(target.resolve(), threading.Lock())


def pull(reference: str, store: Path, progress: Progress | None = None) -> Path:
    """Download ``reference``'s GGUF into ``store`` (checked, then linked into place); the
    file's path.  The hub's file already there is kept; another of its name is a 409."""
    report = progress or (lambda _what, _done, _total: None)
    repo, quant = parse_reference(reference)
    chosen = choose_file(hub_files(repo), quant, repo)
    target = store / chosen.name
    # A second pull of a file being pulled (a client that hung up and asked again) waits for
    # the first and then finds it there.
    with _lock_for(target):
        if target.exists():
            return _already_there(target, chosen, repo, report)
        _remove_stale(store / ".pull")
        store.mkdir(parents=True, exist_ok=True)  # the CLI's first pull makes the store
        with _space_for(store, chosen) as reservation:
            # A folder of its own: pulls of one repository's files shared one, and the first
            # to end removed the other's download.
            staging = _staging_folder(store / ".pull", repo.replace("/", "--") + ".")
            try:
                downloaded = Path(_download(repo, chosen, staging, reservation.counting(report)))
                report("verifying", 0, chosen.size or 0)
                digest = check(downloaded, chosen)
                if not _place(downloaded, target):  # another process's pull put one there meanwhile
                    return _already_there(target, chosen, repo, report)
                placed = target.stat()
            finally:  # nothing half-written stays, whatever happened
                shutil.rmtree(staging, ignore_errors=True)
                with contextlib.suppress(OSError):  # the last pull under way leaves no .pull behind
                    staging.parent.rmdir()
        if digest is not None:  # read before it was linked: not read again when pulled again
            _remember_digest(target, placed, digest)
    size = target.stat().st_size
    report("done", size, size)
    return target


def _place(downloaded: Path, target: Path) -> bool:
    """Move ``downloaded`` to ``target`` unless a file is there (False): a link, unlike a
    rename, never replaces one, even one another process (``uma-trio pull``) just put there."""
    try:
        os.link(downloaded, target)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links (exFAT): checked, then renamed
        if target.exists():
            return False
        os.rename(downloaded, target)
    return True


def _already_there(target: Path, chosen: HubFile, repo: str, report: Progress) -> Path:
    """``target`` if it is the hub's file (its sha256; without one, its size), else a 409:
    anyone may publish a file of the same name, and the store's must not be swapped."""
    size = target.stat().st_size
    if chosen.sha256 is not None:
        report("verifying", 0, size)
        same = chosen.size in (None, size) and _digest(target) == chosen.sha256
    else:
        same = chosen.size is not None and size == chosen.size
    if not same:
        raise PullError(
            f"the model store already has a different {chosen.name} from {repo}'s; "
            "remove or rename it to pull this one",
            409,
        )
    report("done", size, size)
    return target


def _remove_stale(parent: Path) -> None:
    """Staging folders nothing in has changed for :data:`STALE_S`: pulls a daemon that exited
    left (its pull threads do not hold it up).  A live pull, of another process too, writes."""
    if not parent.is_dir():
        return
    for folder in parent.iterdir():
        try:
            newest = max(p.lstat().st_mtime for p in (folder, *folder.rglob("*")))
        except OSError:  # removed meanwhile by the pull that owned it
            continue
        if time.time() - newest > STALE_S:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(eq=False)  # removed from _RESERVED by identity
class _Reservation:
    """The disk space a pull under way still needs: its file's size less what it wrote."""

    device: int
    size: int
    written: int = 0  # set by the pull's thread, read under _SPACE_LOCK: an int, atomic

    def counting(self, report: Progress) -> Progress:
        """``report``, keeping :attr:`written` up to date from the download's progress."""

        def counted(what: str, done: int, total: int) -> None:
            if what == "downloading":
                self.written = done
            report(what, done, total)

        return counted


_SPACE_LOCK = threading.Lock()
_RESERVED: list[_Reservation] = []  # the pulls of this process between their check and end


@contextlib.contextmanager
def _space_for(store: Path, chosen: HubFile) -> Iterator[_Reservation]:
    """A 507 unless the disk has room for the file and :data:`DISK_MARGIN` more, besides
    what the other pulls under way (in this process) still have to write to it: checked
    and reserved at once, so two pulls cannot both count the same free space.  The
    reservation lasts until the pull ends, however it ends."""
    with _SPACE_LOCK:
        device = store.stat().st_dev
        free = shutil.disk_usage(store).free
        others = sum(max(r.size - r.written, 0) for r in _RESERVED if r.device == device)
        need = (chosen.size or 0) + DISK_MARGIN
        if free - others < need:
            pending = f", {others / 2**30:.1f} GiB of it for the pulls under way" if others else ""
            raise PullError(
                f"{chosen.name} needs {need / 2**30:.1f} GiB free in the model store "
                f"(its size and {DISK_MARGIN / 2**30:.0f} GiB to spare); "
                f"the disk has {free / 2**30:.1f} GiB{pending}",
                507,
            )
        reservation = _Reservation(device, chosen.size or 0)
        _RESERVED.append(reservation)
    try:
        yield reservation
    finally:
        with _SPACE_LOCK:
            _RESERVED.remove(reservation)


_DIGEST_LOCK = threading.Lock()
_DIGESTS: dict[Path, tuple[tuple[int, ...], str]] = {}  # a file → (what it was, its sha256)
_DIGESTS_KEPT = 256  # files remembered at most: the oldest is forgotten first


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when the file does: a file replaced (the inode), rewritten (the size, the
    mtime) or touched back to its old mtime after a write (the ctime, which no one sets)."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _digest(path: Path) -> str:
    """``path``'s sha256, read only when it is not the file last read under that path."""
    key = path.resolve()
    before = _identity(key)
    with _DIGEST_LOCK:
        known = _DIGESTS.get(key)
    if known is not None and known[0] == before:
        return known[1]
    digest = sha256_of(key)
    if _identity(key) == before:  # not changed while it was read
        _keep_digest(key, before, digest)
    return digest


def _remember_digest(path: Path, placed: os.stat_result, digest: str) -> None:
    """``digest`` is ``path``'s, read before it was linked there (``placed``: a link keeps the
    inode).  Taken after the staging link is removed, which changes the ctime."""
    key = path.resolve()
    identity = _identity(key)
    if identity[:4] == (placed.st_dev, placed.st_ino, placed.st_size, placed.st_mtime_ns):  # as placed
        _keep_digest(key, identity, digest)


def _keep_digest(key: Path, identity: tuple[int, ...], digest: str) -> None:
    with _DIGEST_LOCK:
        _DIGESTS.pop(key, None)  # put last: the newest
        _DIGESTS[key] = (identity, digest)
        while len(_DIGESTS) > _DIGESTS_KEPT:
            del _DIGESTS[next(iter(_DIGESTS))]


def _staging_folder(parent: Path, prefix: str) -> Path:
    """A new folder in ``parent``, made again if another pull, ending, removed it meanwhile."""
    while True:
        parent.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        except FileNotFoundError:
            continue


def check(path: Path, expected: HubFile) -> str | None:
    """GGUF magic, size and sha256; :class:`PullError` naming what differs.  The sha256 read
    (None where the hub gives none)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise PullError(f"{expected.name} is not a GGUF file (its first bytes are not GGUF)", 502)
    if expected.size is not None and size != expected.size:
        raise PullError(f"{expected.name}: {size} bytes arrived, the hub says {expected.size}", 502)
    if expected.sha256 is None:
        return None
    if (digest := sha256_of(path)) != expected.sha256:
        raise PullError(f"{expected.name}: sha256 {digest} is not the hub's {expected.sha256}", 502)
    return digest


def _endpoint() -> str:
    """The hub's address, for an error that says which hub failed."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _reason(exc: Exception) -> str:
    """An exception as one line: httpx's errors may have an empty message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _download(repo: str, chosen: HubFile, staging: Path, report: Progress) -> str:
    from huggingface_hub import hf_hub_download
    from tqdm.auto import tqdm

    class Reported(tqdm):  # type: ignore[misc]  # huggingface_hub's progress, to the caller
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = _SILENT  # the caller shows it (the CLI's line, /api/pull's events)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown: bool | None = super().update(n)
            report("downloading", int(self.n), int(self.total or chosen.size or 0))
            return shown

    try:
        return str(
            hf_hub_download(
                repo,
                chosen.name,
                local_dir=staging,
                endpoint=os.environ.get("HF_ENDPOINT"),
                tqdm_class=Reported,
            )
        )
    except Exception as exc:  # as in hub_files: httpx's errors and the hub client's own
        if _store_failure(exc, staging):
            raise  # writing the file failed (a full disk): the store's failure, not the hub's
        raise PullError(
            f"{repo}/{chosen.name}: the download failed ({_reason(exc)}; the hub at {_endpoint()})", 502
        ) from None


def _store_failure(exc: Exception, staging: Path) -> bool:
    """Whether a download's error is the store's: an OSError of writing (a full, read-only or
    forbidden disk) or one naming a file in the pull's staging folder.  Any other (a network
    error the hub client lets through, a TLS failure) is the hub's."""
    if not isinstance(exc, OSError) or isinstance(exc, _NETWORK_ERRORS):
        return False
    names = [os.fsdecode(n) for n in (exc.filename, exc.filename2) if isinstance(n, str | bytes | Path)]
    folder = os.path.realpath(staging)  # huggingface_hub may resolve the folder it was given
    return exc.errno in _STORE_ERRNOS or any(Path(os.path.realpath(n)).is_relative_to(folder) for n in names)
