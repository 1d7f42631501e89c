"""On a GPU (skipped without one): layers are offloaded, and greedy output matches the CPU's.

benches/gpu/run.sh runs these on the lent GPU machine with a random-weight Llama-3-8B-shaped
model (``UMA_GPU_TEST_MODEL``); elsewhere they use the default model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from uma_trio.engine.base import BatchEntry
from uma_trio.engine.devices import devices, supports_gpu_offload
from uma_trio.engine.llama import DETERMINISTIC, ContextConfig, LlamaEngine, LlamaModel, Placement
from uma_trio.engine.sampling import Sampler, SamplingParams

HAS_GPU = supports_gpu_offload() and any(d.offloads for d in devices())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU backend or device")]
PROMPT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module")
def model_path() -> Path:
    given = os.environ.get("UMA_GPU_TEST_MODEL")
    if given:
        return Path(given)
    from uma_trio.model_files import ensure_default_model

    return ensure_default_model()


def greedy(engine: LlamaEngine, prompt: str, seq_id: int = 0, steps: int = STEPS) -> list[int]:
    tokens = engine.tokenize(prompt)
    sampler = Sampler(SamplingParams(temperature=0.0))
    out = engine.step_sync([BatchEntry(seq_id, tokens, 0, sampler)]).sampled[0].token_id
    produced, pos = [out], len(tokens)
    for _ in range(steps - 1):
        out = (
            engine.step_sync([BatchEntry(seq_id, np.array([out], np.int32), pos, sampler)])
            .sampled[0]
            .token_id
        )
        produced.append(out)
        pos += 1
    engine.free_seq(seq_id)
    return produced


def run(path: Path, layers: int, **context: object) -> list[int]:
    model = LlamaModel(path, Placement(n_gpu_layers=layers))
    try:
        engine = LlamaEngine(model, ContextConfig(n_ctx_seq=256, n_seq_max=4, **context))  # type: ignore[arg-type]
        try:
            if layers:
                assert model.layers_offloaded == model.layers_total, "every layer should be on the GPU"
            return greedy(engine, PROMPT)
        finally:
            engine.close()
    finally:
        model.close()


def test_every_layer_is_offloaded_and_greedy_text_matches_the_cpu(model_path: Path) -> None:
    # Deterministic settings on both: the same kernels' arithmetic cannot be promised across
    # devices, but greedy choices with clear margins must agree.
    assert run(model_path, 999, **DETERMINISTIC) == run(model_path, 0, **DETERMINISTIC)


def test_deterministic_mode_is_batch_invariant_on_the_gpu(model_path: Path) -> None:
    model = LlamaModel(model_path, Placement(n_gpu_layers=999))
    try:
        engine = LlamaEngine(model, ContextConfig(n_ctx_seq=256, n_seq_max=4, **DETERMINISTIC))  # type: ignore[arg-type]
        try:
            alone = greedy(engine, PROMPT)
            tokens = engine.tokenize(PROMPT)
            sampler = Sampler(SamplingParams(temperature=0.0))
            others = [engine.tokenize(f"Story number {i}: once upon a time") for i in (1, 2, 3)]
            entries = [BatchEntry(0, tokens, 0, sampler)] + [
                BatchEntry(i + 1, t, 0, sampler) for i, t in enumerate(others)
            ]
            result = engine.step_sync(entries)
            first = {s.seq_id: s.token_id for s in result.sampled}
            batched, pos = [first[0]], len(tokens)
            positions = {i + 1: len(t) for i, t in enumerate(others)}
            last = dict(first)
            for _ in range(STEPS - 1):
                step = [BatchEntry(0, np.array([last[0]], np.int32), pos, sampler)] + [
                    BatchEntry(s, np.array([last[s]], np.int32), positions[s], sampler) for s in positions
                ]
                last = {x.seq_id: x.token_id for x in engine.step_sync(step).sampled}
                batched.append(last[0])
                pos += 1
                positions = {s: p + 1 for s, p in positions.items()}
            assert batched == alone
        finally:
            engine.close()
    finally:
        model.close()
