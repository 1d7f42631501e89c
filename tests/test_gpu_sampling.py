"""Greedy rows sampled by llama.cpp where the logits are computed (``--gpu-sampling``).

The mechanism is the same on every backend, so the real model on the CPU checks it: the
device-picked tokens are the host's argmax, sampled requests beside them still get their
logits rows, and a sequence id keeps its sampler across requests (each change costs
llama.cpp a graph re-reserve)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from uma_trio.config import ServerConfig
from uma_trio.daemon import context_config
from uma_trio.engine.base import BatchEntry
from uma_trio.engine.llama import ContextConfig, LlamaEngine, LlamaModel
from uma_trio.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Tell me a joke", "Write a poem about the sea", "Explain gravity", "List three fruits."]


def run(engine: LlamaEngine, samplers: list[Sampler], steps: int = 12) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode all of them together."""
    prompts = [engine.tokenize(engine.apply_chat_template([("user", p)])) for p in PROMPTS[: len(samplers)]]
    first = engine.step_sync([BatchEntry(i, p, 0, samplers[i]) for i, p in enumerate(prompts)])
    assert not first.failed
    out = {s.seq_id: [s.token_id] for s in first.sampled}
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        entries = [BatchEntry(i, np.array([out[i][-1]], np.int32), pos[i], samplers[i]) for i in out]
        result = engine.step_sync(entries)
        assert not result.failed
        for s in result.sampled:
            out[s.seq_id].append(s.token_id)
        pos = [p + 1 for p in pos]
    for i in out:
        engine.free_seq(i)
    return [out[i] for i in range(len(samplers))]


@pytest.fixture
def engines(llama_model: LlamaModel) -> Iterator[tuple[LlamaEngine, LlamaEngine]]:
    config = ContextConfig(n_ctx_seq=512, n_seq_max=4, kv_unified=True)
    host = LlamaEngine(llama_model, config)
    device = LlamaEngine(llama_model, ContextConfig(**{**config.__dict__, "device_greedy": True}))
    yield host, device
    host.close()
    device.close()


def greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0.0))


def seeded(seed: int) -> Sampler:
    return Sampler(SamplingParams(temperature=0.9, seed=seed))


def test_device_picked_tokens_are_the_hosts_argmax(engines: tuple[LlamaEngine, LlamaEngine]) -> None:
    host, device = engines
    expected = run(host, [greedy() for _ in range(4)])
    assert run(device, [greedy() for _ in range(4)]) == expected
    # Attached once per sequence id, then kept: a second request on the same ids changes nothing.
    assert device._device_greedy.attach_changes == 4
    assert run(device, [greedy() for _ in range(4)]) == expected
    assert device._device_greedy.attach_changes == 4


def test_sampled_requests_beside_device_greedy_ones_get_their_rows(
    engines: tuple[LlamaEngine, LlamaEngine],
) -> None:
    host, device = engines
    mixed = [greedy, lambda: seeded(7), greedy, lambda: seeded(11)]
    expected = run(host, [make() for make in mixed])
    assert run(device, [make() for make in mixed]) == expected
    assert device._device_greedy.attach_changes == 2
    # The ids that sampled on the device now carry sampled requests: their samplers come off.
    swapped = [lambda: seeded(5), greedy, lambda: seeded(9), greedy]
    assert run(device, [make() for make in swapped]) == run(host, [make() for make in swapped])
    assert device._device_greedy.attach_changes == 2 + 4


def test_device_sampling_is_asked_for_not_the_default() -> None:
    assert not context_config(ServerConfig(), all_layers_on_gpu=True).device_greedy
    assert context_config(ServerConfig(gpu_sampling=True), all_layers_on_gpu=False).device_greedy
