"""A run-ahead chain hands each step's result back at the point its backend calls for.

On a CPU the result goes back just before the next ``llama_decode``; where every layer is on
a GPU, just after it, while the device computes (``LlamaEngine._chain``).  The GPU order is
run here on the real model by telling the CPU engine that its step frees the host: the
tokens, the order the results come back in, and what a failing step leaves must be the
same in both orders.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import trio

from uma_trio.engine.base import BatchEntry, EngineError, StepResult
from uma_trio.engine.llama import ContextConfig, LlamaEngine, LlamaModel
from uma_trio.engine.sampling import Sampler, SamplingParams

PROMPTS = ("The capital of France is", "Three primary colours are", "def fibonacci(n):")
STEPS = 12


@pytest.fixture(scope="module")
def engine(llama_model: LlamaModel) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(llama_model, ContextConfig(n_ctx_seq=256, n_seq_max=4))
    yield engine
    engine.close()


def chain(
    engine: LlamaEngine, llama_model: LlamaModel, *, fail_at: int | None = None, hold: bool = False,
    held: list[float] | None = None,
) -> tuple[dict[int, list[int]], list[int], EngineError | None]:  # fmt: skip
    """Each prompt's greedy tokens over a chain of STEPS steps; how many entries each step's
    result came back for, in order; the error that ended it (``fail_at``: that step's batch
    names a sequence the context does not have, so ``llama_decode`` refuses it).  ``hold``:
    the results come back together (engine/held_results.py); ``held`` gets how long each was
    kept."""
    greedy = Sampler(SamplingParams(temperature=0.0))
    first = [BatchEntry(seq, llama_model.tokenize(text), 0, greedy) for seq, text in enumerate(PROMPTS)]
    steps = 0

    def follow(entries: Sequence[BatchEntry], result: StepResult) -> list[BatchEntry] | None:
        nonlocal steps
        steps += 1
        if steps >= STEPS:
            return None
        tokens = {s.seq_id: s.token_id for s in result.sampled}
        after = [
            BatchEntry(e.seq_id, np.array([tokens[e.seq_id]], dtype=np.int32), e.pos0 + len(e.tokens), greedy)
            for e in entries
        ]
        if steps == fail_at:
            after.append(BatchEntry(engine.n_seq_max, np.array([1], dtype=np.int32), 0, greedy))
        return after

    generated: dict[int, list[int]] = {seq: [] for seq in range(len(PROMPTS))}
    sizes: list[int] = []
    error: EngineError | None = None

    async def run() -> None:
        nonlocal error
        try:
            result = await engine.step(first, follow, hold=hold)
            while True:
                sizes.append(len(result.sampled))
                if held is not None:
                    held.append(result.held_s)
                for s in result.sampled:
                    generated[s.seq_id].append(s.token_id)
                if not engine.running_ahead:
                    break
                _, result = await engine.next_ahead()
        except EngineError as exc:
            error = exc

    trio.run(run)
    for seq in range(len(PROMPTS)):
        engine.free_seq(seq)
    return generated, sizes, error


@pytest.mark.model
def test_the_device_order_hands_back_the_same_tokens_in_the_same_order(
    engine: LlamaEngine, llama_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_cpu, cpu_sizes, cpu_error = chain(engine, llama_model)
    monkeypatch.setattr(LlamaEngine, "step_frees_host", property(lambda self: True))
    on_device, device_sizes, device_error = chain(engine, llama_model)
    assert cpu_error is None and device_error is None
    assert cpu_sizes == device_sizes == [len(PROMPTS)] * STEPS
    assert on_device == on_cpu
    assert all(len(tokens) == STEPS for tokens in on_cpu.values())


@pytest.mark.model
@pytest.mark.parametrize("frees_host", [False, True])
def test_results_held_come_back_the_same_in_order_each_with_its_wait(
    engine: LlamaEngine, llama_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, frees_host: bool
) -> None:
    """A background chain's results, kept and handed back together, in either order: the
    same tokens in the same order, the earlier ones kept longer."""
    each, each_sizes, _ = chain(engine, llama_model)
    monkeypatch.setattr(LlamaEngine, "step_frees_host", property(lambda self: frees_host))
    waits: list[float] = []
    together, sizes, error = chain(engine, llama_model, hold=True, held=waits)
    assert error is None and together == each and sizes == each_sizes
    assert waits[0] > waits[-2] >= 0.0 and waits[0] > 0.01  # 11 steps of ~8 ms kept for the 12th


@pytest.mark.model
@pytest.mark.parametrize(("frees_host", "hold"), [(False, False), (True, False), (False, True), (True, True)])
def test_a_step_that_fails_mid_chain_keeps_the_tokens_before_it(
    engine: LlamaEngine,
    llama_model: LlamaModel,
    monkeypatch: pytest.MonkeyPatch,
    frees_host: bool,
    hold: bool,
) -> None:
    whole, _, _ = chain(engine, llama_model)
    monkeypatch.setattr(LlamaEngine, "step_frees_host", property(lambda self: frees_host))
    cut, sizes, error = chain(engine, llama_model, fail_at=5, hold=hold)
    assert error is not None and "llama_decode returned" in str(error)
    assert sizes == [len(PROMPTS)] * 5  # the five steps before the refused one came back
    assert cut == {seq: tokens[:5] for seq, tokens in whole.items()}
    assert not engine.running_ahead
