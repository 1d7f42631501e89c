"""``uma-trio top`` on narrow terminals and with several models: numbers are never cut, and
every row and the header say which model they are about (views.py, pure: no daemon)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from rich.console import Console

from uma_trio.observability.metrics import Metrics
from uma_trio.observability.scorecard import scorecard
from uma_trio.observability.views import dashboard, header, report, sessions_table

PRIMARY, OTHER = "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"


def _row(**fields: Any) -> dict[str, Any]:
    row = {
        "id": "chat-2-0", "connection": 4, "lane": "interactive", "phase": "decode", "parked": False,
        "prompt_tokens": 30, "prefilled": 30, "generated": 147, "max_tokens": 150, "age_ms": 3012.0,
        "gap_ms": 4.3, "eta_s": 0.1, "held": None, "model": PRIMARY,
    }  # fmt: skip
    return {**row, **fields}


def _busy_snapshot(in_flight: list[dict[str, Any]], models: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = Metrics(window_s=60.0)
    for i in range(40):  # slow requests: four-digit figures, "2,684.3"-like
        now = 10.0 + i * 0.5
        metrics.on_token_latency("interactive", now, ttft_s=2.6843, gap_s=0.0164)
        metrics.on_completed("interactive", 12.345, now)
        metrics.on_admitted("background", 1.2345, now)
        metrics.on_tick(now, step_s=0.015, overhead_s=0.001, decode_tokens=3, prefill_tokens=0,
                        generated=3, bmt_bytes=10**8, cap_s=0.018)  # fmt: skip
    snapshot: dict[str, Any] = metrics.snapshot(31.0)
    snapshot.update(
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        sessions={"active": len(in_flight), "waiting": 0, "prefilling": 1, "decoding": 1, "parked": 0},
        kv={"cells_used": 349, "cells_total": 32_768, "cells_reserved": 2_400},
        process={"rss_bytes": 904 * 2**20, "open_fds": 19, "gc_pause_max_ms": 0.8},
        scorecard=msgspec.to_builtins(scorecard(metrics, 31.0, latency_cap=1.2, rss_bytes=904 * 2**20)),
        in_flight=in_flight,
        models=models,
    )
    return snapshot


def _models(*states: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"id": i, "state": state, "primary": n == 0} for n, (i, state) in enumerate(states)]


def _two_models_in_flight() -> dict[str, Any]:
    rows = [
        _row(),
        _row(id="bulk-summarise-quarterly-report-0", connection=5, lane="background", phase="prefill",
             prompt_tokens=2000, prefilled=1841, generated=0, max_tokens=200, gap_ms=1980.7, eta_s=12.5,
             held="budget", model=OTHER),
    ]  # fmt: skip
    snapshot = _busy_snapshot(rows, _models((PRIMARY, "loaded"), (OTHER, "loaded")))
    snapshot["kv_loaded"] = {"cells_reserved": 2_600, "cells_total": 65_536}
    return snapshot


def _screen(renderable: Any, width: int) -> str:
    console = Console(width=width, record=True)
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [140, 80, 60])
def test_top_never_cuts_a_number_on_a_narrow_terminal(width: int) -> None:
    """Rich shrank every column evenly: TTFT read "2,68…" and the prompt "1841…" at 80
    columns.  Numbers stay whole; text columns take the ellipsis."""
    screen = _screen(dashboard(_two_models_in_flight()), width)
    assert max(len(line) for line in screen.splitlines()) <= width
    for figure in ("2,684.3", "12,345.0", "1,234.5", "1841/2000", "147/150", "0/200", "1,980.7", "16.4"):
        assert figure in screen, (width, figure, screen)
    assert not re.search(r"(?<![\w.-])[\d,./]+…", screen), screen  # no number ends in "…"
    assert "chat-" in screen and "bulk" in screen  # ids shortened at worst, never dropped


def test_the_whole_report_fits_too() -> None:
    screen = _screen(report(_two_models_in_flight()), 60)
    assert "1841/2000" in screen and "2,684.3" in screen and "12,345.0" in screen


def test_a_request_to_another_model_names_its_model() -> None:
    """Alone in flight, a request to a model other than the primary was shown with no model
    name at all (the column needed rows of two models)."""
    rows = [_row(id="only", model=OTHER)]
    alone = _busy_snapshot(rows, _models((PRIMARY, "loaded"), (OTHER, "loaded")))
    screen = _screen(sessions_table(alone), 140)
    assert "model" in screen and OTHER in screen
    # The store lists one model, but the row is not the primary's: still named.
    unknown = _busy_snapshot([_row(id="only", model=OTHER)], _models((PRIMARY, "loaded")))
    assert OTHER in _screen(sessions_table(unknown), 140)
    # One model, its own rows: no column.
    single = _busy_snapshot([_row()], _models((PRIMARY, "loaded")))
    assert "model" not in _screen(sessions_table(single), 140)


def test_the_header_covers_every_loaded_model() -> None:
    """The header named only the primary file and showed its KV alone, beside session counts
    summed over every model."""
    snapshot = _two_models_in_flight()
    snapshot["models"].append({"id": "llama-3.2-1b", "state": "unloaded", "primary": False})
    snapshot["models"].append({"id": "phi-3-mini", "state": "loading", "primary": False})
    text = header(snapshot).plain
    assert f"{PRIMARY} (primary)" in text and OTHER in text and "phi-3-mini (loading)" in text
    assert "llama-3.2-1b" not in text  # not loaded: not in the header
    assert "KV 2,600/65,536 cells reserved (all loaded models)" in text
    assert "349/32,768" not in text
    # One model loaded: its used cells, as before.
    single = _busy_snapshot([_row()], _models((PRIMARY, "loaded")))
    single["kv_loaded"] = {"cells_reserved": 2_400, "cells_total": 32_768}
    text = header(single).plain
    assert "KV 349/32,768 cells" in text and "models" not in text
