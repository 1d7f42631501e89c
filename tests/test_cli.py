"""The command line, as a user runs it: real processes, real signals."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import EosEvent, TokenEvent
from uma_trio.runtime.server import Server

from .helpers import sim_daemon, slow_grammar

pytestmark = pytest.mark.model

UMA = [sys.executable, "-m", "uma_trio"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UMA, *args], capture_output=True, text=True, timeout=timeout)


def test_missing_model_is_a_clear_error() -> None:
    done = run_cli("serve", "--model", "/nonexistent/model.gguf", "--socket", "/tmp/uma-never.sock")
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_an_infinite_quantity_is_refused_at_start(tmp_path: Path) -> None:
    """Operator's-view review: `--metrics-window inf` was taken, then `top` and `metrics`
    failed with a traceback for the daemon's whole life (the window is JSON's null)."""
    done = run_cli(
        "serve", "--metrics-window", "inf", "--tick-ms", "inf", "--socket", str(tmp_path / "s.sock")
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "must be finite: --tick-ms, --metrics-window" in done.stderr, done.stderr
    assert ServerConfig(idle_timeout_s=float("inf"), stall_timeout_s=float("inf")).idle_timeout_s > 0  # never


def test_corrupt_model_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    done = run_cli("serve", "--model", str(bad), "--socket", str(tmp_path / "s.sock"))
    assert done.returncode == 2
    assert "could not load" in done.stderr and "Traceback" not in done.stderr


def test_generate_without_daemon_exits_3(tmp_path: Path) -> None:
    done = run_cli("generate", "--prompt", "hi", "--socket", str(tmp_path / "none.sock"))
    assert done.returncode == 3 and "cannot talk to the daemon" in done.stderr


async def test_generate_streams_an_answer(server: Server) -> None:
    done = await trio.run_process(
        [*UMA, "generate", "--prompt", "What is the capital of France?", "--temp", "0",
         "--system", "You are a helpful assistant.",
         "--max-tokens", "24", "--socket", str(server.config.socket_path)],
        capture_stdout=True, capture_stderr=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout.decode()


async def test_generate_into_a_full_disk_says_so_and_does_not_blame_the_daemon(server: Server) -> None:
    """`generate > /dev/full` said "cannot talk to the daemon: [Errno 28] No space left"."""
    sock = str(server.config.socket_path)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        done = await trio.run_process(
            [*UMA, "generate", "--prompt", "Hi", "--max-tokens", "4", "--socket", sock],
            stdout=full, capture_stderr=True, check=False,
        )  # fmt: skip
    finally:
        os.close(full)
    err = done.stderr.decode()
    assert done.returncode == 1 and "cannot write the answer to stdout: No space left" in err, err
    assert "daemon" not in err and "Traceback" not in err and "Exception ignored" not in err, err


async def start_daemon(nursery: trio.Nursery, sock: Path, *, grace_s: int) -> trio.Process:
    """``uma-trio serve`` as a process on ``sock``, once its socket is there."""
    env = {**os.environ, "UMA_SOCKET": str(sock), "UMA_SHUTDOWN_GRACE": str(grace_s)}
    proc: trio.Process = await nursery.start(
        lambda task_status: trio.run_process(
            [*UMA, "serve"], env=env, check=False, stderr=subprocess.PIPE, task_status=task_status
        )
    )
    with trio.fail_after(60):
        while not await trio.Path(sock).exists():
            await trio.sleep(0.05)
    return proc


async def test_sigterm_drains_running_requests_and_removes_the_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        sock = Path(tmp) / "d.sock"
        async with trio.open_nursery() as nursery:
            proc = await start_daemon(nursery, sock, grace_s=30)
            with trio.fail_after(60):
                async with UmaClient.connect(sock) as client:
                    async with client.stream(messages=[{"role": "user", "content": "Count to twenty."}],
                                             max_tokens=48, temperature=0.0) as events:  # fmt: skip
                        tokens = 0
                        async for event in events:
                            if isinstance(event, TokenEvent):
                                tokens += 1
                                if tokens == 2:
                                    proc.send_signal(signal.SIGTERM)
                    # Draining: the request in flight finished normally, after the signal.
                    assert isinstance(event, EosEvent) and event.reason in ("stop", "length")
                    assert not sock.exists()  # stopped accepting: the socket is gone at once
                await proc.wait()
        assert proc.returncode == 0
        assert not sock.exists()


async def test_sigterm_does_not_wait_for_a_grammar_being_compiled() -> None:
    """A 4,090-rule grammar compiles for tens of seconds on 2 cores; the daemon exited only
    when it was done (27 s after SIGTERM, even after a second signal)."""
    grammar = slow_grammar()
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        sock = Path(tmp) / "d.sock"
        async with trio.open_nursery() as nursery:
            proc = await start_daemon(nursery, sock, grace_s=1)
            async with UmaClient.connect(sock) as client:

                async def compile_it() -> None:
                    with contextlib.suppress(Exception):  # refused or cut off by the shutdown
                        await client.complete(prompt="x", max_tokens=1, grammar=grammar)

                nursery.start_soon(compile_it)
                await trio.sleep(1.5)  # the compile is under way
                signalled = trio.current_time()
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(8):  # the 1 s grace, and room (the compile alone: 10-25 s)
                    await proc.wait()
        assert trio.current_time() - signalled < 8
        assert proc.returncode == 0


async def test_metrics_and_top_show_the_daemon(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        await client.complete(prompt="Hello", max_tokens=8, temperature=0.0)
    sock = str(server.config.socket_path)

    async def cli(*args: str) -> str:
        done = await trio.run_process(
            [*UMA, *args, "--socket", sock], capture_stdout=True, capture_stderr=True, check=False,
            env={**os.environ, "COLUMNS": "150"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return str(done.stdout.decode())

    snapshot = json.loads(await cli("metrics", "--json"))
    assert sum(snapshot["requests"]["interactive"].values()) == 1
    assert snapshot["scorecard"]["latency_cap"] == server.config.latency_cap
    tables = await cli("metrics")
    assert "scorecard" in tables and "counters (whole run)" in tables and "token gap" in tables
    screen = await cli("top", "--once")
    assert "requests in flight" in screen and snapshot["model"] in screen


def test_metrics_without_daemon_exits_3(tmp_path: Path) -> None:
    for command in ("metrics", "top"):
        done = run_cli(command, "--socket", str(tmp_path / "none.sock"))
        assert done.returncode == 3 and "cannot talk to the daemon" in done.stderr


def test_bad_client_options_are_one_line_usage_errors(tmp_path: Path) -> None:
    """`top --interval nan` and `snapshot save --file` of a file that is not UTF-8 were
    tracebacks; bad options exit 1 (CONFIG.md), before the daemon is asked."""
    not_utf8 = tmp_path / "prompt.txt"
    not_utf8.write_bytes(b"\xff\xfe not utf-8")
    sock = str(tmp_path / "none.sock")
    for args in (
        ["top", "--interval", "nan"],
        ["top", "--interval", "0"],
        ["snapshot", "save", "s1", "--file", str(not_utf8)],
        ["snapshot", "save", "s1"],
    ):
        done = run_cli(*args, "--socket", sock)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_bad_generate_and_snapshot_values_exit_1_naming_the_flag(tmp_path: Path) -> None:
    """`generate --max-tokens 0` was the daemon's refusal (exit 2) naming `$.max_tokens`;
    --tool-choice without --tools was ignored; a bad snapshot name came back as a regex."""
    sock = str(tmp_path / "none.sock")  # no daemon: each is refused before it is asked
    for args, words in [
        (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens: Expected `int` >= 1"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: Expected `float` > 0.0"),
        (["generate", "--prompt", "x", "--temp", "-1"], "--temp: Expected `float` >= 0.0"),
        (["generate", "--prompt", "x", "--tool-choice", "none"], "--tool-choice needs --tools"),
        (["snapshot", "restore", "a b"], "snapshot name: Expected `str` of 1-64 letters, digits"),
        (["load", "m", "--keep-alive", "nan"], "--keep-alive must be a number of seconds"),  # was ignored
    ]:  # fmt: skip
        done = run_cli(*args, "--socket", sock)
        assert done.returncode == 1 and words in done.stderr, (args, done.stderr)
        assert "$." not in done.stderr and "regex" not in done.stderr


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "No such file"),
        (b"{not json", "is not a cost model"),
        (b'{"decode_s": "fast"}', "is not a cost model"),
    ],
    ids=["missing", "not-json", "wrong-type"],
)
def test_a_bad_cost_model_file_is_refused_before_the_model_loads(
    tmp_path: Path, content: bytes | None, words: str
) -> None:
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_bytes(content)
    done = run_cli("serve", "--cost-model", str(path), "--socket", str(tmp_path / "s" / "x.sock"))
    assert done.returncode == 2, done.stderr
    assert f"--cost-model {path}" in done.stderr and words in done.stderr
    assert "Traceback" not in done.stderr and "loading" not in done.stderr.lower()


def test_output_paths_and_bounds_are_refused_before_the_model_loads(tmp_path: Path) -> None:
    """`--tick-trace /nonexistent/x.jsonl` was a traceback once the model had loaded; a
    --scorecard-csv in a missing directory and a --snapshot-dir that is a file were taken;
    --max-frame-bytes 3 (no request fits) and past the 4-byte prefix were taken; and
    --shutdown-grace -1 named three flags."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    missing = tmp_path / "none" / "x.jsonl"
    for args, words in [
        (["--tick-trace", str(missing)], f"--tick-trace {missing} is in {missing.parent}"),
        (["--tick-trace", str(tmp_path)], f"--tick-trace {tmp_path} is a directory"),
        (["--scorecard-csv", str(missing)], f"--scorecard-csv {missing} is in"),
        (["--snapshot-dir", str(a_file)], f"--snapshot-dir {a_file} is not a directory"),
        (["--max-frame-bytes", "3"], "--max-frame-bytes must be 1024 to 4294967295"),
        (["--max-frame-bytes", str(2**32)], "--max-frame-bytes must be 1024 to 4294967295"),
        (["--shutdown-grace", "-1"], "must not be negative: --shutdown-grace"),
    ]:  # fmt: skip
        done = run_cli("serve", *args, "--socket", str(tmp_path / "s" / "x.sock"))
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and "loading" not in done.stderr.lower(), done.stderr
    assert "--keep-alive" not in run_cli("serve", "--shutdown-grace", "-1").stderr


def test_a_fractional_count_is_refused_not_rounded(tmp_path: Path) -> None:
    """cyclopts reads an int flag through float and rounds: `--max-tokens 1.5` served with a
    limit of 2, `generate --max-tokens 2.5` asked for 2.  Every integer flag and UMA_* variable
    takes a whole number only; a whole one still parses."""
    sock = str(tmp_path / "s" / "x.sock")
    for args, flag in [
        (["info", "--max-tokens", "1.5"], "--max-tokens"),
        (["info", "--threads", "2.0"], "--threads"),
        (["info", "--metrics-port", "9.5"], "--metrics-port"),
        (["generate", "--prompt", "hi", "--max-tokens", "2.5", "--socket", sock], "--max-tokens"),
        (["generate", "--prompt", "hi", "--seed", "3.5", "--socket", sock], "--seed"),
        (["calibrate", "--threads", "1.5"], "--threads"),
    ]:  # fmt: skip
        done = run_cli(*args)
        assert done.returncode != 0, (args, done.stdout)
        assert flag in done.stderr and "a whole number is needed" in done.stderr, (args, done.stderr)
    env_done = subprocess.run(
        [*UMA, "info"], capture_output=True, text=True, timeout=60, env={**os.environ, "UMA_MAX_QUEUE": "3.3"}
    )
    assert env_done.returncode == 2 and "UMA_MAX_QUEUE" in env_done.stderr, env_done.stderr
    whole = run_cli("info", "--max-tokens", "7", "--max-queue", "5")
    assert whole.returncode == 0, whole.stderr


def test_a_damaged_calibration_file_is_passed_over_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from uma_trio.cli.serve import _calibrated_cost_model
    from uma_trio.sched.cost import CostCoefficients

    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path))
    log = logging.getLogger("uma_trio.test")
    assert _calibrated_cost_model(log) is None  # none written yet
    (tmp_path / "cost-model.json").write_bytes(b"\x00\x01 half a file")
    with caplog.at_level(logging.WARNING):
        assert _calibrated_cost_model(log) is None
    assert "not used" in caplog.text and "uma-trio calibrate" in caplog.text
    CostCoefficients(source="test").save(tmp_path / "cost-model.json")
    assert _calibrated_cost_model(log) == tmp_path / "cost-model.json"


def test_a_flag_the_parser_refuses_exits_1_not_the_daemons_2(tmp_path: Path) -> None:
    """cyclopts exits 2 for a flag it cannot parse: the code generate documents for an error
    the daemon reported, so a script could not tell a typo from a refusal."""
    sock = str(tmp_path / "none.sock")
    for args in (
        ["generate", "--prompt", "x", "--bogus"],
        ["generate", "--prompt", "x", "--max-tokens", "abc"],
        ["generate"],
        ["metrics", "--bogus"],
        ["top", "--interval", "abc"],
    ):
        done = run_cli(*args, "--socket", sock)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (args, done.stderr)
    # A prompt may start with a hyphen ("-5 + 3 ="): taken as text, then no daemon there.
    for args in (
        ["generate", "--prompt", "-5 + 3 =", "--system", "-"],
        ["snapshot", "save", "s", "--prompt", "-x"],
    ):
        done = run_cli(*args, "--socket", sock)
        assert done.returncode == 3 and "cannot talk to the daemon" in done.stderr, (args, done.stderr)


def test_serves_environment_variables_stay_with_serve(tmp_path: Path) -> None:
    """Read app-wide, UMA_SYSTEM (a serve string) was parsed as `snapshot save`'s bool flag and
    UMA_PROMPT filled its --prompt; the clients still read UMA_SOCKET."""
    sock = tmp_path / "none.sock"
    env = {**os.environ, "UMA_SYSTEM": "You are terse.", "UMA_PROMPT": "hello", "UMA_SOCKET": str(sock)}
    for args in (
        ["snapshot", "save", "n1", "--prompt", "hi"],
        ["snapshot", "save", "n2", "--file", "/dev/null"],
    ):
        done = subprocess.run([*UMA, *args], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 3, (args, done.stderr)  # parsed, then no daemon at UMA_SOCKET
        assert f"cannot talk to the daemon at {sock}" in done.stderr


def test_serve_and_the_clients_read_the_socket_variables_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """With UMA_SOCK and UMA_SOCKET both set, serve took UMA_SOCK and the clients UMA_SOCKET;
    an empty UMA_SOCKET was the path `.`."""
    from uma_trio.cli import app

    monkeypatch.setenv("UMA_SOCK", "/tmp/seeds.sock")
    monkeypatch.setenv("UMA_SOCKET", "/tmp/ours.sock")
    for command in (["serve"], ["metrics"]):
        bound = app.parse_args(command)[1]
        value = bound.kwargs["config"].socket_path if command == ["serve"] else bound.kwargs["socket"]
        assert value == Path("/tmp/ours.sock"), command
    for args in (["metrics"], ["serve"], ["metrics", "--socket", ""]):
        done = subprocess.run([*UMA, *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "UMA_SOCKET": ""})  # fmt: skip
        assert done.returncode == (2 if args == ["serve"] else 1), (args, done.stderr)
        assert "a socket path must not be empty" in done.stderr and "Traceback" not in done.stderr


async def test_generate_with_serves_max_tokens_in_the_environment(server: Server) -> None:
    """UMA_MAX_TOKENS is serve's cap; generate took it as its own request size and was refused
    (E_LIMIT_003) whenever it was over the daemon's --max-tokens."""
    env = {**os.environ, "UMA_MAX_TOKENS": str(server.config.max_tokens * 2)}
    done = await trio.run_process(
        [*UMA, "generate", "--prompt", "Say hi.", "--temp", "0", "--socket", str(server.config.socket_path)],
        capture_stdout=True, capture_stderr=True, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


async def test_generate_exits_2_when_the_daemon_cancels_the_request(
    llama_model: LlamaModel, server_config: ServerConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request the daemon cancels (its shutdown's grace over, a stall) ended with exit 0 and
    the text cut short, as if it had succeeded."""
    from uma_trio.cli.client_commands import _generate

    from .conftest import running_server

    async with running_server(llama_model, server_config, shutdown_grace_s=0.0) as daemon:
        count = "Count from 1 to 500, separated by commas."
        request = {"messages": [{"role": "user", "content": count}], "max_tokens": 400, "temperature": 0.0}

        async def stop_soon() -> None:
            await trio.sleep(0.5)
            daemon.request_shutdown()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_soon)
            code = await _generate(daemon.config.socket_path, request)
    assert code == 2
    assert "the daemon cancelled the request (shutdown)" in capsys.readouterr().err


async def test_a_refusal_before_any_text_is_one_line(
    autojump_clock: trio.abc.Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Docs review: a refused `generate` printed an empty line before its error (the newline
    that ends an answer cut short, with no answer)."""
    from uma_trio.cli.client_commands import _generate

    async with sim_daemon(max_tokens=20) as daemon:
        code = await _generate(daemon.config.socket_path, {"prompt": "hi", "max_tokens": 21})
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith("error E_LIMIT_003: "), captured.err


async def test_serve_refuses_a_live_socket_and_a_bad_store_before_loading(
    server: Server, tmp_path: Path
) -> None:
    """A second daemon on a live socket loaded the model (on a GPU its KV cache too) before
    saying another one was running; a bad --models-dir was found after the load as well."""
    live = str(server.config.socket_path)
    for args in (
        ["--socket", live],
        ["--socket", str(tmp_path / "s.sock"), "--models-dir", str(tmp_path / "none")],
    ):
        done = await trio.run_process(
            [*UMA, "serve", *args], capture_stdout=True, capture_stderr=True, check=False
        )  # fmt: skip
        err = done.stderr.decode()
        assert done.returncode == 2, err
        assert "already listening" in err or "not a directory" in err, err
        assert "loading" not in err, err  # refused before the model was read


def test_calibrate_refuses_an_unwritable_out_before_measuring(tmp_path: Path) -> None:
    """`--out` was first tried after the whole measurement (a minute here, longer on a GPU)."""
    for out in (tmp_path, Path("/proc/uma-trio/cost.json")):
        done = run_cli("calibrate", "--out", str(out), "--repeats", "1", timeout=30)
        assert done.returncode == 2 and f"cannot write {out}" in done.stderr, done.stderr
        assert "prefilling" not in done.stderr  # nothing measured


async def test_top_into_a_pipe_prints_a_frame_each_interval(server: Server) -> None:
    """Drawn on the alternate screen, `top | tee` (or top into a file) wrote nothing at all."""
    sock = str(server.config.socket_path)
    proc = await trio.lowlevel.open_process(
        [*UMA, "top", "--interval", "0.3", "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    out = b""
    with trio.fail_after(30):  # on a loaded machine (the whole suite) its start takes seconds
        while out.count(b"requests in flight") < 2:  # two frames, then Ctrl-C
            chunk = await proc.stdout.receive_some()
            assert chunk, out  # top ended before its second frame
            out += chunk
        proc.send_signal(signal.SIGINT)
        while chunk := await proc.stdout.receive_some():
            out += chunk
        await proc.wait()
    assert proc.returncode == 0
    assert out.decode().count("requests in flight") >= 2


async def test_top_into_a_pipe_whose_reader_leaves_exits_141(server: Server) -> None:
    """`top | head`: rich took the closed pipe for an error and exited 1, a bad option's code."""
    proc = await trio.lowlevel.open_process(
        [*UMA, "top", "--interval", "0.2", "--socket", str(server.config.socket_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    with trio.fail_after(30):
        assert await proc.stdout.receive_some()  # the first frame
        await proc.stdout.aclose()  # the reader leaves
        await proc.wait()
    assert proc.returncode == 141


async def test_a_listing_into_a_pipe_whose_reader_left_exits_141_without_a_traceback(server: Server) -> None:
    """`uma-trio ps | head -1` ended in a BrokenPipeError traceback, exit 1 (several-models
    review); generate and top exited 141 quietly.  Every command now does."""
    sock = str(server.config.socket_path)
    # metrics and --help print through rich, whose own answer to a closed pipe was exit 1.
    for command in (["ps", "--socket", sock], ["metrics", "--socket", sock], ["--help"], ["serve", "--help"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before anything is written
        try:
            argv = [*UMA, *command]
            run = partial(
                subprocess.run, argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60
            )
            done = await trio.to_thread.run_sync(run)
        finally:
            os.close(write_end)
        assert done.returncode == 141 and done.stderr == "", (command, done.returncode, done.stderr)


def test_serve_answers_a_socket_it_cannot_probe_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A live daemon whose backlog is full times the probe out: an OSError other than
    "refused", which left `serve` with a traceback and exit 1."""
    import importlib

    serve_command = importlib.import_module("uma_trio.cli.serve")  # the package's `serve` is the function

    def times_out(path: Path) -> bool:
        raise TimeoutError("timed out")

    monkeypatch.setattr(serve_command, "refuse_taken_socket", times_out)
    sock = tmp_path / "s.sock"
    with caplog.at_level(logging.ERROR):
        assert serve_command.serve(config=ServerConfig(socket_path=sock)) == 2
    assert f"cannot start on {sock}: timed out" in caplog.text


def test_ctrl_c_as_the_daemon_starts_is_exit_130_without_a_traceback(tmp_path: Path) -> None:
    """Found by review: Ctrl-C between the model's load and the daemon's first accept (its
    bandwidth probe, the socket's bind) printed a BaseExceptionGroup traceback and exited 1;
    while loading it was 130, once serving a drain and 0."""
    log = tmp_path / "serve.log"
    for attempt in range(2):
        with log.open("w") as out:
            proc = subprocess.Popen(
                [*UMA, "serve", "--socket", str(tmp_path / f"u{attempt}.sock"), "--http", "127.0.0.1:0"],
                stdout=out, stderr=subprocess.STDOUT,
                # A suite run in the background (`pytest &`) passes SIGINT on ignored.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 120
                while "memory bandwidth probe" not in log.read_text():  # the model has loaded
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.002)
                proc.send_signal(signal.SIGINT)
                status = proc.wait(timeout=60)
            finally:
                proc.kill()
        text = log.read_text()
        assert "Traceback" not in text and "ExceptionGroup" not in text, text
        assert status in (130, 0), text  # 0: the signal came once it served, and it drained
