"""GPU and engine options without a GPU: parsing, the --gpu-layers auto decision on made-up
devices, the two modes' settings, and what `uma-trio info` prints (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from uma_trio.config import ConfigError, ServerConfig, parse_gpu_layers, parse_tensor_split
from uma_trio.engine.devices import Device, layer_devices, placed_devices, supports_gpu_offload
from uma_trio.engine.offload import DeviceMemory, OffloadPlan, plan_offload
from uma_trio.engine.summary import engine_summary, one_line, split_description

GIB = 1024**3


def plan(
    requested: str, *, free_gib: float = 78, gpu: bool = True, weights_gib: float = 4.6, kv_gib: float = 1.0
) -> OffloadPlan:
    device = DeviceMemory("CUDA0", "test GPU", int(free_gib * GIB), 80 * GIB)
    return plan_offload(
        parse_gpu_layers(requested), supports_offload=gpu, devices=(device,) if gpu else (),
        n_layer=32, weight_bytes=int(weights_gib * GIB), kv_bytes=int(kv_gib * GIB),
    )  # fmt: skip


def test_gpu_layers_values_parse_and_bad_ones_name_the_flag() -> None:
    assert parse_gpu_layers("auto") == "auto" and parse_gpu_layers(" ALL ") == "all"
    assert parse_gpu_layers("0") == 0 and parse_gpu_layers("20") == 20
    for bad in ("-1", "many", "1.5", ""):
        with pytest.raises(ValueError, match="--gpu-layers"):
            parse_gpu_layers(bad)
    assert parse_tensor_split("3,1") == (3.0, 1.0) and parse_tensor_split("1/1/2") == (1.0, 1.0, 2.0)
    for bad in ("", "a,b", "-1,2", "0,0"):
        with pytest.raises(ValueError, match="--tensor-split"):
            parse_tensor_split(bad)


def test_auto_offloads_everything_that_fits_and_the_rest_by_layer() -> None:
    full = plan("auto")
    assert (full.n_gpu_layers, full.total) == (33, 33) and "fit in" in full.reason
    # 4.6 + 1.0 GiB over 33 layers is ~0.17 GiB a layer; 3 GiB free less the 512 MiB reserve.
    partial = plan("auto", free_gib=3.0)
    assert 0 < partial.n_gpu_layers < 33 and "offloading the" in partial.reason
    assert partial.n_gpu_layers == int((3.0 - 0.5) * GIB // ((4.6 + 1.0) * GIB / 33))
    assert plan("auto", free_gib=0.4).n_gpu_layers == 0  # not even the reserve
    # The KV cache counts: the same weights with a 40 GiB cache no longer fit whole.
    assert plan("auto", kv_gib=40.0, free_gib=30).n_gpu_layers < 33


def test_without_a_gpu_backend_or_device_everything_stays_on_the_cpu() -> None:
    assert plan("auto", gpu=False).n_gpu_layers == 0
    assert "no GPU backend" in plan("all", gpu=False).reason
    no_device = plan_offload(
        "auto", supports_offload=True, devices=(), n_layer=32, weight_bytes=1, kv_bytes=1
    )
    assert no_device.n_gpu_layers == 0 and "no GPU device" in no_device.reason
    # A Vulkan build whose only Vulkan device is a CPU (llvmpipe): llama.cpp skips the device
    # and reports no offload; the reason names the backend rather than denying it exists.
    built_no_device = plan_offload(
        "auto", supports_offload=False, devices=(), n_layer=32, weight_bytes=1, kv_bytes=1,
        gpu_backends=("Vulkan",),
    )  # fmt: skip
    assert built_no_device.n_gpu_layers == 0
    assert built_no_device.reason == "CPU only: the Vulkan backend found no GPU device"


def test_all_and_counts_are_taken_as_asked() -> None:
    assert plan("all", free_gib=0.1).n_gpu_layers == 33  # the user's word, even when it will not fit
    assert plan("12").n_gpu_layers == 12 and plan("999").n_gpu_layers == 33
    assert plan("0").n_gpu_layers == 0


def test_fast_and_deterministic_modes_and_contradictions() -> None:
    fast = ServerConfig()
    assert (fast.engine_n_ubatch, fast.engine_kv_type, fast.engine_flash_attn) == (512, "f16", "auto")
    # One KV stream for all sessions by default only with every layer on a GPU (fast mode).
    assert fast.engine_kv_unified(True) and not fast.engine_kv_unified(False)
    assert not ServerConfig(kv_unified=False).engine_kv_unified(True)
    assert not ServerConfig(deterministic=True).engine_kv_unified(True)
    exact = ServerConfig(deterministic=True)
    assert (exact.engine_n_ubatch, exact.engine_kv_type, exact.engine_flash_attn) == (32, "q8_0", "on")
    assert ServerConfig(deterministic=True, kv_type="q4_0", n_ubatch=16).engine_n_ubatch == 16
    for bad, flag in [
        ({"kv_type": "f16"}, "quantized KV"), ({"n_ubatch": 64}, "--n-ubatch"),
        ({"kv_unified": True}, "--kv-unified"), ({"flash_attn": "off"}, "flash"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=flag):
            ServerConfig(deterministic=True, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--flash-attn off needs --kv-type f16"):
        ServerConfig(flash_attn="off", kv_type="q8_0")
    for bad in ({"gpu_layers": "x"}, {"main_gpu": -1}, {"split_mode": "diag"}, {"flash_attn": "maybe"}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)  # type: ignore[arg-type]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "uma_trio", *args], capture_output=True, text=True, timeout=120
    )


def test_the_builds_backends_include_every_devices_backend() -> None:
    from uma_trio.engine.devices import backends_built, devices

    built = backends_built()
    assert "CPU" in built and len(set(built)) == len(built)
    assert {d.backend for d in devices()} <= set(built)


def test_deterministic_mode_says_its_guarantee_is_the_cpus_where_layers_are_on_a_gpu() -> None:
    from uma_trio.engine.devices import Device
    from uma_trio.engine.summary import deterministic_caveat, engine_summary

    gpu = Device("Vulkan0", "llvmpipe", "GPU", "Vulkan", 2 * GIB, 2 * GIB)
    cpu = Device("CPU", "AMD EPYC", "CPU", "CPU", 24 * GIB, 24 * GIB)

    def summary(offloaded: int, deterministic: bool) -> dict[str, object]:
        return engine_summary(
            system_info="", devices=(gpu, cpu), layers=(offloaded, 31), reason="test", kv_type="q8_0",
            kv_bytes=1, kv_cells=1, flash_attn="on", settings={"deterministic": deterministic}, model={},
        )  # fmt: skip

    caveat = deterministic_caveat(summary(31, True))
    assert caveat is not None and "CPU backend only" in caveat and "31 of 31 layers on Vulkan0" in caveat
    assert deterministic_caveat(summary(0, True)) is None  # on the CPU the guarantee holds
    assert deterministic_caveat(summary(31, False)) is None  # the fast mode promises nothing


@pytest.mark.model
def test_info_prints_what_serve_would_run_on_without_a_daemon() -> None:
    done = run_cli("info", "--json", "--max-sessions", "4", "--n-ctx", "1024")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["backends"] == ["CPU"] and info["devices"][0]["kind"] == "CPU"
    assert info["gpu_layers"] == {
        "offloaded": 0,
        "total": 31,
        "reason": "CPU only: this llama.cpp build has no GPU backend",
    }
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes (f16) = 23,040 bytes a cell.
    assert info["kv"] == {"location": "CPU", "type": "f16", "bytes": 4096 * 23040, "cells": 4096}
    assert info["settings"]["n_ubatch"] == 512 and info["settings"]["deterministic"] is False
    assert info["settings"]["cuda_graphs"] is False  # nothing on a CUDA device
    text = run_cli("info", "--deterministic").stdout
    assert "GPU layers    0 of 31" in text and "q8_0" in text and "deterministic" in text
    assert info["host_memory_problem"] is None


@pytest.mark.model
def test_a_kv_cache_bigger_than_the_machine_is_refused_before_it_loads(tmp_path: Path) -> None:
    """`serve --n-ctx 99999999999` grew to the machine's 23 GB and was OOM-killed (exit 137);
    `info --n-ctx 200000` showed a 34 GiB cache on it without a word."""
    import psutil

    cells = psutil.virtual_memory().total // 23040 + 1  # one cell more than the machine holds
    socket = str(tmp_path / "s.sock")
    done = run_cli("serve", "--n-ctx", str(cells), "--max-sessions", "1", "--socket", socket)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"--n-ctx {cells} × --max-sessions 1 cells need a" in done.stderr
    assert "GiB f16 KV cache in host memory" in done.stderr and "--kv-type q8_0" in done.stderr

    shown = run_cli("info", "--n-ctx", str(cells), "--max-sessions", "1")
    assert shown.returncode == 0 and "refused       serve would not start: --n-ctx" in shown.stdout


def test_the_memory_checked_is_the_container_s_where_its_limit_is_lower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel OOM-kills a container at its cgroup limit, not at the machine's memory."""
    import psutil

    from uma_trio.engine import planned

    limit = tmp_path / "memory.max"
    monkeypatch.setattr(planned, "_CGROUP_LIMITS", (limit,))
    total = psutil.virtual_memory().total
    limit.write_text("max\n")  # cgroup v2's "no limit"
    assert planned.host_memory_bytes() == total
    limit.write_text(f"{1 << 30}\n")
    assert planned.host_memory_bytes() == 1 << 30
    limit.write_text(f"{total * 2}\n")
    assert planned.host_memory_bytes() == total


@pytest.mark.model
def test_serve_refuses_bad_engine_options_naming_the_flag() -> None:
    for args, words in [
        (["--gpu-layers", "lots"], "--gpu-layers"),
        (["--deterministic", "--kv-type", "f16"], "--deterministic"),
        (["--tensor-split", "a,b"], "--tensor-split"),
        (["--idle-timeout", "nan"], "--idle-timeout"),  # NaN passed every range check
        (["--latency-cap", "nan", "--keep-alive", "nan"], "--keep-alive, --latency-cap"),
    ]:  # fmt: skip
        done = run_cli("serve", *args, "--socket", "/tmp/uma-never/x.sock")
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr


def test_a_socket_path_too_long_to_bind_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """98-107 bytes passed the kernel's limit only once the staging name was added: the daemon
    failed at bind, after loading the model, with a traceback and exit 1."""
    from uma_trio.runtime.unix_socket import STAGING_EXTRA, SUN_PATH_BYTES

    most = SUN_PATH_BYTES - 1 - STAGING_EXTRA
    name = "s" * (most + 1 - len(os.fsencode(tmp_path)) - 1)
    too_long = tmp_path / name
    assert len(os.fsencode(too_long)) == most + 1
    done = run_cli("serve", "--socket", str(too_long))
    assert done.returncode == 2 and "--socket" in done.stderr and "Traceback" not in done.stderr
    assert "loading" not in done.stderr.lower()


def test_no_cuda_graphs_parses_from_the_flag_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from uma_trio import cli

    assert ServerConfig().cuda_graphs is True
    assert cli.app.parse_args(["serve", "--no-cuda-graphs"])[1].kwargs["config"].cuda_graphs is False
    monkeypatch.setenv("UMA_CUDA_GRAPHS", "false")
    assert cli.app.parse_args(["serve"])[1].kwargs["config"].cuda_graphs is False


def test_no_cuda_graphs_turns_llama_cpps_switch_on_and_nothing_turns_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from uma_trio.engine.devices import apply_cuda_graphs, captures_cuda_graphs

    # Set, then removed: monkeypatch then restores the variable as it was when the test ends.
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "")
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS")
    apply_cuda_graphs(True)
    assert "GGML_CUDA_DISABLE_GRAPHS" not in os.environ
    apply_cuda_graphs(False)
    assert os.environ["GGML_CUDA_DISABLE_GRAPHS"] == "1"
    apply_cuda_graphs(True)  # the environment's switch, or an earlier model's, stands
    assert os.environ["GGML_CUDA_DISABLE_GRAPHS"] == "1"
    assert captures_cuda_graphs(33) is False  # whatever devices this machine has


@pytest.mark.model
def test_no_cuda_graphs_reaches_llama_cpp_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """ggml-cuda reads its switch once, at the first step of any model: it must be set before
    the weights load, not after."""
    from uma_trio import daemon
    from uma_trio.engine.llama import ModelLoadError
    from uma_trio.model_files import ensure_default_model

    # Set, then removed: monkeypatch then restores the variable as it was when the test ends.
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "")
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS")
    seen: dict[str, str | None] = {}

    def loading(path: object, placement: object) -> None:
        seen["switch"] = os.environ.get("GGML_CUDA_DISABLE_GRAPHS")
        raise ModelLoadError("stopped before the weights")

    monkeypatch.setattr(daemon, "LlamaModel", loading)
    with pytest.raises(ModelLoadError):
        daemon.load_model(ensure_default_model(), ServerConfig(cuda_graphs=False))
    assert seen["switch"] == "1"
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS")
    with pytest.raises(ModelLoadError):
        daemon.load_model(ensure_default_model(), ServerConfig())
    assert seen["switch"] is None


def two_gpus(
    free0_gib: float, free1_gib: float, splits_rows: bool = False
) -> tuple[DeviceMemory, DeviceMemory]:
    return (
        DeviceMemory("CUDA0", "test GPU", int(free0_gib * GIB), 80 * GIB, splits_rows),
        DeviceMemory("CUDA1", "test GPU", int(free1_gib * GIB), 80 * GIB, splits_rows),
    )


def placed(devices: tuple[DeviceMemory, ...], weights_gib: float, **placement: Any) -> OffloadPlan:
    return plan_offload(
        "auto", supports_offload=True, devices=devices, n_layer=32, weight_bytes=int(weights_gib * GIB),
        kv_bytes=GIB, **placement,
    )  # fmt: skip


def test_auto_plans_for_the_gpus_llama_cpp_will_use() -> None:
    gpus = two_gpus(40, 40)
    # layer or row split: llama.cpp spreads the layers by free memory, each GPU keeps a reserve
    both = placed(gpus, 60)
    assert both.n_gpu_layers == 33 and both.reason.endswith("free on CUDA0, CUDA1")
    assert placed(two_gpus(40, 40, splits_rows=True), 60, split_mode="row").n_gpu_layers == 33
    assert placed(gpus, 80, split_mode="layer").n_gpu_layers < 33  # 81 GiB > 2 x (40 - 2)
    # none: the whole model on --main-gpu, so only its memory counts
    alone = placed(gpus, 60, split_mode="none", main_gpu=1)
    assert 0 < alone.n_gpu_layers < 33 and "of 40.00 GiB free" in alone.reason
    assert placed(gpus, 30, split_mode="none", main_gpu=1).reason.endswith("free on CUDA1")
    # a tensor split fills each GPU by its share: 3,1 puts 3/4 of 61 GiB on a 40 GiB GPU
    skewed = placed(gpus, 60, tensor_split=(3.0, 1.0))
    assert 0 < skewed.n_gpu_layers < 33
    usable0 = 40 * GIB - max(int(40 * GIB * 0.05), 512 * 1024**2)
    assert skewed.n_gpu_layers == int(usable0 * 4 / 3 // (61 * GIB / 33))
    assert placed(gpus, 60, tensor_split=(1.0, 1.0)).n_gpu_layers == 33
    # a share of 0 leaves that GPU out
    assert placed(two_gpus(40, 0.1), 30, tensor_split=(1.0, 0.0)).reason.endswith("free on CUDA0")
    # llama.cpp's default split follows free memory: a nearly full second GPU still gets its
    # share (1/41 of the model), which must fit in what it has left after its reserve
    lopsided = placed(two_gpus(40, 1), 37)
    assert 0 < lopsided.n_gpu_layers < 33
    usable1 = 1 * GIB - 512 * 1024**2
    assert lopsided.n_gpu_layers == int(usable1 * 41 // (38 * GIB / 33))


def test_tensor_split_fills_the_gpus_evenly_unless_told() -> None:
    """llama.cpp's tensor split cuts every matrix (and the KV) into equal parts by default,
    whatever each GPU has free; the layer split follows free memory."""
    gpus = two_gpus(40, 10)  # usable 38 and 9.5 GiB
    assert placed(gpus, 30).n_gpu_layers == 33  # by free memory: 4/5 and 1/5 of 31 GiB fit
    even = placed(gpus, 30, split_mode="tensor")  # half of 31 GiB on a 10 GiB GPU does not
    assert even.n_gpu_layers == int(2 * 9.5 * GIB // (31 * GIB / 33)) and "19.00 GiB usable" in even.reason
    assert placed(gpus, 30, split_mode="tensor", tensor_split=(4.0, 1.0)).n_gpu_layers == 33
    assert placed(gpus, 15, split_mode="tensor").reason.endswith("free on CUDA0, CUDA1")


def test_row_split_is_refused_where_the_backend_cannot_split_rows() -> None:
    """The pinned llama.cpp's CUDA backend has no split buffer type, so its row split fails the
    load ("device CUDA0 does not support split buffers"); uma-trio says so at start-up."""
    cuda = tuple(
        DeviceMemory(f"CUDA{i}", "test GPU", 40 * GIB, 80 * GIB, splits_rows=False) for i in range(2)
    )
    with pytest.raises(
        ConfigError, match=r"--split-mode row: the backend of CUDA0, CUDA1 cannot split .* tensor"
    ):
        placed(cuda, 10, split_mode="row")
    with pytest.raises(ConfigError, match="--split-mode row"):  # at 0 layers too: llama.cpp asks every GPU
        plan_offload(
            0, supports_offload=True, devices=cuda, n_layer=32, weight_bytes=1, kv_bytes=1, split_mode="row"
        )
    assert placed(cuda, 10, split_mode="tensor").n_gpu_layers == 33
    assert placed(two_gpus(40, 40, splits_rows=True), 10, split_mode="row").n_gpu_layers == 33  # SYCL's


def test_tensor_split_with_flash_attention_off_is_refused() -> None:
    with pytest.raises(ConfigError, match="--split-mode tensor needs flash attention"):
        ServerConfig(split_mode="tensor", flash_attn="off")
    ServerConfig(split_mode="tensor", flash_attn="auto")  # llama.cpp turns it on for the split


def test_tensor_split_without_a_gpu_layer_asks_llama_cpp_for_layers() -> None:
    """llama.cpp's tensor split needs a GPU to build its split device from, and fails the load
    without one; with no layer on a GPU there is nothing to split."""
    from uma_trio.engine.planned import placement_for

    config = ServerConfig(split_mode="tensor")
    cpu_only = placement_for(OffloadPlan(0, 31, "CPU only"), config)
    assert cpu_only.split_mode == "layer"
    assert placement_for(OffloadPlan(31, 31, "all"), config).split_mode == "tensor"
    assert placement_for(OffloadPlan(0, 31, "CPU only"), ServerConfig(split_mode="row")).split_mode == "row"


def test_a_placement_the_gpus_cannot_have_is_refused_naming_the_flag() -> None:
    gpus = two_gpus(40, 40)
    with pytest.raises(ConfigError, match=r"--main-gpu 2: this machine has 2 GPU\(s\): CUDA0, CUDA1"):
        placed(gpus, 10, main_gpu=2)
    with pytest.raises(ConfigError, match=r"--tensor-split 1,1,2: 3 shares for 2 GPU\(s\)"):
        placed(gpus, 10, tensor_split=(1.0, 1.0, 2.0))
    # llama.cpp checks --main-gpu even with no layers to place; a machine with no GPU ignores it
    with pytest.raises(ConfigError, match="--main-gpu 5"):
        plan_offload(
            0, supports_offload=True, devices=gpus, n_layer=32, weight_bytes=1, kv_bytes=1, main_gpu=5
        )
    no_gpu = plan_offload("auto", supports_offload=False, devices=(), n_layer=32, weight_bytes=1, kv_bytes=1,
                          main_gpu=5)  # fmt: skip
    assert no_gpu.n_gpu_layers == 0
    for bad in ("inf,1", "nan,1", "1e999,1"):
        with pytest.raises(ConfigError, match="--tensor-split"):
            parse_tensor_split(bad)


def test_layers_go_to_the_gpus_or_else_the_integrated_ones() -> None:
    def device(name: str, kind: str) -> Device:
        return Device(name, "", kind, "Vulkan", GIB, GIB)

    cpu, igpu, gpu0, gpu1 = (
        device("CPU", "CPU"),
        device("Vulkan2", "IGPU"),
        device("Vulkan0", "GPU"),
        device("Vulkan1", "GPU"),
    )
    assert layer_devices((cpu, igpu, gpu0, gpu1)) == (gpu0, gpu1)  # a discrete GPU leaves the APU out
    assert layer_devices((cpu, igpu)) == (igpu,)
    assert layer_devices((cpu,)) == ()
    assert placed_devices((cpu, igpu, gpu0, gpu1), "none", 1) == (gpu1,)
    assert placed_devices((cpu, igpu, gpu0, gpu1), "row", 1) == (gpu0, gpu1)
    # llama.cpp's tensor split builds its device from every GPU, the integrated one included
    assert layer_devices((cpu, igpu, gpu0, gpu1), "tensor") == (igpu, gpu0, gpu1)
    assert placed_devices((cpu, igpu, gpu0, gpu1), "tensor", 1) == (igpu, gpu0, gpu1)
    assert layer_devices((cpu, igpu, gpu0, gpu1), "none") == (gpu0, gpu1)  # none: placed_devices narrows
    summary = engine_summary(
        system_info="", devices=(cpu, igpu, gpu0, gpu1), layers=(33, 33), reason="", kv_type="f16",
        kv_bytes=1, kv_cells=1, flash_attn="on", settings={"split_mode": "none", "main_gpu": 1}, model={},
    )  # fmt: skip
    assert summary["kv"]["location"] == "Vulkan1"
    assert split_description(summary) is None  # one GPU holds the model


def test_the_summary_says_how_the_model_spreads_over_several_gpus() -> None:
    gpus = (Device("CUDA0", "", "GPU", "CUDA", GIB, GIB), Device("CUDA1", "", "GPU", "CUDA", GIB, GIB))

    def summary(layers: int, **settings: Any) -> dict[str, Any]:
        return engine_summary(
            system_info="", devices=gpus, layers=(layers, 33), reason="", kv_type="f16", kv_bytes=1,
            kv_cells=1, flash_attn="on", settings={"n_ubatch": 512, "n_batch": 2048, "n_seq_max": 1,
            "n_ctx_seq": 1, "deterministic": False, **settings}, model={},
        )  # fmt: skip

    assert split_description(summary(33)) == "layer: whole layers spread over CUDA0, CUDA1, by free memory"
    tensor = summary(33, split_mode="tensor")
    assert split_description(tensor) == "tensor: each layer's matrices and KV cut across CUDA0, CUDA1, evenly"
    assert "split tensor: each layer's" in one_line(tensor)
    assert split_description(summary(33, tensor_split=[1.0, 3.0])).endswith("CUDA0, CUDA1, shares 1,3")
    assert split_description(summary(0, split_mode="tensor")) is None  # nothing on a GPU
    assert split_description(summary(33, split_mode="none", main_gpu=1)) is None


@pytest.mark.model
def test_llama_log_captures_nest_so_a_caller_sees_the_models_load() -> None:
    from uma_trio.engine.devices import LlamaLog
    from uma_trio.engine.llama import LlamaModel
    from uma_trio.model_files import ensure_default_model

    with LlamaLog.capture() as outer:
        model = LlamaModel(ensure_default_model())  # captures its own load's lines inside
    try:
        assert model.layers_total == 31
        assert any("model buffer size" in line for line in outer), "the load's lines reach the outer capture"
        assert LlamaLog._captures == ()  # every capture closed, none left collecting
    finally:
        model.close()


@pytest.mark.model
@pytest.mark.skipif(supports_gpu_offload(), reason="with a GPU, llama.cpp's tensor split loads")
def test_a_cpu_daemon_with_tensor_split_loads_and_llama_cpp_alone_would_not() -> None:
    from uma_trio.engine.llama import LlamaModel, ModelLoadError, read_shape
    from uma_trio.engine.llama_model import Placement
    from uma_trio.engine.planned import offload_plan, placement_for
    from uma_trio.model_files import ensure_default_model

    path = ensure_default_model()
    with pytest.raises(ModelLoadError, match="LLAMA_SPLIT_MODE_TENSOR needs >= 1 devices"):
        LlamaModel(path, Placement(split_mode="tensor"))
    config = ServerConfig(split_mode="tensor", gpu_layers="auto")
    model = LlamaModel(path, placement_for(offload_plan(read_shape(path), config), config))
    try:
        assert model.layers_offloaded == 0 and model.placement.split_mode == "layer"
    finally:
        model.close()


def test_devices_say_whether_their_backend_splits_rows() -> None:
    from uma_trio.engine.devices import backend_offers, backend_registries, devices

    cpu = backend_registries()["CPU"]
    assert backend_offers(cpu, "ggml_backend_set_n_threads")  # the lookup finds what is there
    assert not backend_offers(cpu, "ggml_backend_split_buffer_type")  # and not what is not
    found = devices()
    assert [d for d in found if d.kind == "CPU"] and not any(d.splits_rows for d in found if d.kind == "CPU")


def test_a_failed_load_says_what_llama_cpp_said() -> None:
    from uma_trio.engine.llama_model import load_failure

    said = [
        "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) - 142629 MiB free",
        "llama_model_load_from_file_impl: invalid value for main_gpu: 3 (available devices: 2)",
        "llama_model_load_from_file_impl: failed to load model",
    ]
    assert load_failure(said) == "invalid value for main_gpu: 3 (available devices: 2)"
    assert (
        load_failure(["llama_model_load_from_file_impl: failed to load model"])
        == "corrupt or unsupported GGUF"
    )


def test_a_batch_smaller_than_the_sessions_is_refused_at_start_up() -> None:
    """Every running request decodes a token a tick: llama.cpp aborted the daemon at start-up
    (n_outputs_max) with --n-batch 4 beside the default 8 sessions."""
    with pytest.raises(ConfigError, match=r"--n-batch \(4\) must be at least --max-sessions \(8\)"):
        ServerConfig(n_batch=4, max_sessions=8)
    assert ServerConfig(n_batch=8, max_sessions=8).n_batch == 8
