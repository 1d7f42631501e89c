"""OpenAI's HTTP API shapes, and their translation to and from the daemon's own protocol.

Pure: no I/O, no clock (callers pass ``created``), so it is tested alone.  The
request bodies accept what OpenAI's API documents for ``/v1/completions`` and
``/v1/chat/completions``; what the daemon cannot honour (``n > 1``, logprobs,
penalties, ...) is refused by name instead of being silently ignored, and
fields it does not know at all are ignored, as OpenAI-compatible servers do.
Value checks are the socket protocol's own: the translated request goes through
:class:`~uma_trio.protocol.messages.GenerateRequest`'s validation.

Over 400 lines: every request body, response and stream chunk OpenAI's two generation
endpoints define, with their translation; the errors are in openai_errors.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .errors import ErrorCode, UmaError
from .messages import (
    MOST_TOP_LOGPROBS,
    EosEvent,
    GenerateRequest,
    Lane,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
)

# The errors live in openai_errors.py; callers reach every OpenAI shape through this module.
from .openai_errors import ApiError as ApiError
from .openai_errors import api_error as api_error
from .openai_errors import client_param, stop_param
from .openai_errors import decode_json as decode_json
from .openai_errors import from_uma_error as _from_uma_error
from .openai_errors import validation_error as validation_error
from .openai_functions import modernized
from .openai_logprobs import ChatLogprobs, CompletionLogprobs, TextOffsets, chat_logprobs, completion_logprobs
from .tool_text import ToolTextFilter
from .tool_turns import tool_turn_fault
from .tools import TOOL_GRAMMAR_ERROR, ToolFormat

# -- request bodies ----------------------------------------------------------------


# Fields OpenAI allows to be null take None as "the default"; clients do send explicit nulls.


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False


class _Body(Struct, kw_only=True):
    """Fields common to both endpoints.  Unknown fields are ignored."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # any int64, as OpenAI's
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    # The QoS lane (an extension; the X-Uma-Priority header wins), or OpenAI's service tier:
    # "flex" (slower, for background work) maps to the background lane.
    priority: Lane | None = None
    service_tier: str | None = None
    # Penalties and biases (OpenAI's), and llama.cpp's sampling knobs, which OpenAI lacks but
    # its clients often send (llama-server's names).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's and OpenRouter's name for it
    min_tokens: int | None = None  # vLLM's; refused past 0 (_NEUTRAL)
    repeat_last_n: int | None = None
    typical_p: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # Structured output: OpenAI's response_format, and llama-server's grammar (GBNF or Lark)
    # and json_schema extensions.
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Tools (chat only; checked as the daemon's Tool and ToolChoice).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Documented by OpenAI but not supported: refused unless neutral.
    # Chat: logprobs true and top_logprobs 0-20; completions: logprobs N (the top N too).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    functions: list[Any] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    modalities: list[str] | None = None  # ["text"] only: no audio out
    audio: dict[str, Any] | None = None


class CompletionBody(_Body, kw_only=True):
    prompt: str | list[str]


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatTurn(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # checked as the daemon's ToolCall
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # deprecated: openai_functions.py


class ChatBody(_Body, kw_only=True):
    messages: list[ChatTurn]
    function_call: Any = None  # deprecated, with `functions`: openai_functions.py
    # More variables for the chat template, as llama-server and vLLM take them (Qwen 3's
    # `enable_thinking`): the daemon's `template_args`.
    chat_template_kwargs: dict[str, Any] | None = None


# What a field may be set to and still mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "echo": (None, False),
    "best_of": (None, 1),
    "modalities": (None, [], ["text"]),
    "audio": (None,),
    "min_tokens": (None, 0),
}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# Passed to the daemon's request as they are (its validation checks them).
SAMPLING_EXTRAS = (
    "frequency_penalty", "presence_penalty", "logit_bias", "repeat_penalty", "repeat_last_n",
    "typical_p", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
)  # fmt: skip

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def decode_body(data: bytes, kind: type[CompletionBody] | type[ChatBody]) -> CompletionBody | ChatBody:
    return decode_json(data, kind)


class Translated(Struct, kw_only=True):
    """A body turned into a daemon request, and what the HTTP answer needs to know."""

    request: GenerateRequest
    auto_max_tokens: bool  # no max_tokens given: use what the context has left
    include_usage: bool
    n: int = 1  # choices (openai_choices.py)
    legacy_functions: bool = False  # `functions` offered: answer with `function_call`


def _check_supported(body: _Body) -> None:
    if body.n is not None and not 1 <= body.n <= 16:
        raise ApiError(400, f"n={body.n}: from 1 to 16 choices per request", param="n")
    for name, neutral in _NEUTRAL.items():
        if getattr(body, name) not in neutral:
            raise ApiError(400, f"`{name}` is not supported by this server", param=name)
    # As OpenAI and vLLM refuse it (explicit nulls, as some clients send every field, pass).
    if body.stream_options is not None and body.stream_options.include_usage is not None and not body.stream:
        raise ApiError(400, "`stream_options` is only allowed with `stream: true`", param="stream_options")


def _chat_messages(turns: list[ChatTurn]) -> list[dict[str, Any]]:
    if not turns:
        raise ApiError(400, "`messages` must hold at least one message", param="messages")
    out = []
    for i, turn in enumerate(turns):
        role = _ROLES.get(turn.role)
        if role is None:
            raise ApiError(
                400, f"role {turn.role!r} is not supported; use system, developer, user, assistant or tool",
                param=f"messages[{i}].role",
            )  # fmt: skip
        if turn.tool_calls and role != "assistant":
            raise ApiError(
                400, "only an assistant message carries tool_calls", param=f"messages[{i}].tool_calls"
            )
        if role == "tool" and not turn.tool_call_id:
            raise ApiError(
                400, "a tool message needs its `tool_call_id`", param=f"messages[{i}].tool_call_id"
            )
        if isinstance(turn.content, str):
            text = turn.content
        elif turn.content is None and turn.tool_calls:
            text = ""  # an assistant turn that only called tools
        elif turn.content is None:
            raise ApiError(400, "a message needs text `content`", param=f"messages[{i}].content")
        else:
            parts = []
            for part in turn.content:
                if part.type != "text":
                    raise ApiError(
                        400, f"content part type {part.type!r} is not supported; only text",
                        param=f"messages[{i}].content",
                    )  # fmt: skip
                if part.text is None:
                    raise ApiError(400, "a text part needs `text`", param=f"messages[{i}].content")
                parts.append(part.text)
            text = "".join(parts)
        message: dict[str, Any] = {"role": role, "content": text}
        if turn.tool_calls:
            message["tool_calls"] = [_tool_call(call, i, j) for j, call in enumerate(turn.tool_calls)]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        if turn.name is not None and role == "tool":
            message["name"] = turn.name
        out.append(message)
    return out


def _tool_call(call: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """An assistant turn's tool call as the daemon's ToolCall (OpenAI's shape; arguments as
    JSON text, which some clients send as an object: kept as its JSON)."""
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ApiError(400, "a tool call needs type `function` and a `function` object", param=where)
    name, arguments = function.get("name"), function.get("arguments", "")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "a tool call's function needs a `name`", param=f"{where}.function.name")
    if not isinstance(arguments, str):
        arguments = msgspec.json.encode(arguments).decode()
    return {"id": str(call.get("id") or ""), "function": {"name": name, "arguments": arguments}}


def translate(
    body: CompletionBody | ChatBody, *, request_id: str, lane_header: str | None, max_tokens_limit: int
) -> Translated:
    """The daemon request for ``body``; raises :class:`ApiError` for what cannot be served.
    ``max_tokens_limit`` (``--max-tokens``) caps the completions default of 16."""
    legacy = False
    if isinstance(body, ChatBody):
        body, legacy = modernized(body)
    _check_supported(body)
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise ApiError(
            400, "max_tokens and max_completion_tokens disagree; give one", param="max_completion_tokens"
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    lane = lane_for(body, lane_header)
    fields: dict[str, Any] = {"id": request_id, "stream": bool(body.stream), "priority": lane}
    if isinstance(body, ChatBody):
        fields["messages"] = _chat_messages(body.messages)
        if body.chat_template_kwargs is not None:
            fields["template_args"] = body.chat_template_kwargs
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, "one prompt per request (batches are not supported)", param="prompt")
        fields["prompt"] = prompts[0]
        if body.suffix:  # fill-in-the-middle: the prompt is the text before the cursor
            fields["suffix"] = body.suffix
        if max_tokens is None:
            max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_tokens_limit)
    auto = max_tokens is None
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields.update(_logprob_fields(body))
    if body.stop is not None:
        fields["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    for name in (
        "temperature", "top_p", "top_k", "min_p", "response_format", "grammar",
        "tools", "tool_choice", "parallel_tool_calls", *SAMPLING_EXTRAS,
    ):  # fmt: skip
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    if (seed := daemon_seed(body.seed)) is not None:
        fields["seed"] = seed
    if body.repetition_penalty is not None:
        if body.repeat_penalty not in (None, body.repetition_penalty):
            raise ApiError(
                400, "repeat_penalty and repetition_penalty disagree; give one", param="repetition_penalty",
                code=ErrorCode.SCHEMA,
            )  # fmt: skip
        fields["repeat_penalty"] = body.repetition_penalty
    if body.json_schema is not None:
        if body.response_format is not None or body.grammar is not None:
            raise ApiError(
                400, "give one of `response_format`, `json_schema` and `grammar`", param="json_schema",
                code=ErrorCode.SCHEMA,
            )  # fmt: skip
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": body.json_schema}}
    try:
        request = msgspec.convert(fields, GenerateRequest)
    except (msgspec.ValidationError, ValueError) as exc:
        error = stop_param(validation_error(exc), body.stop)
        names = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
        if legacy:
            names.update(tools="functions", tool_choice="function_call")
        if body.repetition_penalty is not None:
            names["repeat_penalty"] = "repetition_penalty"
        if isinstance(body, ChatBody) and body.chat_template_kwargs is not None:
            names["template_args"] = "chat_template_kwargs"
        error = client_param(error, names)  # the fields as the client named them
        raise error from None
    if "messages" in fields and (fault := tool_turn_fault(fields["messages"])):  # as OpenAI's checks
        raise ApiError(400, fault[1], param=f"messages[{fault[0]}]")
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    return Translated(
        request=request, auto_max_tokens=auto, include_usage=include_usage, n=body.n or 1,
        legacy_functions=legacy,
    )  # fmt: skip


SEED_MASK = 2**63 - 1  # the daemon's seeds are 0 .. 2**63-1; OpenAI's any int64


def daemon_seed(seed: int | None) -> int | None:
    """OpenAI's ``seed`` as the daemon's: -1 (clients' "random") is none, another negative
    maps into range by its low 63 bits (still the same sampling for the same seed)."""
    if seed is None or seed == -1:
        return None
    return seed & SEED_MASK if seed < 0 else seed


def from_uma_error(error: UmaError, request: GenerateRequest | None = None) -> ApiError:
    """The HTTP answer to a daemon error; a refused value (E_PROTO_002) whose message starts
    with a request field's name (``logit_bias names token ...``) names it as ``param``, and
    so does a refusal of what ``request`` carries (its constraint, its prompt's length)."""
    api = _from_uma_error(error)
    field = error.message.split(" ", 1)[0]
    if api.param is None and error.code == ErrorCode.SCHEMA and field in GenerateRequest.__struct_fields__:
        api.param = field
    if api.param is None and request is not None:
        api.param = _refused_field(error.code, request, error.message)
    return api


def _refused_field(code: str, request: GenerateRequest, message: str) -> str | None:
    """The field of ``request`` that an admission refusal is about (param was null)."""
    if code == ErrorCode.GRAMMAR:
        if request.uses_tools and message.startswith(TOOL_GRAMMAR_ERROR):
            return "tools"
        return "grammar" if request.grammar is not None else "response_format"
    if code in (ErrorCode.PROMPT_TOO_LARGE, ErrorCode.CONTEXT_OVERFLOW):
        if request.embed:  # /v1/embeddings' text
            return "input"
        return "messages" if request.messages is not None else "prompt"
    return None


def _logprob_fields(body: _Body) -> dict[str, Any]:
    """Chat's ``logprobs`` + ``top_logprobs``, or completions' ``logprobs: N``, as the daemon's."""
    if isinstance(body, ChatBody):
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ApiError(
                400, "logprobs is true or false for chat; top_logprobs says how many", param="logprobs"
            )
        return {"logprobs": True, "top_logprobs": body.top_logprobs or 0} if body.logprobs else {}
    if body.logprobs is None or body.logprobs is False:
        return {}
    if not 0 <= int(body.logprobs) <= MOST_TOP_LOGPROBS:  # named here: the daemon's field is top_logprobs
        raise ApiError(400, f"logprobs must be 0 to {MOST_TOP_LOGPROBS}", param="logprobs")
    return {"logprobs": True, "top_logprobs": int(body.logprobs)}


LANE_HEADER = "x-uma-priority"


def lane_for(body: _Body, header: str | None) -> Lane:
    """The request's QoS lane: the X-Uma-Priority header, else the body's ``priority``,
    else ``service_tier: flex`` → background; interactive by default."""
    from_header = lane_from_header(header)
    if from_header is not None:
        return from_header
    if body.priority is not None:
        return body.priority
    return "background" if body.service_tier == "flex" else "interactive"


def lane_from_header(header: str | None) -> Lane | None:
    """The lane an ``X-Uma-Priority`` header names, if one was sent."""
    if header is None:
        return None
    value = header.strip().lower()
    if value not in ("interactive", "background"):
        raise ApiError(400, f"X-Uma-Priority must be interactive or background, not {header!r}")
    return "background" if value == "background" else "interactive"


# -- responses ---------------------------------------------------------------------
# msgspec leaves UNSET fields out of the JSON: that is how a field is absent here, while
# None is an explicit null.


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    # Absent from stream chunks unless usage was asked for; then null until the last.
    usage: Usage | UnsetType | None = UNSET


class AssistantMessage(Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    function_call: ToolCallFunction | UnsetType = UNSET  # the deprecated shape's one call


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ToolCallDelta(Struct):
    """One whole tool call in a stream (its arguments in one piece, at the end)."""

    index: int
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class Delta(Struct):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    function_call: ToolCallFunction | UnsetType = UNSET  # the deprecated shape's one call, whole


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | UnsetType | None = UNSET


def usage_of(eos: EosEvent) -> Usage:
    u = eos.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, PromptTokensDetails(u.cached_tokens))


def finish_reason(eos: EosEvent, legacy: bool = False) -> str:
    """OpenAI's finish_reason for an eos that completed: stop or length, and tool_calls when
    an answer that called tools ended by itself (``function_call`` in the deprecated shape).
    One cut off by max_tokens is ``length``, as OpenAI's: its whole calls are kept, but a call
    it was writing is lost, and the client must know that the list may be short."""
    assert eos.reason in ("stop", "length"), eos.reason
    if eos.tool_calls and eos.reason == "stop":
        return "function_call" if legacy else "tool_calls"
    return eos.reason


ChunkT = TypeVar("ChunkT", "ChatCompletionChunk", "Completion")


class _Stream(Generic[ChunkT]):
    """The chunks of one streamed completion, in OpenAI's order: the head (chat: a chunk
    with the role), one per token, one with the finish_reason, and with ``include_usage`` a
    last one with no choices and the usage (every other chunk then carries ``usage: null``).
    Subclasses say how one chunk is shaped."""

    index = 0  # the choice these chunks carry (n > 1: protocol/openai_choices.py)
    legacy = False  # the deprecated `functions` were offered: calls as `function_call`

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool) -> None:
        self.id, self.created, self.model = completion_id, created, model
        self._usage: UnsetType | None = None if include_usage else UNSET

    def _chunk(
        self, text: str | None, finish: str | None, *, usage: Usage | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> ChunkT:  # fmt: skip
        """``text`` None: no content (the finish chunk); with ``usage``: the usage chunk."""
        raise NotImplementedError

    def head(self) -> list[ChunkT]:
        return []

    def token(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[ChunkT]:
        return [self._chunk(text, None, logprobs=logprobs)]

    def end(self, eos: EosEvent, *, with_usage: bool = True) -> list[ChunkT]:
        """The finish chunk, and the usage chunk if asked for (``with_usage``: n > 1 sends
        one for all choices, :meth:`usage_chunk`)."""
        chunks = [self._chunk(None, finish_reason(eos, self.legacy))]
        if self._usage is None and with_usage:
            chunks.append(self.usage_chunk(usage_of(eos)))
        return chunks

    def usage_chunk(self, usage: Usage) -> ChunkT:
        return self._chunk(None, None, usage=usage)

    @property
    def wants_usage(self) -> bool:
        return self._usage is None


class ChatStream(_Stream[ChatCompletionChunk]):
    def _chunk(
        self, text: str | None, finish: str | None, *, usage: Usage | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> ChatCompletionChunk:  # fmt: skip
        if usage is not None:
            return ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage)
        delta = Delta() if text is None else Delta(content=text)
        choice = ChatChunkChoice(
            index=self.index, delta=delta, finish_reason=finish, logprobs=chat_logprobs(logprobs)
        )
        return ChatCompletionChunk(self.id, self.created, self.model, [choice], usage=self._usage)

    def head(self) -> list[ChatCompletionChunk]:
        choice = ChatChunkChoice(
            index=self.index, delta=Delta(role="assistant", content=""), finish_reason=None
        )
        return [ChatCompletionChunk(self.id, self.created, self.model, [choice], usage=self._usage)]


class ToolChatStream(ChatStream):
    """A chat stream whose request offered tools: content is sent until it may be a tool
    call (protocol/tool_text.py's ToolTextFilter); at the end the rest of the content, then the
    calls, each whole in one delta.  A token's logprobs go out with the first chunk that
    carries its text; those of text held to the end (the calls', too) with the last chunks."""

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        include_usage: bool,
        fmt: ToolFormat,
        formatted: bool = False,
    ) -> None:
        super().__init__(completion_id, created, model, include_usage)
        self._filter = ToolTextFilter(fmt, formatted)
        self._fed = 0  # characters fed to the filter
        # Each token event's logprobs not sent yet, with where its text starts in what was fed.
        self._held: list[tuple[int, list[TokenLogprob]]] = []
        self._logprobs = False  # the request asked for them

    def token(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[ChatCompletionChunk]:
        if logprobs is not None:
            self._logprobs = True
            self._held.append((self._fed, logprobs))
        self._fed += len(text)
        content = self._filter.feed(text)
        if not content:
            return []
        sent = self._filter.accounted
        ready = [entry for start, entries in self._held if start < sent for entry in entries]
        self._held = [(start, entries) for start, entries in self._held if start >= sent]
        return [self._chunk(content, None, logprobs=ready if self._logprobs else None)]

    def end(self, eos: EosEvent, *, with_usage: bool = True) -> list[ChatCompletionChunk]:
        # Sent whether or not the answer called tools: a Hermes model may write on after its
        # calls, and the whole answer's content has that text too.
        rest = self._filter.rest(eos.content or "")
        held = [entry for _, entries in self._held for entry in entries] if self._logprobs else None
        self._held = []
        chunks = [self._chunk(rest, None, logprobs=held)] if rest else []
        if eos.tool_calls:
            calls = [ToolCallDelta(i, c.id, c.function) for i, c in enumerate(eos.tool_calls)]
            delta = (
                Delta(function_call=eos.tool_calls[0].function) if self.legacy else Delta(tool_calls=calls)
            )
            choice = ChatChunkChoice(
                index=self.index, delta=delta, finish_reason=None,
                logprobs=None if rest else chat_logprobs(held),
            )  # fmt: skip
            chunks.append(ChatCompletionChunk(self.id, self.created, self.model, [choice], usage=self._usage))
        elif held and not rest:  # text that is no content (a generic answer's JSON) had tokens
            chunks.append(self._chunk("", None, logprobs=held))
        return chunks + super().end(eos, with_usage=with_usage)


class CompletionStream(_Stream[Completion]):
    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool) -> None:
        super().__init__(completion_id, created, model, include_usage)
        # Counted from the tokens, not from the text sent: a chunk's text may hold back a
        # pending stop string, or half of a character, while its logprobs are the tokens'.
        self._offsets = TextOffsets()

    def _chunk(
        self, text: str | None, finish: str | None, *, usage: Usage | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> Completion:  # fmt: skip
        if usage is not None:
            return Completion(self.id, self.created, self.model, [], usage=usage)
        described = completion_logprobs(logprobs, self._offsets)
        choice = CompletionChoice(index=self.index, text=text or "", finish_reason=finish, logprobs=described)
        return Completion(self.id, self.created, self.model, [choice], usage=self._usage)


def chat_completion(
    completion_id: str, created: int, model: str, eos: EosEvent, legacy: bool = False
) -> ChatCompletion:
    """``legacy``: the deprecated ``functions`` were offered, so a call is ``function_call``
    (one at most: those requests ask for no parallel calls)."""
    if eos.content is None:  # no tools offered
        message = AssistantMessage(content=eos.text or "")
    elif eos.tool_calls and legacy:
        message = AssistantMessage(content=eos.content or None, function_call=eos.tool_calls[0].function)
    elif eos.tool_calls:
        message = AssistantMessage(content=eos.content or None, tool_calls=eos.tool_calls)
    else:
        message = AssistantMessage(content=eos.content)
    choice = ChatChoice(
        index=0,
        message=message,
        finish_reason=finish_reason(eos, legacy),
        logprobs=chat_logprobs(eos.logprobs),
    )
    return ChatCompletion(completion_id, created, model, [choice], usage_of(eos))


def text_completion(completion_id: str, created: int, model: str, eos: EosEvent) -> Completion:
    choice = CompletionChoice(
        index=0,
        text=eos.text or "",
        finish_reason=finish_reason(eos),
        logprobs=completion_logprobs(eos.logprobs),
    )
    return Completion(completion_id, created, model, [choice], usage=usage_of(eos))


def ended_early(eos: EosEvent) -> ApiError:
    """The error for an eos that did not complete (the daemon is shutting down)."""
    why = eos.cancel_reason or "cancelled"
    return api_error(ErrorCode.SHUTTING_DOWN, f"the request was cancelled ({why}) before it completed")


class Model(Struct):
    id: str
    created: int
    owned_by: str = "uma-trio"
    object: Literal["model"] = "model"
    uma: dict[str, Any] | None = None  # the daemon's own view: state, file, size (docs/MODELS.md)


class ModelList(Struct):
    data: list[Model]
    object: Literal["list"] = "list"


def sse(payload: bytes) -> bytes:
    """One server-sent event carrying ``payload`` (a JSON document, or ``[DONE]``)."""
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse(b"[DONE]")
# An SSE comment: every client skips it, and its bytes keep a read timeout from firing.
SSE_KEEPALIVE = b": keep-alive\n\n"
