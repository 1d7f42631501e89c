"""A request's way in: checked against the limits, tokenized for its model's engine (off
the event loop where it takes real time), given its sampler, and queued on that model's
decode loop.  The server calls it once it knows which model the request names
(runtime/models.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import msgspec
import numpy as np
import trio

from ..config import ServerConfig
from ..engine.base import Engine, TokenArray
from ..engine.sampling import Sampler, SamplingParams
from ..protocol.chat_truncate import fewest_dropped
from ..protocol.errors import ErrorCode, UmaError, too_long
from ..protocol.messages import DEFAULT_MAX_TOKENS, ChatMessage, GenerateRequest
from ..protocol.tools import ToolFormat
from .decode_loop import DecodeLoop
from .off_loop import INLINE_TEXT_CHARS, INLINE_TURNS, off_loop
from .samplers import sampler_for
from .session import END_SLOTS, Session, StreamItem
from .stream import RequestStream
from .tool_use import chat_turns, template_family, template_format, tool_constraint, tool_format

log = logging.getLogger(__name__)

KEEP_HEAD = 4  # Ollama's num_keep: the prompt's first tokens stay when its middle is cut
KEEP_HEAD_BYTES = 256  # ...and of a text cut before it is tokenized, its first bytes


async def open_on(
    engine: Engine,
    loop: DecodeLoop,
    config: ServerConfig,
    request: GenerateRequest,
    arrived: float,
    *,
    connection: int,
    owner: str,
    auto_max_tokens: bool,
    pin_on_finish: bool,
) -> RequestStream:
    """Check ``request`` against the limits, tokenize it for ``engine`` and queue it on
    ``loop`` (the decode loop of the model it names); :class:`UmaError` if it cannot be served."""
    rid = request.id
    if not loop.accepting:  # before tokenizing: the engine may be closing
        raise UmaError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down", request_id=rid)
    if request.max_tokens == DEFAULT_MAX_TOKENS > config.max_tokens:  # the default (or as much)
        request = msgspec.structs.replace(request, max_tokens=config.max_tokens)  # was refused
    if not auto_max_tokens and request.max_tokens > config.max_tokens:
        raise UmaError(
            ErrorCode.MAX_TOKENS,
            f"max_tokens {request.max_tokens} exceeds the limit of {config.max_tokens}",
            request_id=rid,
        )
    if request.truncate and request.messages is not None:  # before the checks it would fail
        request = within_bounds(engine, config, request)
    text_bytes = (
        len(request.prompt.encode()) + len((request.suffix or "").encode())
        + sum(len(f.text.encode()) for f in request.input_extra or ())
        if request.prompt is not None
        else chat_text_bytes(request.messages or ())
    )  # fmt: skip
    if request.messages is not None and len(request.messages) > config.max_prompt_tokens:
        # Every turn the template renders brings a token at least (its role's), and rendering
        # 40,000 empty turns took the loop half a minute before the token count refused them.
        raise UmaError(
            ErrorCode.PROMPT_TOO_LARGE,
            too_long(
                f"the chat has {len(request.messages)} messages, more than the limit of "
                f"{config.max_prompt_tokens} prompt tokens could hold"
            ),
            request_id=rid,
        )
    limit_bytes = config.max_prompt_tokens * engine.max_token_bytes
    if text_bytes > limit_bytes and request.truncate and not request.embed and request.suffix is None:
        # To be cut below anyway: no more text than the tokens kept can come from, its start
        # and its end (Ollama's truncation keeps both), so it is not refused unread.
        request, text_bytes = _text_cut(request, limit_bytes, text_bytes)
    if text_bytes > limit_bytes and request.truncate and request.input_extra:
        # An infill to be cut below anyway: its other files go first, oldest first.
        request, text_bytes = _fewer_files(request, limit_bytes, text_bytes)
    if text_bytes > limit_bytes and request.embed and request.truncate and request.prompt is not None:
        # To be cut anyway (below): no more text than the tokens kept can come from, cut at a
        # character (Ollama's /api/embed truncates by default; this was refused).
        prompt_text = request.prompt.encode()[:limit_bytes].decode(errors="ignore")
        request = msgspec.structs.replace(request, prompt=prompt_text)
        text_bytes = len(prompt_text.encode())
    if text_bytes > limit_bytes:
        # Refused before tokenizing (a megabyte takes a worker thread a while): no token
        # is longer than max_token_bytes, so this text has more tokens than the limit.
        raise UmaError(
            ErrorCode.PROMPT_TOO_LARGE,
            too_long(
                f"{text_bytes} bytes, more than {config.max_prompt_tokens} tokens could hold "
                f"(the limit; the longest token is {engine.max_token_bytes} bytes)"
            ),
            request_id=rid,
        )
    fmt = tool_format(engine, request)
    # A truncated infill is cut while it is laid out (engine/infill.py), as llama-server cuts
    # one: an editor's context of other files grows with the session.
    infill_budget = None
    if request.truncate and request.suffix is not None:
        infill_budget = prompt_budget(engine, config, request, auto_max_tokens=auto_max_tokens)
    prompt = await tokenize_request(engine, request, fmt, infill_budget=infill_budget)
    if request.truncate and request.messages is not None:
        request, prompt = await fitted_chat(engine, config, request, fmt, prompt)
    if request.embed and request.truncate:  # cut to fit instead of refused (decode_loop.submit)
        prompt = prompt[: min(engine.n_ctx_seq, config.max_prompt_tokens)]
    elif request.truncate and request.suffix is None:  # an infill's markers are not cut
        prompt = middle_cut(engine, config, request, prompt, auto_max_tokens=auto_max_tokens)
    if len(prompt) > config.max_prompt_tokens:
        raise UmaError(
            ErrorCode.PROMPT_TOO_LARGE,
            too_long(f"{len(prompt)} tokens > {config.max_prompt_tokens} maximum (--max-prompt-tokens)"),
            request_id=rid,
        )
    if auto_max_tokens and not request.embed:
        room = max(1, engine.n_ctx_seq - len(prompt))
        request = msgspec.structs.replace(request, max_tokens=min(config.max_tokens, room))
    # The client's own cap (Ollama's num_ctx): never a reload.
    if request.max_context is not None and not request.embed:
        # Never past the engine's own: a route's ceiling read --n-ctx for a model not loaded
        # yet, which may load with less (its trained length).
        room = min(request.max_context, engine.n_ctx_seq) - len(prompt)
        if room < 1:
            # The client's own cap, or (as /infill sets it) the per-request context itself.
            own = request.max_context < engine.n_ctx_seq
            limit, whose = (request.max_context, "the request's max_context")
            if not own:
                limit, whose = engine.n_ctx_seq, "the per-request context"
            raise UmaError(
                ErrorCode.CONTEXT_OVERFLOW,
                # A prompt that fills the context is refused too: the answer needs a cell.
                too_long(f"{len(prompt)} tokens leave no room for an answer in {limit} ({whose})"),
                request_id=rid,
            )
        request = msgspec.structs.replace(request, max_tokens=min(request.max_tokens, room))
    # An embedding samples nothing: its sampler is never asked.
    if request.embed:
        sampler = Sampler(SamplingParams(temperature=0.0))
    else:
        sampler = await sampler_for(engine, request, tool_constraint(request, fmt, engine.vocabulary))
    send, receive = trio.open_memory_channel[StreamItem](config.stream_buffer + END_SLOTS)
    session = Session(request, prompt, sampler, send, created=arrived, connection=connection)
    session.pin_on_finish = pin_on_finish
    session.tool_format = fmt
    session.owner = owner
    try:
        loop.submit(session)  # raises when the daemon is full or stopping
    except BaseException:
        send.close()
        receive.close()
        raise
    return RequestStream(session, receive, loop)


async def tokenize_request(
    engine: Engine,
    request: GenerateRequest,
    fmt: ToolFormat | None = None,
    *,
    infill_budget: int | None = None,
) -> TokenArray:
    """The request's prompt as tokens (chat template applied, with the tools it offers in
    the way ``fmt`` says), off the event loop; an infill cut to ``infill_budget`` tokens."""
    try:
        if request.messages is not None:
            template, family = template_format(engine, request), template_family(engine, request)
            turns, tools = chat_turns(request, fmt, template, family)
            # Few turns of little text: rendered and tokenized on the loop.  Turns cost the
            # template's work however empty they are (4,000 empty ones: 0.6 s).
            small = (
                len(request.messages) <= INLINE_TURNS
                and chat_text_bytes(request.messages) <= INLINE_TEXT_CHARS
                and not tools
            )
            tokenize = partial(engine.tokenize_chat, turns, tools, request.template_args)
            tokens = await off_loop(engine, tokenize, small=small)
        elif request.suffix is not None:
            assert request.prompt is not None
            extra = [(f.filename, f.text) for f in request.input_extra or ()]
            infill = partial(
                engine.tokenize_infill, request.prompt, request.suffix, extra, request.middle, infill_budget
            )
            tokens = await off_loop(engine, infill)
        else:
            assert request.prompt is not None
            prompt, small = request.prompt, len(request.prompt) <= INLINE_TEXT_CHARS
            tokens = await off_loop(engine, partial(engine.tokenize, prompt), small=small)
    except ValueError as exc:
        raise UmaError(ErrorCode.MODEL, str(exc), request_id=request.id) from None
    if len(tokens) == 0:
        raise UmaError(ErrorCode.SCHEMA, "the prompt is empty", request_id=request.id)
    return tokens


def within_bounds(engine: Engine, config: ServerConfig, request: GenerateRequest) -> GenerateRequest:
    """A truncated chat without the oldest messages that surely cannot fit, before anything
    is rendered: more turns than --max-prompt-tokens (each brings a token) or more text than
    that many tokens could hold.  As it was if even the last message is too much."""
    assert request.messages is not None
    limit_bytes = config.max_prompt_tokens * engine.max_token_bytes

    def fits(messages: list[ChatMessage]) -> bool:
        return len(messages) <= config.max_prompt_tokens and chat_text_bytes(messages) <= limit_bytes

    if fits(request.messages):
        return request
    found = fewest_dropped(request.messages, lambda messages: messages, fits, first=1)
    if found is None:
        return request
    gone = len(request.messages) - len(found[0])
    log.debug("request %s: the %d oldest messages dropped before rendering", request.id, gone)
    return msgspec.structs.replace(request, messages=found[0])


async def fitted_chat(
    engine: Engine, config: ServerConfig, request: GenerateRequest, fmt: ToolFormat | None, prompt: TokenArray
) -> tuple[GenerateRequest, TokenArray]:
    """A truncated chat whose ``prompt`` leaves no answer token in its context (the request's
    max_context, at most the engine's) or passes --max-prompt-tokens: its oldest messages
    dropped until it fits (protocol/chat_truncate.py), searched off the loop.  As it was if
    even the last message does not fit: refused as before."""
    assert request.messages is not None
    context = request_context(engine, request)
    budget = min(context - 1, config.max_prompt_tokens)
    if len(prompt) <= budget:
        return request, prompt
    template, family = template_format(engine, request), template_family(engine, request)

    def measure(messages: list[ChatMessage]) -> TokenArray | None:
        turns, tools = chat_turns(msgspec.structs.replace(request, messages=messages), fmt, template, family)
        try:
            return engine.tokenize_chat(turns, tools, request.template_args)
        except ValueError:  # this cut's roles no longer suit the template (one wants them to alternate)
            return None

    search = partial(fewest_dropped, request.messages, measure, lambda tokens: len(tokens) <= budget, first=1)
    found = await off_loop(engine, search)
    if found is None:
        return request, prompt
    gone = len(request.messages) - len(found[0])  # every message kept is one it had
    log.debug("request %s: the %d oldest messages dropped to fit %d tokens", request.id, gone, budget)
    return msgspec.structs.replace(request, messages=found[0]), found[1]


def request_context(engine: Engine, request: GenerateRequest) -> int:
    """The context a request may fill: its max_context (Ollama's num_ctx), at most the engine's."""
    return min(request.max_context or engine.n_ctx_seq, engine.n_ctx_seq)


def middle_cut(
    engine: Engine, config: ServerConfig, request: GenerateRequest, prompt: TokenArray, *,
    auto_max_tokens: bool,
) -> TokenArray:  # fmt: skip
    """A truncated request's prompt that leaves no answer token in its context (the request's
    max_context, at most the engine's) or passes --max-prompt-tokens, even without its oldest
    messages: its first :data:`KEEP_HEAD` tokens and its last ones, as Ollama's runner
    truncates, with room left for the answer (its max_tokens, at most half the context; Ollama
    shifts the context while generating instead).  As it was if it fits."""
    context = request_context(engine, request)
    if len(prompt) <= min(context - 1, config.max_prompt_tokens):
        return prompt
    budget = prompt_budget(engine, config, request, auto_max_tokens=auto_max_tokens)
    if budget < 1:  # a context of one cell holds no prompt and answer: refused below, not emptied
        return prompt
    keep = min(KEEP_HEAD, budget // 2)
    log.warning(
        "request %s: truncating its prompt of %d tokens to %d (the first %d and the last %d) for a "
        "context of %d", request.id, len(prompt), budget, keep, budget - keep, context,
    )  # fmt: skip
    return np.concatenate([prompt[:keep], prompt[len(prompt) - (budget - keep) :]])


def prompt_budget(
    engine: Engine, config: ServerConfig, request: GenerateRequest, *, auto_max_tokens: bool
) -> int:
    """The tokens a prompt cut to fit may keep: its context (the request's max_context, at
    most the engine's) less room for the answer (its max_tokens, at most half the context),
    and never more than --max-prompt-tokens."""
    context = request_context(engine, request)
    answer = min(config.max_tokens if auto_max_tokens else request.max_tokens, context // 2)
    return min(context - max(1, answer), config.max_prompt_tokens)


def _fewer_files(request: GenerateRequest, limit_bytes: int, text_bytes: int) -> tuple[GenerateRequest, int]:
    """A truncated infill without the first of its other files (``input_extra``) its text
    needs to lose to be at most ``limit_bytes``, or without them all."""
    files = list(request.input_extra or ())
    while files and text_bytes > limit_bytes:
        text_bytes -= len(files.pop(0).text.encode())
    return msgspec.structs.replace(request, input_extra=files or None), text_bytes


def _text_cut(request: GenerateRequest, limit_bytes: int, text_bytes: int) -> tuple[GenerateRequest, int]:
    """A truncated request with more text than ``limit_bytes`` could be tokens: its prompt, or
    its last message (where the others leave it room), down to its start and its end."""
    if request.prompt is not None:
        text = _ends_of(request.prompt, limit_bytes)
        return msgspec.structs.replace(request, prompt=text), len(text.encode())
    messages = list(request.messages or ())
    if not messages:
        return request, text_bytes
    last = messages[-1]
    room = limit_bytes - (text_bytes - chat_text_bytes([last]))
    if room <= 0 or len(last.content.encode()) <= room:
        return request, text_bytes
    messages[-1] = msgspec.structs.replace(last, content=_ends_of(last.content, room))
    return msgspec.structs.replace(request, messages=messages), chat_text_bytes(messages)


def _ends_of(text: str, limit_bytes: int) -> str:
    """``text``'s first and last bytes, ``limit_bytes`` at most in all, cut at characters."""
    data = text.encode()
    head = min(KEEP_HEAD_BYTES, limit_bytes // 2)
    tail = data[len(data) - (limit_bytes - head) :] if limit_bytes > head else b""
    return data[:head].decode(errors="ignore") + tail.decode(errors="ignore")


def chat_text_bytes(messages: Sequence[ChatMessage]) -> int:
    """The text a chat's turns bring to the template: contents and tool call arguments."""
    return sum(
        len(m.content.encode()) + sum(len(c.function.arguments.encode()) for c in m.tool_calls or ())
        for m in messages
    )
