"""Run a scenario against the whole daemon on a simulated engine.

Real listener, connection tasks, policy and decode loop; only the engine is
:class:`~uma_trio.engine.sim.SimEngine`.  Call it inside a trio run whose clock
is ``trio.testing.MockClock(autojump_threshold=0)``: every wait is then virtual
and a scenario of minutes takes a second or two of real time.  The socket
lives in a fresh temporary directory.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import trio

from ..config import ServerConfig
from ..engine.sim import SimEngine, StepNoise
from ..runtime.server import Server
from ..sched.cost import CostCoefficients
from ..sched.policy import Policy, default_policy
from .runner import ScenarioResult, run_scenario
from .scenario import Scenario

# Every scenario prompt is one word repeated, so with the prefix cache on every prompt after
# the first would be nearly free: simulations measure the scheduler, with the cache off.
SIM_CONFIG = ServerConfig(
    n_ctx=10_240, max_prompt_tokens=8192, max_tokens=4096, max_queue=256, metrics_interval_s=3600.0,
    prefix_cache_cells=0,
)  # fmt: skip


async def simulate(
    scenario: Scenario,
    cost: CostCoefficients,
    config: ServerConfig = SIM_CONFIG,
    policy: Policy | None = None,
    *,
    preemptible: bool = True,
    machine: StepNoise | None = None,
) -> tuple[ScenarioResult, Server]:
    """Run ``scenario`` to its end; return its records and the (stopped) server.
    ``preemptible``: whether the engine can stop a step midway, as llama.cpp's CPU backend
    can (Engine.can_preempt); GPU backends cannot.  ``machine``: the spread of real steps
    around the cost model, the time between them and each request's time outside the engine
    (none by default)."""
    with tempfile.TemporaryDirectory(prefix="uma-sim-") as tmp:
        config = replace(config, socket_path=Path(tmp) / "sim.sock")
        engine = SimEngine(
            cost, n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions, n_batch=config.n_batch
        )
        engine.preemptible_steps = preemptible
        if machine is not None:
            engine.machine = machine
        server = Server(engine, config, policy=policy or default_policy(config, prior=cost))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            delay = machine.request_s if machine is not None else 0.0
            result = await run_scenario(config.socket_path, scenario, request_delay_s=delay)
            server.request_shutdown(force=True)
    return result, server
