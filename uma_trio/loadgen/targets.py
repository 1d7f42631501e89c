"""What a scenario runs against: the uma-trio socket, or any OpenAI-compatible server.

A target opens one connection per client (:meth:`Target.connect`); a
connection streams one request at a time into a :class:`~.records.RequestRecord`,
stamping every token with the runner's clock.  The OpenAI target speaks
``POST /v1/completions`` with SSE, so the same scenario runs against
uma-trio's HTTP gateway, llama.cpp's ``llama-server`` and llama-cpp-python's
server.  Parsing the SSE lines is pure (:func:`apply_chunk`) and tested alone.
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..client import ConnectionLost, UmaClient
from ..protocol.messages import EosEvent, ErrorEvent, TokenEvent
from .scenario import ClientSpec

if TYPE_CHECKING:
    import httpx

from .records import RequestRecord

Clock = Callable[[], float]

# ``error_code`` of a request whose connection died under it (not a daemon error code).
CONNECTION_LOST = "CONNECTION_LOST"
# ... of each request of a client whose connection could not be opened (the runner's).
CONNECT_FAILED = "CONNECT_FAILED"
# ... of a request that went ``timeout_s`` without an event (a stopped or wedged server).
TIMEOUT = "TIMEOUT"
# Seconds a request may wait for its next event: long enough for an 8,000-token prefill on a
# slow CPU, short enough that a server that stopped answering does not hang the bench forever.
DEFAULT_TIMEOUT_S = 600.0


class Connection(Protocol):
    async def run(
        self, spec: ClientSpec, index: int, record: RequestRecord, clock: Clock, on_token: Callable[[], None]
    ) -> bool:
        """Stream request ``index`` of ``spec`` into ``record``, calling ``on_token`` after each
        token event; False once the connection is gone."""
        ...


class Target(Protocol):
    label: str

    def connect(self) -> AbstractAsyncContextManager[Connection]: ...


# -- the uma-trio socket -------------------------------------------------------------


class UmaTarget:
    """The daemon's Unix socket, one :class:`UmaClient` connection per client.  A request
    that waits ``timeout_s`` for its next event is given up (:data:`TIMEOUT`)."""

    def __init__(
        self, socket_path: Path, label: str = "uma", *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.socket_path, self.label, self.timeout_s = socket_path, label, timeout_s

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        opened = False
        try:
            async with UmaClient.connect(self.socket_path) as client:
                opened = True
                yield _UmaConnection(client, self.timeout_s)
        except OSError as exc:
            if opened:  # not the connect's: the caller's own error
                raise
            # The bare OS error ("[Errno 2] No such file or directory") does not say which
            # socket, nor what to do about it.
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                raise ConnectionError(
                    f"no daemon listening on {self.socket_path} ({exc.strerror}): "
                    "start one with `uma-trio serve`, or give --socket"
                ) from exc
            raise ConnectionError(f"cannot connect to {self.socket_path}: {exc}") from exc


class _UmaConnection:
    def __init__(self, client: UmaClient, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.client, self.timeout_s = client, timeout_s

    async def run(
        self, spec: ClientSpec, index: int, record: RequestRecord, clock: Clock, on_token: Callable[[], None]
    ) -> bool:
        # One deadline, pushed back at every event: a stall, not the whole request, is timed.
        with trio.CancelScope(deadline=trio.current_time() + self.timeout_s) as stall:
            alive = await self._stream(spec, index, record, clock, on_token, stall)
        if stall.cancelled_caught:
            # The connection is left as it is: a server that stopped answering gets no more
            # requests from this client (the rest of its chain would wait as long each).
            record.ended, record.error_code = clock(), TIMEOUT
            return False
        return alive

    async def _stream(
        self,
        spec: ClientSpec,
        index: int,
        record: RequestRecord,
        clock: Clock,
        on_token: Callable[[], None],
        stall: trio.CancelScope,
    ) -> bool:
        try:
            async with self.client.stream(**spec.request(index)) as events:
                async for event in events:
                    stall.deadline = trio.current_time() + self.timeout_s
                    now = clock()
                    if isinstance(event, TokenEvent):
                        record.token_times.append(now)
                        on_token()
                    elif isinstance(event, EosEvent):
                        record.ended, record.eos_reason = now, event.reason
                        record.prompt_tokens = event.usage.prompt_tokens
                        record.completion_tokens = event.usage.completion_tokens
                    elif isinstance(event, ErrorEvent):
                        # The client's stream ends at an error event (a following eos is not seen).
                        record.ended, record.error_code = now, event.code
        except ConnectionLost:
            # The daemon may have said why before hanging up (E_LIMIT_006: over
            # --max-connections); when that came before this request was sent, only the
            # client heard it.
            record.ended = clock()
            record.error_code = self.client.connection_error_code or CONNECTION_LOST
            return False
        if record.ended is None:  # the stream ended without eos or error
            record.ended = clock()
            record.error_code = self.client.connection_error_code or CONNECTION_LOST
            return False
        return True


# -- any OpenAI-compatible server ---------------------------------------------------


def completion_body(spec: ClientSpec, index: int, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body for a request: the socket request's prompt, greedy,
    streamed, usage asked for."""
    request = spec.request(index)
    return {
        "model": spec.model or model, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


def apply_chunk(line: str, record: RequestRecord, now: float) -> bool:
    """Fold one SSE line into ``record``; True once the stream is over (``[DONE]`` or an
    error).  Every chunk carrying a choice without a finish_reason is a token event (both
    llama-server and uma-trio send one per token), and so is a final chunk with text."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        if record.ended is None:
            record.ended = now
        return True
    try:
        chunk = json.loads(payload)
    except ValueError:
        record.ended, record.error_code = now, "BAD_SSE"
        return True
    if not isinstance(chunk, dict):
        record.ended, record.error_code = now, "BAD_SSE"
        return True
    if (error := chunk.get("error")) is not None:  # OpenAI's {...}; other servers' a string
        if isinstance(error, dict):
            code = error.get("code") or error.get("type")
        else:
            code = chunk.get("error_type")
        record.ended, record.error_code = now, str(code or "error")
        return True
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason")
        if finish is None or text:
            record.token_times.append(now)
        if finish is not None:
            record.ended, record.eos_reason = now, finish
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    return False


class OpenAITarget:
    """An OpenAI-compatible server at ``base_url`` (e.g. ``http://127.0.0.1:8080``).

    The lane travels in the ``X-Uma-Priority`` header, which other servers ignore.
    The model name comes from ``GET /v1/models`` unless given.  ``timeout_s``: as
    :class:`UmaTarget`'s (httpx's timeout for each read, connect and write).
    """

    def __init__(
        self,
        base_url: str,
        label: str = "openai",
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url, self.label = base_url.rstrip("/").removesuffix("/v1"), label
        self.api_key, self.model, self.timeout_s = api_key, model, timeout_s

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        try:
            import httpx  # only the OpenAI target needs it: the `bench` extra
        except ImportError:
            raise RuntimeError("HTTP targets need httpx: pip install 'uma-trio[bench]'") from None

        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=1)  # one connection per client, like the socket
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=self.timeout_s, limits=limits
        ) as http:
            if self.model is None:
                try:
                    listing = (await http.get("/v1/models")).raise_for_status().json()
                    self.model = str(listing["data"][0]["id"])
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                    raise ConnectionError(f"{self.base_url}/v1/models: {exc!r}") from None
            yield _OpenAIConnection(http, self.model)


# A request that fails before the server answered is sent again this many times, each on a
# new connection (the openai SDK retries such errors twice by default).
STALE_CONNECTION_RETRIES = 2


class _OpenAIConnection:
    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http, self.model = http, model

    async def run(
        self, spec: ClientSpec, index: int, record: RequestRecord, clock: Clock, on_token: Callable[[], None]
    ) -> bool:
        import httpx

        body = completion_body(spec, index, self.model)
        answered = False  # whether the server sent a status line for this request
        for attempt in range(1 + STALE_CONNECTION_RETRIES):
            try:
                async with self.http.stream(
                    "POST", "/v1/completions", json=body, headers={"x-uma-priority": spec.lane}
                ) as response:
                    answered = True
                    return await self._read(response, record, clock, on_token)
            except httpx.TimeoutException:  # a stall, not a stale connection: not sent again
                record.ended, record.error_code = clock(), TIMEOUT
                return False
            except httpx.TransportError:
                # A kept-alive connection the server closed between two requests (llama-server's
                # HTTP library does) fails before any answer: the request never reached the
                # server, and like the openai SDK the client sends it again on a new connection.
                if answered or attempt == STALE_CONNECTION_RETRIES:
                    record.ended, record.error_code = clock(), CONNECTION_LOST
                    return False
        raise AssertionError("unreachable")

    @staticmethod
    async def _read(
        response: httpx.Response, record: RequestRecord, clock: Clock, on_token: Callable[[], None]
    ) -> bool:
        if response.status_code != 200:
            await response.aread()
            record.ended, record.error_code = clock(), f"HTTP_{response.status_code}"
            return True
        done = False
        async for line in response.aiter_lines():  # read to the end: the connection is reused
            if done:
                continue
            before = len(record.token_times)
            done = apply_chunk(line, record, clock())
            for _ in range(len(record.token_times) - before):
                on_token()
        if record.ended is None:
            record.ended, record.error_code = clock(), CONNECTION_LOST
            return False
        return True


def parse_target(
    text: str, *, socket_path: Path, api_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Target:
    """``uma`` (the socket at ``socket_path``), ``uma-http:URL`` or ``openai:URL``, each
    optionally labelled ``LABEL=...`` (e.g. ``llama-server=openai:http://127.0.0.1:8081``);
    ``timeout_s``: how long a request may wait for its next event."""
    label, sep, spec = text.partition("=")
    if not sep or ":" in label:  # no label (an "=" inside a URL is not one)
        label, spec = "", text
    if spec == "uma":
        return UmaTarget(socket_path, label or "uma", timeout_s=timeout_s)
    kind, colon, url = spec.partition(":")
    if colon and kind in ("openai", "uma-http") and url.startswith("http"):
        label = label or (kind if kind == "uma-http" else url)
        return OpenAITarget(url, label, api_key=api_key, timeout_s=timeout_s)
    raise ValueError(f"a target is uma, uma-http:URL or openai:URL (optionally LABEL=...), not {text!r}")
