"""What routers and agents read from a refusal (docs/FLEET.md): a prompt that does not fit
is one LiteLLM and Claude Code recognise by its words, a draining daemon leaves its rest to
the router, and a daemon bound to every address answers to the machine's own names."""

from __future__ import annotations

import os
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.http.origin import allowed_hosts, host_allowed

from .conftest import running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
LONG = [{"role": "user", "content": "Tell me about the sea. " * 120}]  # ~720 tokens


def test_a_wildcard_bind_answers_to_the_machines_own_names() -> None:
    everywhere = allowed_hosts("0.0.0.0", (), ("mac-a", "mac-a.lan.example."))
    assert {"mac-a", "mac-a.local", "mac-a.lan.example", "localhost"} <= everywhere
    assert not host_allowed("evil.example", everywhere)  # a rebinding page's own name
    assert "mac-a" not in allowed_hosts("127.0.0.1", (), ("mac-a",))  # loopback: loopback names
    assert allowed_hosts("0.0.0.0", (), ("localhost",)) == allowed_hosts("127.0.0.1", ())


@pytest.mark.model
async def test_a_prompt_over_the_context_is_one_litellm_and_claude_code_recognise(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """LiteLLM tells a context overflow by its message (then its context_window_fallbacks
    move to a bigger model); Claude Code by Anthropic's "prompt is too long" (then it
    compacts).  Before, the daemon's words matched neither: a plain BadRequestError."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map
    import litellm

    async with running_server(llama_model, server_config, http="127.0.0.1:0", n_ctx=256) as server:
        base = f"{server.http_url}/v1"

        def through_litellm() -> Exception:
            try:
                litellm.completion(
                    model=f"openai/{MODEL}", api_base=base, api_key="none", messages=LONG, max_tokens=8,
                    num_retries=0,
                )  # fmt: skip
            except Exception as exc:
                return exc
            raise AssertionError("the prompt was served")

        refused = await trio.to_thread.run_sync(through_litellm)
        assert isinstance(refused, litellm.ContextWindowExceededError), refused
        claude = anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key="none", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await claude.messages.create(model=MODEL, messages=LONG, max_tokens=8)  # type: ignore[arg-type]
        error: Any = too_long.value.body
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("prompt is too long: ")
        chat = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as overflow:
            await chat.chat.completions.create(model=MODEL, messages=LONG, max_tokens=8)  # type: ignore[arg-type]
        assert overflow.value.code == "context_length_exceeded"
        # A prompt that fits with a max_tokens that does not: on OpenAI's routes max_tokens is a
        # ceiling (llama-server's and Ollama's reading; agents ask for 32,000), so the answer
        # is cut where the context ends.  /generate (the socket's request over HTTP) still
        # refuses it, naming max_tokens (not "prompt is too long", which a client would
        # shorten the wrong thing for) and the room left.
        short = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]
        cut = await chat.chat.completions.create(model=MODEL, messages=short, max_tokens=300, temperature=0)  # type: ignore[arg-type]
        assert cut.choices[0].finish_reason == "length" and cut.usage is not None
        assert cut.usage.prompt_tokens + cut.usage.completion_tokens == 256
        async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
            asked = await http.post("/generate", json={"messages": short, "max_tokens": 300})
        assert asked.status_code == 400 and asked.json()["error"]["code"] == "context_length_exceeded"
        message = asked.json()["error"]["message"]
        assert message.startswith("max_tokens is too large: ") and "at most " in message
        assert "exceeds the available context size" in message


@pytest.mark.model
async def test_a_draining_daemon_leaves_the_rest_to_the_router(
    llama_model: LlamaModel, server_config: ServerConfig
) -> None:
    """A router takes Retry-After as how long to rest a daemon (LiteLLM: ahead of its own
    cooldown_time): a draining daemon sends none, so the router's cooldown holds; a busy or
    loading one still says one second."""
    async with running_server(llama_model, server_config, http="127.0.0.1:0") as server:
        server.loop.stop_accepting()  # what a shutdown does first
        body: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=str(server.http_url)) as http:
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "E_LIMIT_008"
            assert "retry-after" not in refused.headers
            health = await http.get("/health")
            assert health.status_code == 503 and "retry-after" not in health.headers
