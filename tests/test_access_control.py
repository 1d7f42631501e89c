"""Access control (docs/SECURITY.md): the socket's private directory, the peer uid allow-list,
the client's impostor check, and no secrets in the logs.  Simulated engine, real sockets."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import uma_trio.client
import uma_trio.runtime.unix_socket
from uma_trio import cli
from uma_trio.client import ConnectionLost, RequestFailed, UmaClient, UntrustedDaemon
from uma_trio.config import DEFAULT_SOCKET, ServerConfig, default_socket_path
from uma_trio.daemon import http_gateway
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.runtime.peer import peer_uid
from uma_trio.runtime.unix_socket import (
    SocketInUseError,
    UnsafeSocketDirError,
    bind_unix_listener,
    ensure_private_dir,
    remove_stale_socket,
)

from .helpers import RawClient, serving_sim, sim_server

ME = os.geteuid()
OTHER_UID = ME + 12345
needs_root = pytest.mark.skipif(ME != 0, reason="only root can give a directory to another user")


@pytest.fixture
def tmp() -> Iterator[Path]:
    # Short paths (AF_UNIX) in a directory mkdtemp made 0700 and ours.
    with tempfile.TemporaryDirectory(prefix="uma-ac-") as name:
        yield Path(name)


def sim_config(tmp: Path, **overrides: Any) -> ServerConfig:
    return replace(SIM_CONFIG, socket_path=tmp / "d.sock", **overrides)


# -- the socket's directory ------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=lambda m: f"umask{m:03o}")
def test_missing_socket_directory_is_created_0700_whatever_the_umask(tmp: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        ensure_private_dir(tmp / "run")
        assert os.umask(umask) == umask  # given back
    finally:
        os.umask(old)
    info = (tmp / "run").lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == ME
    ensure_private_dir(tmp / "run")  # an existing private directory is fine


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702, 0o777], ids=lambda m: f"{m:04o}")
def test_a_directory_others_can_write_is_refused(tmp: Path, mode: int) -> None:
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(UnsafeSocketDirError) as caught:
        ensure_private_dir(shared)
    message = str(caught.value)
    assert str(shared) in message and f"mode is {mode:04o}" in message and "chmod go-w" in message
    assert isinstance(caught.value, SocketInUseError)  # so the daemon reports it as it does a taken socket


def test_a_symlinked_directory_is_refused(tmp: Path) -> None:
    (tmp / "real").mkdir(mode=0o700)
    (tmp / "link").symlink_to(tmp / "real")
    with pytest.raises(UnsafeSocketDirError, match="symbolic link"):
        ensure_private_dir(tmp / "link")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    with pytest.raises(UnsafeSocketDirError, match="symbolic link"):
        ensure_private_dir(tmp / "dangling")
    assert not (tmp / "nowhere").exists()


def test_a_file_or_an_uncreatable_directory_is_refused(tmp: Path) -> None:
    (tmp / "file").write_text("")
    with pytest.raises(UnsafeSocketDirError, match="not a directory"):
        ensure_private_dir(tmp / "file")
    with pytest.raises(UnsafeSocketDirError, match="cannot create the socket directory"):
        ensure_private_dir(tmp / "a" / "b")  # only the last component is created


@needs_root
def test_a_directory_owned_by_someone_else_is_refused(tmp: Path) -> None:
    theirs = tmp / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(UnsafeSocketDirError, match=f"owned by uid {OTHER_UID} \\(mode 0700\\)"):
        ensure_private_dir(theirs)


def test_a_sticky_shared_directory_like_tmp_is_accepted(tmp: Path) -> None:
    """Issue 17: the sticky bit keeps others from removing or renaming our socket, so a socket
    directly in /tmp is safe; the check used to refuse it and advise `chmod go-w /tmp`."""
    sticky = tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    ensure_private_dir(sticky)
    ensure_private_dir(Path("/tmp"))  # root's, sticky: what the advice would have broken


async def test_the_socket_appears_already_listening(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI once met "connection refused" on a socket that existed: it was bound but not yet
    listening.  It is now bound under another name and linked into place once it listens."""
    path = tmp / "d.sock"
    listener, inode = await bind_unix_listener(path)
    async with listener:
        assert os.listdir(tmp) == ["d.sock"] and path.stat().st_ino == inode
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))  # the backlog takes it before anyone accepts
        client.close()
        # A name taken meanwhile (after the stale-socket check) is refused, not replaced.
        monkeypatch.setattr(uma_trio.runtime.unix_socket, "remove_stale_socket", lambda _: None)
        with pytest.raises(SocketInUseError, match=r"cannot create the socket .*: File exists"):
            await bind_unix_listener(path)
        assert os.listdir(tmp) == ["d.sock"]


@needs_root
def test_a_name_another_user_took_first_in_a_sticky_directory_is_refused(tmp: Path) -> None:
    sticky = tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "d.sock"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(theirs))
    squatter.close()  # a stale socket, but not ours
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(SocketInUseError, match=f"belongs to uid {OTHER_UID}"):
        remove_stale_socket(theirs)
    assert theirs.exists()


async def test_the_daemon_serves_in_a_sticky_shared_directory(tmp: Path) -> None:
    sticky = tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    config = replace(SIM_CONFIG, socket_path=sticky / "d.sock")
    async with serving_sim(sim_server(config)), UmaClient.connect(config.socket_path) as client:
        assert (await client.metrics())["sessions"]["active"] == 0
        assert stat.S_IMODE(config.socket_path.stat().st_mode) == 0o600


async def test_the_daemon_refuses_to_serve_in_a_shared_directory(tmp: Path) -> None:
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky: anyone could replace the socket
    server = sim_server(replace(SIM_CONFIG, socket_path=shared / "d.sock"))
    with pytest.raises(UnsafeSocketDirError, match="other users can write"):
        await server.serve()
    assert not (shared / "d.sock").exists()


async def test_the_daemon_creates_its_directory(tmp: Path) -> None:
    config = replace(SIM_CONFIG, socket_path=tmp / "run" / "d.sock")
    async with serving_sim(sim_server(config)), UmaClient.connect(config.socket_path) as client:
        assert stat.S_IMODE((tmp / "run").stat().st_mode) == 0o700
        assert (await client.metrics())["sessions"]["active"] == 0


def test_serve_refuses_a_shared_directory_with_exit_2_before_loading(tmp: Path) -> None:
    model = tmp / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))  # passes the magic check; never loaded
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    command = ["serve", "--model", str(model), "--socket", str(shared / "d.sock")]
    done = subprocess.run(
        [sys.executable, "-m", "uma_trio", *command], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert f"refusing to serve in {shared}" in done.stderr and "Traceback" not in done.stderr


# -- the default socket path -----------------------------------------------------------


def test_default_socket_is_in_the_runtime_dir_when_ours(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp))
    assert default_socket_path() == tmp / "uma-trio" / "uma.sock"


@pytest.mark.parametrize("value", [None, "", "relative/dir", "/nonexistent/uma-trio-test", "FILE"])
def test_default_socket_falls_back_to_a_per_user_tmp_dir(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        if value == "FILE":
            value = str(tmp / "file")
            Path(value).write_text("")
        monkeypatch.setenv("XDG_RUNTIME_DIR", value)
    assert default_socket_path() == Path(f"/tmp/uma-trio-{ME}/uma.sock")


@needs_root
def test_default_socket_ignores_a_runtime_dir_of_another(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.chown(tmp, OTHER_UID, -1)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp))
    assert default_socket_path() == Path(f"/tmp/uma-trio-{ME}/uma.sock")


def test_the_old_shared_default_is_gone() -> None:
    assert Path("/tmp/uma.sock") not in (DEFAULT_SOCKET, ServerConfig().socket_path)
    assert DEFAULT_SOCKET.name == "uma.sock" and DEFAULT_SOCKET.parent.name in ("uma-trio", f"uma-trio-{ME}")


# -- peer credentials ------------------------------------------------------------------


@pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="no peer credentials here")
async def test_peer_uid_is_ours_on_a_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_uid(a) == ME and peer_uid(b) == ME
    ta, tb = trio.socket.socketpair(socket.AF_UNIX)
    with ta, tb:
        assert peer_uid(ta) == ME
    with socket.socket(socket.AF_UNIX) as lonely:  # not connected: nobody to name
        assert peer_uid(lonely) is None


# -- the allow-list ----------------------------------------------------------------------


def test_allowed_uids_must_be_a_non_empty_list_of_uids() -> None:
    with pytest.raises(ValueError, match="--allow-uid must not be empty"):
        ServerConfig(allowed_uids=())
    with pytest.raises(ValueError, match="--allow-uid must be user ids"):
        ServerConfig(allowed_uids=(-1,))
    assert ServerConfig().allowed_uids is None


def test_allow_uid_flag_repeats_and_reads_its_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    _, bound, _ = cli.app.parse_args(["serve", "--allow-uid", "5", "--allow-uid", "7"])
    assert bound.kwargs["config"].allowed_uids == (5, 7)
    monkeypatch.setenv("UMA_ALLOW_UID", "5 7")
    _, bound, _ = cli.app.parse_args(["serve"])
    assert bound.kwargs["config"].allowed_uids == (5, 7)


async def test_an_allowed_uid_is_served(tmp: Path) -> None:
    async with serving_sim(sim_server(sim_config(tmp, allowed_uids=(OTHER_UID, ME)))) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "a", "prompt": "hello there", "max_tokens": 3})
        events = await client.until_end("a")
        await client.aclose()
        assert events[-1]["event"] == "eos" and events[-1]["reason"] == "length"
        assert "E_AUTH_001" not in server.metrics_snapshot()["errors"]


async def test_a_uid_not_on_the_list_gets_e_auth_001_and_is_closed(
    tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving_sim(sim_server(sim_config(tmp, allowed_uids=(OTHER_UID,)))) as server:
        client = await RawClient.connect(server.config.socket_path)
        with trio.fail_after(10):
            event = await client.next_event()
            assert event == {
                "event": "error", "id": None, "code": "E_AUTH_001",
                "message": f"uid {ME} is not allowed to use this daemon",
            }  # fmt: skip
            assert await client.next_event() is None  # closed after the error
        await client.aclose()
        snapshot = server.metrics_snapshot()
    assert snapshot["errors"] == {"E_AUTH_001": 1}
    assert snapshot["connections"]["total"] == 0  # never served
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("uma_trio")]
    assert [r.getMessage() for r in warnings] == [f"refused a connection from uid {ME}: not in --allow-uid"]


async def test_an_undeterminable_uid_is_refused_when_a_list_is_set(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("uma_trio.runtime.server.peer_uid", lambda sock: None)
    async with serving_sim(sim_server(sim_config(tmp, allowed_uids=(ME,)))) as server:
        client = await RawClient.connect(server.config.socket_path)
        with trio.fail_after(10):
            event = await client.next_event()
        await client.aclose()
    assert event is not None and event["code"] == "E_AUTH_001" and "cannot be determined" in event["message"]


@pytest.mark.parametrize("pause", [0.0, 0.2])  # ask at once, or after the refusal is in
async def test_a_refused_client_is_told_why(tmp: Path, pause: float) -> None:
    async with serving_sim(sim_server(sim_config(tmp, allowed_uids=(OTHER_UID,)))) as server:
        with pytest.raises((RequestFailed, ConnectionLost), match=f"E_AUTH_001: uid {ME} is not allowed"):
            async with UmaClient.connect(server.config.socket_path) as client:
                await trio.sleep(pause)
                with trio.fail_after(10):
                    await client.metrics()


async def test_cli_reports_a_refusal_in_one_line(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with serving_sim(sim_server(sim_config(tmp, allowed_uids=(OTHER_UID,)))) as server:
        path = server.config.socket_path
        codes = [
            await trio.to_thread.run_sync(lambda: cli.metrics(socket=path)),
            await trio.to_thread.run_sync(lambda: cli.top(socket=path, once=True)),
        ]
    err = capsys.readouterr().err
    assert codes == [cli.EXIT_PROTOCOL_ERROR] * 2, err  # the connection refused, as CONFIG.md says
    assert err.count(f"E_AUTH_001: uid {ME} is not allowed to use this daemon") == 2, err
    assert "Traceback" not in err


# -- the client's impostor check ---------------------------------------------------------


async def test_client_refuses_a_daemon_running_as_another_user(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_sim(sim_server(sim_config(tmp))) as server:
        path = server.config.socket_path
        async with UmaClient.connect(path) as client:  # the real check: the daemon is us
            await client.metrics()
        monkeypatch.setattr(uma_trio.client, "peer_uid", lambda sock: OTHER_UID)
        with pytest.raises(UntrustedDaemon) as caught:
            async with UmaClient.connect(path):
                pytest.fail("connected to an impostor")
        assert isinstance(caught.value, ConnectionError)
        assert str(caught.value) == (
            f"the daemon on {path} runs as uid {OTHER_UID}, not as you (uid {ME}); "
            "refusing to send it anything"
        )
        for trusted in (0, None):  # root, or a platform that cannot tell
            monkeypatch.setattr(uma_trio.client, "peer_uid", lambda sock, uid=trusted: uid)
            async with UmaClient.connect(path) as client:
                await client.metrics()


async def test_cli_reports_an_impostor_as_a_connection_error(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(uma_trio.client, "peer_uid", lambda sock: OTHER_UID)
    async with serving_sim(sim_server(sim_config(tmp))) as server:
        path = server.config.socket_path
        # The command runs its own event loop (asyncio, via anyio.run): in a worker thread.
        code = await trio.to_thread.run_sync(lambda: cli.metrics(socket=path))
    assert code == cli.EXIT_PROTOCOL_ERROR
    err = capsys.readouterr().err
    assert f"cannot talk to the daemon at {path}" in err and f"runs as uid {OTHER_UID}, not as you" in err


# -- no secrets in the logs --------------------------------------------------------------

KEY = "sk-uma-secret-7f3a9c"
WRONG_KEY = "sk-uma-wrong-55b1d0"
PROMPT = "zebra quokka secret-prompt-words"


async def test_no_api_key_or_prompt_in_the_logs(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for name, logger in list(logging.root.manager.loggerDict.items()):  # whatever their own levels
        if isinstance(logger, logging.Logger):
            caplog.set_level(logging.DEBUG, logger=name)
    config = sim_config(tmp, http="127.0.0.1:0", api_key=KEY)
    assert KEY not in repr(config) and "api_key" not in repr(config)
    statuses: dict[str, int] = {}
    async with http_gateway(config, "sim.gguf") as gateway, serving_sim(sim_server(config)) as server:
        assert gateway is not None and gateway.url is not None
        gateway.attach(server)
        body = {"model": "sim", "prompt": PROMPT, "max_tokens": 3}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            for label, headers in [
                ("right", {"authorization": f"Bearer {KEY}"}),
                ("wrong", {"authorization": f"Bearer {WRONG_KEY}"}),
                ("scheme", {"authorization": f"Basic {WRONG_KEY}"}),
                ("none", {}),
            ]:
                statuses[label] = (await http.post("/v1/completions", json=body, headers=headers)).status_code
                statuses[label + " models"] = (await http.get("/v1/models", headers=headers)).status_code
        async with UmaClient.connect(config.socket_path) as client:
            await client.complete(prompt=PROMPT, max_tokens=3)
        snapshot = server.metrics_snapshot()
    assert statuses == {
        "right": 200, "right models": 200, "wrong": 401, "wrong models": 401,
        "scheme": 401, "scheme models": 401, "none": 401, "none models": 401,
    }  # fmt: skip
    assert snapshot["errors"].get("invalid_api_key") == 6
    records = caplog.records
    # Not vacuous: the daemon's own records and DEBUG records were captured.
    assert any(r.name == "uma_trio.runtime.server" and "serving sim" in r.getMessage() for r in records)
    assert any(r.levelno == logging.DEBUG for r in records)
    for record in records:
        text = f"{record.getMessage()} {record.msg!r} {record.args!r} {record.exc_text or ''}"
        assert KEY not in text and WRONG_KEY not in text, record
        assert "quokka" not in text, record  # the prompt, at any level
