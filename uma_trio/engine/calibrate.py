"""``uma-trio calibrate``: measure the real engine, fit :class:`CostCoefficients`.

Two halves.  :func:`fit_coefficients` is pure: samples in, coefficients out,
so it is tested on synthetic data.  :func:`measure` drives a real
:class:`~uma_trio.engine.llama.LlamaEngine` through a grid of batches and
times each one with the engine's own ``decode_s`` (``llama_decode`` plus
sampling), the same number the decode loop feeds the online model.

Building long contexts is most of the cost of measuring (prefill runs at
~3 ms/token on two cores), so one source sequence is prefilled once and its
KV cells are cloned and trimmed into the sequences each configuration needs.
``LlamaEngine.copy_seq`` and ``trim_seq`` do the cloning and trimming.  Every timed tick is
preceded by one untimed warm-up tick (which also absorbs llama.cpp's deferred
cross-stream KV copy) and followed by a trim back to the same state, so the
repeats of a configuration measure identical batches.

This module imports no llama_cpp at import time, so the CLI stays light.

Over 400 lines: the measuring grid and the fit belong together (the fit's inputs are the grid's
configurations); the fit is pure and tested on synthetic data, the grid on the real engine.
"""

from __future__ import annotations

import itertools
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..model_files import cache_dir
from ..sched.cost import CostCoefficients, kv_cells_read, over_knee
from .offload import share_text

if TYPE_CHECKING:
    from .llama import LlamaEngine, Placement

Progress = Callable[[str], None]

CALIBRATION_N_CTX_SEQ = 2048
CALIBRATION_N_SEQ_MAX = 9

_TEXT = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut "
    "labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris "
    "nisi ut aliquip ex ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit "
    "esse cillum dolore eu fugiat nulla pariatur. Excepteur sint occaecat cupidatat non proident, sunt "
    "in culpa qui officia deserunt mollit anim id est laborum. "
)


def default_cost_model_path() -> Path:
    """Next to the cached models (same ``UMA_CACHE_DIR`` / platformdirs logic)."""
    return cache_dir().parent / "cost-model.json"


@dataclass(frozen=True, slots=True)
class TickSample:
    """One measured tick, in the cost model's terms."""

    decode_tokens: int
    prefill_tokens: int
    kv_cells: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FitQuality:
    r2: float  # on seconds, unweighted
    mean_abs_rel_error: float  # mean of |predicted - measured| / measured
    n_samples: int


# -- fitting (pure) ------------------------------------------------------------------


# Knees tried by the fit: tokens a tick may carry for its fixed cost (0: a CPU's line).
FLAT_CANDIDATES = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _design(
    samples: Sequence[TickSample], flat_tokens: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    rows = []
    for s in samples:
        beyond = over_knee(s.decode_tokens + s.prefill_tokens, flat_tokens)
        rows.append(
            (
                1.0, beyond * s.decode_tokens, beyond * s.prefill_tokens, s.kv_cells / 1000.0,
                float(s.prefill_tokens > 0),
            )
        )  # fmt: skip
    x = np.array(rows, dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    return x, y


def fit_coefficients(samples: Sequence[TickSample], source: str, device: str = "") -> CostCoefficients:
    """Non-negative least squares of seconds on ``[1, D', P', kv_cells/1000, P > 0]``, for each
    knee in :data:`FLAT_CANDIDATES` (``D'``, ``P'``: the tokens' share past the knee), keeping
    the knee with the smallest residual: a CPU comes out at 0 (a line), a GPU at the batch
    size its step stays flat to.

    Repeats of one configuration are first reduced to their median: on a busy
    machine a tick whose llama.cpp thread got preempted takes 10-50× its usual
    time, and one such tick would otherwise drag every coefficient.  Rows are
    then weighted by ``1/seconds``, i.e. relative error is minimised: ticks
    span ~5 ms to ~1 s, and a plain fit would let the big prefill ticks decide
    the fixed cost that matters most for the small decode ticks the policy
    budgets.  Non-negativity is exact and simple: with five columns we solve
    the plain least squares on every subset of columns, keep the solutions with
    no negative coefficient, and take the one with the smallest residual (the
    NNLS optimum is the least-squares solution on its own support).  A dropped
    column gets coefficient 0.
    """
    if not samples:
        raise ValueError("no samples to fit")
    if any(not (s.seconds > 0.0 and np.isfinite(s.seconds)) for s in samples):
        raise ValueError("every sample needs a positive, finite duration")
    medians = median_per_configuration(samples)
    widest = max(s.decode_tokens + s.prefill_tokens for s in medians)
    knees = FLAT_CANDIDATES if looks_flat(medians) else (0,)
    best, best_flat, best_residual = np.zeros(5), 0, float("inf")
    for flat in knees:
        if flat >= widest:  # a knee past every sample says nothing about per-token costs
            break
        coef, residual = _nnls_relative(*_design(medians, flat))
        if residual < best_residual:
            best, best_flat, best_residual = coef, flat, residual
    return CostCoefficients(
        fixed_s=float(best[0]),
        decode_s=float(best[1]),
        prefill_s=float(best[2]),
        ctx_s_per_kcell=float(best[3]),
        prompt_tick_s=float(best[4]),
        flat_tokens=best_flat,
        source=source,
        device=device,
    )


def looks_flat(medians: Sequence[TickSample]) -> bool:
    """Whether decode steps are memory-bound: the widest decode-only tick at the shallowest
    context costs less than half its width times the one-token tick (a CPU's grows nearly
    linearly; a GPU's barely moves).  Only then is a knee fitted."""
    decode = [s for s in medians if s.prefill_tokens == 0]
    if not decode:
        return False
    shallow = min(s.kv_cells / s.decode_tokens for s in decode)
    at = {s.decode_tokens: s.seconds for s in decode if s.kv_cells / s.decode_tokens == shallow}
    if 1 not in at or len(at) < 2:
        return False
    widest = max(at)
    return at[widest] < 0.5 * widest * at[1]


def _nnls_relative(
    x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], float]:
    """Non-negative least squares of relative error; returns the coefficients and residual."""
    a = x / y[:, None]
    b = np.ones_like(y)
    best = np.zeros(x.shape[1])
    best_residual = float(np.linalg.norm(b))
    for support in itertools.product((True, False), repeat=x.shape[1]):
        cols = [i for i, keep in enumerate(support) if keep]
        if not cols:
            continue
        coef = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if np.any(coef < 0.0):
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        residual = float(np.linalg.norm(a @ full - b))
        if residual < best_residual:
            best, best_residual = full, residual
    return best, best_residual


def median_per_configuration(samples: Sequence[TickSample]) -> list[TickSample]:
    """One sample per distinct ``(D, P, kv_cells)``, timed by the median of its repeats."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for s in samples:
        groups.setdefault((s.decode_tokens, s.prefill_tokens, s.kv_cells), []).append(s.seconds)
    return [TickSample(d, p, kv, float(np.median(times))) for (d, p, kv), times in groups.items()]


def fit_quality(coefficients: CostCoefficients, samples: Sequence[TickSample]) -> FitQuality:
    """How well ``coefficients`` predict ``samples``: R² and mean absolute relative error."""
    if not samples:
        raise ValueError("no samples to score")
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    predicted = np.array(
        [coefficients.predict(s.decode_tokens, s.prefill_tokens, s.kv_cells) for s in samples],
        dtype=np.float64,
    )
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    ss_res = float(np.sum((y - predicted) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else (1.0 if ss_res == 0.0 else 0.0)
    mare = float(np.mean(np.abs(predicted - y) / y))
    return FitQuality(r2=r2, mean_abs_rel_error=mare, n_samples=len(samples))


# -- measuring (real engine) ---------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """Which batches :func:`measure` times; the default fits the 2048×9 calibration context."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (64, 512, 1536)
    mixed_batches: tuple[int, ...] = (0, 1, 3)  # decoders sharing a tick with a prefill chunk
    mixed_context: int = 512  # KV cells each of those decoders holds
    prefill_chunks: tuple[int, ...] = (8, 16, 32, 64, 128)
    prefill_starts: tuple[int, ...] = (0, 1000)  # n_past of the prompt when the chunk runs

    @property
    def source_cells(self) -> int:
        """Longest prefix any configuration clones from the source sequence."""
        mixed: tuple[int, ...] = (self.mixed_context,) if any(self.mixed_batches) else ()
        return max((*self.decode_contexts, *mixed, *self.prefill_starts, 1))

    @property
    def text_tokens(self) -> int:
        """Tokens of real text the grid reads: prefixes plus the tokens decoded after them."""
        chunk_end = max((s + p for s in self.prefill_starts for p in self.prefill_chunks), default=0)
        return max(self.source_cells + 1, chunk_end)

    @property
    def seqs_needed(self) -> int:
        """Seq 0 is the source; decoders are 1..D; the prefill chunk gets the next free id."""
        return 1 + max(max(self.decode_batches, default=0), max(self.mixed_batches, default=0) + 1)

    @property
    def prefill_seq(self) -> int:
        return max(self.mixed_batches, default=0) + 1

    def configurations(self) -> int:
        return len(self.decode_batches) * len(self.decode_contexts) + len(self.mixed_batches) * len(
            self.prefill_chunks
        ) * len(self.prefill_starts)


DEFAULT_GRID = Grid()
# On a GPU a step stays flat up to a knee: wider batches and chunks find it.
GPU_GRID = Grid(
    decode_batches=(1, 2, 4, 8, 16, 32),
    decode_contexts=(64, 512, 1536),
    mixed_batches=(0, 1, 4, 16),
    prefill_chunks=(16, 64, 128, 256, 480),
    prefill_starts=(0, 1000),
)


def measure(
    engine: LlamaEngine,
    *,
    repeats: int,
    progress: Progress | None = None,
    grid: Grid = DEFAULT_GRID,
) -> list[TickSample]:
    """Time every configuration of ``grid`` ``repeats`` times on the real engine.

    Decode-only ticks put ``D`` decoders at each context; mixed ticks add one
    prefill chunk of ``P`` prompt tokens at each start to ``D`` decoders at
    ``grid.mixed_context``.  Chunks request no logits (a middle chunk of a
    prompt); decoders sample greedily, as the decode loop does.
    """
    from .base import BatchEntry
    from .sampling import Sampler, SamplingParams

    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    _check_fits(engine, grid)
    say = progress or (lambda _line: None)
    greedy = Sampler(SamplingParams(temperature=0.0))
    tokens = _text_tokens(engine, grid.text_tokens)
    samples: list[TickSample] = []

    def timed(decoders: int, ctx: int, chunk: tuple[int, int] | None) -> list[float]:
        """Warm up once, then time ``repeats`` identical ticks, restoring the KV after each."""
        entries = [BatchEntry(seq, tokens[ctx : ctx + 1], ctx, greedy) for seq in range(1, decoders + 1)]
        if chunk is not None:
            start, n = chunk
            entries.append(BatchEntry(grid.prefill_seq, tokens[start : start + n], start, None))
        kv_cells = kv_cells_read([ctx] * decoders, [chunk] if chunk is not None else [])
        seconds = []
        for i in range(repeats + 1):
            took = engine.step_sync(entries).decode_s
            for seq in range(1, decoders + 1):
                engine.trim_seq(seq, ctx)
            if chunk is not None:
                engine.trim_seq(grid.prefill_seq, chunk[0])
            if i > 0:
                seconds.append(took)
                samples.append(TickSample(decoders, chunk[1] if chunk else 0, kv_cells, took))
        return seconds

    say(f"prefilling a {grid.source_cells}-token source context (untimed)")
    for pos in range(0, grid.source_cells, engine.n_batch):
        end = min(pos + engine.n_batch, grid.source_cells)
        engine.step_sync([BatchEntry(0, tokens[pos:end], pos, None)])
    try:
        for ctx in grid.decode_contexts:
            for d in grid.decode_batches:
                for seq in range(1, d + 1):
                    engine.copy_seq(0, seq, ctx)
                say(f"decode  D={d} ctx={ctx:>4}: {_ms(timed(d, ctx, None))}")
                for seq in range(1, d + 1):
                    engine.free_seq(seq)
        for start in grid.prefill_starts:
            for d in grid.mixed_batches:
                for seq in range(1, d + 1):
                    engine.copy_seq(0, seq, grid.mixed_context)
                engine.copy_seq(0, grid.prefill_seq, start)
                for p in grid.prefill_chunks:
                    times = timed(d, grid.mixed_context, (start, p))
                    say(f"mixed   D={d} P={p:>3} start={start:>4}: {_ms(times)}")
                for seq in range(1, d + 1):
                    engine.free_seq(seq)
                engine.free_seq(grid.prefill_seq)
    finally:
        for seq in range(grid.seqs_needed):
            engine.free_seq(seq)
    return samples


def _check_fits(engine: LlamaEngine, grid: Grid) -> None:
    if grid.seqs_needed > engine.n_seq_max:
        raise ValueError(f"the grid needs {grid.seqs_needed} sequences, the context has {engine.n_seq_max}")
    if grid.text_tokens + 1 > engine.n_ctx_seq:
        raise ValueError(
            f"the grid needs {grid.text_tokens + 1} cells a sequence, the context has {engine.n_ctx_seq}"
        )
    widest = max(grid.decode_batches, default=0)
    widest = max(widest, max(grid.mixed_batches, default=0) + max(grid.prefill_chunks, default=0))
    if widest > engine.n_batch:
        raise ValueError(f"the grid needs batches of {widest} tokens, n_batch is {engine.n_batch}")


def _text_tokens(engine: LlamaEngine, n: int) -> npt.NDArray[np.int32]:
    text = _TEXT
    while len(tokens := engine.tokenize(text)) < n:
        text += _TEXT
    return tokens[:n]


def _ms(seconds: Sequence[float]) -> str:
    return f"median {1000.0 * float(np.median(seconds)):7.2f} ms over {len(seconds)}"


# -- the whole run, for the CLI ------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    coefficients: CostCoefficients
    quality: FitQuality  # on the per-configuration medians the fit saw
    samples: list[TickSample]  # every timed tick

    @property
    def slow_ticks(self) -> int:
        """Ticks over twice their configuration's median: how noisy the machine was."""
        median = {
            (m.decode_tokens, m.prefill_tokens, m.kv_cells): m.seconds
            for m in median_per_configuration(self.samples)
        }
        return sum(
            s.seconds > 2.0 * median[s.decode_tokens, s.prefill_tokens, s.kv_cells] for s in self.samples
        )


def calibrate(
    model_path: Path,
    *,
    repeats: int = 5,
    threads: int | None = None,
    progress: Progress | None = None,
    grid: Grid | None = None,
    context: dict[str, Any] | None = None,
    placement: Placement | None = None,
) -> Calibration:
    """Load the model into a calibration context, measure, fit.

    ``context`` holds the :class:`~uma_trio.engine.llama.ContextConfig` settings the daemon
    will run with (micro-batch, KV type, flash attention; default: the fast mode's), and
    ``placement`` where the layers go; the grid is :data:`GPU_GRID` when layers are on a GPU.
    Raises ``ModelLoadError`` (from :mod:`uma_trio.engine.llama`) if llama.cpp refuses the model.
    """
    from .llama import ContextConfig, LlamaEngine, LlamaModel

    model = LlamaModel(model_path, placement) if placement is not None else LlamaModel(model_path)
    try:
        if grid is None:
            grid = GPU_GRID if model.layers_offloaded > 0 else DEFAULT_GRID
        config = ContextConfig(
            **{
                "n_ctx_seq": CALIBRATION_N_CTX_SEQ,
                "n_seq_max": max(CALIBRATION_N_SEQ_MAX, grid.seqs_needed),
                "n_threads": threads,
                **(context or {}),
            }
        )
        engine = LlamaEngine(model, config)
        try:
            samples = measure(engine, repeats=repeats, progress=progress, grid=grid)
            device = engine_device_key(engine)
        finally:
            engine.close()
    finally:
        model.close()
    source = describe_run(model_path, threads or os.cpu_count() or 1)
    coefficients = fit_coefficients(samples, source, device=device)
    quality = fit_quality(coefficients, median_per_configuration(samples))
    return Calibration(coefficients, quality, samples)


def calibrate_engine(
    engine: LlamaEngine, *, repeats: int = 3, progress: Progress | None = None
) -> Calibration:
    """Calibrate a running engine in place (the daemon at start-up, on a GPU it has no cost
    model for): :data:`GPU_GRID` cut down to what its context holds."""
    grid = fit_grid(GPU_GRID if engine.model.layers_offloaded > 0 else DEFAULT_GRID, engine)
    samples = measure(engine, repeats=repeats, progress=progress, grid=grid)
    source = describe_run(engine.model.path, engine.config.n_threads or os.cpu_count() or 1)
    coefficients = fit_coefficients(samples, source + " (at start-up)", device=engine_device_key(engine))
    return Calibration(coefficients, fit_quality(coefficients, median_per_configuration(samples)), samples)


def fit_grid(grid: Grid, engine: LlamaEngine) -> Grid:
    """``grid`` without the configurations ``engine``'s context cannot hold."""
    seqs, cells, batch = engine.n_seq_max, engine.n_ctx_seq, engine.n_batch
    chunks = tuple(p for p in grid.prefill_chunks if p < cells // 2)
    starts = tuple(st for st in grid.prefill_starts if st + max(chunks, default=0) < cells)
    mixed = tuple(d for d in grid.mixed_batches if d + 2 <= seqs and d + max(chunks, default=0) <= batch)
    return Grid(
        # up to every session but the source: a GPU step is not linear, so the fit must see
        # the widest batch the daemon will run rather than extrapolate to it
        decode_batches=tuple(
            sorted({d for d in grid.decode_batches if d + 1 <= seqs and d <= batch} | {seqs - 1})
        )
        if seqs > 1
        else (),
        decode_contexts=tuple(c for c in grid.decode_contexts if c + 1 < cells) or (min(64, cells // 2),),
        mixed_batches=mixed or (0,),
        mixed_context=min(grid.mixed_context, cells // 2),
        prefill_chunks=chunks,
        prefill_starts=starts or (0,),
    )


def engine_device_key(engine: LlamaEngine) -> str:
    """What a cost model is only valid for: the device that runs the layers, how many, the
    model file and the engine settings that change a step's cost."""
    from .devices import devices, placed_devices

    m, c = engine.model, engine.config
    p = m.placement
    used = list(placed_devices(devices(), p.split_mode, p.main_gpu)) if m.layers_offloaded else []
    gpus = [f"{d.name} {d.description}" for d in used]
    where = ", ".join(gpus) if gpus else "CPU"
    key = (
        f"{where}; layers {m.layers_offloaded}/{m.layers_total}; {m.path.name}; n_ubatch "
        f"{min(c.n_ubatch, c.n_batch)}; kv {c.kv_type}; flash_attn {'on' if engine.flash_attn else 'off'}"
    )
    # Captures change a CUDA step's cost, and so does how layers spread over several GPUs
    # (added only then: other keys stay as they were, so their files still fit).
    # A tensor split runs through llama.cpp's split device even on one GPU.
    if len(used) > 1 or (used and p.split_mode == "tensor"):
        key += f"; split {p.split_mode} {share_text(p.split_mode, p.tensor_split)}"
    # Where layers run on the CPU, its threads set a step's cost (1 thread: 2.3x 2's prefill);
    # and one KV stream for all sequences reads differently.  Added only off their defaults.
    threads = c.n_threads or os.cpu_count() or 1
    if m.layers_offloaded < m.layers_total and threads != (os.cpu_count() or 1):
        key += f"; threads {threads}"
    all_on_gpu = m.layers_offloaded == m.layers_total and m.layers_total > 0
    if c.kv_unified and not all_on_gpu:  # the auto default: unified only with every layer on a GPU
        key += "; kv_unified"
    elif not c.kv_unified and all_on_gpu:
        key += "; kv per sequence"
    cuda = any(d.backend == "CUDA" for d in used)
    return f"{key}; cuda_graphs off" if cuda and not engine.captures_graphs else key


def describe_run(model_path: Path, threads: int) -> str:
    """The ``source`` string: enough to tell which machine and model a cost file fits."""
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    return f"uma-trio calibrate {day}: {model_path.name}, {threads} threads, {_cpu_name()}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
