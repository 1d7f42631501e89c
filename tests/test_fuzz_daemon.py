"""Fuzzing the live daemon (simulated engine, real socket, real time): every bad input gets
an error event, or a bad length prefix a clean close of that connection only, while another
client's stream runs to its end untouched.  Real time, so the victim's stream (a few seconds
of simulated decode) is still running while every input arrives."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator

import trio

from uma_trio.loadgen.simulate import SIM_CONFIG

from .helpers import RawClient, frame, sim_daemon

INPUTS = 600
STREAM_TOKENS = 300


def garbage(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(kind, bytes on the wire) forever; every payload is framed except ``oversized``."""
    good = {"id": "g", "prompt": "hello world", "max_tokens": 4}
    while True:
        kind = rng.choice(
            ["bytes", "truncated", "utf8", "nested", "types", "unknown", "limits", "cancel", "oversized"]
        )
        text = json.dumps({**good, "id": f"g{rng.randrange(10**6)}"}).encode()
        match kind:
            case "bytes":
                payload = rng.randbytes(rng.randrange(1, 200))
            case "truncated":
                payload = text[: rng.randrange(1, len(text) - 1)]
            case "utf8":
                cut = rng.randrange(len(text))
                payload = text[:cut] + b"\xc3\x28\xff" + text[cut:]
            case "nested":
                payload = rng.choice([b"[", b'{"a":']) * rng.randrange(1_000, 100_000)
            case "types":
                field = rng.choice(
                    ["id", "prompt", "max_tokens", "stream", "temperature", "stop", "priority"]
                )
                # Each of these is the wrong type or out of range for every one of the fields.
                payload = json.dumps({**good, field: rng.choice([None, {}, -1, [1]])}).encode()
            case "unknown":
                payload = json.dumps(rng.choice([{**good, "bogus": 1}, {"type": "shutdown"}, [], 7])).encode()
            case "limits":
                payload = json.dumps({**good, "max_tokens": rng.choice([10**6, 10**9])}).encode()
            case "cancel":
                payload = json.dumps({"type": "cancel", "id": "nobody"}).encode()
            case _:  # a length prefix over the limit: fatal for that connection only
                yield kind, (SIM_CONFIG.max_frame_bytes + 1 + rng.randrange(1000)).to_bytes(4, "little")
                continue
        yield kind, frame(payload)


async def test_fuzzed_inputs_never_disturb_another_stream() -> None:
    rng = random.Random(7)
    sent: Counter[str] = Counter()
    victim_events: list[dict[str, object]] = []
    async with sim_daemon() as server, trio.open_nursery() as nursery:
        config = server.config

        async def victim() -> None:
            client = await RawClient.connect(config.socket_path)
            await client.send({"id": "v", "prompt": "tell me a story", "max_tokens": STREAM_TOKENS})
            victim_events.extend(await client.until_end("v"))
            await client.aclose()

        nursery.start_soon(victim)
        fuzzer = await RawClient.connect(config.socket_path)
        inputs = garbage(rng)
        for _ in range(INPUTS):
            kind, data = next(inputs)
            sent[kind] += 1
            await fuzzer.send_bytes(data)
            event = await fuzzer.next_event()
            assert event is not None and event["event"] == "error", (kind, data[:80], event)
            assert event["code"].startswith("E_"), event
            if kind == "oversized":
                assert event["code"] == "E_PROTO_004"
                assert await fuzzer.next_event() is None  # closed after the error
                fuzzer = await RawClient.connect(config.socket_path)
        victim_still_running = not victim_events
        with trio.fail_after(60):
            while not victim_events or victim_events[-1]["event"] != "eos":
                await trio.sleep(0.1)
        snapshot = server.metrics_snapshot()
    assert victim_still_running  # every input arrived while the victim streamed
    tokens = [e for e in victim_events if e["event"] == "token"]
    assert len(tokens) == STREAM_TOKENS and victim_events[-1]["reason"] == "length"
    assert sum(snapshot["errors"].values()) == INPUTS  # one error event per input, no more
    assert snapshot["sessions"]["active"] == 0 and snapshot["kv"]["cells_used"] == 0
    assert set(sent) == {
        "bytes",
        "truncated",
        "utf8",
        "nested",
        "types",
        "unknown",
        "limits",
        "cancel",
        "oversized",
    }
