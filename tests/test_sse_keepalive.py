"""An HTTP event stream says its request still runs while nothing else comes (``--sse-keepalive``):
clients and proxies give up on a silent stream (Codex after 300 s), and a long prompt on a CPU,
or a wait for room, can be that silent.  Real model, the official SDKs; a prompt of ~1,500
tokens is read for about a second here, and the keep-alive is 0.05 s."""

from __future__ import annotations

import itertools
import random
from contextlib import aclosing
from dataclasses import replace

import anthropic
import httpx
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import GenerateRequest
from uma_trio.runtime.delivery import deliver

from .conftest import API_KEY, openai_sdk, running_server
from .helpers import sim_daemon

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WORDS = ["river", "stone", "cloud", "apple", "window", "garden", "music", "paper", "silver", "orange"]


def long_prompt(seed: int) -> str:
    """~1,500 tokens no other request shares (so none is read from the prefix cache)."""
    chosen = random.Random(seed)
    return " ".join(chosen.choice(WORDS) for _ in range(1_400)) + "\nSay hello."


@pytest.mark.model
async def test_a_long_prompt_s_stream_says_it_still_runs_in_each_api(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    config = replace(server_config, sse_keepalive_s=0.05)
    async with running_server(llama_model, config, http="127.0.0.1:0", api_key=API_KEY) as server:
        # Chat completions: SSE comments between the role chunk and the first token.
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt(1)}],
                "max_tokens": 4, "stream": True}  # fmt: skip
        headers = {"authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
                lines = [line async for line in answer.aiter_lines() if line]
        kept = [i for i, line in enumerate(lines) if line == ": keep-alive"]
        answered = next(i for i, line in enumerate(lines) if i > 0 and line.startswith("data: "))
        # Between the role chunk and the first token (or the end: the model may stop at
        # once), and none after: an interactive stream's gaps are the guard's.
        assert kept and kept == list(range(1, answered)), lines[:8]
        assert lines[-1] == "data: [DONE]"
        # The official SDK reads through them.
        async with openai_sdk(server) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_prompt(2)}], max_tokens=4, stream=True
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            # Responses: response.in_progress after response.created, and again while it reads.
            async with client.responses.stream(
                model=MODEL, input=long_prompt(3), max_output_tokens=4, store=False
            ) as responses:
                events = [event async for event in responses]
                final = await responses.get_final_response()
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:4]
        progress = kinds[: kinds.index("response.output_item.added")].count("response.in_progress")
        assert progress >= 2, kinds[:6]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert kinds[-1] == "response.completed" and final.output_text == "".join(
            event.delta for event in events if event.type == "response.output_text.delta"
        )
        # Anthropic: message_start, then pings (as Anthropic's own streams send them).
        asked = {"model": MODEL, "max_tokens": 4, "stream": True,
                 "messages": [{"role": "user", "content": long_prompt(4)}]}  # fmt: skip
        async with httpx.AsyncClient(base_url=str(server.http_url), timeout=60) as http:
            async with http.stream(
                "POST", "/v1/messages", json=asked, headers={"x-api-key": API_KEY}
            ) as answer:
                said = [line[7:] async for line in answer.aiter_lines() if line.startswith("event: ")]
        assert said[0] == "message_start" and said[-1] == "message_stop"
        answered = next(i for i, kind in enumerate(said) if kind in ("content_block_start", "message_delta"))
        assert said[:answered].count("ping") >= 2, said[:6]  # the model may stop at once
        # The official SDK reads through them.
        async with anthropic.AsyncAnthropic(
            base_url=str(server.http_url), api_key=API_KEY, max_retries=0
        ) as sdk:
            async with sdk.messages.stream(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": long_prompt(5)}]
            ) as messages:
                message = await messages.get_final_message()
        assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.input_tokens > 1_000


async def test_beats_come_only_after_a_silence(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The simulated engine on trio's virtual clock: a 3,000-token prompt read for seconds
    gets a beat each second until its first token; its tokens, 10 ms apart, get none."""
    async with sim_daemon(n_ctx=8192, max_prompt_tokens=8192) as server:
        prompt = " ".join(f"w{i}" for i in range(3000))
        request = GenerateRequest(id="long", prompt=prompt, max_tokens=32, stream=True)
        stream = await server.open_request(request, trio.current_time(), connection=1)
        seen: list[tuple[str, float]] = []
        async with aclosing(deliver(server, stream, 1.0)) as events:
            async for event in events:
                seen.append((type(event).__name__, trio.current_time()))
        kinds = [kind for kind, _ in seen]
        first = kinds.index("TokenEvent")
        assert first >= 3 and set(kinds[:first]) == {"Beat"}, kinds[:first]
        beat_times = [at for _, at in seen[:first]]
        assert all(later - earlier >= 1.0 for earlier, later in itertools.pairwise(beat_times))
        assert seen[first][1] - beat_times[-1] < 1.0  # the token came within the next second
        assert set(kinds[first:-1]) == {"TokenEvent"} and kinds[-1] == "EosEvent"
        assert kinds.count("TokenEvent") == 32


async def test_after_its_first_token_only_a_background_stream_gets_beats(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A token, then 3.5 s of silence, then another: a background stream (paused for the
    interactive ones) gets three beats in between, an interactive one none (its gaps are
    the guard's, and a timed wait per token cost the event loop)."""
    from types import SimpleNamespace

    from uma_trio.runtime.delivery import Beat, _Beating
    from uma_trio.runtime.session import TokenTimes

    for lane, beats in (("background", 3), ("interactive", 0)):
        send, receive = trio.open_memory_channel[object](8)
        stream = SimpleNamespace(receive=receive, delivered_at=TokenTimes(first=0.0), lane=lane)
        seen: list[object] = []

        async def later(send: trio.MemorySendChannel[object] = send) -> None:
            async with send:
                await send.send("token")
                await trio.sleep(3.5)
                await send.send("token")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            async for item in _Beating(stream, 1.0):  # type: ignore[arg-type]
                seen.append(item)
        assert seen[0] == seen[-1] == "token" and len(seen) == 2 + beats
        assert all(isinstance(item, Beat) for item in seen[1:-1]), (lane, seen)
