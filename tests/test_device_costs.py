"""Start-up calibrations kept per device: the second start on a device measures nothing."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from uma_trio.engine import device_costs
from uma_trio.engine.calibrate import Calibration, fit_coefficients, fit_quality, median_per_configuration
from uma_trio.sched.cost import CostCoefficients

from .test_calibrate import synthetic

KEY = "CUDA0 NVIDIA H100 80GB HBM3; layers 33/33; model.gguf; n_ubatch 512; kv f16; flash_attn on"


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def measured(noise: float, device: str = KEY) -> Calibration:
    """A calibration fitted from synthetic ticks, each off the line by a factor of
    ``exp(noise·N(0, 1))`` (a busy machine's spread; the fit is the real one)."""
    rng = np.random.default_rng(7)
    samples = [
        replace(s, seconds=s.seconds * float(np.exp(noise * rng.standard_normal())))
        for s in synthetic(0.004, 0.003, 0.0022, 0.0019, noise=0.0, step=0.002)
    ]
    costs = fit_coefficients(samples, "uma-trio calibrate (at start-up)", device=device)
    return Calibration(costs, fit_quality(costs, median_per_configuration(samples)), samples)


class Counting:
    """A ``measure`` that counts its calls, so a test sees whether calibration ran."""

    def __init__(self, result: Calibration) -> None:
        self.result, self.calls = result, 0

    def __call__(self) -> Calibration:
        self.calls += 1
        return self.result


def test_the_first_start_measures_and_keeps_it_the_second_reads_it_back(cache: Path) -> None:
    first = Counting(measured(noise=0.01))
    costs = device_costs.kept_or_measured(KEY, first)
    assert first.calls == 1
    assert costs == first.result.coefficients
    path = device_costs.path_for(KEY)
    assert path.parent == cache / "cost-models" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # written whole, no temporary left
    second = Counting(measured(noise=0.01))
    assert device_costs.kept_or_measured(KEY, second) == costs
    assert second.calls == 0
    # another device (or model, or setting) has a key of its own and is measured
    other = Counting(measured(noise=0.01, device=KEY.replace("33/33", "20/33")))
    device_costs.kept_or_measured(KEY.replace("33/33", "20/33"), other)
    assert other.calls == 1
    assert len(list((cache / "cost-models").iterdir())) == 2


def test_a_poor_fit_is_used_for_this_run_but_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    noisy = measured(noise=1.0)
    assert noisy.quality.r2 < device_costs.MIN_R2_TO_KEEP
    with caplog.at_level(logging.WARNING, logger="uma_trio.engine.device_costs"):
        assert device_costs.kept_or_measured(KEY, Counting(noisy)) == noisy.coefficients
    assert "used for this run only" in caplog.text
    assert device_costs.load_for(KEY) is None
    again = Counting(measured(noise=0.01))
    device_costs.kept_or_measured(KEY, again)
    assert again.calls == 1


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b'{"fixed_s": "fast"}', b"[1, 2, 3]"],
    ids=["empty", "not-json", "wrong-type", "not-an-object"],
)
def test_a_damaged_file_is_measured_again_and_replaced(
    content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = device_costs.path_for(KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="uma_trio.engine.device_costs"):
        assert device_costs.load_for(KEY) is None
    assert "is not a cost model" in caplog.text
    fresh = Counting(measured(noise=0.01))
    device_costs.kept_or_measured(KEY, fresh)
    assert fresh.calls == 1
    kept = device_costs.load_for(KEY)
    assert kept is not None and kept[0] == fresh.result.coefficients


def test_a_file_for_another_key_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    path = device_costs.path_for(KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"device": "Vulkan0 something else"}')
    with caplog.at_level(logging.WARNING, logger="uma_trio.engine.device_costs"):
        assert device_costs.load_for(KEY) is None
    assert "Vulkan0 something else" in caplog.text


def test_an_unwritable_cache_costs_only_the_next_calibration(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    (cache.parent / "cache").write_text("a file where the cache directory should be")
    result = measured(noise=0.01)
    with caplog.at_level(logging.WARNING, logger="uma_trio.engine.device_costs"):
        assert device_costs.kept_or_measured(KEY, Counting(result)) == result.coefficients
    assert "the next start calibrates again" in caplog.text


def test_only_a_model_with_its_device_key_is_kept() -> None:
    with pytest.raises(ValueError, match="device key"):
        device_costs.store(CostCoefficients())


def test_keys_that_differ_in_any_setting_get_different_files() -> None:
    paths = {device_costs.path_for(KEY.replace("f16", kv)) for kv in ("f16", "q8_0", "q4_0")}
    assert len(paths) == 3
    assert all(p.suffix == ".json" and " " not in p.name for p in paths)
