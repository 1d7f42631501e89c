"""Embeddings (issue 21, point 4): the engine pools hidden states across a prompt's chunks,
the decode loop runs embedding requests beside generation, and the official ``openai`` and
``ollama`` clients get them from ``/v1/embeddings``, ``/api/embed`` and ``/api/embeddings``."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest
import trio

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.base import BatchEntry
from uma_trio.engine.llama import ContextConfig, LlamaEngine, LlamaModel
from uma_trio.engine.pooling import EmbeddingPool, PooledPart, pool_rows, pooling_mode
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.runtime.server import Server

from .conftest import running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest. " * 3


# -- pooling, pure ---------------------------------------------------------------------


def test_the_gguf_pooling_type_picks_how_tokens_pool() -> None:
    modes = [pooling_mode(t) for t in (None, 0, 1, 2, 3, 4)]
    assert modes == ["mean", "mean", "mean", "first", "last", "mean"]


def test_a_pool_folds_chunks_as_the_whole_input_would() -> None:
    rows = np.arange(24, dtype=np.float32).reshape(6, 4)
    for mode, expected in (("mean", rows.mean(axis=0)), ("first", rows[0]), ("last", rows[-1])):
        pool = EmbeddingPool()
        for start, stop in ((0, 2), (2, 5), (5, 6)):
            if (part := pool_rows(0, mode, rows[start:stop], start)) is not None:  # type: ignore[arg-type]
                pool.add(part)
        assert np.allclose(pool.result(normalize=False), expected), mode
        unit = np.asarray(pool.result(normalize=True))
        assert np.isclose(np.linalg.norm(unit), 1.0)
        assert np.allclose(unit, expected / np.linalg.norm(expected))
    with pytest.raises(ValueError):
        EmbeddingPool().result(normalize=True)
    assert pool_rows(0, "first", rows[2:4], 2) is None  # only the chunk at position 0 has the first token
    assert PooledPart(0, "mean", rows.sum(axis=0, dtype=np.float64), 6).rows == 6


def test_an_embed_request_takes_a_prompt_and_nothing_that_generates() -> None:
    assert GenerateRequest(id="e", prompt="hi", embed=True).embed
    chat = [{"role": "user", "content": "hi"}]
    bad: dict[str, Any]
    for bad in ({"messages": chat}, {"prompt": ""}, {"prompt": "a", "grammar": "x"}):
        with pytest.raises(ValueError):
            GenerateRequest(id="e", embed=True, **bad)


# -- the engine, on the real model ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(llama_model: LlamaModel) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(llama_model, ContextConfig(n_ctx_seq=512, n_seq_max=4))
    yield engine
    engine.close()


def embed(engine: LlamaEngine, tokens: np.ndarray, chunks: list[int], seq_id: int = 0) -> np.ndarray:
    pool, pos = EmbeddingPool(), 0
    for size in chunks:
        result = engine.step_sync([BatchEntry(seq_id, tokens[pos : pos + size], pos, None, embed=True)])
        assert [p.seq_id for p in result.pooled] == [seq_id] and not result.sampled
        for part in result.pooled:
            pool.add(part)
        pos += size
    engine.free_seq(seq_id)
    return np.asarray(pool.result(normalize=True))


@pytest.mark.model
def test_an_input_chunked_over_steps_embeds_as_in_one(engine: LlamaEngine, llama_model: LlamaModel) -> None:
    tokens = llama_model.tokenize(TEXT)
    whole = embed(engine, tokens, [len(tokens)])
    chunked = embed(engine, tokens, [7, 20, len(tokens) - 27], seq_id=1)
    assert whole.shape == (llama_model.n_embd,) and np.isclose(np.linalg.norm(whole), 1.0)
    assert float(whole @ chunked) > 0.9999
    other = embed(engine, llama_model.tokenize("Stock markets fell sharply on Tuesday."), [4, 100])
    assert float(whole @ other) < 0.99  # another text, another vector


@pytest.mark.model
def test_a_tick_with_an_embedding_samples_the_same_token(
    engine: LlamaEngine, llama_model: LlamaModel
) -> None:
    prompt, greedy = llama_model.tokenize("The capital of France is"), Sampler(SamplingParams(temperature=0))
    alone = engine.step_sync([BatchEntry(2, prompt, 0, greedy)]).sampled
    engine.free_seq(2)
    tokens = llama_model.tokenize(TEXT)
    mixed = engine.step_sync([BatchEntry(3, tokens, 0, None, embed=True), BatchEntry(2, prompt, 0, greedy)])
    assert [s.token_id for s in mixed.sampled] == [s.token_id for s in alone] and len(mixed.pooled) == 1
    # The next plain step is a generation step again (the context left embedding mode).
    after = engine.step_sync([BatchEntry(2, np.array([alone[0].token_id], np.int32), len(prompt), greedy)])
    assert len(after.sampled) == 1 and not after.pooled
    engine.free_seq(2)
    engine.free_seq(3)


# -- the daemon and its clients ------------------------------------------------------------


@pytest.fixture
async def open_server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", n_ctx=512) as server:
        yield server


def sdk(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


@pytest.mark.model
async def test_the_openai_sdk_embeds_one_text_and_a_list(open_server: Server) -> None:
    api = sdk(open_server)
    one = await api.embeddings.create(model=MODEL, input=TEXT)  # the SDK asks for base64 and decodes it
    vector = np.asarray(one.data[0].embedding)
    assert vector.shape == (576,) and np.isclose(np.linalg.norm(vector), 1.0, atol=1e-5)
    assert one.usage.prompt_tokens > 10 and one.model == MODEL
    texts = [TEXT, "Paris is the capital of France.", TEXT]
    many = await api.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    vectors = np.asarray([d.embedding for d in many.data])
    assert vectors[0] @ vector > 0.9999 and vectors[2] @ vector > 0.9999 and vectors[1] @ vector < 0.99
    middle = len(open_server.engine.tokenize(texts[1]))
    assert many.usage.prompt_tokens == 2 * one.usage.prompt_tokens + middle
    # Every token's hidden state is needed: an embedding never starts from a cached prefix.
    assert open_server.loop.kv.stats.hits == 0
    # The socket's own embed request gives the same vector.
    async with UmaClient.connect(open_server.config.socket_path) as client:
        done = await client.complete(prompt=TEXT, embed=True, stream=False)
    assert done.eos.embedding is not None and np.asarray(done.eos.embedding) @ vector > 0.9999
    assert done.eos.usage.completion_tokens == 0


@pytest.mark.model
async def test_bad_embedding_requests_are_refused_by_name(open_server: Server) -> None:
    api = sdk(open_server)
    cases = [
        ({"input": TEXT, "dimensions": 64}, "dimensions"),
        ({"input": [[1, 2, 3]]}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": TEXT * 12}, "input"),  # longer than a sequence's context (512 cells here)
        ({"input": ["ok", TEXT * 12]}, "input[1]"),  # which one, in a list
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.embeddings.create(model=MODEL, **fields)  # type: ignore[arg-type]
        assert refused.value.param == param, fields
        if fields["input"] == [[1, 2, 3]]:  # LangChain's default: its user is told the way out
            assert "check_embedding_ctx_length=False" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as an_object:  # it said "token ids are not accepted"
        await api.embeddings.create(model=MODEL, input=[{"text": "x"}])  # type: ignore[list-item]
    assert "must be a string, not an object" in str(an_object.value) and an_object.value.param == "input"
    with pytest.raises(openai.NotFoundError):
        await api.embeddings.create(model="text-embedding-3-small", input=TEXT)
    # Ollama's truncate (its default) cuts the same input to fit instead.
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        cut = (await http.post("/api/embed", json={"model": MODEL, "input": TEXT * 12})).json()
        assert len(cut["embeddings"][0]) == 576 and cut["prompt_eval_count"] == open_server.engine.n_ctx_seq
        kept = await http.post("/api/embed", json={"model": MODEL, "input": TEXT * 12, "truncate": False})
        assert kept.status_code == 400 and "truncate" in kept.json()["error"]
        for path, field in (("/api/embed", "input"), ("/api/embeddings", "prompt")):  # was a 200
            odd = await http.post(path, json={"model": MODEL, field: "x", "options": "bad"})
            assert odd.status_code == 400 and "options" in odd.json()["error"], odd.text
        # More text than the prompt limit's tokens could hold was refused before it was cut.
        huge = "hello world. " * (
            open_server.config.max_prompt_tokens * open_server.engine.max_token_bytes // 13 + 9
        )
        cut = (await http.post("/api/embed", json={"model": MODEL, "input": huge})).json()
        assert len(cut["embeddings"][0]) == 576 and cut["prompt_eval_count"] == open_server.engine.n_ctx_seq


@pytest.mark.model
async def test_the_ollama_client_embeds(open_server: Server) -> None:
    api = ollama.AsyncClient(host=str(open_server.http_url))
    answer = await api.embed(model=MODEL, input=[TEXT, "Paris is the capital of France."])
    vectors = np.asarray(answer.embeddings)
    assert vectors.shape == (2, 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert answer.prompt_eval_count and answer.total_duration
    legacy = await api.embeddings(model=MODEL, prompt=TEXT)  # the older endpoint: not normalized
    raw = np.asarray(legacy.embedding)
    assert not np.isclose(np.linalg.norm(raw), 1.0) and raw @ vectors[0] / np.linalg.norm(raw) > 0.9999
    assert (await api.embed(model=MODEL, input=[])).embeddings == []  # how Ollama's clients load a model
    with pytest.raises(ollama.ResponseError) as missing:
        await api.embed(model="nomic-embed-text", input="x")
    assert missing.value.status_code == 404


@pytest.mark.model
async def test_embeddings_run_in_the_background_beside_a_chat(open_server: Server) -> None:
    """A RAG indexer's embeddings take the background lane while a chat streams; both finish
    and the chat's answer is the one it gives alone."""
    api = sdk(open_server)
    ask: Any = [{"role": "user", "content": "What is the capital of France?"}]
    alone = await api.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=24)
    vectors: list[list[float]] = []
    answers: list[str] = []

    async def index() -> None:
        many = await api.embeddings.create(model=MODEL, input=[f"{TEXT} {i}" for i in range(12)])
        vectors.extend(d.embedding for d in many.data)

    async def chat() -> None:
        await trio.sleep(0.05)
        mixed = await api.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=24)
        answers.append(mixed.choices[0].message.content or "")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(index)
        nursery.start_soon(chat)
    assert len(vectors) == 12 and answers == [alone.choices[0].message.content]
    snap = open_server.metrics_snapshot()
    assert snap["requests"]["background"].get("embedded", 0) >= 12  # counted apart from generations
    assert snap["tokens"]["prompt"]["background"] > 0
    assert open_server.loop.kv_cells_used == 0  # nothing left running, no cells held


@pytest.mark.model
async def test_a_client_that_hangs_up_cancels_its_inputs(open_server: Server) -> None:
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        with trio.move_on_after(0.5) as gave_up:
            await http.post("/v1/embeddings", json={"model": MODEL, "input": [TEXT * 4] * 64})
    assert gave_up.cancelled_caught
    with trio.fail_after(10):
        await open_server.loop.wait_idle()
    assert open_server.metrics_snapshot()["cancels"].get("disconnect", 0) >= 1
    assert open_server.loop.kv_cells_used == 0
    async with UmaClient.connect(open_server.config.socket_path) as client:  # a bad one, on the socket
        with pytest.raises(RequestFailed) as refused:
            await client.complete(embed=True, messages=[{"role": "user", "content": "x"}])
    assert "embed" in refused.value.event.message
    raw = base64.b64decode(
        (
            await sdk(open_server).embeddings.with_raw_response.create(
                model=MODEL, input="hi", encoding_format="base64"
            )
        ).http_response.json()["data"][0]["embedding"]
    )
    assert len(raw) == 4 * 576


@pytest.mark.model
async def test_encoding_format_null_is_float(open_server: Server) -> None:
    async with httpx.AsyncClient(base_url=str(open_server.http_url)) as http:
        body = {"model": MODEL, "input": "hi", "encoding_format": None}
        answer = await http.post("/v1/embeddings", json=body)
    assert answer.status_code == 200, answer.text
    vector = answer.json()["data"][0]["embedding"]
    assert isinstance(vector, list) and len(vector) == 576


@pytest.mark.model
async def test_a_batch_refused_for_room_cancels_its_admitted_inputs_for_the_client(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Mixed-load review: a batch some of whose inputs were admitted before the queue was full
    answered its 429, and the admitted inputs were counted as cancelled by a client hang-up
    (`cancels.disconnect`), though the client was waiting for that 429."""
    async with (
        running_server(llama_model, server_config, http="127.0.0.1:0", max_sessions=4, max_queue=2) as server,
        UmaClient.connect(server.config.socket_path) as client,
    ):
        story = [{"role": "user", "content": "Write a long story about a dragon."}]

        async def hold(k: int) -> None:
            async with client.stream(id=f"hold{k}", messages=story, max_tokens=200) as events:
                async for _ in events:
                    pass

        async with trio.open_nursery() as nursery:
            for k in range(5):
                nursery.start_soon(hold, k)
            await trio.sleep(1.0)
            async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
                # Long inputs: one admitted is still being read, beside the streams, when a
                # later one is refused (short ones ended first on a loaded machine).
                refused = await http.post("/v1/embeddings", json={"model": MODEL, "input": [TEXT * 7] * 6})
            with trio.move_on_after(20):  # the loop counts the admitted inputs' cancels
                while not (snapshot := server.metrics_snapshot())["cancels"]:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "E_LIMIT_004", refused.text
    assert snapshot["errors"].get("E_LIMIT_004") == 1, snapshot["errors"]
    # An input was admitted (one place was left) and ended for the client, not as a hang-up.
    assert snapshot["cancels"] == {"client": snapshot["requests"]["background"]["cancelled"]}, snapshot
    assert snapshot["cancels"]["client"] >= 1
