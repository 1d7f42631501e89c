"""``uma-trio calibrate``: the pure fit on synthetic ticks, then the real engine and the CLI."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from uma_trio.engine.calibrate import (
    CALIBRATION_N_CTX_SEQ,
    CALIBRATION_N_SEQ_MAX,
    DEFAULT_GRID,
    Calibration,
    Grid,
    TickSample,
    default_cost_model_path,
    fit_coefficients,
    fit_quality,
    measure,
    median_per_configuration,
)
from uma_trio.engine.llama import ContextConfig, LlamaEngine, LlamaModel
from uma_trio.sched.cost import CostCoefficients, kv_cells_read

TRUE = CostCoefficients(
    fixed_s=0.004, decode_s=0.003, prefill_s=0.0022, ctx_s_per_kcell=0.0019, source="truth"
)


def synthetic(
    fixed: float, decode: float, prefill: float, ctx: float, *, noise: float, seed: int = 0, step: float = 0.0
) -> list[TickSample]:
    """Ticks over a grid like the real one, timed by the given line times (1 + noise)."""
    rng = np.random.default_rng(seed)
    samples = []
    for d, n_past in itertools.product((1, 2, 4, 8), (64, 512, 1536)):
        samples.append((d, 0, kv_cells_read([n_past] * d, [])))
    for d, p, start in itertools.product((0, 1, 3), (8, 16, 32, 64, 128), (0, 1000)):
        samples.append((d, p, kv_cells_read([512] * d, [(start, p)])))
    out = []
    for d, p, kv in samples * 3:
        seconds = fixed + decode * d + prefill * p + ctx * kv / 1000.0 + (step if p else 0.0)
        out.append(TickSample(d, p, kv, seconds * (1.0 + noise * rng.standard_normal())))
    return out


def test_fit_recovers_known_coefficients_from_noisy_ticks() -> None:
    samples = synthetic(TRUE.fixed_s, TRUE.decode_s, TRUE.prefill_s, TRUE.ctx_s_per_kcell, noise=0.02)
    fit = fit_coefficients(samples, "test")
    assert fit.source == "test"
    assert fit.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.15)
    assert fit.decode_s == pytest.approx(TRUE.decode_s, rel=0.05)
    assert fit.prefill_s == pytest.approx(TRUE.prefill_s, rel=0.05)
    assert fit.ctx_s_per_kcell == pytest.approx(TRUE.ctx_s_per_kcell, rel=0.1)
    quality = fit_quality(fit, samples)
    assert quality.r2 > 0.99 and quality.mean_abs_rel_error < 0.03
    assert quality.n_samples == len(samples)


def test_fit_is_exact_without_noise() -> None:
    samples = synthetic(TRUE.fixed_s, TRUE.decode_s, TRUE.prefill_s, TRUE.ctx_s_per_kcell, noise=0.0)
    fit = fit_coefficients(samples, "test")
    for name in ("fixed_s", "decode_s", "prefill_s", "ctx_s_per_kcell"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    quality = fit_quality(fit, samples)
    assert quality.r2 == pytest.approx(1.0) and quality.mean_abs_rel_error == pytest.approx(0.0, abs=1e-9)


def test_fit_finds_the_step_a_prompt_token_adds_and_none_where_there_is_none() -> None:
    line = fit_coefficients(synthetic(0.004, 0.003, 0.0022, 0.0019, noise=0.0), "test")
    assert line.prompt_tick_s == pytest.approx(0.0, abs=1e-9)
    stepped = fit_coefficients(synthetic(0.004, 0.003, 0.0022, 0.0019, noise=0.02, step=0.006), "test")
    assert stepped.prompt_tick_s == pytest.approx(0.006, rel=0.15)
    assert stepped.prefill_s == pytest.approx(0.0022, rel=0.05)


def test_a_preempted_tick_does_not_move_the_fit() -> None:
    samples = synthetic(TRUE.fixed_s, TRUE.decode_s, TRUE.prefill_s, TRUE.ctx_s_per_kcell, noise=0.0)
    # Every configuration repeats 3 times; make one repeat of each big tick 40x slower.
    hit = [replace(s, seconds=40 * s.seconds) if i < len(samples) // 3 and s.prefill_tokens >= 64 else s
           for i, s in enumerate(samples)]  # fmt: skip
    assert hit != samples
    fit = fit_coefficients(hit, "test")
    assert fit.prefill_s == pytest.approx(TRUE.prefill_s, rel=1e-6)
    assert len(median_per_configuration(hit)) == len(samples) // 3
    calibration = Calibration(fit, fit_quality(fit, median_per_configuration(hit)), hit)
    assert calibration.slow_ticks == sum(s.prefill_tokens >= 64 for s in samples) // 3
    assert calibration.quality.r2 == pytest.approx(1.0)


def test_a_negative_coefficient_is_clamped_to_zero_and_the_rest_refit() -> None:
    # Ticks that get *cheaper* with context: an unconstrained fit says ctx < 0.
    samples = synthetic(0.02, 0.003, 0.002, -0.0015, noise=0.0)
    assert all(s.seconds > 0 for s in samples)
    fit = fit_coefficients(samples, "test")
    assert fit.ctx_s_per_kcell == 0.0
    assert min(fit.fixed_s, fit.decode_s, fit.prefill_s) >= 0.0
    # The refit without the context term beats merely zeroing it in the unconstrained fit.
    zeroed = CostCoefficients(fixed_s=0.02, decode_s=0.003, prefill_s=0.002, ctx_s_per_kcell=0.0)
    assert fit_quality(fit, samples).mean_abs_rel_error < fit_quality(zeroed, samples).mean_abs_rel_error


def test_a_negative_intercept_is_clamped() -> None:
    samples = synthetic(-0.001, 0.004, 0.003, 0.001, noise=0.0)
    samples = [s for s in samples if s.seconds > 0]
    fit = fit_coefficients(samples, "test")
    assert fit.fixed_s == 0.0
    assert fit.decode_s > 0 and fit.prefill_s > 0 and fit.ctx_s_per_kcell >= 0


def test_fit_rejects_empty_or_non_positive_samples() -> None:
    with pytest.raises(ValueError):
        fit_coefficients([], "test")
    with pytest.raises(ValueError):
        fit_coefficients([TickSample(1, 0, 10, 0.0)], "test")


def test_default_path_follows_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path))
    assert default_cost_model_path() == tmp_path / "cost-model.json"


def test_default_grid_fits_the_calibration_context() -> None:
    assert DEFAULT_GRID.seqs_needed <= CALIBRATION_N_SEQ_MAX
    assert DEFAULT_GRID.text_tokens + 1 <= CALIBRATION_N_CTX_SEQ


# -- on the real model ----------------------------------------------------------------

SMALL_GRID = Grid(
    decode_batches=(1, 4),
    decode_contexts=(32, 256),
    mixed_batches=(0, 2),
    mixed_context=128,
    prefill_chunks=(16, 64),
    prefill_starts=(0, 256),
)


@pytest.fixture
def small_engine(llama_model: LlamaModel) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(llama_model, ContextConfig(n_ctx_seq=512, n_seq_max=SMALL_GRID.seqs_needed))
    yield eng
    eng.close()


@pytest.mark.model
@pytest.mark.timeout(180)  # ~5 s alone; another llama.cpp process on the 2 cores slows it 10x
def test_measure_on_the_real_engine_fits_its_own_ticks(small_engine: LlamaEngine) -> None:
    lines: list[str] = []
    samples = measure(small_engine, repeats=1, progress=lines.append, grid=SMALL_GRID)
    assert len(samples) == SMALL_GRID.configurations()
    assert len(lines) == SMALL_GRID.configurations() + 1  # plus the source prefill
    assert all(s.seconds > 0 for s in samples)
    assert {(s.decode_tokens, s.prefill_tokens) for s in samples} >= {(1, 0), (4, 0), (0, 16), (2, 64)}
    fit = fit_coefficients(samples, "test")
    assert min(fit.fixed_s, fit.decode_s, fit.prefill_s, fit.ctx_s_per_kcell) >= 0.0
    assert fit_quality(fit, samples).mean_abs_rel_error < 0.5
    assert all(small_engine.seq_cells(seq) == 0 for seq in range(SMALL_GRID.seqs_needed))


@pytest.mark.model
def test_measure_refuses_a_grid_the_context_cannot_hold(small_engine: LlamaEngine) -> None:
    with pytest.raises(ValueError, match="sequences"):
        measure(small_engine, repeats=1, grid=DEFAULT_GRID)


UMA = [sys.executable, "-m", "uma_trio"]


@pytest.mark.model
@pytest.mark.timeout(280)  # ~17 s alone; generous for a machine shared with other runs
def test_cli_calibrate_writes_a_loadable_cost_model(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = subprocess.run(
        [*UMA, "calibrate", "--out", str(out), "--repeats", "1"], capture_output=True, text=True, timeout=270
    )
    assert done.returncode == 0, done.stderr
    loaded = CostCoefficients.load(out)
    assert min(loaded.fixed_s, loaded.decode_s, loaded.prefill_s, loaded.ctx_s_per_kcell) >= 0.0
    assert "SmolLM2-135M-Instruct" in loaded.source
    for word in ("fixed_s", "decode_s", "prefill_s", "ctx_s_per_kcell", "R²", "rel. err"):
        assert word in done.stdout
    assert "decode  D=8" in done.stderr  # progress goes to stderr


def test_cli_calibrate_with_a_missing_model_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [*UMA, "calibrate", "--model", "/nonexistent/m.gguf", "--out", str(tmp_path / "c.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "c.json").exists()


def test_the_device_key_names_threads_and_the_kv_layout_off_their_defaults(llama_model: LlamaModel) -> None:
    """A cost file measured with 1 thread (2.3x the prefill time of 2) or a unified KV was read
    back by a daemon with the defaults as its own."""
    import os

    from uma_trio.engine.calibrate import engine_device_key

    def key(**settings: Any) -> str:
        engine = LlamaEngine(llama_model, ContextConfig(n_ctx_seq=256, n_seq_max=2, **settings))
        try:
            return engine_device_key(engine)
        finally:
            engine.close()

    default = key()
    assert "threads" not in default and "kv_unified" not in default
    assert key(n_threads=os.cpu_count()) == default
    assert key(kv_unified=True) == default + "; kv_unified"
    if (os.cpu_count() or 1) > 1:
        assert key(n_threads=1) == default + "; threads 1"
