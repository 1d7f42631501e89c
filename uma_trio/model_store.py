"""The models a daemon may serve: the ``--model`` file, every GGUF in ``--models-dir``, and
``--alias NAME=FILE`` names for them, each under a stable id (the file name without
``.gguf``, as llama-server and LM Studio name theirs), so every daemon of a fleet answers the
same name.  Reading the directory is the only I/O; resolving a name is a dict look-up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs


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
        files = {model_id(primary.name): primary}
        directory = models_dir if models_dir is not None else default_models_dir()
        if models_dir is not None and not directory.is_dir():
            raise StoreError(f"--models-dir {directory}: not a directory")
        if directory.is_dir():
            for path in sorted(directory.glob("*.gguf")):
                if path.is_file():
                    files.setdefault(model_id(path.name), path)
        named: dict[str, list[str]] = {}
        for alias in aliases:
            name, sep, target = alias.partition("=")
            if not sep or not name or not target:
                raise StoreError(f"--alias {alias!r}: write NAME=FILE")
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
            named.setdefault(key, []).append(name)
        for key, names in named.items():  # a name that is another model's id would hide it
            for name in names:
                if name in files and name != key:
                    raise StoreError(f"--alias {name}={key}: {name!r} is already another model's id")
        primary_id = model_id(primary.name)
        return cls(
            (
                StoreEntry(key, path, _size(path), tuple(named.get(key, ())), primary=key == primary_id)
                for key, path in files.items()
            ),
            directory,
        )

    def rescanned(self) -> ModelStore:
        """This store with the directory's new ``*.gguf`` files (pulled, or copied in since)."""
        if self.directory is None or not self.directory.is_dir():
            return self
        new = [
            StoreEntry(model_id(path.name), path, _size(path))
            for path in sorted(self.directory.glob("*.gguf"))
            if path.is_file() and model_id(path.name) not in self._entries
        ]
        return ModelStore([*self._entries.values(), *new], self.directory) if new else self

    @property
    def primary(self) -> StoreEntry:
        return next(e for e in self._entries.values() if e.primary)

    def entries(self) -> list[StoreEntry]:
        return list(self._entries.values())

    def entry(self, model_id: str) -> StoreEntry:
        return self._entries[model_id]

    def resolve(self, name: str | None) -> str | None:
        """The id ``name`` means (None: the primary's); None when it names no model.  Ollama's
        clients add ``:latest`` to a bare name, which is dropped."""
        if name is None or name == "":
            return self.primary.id
        return self._names.get(name) or self._names.get(name.removesuffix(":latest"))

    def names(self) -> list[str]:
        """The ids, for an error that lists them."""
        return list(self._entries)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
