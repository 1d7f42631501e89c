"""The models a daemon may serve: the ``--model`` file, every GGUF in ``--models-dir``, and
``--alias NAME=FILE`` names for them, each under a stable id (the file name without
``.gguf``, as llama-server and LM Studio name theirs), so every daemon of a fleet answers the
same name.  Reading the directory is the only I/O, and a look-up whether a file found there
is still there when a request names it.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

_WARNED: set[str] = set()  # the files already warned about (skipped): once each, not per rescan


class StoreError(ValueError):
    """A bad ``--alias`` or ``--models-dir``: a start-up error naming the flag."""


def model_id(model_file: str) -> str:
    """A model's id: its file name without ``.gguf``."""
    return model_file.removesuffix(".gguf")


def default_models_dir() -> Path:
    """Where ``--models-dir`` points when not given (read only if it exists)."""
    return Path(platformdirs.user_data_dir("uma-trio")) / "models"


@dataclass(frozen=True, slots=True)
class StoreEntry:
    id: str
    path: Path
    size: int  # the file's bytes
    aliases: tuple[str, ...] = ()
    primary: bool = False  # the --model file: loaded at start-up, for good
    found: bool = False  # found in the directory: forgotten once its file is gone


class ModelStore:
    """The daemon's models by id, and every name a request may use for one."""

    def __init__(self, entries: Iterable[StoreEntry], directory: Path | None = None) -> None:
        self.directory = directory  # where pulled models go and new files are looked for
        self._entries = {e.id: e for e in entries}
        self._names: dict[str, str] = {}
        for entry in self._entries.values():
            for name in (entry.id, entry.path.name, *entry.aliases):
                self._names.setdefault(name, entry.id)

    @classmethod
    def scan(cls, primary: Path, models_dir: Path | None = None, aliases: Sequence[str] = ()) -> ModelStore:
        """The primary model, the directory's ``*.gguf`` files (sorted; the primary's id wins
        a clash) and the aliases (``NAME=FILE``, FILE a path or a file name in the store)."""
        primary_id = model_id(primary.name)
        files = {primary_id: primary}
        directory = models_dir if models_dir is not None else default_models_dir()
        if models_dir is not None and not directory.is_dir():
            raise StoreError(f"--models-dir {directory}: not a directory")
        found = _found_files(directory, primary)
        files.update(found)
        named = _aliases(aliases, files)
        # A directory file an --alias name takes is left out, as a rescan leaves out such a
        # file copied or pulled in while running: it must not stop the next start.
        for key, names in named.items():
            for name in names:
                hidden = next((k for k, path in found.items() if name in (k, path.name) and k != key), None)
                if hidden is not None and hidden not in named:
                    _warn_hidden(found[hidden], name, StoreEntry(key, files[key], 0, tuple(names)))
                    del files[hidden], found[hidden]
        _refuse_hiding(files, named)
        return cls(
            (
                StoreEntry(
                    key, path, _size(path), tuple(named.get(key, ())), primary=key == primary_id,
                    found=key != primary_id and found.get(key) == path,
                )
                for key, path in files.items()
            ),
            directory,
        )  # fmt: skip

    def rescanned(self, loaded: Container[str] = ()) -> ModelStore:
        """This store with the directory's new ``*.gguf`` files (pulled, or copied in since),
        less those found there before and deleted since (a request for one is then refused as
        a name the store has not, not as a corrupt file) unless they are in ``loaded``."""
        if self.directory is None:
            return self
        kept = [e for e in (_restated(e, loaded) for e in self._entries.values()) if e is not None]
        resized = any(e is not self._entries[e.id] for e in kept)
        known = {e.id for e in kept}
        # Every name a request may use already: a new file that would take one of them is left
        # out (the older one answered for it, so the new file was listed but unreachable).
        taken = {name: e for e in kept for name in (e.id, e.path.name, *e.aliases)}
        new = []
        for path in _gguf_files(self.directory):
            key = model_id(path.name)
            if key in known or not _is_gguf(path):
                continue
            if clash := next((name for name in (key, path.name) if name in taken), None):
                _warn_hidden(path, clash, taken[clash])
                continue
            new.append(entry := StoreEntry(key, path, _size(path), found=True))
            taken.update({key: entry, path.name: entry})
        if not new and not resized and len(kept) == len(self._entries):
            return self
        return ModelStore([*kept, *new], self.directory)

    @property
    def primary(self) -> StoreEntry:
        return next(e for e in self._entries.values() if e.primary)

    def entries(self) -> list[StoreEntry]:
        return list(self._entries.values())

    def entry(self, model_id: str) -> StoreEntry:
        return self._entries[model_id]

    def resolve(self, name: str | None, loaded: Container[str] = ()) -> str | None:
        """The id ``name`` means (None: the primary's); None when it names no model.  Ollama's
        clients add ``:latest`` to a bare name, which is dropped.  A model in ``loaded`` (ids)
        still serves from memory after its file is deleted, until it unloads."""
        if name is None or name == "":
            return self.primary.id
        found = self._names.get(name) or self._names.get(name.removesuffix(":latest"))
        if found is None or found in loaded:
            return found
        # A file deleted since the last scan: None, so the caller rescans and the store forgets it.
        return None if _gone(self._entries[found]) else found

    def offered(self) -> list[str]:
        """The ids and the --alias names, for an error that lists what a request may name."""
        return [name for e in self._entries.values() for name in (e.id, *e.aliases)]


def _aliases(aliases: Sequence[str], files: dict[str, Path]) -> dict[str, list[str]]:
    """Each model's ``--alias`` names by id; a path to a file not in the store joins
    ``files``.  A :class:`StoreError` for a bad one, or a name given twice for two files."""
    named: dict[str, list[str]] = {}
    first: dict[str, tuple[str, str]] = {}  # alias name → (id, the --alias that gave it)
    for alias in aliases:
        name, sep, target = alias.partition("=")
        if not sep or not name or not target:
            raise StoreError(f"--alias {alias!r}: write NAME=FILE")
        key = _alias_target(alias, target, files)
        key_before, given = first.setdefault(name, (key, alias))
        if key_before != key:  # the first one silently won
            raise StoreError(f"--alias {alias!r}: {name!r} is already --alias {given}, another model")
        if name not in named.setdefault(key, []) and name != key:  # its own id is no alias
            named[key].append(name)
    return named


def _alias_target(alias: str, target: str, files: dict[str, Path]) -> str:
    """The id of the model ``target`` names (a file of the store, or a path that joins it)."""
    key = model_id(Path(target).name)
    path = Path(target).expanduser()
    if Path(target).name != target and path.is_file() and key in files:
        if files[key].resolve() != path.resolve():  # a path: the file it names, or refused
            clash = f"{target} is not the store's {files[key]}, of the same name"
            raise StoreError(f"--alias {alias!r}: {clash}")
    elif key not in files:
        if not path.is_file():
            raise StoreError(f"--alias {alias!r}: no model file {target!r} in the store or on disk")
        files[key] = path
    return key


def _refuse_hiding(files: dict[str, Path], named: dict[str, list[str]]) -> None:
    """A :class:`StoreError` for an alias that is another model's id or file name: the
    first of them in the store's order answered for it, so one of the two was unreachable."""
    owner = {name: key for key, path in files.items() for name in (key, path.name)}
    for key, names in named.items():
        for name in names:
            if owner.get(name, key) != key:
                other = "id" if name == owner[name] else "file name"
                raise StoreError(f"--alias {name}={key}: {name!r} is already another model's {other}")


def _found_files(directory: Path, primary: Path) -> dict[str, Path]:
    """The directory's model files by id, in name order, less a file whose id or file name an
    earlier one (or the primary) already has: ``a.gguf.gguf`` (id ``a.gguf``) beside ``a.gguf``
    was listed, yet its id named model ``a``; a rescan leaves such a file out, and so does this."""
    taken = {model_id(primary.name): model_id(primary.name), primary.name: model_id(primary.name)}
    found: dict[str, Path] = {}
    for path in _gguf_files(directory):
        if not _is_gguf(path):
            continue
        key = model_id(path.name)
        clash = next((name for name in (key, path.name) if name in taken), None)
        if clash is None:
            found[key] = path
            taken.update({key: key, path.name: key})
        elif path.resolve() != primary.resolve():  # --model's own file found there: nothing to say
            owner = found.get(taken[clash], primary)
            _warn_hidden(path, clash, StoreEntry(taken[clash], owner, 0))
    return found


def _gguf_files(directory: Path) -> Iterator[Path]:
    """The directory's ``*.gguf`` files, sorted, less those whose name is not UTF-8: every
    answer that lists the models (JSON, metrics, an error naming them) would fail on it; and
    those whose name holds a control character (a newline, an escape): ``ps``, ``top`` and
    the log print model names as they are, so one forged lines and drove the terminal."""
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("*.gguf")):
        try:
            path.name.encode("utf-8")
        except UnicodeEncodeError:
            _warn_once(path)
            continue
        if not path.name.isprintable():
            _warn_once(path, "its name holds a control character")
            continue
        if path.is_file():
            yield path


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` starts as a GGUF file does: a notes file or an HTML error page saved
    as ``*.gguf`` was listed as a model (/v1/models, /api/tags, ``ps``) that no request could
    load.  A damaged GGUF file is still listed: its load fails, with the reason."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError:
        return False  # gone or unreadable: a request for it could not load it either
    if magic == b"GGUF":
        return True
    _warn_once(path, f"it is not a GGUF file (it starts {magic!r})")
    return False


def _warn_once(path: Path, why: str = "its name is not UTF-8") -> None:
    if str(path) in _WARNED:
        return
    _WARNED.add(str(path))
    try:
        shown = path.name.encode("utf-8").decode()
        if not shown.isprintable():
            shown = repr(shown)  # one log line, nothing for the terminal to act on
    except UnicodeEncodeError:  # a log line must be UTF-8 too
        shown = repr(path.name.encode("utf-8", "surrogateescape"))
    log.warning("skipping the model file %s in %s: %s", shown, path.parent, why)


def _warn_hidden(path: Path, name: str, owner: StoreEntry) -> None:
    """Once per file and name: ``path``, new in the directory, is not served: ``name`` (its id
    or file name) already names the model ``owner``."""
    key = f"{path}\0{name}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    what = "an --alias of" if name in owner.aliases else "already the name of"
    log.warning(
        "skipping the model file %s in %s: %r is %s the model %r; rename the file to serve it",
        path.name, path.parent, name, what, owner.id,
    )  # fmt: skip


def _gone(entry: StoreEntry) -> bool:
    """Found in the directory and deleted since (the --model file and aliased paths stay)."""
    return entry.found and not entry.path.is_file()


def _restated(entry: StoreEntry, loaded: Container[str]) -> StoreEntry | None:
    """``entry`` as its file is now, from one stat: None once :func:`_gone` (unless it is in
    ``loaded``), else with the file's size now (a file copied over kept the size it had when
    first listed: a 5-byte one replaced by the model still said 5)."""
    try:
        info = entry.path.stat()
    except OSError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        return entry if entry.id in loaded or not entry.found else None
    return replace(entry, size=info.st_size) if info.st_size and info.st_size != entry.size else entry


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
