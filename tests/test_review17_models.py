"""Review 17: a pull from a hub that is not there (or a repository id the hub refuses) is one
clear error, not a traceback or a cut connection; a model file whose name is not UTF-8, or
one deleted since, does not break the daemon's answers; a repeated ``--alias``, or one that
is another model's file name, is refused at start-up."""

from __future__ import annotations

import http.server
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.hub import PullError, pull
from uma_trio.model_store import ModelStore, StoreError

from .conftest import running_server
from .helpers import ids
from .hub_server import Repos, _handler

NOT_UTF8 = os.fsdecode(b"bad\xe8.gguf")  # a name the file system allows and JSON cannot carry


def _closed_port() -> int:
    """A loopback port nothing listens on: a connection there is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return url


# -- 1. pulls: every hub failure is a PullError with a status -------------------------------


def test_an_unreachable_hub_or_a_bad_repo_id_is_a_pull_error(no_hub: str, tmp_path: Path) -> None:
    with pytest.raises(PullError, match="did not answer") as unreachable:
        pull("someone/some-model", tmp_path)
    assert unreachable.value.status == 502 and no_hub in str(unreachable.value)
    with pytest.raises(PullError, match="not a repository id") as bad_id:
        pull("some one/model", tmp_path)
    assert bad_id.value.status == 400


@contextmanager
def hub_cutting_downloads(model_path: Path) -> Iterator[str]:
    """A hub that lists a file, then hangs up a few bytes into its download."""
    repos = Repos()
    repos.add("someone/cut", "cut.gguf", model_path)

    class Cut(_handler(repos)):  # type: ignore[misc]
        def do_GET(self) -> None:
            if "/resolve/" not in self.path:
                super().do_GET()
                return
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            self.wfile.write(b"GGUF")
            self.connection.close()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Cut)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_download_cut_short_is_a_pull_error(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub 1.x lets httpx's errors through hf_hub_download."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with hub_cutting_downloads(model_path) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        with pytest.raises(PullError, match="download failed") as cut:
            pull("someone/cut", tmp_path / "store")
    assert cut.value.status == 502 and not any((tmp_path / "store").glob("*.gguf"))


def test_uma_trio_pull_says_what_failed_in_one_line(no_hub: str, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "uma_trio", "pull", "someone/some-model", "--models-dir", str(tmp_path)]
    for reference, code, reason in (
        ("someone/some-model", 2, "did not answer"),
        ("some one/m", 1, "repository id"),
    ):
        command[4] = reference
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == code and len(lines) == 1, done.stderr
        assert lines[0].startswith("error: ") and reason in lines[0]


@pytest.mark.model
async def test_api_pull_answers_the_hubs_failure_with_its_status(
    no_hub: str, tmp_path: Path, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path) as server:
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http_client:
            for reference, status, reason in (
                ("someone/m", 502, "did not answer"),
                ("a b/m", 400, "repository id"),
            ):
                answer = await http_client.post("/api/pull", json={"model": reference, "stream": False})
                assert answer.status_code == status and reason in answer.json()["error"], answer.text
            streamed = await http_client.post("/api/pull", json={"model": "someone/m", "stream": True})
            lines = [httpx.Response(200, content=line).json() for line in streamed.content.splitlines()]
            assert lines[0] == {"status": "pulling manifest"} and "did not answer" in lines[-1]["error"]


@pytest.mark.model
async def test_api_pull_turns_an_unexpected_failure_into_an_error_line(
    tmp_path: Path, llama_model: LlamaModel, server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the pull: the thread died, then the handler read a ``path`` never set."""

    def broken(*_args: object) -> Path:
        raise RuntimeError("a bug")

    monkeypatch.setattr("uma_trio.http.pull.pull", broken)
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path) as server:
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http_client:
            answer = await http_client.post("/api/pull", json={"model": "someone/m", "stream": False})
            # The detail goes to the daemon's log only (SECURITY.md "The model store and pulls").
            assert answer.status_code == 500 and answer.json()["error"].startswith("internal error")
            streamed = await http_client.post("/api/pull", json={"model": "someone/m"})
            assert b'"error":"internal error' in streamed.content.splitlines()[-1]


# -- 2. a file name that is not UTF-8 --------------------------------------------------------


def shelf_of(tmp_path: Path, *names: str) -> tuple[Path, Path]:
    """``main.gguf`` (the --model file) and a shelf of the ``names``, each a few bytes."""
    primary, shelf = tmp_path / "main.gguf", tmp_path / "shelf"
    shelf.mkdir()
    primary.write_bytes(b"GGUF")
    for name in names:
        (shelf / name).write_bytes(b"GGUF" + name.encode("utf-8", "surrogateescape"))
    return primary, shelf


def test_a_file_name_that_is_not_utf8_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    primary, shelf = shelf_of(tmp_path, "ok.gguf", NOT_UTF8)
    with caplog.at_level(logging.WARNING, logger="uma_trio.model_store"):
        store = ModelStore.scan(primary, shelf)
        (shelf / "new.gguf").write_bytes(b"GGUF")
        again = store.rescanned().rescanned()
    assert ids(store) == ["main", "ok"] and ids(again) == ["main", "ok", "new"]
    warned = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(warned) == 1 and "bad\\xe8.gguf" in warned[0]


def test_a_file_name_with_a_control_character_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Operator's-view review: a newline or an escape in a model's file name reached ``ps``,
    ``top`` and the log as it was (a forged log line, colours on the terminal)."""
    names = ["new\nline.gguf", "esc\x1b[31mred.gguf", "rtl\u202eflow.gguf"]
    primary, shelf = shelf_of(tmp_path, "ok.gguf", "caf\u00e9 au lait.gguf", *names)
    with caplog.at_level(logging.WARNING, logger="uma_trio.model_store"):
        store = ModelStore.scan(primary, shelf)
        again = store.rescanned()
    assert ids(store) == ids(again) == ["main", "caf\u00e9 au lait", "ok"]
    warned = [r.getMessage() for r in caplog.records if "control character" in r.getMessage()]
    assert len(warned) == 3 and all("\n" not in w and "\x1b" not in w for w in warned)
    assert any("'new\\nline.gguf'" in w for w in warned), warned


@pytest.mark.model
async def test_a_file_name_that_is_not_utf8_breaks_no_answer(
    tmp_path: Path, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / NOT_UTF8).write_bytes(b"")
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=shelf) as server:
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http_client:
            listed = await http_client.get("/v1/models")
            assert listed.status_code == 200 and len(listed.json()["data"]) == 1
            chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            unknown = await http_client.post("/v1/chat/completions", json=chat)
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in server.models.describe()] == [llama_model.path.name.removesuffix(".gguf")]


# -- 3. a file deleted since the scan ---------------------------------------------------------


def test_a_deleted_file_leaves_the_store_and_the_others_stay(tmp_path: Path) -> None:
    primary, shelf = shelf_of(tmp_path, "gone.gguf", "kept.gguf")
    far = tmp_path / "far.gguf"
    far.write_bytes(b"GGUF")
    store = ModelStore.scan(primary, shelf, ["g=gone.gguf", f"f={far}"])
    (shelf / "gone.gguf").unlink()
    assert store.resolve("gone") is None and store.resolve("g") is None  # the caller rescans
    rescanned = store.rescanned()
    assert ids(rescanned) == ["main", "kept", "far"] and rescanned.resolve("gone") is None
    # Only what the directory gave is forgotten: --model's file and an aliased path stay.
    primary.unlink()
    far.unlink()
    assert ids(rescanned.rescanned()) == ["main", "kept", "far"] and rescanned.resolve("f") == "far"


def test_a_loaded_model_whose_file_is_deleted_serves_on_from_memory(tmp_path: Path) -> None:
    """Deleting (or pulling over) a loaded model's file made its next request a 404 and, after
    a rescan, left the loaded unit without a store entry; it serves until it unloads."""
    primary, shelf = shelf_of(tmp_path, "gone.gguf")
    store = ModelStore.scan(primary, shelf, ["g=gone.gguf"])
    (shelf / "gone.gguf").unlink()
    loaded = {"gone"}
    assert store.resolve("gone", loaded=loaded) == "gone" and store.resolve("g", loaded=loaded) == "gone"
    kept = store.rescanned(loaded=loaded)
    assert kept.entry("gone").id == "gone" and kept.resolve("gone", loaded=loaded) == "gone"
    assert kept.rescanned().resolve("gone") is None  # once unloaded, it goes


@pytest.mark.model
async def test_a_request_for_a_deleted_model_is_model_not_found(
    tmp_path: Path, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    _, shelf = shelf_of(tmp_path, "gone.gguf")
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=shelf) as server:
        (shelf / "gone.gguf").unlink()
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http_client:
            chat = {"model": "gone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            answer = await http_client.post("/v1/chat/completions", json=chat)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found", (
                answer.text
            )
            assert "gone" not in [m["id"] for m in (await http_client.get("/v1/models")).json()["data"]]


# -- 4. aliases --------------------------------------------------------------------------------


def test_an_alias_given_twice_or_naming_another_models_file_is_refused(tmp_path: Path) -> None:
    primary, shelf = shelf_of(tmp_path, "aaa.gguf", "zzz.gguf")
    with pytest.raises(StoreError, match=r"--alias 'chat=zzz.gguf': 'chat' is already --alias chat=aaa.gguf"):
        ModelStore.scan(primary, shelf, ["chat=aaa.gguf", "chat=zzz.gguf"])
    # The --model's name hid the other (the first in the store's order answered for it).
    with pytest.raises(StoreError, match=r"--alias .*another model's file name"):
        ModelStore.scan(primary, shelf, ["main.gguf=zzz"])
    # A directory file the alias takes is left out, as while running (test_models.py).
    assert ModelStore.scan(primary, shelf, ["zzz.gguf=aaa.gguf"]).resolve("zzz.gguf") == "aaa"
    same = ModelStore.scan(primary, shelf, ["c=aaa.gguf", f"c={shelf / 'aaa.gguf'}", "aaa.gguf=aaa"])
    assert same.entry("aaa").aliases == ("c", "aaa.gguf") and same.resolve("zzz.gguf") == "zzz"


@pytest.mark.model
def test_a_repeated_alias_is_a_start_up_error(tmp_path: Path, model_path: Path) -> None:
    _, shelf = shelf_of(tmp_path, "a.gguf", "b.gguf")
    serve = [
        sys.executable, "-m", "uma_trio", "serve", "--model", str(model_path), "--models-dir", str(shelf),
        "--alias", "chat=a.gguf,chat=b.gguf", "--socket", str(tmp_path / "d.sock"), "--bmt-budget-gbps", "20",
        "--n-ctx", "512", "--max-sessions", "1",
    ]  # fmt: skip
    done = subprocess.run(serve, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert (
        "--alias 'chat=b.gguf': 'chat' is already --alias chat=a.gguf" in done.stderr.strip().splitlines()[-1]
    )


@pytest.mark.model
def test_a_memory_budget_below_the_model_s_own_footprint_is_a_start_up_error(
    tmp_path: Path, model_path: Path
) -> None:
    """Several-models review: `--memory-budget` below --model's own footprint was taken, and
    every other model was then refused as too big for it."""
    serve = [
        sys.executable, "-m", "uma_trio", "serve", "--model", str(model_path), "--memory-budget", "10M",
        "--socket", str(tmp_path / "d.sock"), "--bmt-budget-gbps", "20", "--n-ctx", "512",
        "--max-sessions", "1",
    ]  # fmt: skip
    done = subprocess.run(serve, capture_output=True, text=True, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--memory-budget 10M (10 MiB) is below --model's own footprint" in last, last
