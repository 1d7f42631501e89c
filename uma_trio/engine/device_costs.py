"""Cost models the daemon calibrated at start-up, kept per device so it calibrates once.

On a GPU the daemon has no prior worth using (the CPU's is 10-40x off), so when no
``--cost-model`` file fits the device it times a grid of steps before serving: seconds on an
H100, minutes on a slow device (over six on Mesa's llvmpipe), and again for every model the
store loads on demand.  The result depends only on what :func:`~uma_trio.engine.calibrate.
engine_device_key` names (device, layers, model file, engine settings), so it is written under
that key and read back at the next start or load.  ``uma-trio calibrate`` still writes the one
file ``--cost-model`` defaults to; that file, where it fits, comes first.

No llama.cpp here: keys in, coefficients out, files under the user cache.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..model_files import cache_dir
from ..sched.cost import CostCoefficients, CostModelError

if TYPE_CHECKING:
    from .calibrate import Calibration

log = logging.getLogger(__name__)

# A fit below this is likely to reflect the moment (other processes, a throttling device) more
# than the device: good enough for the run it was measured in, which corrects it online, not
# for every run after.
MIN_R2_TO_KEEP = 0.8


def device_costs_dir() -> Path:
    """Next to ``cost-model.json`` (``UMA_CACHE_DIR`` or the per-user cache)."""
    return cache_dir().parent / "cost-models"


def path_for(device_key: str) -> Path:
    """One file per key; the name is a digest because keys hold spaces, commas and slashes."""
    digest = hashlib.sha256(device_key.encode()).hexdigest()[:16]
    return device_costs_dir() / f"{digest}.json"


def load_for(device_key: str) -> tuple[CostCoefficients, Path] | None:
    """The coefficients calibrated earlier for exactly ``device_key``, or ``None``.

    A file that cannot be read or decoded, or that names another key (a digest collision, a
    hand edit), is ignored with a warning: the caller calibrates again and overwrites it."""
    path = path_for(device_key)
    if not path.is_file():
        return None
    try:
        costs = CostCoefficients.load(path)
    except CostModelError as exc:
        log.warning("%s: calibrating again", exc)
        return None
    if costs.device != device_key:
        log.warning(
            "cost model %s was measured on %r, not %r: calibrating again", path, costs.device, device_key
        )
        return None
    return costs, path


def store(costs: CostCoefficients) -> Path | None:
    """Write ``costs`` under its own ``device`` key.  Returns the path, or ``None`` when the
    cache is not writable: the daemon then calibrates again next time, and says so."""
    if not costs.device:
        raise ValueError("a cost model kept per device needs its device key")
    path = path_for(costs.device)
    try:
        costs.save(path)
    except OSError as exc:
        log.warning("cost model not kept (%s): the next start calibrates again", exc)
        return None
    return path


def kept_or_measured(device_key: str, measure: Callable[[], Calibration]) -> CostCoefficients:
    """The cost model kept for ``device_key``, else ``measure()``'s, kept for next time when
    it fits well.  ``measure``'s exceptions pass through (the caller falls back)."""
    if (kept := load_for(device_key)) is not None:
        log.info("cost model for this device from %s (%s)", kept[1], kept[0].source)
        return kept[0]
    log.info("calibrating the tick-cost model (no cost model for %s)", device_key)
    result = measure()
    c = result.coefficients
    log.info(
        "cost model: fixed %.2f ms, %.3f ms/decode token, %.3f ms/prompt token past %d tokens, "
        "%.4f ms/1k cells, %.2f ms a tick with prompt tokens (R² %.3f)",
        c.fixed_s * 1e3, c.decode_s * 1e3, c.prefill_s * 1e3, c.flat_tokens, c.ctx_s_per_kcell * 1e3,
        c.prompt_tick_s * 1e3, result.quality.r2,
    )  # fmt: skip
    if result.quality.r2 < MIN_R2_TO_KEEP:
        log.warning("cost model fitted poorly (R² %.2f): used for this run only", result.quality.r2)
    elif (kept_at := store(c)) is not None:
        log.info("cost model kept in %s: the next start on this device skips calibrating", kept_at)
    return c
