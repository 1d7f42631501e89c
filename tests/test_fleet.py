"""Two daemons behind LiteLLM's proxy (issue 23): docs/fleet/litellm-config.yaml as shipped,
on loopback.  Forty mixed requests through the proxy are all answered, both daemons serve
some (their own metrics say so), and one daemon stopped in the middle loses nothing: what it
accepted it finishes (it drains), and what it refuses or never gets goes to the other."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.model, pytest.mark.fleet]

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "docs" / "fleet" / "litellm-config.yaml"
MASTER_KEY = "sk-fleet-test-0123456789abcdef"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(url: str, process: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer in {timeout:g} s")


def served(base: str) -> float:
    """Requests a daemon has finished, from its own Prometheus text."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["uma_requests"].samples if s.name == "uma_requests_total")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    litellm = shutil.which("litellm")
    if litellm is None:
        pytest.skip("LiteLLM's proxy is not installed (pip install 'uma-trio[fleet]')")
    ports = [free_port() for _ in range(3)]
    daemons = []
    logs = []
    try:
        for i, port in enumerate(ports[:2]):
            log = (tmp_path / f"daemon-{i}.log").open("wb")
            logs.append(log)
            command = [
                sys.executable, "-m", "uma_trio", "serve", "--socket", str(tmp_path / f"d{i}.sock"),
                "--http", f"127.0.0.1:{port}", "--threads", "1", "--max-sessions", "4", "--n-ctx", "1024",
                "--shutdown-grace", "30",
            ]  # fmt: skip
            daemons.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        for port, daemon in zip(ports, daemons, strict=False):
            wait_for(f"http://127.0.0.1:{port}/health", daemon)
        env = {
            **os.environ, "UMA_A_URL": f"http://127.0.0.1:{ports[0]}/v1", "UMA_B_URL": f"http://127.0.0.1:{ports[1]}/v1",
            "UMA_API_KEY": "none", "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }  # fmt: skip
        log = (tmp_path / "proxy.log").open("wb")
        logs.append(log)
        proxy = subprocess.Popen(
            [litellm, "--config", str(CONFIG), "--port", str(ports[2])],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        daemons.append(proxy)
        wait_for(f"http://127.0.0.1:{ports[2]}/health/liveliness", proxy)
        yield {
            "daemons": daemons[:2],
            "bases": [f"http://127.0.0.1:{p}" for p in ports[:2]],
            "proxy": ports[2],
        }
    finally:
        for process in daemons:
            if process.poll() is None:
                process.terminate()
        for process in daemons:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()


async def test_forty_requests_through_litellm_survive_a_daemon_stopping(fleet: dict[str, Any]) -> None:
    api = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{fleet['proxy']}/v1", api_key=MASTER_KEY, max_retries=0
    )
    answers: dict[int, str] = {}
    limiter = trio.CapacityLimiter(6)
    counts_before_stop: list[float] = []

    async def ask(i: int) -> None:
        async with limiter:
            messages: Any = [{"role": "user", "content": f"Say something about the number {i}."}]
            if i % 3 == 0:  # streamed: the text of every chunk, each exactly once
                stream = await api.chat.completions.create(
                    model="smol", messages=messages, max_tokens=12, temperature=0, stream=True
                )
                parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
                answers[i] = "".join(parts)
            else:
                done = await api.chat.completions.create(
                    model="smol", messages=messages, max_tokens=12, temperature=0
                )
                answers[i] = done.choices[0].message.content or ""

    answers_after_stop: list[int] = []

    async def stop_one() -> None:
        while len(answers) < 15:  # in the middle of the run
            await trio.sleep(0.05)
        for base in fleet["bases"]:
            counts_before_stop.append(await trio.to_thread.run_sync(served, base))
        fleet["daemons"][0].send_signal(signal.SIGTERM)  # drains: finishes what it accepted
        answers_after_stop.extend(i for i in range(40) if i not in answers)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_one)
        for i in range(40):
            nursery.start_soon(ask, i)
    assert sorted(answers) == list(range(40)) and all(answers.values())
    assert len(answers_after_stop) >= 20  # the stop came with the run half done
    assert counts_before_stop[0] > 0, "daemon A served nothing before it stopped"
    assert await trio.to_thread.run_sync(served, fleet["bases"][1]) > 0
    assert fleet["daemons"][0].wait(30) == 0  # it drained and stopped cleanly


async def test_requests_cut_by_a_killed_daemon_are_retried_on_the_other(fleet: dict[str, Any]) -> None:
    """A daemon killed outright (no drain): LiteLLM retries the whole requests it had in
    flight on the other daemon, so every client still gets one answer."""
    proxy = f"http://127.0.0.1:{fleet['proxy']}/v1"
    api = openai.AsyncOpenAI(base_url=proxy, api_key=MASTER_KEY, max_retries=0)
    answers: dict[int, str] = {}
    limiter = trio.CapacityLimiter(6)

    async def ask(i: int) -> None:
        async with limiter:
            messages: Any = [{"role": "user", "content": f"Count to {i}."}]
            done = await api.chat.completions.create(
                model="smol", messages=messages, max_tokens=24, temperature=0
            )
            answers[i] = done.choices[0].message.content or ""

    async def kill_one() -> None:
        while len(answers) < 8:
            await trio.sleep(0.05)
        fleet["daemons"][0].kill()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill_one)
        for i in range(24):
            nursery.start_soon(ask, i)
    assert sorted(answers) == list(range(24)) and all(answers.values())
    assert fleet["daemons"][0].wait(10) != 0  # it was killed, not drained
