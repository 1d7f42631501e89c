"""Pulling a model from a hub (issue 22, point 5): the official ``huggingface_hub`` client
against a local server in the hub's layout (tests/hub_server.py, ``HF_ENDPOINT``), nothing
reaching the internet; ``uma-trio pull``, and Ollama's ``/api/pull`` through the official
``ollama`` client on a running daemon, which then serves the model."""

from __future__ import annotations

import errno
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import ollama
import openai
import pytest

from uma_trio import hub as hub_module
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.hub import HubFile, Progress, PullError, choose_file, parse_reference, pull

from .conftest import running_server
from .hub_server import Repos, fake_hub

REPO = "someone/SmolLM2-135M-GGUF"


def test_a_reference_names_a_repository_and_maybe_a_quantization() -> None:
    assert parse_reference("someone/repo") == ("someone/repo", None)
    assert parse_reference("hf.co/someone/repo:Q4_K_M") == ("someone/repo", "Q4_K_M")
    for bad in ("llama3.2", "a/b/c", "/repo", ""):
        with pytest.raises(PullError, match="user/repo"):
            parse_reference(bad)


def test_the_file_is_the_one_the_quantization_names() -> None:
    files = [HubFile(n, 1, None) for n in ("m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf", "README.md")]
    assert choose_file(files, "q8_0", "r").name == "m-Q8_0.gguf"
    assert choose_file(files, None, "r").name == "m-Q4_K_M.gguf"  # the usual default
    with pytest.raises(PullError, match="no Q2_K"):
        choose_file(files, "Q2_K", "r")
    with pytest.raises(PullError, match="several"):
        choose_file([files[1], HubFile("m-f16.gguf", 1, None)], None, "r")
    with pytest.raises(PullError, match="split"):
        choose_file([HubFile("big-00001-of-00002.gguf", 1, None)], None, "r")
    with pytest.raises(PullError, match="no GGUF"):
        choose_file(files[3:], None, "r")


@pytest.fixture
def hub(model_path: Path, tmp_path: Path) -> Iterator[Repos]:
    repos = Repos()
    repos.add(REPO, "SmolLM2-135M-Instruct-Q4_1.gguf", model_path)
    repos.add(REPO, "SmolLM2-135M-Instruct-bad.gguf", model_path)
    repos.wrong_sha.add("SmolLM2-135M-Instruct-bad.gguf")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"not a model at all")
    repos.add("someone/broken", "broken.gguf", not_gguf)
    with fake_hub(repos) as url:
        saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_DISABLE_TELEMETRY")}
        os.environ.update(
            HF_ENDPOINT=url, HF_HUB_CACHE=str(tmp_path / "hf-cache"), HF_HUB_DISABLE_TELEMETRY="1"
        )
        try:
            yield repos
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def test_a_pull_lands_checked_and_a_bad_one_leaves_nothing(
    hub: Repos, tmp_path: Path, model_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    seen: list[tuple[str, int, int]] = []
    path = pull(f"{REPO}:Q4_1", store, lambda *event: seen.append(event))
    assert path == store / "SmolLM2-135M-Instruct-Q4_1.gguf" and path.read_bytes() == model_path.read_bytes()
    assert [e[0] for e in seen][-2:] == ["verifying", "done"] and any(e[0] == "downloading" for e in seen)
    assert pull(f"{REPO}:Q4_1", store) == path and hub.downloads.count(path.name) == 1  # kept, not fetched
    with pytest.raises(PullError, match="sha256"):
        pull(f"{REPO}:bad", store)
    with pytest.raises(PullError, match="not a GGUF"):
        pull("someone/broken", store)
    with pytest.raises(PullError, match="no such repository"):
        pull("someone/missing", store)
    assert sorted(p.name for p in store.iterdir()) == [path.name]  # nothing half-written stayed


def test_uma_trio_pull_fills_the_store(hub: Repos, tmp_path: Path) -> None:
    store = tmp_path / "cli-store"
    command = [sys.executable, "-m", "uma_trio", "pull", f"{REPO}:q4_1", "--models-dir", str(store)]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert (
        "SmolLM2-135M-Instruct-Q4_1" in done.stdout and (store / "SmolLM2-135M-Instruct-Q4_1.gguf").is_file()
    )
    failed = subprocess.run([*command[:4], "someone/missing", *command[5:]], capture_output=True, text=True)
    assert failed.returncode != 0 and "no such repository" in failed.stderr


@pytest.mark.model
async def test_api_pull_then_the_daemon_serves_the_model(
    hub: Repos, tmp_path: Path, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    store = tmp_path / "daemon-store"
    store.mkdir()
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=store) as server:
        api = ollama.AsyncClient(host=str(server.http_url))
        lines = [line async for line in await api.pull(f"hf.co/{REPO}:Q4_1", stream=True)]
        statuses = [line.status for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
        assert "verifying sha256 digest" in statuses and any(line.total for line in lines)
        with pytest.raises(ollama.ResponseError) as refused:
            await api.pull(f"{REPO}:bad")
        assert "sha256" in refused.value.error
        pulled = "SmolLM2-135M-Instruct-Q4_1"
        assert pulled in {m.model for m in (await api.list()).models}
        sdk = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
        answer = await sdk.completions.create(model=pulled, prompt="The capital of France is", max_tokens=6)
        assert answer.model == pulled and answer.choices[0].text
        assert server.models.state(pulled) == "loaded"


def test_pulls_at_once_keep_out_of_each_other_s_way(hub: Repos, tmp_path: Path, model_path: Path) -> None:
    """Two files of one repository at once: they shared one staging folder and the first to
    end removed the other's download.  The same file twice (a client that hung up and asked
    again): the second waits for the first and finds the file, fetched once."""
    import threading
    import time

    hub.add(REPO, "SmolLM2-135M-Instruct-Q8_0.gguf", model_path)
    store = tmp_path / "store"
    store.mkdir()
    go_on = threading.Event()
    results: dict[str, Path | str] = {}

    def held(what: str, done: int, total: int) -> None:  # the first pull waits mid-download
        if what == "downloading":
            go_on.wait(60)

    def first(reference: str) -> None:
        try:
            results["first"] = pull(reference, store, held)
        except PullError as exc:
            results["first"] = str(exc)

    def under_way() -> None:
        deadline = time.monotonic() + 30
        while not any((store / ".pull").rglob("*")) and time.monotonic() < deadline:
            time.sleep(0.001)

    worker = threading.Thread(target=first, args=(f"{REPO}:Q4_1",))
    worker.start()
    under_way()
    other = pull(f"{REPO}:Q8_0", store)  # another file of the repository, meanwhile
    go_on.set()
    worker.join(60)
    assert results["first"] == store / "SmolLM2-135M-Instruct-Q4_1.gguf" and other.exists()

    go_on.clear()
    (store / "SmolLM2-135M-Instruct-Q4_1.gguf").unlink()
    worker = threading.Thread(target=first, args=(f"{REPO}:Q4_1",))
    worker.start()
    under_way()
    threading.Timer(0.3, go_on.set).start()
    again = pull(f"{REPO}:Q4_1", store)  # waits for the first, then finds the file there
    worker.join(60)
    assert again == results["first"] and hub.downloads.count(again.name) == 2  # once per round
    assert not (store / ".pull").exists()


Q4_1 = "SmolLM2-135M-Instruct-Q4_1.gguf"


def test_a_file_of_that_name_from_another_repository_never_replaces_the_store_s(
    hub: Repos, tmp_path: Path, model_path: Path
) -> None:
    """Review: any repository with a file of the store's file's name replaced it, and one of
    the same size passed for the pulled one.  Now the hub's sha256 decides: a 409, the file
    kept, nothing fetched."""
    store = tmp_path / "store"
    store.mkdir()
    own = bytearray(model_path.read_bytes())
    own[-1] ^= 0xFF  # the same size, other bytes
    for planted in (bytes(own), b"GGUF" + b"\0" * 100):
        (store / Q4_1).write_bytes(planted)
        with pytest.raises(PullError, match=f"already has a different {Q4_1}.*remove or rename") as refused:
            pull(f"{REPO}:Q4_1", store)
        assert refused.value.status == 409 and (store / Q4_1).read_bytes() == planted
    assert Q4_1 not in hub.downloads


def test_without_the_hub_s_sha256_only_the_same_size_counts_as_pulled(
    hub: Repos, tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = model_path.stat().st_size
    monkeypatch.setattr(hub_module, "hub_files", lambda repo: [HubFile(Q4_1, size, None)])
    store = tmp_path / "store"
    store.mkdir()
    (store / Q4_1).write_bytes(b"GGUF" + b"\0" * (size - 4))
    assert pull(f"{REPO}:Q4_1", store) == store / Q4_1  # taken as present: nothing to tell them apart
    (store / Q4_1).write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(PullError, match="already has a different") as refused:
        pull(f"{REPO}:Q4_1", store)
    assert refused.value.status == 409 and (store / Q4_1).stat().st_size == 104 and not hub.downloads


def test_a_file_that_appears_during_the_pull_is_not_replaced(
    hub: Repos, tmp_path: Path, model_path: Path
) -> None:
    """Another process (``uma-trio pull``) may put a file of that name there while this one
    downloads: a different one is kept and the pull refused, the same one is the pull's."""
    store = tmp_path / "store"
    store.mkdir()
    target = store / Q4_1

    def planting(data: bytes) -> Progress:
        def report(what: str, done: int, total: int) -> None:
            if what == "verifying" and not target.exists():
                target.write_bytes(data)

        return report

    with pytest.raises(PullError, match="already has a different") as refused:
        pull(f"{REPO}:Q4_1", store, planting(b"GGUF another"))
    assert refused.value.status == 409 and target.read_bytes() == b"GGUF another"
    target.unlink()
    assert pull(f"{REPO}:Q4_1", store, planting(model_path.read_bytes())) == target
    assert not (store / ".pull").exists()


def test_a_pull_needs_room_for_the_file_and_a_margin(
    hub: Repos, tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    free = [model_path.stat().st_size + 1]  # room for the file, not the margin
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=free[0]))
    with pytest.raises(PullError, match="GiB free in the model store") as refused:
        pull(f"{REPO}:Q4_1", store)
    assert refused.value.status == 507 and not hub.downloads and not list(store.iterdir())
    free[0] = 1 << 50
    assert pull(f"{REPO}:Q4_1", store).exists()


def test_a_pull_removes_staging_folders_left_by_a_daemon_that_exited(hub: Repos, tmp_path: Path) -> None:
    """A pull thread does not hold the daemon up, so its staging folder outlived it; the next
    pull removes those untouched for 10 minutes, and leaves a live one (another process's)."""
    store = tmp_path / "store"
    stale = store / ".pull" / "someone--gone.abc123"
    live = store / ".pull" / "someone--live.def456"
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "half.gguf.incomplete").write_bytes(b"GGUF half")
    past = time.time() - 3600
    for path in (stale / "half.gguf.incomplete", stale):
        os.utime(path, (past, past))
    pull(f"{REPO}:Q4_1", store)
    assert not stale.exists() and (live / "half.gguf.incomplete").exists()


def test_a_file_already_verified_is_not_read_again_until_it_changes(
    hub: Repos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: every pull of a file already there read it whole for its sha256 (a 20 GB
    model, re-pulled by each front end, read each time).  The digest is kept until the file's
    inode, size, mtime or ctime changes; one written over with its mtime put back is read."""
    store = tmp_path / "store"
    store.mkdir()
    path = pull(f"{REPO}:Q4_1", store)
    reads: list[Path] = []
    real = hub_module.sha256_of
    monkeypatch.setattr(hub_module, "sha256_of", lambda p: reads.append(p) or real(p))
    for _ in range(3):
        assert pull(f"{REPO}:Q4_1", store) == path
    assert reads == []  # read once, when it was downloaded
    time.sleep(0.05)  # past the file system's timestamp tick
    path.write_bytes(path.read_bytes())  # the same bytes, written again: read again, once
    for _ in range(2):
        assert pull(f"{REPO}:Q4_1", store) == path
    assert len(reads) == 1
    before = path.stat()
    time.sleep(0.05)
    tampered = bytearray(path.read_bytes())
    tampered[-1] ^= 0xFF
    path.write_bytes(bytes(tampered))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and mtime
    with pytest.raises(PullError, match="already has a different") as refused:
        pull(f"{REPO}:Q4_1", store)
    assert refused.value.status == 409 and len(reads) == 2 and hub.downloads.count(Q4_1) == 1


def test_two_pulls_at_once_do_not_count_the_same_free_space(
    hub: Repos, tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: two pulls at once both found room for their file and the 1 GiB margin in the
    same free space.  A pull's check counts what the others have still to write, and its
    reservation ends with it, a failed one's too."""
    import threading

    hub.add(REPO, "SmolLM2-135M-Instruct-Q8_0.gguf", model_path)
    size = model_path.stat().st_size
    # Room for one file and the margin (the fake disk does not fill: the first pull's bytes
    # still to write are what keeps the second out).
    room = SimpleNamespace(free=size + hub_module.DISK_MARGIN)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: room)
    store = tmp_path / "store"
    store.mkdir()
    reached, go_on = threading.Event(), threading.Event()
    results: dict[str, Path | str] = {}

    def held(what: str, done: int, total: int) -> None:  # the first pull waits mid-download
        if what == "downloading":
            reached.set()
            go_on.wait(60)

    def first(reference: str) -> None:
        try:
            results[reference] = pull(reference, store, held)
        except PullError as exc:
            results[reference] = str(exc)

    for reference in (f"{REPO}:Q4_1", f"{REPO}:bad"):  # one that lands, one that fails its check
        reached.clear()
        go_on.clear()
        worker = threading.Thread(target=first, args=(reference,))
        worker.start()
        assert reached.wait(60)
        with pytest.raises(PullError, match=r"GiB free in the model store.* pulls under way") as refused:
            pull(f"{REPO}:Q8_0", store)
        assert refused.value.status == 507
        go_on.set()
        worker.join(60)
        assert not hub_module._RESERVED  # released, however the pull ended
    assert results[f"{REPO}:Q4_1"] == store / Q4_1 and "sha256" in str(results[f"{REPO}:bad"])
    assert pull(f"{REPO}:Q8_0", store).exists()  # alone, it has the room


@pytest.mark.parametrize(
    ("failure", "store_s"),
    [
        (lambda staging: ssl.SSLError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] verify failed"), False),
        (lambda staging: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), False),
        (lambda staging: OSError(errno.ENOSPC, "No space left on device"), True),
        (lambda staging: FileNotFoundError(errno.ENOENT, "gone", str(staging / "x.incomplete")), True),
    ],
    ids=["tls", "reset", "disk-full", "staging-file"],
)
def test_a_network_error_in_the_download_is_the_hub_s_not_the_store_s(
    hub: Repos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    failure: Callable[[Path], OSError], store_s: bool,
) -> None:  # fmt: skip
    """Review: any OSError with an errno from the download was taken for the store's (500,
    "the model store could not be written"), a reset connection or a TLS failure too (an
    ssl.SSLError's errno 1 is EPERM's).  Only the store's errnos, or a file in the pull's
    staging folder, are the store's; the rest is a 502 naming the hub."""
    import huggingface_hub

    def failing(*args: object, local_dir: Path, **kwargs: object) -> str:
        raise failure(Path(local_dir))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing)
    store = tmp_path / "store"
    if store_s:
        with pytest.raises(OSError) as raised:
            pull(f"{REPO}:Q4_1", store)
        assert not isinstance(raised.value, PullError)
    else:
        hub_named = rf"download failed \(.*; the hub at {re.escape(os.environ['HF_ENDPOINT'])}\)"
        with pytest.raises(PullError, match=hub_named) as refused:
            pull(f"{REPO}:Q4_1", store)
        assert refused.value.status == 502
    assert not list(store.glob("*.gguf")) and not (store / ".pull").exists()
