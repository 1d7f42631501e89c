"""``--http``: the OpenAI-compatible gateway, a small Starlette app on hypercorn's trio worker.

Every HTTP request becomes a daemon request on the same decode loop as the
socket's, so HTTP and socket clients share batches, lanes and limits.  The app
exists before the model is loaded: until :meth:`Gateway.attach` it answers
``/health`` with 503 ``loading`` and everything else with 503.  docs/HTTP.md
describes the endpoints.

Cancel-on-disconnect: each request that reaches the decode loop runs beside a
task that waits for the client's ``http.disconnect``; when it comes, the
request's task is cancelled, which closes :func:`~uma_trio.runtime.delivery.deliver`
and so cancels the request at the next token boundary, as a socket hang-up does.

Over 400 lines: one route per endpoint and the request lifecycle they share (begin, stream
or collect, end); the response shapes, API keys and the SSE response live in their own
modules (responses.py, auth.py, event_stream.py).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal, TypeVar

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.infill import NO_FIM_TOKENS
from ..model_store import model_id
from ..observability.prometheus import exposition
from ..protocol import openai
from ..protocol.codec import decode_client_message
from ..protocol.errors import ErrorCode, UmaError, shown
from ..protocol.llama_server import (
    InfillAnswer,
    InfillBody,
    infill_answer,
    infill_request,
    n_predict,
    no_tokens_answer,
)
from ..protocol.messages import (
    EosEvent,
    ErrorEvent,
    GenerateRequest,
    Lane,
    ModelsRequest,
    ServerEvent,
    TokenEvent,
)
from ..protocol.openai import ApiError
from ..protocol.openai_choices import choice_requests, merged_chat, merged_text, merged_usage, whole_eos
from ..runtime.delivery import Beat, deliver
from ..runtime.desk import RequestDesk
from .anthropic import AnthropicApi
from .auth import BearerAuth, request_owner
from .embeddings import EmbeddingsApi
from .event_stream import UNWATCHED_RECEIVE, EventStream, sticky_disconnect, until_disconnect
from .flight import Flight, answer_limits, client_gone, completed, decode_body, last_word, with_ceiling
from .fresh import FreshConnections, peer_of
from .ollama import OllamaApi, fill_in_middle
from .origin import DEFAULT_CORS_ORIGINS, LOOPBACK_HOSTS, OriginGuard, origin_pattern
from .pull import PullApi
from .responses import error_response, http_error_response, json_response, unexpected_error_response
from .responses_api import ResponsesApi
from .serve import AsgiApp, Receive, Scope, Send

log = logging.getLogger(__name__)

LOAD_WAIT_S = 300.0  # how long an Ollama route waits for the model to load (OLLAMA_LOAD_TIMEOUT's 5 min)

_json = msgspec.json.Encoder()
EventT = TypeVar("EventT")


class PriorityBody(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    priority: Lane


# The principal of HTTP requests (prefix-cache partition): TCP carries no uid, and without a
# key any local user can send them, so they never reuse a socket user's cached prefixes.


def kept_for_others(max_requests: int) -> int:
    """The places among the HTTP requests in flight that one API key may not take, where
    there are several keys: a quarter of them.  One key's flood made another key's every
    request a 429.  (With one key or none every HTTP request is one principal's: nobody
    else could use them.)"""
    return max_requests // 4


class Gateway:
    """The app's state: the server once the model is loaded, and its requests in flight."""

    def __init__(
        self,
        model_file: str,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_requests: int,
        hosts: frozenset[str] = frozenset(LOOPBACK_HOSTS),
        cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS,
        body_timeout_s: float = 10.0,
        api_keys: Sequence[str] = (),
    ) -> None:
        self.model = model_id(model_file)
        self.model_names = {self.model, model_file}
        self.api_key = api_key
        self._keyed = bool(api_key or api_keys)  # /health tells key holders more
        # Principals that may share the places in flight: one per key (keyless, one in all).
        self._principals = len({*api_keys, *([api_key] if api_key else [])}) or 1
        self.max_body_bytes = max_body_bytes
        self.max_requests = max_requests  # generation requests in flight, tokenizing included
        self.body_timeout_s = body_timeout_s  # a body begun must arrive whole within this
        self.server: RequestDesk | None = None
        self._attached = trio.Event()  # set with ``server``: the model has loaded
        self.created = int(time.time())
        self._flights: dict[str, Flight] = {}  # by request id, for POST /priority and the limit
        self.url: str | None = None
        self.urls: list[str] = []  # every address it serves: --http's, then --ollama's
        self.fresh = FreshConnections()  # connections whose first request is still to come
        self.app = self._counting(self.fresh.wrap(self._starlette(hosts, cors_origins, api_key, api_keys)))

    def _starlette(
        self, hosts: frozenset[str], cors_origins: Sequence[str], api_key: str | None, api_keys: Sequence[str]
    ) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/generate", self.generate, methods=["POST"]),
                Route("/infill", self.infill, methods=["POST"]),
                Route("/priority", self.priority, methods=["POST"]),
                Route("/load", self.load_or_unload, methods=["POST"]),
                Route("/unload", self.load_or_unload, methods=["POST"]),
                *OllamaApi(self).routes(),
                *EmbeddingsApi(self).routes(),
                *PullApi(self).routes(),
                *AnthropicApi(self).routes(),
                *ResponsesApi(self).routes(),
            ],
            # Outermost first: web pages are turned away before anything else, allowed origins'
            # preflights are answered before the key is asked for (browsers send none there).
            middleware=[
                Middleware(
                    OriginGuard, hosts=hosts, origins=origin_pattern(cors_origins), refuse=self._refuse
                ),
                Middleware(
                    CORSMiddleware,
                    allow_origin_regex=origin_pattern(cors_origins).pattern,
                    allow_methods=["GET", "POST"],
                    # The browser SDKs' own headers too (OpenAI's x-stainless-*, Anthropic's
                    # key and version): the origin has passed OriginGuard by now.
                    allow_headers=["*"],
                    expose_headers=["x-request-id", "retry-after"],
                    # Chrome's Private Network Access asked an allowed public page's preflight
                    # to a loopback address for it, and got a 400.
                    allow_private_network=True,
                    max_age=600,
                ),
                Middleware(
                    BearerAuth, api_keys=[*([api_key] if api_key else []), *api_keys], count=self._count_error
                ),
            ],
            exception_handlers={
                ApiError: self._api_error_response,
                HTTPException: http_error_response,
                Exception: unexpected_error_response,
            },
        )

    def attach(self, server: RequestDesk) -> None:
        self.server = server
        self._attached.set()

    async def _loaded(self) -> None:
        """Once the model has loaded (at most :data:`LOAD_WAIT_S`; then :meth:`_ready`'s 503
        says it is still loading): Ollama's routes wait so (http/flight.py ``ollama_route``)."""
        with trio.move_on_after(LOAD_WAIT_S):
            await self._attached.wait()

    def _counting(self, app: AsgiApp) -> AsgiApp:
        """``app``, counting each request against its connection among the daemon's open
        connections (runtime/clients.py: a lone client's next request needs no burst wait)."""

        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client")
            if scope["type"] == "http" and client and self.server is not None:
                self.server.clients.sent((str(client[0]), int(client[1])))
            if scope["type"] == "http":
                receive = sticky_disconnect(receive)
                UNWATCHED_RECEIVE.set(receive)  # this request's task (and the tasks it starts) only
            await app(scope, receive, send)

        return counted

    async def watch_connection(self, stream: object) -> None:
        """Beside each accepted connection (serve_asgi's ``on_connection``, cancelled when it
        closes): it counts as a request on its way in until its first request reaches the app
        (http/fresh.py), and among the daemon's open connections until it closes
        (runtime/clients.py)."""
        server, peer = self.server, peer_of(stream)
        if server is not None and peer is not None:
            with server.clients.connected(peer):
                await self.fresh.watch(peer, server.loop.arrivals.mark)
                await trio.sleep_forever()

    def _refuse(self, error: ApiError) -> Response:
        log.info("HTTP %d: %s", error.status, error.message)
        self._count_error(error)
        return error_response(error)

    def _count_error(self, error: ApiError) -> None:
        """Refusals count in the daemon's errors as the socket's do: by the daemon's code, else
        by the error object's code or type.  Not counted: 404/405 (they never reach here),
        hang-ups, and errors the decode loop has counted already."""
        if self.server is not None and not error.counted:
            self.server.metrics.on_error(error.uma_code or error.code or error.type)

    async def _api_error_response(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        log.debug("HTTP %d on %s: %s", exc.status, shown(request.url.path), shown(exc.message, 300))
        self._count_error(exc)
        return error_response(exc)

    # -- plain endpoints ---------------------------------------------------------

    async def health(self, request: Request) -> Response:
        server = self.server
        if server is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"retry-after": "1"})
        if not server.loop.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self._keyed and "uma_owner" not in request.scope.get("state", {}):
            # Open to probes without a key, it says only that it serves: the engine summary
            # (devices and their free memory, the CPU, step timings) is for key holders.
            return JSONResponse({"status": "ok", "model": self.model})
        return JSONResponse({"status": "ok", "model": self.model, "engine": server.describe_engine()})

    async def metrics(self, request: Request) -> Response:
        return Response(exposition(self._ready().registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """Every model of the store, with its state (docs/MODELS.md); OpenAI's fields first.
        Each --alias is an entry of its own (as vLLM lists each served name): a client's model
        picker offers the names a request may use."""
        described = self._ready().models.describe()
        names = [(name, m) for m in described for name in (m["id"], *m["aliases"])]
        listed = [openai.Model(id=name, created=self.created, uma=m) for name, m in names]
        return json_response(openai.ModelList(listed))

    async def _model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the model a name names (an id, a file name or
        an alias, as /v1/chat/completions resolves it), as the list shows it (an alias as its
        own entry); 404 else."""
        name = request.path_params["model"]
        found = self.model_for(name)
        described = next((m for m in self._ready().models.describe() if m["id"] == found), None)
        listed = name if described is not None and name in described["aliases"] else found
        return json_response(openai.Model(id=listed, created=self.created, uma=described))

    def model_for(self, name: str) -> str:
        """The id of the model ``name`` names (an id, a file name or an alias); 404 listing
        the daemon's models when it names none."""
        models = self._ready().models
        try:
            found: str | None = models.resolve(name)
        except UmaError:
            found = None
        if found is None:
            available = ", ".join(f"`{n}`" for n in models.store.offered())
            raise ApiError(
                404, f"The model `{shown(name)}` does not exist; this server has {available}",
                param="model", code="model_not_found",
            )  # fmt: skip
        return found

    async def load_or_unload(self, request: Request) -> Response:
        """The seeds' ``POST /load`` and ``POST /unload``: ``{"model", "keep_alive"?}`` →
        ``{"model": ID, "models": [...]}`` (docs/MODELS.md)."""
        server = self._ready()
        body = decode_body(await self._body(request) or b"{}", _ModelBody)
        op: Literal["load", "unload"] = "load" if request.url.path == "/load" else "unload"
        model = self.model_for(body.model)
        try:
            event = await server.models_op(
                ModelsRequest(type="models", op=op, model=model, keep_alive=body.keep_alive)
            )
        except UmaError as exc:
            raise openai.from_uma_error(exc) from None
        return json_response({"model": model, "models": event.models})

    async def priority(self, request: Request) -> Response:
        self._ready()
        body = openai.decode_json(await self._body(request), PriorityBody)
        owner = request_owner(request)  # another key's requests are not there to move (SECURITY.md)
        # The request the X-Request-Id names, or with n > 1 each of its choices ("ID-0", ...).
        streams = [
            flight.stream
            for fid, flight in self._flights.items()
            if flight.stream is not None and flight.owner == owner
            and (fid == body.id or (fid.startswith(f"{body.id}-") and fid[len(body.id) + 1 :].isdigit()))
        ]  # fmt: skip
        if not streams:
            raise openai.api_error(ErrorCode.UNKNOWN_ID, f"no HTTP request {body.id!r} in flight")
        for stream in streams:
            stream.set_lane(body.priority)
        return JSONResponse({"id": body.id, "priority": body.priority})

    # -- generation --------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, openai.CompletionBody, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, openai.ChatBody, "chatcmpl")

    async def _openai(
        self, request: Request, kind: type[openai.CompletionBody] | type[openai.ChatBody], prefix: str
    ) -> Response:
        server = self._ready()
        # On its way in from here: an idle decode task gathering a burst waits for it.  Nothing
        # below awaits before open_request, which marks it on through tokenizing.
        with server.loop.arrivals.mark():
            data = await self._body(request)
        arrived = trio.current_time()
        body = openai.decode_body(data, kind)
        body = msgspec.structs.replace(body, model=self.model_for(body.model))  # answers name the id
        completion_id = f"{prefix}-{secrets.token_hex(12)}"
        translated = openai.translate(
            body, request_id=completion_id, lane_header=request.headers.get(openai.LANE_HEADER),
            max_tokens_limit=server.config.max_tokens,
        )  # fmt: skip
        translated.request = msgspec.structs.replace(translated.request, model=body.model)
        if not translated.auto_max_tokens:
            translated.request = with_ceiling(self, translated.request, body.model)
        owner = request_owner(request)
        if translated.n > 1:
            # Sessions less the ids pinned snapshots hold, and the queue: the most ever admitted.
            kv = server.loop.kv  # of the cached ids, those no request may take: pinned
            pinned = kv.cached_seqs - (kv.available_seqs() - kv.free_seqs)
            room = server.config.max_sessions - pinned + server.config.max_queue
            if translated.n > room:  # never all admitted: not a 429 to retry for ever
                held = f"this daemon holds at most {room} requests at once (free sessions and queue)"
                raise ApiError(400, f"n={translated.n}: {held}", param="n")
            # Each choice is an HTTP request in flight, of this key's share where keys are several.
            most = self.max_requests - (kept_for_others(self.max_requests) if self._principals > 1 else 0)
            if translated.n > most:
                whose = " of one key" if self._principals > 1 else ""
                held = f"at most {most} HTTP requests{whose} may be in flight at once (--max-connections)"
                raise ApiError(400, f"n={translated.n}: {held}", param="n")
            return await self._choices(request, body, translated, arrived, owner, completion_id)
        async with self._in_flight(translated.request, arrived, translated.auto_max_tokens, owner) as flight:
            return await self._openai_response(request, body, flight, completion_id, translated)

    async def _openai_response(
        self,
        request: Request,
        body: openai.CompletionBody | openai.ChatBody,
        flight: Flight,
        completion_id: str,
        translated: openai.Translated,
    ) -> Response:
        created, include_usage = int(time.time()), translated.include_usage
        is_chat = isinstance(body, openai.ChatBody)
        headers = {"x-request-id": completion_id}
        if not body.stream:
            eos = completed(await self._collect(request, flight))
            if is_chat:
                answer = openai.chat_completion(
                    completion_id, created, body.model, eos, translated.legacy_functions
                )
                return json_response(answer, headers=headers)
            return json_response(
                openai.text_completion(completion_id, created, body.model, eos), headers=headers
            )

        assert flight.stream is not None
        chunks: openai.ChatStream | openai.CompletionStream
        if flight.stream.tool_format is not None:
            fmt, formatted = flight.stream.tool_format, flight.stream.formatted
            chunks = openai.ToolChatStream(completion_id, created, body.model, include_usage, fmt, formatted)
        else:
            stream_kind = openai.ChatStream if is_chat else openai.CompletionStream
            chunks = stream_kind(completion_id, created, body.model, include_usage)
        chunks.legacy = translated.legacy_functions

        async def sse() -> AsyncGenerator[bytes, None]:
            async with aclosing(self._beating_events(flight)) as events:
                for head in chunks.head():
                    yield openai.sse(_json.encode(head))
                async for event in events:
                    match event:
                        case Beat():
                            yield openai.SSE_KEEPALIVE
                        case TokenEvent(text=text, logprobs=logprobs):
                            for chunk in chunks.token(text, logprobs):
                                yield openai.sse(_json.encode(chunk))
                        case EosEvent(reason="stop" | "length"):
                            for chunk in chunks.end(event):
                                yield openai.sse(_json.encode(chunk))
                            yield openai.SSE_DONE
                        case EosEvent(reason="cancelled"):
                            yield openai.sse(_json.encode(openai.ended_early(event).body()))
                        case ErrorEvent(code=code, message=message):
                            error = openai.api_error(ErrorCode(code), message)
                            yield openai.sse(_json.encode(error.body()))
                        case _:  # eos(error) follows its error event: nothing more to say
                            pass

        return self._event_stream(sse, flight, headers)

    async def _choices(
        self,
        request: Request,
        body: openai.CompletionBody | openai.ChatBody,
        translated: openai.Translated,
        arrived: float,
        owner: str,
        completion_id: str,
    ) -> Response:
        """``n`` > 1 (not streamed): choice 0 first, the others once its first token shows
        its prompt is in the KV cache, so they copy it (protocol/openai_choices.py)."""
        requests = choice_requests(translated.request, translated.n)
        if body.stream:
            return await self._streamed_choices(body, translated, requests, arrived, owner, completion_id)
        collected: list[list[ServerEvent]] = [[] for _ in requests]
        flights: list[Flight] = []
        refusal: list[ApiError] = []  # raised while being admitted: answered after the nurseries

        async def pump(i: int, flight: Flight, first: trio.Event | None) -> None:
            async with aclosing(self._events(flight)) as events:
                async for event in events:
                    collected[i].append(event)
                    if first is not None:
                        first.set()

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                first = trio.Event()
                for i, choice in enumerate(requests):
                    if i == 1:
                        await first.wait()
                    try:
                        flight = await self._begin(
                            _in_lane_of(choice, flights), arrived, auto_max_tokens=translated.auto_max_tokens,
                            owner=owner,
                        )  # fmt: skip
                    except ApiError as exc:  # raised in here, a nursery would wrap it in a group
                        refusal.append(exc)
                        nursery.cancel_scope.cancel()
                        return
                    flights.append(flight)
                    nursery.start_soon(pump, i, flight, first if i == 0 else None)

        try:
            await until_disconnect(request.receive, run)
        finally:
            for flight in flights:
                self._end(flight)
        if refusal:
            raise refusal[0]
        for events in collected:
            completed(events)  # raises the error to answer instead, if a choice failed
        eos = [whole_eos(events) for events in collected]
        created = int(time.time())
        if isinstance(body, openai.ChatBody):
            answer: Any = merged_chat(completion_id, created, body.model, eos, translated.legacy_functions)
        else:
            answer = merged_text(completion_id, created, body.model, eos)
        return json_response(answer, headers={"x-request-id": completion_id})

    async def _streamed_choices(
        self,
        body: openai.CompletionBody | openai.ChatBody,
        translated: openai.Translated,
        requests: list[GenerateRequest],
        arrived: float,
        owner: str,
        completion_id: str,
    ) -> Response:
        """``n`` > 1, streamed: each choice's chunks under its index, as they come.  Choice 0
        is admitted before the answer starts (a refusal is its HTTP status); the others once
        its first token is out, beside the stream, a refusal then an error event."""
        auto, n = translated.auto_max_tokens, len(requests)
        flights = [await self._begin(requests[0], arrived, auto_max_tokens=auto, owner=owner)]
        # Bounded: a client that stops reading stops the pumps, so each choice's own channel
        # fills and the loop parks it (unbounded, every choice ran on to max_tokens).
        send, receive = trio.open_memory_channel[tuple[int, ServerEvent | ApiError]](n)

        async def pump(i: int, flight: Flight, started: trio.Event | None) -> None:
            async with aclosing(self._events(flight)) as events:
                async for event in events:
                    if started is not None:
                        started.set()
                    await send.send((i, event))

        async def companion() -> None:
            async with send, trio.open_nursery() as nursery:
                started = trio.Event()
                nursery.start_soon(pump, 0, flights[0], started)
                await started.wait()
                for i in range(1, n):
                    try:
                        choice = _in_lane_of(requests[i], flights)
                        flights.append(await self._begin(choice, arrived, auto_max_tokens=auto, owner=owner))
                    except ApiError as exc:
                        await send.send((i, exc))
                        return
                    nursery.start_soon(pump, i, flights[-1], None)

        created, is_chat = int(time.time()), isinstance(body, openai.ChatBody)
        first = flights[0].stream
        fmt = first.tool_format if first is not None else None
        formatted = first is not None and first.formatted
        streams: list[openai.ChatStream | openai.CompletionStream] = []
        for i in range(n):
            if fmt is not None:  # every choice offers the same tools
                streams.append(
                    openai.ToolChatStream(
                        completion_id, created, body.model, translated.include_usage, fmt, formatted
                    )
                )
            else:
                kind = openai.ChatStream if is_chat else openai.CompletionStream
                streams.append(kind(completion_id, created, body.model, translated.include_usage))
            streams[-1].index, streams[-1].legacy = i, translated.legacy_functions

        async def sse() -> AsyncGenerator[bytes, None]:
            for stream in streams:
                for head in stream.head():
                    yield openai.sse(_json.encode(head))
            ended: list[EosEvent] = []
            async for i, item in receive:
                match item:
                    case TokenEvent(text=text, logprobs=logprobs):
                        for chunk in streams[i].token(text, logprobs):
                            yield openai.sse(_json.encode(chunk))
                    case EosEvent(reason="stop" | "length"):
                        for chunk in streams[i].end(item, with_usage=False):
                            yield openai.sse(_json.encode(chunk))
                        ended.append(item)
                        if len(ended) == n:
                            if streams[0].wants_usage:
                                yield openai.sse(_json.encode(streams[0].usage_chunk(merged_usage(ended))))
                            yield openai.SSE_DONE
                            return
                    case EosEvent(reason="cancelled"):
                        yield openai.sse(_json.encode(openai.ended_early(item).body()))
                        return
                    case ErrorEvent(code=code, message=message):
                        yield openai.sse(_json.encode(openai.api_error(ErrorCode(code), message).body()))
                        return
                    case ApiError():  # a choice refused once the stream began
                        self._count_error(item)
                        yield openai.sse(_json.encode(item.body()))
                        return
                    case _:
                        pass

        def close() -> None:
            for flight in flights:
                self._end(flight)

        stall = self._ready().config.stall_timeout_s

        def on_stall() -> None:
            for flight in flights:
                if flight.stream is not None:
                    flight.stream.cancel("stalled")

        return EventStream(
            sse, on_close=close, headers={"x-request-id": completion_id},
            stall_timeout_s=stall, on_stall=on_stall, companion=companion,
        )  # fmt: skip

    async def infill(self, request: Request) -> Response:
        """llama-server's ``POST /infill`` (protocol/llama_server.py), for editors' code
        completion: interactive unless asked otherwise, cancelled when the editor hangs up."""
        server = self._ready()
        with server.loop.arrivals.mark():  # as in _openai
            data = await self._body(request)
        arrived = trio.current_time()
        rid = f"infill-{secrets.token_hex(12)}"
        body = openai.decode_json(data, InfillBody)
        headers = {"x-request-id": rid}
        limit = n_predict(body)
        try:  # with no limit, the same checks as a request that generates
            limits = answer_limits(self, self.model)
            asked = body if limit != 0 else msgspec.structs.replace(body, n_predict=None, max_tokens=None)
            generate_request = infill_request(asked, rid, limits.max_tokens, limits.context)
        except (msgspec.ValidationError, ValueError) as exc:
            raise openai.validation_error(exc) from None
        if limit == 0:  # llama-server only warms its cache: no prefill-only request here
            if not fill_in_middle(server.loop.engine):  # an editor's warm-up must learn it too
                raise openai.api_error(ErrorCode.MODEL, NO_FIM_TOKENS)
            answer = no_tokens_answer(self.model)
            if body.stream:
                event = openai.sse(_json.encode(answer))
                return Response(event, media_type="text/event-stream", headers=headers)
            return json_response(answer, headers=headers)
        # No limit given: up to --max-tokens, within the context's room (as chat's default).
        owner = request_owner(request)
        async with self._in_flight(generate_request, arrived, limit is None, owner) as flight:
            if not generate_request.stream:
                eos = completed(await self._collect(request, flight))
                return json_response(infill_answer(eos, self.model, eos.text or ""), headers=headers)

            async def sse() -> AsyncGenerator[bytes, None]:
                async with aclosing(self._beating_events(flight)) as events:
                    async for event in events:
                        match event:
                            case Beat():
                                yield openai.SSE_KEEPALIVE
                            case TokenEvent(text=text):
                                yield openai.sse(_json.encode(InfillAnswer(content=text, stop=False)))
                            case EosEvent(reason="stop" | "length"):
                                yield openai.sse(_json.encode(infill_answer(event, self.model, "")))
                            case EosEvent(reason="cancelled"):  # a stall, shutdown: say so, as chat's
                                yield openai.sse(_json.encode(openai.ended_early(event).body()))
                            case ErrorEvent(code=code, message=message):
                                error = openai.api_error(ErrorCode(code), message)
                                yield openai.sse(_json.encode(error.body()))
                            case _:
                                pass

            return self._event_stream(sse, flight, headers)

    async def generate(self, request: Request) -> Response:
        """The socket protocol over HTTP: its request body, its events as SSE (or, with
        ``"stream": false``, the eos event as JSON)."""
        with self._ready().loop.arrivals.mark():  # as in _openai
            data = await self._body(request)
        arrived = trio.current_time()
        generate_request = _generate_request(data)
        lane = openai.lane_from_header(request.headers.get(openai.LANE_HEADER))
        if lane is not None:
            generate_request = msgspec.structs.replace(generate_request, priority=lane)
        async with self._in_flight(generate_request, arrived, False, request_owner(request)) as flight:
            headers = {"x-request-id": generate_request.id}
            if not generate_request.stream:
                return json_response(last_word(await self._collect(request, flight)), headers=headers)

            async def sse() -> AsyncGenerator[bytes, None]:
                async with aclosing(self._beating_events(flight)) as events:
                    async for event in events:
                        beat = isinstance(event, Beat)
                        yield openai.SSE_KEEPALIVE if beat else openai.sse(_json.encode(event))

            return self._event_stream(sse, flight, headers)

    # -- plumbing ----------------------------------------------------------------

    def _ready(self) -> RequestDesk:
        server = self.server
        if server is None:
            message = "the model is still loading; retry shortly"
            raise ApiError(503, message, type="server_error", code="loading")
        return server

    async def _arriving(self, request: Request) -> tuple[bytes, float]:
        """A generation request's body and when it was in: while it is read it counts as on
        its way in, so an idle decode task gathering a burst waits for it."""
        with self._ready().loop.arrivals.mark():
            data = await self._body(request)
        return data, trio.current_time()

    async def _body(self, request: Request) -> bytes:
        """The request body, refused (413) past ``max_body_bytes`` without reading it all."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        # A deadline for the whole body (hypercorn has none once the headers are in): a client
        # that stops mid-body would otherwise hold its connection, and a descriptor, for good.
        with trio.move_on_after(self.body_timeout_s) as deadline:
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise self._too_large()
                    chunks.append(chunk)
            except ClientDisconnect:
                raise client_gone() from None
        if deadline.cancelled_caught:
            error = openai.api_error(
                ErrorCode.FRAME_TIMEOUT,
                f"the request body did not arrive within {self.body_timeout_s:g} s ({size} bytes came)",
            )
            error.close_connection = True
            raise error
        data = b"".join(chunks)
        try:  # every body is JSON: refused as a whole, whichever field the bad bytes are in
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise openai.api_error(
                ErrorCode.INVALID_UTF8, f"the body is not valid UTF-8 (byte {exc.start})"
            ) from None
        return data

    def _too_large(self) -> ApiError:
        limit = self.max_body_bytes
        error = openai.api_error(ErrorCode.FRAME_TOO_LARGE, f"the body exceeds the limit of {limit} bytes")
        # The rest of the body is never read: the connection cannot carry another request.
        error.close_connection = True
        return error

    @asynccontextmanager
    async def _in_flight(
        self, generate_request: GenerateRequest, arrived: float, auto_max_tokens: bool, owner: str
    ) -> AsyncIterator[Flight]:
        """The request lifecycle guard: a registered request is released if anything raises
        before its response owns it (:class:`EventStream` and :meth:`_collect` release it
        however they end).  Without it, a failure in between (once, a header that would not
        encode) left the id taken and the session parked for good."""
        flight = await self._begin(generate_request, arrived, auto_max_tokens=auto_max_tokens, owner=owner)
        try:
            yield flight
        except BaseException:
            self._end(flight)
            raise

    async def _begin(
        self, generate_request: GenerateRequest, arrived: float, *, auto_max_tokens: bool, owner: str
    ) -> Flight:
        """Admit one generation request: its id and a place among the HTTP requests in flight
        are taken before it is tokenized, so neither can be handed out twice."""
        server = self._ready()
        if not server.loop.accepting:
            raise openai.api_error(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if len(self._flights) >= self.max_requests:
            raise openai.api_error(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"at most {self.max_requests} HTTP requests may be in flight; try again later",
            )
        held = sum(1 for other in self._flights.values() if other.owner == owner)
        if self._principals > 1 and held >= self.max_requests - kept_for_others(self.max_requests):
            raise openai.api_error(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"{held} of the {self.max_requests} HTTP requests that may be in flight are this"
                " key's; the rest are kept for other keys; try again later",
            )
        rid = generate_request.id
        if rid in self._flights:
            raise openai.api_error(ErrorCode.DUPLICATE_ID, f"request {rid!r} is already in flight")
        flight = self._flights[rid] = Flight(rid, owner)

        refused: list[Exception] = []  # raised out of the watching nursery as itself, not a group

        async def opening() -> None:
            try:
                flight.stream = await server.open_request(
                    generate_request, arrived, connection=server.next_connection_number(),
                    owner=owner, auto_max_tokens=auto_max_tokens,
                )  # fmt: skip
            except Exception as exc:
                refused.append(exc)

        try:
            # A client that hangs up while its request waits (for a model's load, or room to
            # load it: up to a minute) gives its place up: nobody would read the answer, and a
            # load for it would unload a model others use.
            receive = UNWATCHED_RECEIVE.get()  # None where a watcher runs already
            await (opening() if receive is None else until_disconnect(receive, opening))
            if refused:
                raise refused[0]
            if flight.stream is None:  # hung up before it was queued (its grammar's compile, a load)
                server.metrics.on_finished(
                    generate_request.priority, "cancelled", trio.current_time(), computed_tokens=0,
                    cancel_reason="disconnect",
                )  # fmt: skip
                raise client_gone()
        except UmaError as exc:
            self._end(flight)
            raise openai.from_uma_error(exc, generate_request) from None
        except BaseException:
            self._end(flight)
            raise
        return flight

    def _event_stream(
        self, sse: Callable[[], AsyncGenerator[bytes, None]], flight: Flight, headers: dict[str, str]
    ) -> EventStream:
        assert self.server is not None and flight.stream is not None
        stream, stall = flight.stream, self.server.config.stall_timeout_s
        return EventStream(
            sse, on_close=lambda: self._end(flight), headers=headers,
            stall_timeout_s=stall, on_stall=lambda: stream.cancel("stalled"), queued=lambda: stream.queued,
        )  # fmt: skip

    def _end(self, flight: Flight) -> None:
        """The request is over for its client: cancel it if it still runs (a no-op after its
        eos) and give back its place.  Idempotent; reached however the response ends."""
        if flight.stream is not None:
            flight.stream.cancel(flight.stream.gone_reason())
        if self._flights.get(flight.id) is flight:
            del self._flights[flight.id]

    def _events(self, flight: Flight) -> AsyncGenerator[ServerEvent, None]:
        assert self.server is not None and flight.stream is not None
        return self._ending(flight, deliver(self.server, flight.stream))

    def _beating_events(self, flight: Flight) -> AsyncGenerator[ServerEvent | Beat, None]:
        """:meth:`_events` for an event stream: a :class:`Beat` after each ``--sse-keepalive``
        seconds without an event."""
        assert self.server is not None and flight.stream is not None
        every = self.server.config.sse_keepalive_s or math.inf
        return self._ending(flight, deliver(self.server, flight.stream, every))

    async def _ending(
        self, flight: Flight, delivered: AsyncGenerator[EventT, None]
    ) -> AsyncGenerator[EventT, None]:
        """``delivered``'s events; the flight ends with them, however they end."""
        try:
            async with aclosing(delivered) as events:
                async for event in events:
                    yield event
        finally:
            self._end(flight)

    async def _collect(self, request: Request, flight: Flight) -> list[ServerEvent]:
        """All events of a non-streamed request; a disconnect meanwhile cancels it."""
        collected: list[ServerEvent] = []

        async def collect() -> None:
            async with aclosing(self._events(flight)) as events:
                async for event in events:
                    collected.append(event)

        try:
            await until_disconnect(request.receive, collect)
        finally:
            self._end(flight)
        return collected


class _ModelBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    keep_alive: float | None = None


def _generate_request(data: bytes) -> GenerateRequest:
    """A socket-protocol generate request from an HTTP body; ``id`` is optional here."""
    obj = openai.decode_json(data, Any)
    if isinstance(obj, dict):
        obj.setdefault("id", f"gen-{secrets.token_hex(12)}")
        data = _json.encode(obj)
    try:
        message = decode_client_message(data)
    except UmaError as exc:
        raise openai.from_uma_error(exc) from None
    if not isinstance(message, GenerateRequest):
        raise ApiError(400, "POST /generate takes a generate request", param="type")
    return message


def _in_lane_of(choice: GenerateRequest, flights: Sequence[Flight]) -> GenerateRequest:
    """A later choice of an ``n`` > 1 request, in the lane its first choice is in now: a
    ``/priority`` move that came before it started moves it too (it started in the old one)."""
    first = flights[0].stream if flights else None
    return choice if first is None else msgspec.structs.replace(choice, priority=first.lane)
