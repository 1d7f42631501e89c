"""Wire the real engine to the server; the ``serve`` command's trio entry point."""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import psutil
import trio

from .config import ConfigError, ServerConfig, parse_memory_budget, read_api_keys
from .engine import device_costs
from .engine.base import BatchEntry
from .engine.chat_template import ChatTemplateError, JinjaChatTemplate
from .engine.devices import apply_cuda_graphs
from .engine.llama import (
    KV_TYPES,
    ContextConfig,
    LlamaEngine,
    LlamaModel,
    ModelLoadError,
    read_shape,
)
from .engine.memory_profile import memory_profile, probe_bandwidth_gbps, probe_step_bandwidth_gbps
from .engine.planned import (
    host_memory_bytes,
    host_memory_problem,
    memory_footprint,
    offload_plan,
    placement_for,
)
from .engine.summary import deterministic_caveat, one_line
from .exception_groups import first_leaf
from .http.gateway import Gateway
from .http.metrics import metrics_app
from .http.origin import DEFAULT_CORS_ORIGINS, allowed_hosts
from .http.serve import BindError, bind_tcp, serve_asgi
from .model_store import ModelStore, StoreEntry, StoreError
from .process_setup import freeze_startup_heap, raise_fd_limit
from .runtime.models import LoadedModel, Loading
from .runtime.server import DaemonFailed, Server
from .runtime.unix_socket import SocketInUseError
from .sched.bmt import BmtGuard
from .sched.cost import CostCoefficients, CostModelError
from .sched.policy import Policy, default_policy

log = logging.getLogger(__name__)


class DaemonStartError(Exception):
    """The daemon could not start: bad model, socket taken, ..."""


def context_config(config: ServerConfig, all_layers_on_gpu: bool = False) -> ContextConfig:
    """The llama.cpp context the daemon's settings describe (fast or deterministic mode)."""
    return ContextConfig(
        n_ctx_seq=config.n_ctx,
        n_batch=config.n_batch,
        n_ubatch=config.engine_n_ubatch,
        n_seq_max=config.max_sessions,
        n_threads=config.threads,
        kv_unified=config.engine_kv_unified(all_layers_on_gpu),
        device_greedy=config.gpu_sampling,
        kv_type=config.engine_kv_type,
        flash_attn=config.engine_flash_attn,
    )


def engine_for(model: LlamaModel, config: ServerConfig) -> LlamaEngine:
    """A context over ``model`` sized by the daemon's settings."""
    all_on_gpu = 0 < model.layers_offloaded == model.layers_total
    return LlamaEngine(model, context_config(config, all_on_gpu))


def load_model(model_path: Path, config: ServerConfig) -> LlamaModel:
    template = chat_template_file(config.chat_template)  # refused before the weights load
    shape = read_shape(model_path)
    plan = offload_plan(shape, config)
    log.info("GPU layers: %d of %d (%s)", plan.n_gpu_layers, plan.total, plan.reason)
    if problem := host_memory_problem(shape, config, plan, host_memory_bytes()):
        raise ConfigError(problem)
    apply_cuda_graphs(config.cuda_graphs)  # before the first step of any model
    model = LlamaModel(model_path, placement_for(plan, config))
    if template is not None:
        model.use_chat_template(template)
    log.info("chat template: %s", model.chat_template_in_use(config.chat_template))
    return model


def chat_template_file(path: Path | None) -> str | None:
    """The ``--chat-template`` file's text, checked to compile; :class:`ConfigError` if not."""
    if path is None:
        return None
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it ({exc})") from None
    try:
        JinjaChatTemplate(source)
    except ChatTemplateError as exc:
        raise ConfigError(f"--chat-template {path}: {exc}") from None
    return source


def load_engine(model_path: Path, config: ServerConfig) -> LlamaEngine:
    try:
        engine = engine_for(load_model(model_path, config), config)
    except (ModelLoadError, ConfigError) as exc:
        raise DaemonStartError(str(exc)) from None
    summary = engine.describe(deterministic=config.deterministic)
    log.info("%s", one_line(summary))
    if caveat := deterministic_caveat(summary):
        log.warning("%s", caveat)
    _ = engine.max_token_bytes  # read the vocabulary now, not during the first request
    return engine


def cost_prior(engine: LlamaEngine, config: ServerConfig) -> CostCoefficients:
    """The cost model for this engine: the ``--cost-model`` file if it was measured on this
    device with these settings; on a GPU without one, the one an earlier start calibrated
    for this device (:mod:`~uma_trio.engine.device_costs`), else a calibration now, kept for
    the next start (a CPU prior is 10-40x off there); otherwise the built-in CPU
    coefficients, which the policy keeps correcting online."""
    from .engine.calibrate import calibrate_engine, engine_device_key

    key = engine_device_key(engine)
    on_gpu = engine.model.layers_offloaded > 0
    if config.cost_model is not None:
        try:
            loaded = CostCoefficients.load(config.cost_model)
        except CostModelError as exc:
            raise DaemonStartError(f"--cost-model {exc}") from None
        # A file with no device predates device keys: it was measured on a CPU.
        if loaded.device == key or (not loaded.device and not on_gpu):
            log.info("cost model from %s (%s)", config.cost_model, loaded.source)
            return loaded
        log.warning(
            "cost model %s was measured on %r, not %r: not used", config.cost_model, loaded.device, key
        )
    if not on_gpu:
        return CostCoefficients()
    try:
        # Seconds on a GPU, minutes on a slow device: each configuration is logged as it is timed.
        return device_costs.kept_or_measured(
            key, lambda: calibrate_engine(engine, progress=lambda line: log.info("calibrating: %s", line))
        )
    except ValueError as exc:  # a context too small for any grid (one session, say)
        log.warning("no start-up calibration (%s): built-in costs, corrected online", exc)
        return CostCoefficients()


def policy_for(engine: LlamaEngine, config: ServerConfig) -> Policy:
    """The scheduling policy with the ΣBMT guard sized for this model and device."""
    gbps = config.bmt_budget_gbps
    if gbps is None:
        if engine.model.layers_offloaded > 0:
            gbps = probe_step_bandwidth_gbps(engine)
            log.info("device bandwidth from one-token steps: %.3g GB/s (--bmt-budget-gbps to skip)", gbps)
        else:
            gbps = probe_bandwidth_gbps()
            log.info("memory bandwidth probe: %.1f GB/s (set --bmt-budget-gbps to skip it)", gbps)
    # With the guard off (0 GB/s) it still estimates each tick's bytes for the scorecard.
    kv_bytes = KV_TYPES[engine.config.kv_type][1]
    guard = BmtGuard(memory_profile(engine.model, config.engine_n_ubatch, kv_type_bytes=kv_bytes), gbps)
    return default_policy(config, guard, prior=cost_prior(engine, config))


def server_for(engine: LlamaEngine, config: ServerConfig, policy: Policy) -> Server:
    """The server over ``engine`` (the primary model, which describes its devices and
    settings to the metrics), with the store's other models loaded on demand."""
    try:
        store = ModelStore.scan(engine.model.path, config.models_dir, config.alias)
    except StoreError as exc:
        raise DaemonStartError(str(exc)) from None
    if len(store.entries()) > 1:
        names = [f"{e.id}{' (loaded)' if e.primary else ''}" for e in store.entries()]
        log.info("models: %s", ", ".join(names))
    return Server(
        engine, config, policy, describe=partial(engine.describe, deterministic=config.deterministic),
        store=store, loading=loading_for(engine, config),
    )  # fmt: skip


def loading_for(engine: LlamaEngine, config: ServerConfig) -> Loading:
    """How the store's other models load, and the memory budget they share with --model's:
    ``--memory-budget``, or by default --model's footprint plus 90 % of the memory free now."""
    memory = psutil.virtual_memory()
    primary = memory_footprint(engine.model.shape, config)
    if config.memory_budget is not None:
        budget = parse_memory_budget(config.memory_budget, memory.total)
        if budget < primary:  # it was taken, and every other model then refused as too big
            mib = f"{budget / 2**20:.0f} MiB) is below --model's own footprint ({primary / 2**20:.0f} MiB"
            raise DaemonStartError(f"--memory-budget {config.memory_budget} ({mib}: weights and KV cache)")
    else:
        budget = primary + int(0.9 * memory.available)
    return Loading(
        load=partial(load_other_model, config=config),
        footprint=lambda entry: memory_footprint(read_shape(entry.path), config),
        budget_bytes=budget, primary_bytes=primary,
    )  # fmt: skip


def load_other_model(entry: StoreEntry, config: ServerConfig) -> LoadedModel:
    """A model of the store other than --model, loaded as --model is (runtime/models.py calls
    it in a worker thread when a request names the model), with its own chat template:
    ``--chat-template`` is --model's."""
    # Its vocabulary read here, not on the event loop.
    engine = load_engine(entry.path, replace(config, chat_template=None))

    def close() -> None:
        engine.close()
        engine.model.close()

    try:
        # One step now pages the weights in, so its first tick beside another model's streams
        # is not the slow one (a cold step took twice its prediction on the CPU).
        engine.step_sync([BatchEntry(0, engine.tokenize("Hello"), 0, None)])
        engine.free_seq(0)
        policy = policy_for(engine, config)
    except BaseException:  # the request fails; the weights and context must not stay behind
        close()
        raise

    return LoadedModel(engine, policy, close, partial(engine.describe, deterministic=config.deterministic))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@asynccontextmanager
async def http_gateway(config: ServerConfig, model_file: str) -> AsyncIterator[Gateway | None]:
    """With ``--http``: the port bound and the gateway serving (503 until a server is
    attached) for the duration of the block; without it, None."""
    addresses = [
        (flag, a) for flag, a in (("http", config.http_address), ("ollama", config.ollama_address)) if a
    ]
    if not addresses:
        yield None
        return
    try:
        file_keys = read_api_keys(config.api_key_file) if config.api_key_file is not None else ()
    except ValueError as exc:
        raise DaemonStartError(str(exc)) from None
    if (cert := config.tls_cert) is not None and (key := config.tls_key) is not None:
        try:  # checked here: once serving began, a bad file was a traceback
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise DaemonStartError(f"--tls-cert {cert} / --tls-key {key}: {exc}") from None
    socks = [
        (flag, bind_tcp(h, p, "the HTTP API" if flag == "http" else "the Ollama port"))
        for flag, (h, p) in addresses
    ]
    for _, (h, _p) in addresses:
        if not _is_loopback(h) and config.api_key is None and not file_keys:
            log.warning("the HTTP API on %s is reachable from other hosts and has no --api-key", h)
    own = (socket.gethostname(), socket.getfqdn())  # a wildcard bind answers to the machine's names
    hosts = frozenset().union(*(allowed_hosts(h, config.allowed_hosts, own) for _, (h, _p) in addresses))
    gateway = Gateway(
        model_file, api_key=config.api_key, api_keys=file_keys, max_body_bytes=config.max_frame_bytes,
        max_requests=config.max_connections, hosts=hosts,
        cors_origins=DEFAULT_CORS_ORIGINS if config.cors_origins is None else config.cors_origins,
        body_timeout_s=config.frame_timeout_s,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        tls = (
            (config.tls_cert, config.tls_key)
            if config.tls_cert is not None and config.tls_key is not None
            else None
        )
        urls = []
        for flag, sock in socks:
            serve = partial(
                serve_asgi,
                gateway.app,
                sock,
                name=flag,
                tls=tls,
                max_connections=config.http_max_connections,
                on_connection=gateway.watch_connection,
                write_timeout_s=config.stall_timeout_s,
            )
            urls.append(await nursery.start(serve))
            log.info("HTTP API (OpenAI, Ollama, Anthropic) on %s (--%s)", urls[-1], flag)
        gateway.url = urls[0]
        gateway.urls = urls
        yield gateway
        nursery.cancel_scope.cancel()


def bind_metrics(config: ServerConfig) -> socket.socket | None:
    """``--metrics-port``'s socket, bound before the model loads (as the HTTP ports are), so a
    taken port is a start-up error in a second, not after the load; it answers once serving."""
    address = config.metrics_address
    return bind_tcp(*address, "metrics") if address is not None else None


async def _serve(
    server: Server, gateway: Gateway | None, *, handle_signals: bool,
    metrics_sock: socket.socket | None = None,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Run ``server``; the gateway serves it once its socket accepts, and ``--metrics-port``
    (``metrics_sock``, bound here unless the caller bound it first) until it stops."""
    address = server.config.metrics_address
    if metrics_sock is None:
        metrics_sock = bind_metrics(server.config)
    async with trio.open_nursery() as nursery:

        async def run_server(task_status: trio.TaskStatus[Server]) -> None:
            await server.serve(handle_signals=handle_signals, task_status=task_status)
            nursery.cancel_scope.cancel()  # the metrics port goes with the server

        try:
            await nursery.start(run_server)
        except BaseException:
            if metrics_sock is not None:
                metrics_sock.close()
            raise
        if metrics_sock is not None and address is not None:
            # The gateway's Host check: a DNS-rebinding page could read the port otherwise.
            own = (socket.gethostname(), socket.getfqdn())
            hosts = allowed_hosts(address[0], server.config.allowed_hosts, own)
            base = await nursery.start(partial(
                serve_asgi, metrics_app(server.registry, hosts), metrics_sock, name="metrics_http",
                max_connections=server.config.max_connections,
            ))  # fmt: skip
            server.metrics_url = f"{base}/metrics"
            log.info("Prometheus metrics on %s", server.metrics_url)
        if gateway is not None:
            server.http_url = gateway.url
            server.http_urls = gateway.urls
            gateway.attach(server)
        task_status.started(server)


@asynccontextmanager
async def serving(model: LlamaModel, config: ServerConfig) -> AsyncIterator[Server]:
    """A daemon on ``model`` inside the caller's trio run (tests, benchmarks), with the
    policy and (with ``config.http``) the gateway ``uma-trio serve`` builds; stopped and its
    context freed on exit."""
    engine = engine_for(model, config)
    try:
        async with http_gateway(config, model.path.name) as gateway, trio.open_nursery() as nursery:
            server = server_for(engine, config, policy_for(engine, config))
            await nursery.start(partial(_serve, server, gateway, handle_signals=False))
            yield server
            server.request_shutdown(force=True)
    finally:
        engine.close()


async def run_daemon(model_path: Path, config: ServerConfig) -> None:
    log.debug("open-file limit %d", raise_fd_limit())
    engine: LlamaEngine | None = None
    try:
        try:
            async with http_gateway(config, model_path.name) as gateway:
                with ExitStack() as closing:
                    if (metrics_sock := bind_metrics(config)) is not None:
                        closing.callback(metrics_sock.close)  # a no-op once serving has closed it
                    # The HTTP port answers /health with 503 "loading" meanwhile.
                    log.info("loading %s", model_path)
                    engine = await trio.to_thread.run_sync(load_engine, model_path, config)
                    policy = await trio.to_thread.run_sync(policy_for, engine, config)
                    freeze_startup_heap()
                    server = server_for(engine, config, policy)
                    await _serve(server, gateway, handle_signals=True, metrics_sock=metrics_sock)
        finally:
            # Only once the gateway has stopped: its handlers may still be tokenizing in
            # worker threads, which leaving its nursery waits for.
            if engine is not None:
                engine.close()
                engine.model.close()
    except* (SocketInUseError, BindError, DaemonStartError, DaemonFailed) as group:
        raise DaemonStartError(str(first_leaf(group))) from None
    except* KeyboardInterrupt:  # Ctrl-C as the server started: one interrupt, not a group's traceback
        raise KeyboardInterrupt from None
