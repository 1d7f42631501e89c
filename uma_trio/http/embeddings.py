"""The embedding endpoints: OpenAI's ``POST /v1/embeddings`` and Ollama's ``POST /api/embed``
and ``POST /api/embeddings`` (protocol/embeddings.py has the shapes).

Each input is one ``embed`` request through the gateway's lifecycle; a request's inputs run
side by side, at most as many at a time as the engine has sequences, so a long list takes
turns with everybody else instead of filling the queue.  The first input that fails ends
the others and is the answer; a client that hangs up cancels them all.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from contextlib import aclosing
from functools import partial

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..engine.model_card import card_of
from ..protocol import embeddings
from ..protocol.errors import ErrorCode
from ..protocol.messages import CancelReason, EosEvent, ErrorEvent, GenerateRequest, ServerEvent
from ..protocol.ollama import required_model
from ..protocol.ollama_durations import keep_alive_seconds
from ..protocol.openai import LANE_HEADER, ApiError, lane_from_header
from .auth import request_owner
from .event_stream import until_disconnect
from .flight import GatewayCore, completed, decode_body, ollama_route
from .ollama import load_or_unload
from .responses import json_response

SizeCheck = Callable[[int], None]  # refuses a `dimensions` the model's vectors (this size) cannot give


class EmbeddingsApi:
    """The routes; the model names and limits are the gateway's."""

    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [
            Route("/v1/embeddings", self.openai, methods=["POST"]),
            Route("/api/embed", ollama_route(self.gateway, self.ollama_embed), methods=["POST"]),
            Route("/api/embeddings", ollama_route(self.gateway, self.ollama_embeddings), methods=["POST"]),
        ]

    async def openai(self, request: Request) -> Response:
        data, arrived = await self.gateway._arriving(request)
        body = decode_body(data, embeddings.OpenAIBody)
        model = self.gateway.model_for(body.model)
        texts = embeddings.texts_of(body.input)
        if not texts:
            raise ApiError(400, "`input` is empty: give a text or a list of texts", param="input")
        check = partial(embeddings.check_dimensions, body.dimensions)
        ends = await self._embed(request, texts, arrived, model, check=check)
        return json_response(embeddings.openai_answer(model, ends, body.encoding_format or "float"))

    async def ollama_embed(self, request: Request) -> Response:
        data, arrived = await self.gateway._arriving(request)
        body = decode_body(data or b"{}", embeddings.OllamaEmbedBody)
        model = self.gateway.model_for(required_model(body.model))
        keep_alive = keep_alive_seconds(body.keep_alive)
        texts = embeddings.ollama_texts(body.input)
        ends, load_s = [], 0.0
        if not texts:  # Ollama's load call (with keep_alive 0 its unload call), answered at once
            _, load_s = await load_or_unload(self.gateway, model, keep_alive)
        else:
            check = partial(embeddings.check_ollama_dimensions, body.dimensions)
            try:
                ends = await self._embed(
                    request, texts, arrived, model, check=check, truncate=body.truncate, keep_alive=keep_alive
                )
            except ApiError as exc:  # the daemon's message names no field of Ollama's: this one
                if exc.uma_code == ErrorCode.CONTEXT_OVERFLOW:
                    exc.message += "; truncate: true cuts it to fit"
                raise
        total_s = trio.current_time() - arrived
        return json_response(
            embeddings.ollama_embed_answer(body.model, ends, total_s, body.dimensions, load_s)
        )

    async def ollama_embeddings(self, request: Request) -> Response:
        data, arrived = await self.gateway._arriving(request)
        body = decode_body(data or b"{}", embeddings.OllamaEmbeddingsBody)
        model = self.gateway.model_for(required_model(body.model))
        keep_alive = keep_alive_seconds(body.keep_alive)
        if not body.prompt:  # as Ollama: an empty prompt loads the model and has an empty embedding
            await load_or_unload(self.gateway, model, keep_alive)
            return json_response({"embedding": []})
        # Ollama's older endpoint gives the vector as pooled, not scaled to unit length.
        (end,) = await self._embed(
            request, [body.prompt], arrived, model, normalize=False, truncate=True, keep_alive=keep_alive
        )
        return json_response({"embedding": end.embedding})

    # -- the request path -----------------------------------------------------------

    async def _embed(
        self,
        request: Request,
        texts: list[str],
        arrived: float,
        model: str,
        *,
        check: SizeCheck | None = None,
        normalize: bool = True,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> list[EosEvent]:
        """Each text's eos (its embedding) from ``model``, in order; the first failure is
        raised, and what ``check`` refuses of the model's embedding size: before any input
        runs where the size is known (a loaded model), else once the vectors are in."""
        gateway, owner = self.gateway, request_owner(request)
        if check is not None and (n_embd := await self._n_embd(model)) is not None:
            check(n_embd)
        lane = lane_from_header(request.headers.get(LANE_HEADER)) or "background"
        rid = f"embd-{secrets.token_hex(12)}"
        requests = embeddings.embed_requests(
            texts, rid, lane, model, normalize=normalize, truncate=truncate, keep_alive=keep_alive
        )
        collected: list[list[ServerEvent]] = [[] for _ in requests]
        refusal: list[ApiError] = []  # raised while being admitted (busy, shutting down, too long)
        limiter = trio.CapacityLimiter(max(1, gateway._ready().loop.engine.n_seq_max))
        failed = False  # one input failed: the rest end for the client, which has not hung up

        def gone_reason() -> CancelReason:  # (they were counted as disconnects)
            return "client" if failed else "disconnect"

        async def one(i: int, embed: GenerateRequest, nursery: trio.Nursery) -> None:
            nonlocal failed
            async with limiter:
                try:
                    async with gateway._in_flight(embed, arrived, False, owner) as flight:
                        assert flight.stream is not None
                        flight.stream.gone_reason = gone_reason
                        async with aclosing(gateway._events(flight)) as events:
                            async for event in events:
                                collected[i].append(event)
                except ApiError as exc:
                    if exc.param == "input" and len(requests) > 1:  # which text: input[i]
                        exc.param, exc.message = f"input[{i}]", f"input[{i}]: {exc.message}"
                    refusal.append(exc)
            if refusal or any(isinstance(e, ErrorEvent) for e in collected[i]):
                failed = True  # the answer is its error
                nursery.cancel_scope.cancel()

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                for i, embed in enumerate(requests):
                    nursery.start_soon(one, i, embed, nursery)

        await until_disconnect(request.receive, run)
        if refusal:
            raise refusal[0]
        for events in collected:  # the failure, not the inputs it cut short
            if any(isinstance(e, ErrorEvent) for e in events):
                completed(events)
        ends = [completed(events) for events in collected]
        if check is not None:
            check(len(ends[0].embedding or ()))
        return ends

    async def _n_embd(self, model: str) -> int | None:
        """``model``'s embedding size: its engine's where loaded, else what its file says
        (engine/model_card.py, no weights read); None where neither says."""
        desk = self.gateway._ready()
        if desk.models.store.entry(model).primary:
            described = desk.describe_engine()
        elif (unit := desk.models.units.get(model)) is not None and unit.loaded.describe is not None:
            described = unit.loaded.describe()
        else:
            try:
                card = await trio.to_thread.run_sync(card_of, desk.models.store.entry(model).path)
            except OSError:
                return None
            return card.embedding_length if card is not None else None
        n_embd = described.get("model", {}).get("n_embd")
        return n_embd if isinstance(n_embd, int) else None
