"""Review 17, the HTTP gateway: llama.vim's ``input_extra`` chunks and ``n_predict`` 0 / -1 on
``/infill``; ``GET /v1/models/{model}``; a tool answer cut off before its first call is whole
shows no JSON; a negative ``seed``; CORS headers on the origin check's 415; ``param`` of an
out-of-vocabulary ``logit_bias``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from uma_trio.protocol.llama_server import InfillBody, infill_request, n_predict
from uma_trio.protocol.openai import daemon_seed
from uma_trio.protocol.tool_text import ToolTextFilter, parse_tool_calls
from uma_trio.runtime.server import Server

from .conftest import API_KEY, openai_sdk
from .test_http_hardening import gateway_on_sim
from .test_infill import fim_model, fim_model_path, fim_server  # noqa: F401 (fixtures)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
VIM_CHUNK = {"text": "X = 1\n", "time": 1732712345.5, "filename": "util.py"}  # llama.vim's ring chunk


# -- 1, 2. /infill ---------------------------------------------------------------------------


def test_input_extra_keeps_what_the_daemon_reads() -> None:
    body = InfillBody(input_prefix="a", input_suffix="b", input_extra=[VIM_CHUNK, {"text": "y"}])
    request = infill_request(body, "r", 512)
    assert [(f.filename, f.text) for f in request.input_extra or ()] == [("util.py", "X = 1\n"), ("", "y")]


@pytest.mark.parametrize(
    ("given", "expected"), [({}, 4096), ({"n_predict": -1}, 4096), ({"n_predict": 7}, 7)]
)
def test_n_predict_minus_one_or_unset_is_up_to_max_tokens(given: dict[str, Any], expected: int) -> None:
    body = InfillBody(input_prefix="a", input_suffix="b", **given)
    assert infill_request(body, "r", 4096).max_tokens == expected
    assert n_predict(body) == (None if expected == 4096 else expected)
    assert n_predict(InfillBody(n_predict=0)) == 0


def http(server: Server) -> httpx.AsyncClient:
    # httpx's default 5 s is a timing assertion on real-model work: a busy machine's prefill
    # of the infill context took longer (the answer is what is checked here).
    return httpx.AsyncClient(
        base_url=str(server.http_url), headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )


@pytest.mark.model
async def test_infill_takes_llama_vim_chunks_and_n_predict_zero_generates_nothing(
    fim_server: Server,  # noqa: F811 (the fixture imported above)
) -> None:
    body: dict[str, Any] = {
        "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "temperature": 0,
        "input_extra": [VIM_CHUNK],
    }  # fmt: skip
    async with http(fim_server) as client:
        answered = await client.post("/infill", json={**body, "n_predict": 4})
        assert answered.status_code == 200, answered.text
        assert 1 <= answered.json()["tokens_predicted"] <= 4
        generated = dict(fim_server.metrics.tokens_generated)
        nothing = await client.post("/infill", json={**body, "n_predict": 0})
        assert nothing.status_code == 200, nothing.text
        answer = nothing.json()
        assert answer["content"] == "" and answer["tokens_predicted"] == 0 and answer["stop_type"] == "limit"
        streamed = await client.post("/infill", json={**body, "n_predict": 0, "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert [(c["content"], c["stop"]) for c in chunks] == [("", True)]
        assert fim_server.metrics.tokens_generated == generated  # nothing ran
        # Checked as a request that generates would be (a bad field was a 200 with n_predict 0).
        bad = await client.post("/infill", json={**body, "n_predict": 0, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text


# -- 3. GET /v1/models/{model} ---------------------------------------------------------------


@pytest.mark.model
async def test_the_sdk_retrieves_a_model_by_id_or_file_name(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        for name in (MODEL, f"{MODEL}.gguf"):
            model = await client.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (MODEL, "model", "uma-trio")
            assert model.created > 0
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("no-such-model")
        assert missing.value.code == "model_not_found"


# -- 4. a tool answer cut off before its first call is whole ---------------------------------

CUT = '{"tool_calls": [{"name": "get_weath'


def test_a_cut_generic_call_is_no_content_whole_or_streamed() -> None:
    assert parse_tool_calls(CUT, "generic", ["get_weather"]) == ("", [])
    assert parse_tool_calls('{"tool_calls": [', "generic", ["get_weather"]) == ("", [])
    text_filter = ToolTextFilter("generic")
    assert [text_filter.feed(piece) for piece in ('{"tool_calls"', ': [{"name": "', "get_weath")] == [
        "",
        "",
        "",
    ]
    assert text_filter.rest("") == ""


@pytest.mark.model
async def test_a_call_cut_by_max_tokens_leaks_no_json(keyed_http_server: Server) -> None:
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fields: dict[str, Any] = dict(
        model=MODEL, max_tokens=6, temperature=0, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": city}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )  # fmt: skip
    async with openai_sdk(keyed_http_server) as client:
        whole = await client.chat.completions.create(**fields)
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert not choice.message.content
        streamed = [
            c.delta.content
            async for chunk in await client.chat.completions.create(**fields, stream=True)
            for c in chunk.choices
            if c.delta.content
        ]
        assert streamed == []


# -- 5. seed -----------------------------------------------------------------------------------


def test_openai_seeds_map_into_the_daemon_s_range() -> None:
    assert daemon_seed(None) is None and daemon_seed(-1) is None
    assert daemon_seed(-2) == 2**63 - 2 and daemon_seed(-(2**63)) == 0 and daemon_seed(5) == 5


@pytest.mark.model
async def test_negative_seeds_are_taken(keyed_http_server: Server) -> None:
    fields: dict[str, Any] = dict(model=MODEL, max_tokens=8, temperature=1.0,
                                  messages=[{"role": "user", "content": "Tell me a word."}])  # fmt: skip
    async with openai_sdk(keyed_http_server) as client:
        assert (await client.chat.completions.create(**fields, seed=-1)).choices
        texts = [(await client.chat.completions.create(**fields, seed=-7)).choices[0].message.content]
        texts.append((await client.chat.completions.create(**fields, seed=-7)).choices[0].message.content)
        assert texts[0] == texts[1]  # another negative seed is still a seed


# -- 6. CORS headers on the origin check's 415 --------------------------------------------------


async def test_an_allowed_origin_can_read_the_415() -> None:
    body = b'{"model": "sim", "prompt": "a", "max_tokens": 2}'
    async with gateway_on_sim() as (_, _, url), httpx.AsyncClient(base_url=url) as client:
        local = {"origin": "http://localhost:5173", "content-type": "text/plain"}
        refused = await client.post("/v1/completions", content=body, headers=local)
        assert refused.status_code == 415
        assert refused.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "origin" in refused.headers["vary"].lower()
        evil = await client.post(
            "/v1/completions", content=body, headers={**local, "origin": "http://evil.example"}
        )
        assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
        tool = await client.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
        assert tool.status_code == 415 and "access-control-allow-origin" not in tool.headers


# -- 7. logit_bias outside the vocabulary ----------------------------------------------------


@pytest.mark.model
async def test_a_logit_bias_outside_the_vocabulary_names_its_param(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL, max_tokens=2, logit_bias={"99999999": 5},
                messages=[{"role": "user", "content": "hi"}],
            )  # fmt: skip
        assert refused.value.param == "logit_bias" and "vocabulary" in refused.value.message
