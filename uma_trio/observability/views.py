"""Terminal views of a metrics snapshot (``rich``): ``uma-trio metrics`` and ``uma-trio top``.

Pure functions from the snapshot dict (docs/METRICS.md) to renderables, so
they are tested without a terminal or a daemon.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .metrics import LANES

KINDS = (("ttft_ms", "TTFT"), ("itl_ms", "token gap"), ("queue_ms", "queue"), ("e2e_ms", "request"))


def _num(value: float | None, spec: str = ",.1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def header(snap: dict[str, Any]) -> Text:
    kv, sessions, process = snap["kv"], snap["sessions"], snap["process"]
    return Text.assemble(
        (f"{snap['model']}", "bold"),
        f"  up {snap['uptime_s']:,.0f} s  ",
        f"sessions {sessions['active']} (+{sessions['waiting']} waiting, {sessions['parked']} parked)  ",
        f"KV {kv['cells_used']:,}/{kv['cells_total']:,} cells  ",
        f"RSS {process['rss_bytes'] / 2**20:,.0f} MiB  fds {_num(process['open_fds'], 'd')}  ",
        f"GC pause max {process['gc_pause_max_ms']:.1f} ms",
    )


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


def latency_table(snap: dict[str, Any], scope: str = "window") -> Table:
    figures = snap["latency"][scope]
    title = f"latency, last {snap['latency']['window_s']:g} s" if scope == "window" else "latency, whole run"
    table = Table(title=f"{title} (ms)", title_justify="left")
    for column in ("lane", "figure", "count", "p50", "p95", "p99", "max"):
        table.add_column(column, justify="left" if column in ("lane", "figure") else "right")
    for lane in LANES:
        for key, label in KINDS:
            p = figures[lane][key]
            if p["count"]:
                table.add_row(
                    lane, label, f"{p['count']:,}", *(_num(p[q]) for q in ("p50", "p95", "p99", "max"))
                )
    tick = figures["tick_ms"]
    if tick["count"]:
        table.add_row(
            "-", "engine tick", f"{tick['count']:,}", *(_num(tick[q]) for q in ("p50", "p95", "p99", "max"))
        )
    return table


def sessions_table(snap: dict[str, Any]) -> Table:
    table = Table(title="requests in flight", title_justify="left")
    several = len({row.get("model") for row in snap["in_flight"]}) > 1  # then each row says whose
    columns = ("conn", "id", *(("model",) if several else ()), "lane", "phase", "prompt", "generated",
               "gap ms", "age s", "eta s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("id", "model", "lane", "phase") else "right")
    for row in snap["in_flight"]:
        held = row.get("held") or ("parked" if row["parked"] else None)
        phase = row["phase"] + (f" ({held})" if held else "")
        prompt = f"{row['prefilled']}/{row['prompt_tokens']}"
        style = "yellow" if row["lane"] == "background" else None
        table.add_row(
            # Text: an id is the client's, and rich would read "[/b]" in it as markup (and raise).
            str(row["connection"]), Text(row["id"]), *((Text(row["model"]),) if several else ()),
            row["lane"], phase, prompt,
            f"{row['generated']}/{row['max_tokens']}", _num(row["gap_ms"]), f"{row['age_ms'] / 1000:,.1f}",
            "-" if row.get("eta_s") is None else f"{row['eta_s']:,.1f}", style=style,
        )  # fmt: skip
    return table


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
    return Group(header(snap), sessions_table(snap), latency_table(snap, "window"), scorecard_table(snap))


def report(snap: dict[str, Any]) -> Group:
    """``uma-trio metrics``: everything, once."""
    return Group(
        header(snap), scorecard_table(snap), latency_table(snap, "window"), latency_table(snap, "run"),
        counters_table(snap), sessions_table(snap),
    )  # fmt: skip
