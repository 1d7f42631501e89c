"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``): its bodies as daemon requests and its answers.  Pure.

Field names follow the official ``ollama`` Python client's types.  ``options.num_ctx`` is
a per-request cap on the context (prompt plus answer), never a reload: the model and its
context stay as the daemon loaded them for every app; ``num_predict`` is a ceiling, cut to
--max-tokens and the room the context leaves, never refused.  Durations are nanoseconds, times
RFC 3339.  What the daemon cannot honour (images, ``template``, ``context``, thinking) is
refused by name; load-time options (``num_gpu``, ``use_mmap``, ...) are ignored, as they
describe a model load that does not happen here.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .messages import EosEvent, GenerateRequest, ToolCall
from .openai_errors import ApiError

# The API level answered at /api/version: Ollama's release that added /v1/responses, which
# clients gate on (`codex --oss` refuses an older one).
OLLAMA_VERSION = "0.13.4"


_WHOLE = ("num_ctx", "num_predict", "seed", "top_k", "repeat_last_n", "mirostat")

# An integer option: Go's JSON gives Ollama every number as a float64, so 128.0 is 128 there.
WholeNumber = int | float | None


class Options(Struct, kw_only=True):
    """The runtime options; unknown (load-time) ones are ignored.  The integer ones take a
    whole float (``128.0``) as its integer and refuse a fraction (``__post_init__``)."""

    num_ctx: WholeNumber = None
    num_predict: WholeNumber = None
    seed: WholeNumber = None
    temperature: float | None = None
    top_k: WholeNumber = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_last_n: WholeNumber = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: WholeNumber = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    stop: list[str] | None = None

    def __post_init__(self) -> None:
        for name in _WHOLE:
            value = getattr(self, name)
            if isinstance(value, float):
                if not value.is_integer():  # msgspec reports it as a 400 at `$.options`
                    raise ValueError(f"options.{name} must be a whole number, not {value!r}")
                setattr(self, name, int(value))


class OllamaMessage(Struct, kw_only=True):
    role: str
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


def required_model(name: str | None) -> str:
    """A request's model name; none (missing or empty) is Ollama's ``400 model is required``
    on every model route (a missing one was msgspec's "Object missing required field", an
    empty one served the default model and answered with ``"model": ""``)."""
    if not name:
        raise ApiError(400, "model is required")
    return name


class _Common(Struct, kw_only=True):
    model: str = ""  # required: required_model says so as Ollama does
    stream: bool | None = None  # Ollama streams unless told not to
    format: Any = None  # "json", "" or a JSON schema
    options: Options | None = None
    keep_alive: Any = None  # how long the model stays loaded once idle (keep_alive_seconds)
    think: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[Any] | None = None
    truncate: bool | None = None  # unset or true: the oldest messages go if the chat does not fit


class GenerateBody(_Common, kw_only=True):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None
    truncate: bool | None = None  # unset or true: a prompt too long for the context is cut


class ShowBody(Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the old field name


_PASSED = (
    "seed", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n", "repeat_penalty",
    "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "stop",
)  # fmt: skip


# The daemon request's fields the client set as options: a refusal names them so.
CLIENT_NAMES = {name: f"options.{name}" for name in _PASSED} | {
    "max_tokens": "options.num_predict", "max_context": "options.num_ctx",
}  # fmt: skip


# Ollama's own defaults where they differ from the daemon's (llama.cpp's: top_p 0.95, min_p
# 0.05): its api/types.go DefaultOptions, and min_p unset there.  Its repeat_penalty default
# (1.1) is left out: Ollama's Go sampler, which runs its newer models, applies no penalties
# (ollama/ollama#15783), and greedy answers would part from every other route's.
OLLAMA_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0}


WHOLE_CONTEXT = 1 << 20  # repeat_last_n: the daemon cuts it to the request's context


def minus_one_means(fields: dict[str, Any]) -> dict[str, Any]:
    """Ollama's and llama.cpp's documented -1 values in the daemon's terms: a negative seed is
    a random one (no seed), repeat_last_n -1 the whole context (both were 400s)."""
    if fields.get("seed") is not None and fields["seed"] < 0:
        del fields["seed"]
    if fields.get("repeat_last_n") == -1:
        fields["repeat_last_n"] = WHOLE_CONTEXT
    return fields


def streams(body: _Common) -> bool:
    return body.stream is not False


@dataclass(frozen=True)
class Limits:
    """What bounds an answer on this daemon: ``--max-tokens`` and the per-request context
    of the model a request names."""

    max_tokens: int
    context: int


def answer_bounds(options: Options, limits: Limits | None) -> dict[str, int]:
    """``max_tokens`` and ``max_context`` from ``num_predict`` and ``num_ctx``.  num_predict
    is a ceiling, as Ollama's (boundedNumPredict): past ``limits`` (--max-tokens, the room the
    prompt leaves in the context) the answer is cut and ends with ``length``, never refused.
    The room is max_context's: the daemon cuts max_tokens to it less the prompt's tokens."""
    bounds: dict[str, int] = {}
    if options.num_ctx is not None and options.num_ctx > 0:
        bounds["max_context"] = int(options.num_ctx)
    if options.num_predict is not None and options.num_predict > 0:
        bounds["max_tokens"] = int(options.num_predict)
        if limits is not None:
            bounds["max_tokens"] = min(bounds["max_tokens"], limits.max_tokens)
            bounds["max_context"] = min(bounds.get("max_context", limits.context), limits.context)
    return bounds


def _common_fields(body: _Common, request_id: str, limits: Limits | None) -> dict[str, Any]:
    if body.think not in (None, False):
        raise ApiError(400, "`think` is not supported: this model does not think aloud")
    fields: dict[str, Any] = {"id": request_id, "stream": True, **OLLAMA_DEFAULTS}
    options = body.options or Options()
    for name in _PASSED:
        if (value := getattr(options, name)) is not None:
            fields[name] = value
    minus_one_means(fields)
    fields.update(answer_bounds(options, limits))
    if body.format not in (None, ""):
        schema = None if body.format == "json" else body.format
        if schema is not None and not isinstance(schema, dict):
            raise ApiError(400, '`format` must be "json" or a JSON schema object')
        fields["response_format"] = {"type": "json_object"} if schema is None else {
            "type": "json_schema", "json_schema": {"schema": schema}
        }  # fmt: skip
    if body.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    return fields


def _thinking(body: _Common) -> dict[str, Any]:
    """``think: false`` for a templated request: the template is told so (Qwen 3's
    ``enable_thinking``; a template that reads no such variable renders as before)."""
    return {"template_args": {"enable_thinking": False}} if body.think is False else {}


def chat_request(body: ChatBody, request_id: str, limits: Limits | None = None) -> GenerateRequest:
    """The daemon request for ``/api/chat``; :class:`ApiError` or ``ValueError`` /
    ``msgspec.ValidationError`` (the socket protocol's checks) for a bad one.  Without
    ``limits``, num_predict is passed as it is."""
    fields = _common_fields(body, request_id, limits)
    messages = []
    for i, message in enumerate(body.messages):
        if message.images:
            raise ApiError(400, f"messages[{i}].images: images are not supported by this model")
        turn: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [_tool_call(call, i) for call in message.tool_calls]
        if message.role == "tool":
            turn["tool_call_id"] = message.tool_name or "tool"
            if message.tool_name:
                turn["name"] = message.tool_name
        messages.append(turn)
    if not messages:
        raise ApiError(400, "`messages` must hold at least one message")
    fields["messages"] = messages
    fields.update(_thinking(body))
    fields["truncate"] = body.truncate is not False  # the daemon drops the oldest messages to fit
    if body.tools:
        fields["tools"] = body.tools
    return msgspec.convert(fields, GenerateRequest)


def _tool_call(call: dict[str, Any], i: int) -> dict[str, Any]:
    function = call.get("function") or {}
    if not isinstance(function, dict) or not function.get("name"):
        raise ApiError(400, f"messages[{i}].tool_calls: a call needs function.name")
    arguments = function.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": str(call.get("id") or ""), "function": {"name": function["name"], "arguments": text}}


def generate_request(body: GenerateBody, request_id: str, limits: Limits | None = None) -> GenerateRequest:
    """The daemon request for ``/api/generate``: ``prompt`` with the chat template (and
    ``system``), or as it is with ``raw``; with a ``suffix``, an infill (an empty one is
    none, as in Ollama)."""
    for name in ("template", "context", "images"):
        if getattr(body, name):
            raise ApiError(400, f"`{name}` is not supported by this server")
    fields = _common_fields(body, request_id, limits)
    prompt = body.prompt or ""
    if body.suffix:
        fields.update(prompt=prompt, suffix=body.suffix)
    elif body.raw:
        fields["prompt"] = prompt
    else:
        system = [{"role": "system", "content": body.system}] if body.system else []
        fields["messages"] = [*system, {"role": "user", "content": prompt}]
        fields.update(_thinking(body))
    fields["truncate"] = body.truncate is not False  # an infill is cut as engine/infill.py says
    return msgspec.convert(fields, GenerateRequest)


# -- answers ------------------------------------------------------------------------


def now_rfc3339() -> str:
    return rfc3339(datetime.datetime.now(datetime.UTC).timestamp())


def rfc3339(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).isoformat().replace("+00:00", "Z")


class AssistantMessage(Struct, omit_defaults=True):
    content: str
    role: str = msgspec.field(default_factory=lambda: "assistant")  # always written
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class Chunk(Struct, omit_defaults=True):
    """One NDJSON line of /api/chat (``message``) or /api/generate (``response``)."""

    model: str
    created_at: str
    done: bool
    message: AssistantMessage | UnsetType = UNSET
    response: str | UnsetType = UNSET
    done_reason: str | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET
    logprobs: list[dict[str, Any]] | UnsetType = UNSET


def text_chunk(model: str, text: str, chat: bool, logprobs: list[dict[str, Any]] | None = None) -> Chunk:
    chunk = Chunk(model=model, created_at=now_rfc3339(), done=False)
    if chat:
        chunk.message = AssistantMessage(content=text)
    else:
        chunk.response = text
    if logprobs:
        chunk.logprobs = logprobs
    return chunk


def final_chunk(model: str, eos: EosEvent, chat: bool, text: str = "") -> Chunk:
    """The last line (``done: true``), with the counts and durations, the tool calls, and
    the whole text for an answer that was not streamed."""
    timings, usage = eos.timings, eos.usage
    ttft = timings.ttft_ms if timings.ttft_ms is not None else timings.total_ms
    chunk = Chunk(
        model=model, created_at=now_rfc3339(), done=True, done_reason=eos.reason,
        total_duration=_ns(timings.total_ms), load_duration=_ns(timings.load_ms or 0.0),
        prompt_eval_count=usage.prompt_tokens, prompt_eval_duration=_ns(ttft - timings.queue_ms),
        eval_count=usage.completion_tokens, eval_duration=_ns(timings.total_ms - ttft),
    )  # fmt: skip
    if chat:
        content = eos.content if eos.content is not None else text
        chunk.message = AssistantMessage(content=content or "")
        if eos.tool_calls:
            chunk.message.tool_calls = [ollama_call(c) for c in eos.tool_calls]
    else:
        chunk.response = text
    return chunk


def ollama_call(call: ToolCall) -> dict[str, Any]:
    """Ollama's tool call: the arguments as an object, not JSON text."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = {}
    return {"function": {"name": call.function.name, "arguments": arguments}}


def _ns(ms: float) -> int:
    return max(0, int(ms * 1e6))


def logprobs_of(entries: list[Any] | None) -> list[dict[str, Any]] | None:
    if not entries:
        return None
    return [
        {"token": e.token, "logprob": e.logprob,
         "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in e.top_logprobs]}
        for e in entries
    ]  # fmt: skip


class ModelDetails(Struct):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str
    parent_model: str = ""


class ModelEntry(Struct, omit_defaults=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str | UnsetType = UNSET
    size_vram: int | UnsetType = UNSET
    context_length: int | UnsetType = UNSET


class ModelList(Struct):
    models: list[ModelEntry]


class ShowAnswer(Struct):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(Struct):
    version: str = OLLAMA_VERSION


Kind = Literal["chat", "generate"]
BodyT = TypeVar("BodyT", ChatBody, GenerateBody, ShowBody)
