"""One HTTP generation request on its way through the gateway (:class:`Flight`), how its
events end (an eos, or the error to answer instead), and what the API modules beside the
gateway (ollama, anthropic, responses_api) use of it (:class:`GatewayCore`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..protocol import openai
from ..protocol.errors import ErrorCode
from ..protocol.messages import EosEvent, ErrorEvent, GenerateRequest, ServerEvent
from ..protocol.ollama import Limits, Options, answer_bounds
from ..protocol.openai import ApiError
from ..runtime.delivery import Beat
from ..runtime.desk import RequestDesk
from ..runtime.stream import RequestStream
from .event_stream import EventStream


@dataclass(eq=False)
class Flight:
    """One HTTP generation request, from admission to its last event."""

    id: str
    owner: str = ""  # its principal (auth.request_owner): only the same one may move it
    stream: RequestStream | None = None  # None while it is being tokenized


def last_word(events: Sequence[ServerEvent]) -> EosEvent:
    """The eos of a whole (non-streamed) request, or the error to answer instead."""
    for event in events:
        if isinstance(event, ErrorEvent):
            raise counted(openai.api_error(ErrorCode(event.code), event.message))
    last = events[-1] if events else None
    if not isinstance(last, EosEvent):
        raise client_gone()
    return last


def completed(events: Sequence[ServerEvent]) -> EosEvent:
    """The eos of a request that completed (stop or length), or the error to answer instead."""
    last = last_word(events)
    if last.reason not in ("stop", "length"):
        raise counted(openai.ended_early(last))  # a cancel, not a refusal
    return last


def counted(error: ApiError) -> ApiError:
    """Mark an error the daemon's counts already hold (or that is not a refusal)."""
    error.counted = True
    return error


def client_gone() -> ApiError:
    """The client went away: nobody reads this answer, and it is a hang-up, not an error."""
    return counted(ApiError(499, "client closed the request"))


class GatewayCore(Protocol):
    """The gateway's request lifecycle, as its API modules use it."""

    model: str

    def model_for(self, name: str) -> str: ...

    def _ready(self) -> RequestDesk: ...

    async def _loaded(self) -> None: ...

    def _count_error(self, error: ApiError) -> None: ...

    async def _body(self, request: Request) -> bytes: ...

    async def _arriving(self, request: Request) -> tuple[bytes, float]: ...

    def _in_flight(
        self, generate_request: GenerateRequest, arrived: float, auto_max_tokens: bool, owner: str
    ) -> AbstractAsyncContextManager[Flight]: ...

    async def _collect(self, request: Request, flight: Flight) -> list[ServerEvent]: ...

    def _events(self, flight: Flight) -> AsyncGenerator[ServerEvent, None]: ...

    def _beating_events(self, flight: Flight) -> AsyncGenerator[ServerEvent | Beat, None]: ...

    def _event_stream(
        self, sse: Callable[[], AsyncGenerator[bytes, None]], flight: Flight, headers: dict[str, str]
    ) -> EventStream: ...


BodyT = TypeVar("BodyT")
Handler = Callable[[Request], Awaitable[Response]]


def answer_limits(gateway: GatewayCore, model: str) -> Limits:
    """--max-tokens and ``model``'s per-request context (its engine's where it is loaded, else
    --n-ctx, what it will be loaded with): what a route whose clients' token limit is a
    ceiling (Ollama's num_predict, Anthropic's max_tokens, OpenAI's max_tokens) cuts their
    answers to."""
    desk = gateway._ready()
    unit = desk.models.units.get(model)
    if desk.models.store.entry(model).primary:
        context = desk.loop.engine.n_ctx_seq
    else:
        context = unit.engine.n_ctx_seq if unit is not None else desk.config.n_ctx
    return Limits(max_tokens=desk.config.max_tokens, context=context)


def with_ceiling(gateway: GatewayCore, request: GenerateRequest, model: str) -> GenerateRequest:
    """``request`` (for ``model``) with the client's ``max_tokens`` as a ceiling, as OpenAI's
    is an upper bound ("the maximum number of tokens that can be generated"): cut to
    --max-tokens and to the room the prompt leaves in the context, the answer then ending with
    ``length``; never refused (coding agents ask for 32,000: OpenCode on chat completions).
    The Anthropic and Ollama routes cap theirs in their own translation (answer_bounds)."""
    limits = answer_limits(gateway, model)
    options = Options(num_predict=request.max_tokens, num_ctx=request.max_context)
    return msgspec.structs.replace(request, **answer_bounds(options, limits))


def decode_body(data: bytes, kind: type[BodyT]) -> BodyT:
    """A request body as ``kind``; a 400 naming the field when it is not."""
    return openai.decode_json(data, kind)


def ollama_route(gateway: GatewayCore, handler: Handler) -> Handler:
    """``handler`` as Ollama answers: its errors in Ollama's shape, and run once the model has
    loaded.  Ollama's server answers ``GET /`` at once and holds a request until its model is
    in; a 503 "still loading" failed the clients whose readiness probe had passed."""

    async def after_load(request: Request) -> Response:
        await gateway._loaded()
        return await handler(request)

    return answering_as("ollama", after_load)


def answering_as(shape: str, handler: Handler) -> Handler:
    """``handler``, its errors answered in another API's shape (``ApiError.shape``)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            exc.shape = shape
            raise

    return wrapped
