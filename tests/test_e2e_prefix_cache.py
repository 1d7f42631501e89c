"""The prefix cache on the real model: a hit changes how much is prefilled, never the output."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.messages import EosEvent, TokenEvent
from uma_trio.runtime.admission import FOLLOW_MIN_UNREAD
from uma_trio.runtime.server import Server

from .conftest import running_server


@pytest.fixture
def server_config(server_config: ServerConfig) -> ServerConfig:
    """--deterministic: a cache hit must give exactly the cold run's greedy tokens, which only
    that mode promises (docs/CONFIG.md "Two modes")."""
    return replace(server_config, deterministic=True)


pytestmark = pytest.mark.model

# About 400 tokens: long enough that a hit is unmistakable, short enough to prefill in ~1.5 s.
SYSTEM = (
    "You are the help desk of a small public library. Answer briefly and politely. "
    + " ".join(
        f"Rule {i}: the {room} is open from {8 + i % 3} to {17 + i % 4} o'clock on weekdays, "
        f"and books about {topic} are kept there."
        for i, (room, topic) in enumerate(
            [
                ("reading room", "history"), ("children's corner", "animals"), ("basement", "maps"),
                ("music room", "jazz"), ("study hall", "mathematics"), ("garden annex", "plants"),
                ("east wing", "travel"), ("west wing", "cooking"), ("attic", "old newspapers"),
                ("media lab", "computers"), ("gallery", "painting"), ("quiet room", "poetry"),
            ]
        )
    )
)  # fmt: skip
QUESTIONS = ["Where are the maps?", "When does the music room open?", "Can I cook there?", "Who are you?"]


def chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *({"role": r, "content": c} for r, c in turns)]


async def greedy(
    client: UmaClient, messages: list[dict[str, str]], max_tokens: int = 24
) -> tuple[list[int], EosEvent]:
    ids: list[int] = []
    async with client.stream(messages=messages, max_tokens=max_tokens, temperature=0.0) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                ids.append(event.token_id)
            elif isinstance(event, EosEvent):
                return ids, event
    raise AssertionError(f"no eos; got {ids}")


async def reference(
    model: LlamaModel, config: ServerConfig, conversations: list[list[dict[str, str]]], max_tokens: int = 24
) -> list[list[int]]:
    """Each conversation's greedy tokens from a daemon with the cache off."""
    off_socket = config.socket_path.with_name("cache-off.sock")
    async with running_server(model, config, prefix_cache_cells=0, socket_path=off_socket) as off:
        async with UmaClient.connect(off.config.socket_path) as client:
            results = [await greedy(client, c, max_tokens) for c in conversations]
    assert all(eos.usage.cached_tokens == 0 for _, eos in results)
    return [ids for ids, _ in results]


async def cache_figures(client: UmaClient) -> dict[str, Any]:
    return (await client.metrics())["prefix_cache"]


async def test_hit_gives_the_same_greedy_output_as_no_cache(
    server: Server, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """A shared system prompt, then a second turn that reuses the first turn's whole KV."""
    with trio.fail_after(180):
        async with UmaClient.connect(server.config.socket_path) as client:
            first, first_eos = await greedy(client, chat(("user", QUESTIONS[0])))
            assert first_eos.usage.cached_tokens == 0
            other, other_eos = await greedy(client, chat(("user", QUESTIONS[1])))
            reply = b"".join(llama_model.piece(t) for t in first).decode("utf-8", "replace")
            turn2 = chat(("user", QUESTIONS[0]), ("assistant", reply), ("user", "And the jazz books?"))
            second, second_eos = await greedy(client, turn2)
            figures = await cache_figures(client)
    # The second question reuses the system prompt; the next turn the first turn's prompt and answer.
    assert other_eos.usage.cached_tokens > 300
    assert second_eos.usage.cached_tokens > first_eos.usage.prompt_tokens
    assert figures["hits"] == 2 and figures["misses"] == 1
    assert figures["reused_tokens"] == other_eos.usage.cached_tokens + second_eos.usage.cached_tokens
    expected = await reference(llama_model, server_config, [chat(("user", QUESTIONS[1])), turn2])
    assert [other, second] == expected
    assert len(other) > 5


async def test_concurrent_requests_sharing_a_prefix_each_get_their_own_answer(
    server: Server, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    conversations = [chat(("user", q)) for q in QUESTIONS]
    with trio.fail_after(180):
        async with UmaClient.connect(server.config.socket_path) as client:
            await greedy(client, chat(("user", "Hello.")), max_tokens=4)  # warms the system prompt
            results: dict[int, tuple[list[int], EosEvent]] = {}

            async def one(i: int) -> None:
                results[i] = await greedy(client, conversations[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(conversations)):
                    nursery.start_soon(one, i)
    assert all(eos.usage.cached_tokens > 300 for _, eos in results.values())
    expected = await reference(llama_model, server_config, conversations)
    assert [results[i][0] for i in range(len(conversations))] == expected
    assert len({tuple(ids) for ids in expected}) == len(expected)  # four different answers


async def test_requests_arriving_together_with_a_shared_prefix_read_it_once(
    server: Server, llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Scheduler review: identical prompts (or one system prompt) arriving together were each
    read in full, side by side (six 1,600-token prompts: every first token after 46 s, one
    alone 7 s).  Now one reads the shared prefix and the others copy it once read, and each
    answer is still exactly its cold answer."""
    conversations = [chat(("user", q)) for q in QUESTIONS]
    with trio.fail_after(180):
        async with UmaClient.connect(server.config.socket_path) as client:
            before = await cache_figures(client)
            results: dict[int, tuple[list[int], EosEvent]] = {}

            async def one(i: int) -> None:
                results[i] = await greedy(client, conversations[i])

            async with trio.open_nursery() as nursery:  # a cold cache: nothing read yet
                for i in range(len(conversations)):
                    nursery.start_soon(one, i)
            after = await cache_figures(client)
    cached = sorted(eos.usage.cached_tokens for _, eos in results.values())
    # All but the first copied the 401 tokens they share: whole, or (one that reached admission
    # after the reader had read all but FOLLOW_MIN_UNREAD of them: a CI machine once took a
    # tick to send them all) what was read by then, reading the rest beside it (admission.py).
    assert cached[0] == 0 and all(c >= 401 - FOLLOW_MIN_UNREAD for c in cached[1:]), cached
    assert after["hits"] - before["hits"] == len(conversations) - 1
    expected = await reference(llama_model, server_config, conversations)
    assert [results[i][0] for i in range(len(conversations))] == expected


async def test_prefix_evicted_while_a_request_reuses_it_breaks_nothing(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Two sequence ids: the reusing request holds one, so the next request must evict the
    cached prefix it copied from while it is still generating."""
    long_answer = chat(("user", "Describe every room of the library in detail."))
    async with running_server(llama_model, server_config, max_sessions=2, interactive_reserve=0) as srv:
        with trio.fail_after(180):
            async with UmaClient.connect(srv.config.socket_path) as client:
                await greedy(client, chat(("user", QUESTIONS[0])), max_tokens=4)  # cached in one id
                ids: list[int] = []
                evicted_midway = False
                async with client.stream(messages=long_answer, max_tokens=64, temperature=0.0) as events:
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            ids.append(event.token_id)
                            if len(ids) == 8:  # mid-stream: an unrelated request needs the cached id
                                await client.complete(prompt="Count to three.", max_tokens=4, temperature=0.0)
                                evicted_midway = (await cache_figures(client))["evictions"] >= 1
                        elif isinstance(event, EosEvent):
                            assert event.usage.cached_tokens > 300
    assert evicted_midway
    assert len(ids) > 16
    assert [ids] == await reference(llama_model, server_config, [long_answer], max_tokens=64)


async def test_cached_prefix_moved_out_of_the_way_is_reused_exactly(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """Four ids.  While a long answer runs in id 2, a new request evicts the oldest prefix
    (id 0) but takes id 1, next to the running one: the prefix cached in 1 moves to 0
    (kv_manager "Which id a request gets").  The next turn of that conversation then reuses
    the moved cells and must answer exactly as without a cache."""
    first_turn = chat(("user", QUESTIONS[1]))
    long_answer = chat(("user", "Describe every room of the library in detail."))
    async with running_server(llama_model, server_config, max_sessions=4, interactive_reserve=0) as srv:
        with trio.fail_after(240):
            async with UmaClient.connect(srv.config.socket_path) as client:
                await client.complete(prompt="Count to three.", max_tokens=4, temperature=0.0)  # id 0
                first, _ = await greedy(client, first_turn, max_tokens=12)  # id 1
                moves_midway = -1
                async with client.stream(messages=long_answer, max_tokens=40, temperature=0.0) as events:
                    n = 0
                    async for event in events:  # id 2
                        n += isinstance(event, TokenEvent)
                        if n == 8 and moves_midway < 0:
                            await client.complete(
                                prompt="Name a colour.", max_tokens=4, temperature=0.0
                            )  # id 3
                            await client.complete(prompt="Say hello.", max_tokens=4, temperature=0.0)
                            moves_midway = (await cache_figures(client))["moves"]
                reply = b"".join(llama_model.piece(t) for t in first).decode("utf-8", "replace")
                turn2 = chat(("user", QUESTIONS[1]), ("assistant", reply), ("user", "And on Sundays?"))
                second, second_eos = await greedy(client, turn2)
    assert moves_midway == 1
    assert second_eos.usage.cached_tokens > 300
    assert [second] == await reference(llama_model, server_config, [turn2])
