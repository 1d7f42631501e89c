"""Ollama's native API on the gateway (protocol/ollama.py has the shapes): the same request
path as the OpenAI routes (lanes, limits, the prefix cache, cancel on disconnect), answers
as NDJSON lines, errors as ``{"error": "..."}``."""

from __future__ import annotations

import datetime
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..engine.model_card import ModelCard, card_of
from ..protocol import ollama
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import EosEvent, ErrorEvent, GenerateRequest, TokenEvent
from ..protocol.ollama_durations import KEEP_ALIVE_MAX_S, keep_alive_seconds
from ..protocol.ollama_stream import Lines, ToolChatLines
from ..protocol.openai import api_error, ended_early, validation_error
from ..protocol.openai_errors import client_param
from ..runtime.models import ModelHost
from .auth import request_owner
from .flight import GatewayCore, answer_limits, answering_as, completed, decode_body, ollama_route
from .responses import json_response

_json = msgspec.json.Encoder()
Handler = Callable[[Request], Awaitable[Response]]


class OllamaApi:
    """The routes; they run requests through the gateway's lifecycle (admit, stream or
    collect, end)."""

    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway
        self._card_reads = trio.CapacityLimiter(1)  # vocab-only loads for /api/show and /api/tags

    def routes(self) -> list[Route]:
        return [
            Route("/", answering_as("ollama", self.root), methods=["GET", "HEAD"]),
            Route("/api/version", answering_as("ollama", self.version), methods=["GET"]),
            Route("/api/tags", ollama_route(self.gateway, self.tags), methods=["GET", "HEAD"]),
            Route("/api/ps", ollama_route(self.gateway, self.ps), methods=["GET"]),
            Route("/api/show", ollama_route(self.gateway, self.show), methods=["POST"]),
            Route("/api/chat", ollama_route(self.gateway, self.chat), methods=["POST"]),
            Route("/api/generate", ollama_route(self.gateway, self.generate), methods=["POST"]),
        ]

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return json_response(ollama.Version())

    async def tags(self, request: Request) -> Response:
        models = self.gateway._ready().models.describe()
        primary = await self._entry()
        listed: list[ollama.ModelEntry] = [primary]
        for model in models:
            entry = primary if model["primary"] else await self._other_entry(model)
            if entry is None:
                continue
            if not model["primary"]:
                listed.append(entry)
            # Each --alias as an entry of its own, as Ollama lists a copy (`ollama cp`): a
            # picker filled from the list offers the names a request may use.
            listed += [msgspec.structs.replace(entry, name=alias, model=alias) for alias in model["aliases"]]
        return json_response(ollama.ModelList(listed))

    async def ps(self, request: Request) -> Response:
        # Loaded for good: it expires when the daemon stops, a year from now as far as a
        # client's countdown goes.
        later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=KEEP_ALIVE_MAX_S)
        entry = await self._entry()
        desk = self.gateway._ready()
        entry.expires_at = later.isoformat().replace("+00:00", "Z")
        # The memory a loaded model takes, weights and KV cache, as Ollama's `size` here counts
        # its runner's (/api/tags gives the file's).
        loading = desk.models.loading
        entry.size = (loading.primary_bytes if loading is not None else 0) or entry.size
        entry.size_vram = _size_vram(entry.size, desk.describe_engine())
        entry.context_length = desk.loop.engine.n_ctx_seq
        loaded = []  # the store's other models while loaded: they expire after their keep-alive
        for model in desk.models.describe():
            if model["state"] == "loaded" and not model["primary"]:
                if (other := await self._other_entry(model)) is None:
                    continue
                # What the primary's entry says, for this one too (both were missing).
                other.context_length = model["context_length"]
                other.size = model.get("footprint_bytes") or other.size
                unit = desk.models.units.get(model["id"])
                if unit is not None and unit.loaded.describe is not None:
                    other.size_vram = _size_vram(other.size, unit.loaded.describe())
                else:  # a simulated engine: nothing on a GPU
                    other.size_vram = 0
                keep = model.get("keep_alive_s")
                # Kept for good, or longer than a year (a socket client's /load may ask for
                # more): a year from now, as the primary model (a timedelta overflows past ~1e14 s).
                year = KEEP_ALIVE_MAX_S
                left = year if keep is None else min(year, max(0.0, keep - model.get("idle_s", 0.0)))
                expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=left)
                other.expires_at = expires.isoformat().replace("+00:00", "Z")
                loaded.append(other)
        return json_response(ollama.ModelList([entry, *loaded]))

    async def show(self, request: Request) -> Response:
        """What the model file says about itself (engine/model_card.py), loaded or not, and
        what this daemon serves of it: its per-request context and, for the primary model,
        the template --chat-template may have set."""
        body = self._decode(await self.gateway._body(request), ollama.ShowBody)
        model = self.gateway.model_for(ollama.required_model(body.model or body.name))
        card = await self._card(model)
        primary = model == self.gateway.model
        if card is None and not primary and self.gateway._ready().models.state(model) != "loaded":
            # Nothing serves it and its file reads as no model: it was a 200 of made-up details.
            message = f"cannot load model {model!r}: llama.cpp cannot read its file"
            raise api_error(ErrorCode.MODEL_LOAD, message)
        if primary:
            engine = self.gateway._ready().loop.engine
            template, context = engine.chat_template_source or "", engine.n_ctx_seq
            details = self._details(card)
            insert = fill_in_middle(engine)
        else:
            context = served_context(self.gateway._ready().models, model)
            template = card.chat_template if card else ""
            details, insert = self._card_details(card), bool(card and card.fill_in_middle)
        info: dict[str, Any] = card.model_info() if card else {"general.name": model}
        arch = card.architecture if card and card.architecture else details.family
        info.setdefault("general.architecture", arch)
        info[f"{arch}.context_length"] = context  # what a request may use here, not the trained length
        return json_response(
            ollama.ShowAnswer(
                modelfile=f"FROM {model}", parameters="", template=template, details=details,
                model_info=info, capabilities=capabilities(card, insert=insert),
                modified_at=self._modified_at(model),
            )
        )  # fmt: skip

    def _file_bytes(self, model: str) -> int:
        """``model``'s file size, as /v1/models and the other models' entries give it (the
        primary's was llama.cpp's tensor bytes, 1.8 MB less)."""
        return self.gateway._ready().models.store.entry(model).size

    def _modified_at(self, model: str) -> str:
        """When ``model``'s file was last written, as Ollama's lists say (it was the time of
        the request); now, for a file gone since it loaded (one stat: no thread needed)."""
        try:
            return ollama.rfc3339(self.gateway._ready().models.store.entry(model).path.stat().st_mtime)
        except (OSError, KeyError):
            return ollama.now_rfc3339()

    async def _card(self, model: str) -> ModelCard | None:
        """``model``'s card, read off the event loop one file at a time; None when its file
        can no longer be read (deleted while the model still serves from memory)."""
        path = self.gateway._ready().models.store.entry(model).path
        try:
            return await trio.to_thread.run_sync(card_of, path, limiter=self._card_reads)
        except OSError:
            return None

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
        model = gateway.model_for(ollama.required_model(body.model))
        keep_alive = keep_alive_seconds(body.keep_alive)
        # Ollama's load call (an empty prompt, or no messages), with keep_alive 0 its unload call.
        generate = isinstance(body, ollama.GenerateBody)
        if not body.messages if isinstance(body, ollama.ChatBody) else not (body.prompt or body.suffix):
            done, _ = await load_or_unload(gateway, model, keep_alive)
            now = ollama.now_rfc3339()
            answer = ollama.Chunk(model=body.model, created_at=now, done=True, done_reason=done)
            if generate:
                answer.response = ""
            else:
                answer.message = ollama.AssistantMessage("")
            return json_response(answer)
        translated = self._translate(body, rid, answer_limits(self.gateway, model))
        generate_request = msgspec.structs.replace(translated, model=model, keep_alive=keep_alive)
        # Without num_predict: until the context is full (or the model ends), at most --max-tokens.
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
                return json_response(final, headers={"x-request-id": rid})

            fmt = flight.stream.tool_format if flight.stream is not None else None
            formatted = flight.stream is not None and flight.stream.formatted
            chunks = Lines(model, chat) if fmt is None else ToolChatLines(model, fmt, formatted)

            async def lines() -> AsyncGenerator[bytes, None]:
                async with aclosing(gateway._events(flight)) as events:
                    async for event in events:
                        match event:
                            case TokenEvent(text=text, logprobs=logprobs):
                                for chunk in chunks.token(text, logprobs):
                                    yield _line(chunk)
                            case EosEvent(reason="stop" | "length"):
                                for chunk in chunks.end(event):
                                    yield _line(chunk)
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

    def _translate(
        self, body: ollama.ChatBody | ollama.GenerateBody, rid: str, limits: ollama.Limits
    ) -> GenerateRequest:
        try:
            if isinstance(body, ollama.ChatBody):
                request = ollama.chat_request(body, rid, limits)
            else:
                request = ollama.generate_request(body, rid, limits)
        except (msgspec.ValidationError, ValueError) as exc:
            raise client_param(validation_error(exc), ollama.CLIENT_NAMES) from None
        return request

    def _decode(self, data: bytes, kind: type[ollama.BodyT]) -> ollama.BodyT:
        return decode_body(data or b"{}", kind)

    def _details(self, card: ModelCard | None) -> ollama.ModelDetails:
        # llama.cpp's description: "llama 135M Q4_1" (architecture, size, quantization).  Its
        # size is guessed from the layer count (SmolLM2-135M's read "256M"): the file's own
        # label first, as for the store's other models (_card_details).
        words = str(self.gateway._ready().describe_engine()["model"].get("description", "")).split()
        family = words[0] if words else "unknown"
        guessed = words[1] if len(words) > 1 else ""
        return ollama.ModelDetails(
            format="gguf", family=family, families=[family],
            parameter_size=card.size_label if card and card.size_label else guessed,
            quantization_level=words[-1] if len(words) > 2 else "",
        )  # fmt: skip

    @staticmethod
    def _card_details(card: ModelCard | None) -> ollama.ModelDetails:
        family = card.architecture if card else ""
        return ollama.ModelDetails(
            "gguf", family, [family] if family else [], parameter_size=card.size_label if card else "",
            quantization_level=card.quantization if card else "",
        )  # fmt: skip

    async def _other_entry(self, model: dict[str, Any]) -> ollama.ModelEntry | None:
        """A model of the store other than the primary, from its file alone; None when the
        store has forgotten it since ``model`` was listed: the caller reads one card after
        another, and meanwhile a rescan drops the model of a deleted file that has unloaded."""
        try:
            card = await self._card(model["id"])
        except KeyError:
            return None
        return ollama.ModelEntry(
            name=model["id"], model=model["id"], modified_at=self._modified_at(model["id"]),
            size=model["bytes"], digest="", details=self._card_details(card),
        )  # fmt: skip

    async def _entry(self) -> ollama.ModelEntry:
        """The primary model's entry in the lists."""
        details = self._details(await self._card(self.gateway.model))
        return ollama.ModelEntry(
            name=self.gateway.model, model=self.gateway.model,
            modified_at=self._modified_at(self.gateway.model), size=self._file_bytes(self.gateway.model),
            digest="", details=details,
        )  # fmt: skip


def _size_vram(size: int, summary: dict[str, Any]) -> int:
    """A model's bytes on a GPU, as its share of offloaded layers (0 with none, or simulated)."""
    layers = summary.get("gpu_layers")
    if layers is None:
        return 0
    return int(size * layers["offloaded"] // max(1, layers["total"]))


async def load_or_unload(gateway: GatewayCore, model: str, keep_alive: float | None) -> tuple[str, float]:
    """Ollama's load call (no prompt, messages or input): load ``model`` (``"load"``), or
    unload it with ``keep_alive`` 0 (``"unload"``); and the seconds it waited for the load
    (0 when the model was loaded: ``load_duration``).  The primary model stays: its unload
    call is refused as ``POST /unload`` refuses it (it said ``"unload"`` and nothing was)."""
    models = gateway._ready().models
    if models.store.entry(model).primary:
        if keep_alive == 0:
            raise api_error(ErrorCode.MODEL, f"{model} is --model's model: it stays loaded")
        return "load", 0.0
    if keep_alive == 0:
        await models.unload_when_idle(model)
        return "unload", 0.0
    asked, loaded = trio.current_time(), model in models.units
    try:
        models.release(await models.acquire(model, keep_alive))
    except UmaError as exc:
        raise api_error(exc.code, exc.message) from None
    return "load", 0.0 if loaded else trio.current_time() - asked


def served_context(models: ModelHost, model_id: str) -> int:
    """The tokens one request to ``model_id`` may hold: its engine's, once loaded; before,
    what the store says every model gets (--n-ctx)."""
    if (unit := models.units.get(model_id)) is not None:
        return int(unit.loop.engine.n_ctx_seq)
    listed = next((m["context_length"] for m in models.describe() if m["id"] == model_id), None)
    if listed is None:  # its file deleted since the request named it (a listing rescans)
        raise api_error(ErrorCode.MODEL_NOT_FOUND, f"model {model_id!r} is not here any more")
    return int(listed)


def fill_in_middle(engine: Any) -> bool:
    """Whether a loaded model's vocabulary has the FIM tokens (/infill, Ollama's suffix)."""
    try:
        engine.tokenize_infill("", "")
    except ValueError:  # NoFimTokens
        return False
    return True


def capabilities(card: ModelCard | None, *, insert: bool) -> list[str]:
    """Ollama's capability names for a model: an embedding model only embeds; any other
    completes and calls tools (through its template or the generic format), and inserts
    where its vocabulary has the FIM tokens."""
    if card is not None and card.embedding_only:
        return ["embedding"]
    return ["completion", "tools", *(["insert"] if insert else [])]


def _line(value: object) -> bytes:
    return _json.encode(value) + b"\n"
