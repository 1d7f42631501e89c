"""Infill for editors (issue 20, point 5): the fill-in-the-middle prompt, ``suffix`` on
/v1/completions and llama-server's ``/infill``.  The default model has no FIM tokens (a clear
400 for it); the tests give a copy of it FIM token ids in its metadata (gguf's
``copy_with_new_metadata``): its weights were not trained for infill, so these tests check
the mechanics, not the code it writes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.infill import FimTokens, NoFimTokens, infill_tokens
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .conftest import API_KEY, openai_sdk, running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Control tokens of SmolLM2's vocabulary, standing in for FIM tokens.
FIM = FimTokens(pre=8, suf=9, mid=10, rep=4, sep=5)


def words(text: str) -> list[int]:
    return [100 + len(w) for w in text.split()]


def test_the_prompt_is_laid_out_as_llama_server_lays_it_out() -> None:
    assert infill_tokens(FIM, words, "def f(", "):\n", bos=1).tolist() == [
        1,
        8,
        *words("def f("),
        9,
        *words("):\n"),
        10,
    ]
    with_files = infill_tokens(FIM, words, "a", "b", [("x.py", "import y")], middle="c").tolist()
    assert with_files == [
        4, *words("project\n"), 5, *words("x.py\nimport y"), 5,
        8, *words("a"), 9, *words("b"), 10, *words("c"),
    ]  # fmt: skip
    no_files_tokens = FimTokens(pre=8, suf=9, mid=10)
    assert infill_tokens(no_files_tokens, words, "a", "b", [("x.py", "z")]).tolist()[:3] == [
        8,
        *words("z\na"),
    ]
    with pytest.raises(NoFimTokens, match="fill-in-the-middle"):
        infill_tokens(None, words, "a", "b")


def test_an_infill_past_its_budget_loses_other_files_first_then_the_ends_of_its_texts() -> None:
    """As llama-server cuts an infill: the oldest files first, then the prefix's start and the
    suffix's end; the FIM tokens and the middle never.  (It was laid out whole and refused.)"""
    files = [("a.py", "one two three"), ("b.py", "four five"), ("c.py", "six")]
    whole = infill_tokens(FIM, words, "p1 p2 p3 p4", "s1 s2", files, middle="m").tolist()
    assert (
        infill_tokens(FIM, words, "p1 p2 p3 p4", "s1 s2", files, middle="m", budget=len(whole)).tolist()
        == whole
    )
    # One token short: the first file goes (its separator and three words), nothing else.
    cut = infill_tokens(FIM, words, "p1 p2 p3 p4", "s1 s2", files, middle="m", budget=len(whole) - 1).tolist()
    assert cut == [4, *words("project\n"), 5, *words("b.py\nfour five"), 5, *words("c.py\nsix"), 5,
                   8, *words("p1 p2 p3 p4"), 9, *words("s1 s2"), 10, *words("m")]  # fmt: skip
    # Room for the FIM tokens, the middle and four words: no files, the prefix's end (three
    # quarters of the room) and the suffix's start.
    four = infill_tokens(FIM, words, "p1 p2 p3 p4", "s1 s2", files, middle="m", budget=4 + 4).tolist()
    assert four == [8, *words("p2 p3 p4"), 9, *words("s1"), 10, *words("m")]
    # A long suffix keeps at least a quarter of the room.
    long_suffix = infill_tokens(FIM, words, "p " * 20, "s " * 20, budget=3 + 8).tolist()
    assert long_suffix == [8, *words("p " * 6), 9, *words("s " * 2), 10]
    # The FIM tokens and the middle alone past the budget: as it was, to be refused.
    assert len(infill_tokens(FIM, words, "p", "s", middle="m1 m2 m3", budget=4)) == 3 + 2 + 3


@pytest.fixture(scope="module")
def fim_model_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    target = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    reader = gguf.GGUFReader(model_path)
    writer = gguf.GGUFWriter(target, arch="llama", endianess=reader.endianess)
    uint32 = gguf.GGUFValueType.UINT32
    keys = gguf.Keys.Tokenizer
    ids = {keys.FIM_PRE_ID: FIM.pre, keys.FIM_SUF_ID: FIM.suf, keys.FIM_MID_ID: FIM.mid,
           keys.FIM_REP_ID: FIM.rep, keys.FIM_SEP_ID: FIM.sep}  # fmt: skip
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(uint32, v) for k, v in ids.items()}, [])
    yield target


@pytest.fixture(scope="module")
def fim_model(fim_model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(fim_model_path)
    yield model
    model.close()


@pytest.mark.model
def test_a_model_with_fim_tokens_gets_the_prompt(fim_model: LlamaModel) -> None:
    assert fim_model.fim == FIM
    tokens = fim_model.tokenize_infill("x = <issue_start>", " + 1\n", [("a.py", "y = 2")]).tolist()
    assert (
        tokens.count(FIM.pre) == tokens.count(FIM.suf) == tokens.count(FIM.mid) == 1
    )  # typed text stays text
    assert tokens.index(FIM.pre) < tokens.index(FIM.suf) < len(tokens) - 1 and tokens[-1] == FIM.mid
    assert tokens[0] == FIM.rep  # SmolLM2's tokenizer adds no BOS


@pytest.fixture
async def fim_server(fim_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(fim_model, server_config, http="127.0.0.1:0", api_key=API_KEY) as server:
        yield server


def http(server: Server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=str(server.http_url), headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.model
async def test_infill_over_http_whole_and_streamed(fim_server: Server, fim_model: LlamaModel) -> None:
    body: dict[str, Any] = {
        "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 8, "temperature": 0,
        "input_extra": [{"filename": "util.py", "text": "X = 1"}],
    }  # fmt: skip
    async with http(fim_server) as client:
        whole = await client.post("/infill", json=body)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["stop"] is True and answer["stop_type"] in ("eos", "limit")
        expected = fim_model.tokenize_infill(body["input_prefix"], "\n", [("util.py", "X = 1")])
        assert answer["tokens_evaluated"] == len(expected) and answer["tokens_predicted"] <= 8
        chunks = []
        async with client.stream("POST", "/infill", json={**body, "stream": True}) as streamed:
            async for line in streamed.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
        assert chunks[-1]["stop"] is True and all(c["stop"] is False for c in chunks[:-1])
        assert "".join(c["content"] for c in chunks) == answer["content"]  # greedy: the same text
        bad = await client.post("/infill", json={**body, "n_predict": "many"})
        assert bad.status_code == 400 and "n_predict" in bad.text
    async with openai_sdk(fim_server) as sdk:
        done = await sdk.completions.create(
            model="smollm2-fim", prompt=body["input_prefix"], suffix="\n", max_tokens=8, temperature=0
        )
        assert done.usage is not None and done.usage.prompt_tokens == len(
            fim_model.tokenize_infill(body["input_prefix"], "\n")
        )


async def test_logit_bias_in_llama_server_s_forms_is_honoured(
    fim_server: Server, fim_model: LlamaModel
) -> None:
    """`logit_bias` was dropped with the unknown fields, junk and all: every form answered as if
    none were given.  llama-server's forms: `{"id": bias}` and `[[id, bias]]`, `false` banning."""
    body: dict[str, Any] = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
                            "n_predict": 6, "temperature": 0}  # fmt: skip
    async with http(fim_server) as client:
        first = (await client.post("/infill", json=body)).json()["content"]
        token = fim_model.tokenize(first, add_bos=False, special=False).tolist()[0]
        for bias in ({str(token): -100}, [[token, -100]], [[token, False]]):
            answer = await client.post("/infill", json={**body, "logit_bias": bias})
            assert answer.status_code == 200 and answer.json()["content"] != first, (bias, answer.text)
        for junk in ("junk", [[token]], [["return", -1]], [[1.5, 1]], {"abc": 1}):
            answer = await client.post("/infill", json={**body, "logit_bias": junk})
            assert answer.status_code == 400 and "logit_bias" in answer.text, (junk, answer.text)


@pytest.mark.model
async def test_a_model_without_fim_tokens_is_a_clear_error(keyed_http_server: Server) -> None:
    async with http(keyed_http_server) as client:
        refused = await client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert refused.status_code == 400 and "fill-in-the-middle" in refused.json()["error"]["message"]
        # An editor's warm-up (n_predict 0) was a 200 here: it must learn the model cannot infill.
        for warm_up in ({"n_predict": 0}, {"n_predict": 0, "stream": True}):
            refused = await client.post("/infill", json={"input_prefix": "a", **warm_up})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "E_MODEL_001"
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "suffix": "b"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "E_MODEL_001"
    async with UmaClient.connect(keyed_http_server.config.socket_path) as socket_client:
        with pytest.raises(RequestFailed) as failed:
            await socket_client.complete(prompt="a", suffix="b", max_tokens=4)
        assert failed.value.event.code == "E_MODEL_001"
        with pytest.raises(RequestFailed) as failed:
            await socket_client.complete(
                messages=[{"role": "user", "content": "a"}], suffix="b", max_tokens=4
            )
        assert failed.value.event.code == "E_PROTO_002" and "suffix" in failed.value.event.message


@pytest.mark.model
async def test_n_predict_past_the_limits_is_cut_to_them(
    fim_model: LlamaModel, server_config: ServerConfig
) -> None:
    """As llama-server caps n_predict to what fits: --max-tokens, then the context's room."""
    body: dict[str, Any] = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n"}
    async with (
        running_server(fim_model, server_config, http="127.0.0.1:0", api_key=API_KEY, max_tokens=6) as server,
        http(server) as client,
    ):
        answer = await client.post("/infill", json={**body, "n_predict": 99999, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens_predicted"] <= 6
    async with (
        running_server(fim_model, server_config, http="127.0.0.1:0", api_key=API_KEY, n_ctx=256) as server,
        http(server) as client,
    ):
        assert server.loop.engine.n_ctx_seq == 256 and server.config.max_tokens > 1000
        answer = await client.post("/infill", json={**body, "n_predict": 1000, "stop": ["\n"]})
        assert answer.status_code == 200, answer.text  # prompt + n_predict > the context: cut


@pytest.mark.model
async def test_a_stream_cut_short_ends_with_an_error(fim_server: Server) -> None:
    """A stall or a shutdown cancels the request: the editor is told, as chat's stream tells."""
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 400}
    body["stream"] = True
    chunks = []
    async with http(fim_server) as client, client.stream("POST", "/infill", json=body) as streamed:
        fim_server.loop.cancel_all("stalled")
        async for line in streamed.aiter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert chunks and "error" in chunks[-1], chunks[-3:]
    assert "cancelled (stalled)" in chunks[-1]["error"]["message"]
    assert all(c["stop"] is False for c in chunks[:-1])


@pytest.mark.model
async def test_an_editor_s_context_past_the_model_s_is_cut_not_refused(
    fim_model: LlamaModel, server_config: ServerConfig
) -> None:
    """llama.vim sends the files it saw lately (its ring of chunks) with each completion: past
    the context they made every completion a 400 here, where llama-server cuts them.  Now cut:
    oldest files first, then the prefix's start; /v1/completions (OpenAI's API never cuts) and
    Ollama's ``truncate: false`` still refuse."""
    chunk = "def helper_{0}(value):\n    return value * {0} + offset_{0}\n" * 4
    extra = [{"filename": f"mod{i}.py", "text": chunk.format(i)} for i in range(12)]
    prefix = "import os\n" + "x = compute(1, 2, 3)\n" * 300
    body: dict[str, Any] = {"input_prefix": prefix, "input_suffix": "\n", "input_extra": extra,
                            "n_predict": 8, "temperature": 0}  # fmt: skip
    n_ctx = 512  # a small context: quick to fill on two cores
    files = [(f["filename"], f["text"]) for f in extra]
    assert len(fim_model.tokenize_infill(prefix, "\n", files)) > 4 * n_ctx  # far past the context
    async with (
        running_server(fim_model, server_config, http="127.0.0.1:0", api_key=API_KEY, n_ctx=n_ctx) as server,
        http(server) as client,
    ):
        assert server.loop.engine.n_ctx_seq == n_ctx
        client.timeout = httpx.Timeout(120.0)
        answer = await client.post("/infill", json=body)
        assert answer.status_code == 200, answer.text
        evaluated = answer.json()["tokens_evaluated"]
        assert evaluated == len(fim_model.tokenize_infill(prefix, "\n", files, budget=n_ctx - 8))
        assert n_ctx - 8 - 50 < evaluated <= n_ctx - 8  # the context filled, room left for the answer
        # Files alone past the context: the newest ones kept, the prefix whole.
        short = {**body, "input_prefix": "x = "}
        answer = await client.post("/infill", json=short)
        assert answer.status_code == 200, answer.text
        kept = fim_model.tokenize_infill("x = ", "\n", files, budget=n_ctx - 8).tolist()
        assert answer.json()["tokens_evaluated"] == len(kept)
        assert 2 < kept.count(FIM.sep) - 1 < len(files)  # some files kept, the oldest dropped

        def has_file(name: str, text: str) -> bool:
            file = fim_model.tokenize(f"{name}\n{text}", add_bos=False, special=False).tolist()
            return any(kept[i : i + len(file)] == file for i in range(len(kept)))

        assert has_file(*files[-1]) and not has_file(*files[0])
        refused = await client.post(
            "/v1/completions",
            json={"model": "smollm2-fim", "prompt": prefix, "suffix": "\n", "max_tokens": 8},
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        ollama = await client.post(
            "/api/generate",
            json={"model": "smollm2-fim", "prompt": prefix, "suffix": "\n", "stream": False,
                  "options": {"num_predict": 4, "temperature": 0}},
        )  # fmt: skip
        assert ollama.status_code == 200, ollama.text
        assert ollama.json()["prompt_eval_count"] <= n_ctx - 4
        no_cut = await client.post(
            "/api/generate",
            json={"model": "smollm2-fim", "prompt": prefix, "suffix": "\n", "stream": False,
                  "truncate": False, "options": {"num_predict": 4}},
        )  # fmt: skip
        assert no_cut.status_code == 400, no_cut.text
