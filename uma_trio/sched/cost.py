"""Tick-time model: how long a batch takes, from what is in it.  Pure.

A tick's decode time on the CPU backend is close to linear in

* a fixed part per ``llama_decode`` (graph build, thread wake-up, weight reads),
* its decode tokens and its prefill tokens (each costs matmul work), and
* the KV cells attention reads: every batched token scans its sequence's
  context, so the cost grows with ``n_past``.

On a GPU a step is memory-bound up to a knee: the weights are read once whatever the
batch holds, so the first ``flat_tokens`` tokens of a tick cost no more than one
(``fixed_s``), and only the tokens beyond the knee add their per-token cost.  On the
CPU ``flat_tokens`` is 0 and the model is the plain line.  The policy spends the flat
part: a tick with room under the knee takes prompt tokens and background decoders for
free (:meth:`CostCoefficients.predict`).

:class:`CostCoefficients` hold one fit of that line; ``uma-trio calibrate``
measures them on the real engine and writes them as JSON, which both the
policy (as its prior) and the simulated engine (as ground truth) load.
:class:`TickCostModel` starts from those coefficients and keeps learning all four
online, jointly: an exponentially weighted least-squares fit over recent ticks, pulled
towards the prior where the ticks say little (ridge), then clamped to [¼, 4]× the prior.
Fitted jointly, time every tick shares (contention on a busy machine, a slower clock)
lands in ``fixed_s`` instead of inflating the per-token costs of whichever token kind
the tick happened to carry.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from msgspec.structs import replace


class CostCoefficients(msgspec.Struct, frozen=True, kw_only=True):
    """``seconds = fixed_s + decode_s·D + prefill_s·P + ctx_s_per_kcell·(KV cells read)/1000``,
    plus ``prompt_tick_s`` when the tick carries any prompt token (P > 0).

    That last term is a step, not a slope: on the H100 three decode tokens took 5.4 ms and the
    same three with two prompt tokens 9.1 ms (another batch shape: other matrix kernels, and
    llama.cpp's CUDA graph rebuilt), while 64 more prompt tokens cost little more.  A line
    through such ticks prices a few prompt tokens as cheap, so a policy trickled them in two at
    a time, each tick paying the whole jump (BENCHMARKS.md "GPU", run M's mixed trace)."""

    # Defaults: `uma-trio calibrate` on the 2-core AMD EPYC dev machine, SmolLM2-135M Q4_1
    # (three runs, R² 0.988-0.997, mean relative error 8-9%).
    fixed_s: float = 0.0032
    decode_s: float = 0.0038  # per decode token
    prefill_s: float = 0.0023  # per prompt token
    ctx_s_per_kcell: float = 0.0018  # per 1,000 KV cells scanned by the batch's tokens
    flat_tokens: int = 0  # tokens a tick carries for fixed_s alone (the knee; 0 on a CPU)
    prompt_tick_s: float = 0.0  # once per tick that carries prompt tokens (the step above)
    source: str = "built-in defaults (2-core AMD EPYC, SmolLM2-135M Q4_1)"
    device: str = ""  # what the coefficients were measured on (engine_device_key); "" = any CPU

    def predict(self, decode_tokens: int, prefill_tokens: int, kv_cells_read: int) -> float:
        n = decode_tokens + prefill_tokens
        if n == 0:
            return 0.0
        beyond = over_knee(n, self.flat_tokens)
        return (
            self.fixed_s
            + beyond * (self.decode_s * decode_tokens + self.prefill_s * prefill_tokens)
            + self.ctx_s_per_kcell * kv_cells_read / 1000.0
            + (self.prompt_tick_s if prefill_tokens > 0 else 0.0)
        )

    def save(self, path: Path) -> None:
        """Atomically: a process killed mid-write leaves the old file or none, never half."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(msgspec.json.format(msgspec.json.encode(self)))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> CostCoefficients:
        """Raises :class:`CostModelError` naming the file and what is wrong with it."""
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except OSError as exc:
            raise CostModelError(f"{path}: {exc.strerror or exc}") from None
        except msgspec.DecodeError as exc:  # ValidationError is one too
            raise CostModelError(f"{path} is not a cost model from `uma-trio calibrate`: {exc}") from None


class CostModelError(ValueError):
    """A cost-model file that cannot be read or is not one."""


def over_knee(n_tokens: int, flat_tokens: int) -> float:
    """The share of a tick's tokens past the knee, which pay their per-token cost."""
    return max(0, n_tokens - flat_tokens) / n_tokens if n_tokens > 0 else 0.0


def kv_cells_read(decode_ctx: list[int], prefill: list[tuple[int, int]]) -> int:
    """KV cells attention scans: a decode token reads its ``n_past`` cells; a chunk of
    ``n`` prompt tokens starting at ``n_past`` reads about ``n·(n_past + n/2)``."""
    return sum(decode_ctx) + sum(n * (start + n // 2) for start, n in prefill)


_N = 5  # the fit's features: fixed, decode tokens, prompt tokens, KV cells, a prompt's step


def solve_positive_definite(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a·x = b`` for a small symmetric positive definite ``a`` (Cholesky)."""
    n = len(b)
    low: list[list[float]] = []
    for i in range(n):
        row_a, row = a[i], [0.0] * n
        for j in range(i + 1):
            other, s = low[j] if j < i else row, row_a[j]
            for k in range(j):
                s -= row[k] * other[k]
            if j < i:
                row[j] = s / other[j]
            elif s > 0.0:
                row[i] = math.sqrt(s)
            else:
                raise ValueError("the matrix is not positive definite")
        low.append(row)
    y = [0.0] * n
    for i in range(n):
        row, s = low[i], b[i]
        for k in range(i):
            s -= row[k] * y[k]
        y[i] = s / row[i]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        s = y[i]
        for k in range(i + 1, n):
            s -= low[k][i] * x[k]
        x[i] = s / low[i][i]
    return x


CLAMP = 4.0  # how far the online corrections may move a cost from the prior (either way)
# A step that took more than this × its prediction is learned as this × its prediction: it
# stalled (the VM stopped it, a CUDA graph was captured), which says nothing of what the next
# tick's tokens cost.  Folded in whole, one 83 ms step among 10 ms ones (compare.py mixed, run
# BE) lifted the predicted three-chat tick 2.4×, and the tick budget with it, for ~30 ticks.
# A real change of pace still gets through, at up to this factor a tick.
STALL_FACTOR = 2.0


@dataclass
class TickCostModel:
    """The coefficients, refitted online from measured ticks (see the module docstring)."""

    prior: CostCoefficients
    forget: float = 0.97  # a tick's weight decays by this each tick: ~33 ticks of memory
    prior_ticks: float = 0.05  # the prior weighs as much as this many typical ticks: it decides
    # only what the ticks leave open (e.g. fixed vs per-token cost while every tick has 16 tokens)
    current: CostCoefficients | None = None
    last_s: float = 0.0
    ewma_s: float = 0.0
    # Exponentially weighted sums over ticks of x·xᵀ, x·seconds and x² (x: the features).
    # Plain floats, not numpy: a tick is folded in right after its step, when the step has
    # pushed the interpreter's working set out of the CPU caches, and a dozen small numpy
    # calls (linalg.solve's wrappers among them) then took ~150 µs of a 6.5 ms CPU tick.
    _gram: list[list[float]] = field(default_factory=lambda: [[0.0] * _N for _ in range(_N)])
    _rhs: list[float] = field(default_factory=lambda: [0.0] * _N)
    _sq: list[float] = field(default_factory=lambda: [0.0] * _N)
    _weight: float = 0.0
    _stale: bool = False  # ticks were folded in since the last solve

    def __post_init__(self) -> None:
        if self.current is None:
            self.current = self.prior

    @property
    def coefficients(self) -> CostCoefficients:
        """The fit of every tick observed so far.  Solved when read, not at each tick: the
        fit is a function of the sums alone, and steps run ahead (runtime/run_ahead.py) are
        observed one after another with no plan reading it in between."""
        if self._stale:
            self._solve()
        assert self.current is not None
        return self.current

    def predict(self, decode_tokens: int, prefill_tokens: int, kv_cells: int) -> float:
        return self.coefficients.predict(decode_tokens, prefill_tokens, kv_cells)

    def observe(self, decode_tokens: int, prefill_tokens: int, kv_cells: int, seconds: float) -> None:
        """Fold one measured tick into the fit (a stall only as :data:`STALL_FACTOR` × the
        prediction; :attr:`last_s` and :attr:`ewma_s` keep what was measured)."""
        if decode_tokens + prefill_tokens == 0:
            return
        self.last_s = seconds
        self.ewma_s = seconds if self.ewma_s == 0.0 else 0.8 * self.ewma_s + 0.2 * seconds
        assert self.current is not None  # the last solve's: what the plan was made with
        predicted = self.current.predict(decode_tokens, prefill_tokens, kv_cells)
        if predicted > 0.0:  # a model that predicts nothing yet learns from what it sees
            seconds = min(seconds, STALL_FACTOR * predicted)
        p = self.prior
        beyond = over_knee(decode_tokens + prefill_tokens, p.flat_tokens)
        has_prompt = float(prefill_tokens > 0)
        x = (1.0, beyond * decode_tokens, beyond * prefill_tokens, kv_cells / 1000.0, has_prompt)
        f = self.forget
        for i, row in enumerate(self._gram):
            xi = x[i]
            for j in range(_N):
                row[j] = f * row[j] + xi * x[j]
            self._rhs[i] = f * self._rhs[i] + xi * seconds
            self._sq[i] = f * self._sq[i] + xi * xi
        self._weight = f * self._weight + 1.0
        self._stale = True

    def _solve(self) -> None:
        self._stale = False
        p = self.prior
        # Ridge towards the prior, scaled per feature by its typical size; a feature no tick
        # has carried yet (prompt tokens before the first prompt) keeps the prior's value.
        prior = (p.fixed_s, p.decode_s, p.prefill_s, p.ctx_s_per_kcell, p.prompt_tick_s)
        ridge = [self.prior_ticks * sq / self._weight + 1e-9 for sq in self._sq]
        system = [
            [v + ridge[i] if i == j else v for j, v in enumerate(row)] for i, row in enumerate(self._gram)
        ]
        rhs = [b + r * q for b, r, q in zip(self._rhs, ridge, prior, strict=True)]
        fit = solve_positive_definite(system, rhs)
        # Exactly the prior's where no tick has carried the feature (it is decoupled there,
        # and the solve would only round it).
        fixed, decode, prefill, ctx, prompt_tick = (
            q if sq == 0.0 else v for v, q, sq in zip(fit, prior, self._sq, strict=True)
        )
        self.current = self._clamped(
            replace(
                p, fixed_s=fixed, decode_s=decode, prefill_s=prefill, ctx_s_per_kcell=ctx,
                prompt_tick_s=prompt_tick,
            )
        )  # fmt: skip

    def _clamped(self, coefficients: CostCoefficients) -> CostCoefficients:
        """Each learned cost within [1/CLAMP, CLAMP] × the prior's.  On a busy machine a tick
        also holds time spent waiting for cores, which the per-token costs would otherwise
        absorb without bound (seen: prefill at 19-1,942 ms a token against a prior of 2.3,
        and a lone prompt moving one token a tick)."""
        p = self.prior

        def clamp(value: float, prior: float) -> float:
            return min(max(value, prior / CLAMP), prior * CLAMP) if prior > 0 else max(value, 0.0)

        return replace(
            coefficients,
            fixed_s=clamp(coefficients.fixed_s, p.fixed_s),
            decode_s=clamp(coefficients.decode_s, p.decode_s),
            prefill_s=clamp(coefficients.prefill_s, p.prefill_s),
            ctx_s_per_kcell=clamp(coefficients.ctx_s_per_kcell, p.ctx_s_per_kcell),
            # A prior of 0 (a CPU, uncalibrated) still bounds it: a jump is a share of a tick.
            prompt_tick_s=min(max(coefficients.prompt_tick_s, 0.0), CLAMP * max(p.prompt_tick_s, p.fixed_s)),
        )
