"""benches/gpu_mixed_runs.py: recorded GPU mixed runs, the worst gap against the chats alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHES = Path(__file__).resolve().parent.parent / "benches"


def load() -> ModuleType:
    sys.path.insert(0, str(BENCHES))  # it imports bench_output beside it
    try:
        spec = importlib.util.spec_from_file_location("gpu_mixed_runs", BENCHES / "gpu_mixed_runs.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHES))


def row(system: str = "uma-trio", part: str = "mixed", variant: str = "", **gaps: str) -> dict[str, str]:
    figures = {"gap_ms_p95": "7", "gap_ms_max": "14", "alone_gap_ms_p95": "7", "alone_gap_ms_max": "21"}
    return {"run": "2026-11-27 run T", "system": system, "part": part, "variant": variant, **figures, **gaps}


def test_only_uma_trio_cuda_mixed_rows_with_both_phases_count() -> None:
    module = load()
    rows = [
        row(),
        row(system="llama-server"),
        row(part="streams"),
        row(variant="Vulkan (NVIDIA driver)"),
        row(variant="--no-cuda-graphs"),
        row(alone_gap_ms_max=""),
    ]
    (only,) = module.mixed_runs(rows)
    assert only.p95_vs_alone_p95 == 1.0
    assert only.max_vs_alone_p95 == 2.0
    assert only.alone_max_vs_alone_p95 == 3.0
    assert abs(only.max_vs_alone_max - 14 / 21) < 1e-3


def test_the_totals_count_the_runs_within_each_limit() -> None:
    module = load()
    runs = module.mixed_runs([row(), row(gap_ms_max="15", alone_gap_ms_max="14", gap_ms_p95="9")])
    lines = module.totals(runs)
    assert lines[0] == "2 CUDA mixed runs"
    assert lines[1].endswith(": 1 of 2")  # p95 9 / 7 > 1.2
    assert "<= 2.0: 1 of 2" in lines[2]  # max 15 / 7 > 2
    assert "<= 2.0: 1 of 2" in lines[3]  # the chats alone: 21 / 7 over, 14 / 7 within
    assert lines[4].endswith("<= 1.0 in 1 of 2")  # 14 / 21 within, 15 / 14 over
    assert module.totals([]) == ["no CUDA mixed runs with both phases recorded"]
