"""Anthropic's Messages API on the gateway (protocol/anthropic.py has the shapes), on the
same request path as the other routes; errors in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..protocol import anthropic
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import EosEvent, ErrorEvent, GenerateRequest, TokenEvent
from ..protocol.ollama import Limits
from ..protocol.openai import ApiError, api_error, ended_early, from_uma_error, validation_error
from ..protocol.tool_text import ToolTextFilter
from ..runtime.delivery import Beat
from .auth import request_owner
from .flight import Flight, GatewayCore, answer_limits, answering_as, completed, decode_body
from .responses import json_response

Handler = Callable[[Request], Awaitable[Response]]


class AnthropicApi:
    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", answering_as("anthropic", self.messages), methods=["POST"]),
            Route(
                "/v1/messages/count_tokens", answering_as("anthropic", self.count_tokens), methods=["POST"]
            ),
        ]

    async def count_tokens(self, request: Request) -> Response:
        body = self._body(await self.gateway._body(request))
        generate_request = self._translate(body, "count", count_only=True)
        try:
            tokens = await self.gateway._ready().count_tokens(generate_request)
        except UmaError as exc:
            raise from_uma_error(exc) from None
        return json_response({"input_tokens": tokens})

    async def messages(self, request: Request) -> Response:
        gateway = self.gateway
        data, arrived = await gateway._arriving(request)
        body = self._body(data)
        msg_id = anthropic.message_id()
        # max_tokens is a ceiling, as Ollama's num_predict: Claude Code asks for 32000 and more.
        limits = answer_limits(gateway, body.model)
        generate_request = self._translate(body, msg_id, limits)  # its X-Request-Id, for /priority
        try:
            async with gateway._in_flight(generate_request, arrived, False, request_owner(request)) as flight:
                headers = {"x-request-id": msg_id, "request-id": msg_id}  # the latter Anthropic's
                if not body.stream:
                    events = await gateway._collect(request, flight)
                    eos = completed(events)
                    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
                    return json_response(anthropic.message(msg_id, body.model, eos, text), headers=headers)
                streamed = partial(self._events, flight, msg_id, body.model)
                return gateway._event_stream(streamed, flight, headers)
        except ApiError as exc:  # the admission's refusals (a tool's schema) name Anthropic's fields
            raise anthropic.client_error(exc) from None

    async def _events(self, flight: Flight, msg_id: str, model: str) -> AsyncGenerator[bytes, None]:
        assert flight.stream is not None
        fmt = flight.stream.tool_format
        text_filter = ToolTextFilter(fmt, flight.stream.formatted) if fmt is not None else None
        stream = flight.stream
        index, text_open, started = 0, False, False

        def opening() -> list[bytes]:
            """message_start (and a ping, as Anthropic sends), before the first event: the
            request is admitted by then, so its usage splits the prompt as the end's does
            (unless the first is a keep-alive of a request still queued: nothing cached yet)."""
            nonlocal started
            if started:
                return []
            started = True
            cached = stream.cached_tokens
            usage = {"input_tokens": stream.prompt_tokens - cached, "output_tokens": 0,
                     "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip
            start: dict[str, Any] = {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage,
            }  # fmt: skip
            return [anthropic.event("message_start", {"message": start}), anthropic.event("ping", {})]

        def text_events(piece: str) -> list[bytes]:
            """A text delta, after the text block's start the first time."""
            nonlocal text_open
            if not piece:
                return []
            chunks = []
            if not text_open:
                block = {"index": index, "content_block": {"type": "text", "text": ""}}
                chunks.append(anthropic.event("content_block_start", block))
                text_open = True
            delta = {"index": index, "delta": {"type": "text_delta", "text": piece}}
            return [*chunks, anthropic.event("content_block_delta", delta)]

        async with aclosing(self.gateway._beating_events(flight)) as events:
            async for event in events:
                begun = opening()
                for chunk in begun:
                    yield chunk
                match event:
                    case Beat():  # still reading the prompt, or waiting: a ping, as Anthropic's
                        if not begun:  # the opening ends with one
                            yield anthropic.event("ping", {})
                    case TokenEvent(text=text):
                        shown = text_filter.feed(text) if text_filter is not None else text
                        for chunk in text_events(shown):
                            yield chunk
                    case EosEvent(reason="stop" | "length"):
                        # The text the filter held back, after the calls too (a hermes answer
                        # may go on writing after its <tool_call>).
                        rest = text_filter.rest(event.content or "") if text_filter else ""
                        for chunk in text_events(rest):
                            yield chunk
                        if text_open:
                            yield anthropic.event("content_block_stop", {"index": index})
                            index += 1
                        for block in anthropic.content_blocks(event, ""):
                            if block["type"] != "tool_use":
                                continue
                            opened: dict[str, Any] = {**block, "input": {}}
                            yield anthropic.event(
                                "content_block_start", {"index": index, "content_block": opened}
                            )
                            delta = {
                                "type": "input_json_delta",
                                "partial_json": msgspec.json.encode(block["input"]).decode(),
                            }
                            yield anthropic.event("content_block_delta", {"index": index, "delta": delta})
                            yield anthropic.event("content_block_stop", {"index": index})
                            index += 1
                        delta_end = {
                            "stop_reason": anthropic.stop_reason(event), "stop_sequence": event.stop_sequence,
                        }  # fmt: skip
                        # Cumulative, as Anthropic's: the same input split as message_start's.
                        yield anthropic.event(
                            "message_delta", {"delta": delta_end, "usage": anthropic.usage_of(event)}
                        )
                        yield anthropic.event("message_stop", {})
                    case EosEvent(reason="cancelled"):
                        yield anthropic.event(
                            "error", anthropic.error_body(ended_early(event).message, "overloaded_error")
                        )
                    case ErrorEvent(code=code, message=message):
                        error = api_error(ErrorCode(code), message)
                        yield anthropic.event("error", anthropic.error_body(error.message, "api_error"))
                    case _:
                        pass

    def _body(self, data: bytes) -> anthropic.MessagesBody:
        body = decode_body(data, anthropic.MessagesBody)
        return msgspec.structs.replace(body, model=self.gateway.model_for(body.model))

    def _translate(
        self,
        body: anthropic.MessagesBody,
        rid: str,
        limits: Limits | None = None,
        *,
        count_only: bool = False,
    ) -> GenerateRequest:
        try:
            translated = anthropic.messages_request(body, rid, count_only=count_only, limits=limits)
            return msgspec.structs.replace(translated, model=body.model)
        except (msgspec.ValidationError, ValueError) as exc:
            raise anthropic.client_error(validation_error(exc)) from None
