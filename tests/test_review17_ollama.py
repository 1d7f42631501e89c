"""Review 17, the Ollama routes: num_predict is a ceiling, keep_alive's edge values, the
client's embed load call, an empty suffix, Ollama's ``dimensions`` and whole-float integer
options, through the official ``ollama`` client (or raw JSON where the client cannot send it)
against the gateway on the default model."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol import ollama as protocol
from uma_trio.protocol.ollama_durations import keep_alive_seconds
from uma_trio.protocol.openai_errors import ApiError
from uma_trio.runtime.server import Server

from .conftest import running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
N_CTX, MAX_TOKENS = 128, 16  # small, so that a cut shows in a few tokens
STORY = "Write a long story about a dragon."
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
async def open_server(
    llama_model: LlamaModel, server_config: ServerConfig, model_path: Path, tmp_path: Path
) -> AsyncIterator[Server]:
    """The gateway without a key, a small context and --max-tokens, and a second model of the
    store (a copy of the default one) to load and unload."""
    shutil.copyfile(model_path, tmp_path / "second.gguf")
    limits = {"n_ctx": N_CTX, "max_tokens": MAX_TOKENS}
    async with running_server(
        llama_model, server_config, http="127.0.0.1:0", models_dir=tmp_path, **limits
    ) as server:
        yield server


def client(server: Server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=str(server.http_url))


async def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
        return await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def background_requests(server: Server) -> int:
    return sum(server.metrics_snapshot()["requests"].get("background", {}).values())


# -- pure ------------------------------------------------------------------------------


def test_keep_alive_refuses_an_overflowing_integer_and_an_empty_duration() -> None:
    for bad in (10**400, -(10**400), "", "  "):
        with pytest.raises(ApiError) as refused:
            keep_alive_seconds(bad)
        assert refused.value.status == 400 and refused.value.param == "keep_alive", bad


def test_num_predict_is_cut_to_the_limits_and_the_context() -> None:
    limits = protocol.Limits(max_tokens=2048, context=4096)
    bounds = protocol.answer_bounds(protocol.Options(num_predict=4096.0), limits)
    assert bounds == {"max_tokens": 2048, "max_context": 4096}
    capped = protocol.answer_bounds(protocol.Options(num_predict=100, num_ctx=8192), limits)
    assert capped == {"max_tokens": 100, "max_context": 4096}
    assert protocol.answer_bounds(protocol.Options(num_ctx=512), limits) == {"max_context": 512}
    assert protocol.answer_bounds(protocol.Options(num_predict=-1), limits) == {}


# -- on the daemon -------------------------------------------------------------------------


@pytest.mark.model
async def test_num_predict_past_max_tokens_or_the_context_is_cut_not_refused(open_server: Server) -> None:
    api, greedy = client(open_server), {"temperature": 0, "num_predict": 4096}
    told = await api.generate(model=MODEL, prompt=STORY, options=greedy)
    assert told.done_reason == "length" and told.eval_count == MAX_TOKENS
    chat = await api.chat(model=MODEL, messages=[{"role": "user", "content": STORY}], options=greedy)
    assert chat.done_reason == "length" and chat.eval_count == MAX_TOKENS
    # A prompt that leaves less room than num_predict: the answer fills the context.
    long_prompt = " ".join([TEXT] * 12)
    for num_predict in (MAX_TOKENS, 4096):
        cut = await api.generate(
            model=MODEL, prompt=long_prompt, raw=True, options={"temperature": 0, "num_predict": num_predict}
        )
        assert cut.prompt_eval_count is not None and N_CTX - MAX_TOKENS < cut.prompt_eval_count < N_CTX
        assert cut.done_reason == "length" and cut.eval_count == N_CTX - cut.prompt_eval_count


@pytest.mark.model
async def test_keep_alive_too_large_or_empty_is_a_400_naming_it(open_server: Server) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    generate = {"model": MODEL, "prompt": "hi", "stream": False}
    for body in (chat, generate):
        for keep_alive in (10**400, "", "  "):
            path = "/api/chat" if "messages" in body else "/api/generate"
            answer = await post(open_server, path, {**body, "keep_alive": keep_alive})
            assert answer.status_code == 400, (path, keep_alive, answer.text)
            error = answer.json()["error"]  # Ollama's shape, not OpenAI's
            assert isinstance(error, str) and "keep_alive" in error
    unload = await post(open_server, "/api/chat", {"model": "second", "messages": [], "keep_alive": ""})
    assert unload.status_code == 400


@pytest.mark.model
async def test_the_clients_embed_call_without_input_loads_and_keep_alive_counts(open_server: Server) -> None:
    api, models = client(open_server), open_server.models
    assert (await api.embed(model=MODEL)).embeddings == []  # the client sends input ""
    assert (await api.embed(model="second")).embeddings == [] and models.state("second") == "loaded"
    assert (await api.embed(model="second", keep_alive=0)).embeddings == []
    assert models.state("second") == "unloaded"
    # With input: the request's keep_alive is the model's, as on /api/chat.
    vectors = await api.embed(model="second", input=TEXT, keep_alive="1s")
    assert len(vectors.embeddings[0]) == 576 and models.state("second") == "loaded"
    with trio.fail_after(10):
        while models.state("second") == "loaded":
            await trio.sleep(0.1)
    assert (await api.embeddings(model="second", prompt="")).embedding == []  # the older endpoint loads too
    assert models.state("second") == "loaded"
    refused = await post(open_server, "/api/embed", {"model": MODEL, "input": [""]})  # in a list: still empty
    assert refused.status_code == 400


@pytest.mark.model
async def test_an_empty_suffix_is_no_infill(open_server: Server) -> None:
    answer = await client(open_server).generate(
        model=MODEL, prompt="Hi", suffix="", options={"temperature": 0, "num_predict": 4}
    )
    assert answer.done and answer.eval_count


@pytest.mark.model
async def test_dimensions_shorten_and_too_many_are_refused_before_any_work(open_server: Server) -> None:
    api = client(open_server)
    full = np.asarray((await api.embed(model=MODEL, input=TEXT)).embeddings[0])
    unset = await post(open_server, "/api/embed", {"model": MODEL, "input": TEXT, "dimensions": 0})
    assert unset.status_code == 200 and np.allclose(unset.json()["embeddings"][0], full)
    short = np.asarray((await api.embed(model=MODEL, input=[TEXT, TEXT], dimensions=64)).embeddings)
    assert short.shape == (2, 64) and np.allclose(np.linalg.norm(short, axis=1), 1.0)
    assert np.allclose(short[0], full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    ran = background_requests(open_server)
    cases = [
        ("/api/embed", {"model": MODEL, "input": [TEXT] * 4, "dimensions": 577}),
        ("/api/embed", {"model": MODEL, "input": TEXT, "dimensions": -1}),
        # OpenAI's: the model's own size only.
        ("/v1/embeddings", {"model": MODEL, "input": [TEXT] * 4, "dimensions": 64}),
    ]
    for path, body in cases:
        refused = await post(open_server, path, body)
        assert refused.status_code == 400 and "dimensions" in refused.text, (path, body)
    assert background_requests(open_server) == ran  # refused before any input ran


@pytest.mark.model
async def test_integer_options_take_whole_floats(open_server: Server) -> None:
    body = {"model": MODEL, "prompt": STORY, "stream": False}
    options = {"num_predict": 4.0, "top_k": 40.0, "temperature": 0}
    whole = await post(open_server, "/api/generate", {**body, "options": options})
    assert whole.status_code == 200 and whole.json()["eval_count"] == 4
    half = await post(open_server, "/api/generate", {**body, "options": {"num_predict": 4.5}})
    assert half.status_code == 400 and "num_predict" in half.json()["error"]
