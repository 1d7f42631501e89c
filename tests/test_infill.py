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
