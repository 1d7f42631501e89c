"""Commands that need no daemon: fetch-model and calibrate."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..config import ServerConfig, WholeNumber
from ..model_files import ModelFileError, check_model_path, ensure_default_model
from .common import (
    DEFAULTS,
    EXIT_SERVER_ERROR,
    setup_logging,
)


def fetch_model(*, force: bool = False) -> int:
    """Fetch and verify the embedded default model; print its path.

    Parameters
    ----------
    force
        Download again even if a verified copy is cached.
    """
    setup_logging("info")
    try:
        print(ensure_default_model(force=force))
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    return 0


def calibrate(
    *,
    model: Path | None = None,
    out: Path | None = None,
    repeats: WholeNumber = 5,
    threads: WholeNumber | None = None,
    gpu_layers: str = DEFAULTS.gpu_layers,
    deterministic: bool = False,
) -> int:
    """Measure this machine's tick costs on the real engine and write them as JSON.

    Times decode-only and mixed decode+prefill batches (about a minute), fits
    the scheduler's tick-cost model to them and prints the coefficients with
    the fit's R² and mean relative error.

    Parameters
    ----------
    model
        GGUF file to measure. Default: the embedded SmolLM2-135M-Instruct Q4_1.
    out
        Where to write the cost model. Default: cost-model.json in the user cache
        directory (next to the fetched models; honours UMA_CACHE_DIR).
    repeats
        Timed runs of every batch configuration.
    threads
        llama.cpp threads (default: all cores), as the daemon will run them.
    gpu_layers
        Layers on the GPU, as `serve --gpu-layers` (auto, all or a count).
    deterministic
        Measure the --deterministic engine settings instead of the fast ones.
    """
    from ..engine.calibrate import calibrate as run_calibration  # numpy, llama_cpp: keep others light
    from ..engine.calibrate import default_cost_model_path

    if repeats < 1 or (threads is not None and threads < 1):
        print("error: --repeats and --threads must be positive", file=sys.stderr)
        return EXIT_SERVER_ERROR
    target = out if out is not None else default_cost_model_path()
    if (problem := _unwritable(target)) is not None:  # found now, not after a minute of measuring
        print(f"error: cannot write {target}: {problem}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    try:
        model_path = check_model_path(model) if model is not None else ensure_default_model()
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR

    from ..engine.llama import ModelLoadError

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from ..daemon import context_config
    from ..engine.llama import read_shape
    from ..engine.planned import offload_plan, placement_for

    try:
        config = ServerConfig(gpu_layers=gpu_layers, deterministic=deterministic, threads=threads)
        plan = offload_plan(read_shape(model_path), config)
        engine = context_config(config, 0 < plan.n_gpu_layers == plan.total)
        context = {
            "n_ubatch": engine.n_ubatch, "kv_type": engine.kv_type, "flash_attn": engine.flash_attn,
            "kv_unified": engine.kv_unified,
        }  # fmt: skip
        result = run_calibration(
            model_path, repeats=repeats, threads=threads, progress=progress, context=context,
            placement=placement_for(plan, config),
        )  # fmt: skip
    except (ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    c, q = result.coefficients, result.quality
    if result.slow_ticks:
        print(
            f"warning: {result.slow_ticks} of {len(result.samples)} ticks took over twice their "
            "configuration's median (a busy machine?); the fit uses medians",
            file=sys.stderr,
        )
    print(f"fixed_s          {c.fixed_s:.6f}  s per tick")
    print(f"decode_s         {c.decode_s:.6f}  s per decode token")
    print(f"prefill_s        {c.prefill_s:.6f}  s per prompt token")
    print(f"ctx_s_per_kcell  {c.ctx_s_per_kcell:.6f}  s per 1,000 KV cells read")
    print(f"flat_tokens      {c.flat_tokens}  tokens a tick carries for fixed_s (the knee)")
    print(f"prompt_tick_s    {c.prompt_tick_s:.6f}  s once a tick that carries prompt tokens")
    print(f"device           {c.device}")
    print(f"R²               {q.r2:.4f}  ({q.n_samples} configurations, medians)")
    print(f"mean |rel. err|  {100.0 * q.mean_abs_rel_error:.1f} %")
    try:
        c.save(target)
    except OSError as exc:
        print(f"error: cannot write {target}: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    print(f"wrote {target}")
    return 0


def _unwritable(target: Path) -> str | None:
    """Why the cost model could not be written to ``target``, or None."""
    if target.is_dir():
        return "it is a directory"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "permission denied"
    return None
