"""Wire the real engine to the server; the ``serve`` command's trio entry point."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from .config import ServerConfig
from .engine.llama import KV_TYPES, ContextConfig, LlamaEngine, LlamaModel, ModelLoadError
from .engine.memory_profile import memory_profile, probe_bandwidth_gbps
from .exception_groups import first_leaf
from .http.gateway import Gateway
from .http.serve import BindError, bind_tcp, serve_asgi
from .runtime.server import Server
from .runtime.unix_socket import SocketInUseError
from .sched.policy import BmtGuard, Policy, default_policy

log = logging.getLogger(__name__)


class DaemonStartError(Exception):
    """The daemon could not start: bad model, socket taken, ..."""


def engine_for(model: LlamaModel, config: ServerConfig) -> LlamaEngine:
    """A context over ``model`` sized by the daemon's settings."""
    context = ContextConfig(
        n_ctx_seq=config.n_ctx,
        n_batch=config.n_batch,
        n_ubatch=config.n_ubatch,
        n_seq_max=config.max_sessions,
        n_threads=config.threads,
        kv_unified=config.kv_unified,
        kv_type=config.kv_type,
    )
    return LlamaEngine(model, context)


def load_engine(model_path: Path, config: ServerConfig) -> LlamaEngine:
    try:
        return engine_for(LlamaModel(model_path), config)
    except ModelLoadError as exc:
        raise DaemonStartError(str(exc)) from None


def policy_for(engine: LlamaEngine, config: ServerConfig) -> Policy:
    """The scheduling policy with the ΣBMT guard sized for this model and machine."""
    gbps = config.bmt_budget_gbps
    if gbps is None:
        gbps = probe_bandwidth_gbps()
        log.info("memory bandwidth probe: %.1f GB/s (set --bmt-budget-gbps to skip it)", gbps)
    # With the guard off (0 GB/s) it still estimates each tick's bytes for the scorecard.
    kv_bytes = KV_TYPES[config.kv_type][1]
    guard = BmtGuard(memory_profile(engine.model, engine.config.n_ubatch, kv_type_bytes=kv_bytes), gbps)
    return default_policy(config, guard)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@asynccontextmanager
async def http_gateway(config: ServerConfig, model_file: str) -> AsyncIterator[Gateway | None]:
    """With ``--http``: the port bound and the gateway serving (503 until a server is
    attached) for the duration of the block; without it, None."""
    address = config.http_address
    if address is None:
        yield None
        return
    host, port = address
    sock = bind_tcp(host, port, "the HTTP API")
    if not _is_loopback(host) and config.api_key is None:
        log.warning("the HTTP API on %s is reachable from other hosts and has no --api-key", host)
    gateway = Gateway(
        model_file, api_key=config.api_key, max_body_bytes=config.max_frame_bytes,
        max_requests=config.max_connections,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        gateway.url = await nursery.start(partial(serve_asgi, gateway.app, sock, name="http"))
        log.info("OpenAI-compatible API on %s/v1", gateway.url)
        yield gateway
        nursery.cancel_scope.cancel()


async def _serve(
    server: Server, gateway: Gateway | None, *, handle_signals: bool,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Run ``server``; the gateway serves it once its socket accepts."""
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(server.serve, handle_signals=handle_signals))
        if gateway is not None:
            server.http_url = gateway.url
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
            server = Server(engine, config, policy_for(engine, config))
            await nursery.start(partial(_serve, server, gateway, handle_signals=False))
            yield server
            server.request_shutdown(force=True)
    finally:
        engine.close()


async def run_daemon(model_path: Path, config: ServerConfig) -> None:
    engine: LlamaEngine | None = None
    try:
        try:
            async with http_gateway(config, model_path.name) as gateway:
                # The HTTP port answers /health with 503 "loading" meanwhile.
                log.info("loading %s", model_path)
                engine = await trio.to_thread.run_sync(load_engine, model_path, config)
                policy = await trio.to_thread.run_sync(policy_for, engine, config)
                await _serve(Server(engine, config, policy), gateway, handle_signals=True)
        finally:
            # Only once the gateway has stopped: its handlers may still be tokenizing in
            # worker threads, which leaving its nursery waits for.
            if engine is not None:
                engine.close()
                engine.model.close()
    except* (SocketInUseError, BindError, DaemonStartError) as group:
        raise DaemonStartError(str(first_leaf(group))) from None
