"""Wire the real engine to the server; the ``serve`` command's trio entry point."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from .config import ServerConfig
from .engine.llama import ContextConfig, LlamaEngine, LlamaModel, ModelLoadError
from .engine.memory_profile import memory_profile, probe_bandwidth_gbps
from .runtime.metrics_http import MetricsPortError
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
    guard = BmtGuard(memory_profile(engine.model, engine.config.n_ubatch), gbps)
    return default_policy(config, guard)


@asynccontextmanager
async def serving(model: LlamaModel, config: ServerConfig) -> AsyncIterator[Server]:
    """A daemon on ``model`` inside the caller's trio run (tests, benchmarks), with the
    policy ``uma-trio serve`` builds; stopped and its context freed on exit."""
    engine = engine_for(model, config)
    try:
        async with trio.open_nursery() as nursery:
            server: Server = await nursery.start(Server(engine, config, policy_for(engine, config)).serve)
            yield server
            server.request_shutdown(force=True)
    finally:
        engine.close()


async def run_daemon(model_path: Path, config: ServerConfig) -> None:
    log.info("loading %s", model_path)
    engine = load_engine(model_path, config)
    try:
        await Server(engine, config, policy_for(engine, config)).serve(handle_signals=True)
    except (SocketInUseError, MetricsPortError) as exc:
        raise DaemonStartError(str(exc)) from None
    finally:
        engine.close()
        engine.model.close()
