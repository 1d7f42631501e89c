"""Ollama's ``/api/show`` and ``/api/tags`` describe every model of the store from its own
file (engine/model_card.py), loaded or not: apps such as VS Code's Ollama provider and
Continue list a model by its capabilities and context length before they load it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import ollama
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.llama_model import ModelLoadError
from uma_trio.engine.model_card import ModelCard, _cached, card_of, read_card, typed
from uma_trio.http.ollama import capabilities

from .conftest import running_server

pytestmark = pytest.mark.model

PRIMARY = "SmolLM2-135M-Instruct.Q4_1"


def test_values_are_typed_back_from_llama_cpps_text() -> None:
    assert typed("8192") == 8192 and typed("-1") == -1
    assert typed("1e-05") == 1e-05 and typed("0.000010") == 1e-05
    assert typed("100000.000000") == 100000.0
    assert typed("true") is True and typed("false") is False
    assert typed("135M") == "135M" and typed("") == ""


def test_the_card_of_the_default_model_file(model_path: Path) -> None:
    card = read_card(model_path)
    assert card.architecture == "llama" and card.size_label == "135M" and card.quantization == "Q4_1"
    assert "<|im_start|>" in card.chat_template and not card.fill_in_middle and not card.embedding_only
    info = card.model_info()
    assert info["llama.context_length"] == 8192 and info["llama.block_count"] == 30
    assert "tokenizer.chat_template" not in info  # shown as the template, not twice
    assert card_of(model_path) is card_of(model_path)  # read once per version of the file


def test_a_file_llama_cpp_cannot_read_has_no_card_and_is_read_once(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError):
        read_card(broken)
    assert card_of(broken) is None
    before = _cached.cache_info().hits
    assert card_of(broken) is None and _cached.cache_info().hits == before + 1


def test_an_embedding_model_only_embeds() -> None:
    bert = {"general.architecture": "bert", "bert.embedding_length": "384"}
    pooled = ModelCard(metadata=bert, chat_template="", fill_in_middle=False, pooling=1)
    chat = ModelCard(metadata={}, chat_template="", fill_in_middle=True, pooling=None)
    assert capabilities(pooled, insert=False) == ["embedding"] and pooled.embedding_length == 384
    assert capabilities(chat, insert=True) == ["completion", "tools", "insert"]
    assert capabilities(None, insert=False) == ["completion", "tools"]


async def test_a_model_not_loaded_is_shown_from_its_file_and_stays_unloaded(
    llama_model: LlamaModel, server_config: ServerConfig, model_path: Path, tmp_path: Path
) -> None:
    shutil.copy(model_path, tmp_path / "other.gguf")  # a second model of the store: id `other`
    os.utime(tmp_path / "other.gguf", (1_700_000_000, 1_700_000_000))  # 2023-11-14T22:13:20Z
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path) as server:
        api = ollama.AsyncClient(host=str(server.http_url))
        shown = await api.show("other")
        assert shown.capabilities == ["completion", "tools"]  # it was ["completion"]: no tools
        assert shown.details.family == "llama" and shown.details.parameter_size == "135M"
        assert shown.details.quantization_level == "Q4_1"
        assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
        # What a request may hold here (--n-ctx), as for the loaded model, not the trained 8,192.
        assert shown.modelinfo["llama.context_length"] == server.config.n_ctx
        assert shown.modelinfo["llama.embedding_length"] == 576
        assert shown.template and "<|im_start|>" in shown.template
        primary = await api.show(PRIMARY)
        assert primary.modelinfo is not None and primary.modelinfo["llama.block_count"] == 30
        assert primary.modelinfo["llama.context_length"] == server.loop.engine.n_ctx_seq
        listed = {m.model: m.details for m in (await api.list()).models}
        # The primary's size is its file's, as the others' (it was llama.cpp's tensor bytes).
        file_bytes = (await trio.Path(model_path).stat()).st_size
        sizes = {m.model: m.size for m in (await api.list()).models}
        assert sizes[PRIMARY] == sizes["other"] == file_bytes
        # A file copied over one listed is listed at its new size (it kept the first one's).
        (tmp_path / "later.gguf").write_bytes(b"GGUF" + bytes(60))
        assert {m.model: m.size for m in (await api.list()).models}["later"] == 64
        shutil.copy(model_path, tmp_path / "later.gguf")
        assert {m.model: m.size for m in (await api.list()).models}["later"] == file_bytes
        (tmp_path / "later.gguf").unlink()
        # When the file was written, as Ollama says (it was the request's time).
        dates = {m.model: m.modified_at for m in (await api.list()).models}
        assert dates["other"] is not None and dates["other"].timestamp() == 1_700_000_000
        assert shown.modified_at is not None and shown.modified_at.timestamp() == 1_700_000_000
        other = listed["other"]
        assert other is not None and (other.family, other.parameter_size, other.quantization_level) == (
            "llama",
            "135M",
            "Q4_1",
        )
        assert server.models.state("other") == "unloaded"  # reading its card loaded nothing
        # The primary's size is its file's label too (llama.cpp's description guessed "256M").
        assert listed[PRIMARY] is not None and listed[PRIMARY].parameter_size == "135M"
        assert primary.details is not None and primary.details.parameter_size == "135M"
        running = {m.model: m.details for m in (await api.ps()).models}
        assert running[PRIMARY] is not None and running[PRIMARY].parameter_size == "135M"
        async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
            missing = await http.post("/api/show", json={"model": "nothing-here"})
            assert missing.status_code == 404 and "nothing-here" in missing.json()["error"]
            # A file that is no model: refused as a request naming it is (it was a 200 of
            # made-up details: family "", capabilities completion and tools); one that is no
            # GGUF file at all is no model of the store (it was listed as one).
            await trio.Path(tmp_path / "junk.gguf").write_bytes(b"GGUF junk\n")
            junk = await http.post("/api/show", json={"model": "junk"})
            assert junk.status_code == 422 and "cannot load model 'junk'" in junk.json()["error"], junk.text
            await trio.Path(tmp_path / "notes.gguf").write_bytes(b"notes\n")
            notes = await http.post("/api/show", json={"model": "notes"})
            assert notes.status_code == 404 and "notes" in notes.json()["error"], notes.text
            assert "notes" not in {m.model for m in (await api.list()).models}


async def test_a_dimensions_no_model_gives_is_refused_before_the_model_loads(
    llama_model: LlamaModel, server_config: ServerConfig, model_path: Path, tmp_path: Path
) -> None:
    """For a model not yet loaded, the embedding size comes from its file: a `dimensions` it
    cannot give is a 400 at once, and nothing is loaded or embedded for it."""
    shutil.copy(model_path, tmp_path / "other.gguf")
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path) as server:
        async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
            ollama_too_wide = await http.post(
                "/api/embed", json={"model": "other", "input": "hi", "dimensions": 577}
            )
            assert ollama_too_wide.status_code == 400 and "576" in ollama_too_wide.json()["error"]
            openai_other = {"model": "other", "input": "hi", "dimensions": 100}
            refused = await http.post("/v1/embeddings", json=openai_other)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
            assert server.models.state("other") == "unloaded"
            shortened = await http.post("/api/embed", json={"model": "other", "input": "hi", "dimensions": 8})
            assert shortened.status_code == 200 and len(shortened.json()["embeddings"][0]) == 8


async def test_the_wait_for_a_model_to_load_is_its_load_duration(
    llama_model: LlamaModel, server_config: ServerConfig, model_path: Path, tmp_path: Path
) -> None:
    """Ollama's ``load_duration``: the time a request waited for its model to load (it was 0
    even for the request that loaded it), within its ``total_duration``; 0 once loaded."""
    shutil.copy(model_path, tmp_path / "other.gguf")
    async with running_server(llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path) as server:
        api = ollama.AsyncClient(host=str(server.http_url))
        embedded = await api.embed(model="other", input="hello")
        assert embedded.load_duration is not None and embedded.total_duration is not None
        assert 0 < embedded.load_duration <= embedded.total_duration
        said = [{"role": "user", "content": "Hi"}]
        warm = await api.chat(model="other", messages=said, options={"num_predict": 2})
        assert warm.load_duration == 0 and warm.total_duration
        assert server.models.state("other") == "loaded"
        await api.generate(model="other", keep_alive=0)  # unloaded when idle
        with trio.fail_after(30):
            while server.models.state("other") != "unloaded":
                await trio.sleep(0.05)
        cold = await api.chat(model="other", messages=said, options={"num_predict": 2}, stream=True)
        last = [chunk async for chunk in cold][-1]
        assert last.done and last.load_duration is not None and last.total_duration is not None
        assert 0 < last.load_duration <= last.total_duration
        assert last.prompt_eval_duration is not None and last.prompt_eval_duration > 0
        # /api/embed's load call (no input) waits for the load too: it said 0 (HTTP.md says not).
        await api.generate(model="other", keep_alive=0)
        with trio.fail_after(30):
            while server.models.state("other") != "unloaded":
                await trio.sleep(0.05)
        loaded = await api.embed(model="other", input=[])
        assert loaded.embeddings == [] and server.models.state("other") == "loaded"
        assert loaded.load_duration is not None and loaded.total_duration is not None
        assert 0 < loaded.load_duration <= loaded.total_duration
