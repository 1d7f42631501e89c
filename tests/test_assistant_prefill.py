"""A chat that ends with the assistant's own text is continued, not answered anew:
Anthropic's prefill (``{"role": "assistant", "content": "{"}`` to start a JSON answer), and
what llama-server and Ollama do with such a chat (engine/base.py ``split_prefill``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import numpy as np
import ollama
import openai
import pytest

from uma_trio.config import ServerConfig
from uma_trio.engine.base import split_prefill
from uma_trio.engine.llama import LlamaModel
from uma_trio.runtime.server import Server

from .conftest import API_KEY, running_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = {"role": "user", "content": "What is the capital of France?"}
STARTED = "The capital of France is"
PREFILLED: list[Any] = [ASK, {"role": "assistant", "content": STARTED}]


def test_only_a_last_assistant_text_after_another_message_is_continued() -> None:
    user, said = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}
    assert split_prefill([user, said]) == ([user], "Hel")
    assert split_prefill([said]) == ([said], "")  # nothing before it to answer
    assert split_prefill([user]) == ([user], "")
    called = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    assert split_prefill([user, called]) == ([user, called], "")
    assert split_prefill([user, {**said, "tool_calls": [{"id": "1"}]}])[1] == ""
    assert split_prefill([user, {"role": "assistant", "content": ""}])[1] == ""


@pytest.mark.model
def test_the_prefill_follows_the_assistants_turn_with_no_end_of_turn(llama_model: LlamaModel) -> None:
    tokens = llama_model.tokenize_chat(PREFILLED)
    asked = llama_model.tokenize_chat([ASK])  # up to "<|im_start|>assistant\n"
    text = llama_model.tokenize(STARTED, add_bos=False, special=False)
    assert np.array_equal(tokens, np.concatenate([asked, text]))
    # Before, the assistant's turn was closed and a new one opened after it.
    closed = llama_model.tokenize("<|im_end|>", add_bos=False)
    assert closed[0] not in tokens[len(asked) :].tolist()


@pytest.fixture
async def server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config, http="127.0.0.1:0", api_key=API_KEY) as srv:
        yield srv


@pytest.mark.model
async def test_every_api_continues_the_assistants_text(server: Server) -> None:
    """The answer is only what follows the prefill (as Anthropic's API answers), and it goes
    on from it: greedy, "The capital of France is" goes on with " Paris"."""
    async with anthropic.AsyncAnthropic(base_url=str(server.http_url), api_key=API_KEY, max_retries=0) as api:
        message = await api.messages.create(
            model=MODEL, messages=PREFILLED, max_tokens=6, extra_body={"temperature": 0}
        )
    text = message.content[0].text if message.content[0].type == "text" else ""
    assert text.startswith(" Paris"), text
    chat = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)
    answer = await chat.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=6, temperature=0)
    assert (answer.choices[0].message.content or "").startswith(" Paris")
    assert answer.usage is not None and message.usage.input_tokens == answer.usage.prompt_tokens
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = await ollama.AsyncClient(host=str(server.http_url), headers=headers).chat(
        model=MODEL, messages=PREFILLED, options={"temperature": 0, "num_predict": 6}
    )
    assert (reply.message.content or "").startswith(" Paris")
