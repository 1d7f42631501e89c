"""benches/cpu_steal.py: the hypervisor's steal time over a benchmark run's window."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType


def load() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benches" / "cpu_steal.py"
    spec = importlib.util.spec_from_file_location("cpu_steal", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_window_counts_the_rise_from_the_sample_before_it_to_the_one_after() -> None:
    between = load()._steal_between
    times, steal = [0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.4, 6.0]
    assert abs(between(times, steal, 1.0, 2.0) - 0.4) < 1e-12
    assert abs(between(times, steal, 1.5, 2.5) - 1.0) < 1e-12  # never under-counted: 1.0 -> 3.0
    assert between(times, steal, 0.0, 1.0) == 0.0
    assert between(times, steal, 2.0, 2.0) == 0.0 and between([], [], 0.0, 1.0) == 0.0
    assert abs(between(times, steal, -1.0, 9.0) - 1.0) < 1e-12  # clamped to the samples taken


def test_the_sampler_samples_while_the_block_runs() -> None:
    module = load()
    with module.StealSampler(interval_s=0.01) as sampler:
        began = time.perf_counter()
        time.sleep(0.05)
        ended = time.perf_counter()
    assert len(sampler._times) >= 4  # the first, the thread's, the last
    assert sampler.during(began, ended) >= 0.0
    assert module.cumulative_steal_s() >= 0.0
