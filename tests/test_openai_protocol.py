"""The OpenAI shapes and their translation, alone (no I/O)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from uma_trio.protocol import openai, openai_errors
from uma_trio.protocol.errors import ErrorCode
from uma_trio.protocol.messages import (
    EosEvent,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
    Usage,
)
from uma_trio.protocol.openai_logprobs import TextOffsets, completion_logprobs

MODEL = "m"


def chat(**fields: Any) -> openai.ChatBody:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    decoded = openai.decode_body(msgspec.json.encode(body), openai.ChatBody)
    assert isinstance(decoded, openai.ChatBody)
    return decoded


def completion(**fields: Any) -> openai.CompletionBody:
    decoded = openai.decode_body(msgspec.json.encode({"model": MODEL, **fields}), openai.CompletionBody)
    assert isinstance(decoded, openai.CompletionBody)
    return decoded


def translate(
    body: openai.ChatBody | openai.CompletionBody, header: str | None = None, limit: int = 2048
) -> openai.Translated:
    return openai.translate(body, request_id="r1", lane_header=header, max_tokens_limit=limit)


def eos(reason: Any = "stop", text: str | None = None) -> EosEvent:
    return EosEvent("r1", reason, Usage(5, 3, 8), Timings(queue_ms=0.0, total_ms=1.0), text=text)


def test_chat_fields_map_onto_the_socket_request() -> None:
    t = translate(
        chat(
            max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", stream=True,
            stream_options={"include_usage": True}, user="u", top_k=5, min_p=0.1, unknown_field=1,
        )
    )  # fmt: skip
    r = t.request
    assert (r.id, r.max_tokens, r.temperature, r.top_p, r.seed, r.stop) == ("r1", 7, 0, 0.5, 3, ["\n"])
    assert (r.stream, r.top_k, r.min_p, r.priority) == (True, 5, 0.1, "interactive")
    assert r.messages is not None and [(m.role, m.content) for m in r.messages] == [("user", "hi")]
    assert t.include_usage and not t.auto_max_tokens


def test_chat_without_max_tokens_uses_the_context_left_and_completions_default_to_16() -> None:
    assert translate(chat()).auto_max_tokens
    t = translate(completion(prompt="x"))
    assert not t.auto_max_tokens and t.request.max_tokens == openai.COMPLETIONS_DEFAULT_MAX_TOKENS
    assert translate(completion(prompt=["x"], max_tokens=3)).request.max_tokens == 3
    assert (
        translate(completion(prompt="x"), limit=8).request.max_tokens == 8
    )  # the default obeys --max-tokens


def test_explicit_nulls_mean_the_defaults() -> None:
    t = translate(chat(n=None, stream=None, stream_options={"include_usage": None}, temperature=None))
    assert not t.request.stream and not t.include_usage and t.request.temperature == 0.8


def test_message_roles_and_text_parts() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    r = translate(chat(messages=messages)).request
    assert r.messages is not None
    assert [(m.role, m.content) for m in r.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
        ("assistant", "ok"),
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias[...]"),
        ({"mirostat": 3}, "mirostat"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        # Checks across fields have no path in msgspec's message: param was null.
        ({"tool_choice": "required"}, "tool_choice"),
        ({"modalities": ["text", "audio"]}, "modalities"),  # were accepted, answered in text
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "grammar": "root ::= [a]"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"type": "function"}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ""}, "stop"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_unsupported_or_invalid_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.ApiError) as refused:
        translate(chat(**fields))
    assert refused.value.status == 400 and refused.value.param == param


def test_a_refused_max_completion_tokens_is_named_as_sent_and_int64_seeds_pass() -> None:
    with pytest.raises(openai.ApiError) as refused:
        translate(chat(max_completion_tokens=0))
    assert "max_completion_tokens" in refused.value.message and "$.max_tokens" not in refused.value.message
    for seed in (-(2**63), 2**63 - 1, -5):
        assert translate(chat(seed=seed)).request.seed is not None
    assert translate(chat(stream=True, stream_options={"include_usage": True})).include_usage
    # vLLM's names: repetition_penalty is repeat_penalty; min_tokens 0 is no request at all.
    assert translate(chat(repetition_penalty=1.3, min_tokens=0)).request.repeat_penalty == 1.3
    assert translate(chat(repetition_penalty=1.3, repeat_penalty=1.3)).request.repeat_penalty == 1.3


@pytest.mark.parametrize("kwargs", [{"messages": 1}, {f"v{i}": i for i in range(17)}])
def test_a_refused_chat_template_kwargs_is_named_as_sent(kwargs: dict[str, int]) -> None:
    """Found by review: a reserved variable or too many of them were refused naming
    ``template_args``, the socket's field, which the client never sent."""
    with pytest.raises(openai.ApiError) as refused:
        translate(chat(chat_template_kwargs=kwargs))
    assert refused.value.status == 400 and refused.value.param == "chat_template_kwargs"
    assert "template_args" not in refused.value.message and "chat_template_kwargs" in refused.value.message


@pytest.mark.parametrize("logprobs", [21, -1])
def test_completions_logprobs_out_of_range_names_logprobs(logprobs: int) -> None:
    """Found by review: /v1/completions' ``logprobs: 21`` was refused naming ``top_logprobs``,
    the daemon's field, which the client never sent."""
    with pytest.raises(openai.ApiError) as refused:
        translate(completion(prompt="hi", logprobs=logprobs))
    assert refused.value.status == 400 and refused.value.param == "logprobs"
    assert "logprobs must be 0 to 20" in refused.value.message
    assert translate(completion(prompt="hi", logprobs=20)).request.top_logprobs == 20


def test_a_text_part_without_text_says_so() -> None:
    """Found by review: it read "content part type 'text' is not supported; only text"."""
    with pytest.raises(openai.ApiError) as refused:
        translate(chat(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert refused.value.param == "messages[0].content" and "needs `text`" in refused.value.message


def test_neutral_values_of_unsupported_fields_pass() -> None:
    neutral = {"n": 1, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0,
               "response_format": {"type": "text"}, "tools": [], "echo": False, "best_of": 1}  # fmt: skip
    translate(chat(**neutral))


def test_batched_prompts_are_refused() -> None:
    with pytest.raises(openai.ApiError) as refused:
        translate(completion(prompt=["a", "b"]))
    assert refused.value.param == "prompt"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model": ', ErrorCode.INVALID_JSON, None),
        (b'{"model": 1, "messages": []}', ErrorCode.SCHEMA, "model"),
        (b'{"messages": []}', ErrorCode.SCHEMA, "model"),  # "missing required field `model`"
        (
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
            ErrorCode.SCHEMA,
            "messages[0].content",
        ),
    ],
)
def test_body_decoding_errors(body: bytes, code: ErrorCode, param: str | None) -> None:
    with pytest.raises(openai.ApiError) as refused:
        openai.decode_body(body, openai.ChatBody)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)


@pytest.mark.parametrize(
    ("header", "fields", "lane"),
    [
        (None, {}, "interactive"),
        ("background", {}, "background"),
        (" Background ", {"priority": "interactive"}, "background"),
        ("interactive", {"service_tier": "flex"}, "interactive"),
        (None, {"priority": "background"}, "background"),
        (None, {"service_tier": "flex"}, "background"),
        (None, {"service_tier": "priority"}, "interactive"),
    ],
)
def test_lane_precedence(header: str | None, fields: dict[str, Any], lane: str) -> None:
    assert translate(chat(**fields), header).request.priority == lane


def test_a_bad_lane_header_is_refused() -> None:
    with pytest.raises(openai.ApiError):
        translate(chat(), "urgent")


def test_daemon_errors_map_to_http_statuses() -> None:
    assert openai.api_error(ErrorCode.MAX_TOKENS, "x").uma_code == ErrorCode.MAX_TOKENS
    assert openai.api_error(ErrorCode.SERVER_BUSY, "x").status == 429
    assert openai.api_error(ErrorCode.SHUTTING_DOWN, "x").status == 503
    assert openai.api_error(ErrorCode.FRAME_TOO_LARGE, "x").status == 413
    too_long = openai.api_error(ErrorCode.CONTEXT_OVERFLOW, "x")
    assert (too_long.status, too_long.code, too_long.uma_code) == (
        400,
        "context_length_exceeded",
        "E_LIMIT_002",
    )
    assert set(ErrorCode) <= set(openai_errors._STATUS), "every daemon error has an HTTP status"


def test_chat_stream_chunks_follow_openais_order() -> None:
    stream = openai.ChatStream("c1", 7, MODEL, include_usage=True)
    chunks = [*stream.head(), *stream.token("Hi"), *stream.end(eos("length"))]
    decoded = [msgspec.json.decode(msgspec.json.encode(c)) for c in chunks]
    assert [d["object"] for d in decoded] == ["chat.completion.chunk"] * 4
    assert decoded[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert decoded[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert decoded[2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    assert decoded[3]["choices"] == [] and decoded[3]["usage"]["total_tokens"] == 8
    assert all(d["usage"] is None for d in decoded[:3])


def test_without_include_usage_chunks_carry_no_usage_key() -> None:
    stream = openai.CompletionStream("c1", 7, MODEL, include_usage=False)
    chunks = [*stream.head(), *stream.token("a"), *stream.end(eos())]
    decoded = [msgspec.json.decode(msgspec.json.encode(c)) for c in chunks]
    assert len(decoded) == 2 and all("usage" not in d for d in decoded)
    assert decoded[1]["choices"][0]["finish_reason"] == "stop" and decoded[1]["object"] == "text_completion"


def test_whole_answers() -> None:
    answer = msgspec.json.decode(msgspec.json.encode(openai.chat_completion("c1", 7, MODEL, eos(text="yo"))))
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"content": "yo", "role": "assistant"}
    assert answer["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    text = msgspec.json.decode(
        msgspec.json.encode(openai.text_completion("c1", 7, MODEL, eos("length", "t")))
    )
    assert text["choices"][0]["text"] == "t" and text["choices"][0]["finish_reason"] == "length"
    early = openai.ended_early(eos("cancelled"))
    assert early.status == 503 and early.body()["error"]["type"] == "server_error"


def test_sse_framing() -> None:
    assert openai.sse(b"{}") == b"data: {}\n\n"
    assert openai.SSE_DONE == b"data: [DONE]\n\n"


def test_text_offsets_count_characters_not_the_u_fffd_of_split_ones() -> None:
    """ "é" (c3 a9) drawn as two byte tokens, each reading as U+FFFD: offsets were summed from
    those and every later one was shifted."""
    entries = [
        TokenLogprob("\ufffd", -0.1, [0xC3], []),
        TokenLogprob("\ufffd", -0.1, [0xA9], []),
        TokenLogprob("x", -0.1, [0x78], []),
    ]
    described = completion_logprobs(entries, TextOffsets(2))
    assert described is not None and described.text_offset == [2, 2, 3]  # "ab" + "éx": "x" at 3


def test_legacy_tokens_of_a_split_character_are_named_by_their_bytes() -> None:
    """Each half of "é" read U+FFFD: the tokens did not join to the text, and two such
    alternatives collided as one key of top_logprobs.  OpenAI writes them "bytes:\\xc3"."""
    halves = [TopLogprob("\ufffd", -1.0, [0xC3]), TopLogprob("\ufffd", -2.0, [0xC4])]
    entries = [TokenLogprob("\ufffd", -0.1, [0xC3], halves), TokenLogprob("\ufffd", -0.1, [0xA9], [])]
    described = completion_logprobs(entries)
    assert described is not None
    assert described.tokens == ["bytes:\\xc3", "bytes:\\xa9"]
    assert described.top_logprobs[0] == {"bytes:\\xc3": -1.0, "bytes:\\xc4": -2.0}
    whole = completion_logprobs([TokenLogprob("é", -0.1, list("é".encode()), [])])
    assert whole is not None and whole.tokens == ["é"]
    # Chat's entries too (found by review: only the legacy lists named them), their bytes kept.
    chat = openai.chat_logprobs([*entries, TokenLogprob("é", -0.1, list("é".encode()), [])])
    assert chat is not None
    assert [e.token for e in chat.content] == ["bytes:\\xc3", "bytes:\\xa9", "é"]
    assert [t.token for t in chat.content[0].top_logprobs] == ["bytes:\\xc3", "bytes:\\xc4"]
    assert [e.bytes for e in chat.content] == [[0xC3], [0xA9], list("é".encode())]


def lp(token: str, data: bytes | None = None) -> TokenLogprob:
    return TokenLogprob(token, -0.5, list(token.encode() if data is None else data), [])


def test_streamed_text_offsets_are_the_whole_answer_s() -> None:
    """A chunk's text may hold back a pending stop string (" United" sent as " ", then
    "United States" with " States"'s entry), or a character cut between two chunks' tokens:
    offsets counted from the text sent, or afresh per chunk, were shifted."""
    events = [
        ("The", [lp("The")]),
        (" ", [lp(" United")]),  # " United" held: it may start the stop string "United Kingdom"
        ("United States", [lp(" States")]),
        (" ", [lp(" \ufffd", b" \xf0")]),  # " 💑": three tokens, the emoji's bytes cut in two chunks
        ("\U0001f491", [lp("\ufffd", b"\x9f\x92"), lp("\ufffd", b"\x91")]),
        ("!", [lp("!")]),
    ]
    stream = openai.CompletionStream("c1", 7, MODEL, include_usage=False)
    streamed = []
    for text, entries in events:
        (chunk,) = stream.token(text, entries)
        described = chunk.choices[0].logprobs
        assert described is not None
        streamed += described.text_offset
    whole = completion_logprobs([e for _, entries in events for e in entries])
    assert whole is not None and streamed == whole.text_offset == [0, 3, 10, 17, 18, 18, 19]
    text = "".join(text for text, _ in events)
    assert text[10:17] == " States" and text[19] == "!"


CALL = ToolCall(id="call_1", function=ToolCallFunction(name="f", arguments="{}"))


@pytest.mark.parametrize(("reason", "finish"), [("stop", "tool_calls"), ("length", "length")])
def test_calls_cut_off_by_max_tokens_finish_with_length(reason: Any, finish: str) -> None:
    """Cut off, an answer's list of calls may be short (a call it was writing is lost): it
    said tool_calls, as if the answer were whole."""
    cut = msgspec.structs.replace(eos(reason), content="", tool_calls=[CALL])
    answer = openai.chat_completion("c1", 7, MODEL, cut)
    assert answer.choices[0].finish_reason == finish
    assert answer.choices[0].message.tool_calls == [CALL]  # the whole calls are kept
    stream = openai.ToolChatStream("c1", 7, MODEL, include_usage=False, fmt="generic")
    chunks = [*stream.head(), *stream.token('{"tool_calls": [{"name": "f", "arguments": {}}, {"na'),
              *stream.end(cut)]  # fmt: skip
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, finish]
    assert chunks[1].choices[0].delta.tool_calls == [openai.ToolCallDelta(0, "call_1", CALL.function)]


def test_a_tool_stream_sends_each_token_s_logprobs_with_its_text() -> None:
    """Offered tools, a stream sent no logprobs at all; held text's go out with it (a
    Hermes call's at the end, with the calls)."""
    events = [
        ("Sure", [lp("Sure")]),
        (".\n", [lp("."), lp("\n")]),
        ("<tool_call>", [lp("<tool_call>")]),
        ('{"name": "f", "arguments": {}}</tool_call>', [lp("{...}")]),
        ("\nDone", [lp("\nDone")]),
    ]
    stream = openai.ToolChatStream("c1", 7, MODEL, include_usage=False, fmt="hermes")
    chunks = [chunk for text, entries in events for chunk in stream.token(text, entries)]
    ended = msgspec.structs.replace(eos(), content="Sure.\n\nDone", tool_calls=[CALL])
    chunks += stream.end(ended)
    sent = [(c.choices[0].delta.content, [e.token for e in c.choices[0].logprobs.content])
            for c in chunks if c.choices[0].logprobs]  # fmt: skip
    assert sent == [
        ("Sure", ["Sure"]),
        (".", [".", "\n"]),  # "\n" held (it may be trimmed) but its token's text began here
        ("\n\nDone", ["<tool_call>", "{...}", "\nDone"]),  # the held text and the call's tokens
    ]
