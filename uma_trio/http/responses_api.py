"""OpenAI's Responses API on the gateway, stateless (protocol/responses_api.py has the shapes),
on the same request path as the other routes."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..protocol import responses_api as api
from ..protocol.errors import ErrorCode
from ..protocol.messages import EosEvent, ErrorEvent, TokenEvent, TokenLogprob
from ..protocol.openai import LANE_HEADER, ApiError, api_error, ended_early
from ..protocol.openai_logprobs import openai_named
from ..protocol.responses_tools import call_items, new_id
from ..protocol.tool_text import ToolTextFilter
from ..runtime.delivery import Beat
from .auth import request_owner
from .flight import Flight, GatewayCore, completed, decode_body, with_ceiling
from .responses import json_response


class ResponsesApi:
    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        gateway = self.gateway
        data, arrived = await gateway._arriving(request)
        body = self._body(data)
        response_id, created = new_id("resp"), api.now()
        # The request's id is the response's (its X-Request-Id, for /priority).
        generate_request, names = api.responses_request(body, response_id, request.headers.get(LANE_HEADER))
        generate_request = msgspec.structs.replace(generate_request, model=body.model)
        auto = body.max_output_tokens is None
        if not auto:
            generate_request = with_ceiling(gateway, generate_request, body.model)
        try:
            async with gateway._in_flight(generate_request, arrived, auto, request_owner(request)) as flight:
                headers = {"x-request-id": response_id}
                if body.stream:
                    return gateway._event_stream(
                        lambda: self._events(flight, body, response_id, created), flight, headers
                    )
                events = await gateway._collect(request, flight)
                eos = completed(events)
                text = (
                    eos.content
                    if eos.content is not None
                    else "".join(e.text for e in events if isinstance(e, TokenEvent))
                )
                tokens = [x for e in events if isinstance(e, TokenEvent) for x in e.logprobs or ()]
                logprobs = openai_named(tokens)
                output = api.answer_items(new_id("msg"), text, eos, body, logprobs)
                return json_response(
                    api.response_object(response_id, created, body, output, eos), headers=headers
                )
        except ApiError as exc:  # the daemon's checks (--max-tokens, ...) name the chat's fields
            raise api.as_sent(exc, names) from None

    async def _events(
        self, flight: Flight, body: api.ResponsesBody, response_id: str, created: int
    ) -> AsyncGenerator[bytes, None]:
        assert flight.stream is not None
        fmt = flight.stream.tool_format
        text_filter = ToolTextFilter(fmt, flight.stream.formatted) if fmt is not None else None
        sequence = 0

        def event(name: str, data: dict[str, Any]) -> bytes:
            nonlocal sequence
            sequence += 1
            payload = msgspec.json.encode({"type": name, "sequence_number": sequence - 1, **data})
            return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"

        begun = api.response_object(response_id, created, body, [], None)
        yield event("response.created", {"response": begun})
        yield event("response.in_progress", {"response": begun})
        msg_id, text, opened, output = new_id("msg"), "", False, []
        # Tokens' log-probabilities (include's LOGPROBS) go with the delta that shows their
        # text: those of text the tool filter holds back wait for it; all of them at the end.
        pending: list[TokenLogprob] = []
        every: list[TokenLogprob] = []
        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}

        def open_text() -> list[bytes]:
            return [
                event(
                    "response.output_item.added",
                    {"output_index": 0, "item": api.message_item(msg_id, "", "in_progress")},
                ),
                event("response.content_part.added", {**where, "part": api.output_text("")}),
            ]

        async with aclosing(self.gateway._beating_events(flight)) as events:
            async for item in events:
                match item:
                    case Beat():  # still reading the prompt, or waiting: said again, as progress
                        yield event("response.in_progress", {"response": begun})
                    case TokenEvent(text=piece, logprobs=logprobs):
                        named = openai_named(logprobs or ())
                        pending += named
                        every += named
                        shown = text_filter.feed(piece) if text_filter is not None else piece
                        if not shown:
                            continue
                        if not opened:
                            for chunk in open_text():
                                yield chunk
                            opened = True
                        text += shown
                        yield event(
                            "response.output_text.delta", {**where, "delta": shown, "logprobs": pending}
                        )
                        pending = []
                    case EosEvent(reason="stop" | "length"):
                        # The text the filter held back, after the calls too (as chat streams do).
                        rest = text_filter.rest(item.content or "") if text_filter else ""
                        if not opened and (rest or not item.tool_calls):  # an empty answer too, as unstreamed
                            for chunk in open_text():
                                yield chunk
                            opened = True
                        if rest or (opened and pending):  # the last tokens' logprobs, with or without text
                            text += rest
                            yield event(
                                "response.output_text.delta", {**where, "delta": rest, "logprobs": pending}
                            )
                        if opened:
                            yield event(
                                "response.output_text.done", {**where, "text": text, "logprobs": every}
                            )
                            yield event(
                                "response.content_part.done", {**where, "part": api.output_text(text, every)}
                            )
                            output.append(api.message_item(msg_id, text, api.message_status(item), every))
                            yield event("response.output_item.done", {"output_index": 0, "item": output[-1]})
                        for call in call_items(item, body.tools):
                            index = len(output)
                            for chunk in _call_events(event, call, index):
                                yield chunk
                            output.append(call)
                        final = api.response_object(response_id, created, body, output, item)
                        yield event("response.completed", {"response": final})
                    case EosEvent(reason="cancelled"):
                        ended = ended_early(item)  # its message begins with the daemon's code too
                        failed = api.failed_object(
                            response_id, created, body, output, ended.status, f"{ended.code}: {ended.message}"
                        )
                        yield event("response.failed", {"response": failed})
                    case ErrorEvent(code=code, message=message):
                        error = api_error(ErrorCode(code), message)
                        failed = api.failed_object(
                            response_id, created, body, output, error.status, f"{error.code}: {error.message}"
                        )
                        yield event("response.failed", {"response": failed})
                    case _:
                        pass

    def _body(self, data: bytes) -> api.ResponsesBody:
        body = decode_body(data, api.ResponsesBody)
        return msgspec.structs.replace(body, model=self.gateway.model_for(body.model))


def _call_events(
    event: Callable[[str, dict[str, Any]], bytes], call: dict[str, Any], index: int
) -> list[bytes]:
    """A call item's events, whole: added, its arguments (or a custom tool's input), done."""
    custom = call["type"] == "custom_tool_call"
    field, kind = ("input", "custom_tool_call_input") if custom else ("arguments", "function_call_arguments")
    ids = {"item_id": call["id"], "output_index": index}
    done = {**ids, field: call[field]} if custom else {**ids, field: call[field], "name": call["name"]}
    return [
        event(
            "response.output_item.added",
            {"output_index": index, "item": {**call, field: "", "status": "in_progress"}},
        ),
        event(f"response.{kind}.delta", {**ids, "delta": call[field]}),
        event(f"response.{kind}.done", done),
        event("response.output_item.done", {"output_index": index, "item": call}),
    ]
