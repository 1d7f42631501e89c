"""Structured output (issue 20, point 3): JSON schemas, JSON objects and grammars constrain
what the real model generates, through the openai SDK, raw HTTP and the socket."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import msgspec
import numpy as np
import pydantic
import pytest
import trio

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.engine.constraints import ConstraintError, grammar_constraint, json_schema_constraint
from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.sampling import SamplingParams
from uma_trio.runtime.server import Server

from .conftest import openai_sdk
from .helpers import draw_until_end, grammar_accepts

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
UMA = [sys.executable, "-m", "uma_trio"]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. You answer in JSON."}


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
    name: Annotated[str, pydantic.Field(max_length=24)]
    country: Annotated[str, pydantic.Field(max_length=24)]
    population_millions: Annotated[int, pydantic.Field(ge=0, le=100)]
    kind: Literal["capital", "other"]


def ask(question: str) -> list[Any]:
    return [SYSTEM, {"role": "user", "content": question}]


def test_random_logits_under_a_schema_still_give_valid_json(llama_model: LlamaModel) -> None:
    """Whatever the model would say, the mask keeps every draw inside the schema: random
    logits, sampled at temperature 1, always assemble to an instance of it."""
    schema = City.model_json_schema()
    rng = np.random.default_rng(7)
    for seed in range(5):
        sampler = llama_model.vocabulary.sampler(
            SamplingParams(temperature=1.0, seed=seed), json_schema_constraint(schema)
        )
        text = draw_until_end(llama_model, sampler, rng, limit=400, scale=4)
        City.model_validate_json(text)  # raises if the draw left the schema


def test_a_grammar_limits_the_choice_and_ends_the_generation(llama_model: LlamaModel) -> None:
    sampler = llama_model.vocabulary.sampler(
        SamplingParams(temperature=0.0), grammar_constraint('root ::= "yes" | "no"')
    )
    allowed = sampler.allowed()
    words = {llama_model.piece(t) for t in np.flatnonzero(allowed).tolist()}
    assert words and all(b"yes".startswith(w) or b"no".startswith(w) for w in words)
    logits = np.zeros(llama_model.n_vocab, dtype=np.float32)
    logits[llama_model.tokenize("no", add_bos=False)[0]] = 5.0
    first = sampler.sample(logits)
    assert llama_model.piece(first) in (b"no", b"n")
    while not llama_model.is_eog(token := sampler.sample(np.zeros(llama_model.n_vocab, dtype=np.float32))):
        first = token
    assert sampler.matcher.is_accepting()


@pytest.mark.parametrize(
    ("make", "text", "problem"),
    [
        (json_schema_constraint, {"type": "object", "properties": {"a": {"type": "frob"}}}, "frob"),
        (grammar_constraint, 'root ::= "a" missing_rule', "missing_rule"),
        (grammar_constraint, "start: ( ", "grammar"),
    ],
)
def test_an_invalid_schema_or_grammar_names_the_problem(
    llama_model: LlamaModel, make: Any, text: Any, problem: str
) -> None:
    with pytest.raises(ConstraintError, match=problem):
        llama_model.vocabulary.sampler(SamplingParams(), make(text))


async def test_openai_sdk_parse_returns_a_validated_object(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        reply = await client.chat.completions.parse(
            model=MODEL,
            messages=ask("Describe Paris as JSON."),
            response_format=City,
            temperature=0,
            max_tokens=96,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        assert choice.message.parsed.name  # the model filled it in


async def test_json_object_and_streamed_schema_over_http(keyed_http_server: Server) -> None:
    async with openai_sdk(keyed_http_server) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=ask("List three fruits as a JSON object."), temperature=0, max_tokens=96,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
        stream = await client.chat.completions.create(
            model=MODEL, messages=ask("Describe Rome."), temperature=0.7, seed=3, max_tokens=96,
            response_format=schema, stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        City.model_validate_json(text)
        # /v1/completions takes it too, and llama-server's `grammar` and `json_schema` fields.
        done = await client.completions.create(
            model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
            extra_body={"grammar": 'root ::= " yes" | " no"'},
        )  # fmt: skip
        assert done.choices[0].text in (" yes", " no")
        done = await client.completions.create(
            model=MODEL, prompt="A number:", max_tokens=16, temperature=0,
            extra_body={"json_schema": {"type": "integer", "minimum": 0, "maximum": 999}},
        )  # fmt: skip
        assert 0 <= int(done.choices[0].text) <= 999


TOOL = {"type": "function", "function": {"name": "noop"}}
FROB = {"schema": {"type": "frob"}}
BAD_REGEX = {"schema": {"type": "string", "pattern": "(["}}
BROKEN = {"name": "broken"}
BROKEN_TOOL = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/nope"}},
}}}  # fmt: skip


async def test_bad_schemas_and_grammars_are_400s_naming_the_problem(keyed_http_server: Server) -> None:
    async with httpx.AsyncClient(
        base_url=f"{keyed_http_server.http_url}/v1", headers={"Authorization": "Bearer k"}, timeout=60
    ) as http:
        # param: the field at fault (a schema or grammar that does not compile: it was null).
        cases: list[tuple[dict[str, Any], str, str]] = [
            (
                {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
                "frob", "response_format",
            ),
            ({"grammar": 'root ::= "a" nowhere'}, "nowhere", "grammar"),
            ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
            (
                {"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
                "not both", "response_format",
            ),
            ({"json_schema": {"type": "integer"}, "grammar": 'root ::= "a"'}, "json_schema", "json_schema"),
            # With tools, the format's fault is named as the format's, a tool's as its own
            # field (it read "/$defs/uma_tool_0/nope" and quoted the grammar built for it).
            (
                {"tools": [TOOL], "response_format": {"type": "json_schema", "json_schema": FROB}},
                "frob", "response_format",
            ),
            (
                {"tools": [TOOL, BROKEN_TOOL], "tool_choice": {"type": "function", "function": BROKEN}},
                "`tools[1].function.parameters`: Pointer '/nope' does not exist", "tools",
            ),
            (  # the whole of the compiler's message, as without tools (it was cut to a line)
                {"tools": [TOOL], "response_format": {"type": "json_schema", "json_schema": BAD_REGEX}},
                "unclosed character class", "response_format",
            ),
        ]  # fmt: skip
        for extra, problem, param in cases:
            answer = await http.post(
                "/chat/completions", json={"model": MODEL, "messages": ask("hi"), **extra}
            )
            assert answer.status_code == 400, answer.text
            assert problem in answer.json()["error"]["message"], answer.text
            assert answer.json()["error"]["param"] == param, answer.text
            assert answer.json()["error"]["code"] is not None, answer.text  # json_schema + grammar: null
            assert "uma_tool" not in answer.text and "x-guidance" not in answer.text
        answer = await http.post(
            "/chat/completions", json={"model": MODEL, "messages": ask("hi"), "max_tokens": 2}
        )
        assert answer.status_code == 200  # nothing lost for the next request


async def test_the_socket_protocol_takes_response_format_and_grammar(server: Server) -> None:
    async with UmaClient.connect(server.config.socket_path) as client:
        done = await client.complete(
            messages=ask("Describe Paris."), temperature=0, max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"schema": City.model_json_schema()}},
        )  # fmt: skip
        City.model_validate_json(done.text)
        done = await client.complete(prompt="Colour:", grammar='start: " red" | " green"', max_tokens=8)
        assert done.text in (" red", " green")
        with pytest.raises(RequestFailed) as failed:
            await client.complete(prompt="x", grammar="root ::= (", max_tokens=4)
        assert failed.value.event.code == "E_GRAMMAR_001" and "grammar" in failed.value.event.message


def chain_grammar(rules: int) -> str:
    """A GBNF grammar of ``rules`` rules, each naming the next: llguidance recurses a level
    per rule when it compiles one."""
    return "root ::= r1\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1, rules)) + f'r{rules} ::= "x"\n'


async def test_a_deep_grammar_is_served_or_refused_and_never_kills_the_daemon(server: Server) -> None:
    """A 4,000-rule chain (62 KB) overflowed the worker thread's stack inside llguidance and
    the daemon died of SIGSEGV; past MAX_GBNF_RULES a grammar is refused by name."""
    async with UmaClient.connect(server.config.socket_path) as client:
        done = await client.complete(prompt="x", grammar=chain_grammar(4000), max_tokens=4)
        assert done.text == "x"
        with pytest.raises(RequestFailed) as failed:
            await client.complete(prompt="x", grammar=chain_grammar(5000), max_tokens=4)
        assert failed.value.event.code == "E_GRAMMAR_001" and "rules" in failed.value.event.message
        free = await client.complete(prompt="The capital of France is", max_tokens=2, temperature=0)
        assert free.eos.reason == "length"


async def test_a_grammar_is_compiled_off_the_event_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GBNF's conversion ran on the event loop: a 228 KB grammar froze every stream for 24 s.
    Then on a thread, holding the GIL beside the decode; now in a process of its own, and
    the compile of its Lark on a thread."""
    import threading

    from uma_trio.runtime import samplers

    threads: list[tuple[str, bool]] = []

    def recorded(text: str, lark: str | None = None) -> Any:
        threads.append((threading.current_thread().name, lark is not None))
        return grammar_constraint(text, lark)

    monkeypatch.setattr(samplers, "grammar_constraint", recorded)
    async with UmaClient.connect(server.config.socket_path) as client:
        done = await client.complete(prompt="Colour:", grammar='root ::= " red" | " green"', max_tokens=4)
    assert done.text in (" red", " green") and threads
    assert all(name != threading.main_thread().name and converted for name, converted in threads), threads


async def test_a_slow_grammar_s_conversion_ends_with_its_client_and_has_a_time_limit(
    keyed_http_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: two clients sent 4,000-rule GBNF grammars (within the limits) and hung up;
    their conversions ran on for two minutes holding both compile threads, and a JSON
    request of anyone else waited 126-153 s for its 5 tokens.  The conversion's process is
    now killed with its request, and one that runs past the limit is refused."""
    from uma_trio.runtime import gbnf_convert

    from .helpers import slow_grammar

    def converters() -> int:
        found = 0
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):  # a process gone meanwhile
                found += b"gbnf_worker" in cmdline.read_bytes()
        return found

    url = f"{keyed_http_server.http_url}/v1/chat/completions"
    key = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(headers=key, timeout=60) as http:
        for k in range(2):  # each hangs up while its grammar converts
            body = {
                "model": MODEL,
                "messages": ask("x"),
                "max_tokens": 5,
                "grammar": slow_grammar() + f"# {k}",
            }
            with trio.move_on_after(1.5):
                await http.post(url, json=body)
        with trio.fail_after(5):
            while converters():  # killed with its request
                await trio.sleep(0.05)
        started = trio.current_time()
        body = {
            "model": MODEL,
            "messages": ask("hi"),
            "max_tokens": 5,
            "response_format": {"type": "json_object"},
        }
        answer = await http.post(url, json=body)
        assert answer.status_code == 200 and trio.current_time() - started < 20, answer.text
        monkeypatch.setattr(gbnf_convert, "CONVERT_LIMIT_S", 0.5)
        body = {"model": MODEL, "messages": ask("x"), "max_tokens": 5, "grammar": slow_grammar()}
        answer = await http.post(url, json=body)
        assert answer.status_code == 400, answer.text
        assert "took over 0.5 s to convert from GBNF" in answer.json()["error"]["message"], answer.text
        assert answer.json()["error"]["param"] == "grammar", answer.text
    snapshot = keyed_http_server.metrics_snapshot()
    assert snapshot["cancels"].get("disconnect", 0) >= 2, snapshot["cancels"]  # the hang-ups count


def test_a_schema_nested_too_deeply_is_refused_by_name() -> None:
    """json.dumps raised RecursionError (not a ValueError): the connection dropped unanswered."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ConstraintError, match="nested too deeply"):
        json_schema_constraint(schema)


async def test_the_cli_sends_a_schema_or_a_grammar(server: Server, tmp_path: Path) -> None:
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(City.model_json_schema()))
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    sock = str(server.config.socket_path)
    base = [
        *UMA,
        "generate",
        "--prompt",
        "Describe Paris.",
        "--temp",
        "0",
        "--max-tokens",
        "96",
        "--socket",
        sock,
    ]
    done = await trio.run_process([*base, "--json-schema", str(schema)], capture_stdout=True, check=False)
    assert done.returncode == 0
    City.model_validate_json(done.stdout)
    done = await trio.run_process([*base, "--grammar", str(grammar)], capture_stdout=True, check=False)
    assert done.returncode == 0 and done.stdout.decode().strip() in ("yes", "no")
    done = await trio.run_process(
        [*base, "--grammar", str(tmp_path / "missing.gbnf")], capture_stderr=True, check=False
    )
    assert done.returncode == 1 and "missing.gbnf" in done.stderr.decode()
    grammar.write_text("root ::= (")
    done = await trio.run_process([*base, "--grammar", str(grammar)], capture_stderr=True, check=False)
    assert done.returncode == 2 and "E_GRAMMAR_001" in done.stderr.decode()


def test_strict_closes_every_whole_object_and_leaves_composed_ones_working() -> None:
    """Closed where an object names all its keys (nested, in definitions, each branch of a
    union); left as it is where closing would forbid what another part brings (an allOf base,
    an allOf member, branches beside a node's own properties): a first version closed those
    too, and schemas that worked matched nothing."""
    from uma_trio.protocol.strict_schema import closed

    def strict_takes(schema: dict[str, Any], text: str) -> bool:
        return grammar_accepts(json_schema_constraint(closed(schema)).grammar, text)

    plain = {"type": "object", "properties": {"k": {"type": "string"}, "in": {"type": "object",
             "properties": {"q": {"type": "integer"}}}}, "required": ["k"]}  # fmt: skip
    assert strict_takes(plain, '{"k": "x", "in": {"q": 1}}')
    assert not strict_takes(plain, '{"k": "x", "s": "y"}') and not strict_takes(
        plain, '{"k": "x", "in": {"z": 1}}'
    )
    assert grammar_accepts(json_schema_constraint(plain).grammar, '{"k": "x", "s": "y"}')  # not strict: open
    a = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
    union = {"type": "object", "anyOf": [a, b]}
    assert strict_takes(union, '{"a": 1}') and not strict_takes(union, '{"a": 1, "z": 2}')
    base_def = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    base = {
        "type": "object", "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"extra": {"type": "string"}},
        "required": ["extra"], "$defs": {"Base": base_def},
    }  # fmt: skip
    assert strict_takes(base, '{"id": 1, "extra": "x"}')
    assert strict_takes({"type": "object", "allOf": [a, b]}, '{"a": 1, "b": 2}')
    beside = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "anyOf": [b]}
    assert strict_takes(beside, '{"x": 1, "b": 2}')
    said = {"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": True}
    assert strict_takes(said, '{"k": "x", "s": "y"}')  # the schema's own word is kept
    assert "additionalProperties" not in plain  # the request's own schema is left as it was


async def test_a_strict_schema_gives_no_key_it_does_not_name(server: Server) -> None:
    """strict: true was read and ignored: with additionalProperties left open the model could
    add keys, the same one again too, and the answer ran to max_tokens as invalid JSON."""
    schema = {
        "type": "object",
        "properties": {"k": {"const": "x"}, "b": {"type": "boolean"}},
        "required": ["k", "b"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    async with UmaClient.connect(server.config.socket_path) as client:
        for seed in range(3):
            done = await client.complete(
                messages=ask("Give me an example with many keys."), response_format=fmt, max_tokens=60,
                temperature=1.5, seed=seed,
            )  # fmt: skip
            assert done.eos.reason == "stop", done.text
            assert set(json.loads(done.text)) == {"k", "b"}, done.text


def test_a_schema_that_is_not_strict_is_closed_as_llama_cpp_closes_it() -> None:
    """Not strict, an object that lists its properties takes no other key (llama.cpp's converter,
    so llama-server's `json_schema` and Ollama's `format`; vLLM's xgrammar alike); a bare
    `{"type": "object"}` and one that says `additionalProperties` keep what they say."""
    from uma_trio.protocol.messages import GenerateRequest
    from uma_trio.runtime.samplers import format_schema

    def takes(schema: dict[str, Any], text: str, strict: bool | None = None) -> bool:
        spec: dict[str, Any] = {"schema": schema} if strict is None else {"schema": schema, "strict": strict}
        request = GenerateRequest(
            id="x", prompt="p", response_format={"type": "json_schema", "json_schema": spec}
        )  # type: ignore[arg-type]
        request = msgspec.convert(msgspec.to_builtins(request), GenerateRequest)
        return grammar_accepts(json_schema_constraint(format_schema(request)).grammar, text)

    listed = {"type": "object", "properties": {"a": {"type": "integer"}, "in": {"type": "object",
              "properties": {"q": {"type": "integer"}}}}, "required": ["a"]}  # fmt: skip
    assert takes(listed, '{"a": 1, "in": {"q": 2}}')
    assert not takes(listed, '{"a": 1, "b": 2}') and not takes(listed, '{"a": 1, "in": {"z": 2}}')
    assert takes({"type": "object"}, '{"b": 2}') and not takes({"type": "object"}, '{"b": 2}', strict=True)
    assert takes({**listed, "additionalProperties": True}, '{"a": 1, "b": 2}')
    assert takes({**listed, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": "x"}')
    assert "additionalProperties" not in listed  # the request's own schema is left as it was
