"""Other model families' GGUFs, as users bring them (the chat-templates review, 2026-11-29):
copies of the default model with another family's chat template and special tokens written
into its metadata (gguf's ``copy_with_new_metadata``).  Its weights stay SmolLM2's, so these
tests check the mechanics (prompts, grammars, the reading of calls), not what a Qwen or a
Mistral would answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from uma_trio.config import ServerConfig
from uma_trio.engine.chat_template import ChatTemplateError, JinjaChatTemplate
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.protocol.tool_text import ToolTextFilter, parse_tool_calls
from uma_trio.protocol.tool_turns import nine_character_ids
from uma_trio.runtime.tool_use import chat_turns

from .conftest import openai_sdk, running_server
from .test_tool_calls import ASK, NAMES, TIME, WEATHER

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types, as GGUF writes them


def family_copy(
    source: Path, target: Path, template: str, renames: dict[int, tuple[str, int]],
    named: dict[str, str] | None = None,
) -> Path:  # fmt: skip
    """The default model with ``template`` and its tokens ``renames`` (id: text, type), and
    the templates ``named`` (``tool_use``: tokenizer.chat_template.tool_use)."""
    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(source)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    for token, (text, kind) in renames.items():
        tokens[token], types[token] = text, kind
    value, keys = gguf.GGUFValueType, gguf.Keys.Tokenizer
    metadata = {
        keys.LIST: MetadataDetails(value.ARRAY, tokens, sub_type=value.STRING),
        keys.TOKEN_TYPE: MetadataDetails(value.ARRAY, types, sub_type=value.INT32),
        keys.CHAT_TEMPLATE: MetadataDetails(value.STRING, template),
    }
    for name, text in (named or {}).items():
        metadata[f"{keys.CHAT_TEMPLATE}.{name}"] = MetadataDetails(value.STRING, text)
    writer = gguf.GGUFWriter(target, arch="llama", endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, metadata, [])
    return target


@contextmanager
def loaded(path: Path) -> Iterator[LlamaModel]:
    """The model at ``path``, closed after."""
    model = LlamaModel(path)
    try:
        yield model
    finally:
        model.close()


# Qwen's call markers, user-defined tokens in its vocabulary (ids of the default model's reused).
QWEN_CALL_TOKENS = {3: ("<tool_call>", USER_DEFINED), 4: ("</tool_call>", USER_DEFINED)}


async def forced_call(client: openai.AsyncOpenAI, model: str, choice: Any) -> Any:
    """A chat asking for the weather with the tool call forced by ``choice``: it answers with a
    call of an offered tool whose arguments are JSON."""
    reply = await client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,  # type: ignore[arg-type,list-item]
        temperature=0, max_tokens=80,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls, reply
    assert calls[0].function.name in NAMES
    json.loads(calls[0].function.arguments)
    return reply


@pytest.fixture(scope="module")
def qwen_like(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    """Qwen 2.5's template, and its <tool_call> markers as the user-defined tokens they are in
    Qwen's vocabulary."""
    path = family_copy(
        model_path, tmp_path_factory.mktemp("qwen") / "qwen-tools.gguf",
        (TEMPLATES / "qwen2.5-instruct.jinja").read_text(),
        QWEN_CALL_TOKENS,
    )  # fmt: skip
    with loaded(path) as model:
        yield model


# Hermes 3's default template: ChatML, no tools (those are in its tool_use template); its
# {{bos_token}} left out, which in SmolLM2's vocabulary is <|im_start|>.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_like(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    """Hermes 3's two templates: ChatML by default, and the one named ``tool_use``."""
    path = family_copy(
        model_path, tmp_path_factory.mktemp("hermes") / "hermes-tools.gguf", CHATML, {},
        {"tool_use": (TEMPLATES / "hermes-3-llama-3.1-tool_use.jinja").read_text()},
    )  # fmt: skip
    with loaded(path) as model:
        yield model


@pytest.fixture(scope="module")
def mistral_like(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    """Mistral Nemo's template, and [TOOL_CALLS] as the control token it is in its vocabulary
    (written as no text)."""
    path = family_copy(
        model_path, tmp_path_factory.mktemp("mistral") / "nemo-tools.gguf",
        (TEMPLATES / "mistral-nemo-instruct-2407.jinja").read_text(), {6: ("[TOOL_CALLS]", CONTROL)},
    )  # fmt: skip
    with loaded(path) as model:
        yield model


@pytest.mark.model
async def test_a_forced_call_on_a_model_whose_markers_are_special_tokens(
    qwen_like: LlamaModel, server_config: ServerConfig
) -> None:
    """The grammar spelled <tool_call> as text, which the tokenizer turns into Qwen's special
    token, whose bytes the grammar then refused: every forced call was a 500 ("the grammar
    refused token 3").  It names the token now."""
    assert qwen_like.vocabulary.special_token("<tool_call>") == 3
    assert qwen_like.vocabulary.special_token("<|im_end|>") == 2  # a control token
    assert qwen_like.vocabulary.special_token("hello") is None
    async with running_server(qwen_like, server_config, http="127.0.0.1:0", api_key="k") as server:
        async with openai_sdk(server) as client:
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                await forced_call(client, "qwen-tools", choice)


@pytest.mark.model
async def test_a_mistral_tool_loop_streams_its_call_and_takes_its_result_back(
    mistral_like: LlamaModel, server_config: ServerConfig
) -> None:
    """Streamed, the call came as content too ([TOOL_CALLS] is written as no text, and the
    stream only held back text after it); its result sent back was a 400 (Mistral's template
    wants nine-character ids, and ours were OpenAI's ``call_`` and 24 more)."""
    async with running_server(mistral_like, server_config, http="127.0.0.1:0", api_key="k") as server:
        async with openai_sdk(server) as client:
            ask: Any = dict(model="nemo-tools", tools=[WEATHER, TIME], tool_choice="required",
                            temperature=0, max_tokens=80)  # fmt: skip
            stream = await client.chat.completions.create(messages=ASK, stream=True, **ask)
            content, names, arguments, call_id = "", "", "", ""
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    call_id = call.id or call_id
                    names += call.function.name or "" if call.function else ""
                    arguments += call.function.arguments or "" if call.function else ""
            assert content == "" and names in NAMES, (content, names)
            history = [
                *ASK,
                {"role": "assistant", "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": names, "arguments": arguments}}
                ]},
                {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
            ]  # fmt: skip
            assert len(call_id) > 9
            answer = await client.chat.completions.create(
                messages=history, **{**ask, "tool_choice": "none", "max_tokens": 8}
            )
            assert answer.choices[0].message.content is not None


@pytest.fixture(scope="module")
def qwen3_coder_like(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    """Qwen3-Coder's template (XML calls, as Qwen 3.5's), its <tool_call> markers user-defined
    tokens as in Qwen's vocabulary."""
    path = family_copy(
        model_path, tmp_path_factory.mktemp("qwen3coder") / "qwen3-coder-tools.gguf",
        (TEMPLATES / "qwen3-coder.jinja").read_text(),
        QWEN_CALL_TOKENS,
    )  # fmt: skip
    with loaded(path) as model:
        yield model


@pytest.mark.model
async def test_a_qwen3_coder_tool_loop_calls_in_xml_and_renders_its_history(
    qwen3_coder_like: LlamaModel, server_config: ServerConfig
) -> None:
    """Qwen3-Coder's (and Qwen 3.5's) calls are XML inside <tool_call>: they were read as
    Hermes' JSON, so every call such a model wrote came back as text, and a forced call was
    written in JSON against its own template's format.  Now a forced call is written in
    XML, read back as a call with JSON arguments (streamed the same), and the history with
    the call and its result renders as Qwen3-Coder's template writes it."""
    async with running_server(qwen3_coder_like, server_config, http="127.0.0.1:0", api_key="k") as server:
        async with openai_sdk(server) as client:
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                reply = await forced_call(client, "qwen3-coder-tools", choice)
            call = reply.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) <= {
                "city",
                "unit",
            }
            ask: Any = dict(model="qwen3-coder-tools", tools=[WEATHER, TIME], tool_choice="required",
                            temperature=0, max_tokens=80)  # fmt: skip
            stream = await client.chat.completions.create(messages=ASK, stream=True, **ask)
            content, streamed = "", ""
            async for chunk in stream:
                content += chunk.choices[0].delta.content or ""
                for part in chunk.choices[0].delta.tool_calls or ():
                    streamed += part.function.arguments or "" if part.function else ""
            assert content == "" and json.loads(streamed), (content, streamed)
            history = [
                *ASK,
                {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
            ]  # fmt: skip
            answer = await client.chat.completions.create(
                messages=history, **{**ask, "tool_choice": "none", "max_tokens": 8}
            )
            assert answer.choices[0].message.content is not None
    request = msgspec.convert({"id": "r", "messages": history, "tools": [WEATHER]}, GenerateRequest)
    turns, tools = chat_turns(request, "xml", None)
    rendered = qwen3_coder_like.apply_chat_template(turns, tools)
    assert "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n" in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered


def taught_to_call_in_xml() -> list[dict[str, str]]:
    """A chat whose history teaches the model to answer with a Qwen3-Coder call of
    ``get_weather`` (two answers of the XML block), then asks again."""

    def said(city: str) -> str:
        return (
            "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            f"{city}\n</parameter>\n</function>\n</tool_call>"
        )

    messages: list[dict[str, str]] = []
    for city in ("Rome", "Oslo"):
        messages += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": said(city)},
        ]
    return [*messages, {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.model
async def test_a_qwen3_coder_call_written_freely_is_a_call_in_every_api(
    qwen3_coder_like: LlamaModel, server_config: ServerConfig
) -> None:
    """With ``tool_choice`` auto the model writes its call itself, in XML: it came back as the
    answer's text, so an agent on Qwen3-Coder or Qwen 3.5 never saw a call.  It is a call now,
    whole and streamed, on OpenAI's chat API and on Anthropic's (Claude Code's)."""
    messages = taught_to_call_in_xml()
    async with running_server(qwen3_coder_like, server_config, http="127.0.0.1:0", api_key="k") as server:
        async with openai_sdk(server) as client:
            fields: Any = dict(model="qwen3-coder-tools", messages=messages, tools=[WEATHER], temperature=0,
                               max_tokens=60)  # fmt: skip
            whole = await client.chat.completions.create(**fields)
            message = whole.choices[0].message
            assert message.tool_calls and whole.choices[0].finish_reason == "tool_calls", message
            assert message.tool_calls[0].function.name == "get_weather"
            assert json.loads(message.tool_calls[0].function.arguments)["city"]
            assert message.content == "Let me check."
            content, arguments = "", ""
            async for chunk in await client.chat.completions.create(**fields, stream=True):
                content += chunk.choices[0].delta.content or ""
                for part in chunk.choices[0].delta.tool_calls or ():
                    arguments += part.function.arguments or "" if part.function else ""
            assert (content, arguments) == (message.content, message.tool_calls[0].function.arguments)
        function = WEATHER["function"]
        claude = anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key="k", max_retries=0)
        said = await claude.messages.create(
            model="qwen3-coder-tools", messages=messages, max_tokens=60,  # type: ignore[arg-type]
            tools=[{"name": function["name"], "input_schema": function["parameters"]}],  # type: ignore[index]
            extra_body={"temperature": 0},
        )  # fmt: skip
        assert said.stop_reason == "tool_use" and [b.type for b in said.content] == ["text", "tool_use"]


def test_tool_call_ids_become_nine_characters_alike_in_call_and_result() -> None:
    turns = [
        {"role": "assistant", "tool_calls": [{"id": "call_0123456789abcdef01234567", "function": {}},
                                             {"id": "abcDEF123", "function": {}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "x"},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "y"},
    ]  # fmt: skip
    out = nine_character_ids(turns)
    first, kept = (c["id"] for c in out[0]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and kept == "abcDEF123"
    assert [out[1]["tool_call_id"], out[2]["tool_call_id"]] == [first, kept]
    assert turns[1]["tool_call_id"].startswith("call_")  # the request's own turns unchanged


def test_a_template_refusing_a_system_message_gets_it_in_the_first_user_message() -> None:
    """Gemma's template raises "System role not supported": every agent's request was a 400,
    where llama-server and Ollama put the system text before the first user message."""
    gemma = JinjaChatTemplate((TEMPLATES / "gemma-2-2b-it.jinja").read_text(), bos_token="<bos>")
    rendered = gemma.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):  # another refusal stands
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_hf_template_extensions_render() -> None:
    """``{% generation %}`` (HF's training-mask tag: GLM, LFM2.5, Laguna) did not compile, and
    ``tojson(ensure_ascii=...)`` (GLM-4.6, MiniMax, Kimi) was a TypeError."""
    template = JinjaChatTemplate(
        "{% for m in messages %}{% generation %}{{ m.content | tojson(ensure_ascii=False) }}"
        "{% endgeneration %}{{ m.content | tojson(ensure_ascii=True) }}{% endfor %}"
    )
    assert template.render([{"role": "user", "content": "é"}]) == '"é""\\u00e9"'


def test_a_tool_is_given_to_the_template_without_strict_unless_set() -> None:
    request = msgspec.convert({"id": "r", "messages": ASK, "tools": [WEATHER]}, GenerateRequest)
    _, tools = chat_turns(request, "hermes")
    assert tools is not None and "strict" not in tools[0]["function"]
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    request = msgspec.convert({"id": "r", "messages": ASK, "tools": [strict]}, GenerateRequest)
    _, tools = chat_turns(request, "hermes")
    assert tools is not None and tools[0]["function"]["strict"] is True


@pytest.mark.parametrize("marker", ["", "[TOOL_CALLS]"])
def test_a_streamed_mistral_call_is_held_back_with_or_without_its_marker_s_text(marker: str) -> None:
    """[TOOL_CALLS] is a control token, written as no text: the filter waited for the marker
    and streamed the bare JSON list as content (OpenAI, Ollama and Anthropic streams alike)."""
    pieces = [marker, '[{"', "name", '": "', "get", "_weather", '", "arguments": {"city": "Rome"}}]']
    held = ToolTextFilter("mistral")
    assert "".join(held.feed(piece) for piece in pieces) == ""
    text = "".join(pieces)
    content, calls = parse_tool_calls(text, "mistral", NAMES)
    assert [c.name for c in calls] == ["get_weather"] and held.rest(content) == ""
    prose = ToolTextFilter("mistral")  # text that is no call still streams as it comes
    assert prose.feed("Sunny ") + prose.feed("today") == "Sunny today"


def test_a_template_that_renders_calls_itself_gets_the_history_as_it_is() -> None:
    """MiniMax-M2's (and gpt-oss's) calls are read in the generic format, and their history was
    rewritten for it: the calls into the assistant's text, while the results kept their
    `tool` role, which these templates refuse without a call before it ("Message has tool
    role, but there was no previous assistant message with a tool call!"): every second turn
    of a tool loop was a 400.  Such a template renders the calls itself, as llama.cpp lets it."""
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    request = msgspec.convert({"id": "r", "messages": history, "tools": [WEATHER]}, GenerateRequest)
    turns, tools = chat_turns(request, "generic", None)
    minimax = JinjaChatTemplate((TEMPLATES / "minimax-m2.jinja").read_text())
    rendered = minimax.render(turns, tools=tools)
    assert "get_weather" in rendered and "sunny, 21 C" in rendered


@pytest.mark.model
async def test_thinking_controls_reach_the_template(model_path: Path, server_config: ServerConfig) -> None:
    """`chat_template_kwargs` (llama-server's and vLLM's) and Ollama's `think: false` were
    accepted and dropped: Qwen 3 was never told not to think (HF's prompt has the empty
    `<think>` block its template writes for `enable_thinking: false`)."""
    model = LlamaModel(model_path)
    try:
        model.use_chat_template((TEMPLATES / "qwen3.jinja").read_text())
        chat = [{"role": "user", "content": "Hi"}]
        plain = model.tokenize_chat(chat)
        quiet = model.tokenize_chat(chat, None, {"enable_thinking": False})
        assert "<think>\n\n</think>" in model.apply_chat_template(chat, None, {"enable_thinking": False})
        assert "<think>" not in model.apply_chat_template(chat) and len(quiet) > len(plain)
        async with (
            running_server(model, server_config, http="127.0.0.1:0", api_key="k") as server,
            openai_sdk(server) as client,
        ):
            counts = []
            for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
                reply = await client.chat.completions.create(
                    model="SmolLM2-135M-Instruct.Q4_1", messages=chat, max_tokens=1,  # type: ignore[arg-type]
                    extra_body=extra,
                )  # fmt: skip
                assert reply.usage is not None
                counts.append(reply.usage.prompt_tokens)
            assert counts == [len(plain), len(quiet)]
            async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
                answer = await http.post("/api/chat", headers={"Authorization": "Bearer k"}, json={
                    "model": "SmolLM2-135M-Instruct.Q4_1", "messages": chat, "stream": False, "think": False,
                    "options": {"num_predict": 1},
                })  # fmt: skip
                assert answer.status_code == 200 and answer.json()["prompt_eval_count"] == len(quiet)
            with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
                await client.chat.completions.create(
                    model="SmolLM2-135M-Instruct.Q4_1", messages=chat, max_tokens=1,  # type: ignore[arg-type]
                    extra_body={"chat_template_kwargs": {"messages": []}},
                )  # fmt: skip
    finally:
        model.close()


def test_template_args_are_checked() -> None:
    chat = [{"role": "user", "content": "Hi"}]
    with pytest.raises(msgspec.ValidationError, match="need `messages`"):
        msgspec.convert({"id": "r", "prompt": "x", "template_args": {"a": 1}}, GenerateRequest)
    for bad in ("messages", "add_generation_prompt", "not a name"):
        with pytest.raises(msgspec.ValidationError, match="may not set"):
            msgspec.convert({"id": "r", "messages": chat, "template_args": {bad: 1}}, GenerateRequest)
    assert msgspec.convert({"id": "r", "messages": chat, "template_args": {"x": 1}}, GenerateRequest)


@pytest.mark.model
async def test_a_request_with_tools_gets_the_gguf_s_tool_use_template(
    hermes_like: LlamaModel, server_config: ServerConfig
) -> None:
    """Hermes 2 Pro / 3 and Command-R GGUFs carry their tools in a second template, named
    ``tool_use``, which llama.cpp renders a request with tools with; it was unread, so those
    models got their default one and the generic format's instructions instead of the prompt
    and the <tool_call> they were trained on."""
    plain = hermes_like.apply_chat_template(ASK)
    assert plain.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>"), plain
    assert "function calling AI model" in hermes_like.apply_chat_template(ASK, [WEATHER])
    request = msgspec.convert(
        {"id": "h", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}, GenerateRequest
    )
    turns, tools = chat_turns(request, "hermes", None, "hermes")
    expected = len(hermes_like.tokenize_chat(turns, tools))
    async with running_server(hermes_like, server_config, http="127.0.0.1:0", api_key="k") as server:
        async with openai_sdk(server) as client:
            reply = await forced_call(client, "hermes-tools", "required")
            assert reply.usage is not None and reply.usage.prompt_tokens == expected
            chat = await client.chat.completions.create(
                model="hermes-tools", messages=ASK, temperature=0, max_tokens=2,  # type: ignore[arg-type]
            )  # fmt: skip
            assert chat.usage is not None and chat.usage.prompt_tokens == len(hermes_like.tokenize_chat(ASK))
