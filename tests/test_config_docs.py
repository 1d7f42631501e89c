"""docs/CONFIG.md and `uma-trio serve` agree (issue 18): every flag documented, every
documented flag real, and every plain-number default the same in both."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from uma_trio import cli
from uma_trio.config import ServerConfig

DOC = Path(__file__).parent.parent / "docs" / "CONFIG.md"


def documented() -> dict[str, str]:
    """The serve table's flags and their default cells."""
    table = DOC.read_text().split("| flag | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for flag in re.findall(r"`(--[a-z0-9-]+)", cells[0]):
            rows[flag] = cells[1]
    return rows


def serve_flags() -> dict[str, object]:
    return {
        "--" + name.replace("_", "-"): p.default
        for name, p in inspect.signature(cli.serve).parameters.items()
    }


def test_every_serve_flag_is_documented_and_every_documented_flag_exists() -> None:
    flags, docs = serve_flags(), documented()
    assert len(flags) > 40
    assert sorted(set(flags) - set(docs)) == []  # undocumented flags
    assert sorted(set(docs) - set(flags)) == []  # documented flags serve does not take


def test_plain_number_defaults_match() -> None:
    flags, docs = serve_flags(), documented()
    checked = 0
    for flag, cell in docs.items():
        if re.fullmatch(r"[0-9.]+", cell):
            assert float(cell) == flags[flag], f"{flag}: CONFIG.md says {cell}, serve uses {flags[flag]}"
            checked += 1
    assert checked >= 20


def test_serve_defaults_are_the_config_defaults() -> None:
    """The CLI takes its defaults from ServerConfig (cli._DEFAULTS), not from copies."""
    config = ServerConfig()
    flags = serve_flags()
    for name in ("max_sessions", "max_queue", "max_connections", "http_max_connections", "n_batch", "n_ctx"):
        assert flags["--" + name.replace("_", "-")] == getattr(config, name)
    assert flags["--idle-timeout"] == config.idle_timeout_s and flags["--tick-ms"] == config.tick_ms
