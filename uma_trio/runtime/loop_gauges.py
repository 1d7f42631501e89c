"""What the decode loop shows the metrics snapshot and ``uma-trio top``: plain dicts built
from its state, read between ticks (never from llama.cpp, which a step may be writing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..sched.kv_manager import KvManager
from .lifecycle import Phase
from .session import Session


def eta_s(session: Session, now: float, tick_s: float) -> float | None:
    """Seconds until the request ends (at ``max_tokens``) at the pace it has gone so far: its
    prompt at the rate its prefill has run, then one tick a token; once decoding, at its own
    mean gap, or slower while the token it waits for now has taken longer than that (a
    decoder held back by the budget: its pace so far counts the wait).  An embedding ends
    with its prompt.  None until it has advanced."""
    left = _answer_tokens(session) - session.generated
    times = session.generated_at
    if session.phase is Phase.DECODE and times.first is not None and times.last is not None:
        mean_gap = (times.last - times.first) / (session.generated - 1) if session.generated > 1 else tick_s
        with_the_wait = (now - times.first) / session.generated  # the gap running now counted as one
        return round(left * max(mean_gap, with_the_wait), 3)
    prefilled, started = session.n_past - session.cached_tokens, session.admitted
    if session.phase is not Phase.PREFILL or started is None or prefilled <= 0 or now <= started:
        return None
    rate = prefilled / (now - started)
    return round(session.prompt_remaining / rate + left * tick_s, 3)


def _answer_tokens(session: Session) -> int:
    """The most tokens it may generate: none for an embedding (its ``max_tokens`` is unused)."""
    return 0 if session.request.embed else session.request.max_tokens


def describe(session: Session, now: float, tick_s: float = 0.0, held: str | None = None) -> dict[str, Any]:
    """One row of the live view: where a request stands, how long since its last token,
    when it should end and, if the last plan left it out, why (``held``: the plan's reason)."""
    since = session.last_token if session.last_token is not None else session.created
    return {
        "id": session.id,
        "connection": session.connection,
        "lane": session.lane,
        "phase": session.phase.value,
        "parked": session.parked,
        "prompt_tokens": len(session.prompt),
        "prefilled": min(session.n_past, len(session.prompt)),
        "generated": session.generated,
        "max_tokens": _answer_tokens(session),
        "age_ms": round((now - session.created) * 1000.0, 1),
        "gap_ms": round((now - since) * 1000.0, 1),
        "eta_s": eta_s(session, now, tick_s),
        "held": "queue" if session.phase is Phase.WAITING else held,  # not admitted yet
    }


def session_gauges(
    active: Sequence[Session],
    waiting: Sequence[Session],
    now: float,
    tick_s: float,
    held: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """``held``: the last plan's reason for each seq id it left out."""
    held = held or {}
    rows = [describe(s, now, tick_s, held.get(s.seq_id) if s.seq_id is not None else None) for s in active]
    return {
        "in_flight": [*rows, *(describe(s, now, tick_s) for s in waiting)],
        "sessions": {
            "active": len(active),
            "waiting": len(waiting),
            "prefilling": sum(s.phase is Phase.PREFILL for s in active),
            "decoding": sum(s.phase is Phase.DECODE for s in active),
            "parked": sum(s.parked for s in active),
        },
    }


def kv_gauges(
    kv: KvManager, *, cells_total: int, cells_per_seq: int, cells_used: int, cells_reserved: int,
    seqs_total: int, kv_type: str,
) -> dict[str, Any]:  # fmt: skip
    return {
        "kv": {
            "cells_total": cells_total,
            "cells_per_seq": cells_per_seq,
            "cells_used": cells_used,
            "cells_reserved": cells_reserved,
            "seqs_total": seqs_total,
            "seqs_free": kv.free_seqs,
            "kv_type": kv_type,
        },
        "prefix_cache": {
            "enabled": kv.enabled,
            "budget_cells": kv.budget_cells,
            "sequences": kv.cached_seqs,
            "cells": kv.cached_cells,
            "hits": kv.stats.hits,
            "misses": kv.stats.misses,
            "reused_tokens": kv.stats.reused_tokens,
            "evictions": kv.stats.evictions,
            "moves": kv.stats.moves,
        },
    }


def add_models_sessions(
    snapshot: dict[str, Any], primary: str, others: Mapping[str, dict[str, Any]],
    awaiting_load: Mapping[str, int] | None = None,
) -> None:  # fmt: skip
    """Fold the other loaded models' requests into ``snapshot`` (the primary loop's gauges),
    and set ``by_model``: each loaded model's scheduler snapshot and whether its loop is idle.
    The rest:
    ``in_flight`` rows of every model, each naming its model, ``sessions`` summed (with the
    requests waiting for their model to load, ``awaiting_load``, among the waiting and
    counted as ``loading`` too), and
    ``kv_loaded`` the running requests' reserved cells of every loaded model over their
    cells, for the router's usage gauge.  Without it a daemon busy on another model read as
    idle to a router (docs/FLEET.md)."""

    def idle(gauges: dict[str, Any]) -> bool:
        return not gauges["sessions"]["active"] and not gauges["sessions"]["waiting"]

    # Each loaded model's scheduler (Prometheus labels its series by model), before the sums.
    snapshot["by_model"] = {
        primary: {"scheduler": snapshot["scheduler"], "idle": idle(snapshot)},
        **{model: {"scheduler": g["scheduler"], "idle": idle(g)} for model, g in others.items()},
    }
    loading = sum((awaiting_load or {}).values())
    if loading:  # requests wait on a load, in no loop yet: the daemon is not idle to a router
        snapshot["by_model"][primary]["idle"] = False
    snapshot["sessions"]["waiting"] += loading
    snapshot["sessions"]["loading"] = loading  # of the waiting, those whose model is loading
    for row in snapshot["in_flight"]:
        row["model"] = primary
    reserved, total = snapshot["kv"]["cells_reserved"], snapshot["kv"]["cells_total"]
    for model, gauges in others.items():
        snapshot["in_flight"] += [{**row, "model": model} for row in gauges["in_flight"]]
        for key, count in gauges["sessions"].items():
            snapshot["sessions"][key] += count
        reserved += gauges["kv"]["cells_reserved"]
        total += gauges["kv"]["cells_total"]
    snapshot["kv_loaded"] = {"cells_reserved": reserved, "cells_total": total}
