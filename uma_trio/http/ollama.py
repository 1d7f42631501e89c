"""Ollama's native API on the gateway (protocol/ollama.py has the shapes): the same request
path as the OpenAI routes (lanes, limits, the prefix cache, cancel on disconnect), answers
as NDJSON lines, errors as ``{"error": "..."}``."""

from __future__ import annotations

import datetime
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..protocol import ollama
from ..protocol.errors import ErrorCode
from ..protocol.messages import EosEvent, ErrorEvent, GenerateRequest, TokenEvent
from ..protocol.openai import ApiError, api_error, ended_early, validation_error
from .auth import request_owner
from .flight import GatewayCore, answering_as, completed, decode_body
from .responses import json_response

_json = msgspec.json.Encoder()
Handler = Callable[[Request], Awaitable[Response]]


class OllamaApi:
    """The routes; they run requests through the gateway's lifecycle (admit, stream or
    collect, end)."""

    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [
            Route("/", answering_as("ollama", self.root), methods=["GET", "HEAD"]),
            Route("/api/version", answering_as("ollama", self.version), methods=["GET"]),
            Route("/api/tags", answering_as("ollama", self.tags), methods=["GET", "HEAD"]),
            Route("/api/ps", answering_as("ollama", self.ps), methods=["GET"]),
            Route("/api/show", answering_as("ollama", self.show), methods=["POST"]),
            Route("/api/chat", answering_as("ollama", self.chat), methods=["POST"]),
            Route("/api/generate", answering_as("ollama", self.generate), methods=["POST"]),
        ]

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return json_response(ollama.Version())

    async def tags(self, request: Request) -> Response:
        return json_response(ollama.ModelList([self._entry()]))

    async def ps(self, request: Request) -> Response:
        # Loaded for good: it expires when the daemon stops, a year from now as far as a
        # client's countdown goes.
        later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)
        entry = self._entry()
        summary = self.gateway._ready().describe_engine()
        layers = summary["gpu_layers"]
        entry.expires_at = later.isoformat().replace("+00:00", "Z")
        entry.size_vram = entry.size * layers["offloaded"] // max(1, layers["total"])
        entry.context_length = self.gateway._ready().loop.engine.n_ctx_seq
        return json_response(ollama.ModelList([entry]))

    async def show(self, request: Request) -> Response:
        body = self._decode(await self.gateway._body(request), ollama.ShowBody)
        self._check_model(body.model or body.name or "")
        engine = self.gateway._ready().loop.engine
        template = engine.chat_template_source or ""
        capabilities = ["completion", "tools"]  # tools: through the template or the generic format
        try:
            engine.tokenize_infill("", "")
            capabilities.append("insert")
        except ValueError:  # NoFimTokens
            pass
        info = {
            "general.architecture": "llama", "general.name": self.gateway.model,
            "llama.context_length": engine.n_ctx_seq,
        }  # fmt: skip
        return json_response(
            ollama.ShowAnswer(
                modelfile=f"FROM {self.gateway.model}",
                parameters="",
                template=template,
                details=self._details(),
                model_info=info,
                capabilities=capabilities,
                modified_at=ollama.now_rfc3339(),
            )
        )

    async def chat(self, request: Request) -> Response:
        return await self._run(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self._run(request, "generate")

    # -- the request path -----------------------------------------------------------

    async def _run(self, request: Request, kind: ollama.Kind) -> Response:
        gateway = self.gateway
        data, arrived = await gateway._arriving(request)
        rid = f"ollama-{secrets.token_hex(12)}"
        body: ollama.ChatBody | ollama.GenerateBody
        if kind == "chat":
            body = self._decode(data, ollama.ChatBody)
        else:
            body = self._decode(data, ollama.GenerateBody)
        self._check_model(body.model)
        if isinstance(body, ollama.GenerateBody) and not (body.prompt or body.suffix):
            # Ollama loads the model on an empty prompt and answers done at once.
            return json_response(ollama.Chunk(model=body.model, created_at=ollama.now_rfc3339(), done=True,
                                              response="", done_reason="load"))  # fmt: skip
        generate_request = self._translate(body, rid)
        # Without num_predict Ollama generates until the context is full (or the model ends).
        auto = not (body.options and body.options.num_predict and body.options.num_predict > 0)
        chat, model = kind == "chat", body.model
        async with gateway._in_flight(generate_request, arrived, auto, request_owner(request)) as flight:
            if not ollama.streams(body):
                events = await gateway._collect(request, flight)
                eos = completed(events)
                text = "".join(e.text for e in events if isinstance(e, TokenEvent))
                final = ollama.final_chunk(model, eos, chat, text)
                if not chat:
                    final.response = text
                tokens = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs or ()]
                if (described := ollama.logprobs_of(tokens)) is not None:
                    final.logprobs = described
                return json_response(final)

            async def lines() -> AsyncGenerator[bytes, None]:
                async with aclosing(gateway._events(flight)) as events:
                    async for event in events:
                        match event:
                            case TokenEvent(text=text, logprobs=logprobs):
                                if flight.stream is not None and flight.stream.tool_format is not None:
                                    continue  # a tool-calling answer comes whole, at the end
                                yield _line(
                                    ollama.text_chunk(model, text, chat, ollama.logprobs_of(logprobs))
                                )
                            case EosEvent(reason="stop" | "length"):
                                yield _line(ollama.final_chunk(model, event, chat))
                            case EosEvent(reason="cancelled"):
                                yield _line({"error": ended_early(event).message})
                            case ErrorEvent(code=code, message=message):
                                yield _line({"error": api_error(ErrorCode(code), message).message})
                            case _:
                                pass

            stream = gateway._event_stream(lines, flight, {"x-request-id": rid})
            stream.media_type = "application/x-ndjson"
            stream.init_headers({"cache-control": "no-cache", "x-request-id": rid})
            return stream

    def _translate(self, body: ollama.ChatBody | ollama.GenerateBody, rid: str) -> GenerateRequest:
        try:
            if isinstance(body, ollama.ChatBody):
                request = ollama.chat_request(body, rid)
            else:
                request = ollama.generate_request(body, rid)
        except (msgspec.ValidationError, ValueError) as exc:
            raise validation_error(exc) from None
        return request

    def _decode(self, data: bytes, kind: type[ollama.BodyT]) -> ollama.BodyT:
        return decode_body(data or b"{}", kind)

    def _check_model(self, name: str) -> None:
        if name.removesuffix(":latest") in self.gateway.model_names:
            return
        raise ApiError(404, f"model '{name}' not found; this server has '{self.gateway.model}'")

    def _details(self) -> ollama.ModelDetails:
        # llama.cpp's description: "llama 135M Q4_1" (architecture, size, quantization).
        words = str(self.gateway._ready().describe_engine()["model"].get("description", "")).split()
        family = words[0] if words else "unknown"
        return ollama.ModelDetails(
            format="gguf", family=family, families=[family],
            parameter_size=words[1] if len(words) > 1 else "",
            quantization_level=words[-1] if len(words) > 2 else "",
        )  # fmt: skip

    def _entry(self) -> ollama.ModelEntry:
        model = self.gateway._ready().describe_engine()["model"]
        return ollama.ModelEntry(
            name=self.gateway.model, model=self.gateway.model, modified_at=ollama.now_rfc3339(),
            size=int(model.get("weight_bytes", 0)), digest="", details=self._details(),
        )  # fmt: skip


def _line(value: object) -> bytes:
    return _json.encode(value) + b"\n"
