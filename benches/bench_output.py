"""Helpers the benchmark scripts share: CSV output under ``benches/results/``, free ports."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from uma_trio.loadgen.bench import write_csv as _write_csv


def write_csv(path: Path, rows: Iterable[Mapping[str, Any]], fieldnames: Sequence[str]) -> None:
    """:func:`uma_trio.loadgen.bench.write_csv`, and say where it went."""
    _write_csv(path, rows, fieldnames)
    print(f"wrote {path}")


def free_port() -> int:
    """A loopback TCP port free right now, for a server subprocess to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Figure(Protocol):
    def tight_layout(self) -> None: ...

    def savefig(self, fname: Path, *, dpi: int) -> None: ...


def save_figure(fig: Figure, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` as a PNG, and say where it went."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
