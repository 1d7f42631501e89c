"""Shared fixtures: the real default model (loaded once) and an in-process daemon."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from uma_trio.config import ServerConfig
from uma_trio.daemon import serving
from uma_trio.engine.llama import LlamaModel
from uma_trio.model_files import ensure_default_model
from uma_trio.runtime.server import Server

if TYPE_CHECKING:  # the GPU machine runs tests/test_gpu.py without the SDK installed
    import openai

_socket_numbers = itertools.count()


@pytest.fixture(scope="session")
def model_path() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def llama_model(model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(model_path)
    yield model
    model.close()


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~108 bytes, so keep them short.
    with tempfile.TemporaryDirectory(prefix="uma-") as tmp:
        yield Path(tmp) / f"d{next(_socket_numbers)}.sock"


@pytest.fixture
def server_config(socket_path: Path) -> ServerConfig:
    return ServerConfig(
        socket_path=socket_path, n_ctx=2048, max_sessions=8, metrics_interval_s=3600, bmt_budget_gbps=20.0
    )


@pytest.fixture
async def server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    async with running_server(llama_model, server_config) as srv:
        yield srv


API_KEY = "k"


@pytest.fixture
async def keyed_http_server(llama_model: LlamaModel, server_config: ServerConfig) -> AsyncIterator[Server]:
    """A daemon on the real model with the HTTP gateway on a free port, key ``API_KEY``."""
    async with running_server(llama_model, server_config, http="127.0.0.1:0", api_key=API_KEY) as srv:
        yield srv


def openai_sdk(server: Server) -> openai.AsyncOpenAI:
    """The official SDK pointed at ``server``'s gateway, without retries."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)


@asynccontextmanager
async def running_server(model: LlamaModel, config: ServerConfig, **overrides: Any) -> AsyncIterator[Server]:
    """Start a daemon on the real model in this trio run; stop it and free its context after."""
    async with serving(model, replace(config, **overrides)) as server:
        yield server
