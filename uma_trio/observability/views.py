"""Terminal views of a metrics snapshot (``rich``): ``uma-trio metrics`` and ``uma-trio top``.

Pure functions from the snapshot dict (docs/METRICS.md) to renderables, so
they are tested without a terminal or a daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from .metrics import LANES

KINDS = (("ttft_ms", "TTFT"), ("itl_ms", "token gap"), ("queue_ms", "queue"), ("e2e_ms", "request"))


def _num(value: float | None, spec: str = ",.1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _models_line(snap: dict[str, Any]) -> str:
    """The loaded (and loading) models, with several in the store: ``models a (primary), b``."""
    models = snap.get("models") or []
    if len(models) < 2:
        return ""
    shown = [
        m["id"]
        + (" (primary)" if m.get("primary") else "")
        + ("" if m["state"] == "loaded" else f" ({m['state']})")
        for m in models
        if m["state"] != "unloaded"
    ]
    return f"models {', '.join(shown)}  " if shown else ""


def _kv_figure(snap: dict[str, Any]) -> str:
    """The primary's used cells while it is the only model loaded; with several loaded, the
    cells their running requests reserved over all of theirs (``kv_loaded``), so the KV
    figure covers the same requests as the summed session counts."""
    kv, loaded = snap["kv"], snap.get("kv_loaded")
    several = sum(m["state"] == "loaded" for m in snap.get("models") or []) > 1
    if loaded is not None and (several or loaded["cells_total"] != kv["cells_total"]):
        return (
            f"KV {loaded['cells_reserved']:,}/{loaded['cells_total']:,} cells reserved (all loaded models)  "
        )
    return f"KV {kv['cells_used']:,}/{kv['cells_total']:,} cells  "


def header(snap: dict[str, Any]) -> Text:
    sessions, process = snap["sessions"], snap["process"]
    return Text.assemble(
        (f"{snap['model']}", "bold"),
        f"  up {snap['uptime_s']:,.0f} s  ",
        _models_line(snap),
        f"sessions {sessions['active']} (+{sessions['waiting']} waiting, {sessions['parked']} parked)  ",
        _kv_figure(snap),
        f"RSS {process['rss_bytes'] / 2**20:,.0f} MiB  fds {_num(process['open_fds'], 'd')}  ",
        f"GC pause max {process['gc_pause_max_ms']:.1f} ms",
    )


# -- fitting a table to the terminal ------------------------------------------------------
#
# Rich shrinks every column evenly once a table is wider than the console, which cut numbers
# ("2,68…" for 2,684.3).  So numbers never wrap and are never cut: the text columns (ids,
# models, lanes, phases) take the ellipsis, and where even that is not enough the table drops
# its least useful columns, then its borders.  The widths are counted here from the cells'
# text, before rich lays the table out.

_TEXT_MIN = 5  # the narrowest a text column gets in the sums below ("inte…")


@dataclass
class _Layout:
    """Which columns a table shows and how tightly it is drawn."""

    drop: frozenset[str] = frozenset()
    compact: bool = False  # no borders, one space between columns


_LAYOUTS = (
    _Layout(),
    _Layout(frozenset({"eta s"})),
    _Layout(frozenset({"eta s", "conn"})),
    _Layout(frozenset({"eta s", "conn"}), compact=True),
    _Layout(frozenset({"eta s", "conn", "age s"}), compact=True),
)


def _table(title: str, layout: _Layout, **options: Any) -> Table:
    if layout.compact:
        options.update(box=None, pad_edge=False, collapse_padding=True, padding=(0, 1))
    return Table(title=title, title_justify="left", **options)


def _add_columns(table: Table, columns: Sequence[str], text: Collection[str]) -> None:
    for column in columns:
        if column in text:  # may shrink: wraps at spaces, and a word too long ends in "…"
            table.add_column(column, justify="left", overflow="ellipsis")
        else:
            table.add_column(column, justify="right", no_wrap=True)


def _width_needed(
    header: Sequence[str], rows: Sequence[Sequence[str]], text: Collection[str], compact: bool
) -> int:
    """Console cells the table needs with its numbers whole and its text columns at their
    narrowest: the widest cell of each number column, ``_TEXT_MIN`` of each text column, and
    the borders and padding."""
    widths = []
    for index, name in enumerate(header):
        widest = max([cell_len(name), *(cell_len(row[index]) for row in rows)])
        widths.append(min(widest, _TEXT_MIN) if name in text else widest)
    n = len(widths)
    chrome = n - 1 if compact else 3 * n + 1  # a space between columns / "│ " … " │"
    return sum(widths) + chrome


class _Fitted:
    """A table built at render time for the width it is given (the first of ``layouts`` whose
    numbers fit whole, else the tightest)."""

    def __init__(self, build: Callable[[_Layout], tuple[Table, int]], layouts: Sequence[_Layout]) -> None:
        self._build = build
        self._layouts = layouts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for layout in self._layouts:
            table, needed = self._build(layout)
            if needed <= options.max_width:
                break
        yield table


def scorecard_table(snap: dict[str, Any]) -> Table:
    card = snap["scorecard"]
    table = Table(
        title=f"scorecard (last {card['window_s']:,.0f} s)", title_justify="left", show_header=False
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("tokens/s", _num(card["tokens_per_s"])),
        (f"tokens/s at cap {card['latency_cap']:g}x", _num(card["tokens_per_s_at_cap"])),
        ("cap kept", _num(card["cap_kept_pct"], ".1f", " %")),
        ("interactive gap p95 / p99", f"{_num(card['p95_ms'])} / {_num(card['p99_ms'])} ms"),
        ("interactive TTFT p95", f"{_num(card['ttft_p95_ms'])} ms"),
        ("scheduler efficiency", _num(card["scheduler_efficiency"], ".3f")),
        ("engine idle", _num(card["engine_idle_pct"], ".1f", " %")),
        ("ΣBMT per token", _num(card["sum_bmt_mb_per_token"], ",.1f", " MB")),
        ("RSS", _num(card["rss_gb"], ".3f", " GB")),
    ]
    for row in rows:
        table.add_row(*row)
    return table


_LATENCY_LAYOUTS = (_Layout(), _Layout(compact=True), _Layout(frozenset({"p99"}), compact=True))


def _latency(snap: dict[str, Any], scope: str, layout: _Layout) -> tuple[Table, int]:
    figures = snap["latency"][scope]
    title = f"latency, last {snap['latency']['window_s']:g} s" if scope == "window" else "latency, whole run"
    quantiles = [q for q in ("p50", "p95", "p99", "max") if q not in layout.drop]
    columns = ("lane", "figure", "count", *quantiles)
    rows: list[list[str]] = []
    for lane in LANES:
        for key, label in KINDS:
            p = figures[lane][key]
            if p["count"]:
                rows.append([lane, label, f"{p['count']:,}", *(_num(p[q]) for q in quantiles)])
    tick = figures["tick_ms"]
    if tick["count"]:
        rows.append(["-", "engine tick", f"{tick['count']:,}", *(_num(tick[q]) for q in quantiles)])
    text = ("lane", "figure")
    table = _table(f"{title} (ms)", layout)
    _add_columns(table, columns, text)
    for row in rows:
        table.add_row(*row)
    return table, _width_needed(columns, rows, text, layout.compact)


def latency_table(snap: dict[str, Any], scope: str = "window") -> Table:
    return _latency(snap, scope, _Layout())[0]


def _several_models(snap: dict[str, Any]) -> bool:
    """Whether rows name their model: the store has several, or a row is not the primary's
    (a request to another model is never shown as the primary's), or rows of two models."""
    models = snap.get("models") or []
    if len(models) > 1:
        return True
    named = {row.get("model") for row in snap["in_flight"]} - {None}
    primary = next((m["id"] for m in models if m.get("primary")), None)
    return len(named) > 1 or (primary is not None and bool(named - {primary}))


def _sessions(snap: dict[str, Any], layout: _Layout) -> tuple[Table, int]:
    several = _several_models(snap)
    every = ("conn", "id", *(("model",) if several else ()), "lane", "phase", "prompt", "generated",
             "gap ms", "age s", "eta s")  # fmt: skip
    columns = [c for c in every if c not in layout.drop]
    text = ("id", "model", "lane", "phase")
    cells: list[dict[str, str]] = []
    styles: list[str | None] = []
    for row in snap["in_flight"]:
        held = row.get("held") or ("parked" if row["parked"] else None)
        cells.append({
            "conn": str(row["connection"]), "id": row["id"], "model": str(row.get("model") or "-"),
            "lane": row["lane"], "phase": row["phase"] + (f" ({held})" if held else ""),
            "prompt": f"{row['prefilled']}/{row['prompt_tokens']}",
            # An embedding generates nothing (max_tokens 0): "-", not "0/256".
            "generated": f"{row['generated']}/{row['max_tokens']}" if row["max_tokens"] else "-",
            "gap ms": _num(row["gap_ms"]),
            "age s": f"{row['age_ms'] / 1000:,.1f}",
            "eta s": "-" if row.get("eta_s") is None else f"{row['eta_s']:,.1f}",
        })  # fmt: skip
        styles.append("yellow" if row["lane"] == "background" else None)
    table = _table("requests in flight", layout)
    _add_columns(table, columns, text)
    for row_cells, style in zip(cells, styles, strict=True):
        # Text: an id (and a model name) is the client's, and rich would read "[/b]" in it as
        # markup (and raise).
        table.add_row(
            *(Text(row_cells[c]) if c in ("id", "model") else row_cells[c] for c in columns), style=style
        )
    rows = [[row_cells[c] for c in columns] for row_cells in cells]
    return table, _width_needed(columns, rows, text, layout.compact)


def sessions_table(snap: dict[str, Any]) -> Table:
    return _sessions(snap, _Layout())[0]


def fitted_sessions(snap: dict[str, Any]) -> _Fitted:
    """The requests in flight, laid out for the console's width when printed."""
    return _Fitted(lambda layout: _sessions(snap, layout), _LAYOUTS)


def fitted_latency(snap: dict[str, Any], scope: str = "window") -> _Fitted:
    return _Fitted(lambda layout: _latency(snap, scope, layout), _LATENCY_LAYOUTS)


def counters_table(snap: dict[str, Any]) -> Table:
    table = Table(title="counters (whole run)", title_justify="left", show_header=False)
    table.add_column("counter")
    table.add_column("value")

    def by(mapping: dict[str, int]) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in sorted(mapping.items()) if v) or "0"

    for lane in LANES:
        table.add_row(f"requests ({lane})", by(snap["requests"][lane]))
    table.add_row("cancels", by(snap["cancels"]))
    table.add_row("errors", by(snap["errors"]))
    table.add_row("prompt tokens", by(snap["tokens"]["prompt"]))
    table.add_row("generated tokens", by(snap["tokens"]["generated"]))
    table.add_row("ticks", f"{snap['ticks']:,} (avg {snap['avg_batch_tokens']:.2f} tokens)")
    table.add_row(
        "connections", f"{snap['connections']['open']} open, {snap['connections']['total']:,} total"
    )
    return table


def dashboard(snap: dict[str, Any]) -> Group:
    """``uma-trio top``: what runs now and how it feels."""
    return Group(header(snap), fitted_sessions(snap), fitted_latency(snap, "window"), scorecard_table(snap))


def report(snap: dict[str, Any]) -> Group:
    """``uma-trio metrics``: everything, once."""
    return Group(
        header(snap), scorecard_table(snap), fitted_latency(snap, "window"), fitted_latency(snap, "run"),
        counters_table(snap), fitted_sessions(snap),
    )  # fmt: skip
