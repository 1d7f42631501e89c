"""Context limits, as the twenty-seventh session's review found them: the socket's default
``max_tokens`` against a lower ``--max-tokens``, the Responses API's ``truncation``, and the
context a request may hold as the models list says it with ``--kv-unified``."""

from __future__ import annotations

import msgspec
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel

from .conftest import running_server
from .helpers import RawClient, sim_daemon


async def test_an_unset_max_tokens_takes_a_lower_max_tokens_limit(autojump_clock: trio.abc.Clock) -> None:
    """With `--max-tokens 20`, a socket request that named no max_tokens was refused
    ("max_tokens 256 exceeds the limit of 20"): the default is cut to the limit; a
    max_tokens the client names past it is still refused."""
    async with sim_daemon(max_tokens=20) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "d", "prompt": "hi there", "stream": False})
        served = await client.until_end("d")
        await client.send({"id": "x", "prompt": "hi there", "max_tokens": 21})
        refused = await client.next_event()
    assert served[-1]["event"] == "eos" and served[-1]["reason"] == "length", served[-1]
    assert served[-1]["usage"]["completion_tokens"] == 20
    assert refused is not None and refused["code"] == "E_LIMIT_003", refused


async def test_an_unset_max_tokens_that_does_not_fit_is_said_to_be_the_default(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Protocol review: with a 64-token context, a 10-token prompt that named no max_tokens
    was refused as "prompt (11 tokens) + max_tokens (256) exceeds the context", a field the
    client never sent: the message says it is the default, and how many tokens fit."""
    async with sim_daemon(n_ctx=64, max_sessions=1) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"id": "d", "prompt": "one two three four five six"})
        default = await client.next_event()
        await client.send({"id": "x", "prompt": "one two three four five six", "max_tokens": 100})
        named = await client.next_event()
    assert default is not None and default["code"] == "E_LIMIT_002", default
    assert "max_tokens (256, the default)" in default["message"] and "ask for that many" in default["message"]
    assert named is not None and "max_tokens (100)" in named["message"], named


def test_responses_truncation_auto_drops_the_oldest_turns_and_other_values_are_refused() -> None:
    """`truncation: "auto"` was ignored (an input too long was refused) and `"bogus"` taken."""
    from uma_trio.protocol.responses_api import ResponsesBody, responses_request

    auto = msgspec.convert({"model": "m", "input": "hi", "truncation": "auto"}, ResponsesBody)
    assert responses_request(auto, "r", None)[0].truncate
    disabled = msgspec.convert({"model": "m", "input": "hi", "truncation": "disabled"}, ResponsesBody)
    assert not responses_request(disabled, "r", None)[0].truncate
    with pytest.raises(msgspec.ValidationError, match=r"truncation"):
        msgspec.convert({"model": "m", "input": "hi", "truncation": "bogus"}, ResponsesBody)


async def test_the_models_list_gives_the_context_a_request_may_hold(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """With --kv-unified a request may hold every cell (4 x 256 here), and the refusal said
    "in 1024 (--n-ctx)" while --n-ctx was 256; /v1/models said 256, /api/show 1024."""
    async with running_server(
        llama_model, server_config, n_ctx=256, max_sessions=4, kv_unified=True
    ) as server:
        client = await RawClient.connect(server.config.socket_path)
        await client.send({"type": "models", "id": "l"})
        listed = await client.next_event()
        await client.send({"id": "p", "prompt": "word " * 1100, "max_tokens": 1, "max_context": 5000})
        refused = await client.next_event()
    assert listed is not None and listed["models"][0]["context_length"] == 1024, listed
    assert refused is not None and refused["code"] == "E_LIMIT_002", refused
    assert "in 1024 (the per-request context)" in refused["message"]
