"""Wire messages, as msgspec Structs.

Client → daemon messages are told apart by an optional ``"type"`` field; a
message without one is a generate request, so the seeds' request
``{"id", "prompt", "max_tokens", "stream", "temperature", "top_p"}`` is
accepted exactly as written.  Daemon → client events are a tagged union on
``"event"``.  New fields always get defaults, so old clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .response_format import ResponseFormat, TextFormat
from .tools import NamedToolChoice, Tool, ToolChoice

Lane = Literal["interactive", "background"]
FinishReason = Literal["stop", "length", "cancelled", "error"]
CancelReason = Literal["client", "disconnect", "shutdown", "stalled"]

# Printable ASCII without spaces: an id travels into HTTP headers (latin-1 only), log lines
# and error messages, where a CR/LF or a non-latin-1 character broke a response after the
# request was registered.  (``\Z``, not ``$``: ``$`` also matches before a final newline.)
REQUEST_ID_PATTERN = r"^[!-~]{1,128}\Z"
MOST_TOP_LOGPROBS = 20  # the most likely tokens a token's logprobs may list (OpenAI's limit)
DEFAULT_MAX_TOKENS = 256  # cut to --max-tokens where that is lower (runtime/intake.py)
RequestId = Annotated[str, Meta(pattern=REQUEST_ID_PATTERN)]
# A file name in the snapshot directory: no path separators, no leading dot.
SnapshotName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]
TokenKey = Annotated[str, Meta(pattern=r"^[0-9]{1,9}\Z")]  # a token id, as a JSON object key
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]  # added to the token's logit; -100 bans it


class ToolCallFunction(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool call an assistant turn made (OpenAI's ``message.tool_calls[i]``)."""

    id: Annotated[str, Meta(max_length=256)] = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    """One turn of a chat, formatted with the model's own chat template.  An assistant turn
    may carry the ``tool_calls`` it made (then ``content`` may be empty); a ``tool`` turn the
    result of one, with its ``tool_call_id``."""

    role: Annotated[str, Meta(min_length=1, max_length=32)]
    content: str = ""
    tool_calls: Annotated[list[ToolCall], Meta(max_length=128)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None

    def template_fields(self) -> dict[str, Any]:
        """The turn as a chat template reads it (HF transformers' message dict): only the
        fields the turn has; a tool call's arguments as the object its JSON text holds, as
        transformers' templates expect (``arguments | tojson``), or the text if it holds none."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            turn["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


def _arguments(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # nested past the stack: the text, as any non-object
        return text
    return value if isinstance(value, dict) else text


class ExtraFile(Struct, forbid_unknown_fields=True, kw_only=True):
    """Another file of the project, as context for an infill (llama-server's input_extra)."""

    filename: Annotated[str, Meta(max_length=1024)] = ""
    text: str


# A GBNF (llama.cpp) or Lark (llguidance) grammar, as text.
GrammarText = Annotated[str, Meta(min_length=1, max_length=256 * 1024)]


# What the daemon gives a chat template itself (engine/chat_template.py): `template_args` may not
# set them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
     "strftime_now", "range", "namespace", "dict", "cycler", "joiner"}
)  # fmt: skip


class GenerateRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Start a completion.  Exactly one of ``prompt`` and ``messages``."""

    id: RequestId
    type: Literal["generate"] = "generate"
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] = DEFAULT_MAX_TOKENS
    stream: bool = True
    # Sampling defaults follow llama.cpp's; temperature 0 means greedy.
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.8
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.95
    top_k: Annotated[int, Meta(ge=0)] = 40
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.05
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[list[StopString], Meta(max_length=16)] = msgspec.field(default_factory=list)
    # Penalties, biases and llama.cpp's other samplers (docs/PROTOCOL.md "Sampling"); the
    # defaults turn each off.
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repeat_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    repeat_last_n: Annotated[int, Meta(ge=0, le=1 << 20)] = 64
    logit_bias: Annotated[dict[TokenKey, Bias], Meta(max_length=1024)] = msgspec.field(default_factory=dict)
    typical_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    dry_multiplier: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    dry_base: Annotated[float, Meta(ge=1.0, le=100.0)] = 1.75
    dry_allowed_length: Annotated[int, Meta(ge=0, le=1024)] = 2
    dry_penalty_last_n: Annotated[int, Meta(ge=-1, le=1 << 20)] = -1
    xtc_probability: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    xtc_threshold: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.1
    mirostat: Literal[0, 1, 2] = 0
    mirostat_tau: Annotated[float, Meta(gt=0.0, le=100.0)] = 5.0
    mirostat_eta: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.1
    logprobs: bool = False  # each token's log-probability (and the top_logprobs') in its events
    top_logprobs: Annotated[int, Meta(ge=0, le=MOST_TOP_LOGPROBS)] = 0
    priority: Lane = "interactive"
    # The most KV cells this request may use, prompt and answer (Ollama's num_ctx): the answer
    # is cut to fit; a prompt that does not leave room is E_LIMIT_002.  Never a reload.
    max_context: Annotated[int, Meta(ge=1)] | None = None
    # Structured output: the completion is one JSON value of the format's schema, or matches
    # the grammar (docs/PROTOCOL.md "Structured output").  At most one of the two.
    response_format: ResponseFormat | None = None
    grammar: GrammarText | None = None
    # Fill-in-the-middle (docs/PROTOCOL.md "Infill"): `prompt` is the text before the cursor,
    # `suffix` the text after it, `input_extra` other files as context.
    suffix: Annotated[str, Meta(max_length=1 << 22)] | None = None
    input_extra: Annotated[list[ExtraFile], Meta(max_length=256)] | None = None
    middle: Annotated[str, Meta(max_length=1 << 20)] = ""  # the middle's start, already typed
    # Tools the model may call (docs/PROTOCOL.md "Tool calls"); chat requests only.
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    # More variables for the chat template (llama-server's and vLLM's `chat_template_kwargs`:
    # Qwen 3's `enable_thinking`, gpt-oss's `reasoning_effort`); chat requests only.
    template_args: Annotated[dict[str, Any], Meta(max_length=16)] | None = None
    # Embeddings (docs/PROTOCOL.md "Embeddings"): nothing is generated; the eos carries the
    # prompt's pooled hidden state, scaled to unit length with `normalize`.  `truncate` cuts
    # a prompt longer than the context to fit instead of refusing it.
    embed: bool = False
    normalize: bool = True
    truncate: bool = False
    # Which of the daemon's models (docs/MODELS.md; None: --model's), and how long it stays
    # loaded once idle (seconds; negative: for good; Ollama's keep_alive).
    model: Annotated[str, Meta(max_length=256)] | None = None
    keep_alive: float | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` is required")
        if self.embed:
            self._check_embedding()
        if self.grammar is not None and not isinstance(self.response_format, TextFormat | None):
            raise ValueError("give `response_format` or `grammar`, not both")
        names = [t.function.name for t in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"`tool_choice` names {self.tool_choice.function.name!r}, not in `tools`")
        if self.tool_choice == "required" and not names:
            raise ValueError("`tool_choice` `required` needs `tools`")
        if self.uses_tools and self.prompt is not None:
            raise ValueError("`tools` need `messages` (the chat template renders them)")
        if self.uses_tools and self.grammar is not None:
            raise ValueError("give `tools` or a `grammar`, not both")
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        if self.template_args is not None:
            if self.messages is None:
                raise ValueError("`template_args` need `messages` (the chat template reads them)")
            if bad := [k for k in self.template_args if not k.isidentifier() or k in RESERVED_TEMPLATE_NAMES]:
                raise ValueError(
                    f"`template_args` may not set {bad[0]!r}: the daemon sets it, or it is no name"
                )
        if self.suffix is not None and self.prompt is None:
            raise ValueError("`suffix` (infill) needs `prompt`, the text before it")
        if self.input_extra is not None and self.suffix is None:
            raise ValueError("`input_extra` is context for an infill: it needs `suffix`")

    def _check_embedding(self) -> None:
        if self.prompt is None:
            raise ValueError("`embed` takes a `prompt`, the text to embed")
        if not self.prompt:
            raise ValueError("`prompt` must not be empty: an empty text has no embedding")
        generating = {
            "tools": self.tools, "response_format": self.response_format, "grammar": self.grammar,
            "suffix": self.suffix, "logprobs": self.logprobs or None,
        }  # fmt: skip
        if given := [name for name, value in generating.items() if value is not None]:
            raise ValueError(f"`embed` generates nothing: drop {', '.join(f'`{n}`' for n in given)}")

    @property
    def uses_tools(self) -> bool:
        """Whether the model is offered tools (some, and tool_choice is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"


class CancelRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Cancel the in-flight request ``id`` of this connection."""

    type: Literal["cancel"]
    id: RequestId


class MetricsRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Ask for a metrics snapshot; answered without waiting for a decode tick."""

    type: Literal["metrics"]
    id: RequestId | None = None


class PriorityRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Move the in-flight request ``id`` of this connection to another lane."""

    type: Literal["priority"]
    id: RequestId
    priority: Lane


class SnapshotRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Save a prompt's KV cells under a name, restore them into the prefix cache, or list.

    ``save`` needs ``name`` and exactly one of ``prompt`` and ``messages``;
    ``restore`` needs ``name``; ``list`` takes neither."""

    type: Literal["snapshot"]
    op: Literal["save", "restore", "list"]
    id: RequestId | None = None
    name: SnapshotName | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        has_text = self.prompt is not None or self.messages is not None
        if self.op == "save" and (self.prompt is None) == (self.messages is None):
            raise ValueError("save needs exactly one of `prompt` and `messages`")
        if self.op != "save" and has_text:
            raise ValueError(f"{self.op} takes no `prompt` or `messages`")
        if (self.op == "list") != (self.name is None):
            raise ValueError("list takes no `name`" if self.op == "list" else f"{self.op} needs a `name`")


class ModelsRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """List the daemon's models, or load or unload one (docs/MODELS.md); answered by one
    ``models`` event.  ``load`` and ``unload`` need ``model``."""

    type: Literal["models"]
    op: Literal["list", "load", "unload"] = "list"
    id: RequestId | None = None
    model: Annotated[str, Meta(max_length=256)] | None = None
    keep_alive: float | None = None  # load: seconds it stays once idle (negative: for good)

    def __post_init__(self) -> None:
        if (self.op == "list") != (self.model is None):
            raise ValueError("list takes no `model`" if self.op == "list" else f"{self.op} needs a `model`")


ClientMessage = (
    GenerateRequest | CancelRequest | MetricsRequest | PriorityRequest | SnapshotRequest | ModelsRequest
)

MESSAGE_TYPES: dict[str, type[ClientMessage]] = {
    "generate": GenerateRequest,
    "cancel": CancelRequest,
    "metrics": MetricsRequest,
    "priority": PriorityRequest,
    "snapshot": SnapshotRequest,
    "models": ModelsRequest,
}


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of prefilled


class Timings(Struct, omit_defaults=True):
    """One request's own latency figures, in milliseconds."""

    queue_ms: float
    total_ms: float
    ttft_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    itl_max_ms: float | None = None
    tokens_per_s: float | None = None
    # The wait for its model to load (a model other than --model's, not loaded when it came),
    # within queue_ms; absent when there was none.
    load_ms: float | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    """A generated token's log-probability under the model, and the most likely tokens'."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class TokenEvent(Struct, tag_field="event", tag="token", omit_defaults=True):
    id: str
    text: str
    token_id: int
    # With `logprobs`: the tokens this event's text comes from (a token whose text is held
    # back, such as the start of a possible stop string, is reported with the text).
    logprobs: list[TokenLogprob] | None = None


class EosEvent(Struct, tag_field="event", tag="eos", omit_defaults=True):
    """Always the last event of an accepted request."""

    id: str
    reason: FinishReason
    usage: Usage
    timings: Timings
    # The whole completion, only for ``"stream": false`` requests.
    text: str | None = None
    # Why a request was cancelled: the client asked, hung up, or the daemon stopped.
    cancel_reason: CancelReason | None = None
    stop_sequence: str | None = None  # ended by one of the request's stop strings: which one
    # Requests with tools: the answer's text outside its tool calls, and the calls.
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # With `logprobs` and `"stream": false`: every generated token's.
    logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # an `embed` request's embedding


class ErrorEvent(Struct, tag_field="event", tag="error"):
    id: str | None
    code: str
    message: str


class MetricsEvent(Struct, tag_field="event", tag="metrics", omit_defaults=True):
    metrics: dict[str, Any]
    id: str | None = None


class SnapshotInfo(Struct):
    name: str
    tokens: int  # KV cells the snapshot fills
    bytes: int  # size of its file
    model: str
    kv_type: str
    created_unix: float


class SnapshotEvent(Struct, tag_field="event", tag="snapshot", omit_defaults=True):
    """The answer to a snapshot request: the snapshot saved or restored, or all of them."""

    op: Literal["save", "restore", "list"]
    snapshots: list[SnapshotInfo]
    id: str | None = None


class ModelsEvent(Struct, tag_field="event", tag="models", omit_defaults=True):
    """The answer to a models request: every model of the store with its state, after the
    load or unload (docs/MODELS.md)."""

    op: Literal["list", "load", "unload"]
    models: list[dict[str, Any]]
    id: str | None = None


ServerEvent = TokenEvent | EosEvent | ErrorEvent | MetricsEvent | SnapshotEvent | ModelsEvent
