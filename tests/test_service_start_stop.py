"""`uma-trio serve` under a supervisor (a systemd unit, a container's entrypoint): start-up
refusals before the model loads, and what each stop signal does before and while it serves.
Found by a review that ran the daemon as a service (RELIABILITY.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.protocol.messages import EosEvent, TokenEvent

pytestmark = pytest.mark.model

UMA = [sys.executable, "-m", "uma_trio"]


def serve(
    log: Path, *args: str, env: dict[str, str] | None = None, hang_up_ignored: bool = False
) -> subprocess.Popen[bytes]:
    """``uma-trio serve`` with its log in ``log``, with the default signal actions a
    supervisor gives it (a suite run in the background passes SIGINT on ignored)."""

    def default_signals() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if hang_up_ignored else signal.SIG_DFL)

    with log.open("wb") as out:
        return subprocess.Popen(
            [*UMA, "serve", *args], stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=default_signals
        )


def wait_for(proc: subprocess.Popen[bytes], log: Path, ready: object) -> None:
    deadline = time.monotonic() + 120
    while not (ready() if callable(ready) else str(ready) in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.002)


async def stream_and_signal(
    sock: Path, proc: subprocess.Popen[bytes], signum: signal.Signals
) -> list[object]:
    """A streamed request's events, ``signum`` sent to the daemon after its second token."""
    events: list[object] = []
    with trio.fail_after(60):
        async with UmaClient.connect(sock) as client:
            messages = [{"role": "user", "content": "Count to twenty."}]
            async with client.stream(messages=messages, max_tokens=24, temperature=0.0) as stream:
                async for event in stream:
                    events.append(event)
                    if isinstance(event, TokenEvent) and sum(isinstance(e, TokenEvent) for e in events) == 2:
                        proc.send_signal(signum)
    return events


def test_a_directory_where_no_socket_can_be_made_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """A read-only file system (a container run with --read-only) or /proc passed the
    directory's checks (ours, 0700, no link); the bind then failed after the whole load, with
    a 70-line exception-group traceback and exit 1."""
    for sock in ("/proc/uma-trio-test.sock", "/sys/uma-trio-test.sock"):
        done = subprocess.run([*UMA, "serve", "--socket", sock], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "loading" not in done.stderr and "Traceback" not in done.stderr, done.stderr
        if os.geteuid() == 0:  # another user is refused earlier: the directory is not theirs
            assert f"cannot create the socket {sock}" in done.stderr, done.stderr


def test_a_taken_metrics_port_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """--http's port was bound before the load, --metrics-port's only after it."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [*UMA, "serve", "--socket", str(tmp_path / "d.sock"), "--metrics-port", port],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "loading" not in done.stderr, done.stderr


def test_a_refused_value_from_the_environment_names_its_variable(tmp_path: Path) -> None:
    """`UMA_N_CTX=0` was refused as "must be positive: --n-ctx", a flag the command line never
    had; `UMA_LOG_LEVEL=DEBUG` was refused for its case."""
    env = {**os.environ, "UMA_N_CTX": "0", "UMA_SOCKET": str(tmp_path / "d.sock")}
    done = subprocess.run([*UMA, "serve"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "must be positive: --n-ctx (from the environment: UMA_N_CTX=0)" in done.stderr, done.stderr
    done = subprocess.run(
        [*UMA, "serve", "--n-ctx", "0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and "environment" not in done.stderr, done.stderr  # the flag said it
    env = {**os.environ, "UMA_LOG_LEVEL": "DEBUG"}
    done = subprocess.run([*UMA, "serve", "--model", str(tmp_path / "none.gguf")], capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_the_model_loads_says_so(tmp_path: Path, signum: signal.Signals) -> None:
    """SIGTERM while loading ended the process with no line in its log (Ctrl-C logged one),
    and SIGHUP too; both still end it by the signal, as a supervisor expects."""
    log = tmp_path / "serve.log"
    proc = serve(log, "--socket", str(tmp_path / "d.sock"))
    try:
        wait_for(proc, log, "loading")
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == -signum
    finally:
        proc.kill()
    text = log.read_text()
    assert f"{signum.name} while not serving" in text and "Traceback" not in text, text
    assert not (tmp_path / "d.sock").exists()


def test_sighup_drains_as_sigterm_does_and_is_left_ignored_under_nohup(tmp_path: Path) -> None:
    """SIGHUP (the terminal closed, a supervisor's `kill -HUP`) killed a serving daemon at
    once: every stream cut with no ending, the socket file left behind.  It now drains, as
    SIGTERM; under nohup (SIGHUP ignored at start) it stays ignored.  A signal sent the
    moment the socket appears is the drain's too (it was the default action's before)."""
    sock, log = tmp_path / "d.sock", tmp_path / "serve.log"
    proc = serve(log, "--socket", str(sock), "--shutdown-grace", "120")  # a loaded machine: slow steps
    try:
        wait_for(proc, log, sock.exists)
        events = trio.run(stream_and_signal, sock, proc, signal.SIGHUP)
        assert isinstance(events[-1], EosEvent) and events[-1].reason in ("stop", "length"), log.read_text()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert "SIGHUP: draining" in log.read_text() and not sock.exists()

    proc = serve(log, "--socket", str(sock), hang_up_ignored=True)
    try:
        wait_for(proc, log, sock.exists)
        proc.send_signal(signal.SIGTERM)  # at once: the receiver is there before the socket
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        proc.kill()
    assert not sock.exists()

    proc = serve(log, "--socket", str(sock), hang_up_ignored=True)
    try:
        wait_for(proc, log, sock.exists)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text()  # nohup's choice stands
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
