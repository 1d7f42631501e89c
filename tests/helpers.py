"""Test helpers: a raw protocol client for sending arbitrary bytes, a whole daemon on the
simulated engine, and the checks shared by the reliability tests."""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.base import Engine
from uma_trio.engine.sim import SimEngine
from uma_trio.loadgen.simulate import SIM_CONFIG
from uma_trio.model_store import ModelStore
from uma_trio.protocol.framing import FrameDecoder
from uma_trio.runtime.server import Server
from uma_trio.sched.cost import CostCoefficients


def sim_server(
    config: ServerConfig,
    wrap: Callable[[SimEngine], Engine] | None = None,
    cost: CostCoefficients | None = None,
) -> Server:
    """A daemon for ``config`` on the simulated engine (not started); ``wrap`` wraps the
    engine (fault injection)."""
    sim = SimEngine(cost or CostCoefficients(), n_ctx_seq=config.n_ctx, n_seq_max=config.max_sessions)
    return Server(wrap(sim) if wrap is not None else sim, config)


@asynccontextmanager
async def serving_sim(server: Server) -> AsyncIterator[Server]:
    """``server`` serving for the duration of the block; force-stopped on exit."""
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield server
        server.request_shutdown(force=True)


@asynccontextmanager
async def sim_daemon(
    wrap: Callable[[SimEngine], Engine] | None = None,
    cost: CostCoefficients | None = None,
    **overrides: Any,
) -> AsyncIterator[Server]:
    """A whole daemon (real socket, connections, policy, decode loop) on the simulated
    engine, with SIM_CONFIG plus ``overrides``, its socket in a fresh private directory."""
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        config = replace(SIM_CONFIG, socket_path=Path(tmp) / "d.sock", **overrides)
        async with serving_sim(sim_server(config, wrap, cost)) as server:
            yield server


@asynccontextmanager
async def streaming(
    http: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/completions"
) -> AsyncIterator[None]:
    """``body`` streamed from ``path`` for the duration of the block, which begins once its
    first line has come (a session taken); the stream is dropped at the block's end."""
    async with trio.open_nursery() as nursery:
        started = trio.Event()

        async def hold() -> None:
            async with http.stream("POST", path, json=body) as held:
                async for _ in held.aiter_lines():
                    started.set()

        nursery.start_soon(hold)
        await started.wait()
        yield
        nursery.cancel_scope.cancel()


def assert_nothing_held(server: Server) -> None:
    """No request waiting or running, no KV cell reserved, and the engine's cells exactly
    the cached prefixes' (which belong to no request), every sequence id free or cached."""
    gauges = server.loop.gauges()
    assert gauges["sessions"] == {"active": 0, "waiting": 0, "prefilling": 0, "decoding": 0, "parked": 0}
    assert gauges["kv"]["cells_reserved"] == 0
    engine_cells = sum(server.engine.seq_cells(s) for s in range(server.engine.n_seq_max))
    assert engine_cells == gauges["prefix_cache"]["cells"]
    assert gauges["kv"]["seqs_free"] + gauges["prefix_cache"]["sequences"] == server.engine.n_seq_max


def frame(obj: Any) -> bytes:
    payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("<I", len(payload)) + payload


class RawClient:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(1 << 24)
        self._pending: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: Path) -> RawClient:
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, obj: Any) -> None:
        await self.stream.send_all(frame(obj))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next_event(self) -> dict[str, Any] | None:
        """The next event, or None at EOF."""
        while not self._pending:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self._pending.extend(json.loads(p) for p in self._decoder.feed(data))
        return self._pending.pop(0)

    async def until_end(self, request_id: str) -> list[dict[str, Any]]:
        """Events of ``request_id`` up to its eos or error (others are kept aside)."""
        mine: list[dict[str, Any]] = []
        while True:
            event = await self.next_event()
            assert event is not None, f"connection closed before {request_id} ended: {mine}"
            if event.get("id") != request_id:
                continue
            mine.append(event)
            if event["event"] in ("eos", "error"):
                return mine

    async def until_all_end(self, request_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Each request's events up to its eos or error, however they interleave."""
        events: dict[str, list[dict[str, Any]]] = {rid: [] for rid in request_ids}
        ended = 0
        while ended < len(request_ids):
            event = await self.next_event()
            assert event is not None, f"connection closed before all ended: {events}"
            events[event["id"]].append(event)
            ended += event["event"] in ("eos", "error")
        return events

    async def aclose(self) -> None:
        await self.stream.aclose()


async def stream_one(server: Any, rid: str, max_tokens: int) -> list[dict[str, Any]]:
    """One streamed request on a connection of its own: its events up to the end."""
    client = await RawClient.connect(server.config.socket_path)
    await client.send({"id": rid, "prompt": "tell me everything", "max_tokens": max_tokens})
    events = await client.until_end(rid)
    await client.aclose()
    return events


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["event"] == "token")


def assert_lane_percentiles_agree(
    latency: dict[str, Any],
    records: list[Any],
    lane: str,
    *,
    buckets: str = "sketch",
    slack_ms: float = 0.0,
) -> None:
    """The daemon's run-wide TTFT and token-gap p50/p95/p99/max for ``lane`` match those
    computed from the client-side timestamps of ``records`` (loadgen RequestRecords) within
    one bucket width: of the DDSketch (1 %, ``buckets="sketch"``) or of the Prometheus
    histogram holding the value (``buckets="prometheus"``), or within ``slack_ms`` (twice that
    for the max) where that is larger.  Same rank rule on both sides: numpy's "lower" method."""
    import bisect

    import numpy as np

    from uma_trio.loadgen.stats import gaps, ttft
    from uma_trio.observability.latency import GAMMA
    from uma_trio.observability.metrics import GAP_BUCKETS, REQUEST_BUCKETS

    def width(key: str, value_ms: float) -> float:
        if buckets == "sketch":
            return value_ms * (GAMMA - 1.0)
        bounds = [0.0, *(b * 1000.0 for b in (GAP_BUCKETS if key == "itl_ms" else REQUEST_BUCKETS))]
        i = min(max(bisect.bisect_left(bounds, value_ms), 1), len(bounds) - 1)
        return bounds[i] - bounds[i - 1]

    mine = [r for r in records if r.lane == lane]
    client = {
        "itl_ms": np.concatenate([gaps(r) for r in mine]) * 1000.0,
        "ttft_ms": np.asarray([t for t in map(ttft, mine) if t is not None]) * 1000.0,
    }
    for key, values in client.items():
        server = latency["run"][lane][key]
        assert server["count"] == len(values), (lane, key)
        exact = {f"p{q}": float(np.percentile(values, q, method="lower")) for q in (50, 95, 99)}
        exact["max"] = float(values.max())
        for figure, value in exact.items():
            # The max is one sample: one late wake-up of either side moves it whole (slack × 2);
            # so is a percentile above all but one sample (a p99 of fewer than 100 gaps).
            one_sample = figure == "max" or len(values) * (1 - int(figure[1:]) / 100) < 1
            allowed = max(width(key, value), slack_ms * (2.0 if one_sample else 1.0))
            assert abs(server[figure] - value) <= allowed, (
                lane,
                key,
                figure,
                server[figure],
                value,
            )


def draw_until_end(model: Any, sampler: Any, rng: Any, limit: int, scale: float) -> bytes:
    """The text ``sampler`` draws from random logits (normal, times ``scale``) until an
    end-of-generation token; fails the test if none comes within ``limit`` draws."""
    import numpy as np
    import pytest

    text = b""
    for _ in range(limit):
        token = sampler.sample(rng.standard_normal(model.n_vocab).astype(np.float32) * scale)
        if model.is_eog(token):
            return text
        text += model.piece(token)
    pytest.fail(f"no end of generation: {text!r}")


def slow_grammar() -> str:
    """A GBNF grammar just under the rule limit, a chain of alternatives: llguidance takes
    10-25 s to compile it on 2 cores (its converter is quadratic in the rules)."""
    from uma_trio.engine.constraints import MAX_GBNF_RULES

    rules = MAX_GBNF_RULES - 6
    chain = "".join(f'r{i} ::= "a{i}" r{i + 1} | "b"\n' for i in range(rules))
    return f'root ::= r0\n{chain}r{rules} ::= "z"\n'


def taught_to_call(after: str = "") -> list[dict[str, str]]:
    """A chat whose history teaches a Hermes-template model to call ``get_weather`` (two
    answers of a ``<tool_call>`` block, each followed by ``after``), then asks again."""

    def said(city: str) -> str:
        call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        return f"Let me check.\n<tool_call>\n{call}\n</tool_call>{after}"

    messages: list[dict[str, str]] = []
    for city in ("Rome", "Oslo"):
        messages.append({"role": "user", "content": f"Weather in {city}?"})
        messages.append({"role": "assistant", "content": said(city)})
    return [*messages, {"role": "user", "content": "Weather in Paris?"}]


def grammar_accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's ``grammar`` (a compiled constraint's) takes ``text`` whole, byte by
    byte over a 256-byte vocabulary: a schema's meaning checked with no model loaded."""
    import llguidance

    class Bytes:
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        eos_token_id, bos_token_id, is_tokenizer_wrapper = 256, None, True

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    assert not failed, messages
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def ids(store: ModelStore) -> list[str]:
    """The store's model ids, in its order."""
    return [entry.id for entry in store.entries()]
