"""ΣBMT estimate and budget trimming (pure), plus the real model's memory profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from uma_trio.engine.llama import LlamaModel
from uma_trio.engine.memory_profile import memory_profile, probe_bandwidth_gbps
from uma_trio.sched.bmt import MemoryProfile, tick_bytes, trim_to_budget

# Round numbers so expectations can be computed by hand: 1000 B of weights per
# micro-batch of 4 tokens, 10 B per KV cell.
P = MemoryProfile(weight_bytes=1000, kv_bytes_per_cell=10, n_ubatch=4)


# -- tick_bytes ----------------------------------------------------------------


def test_empty_tick_moves_nothing() -> None:
    assert tick_bytes(P, [], []) == 0
    assert tick_bytes(P, [], [(50, 0)]) == 0


def test_one_decoder_reads_weights_once_plus_its_cells() -> None:
    assert tick_bytes(P, [5], []) == 1000 + 5 * 10


def test_decoders_in_one_micro_batch_share_the_weight_read() -> None:
    # 4 tokens = 1 micro-batch; cells 5+7+0+3 = 15.
    assert tick_bytes(P, [5, 7, 0, 3], []) == 1000 + 15 * 10


def test_weights_are_read_once_per_micro_batch() -> None:
    assert tick_bytes(P, [1] * 5, []) == 2 * 1000 + 5 * 10  # ceil(5/4) = 2
    assert tick_bytes(P, [1] * 8, []) == 2 * 1000 + 8 * 10
    assert tick_bytes(P, [1] * 9, []) == 3 * 1000 + 9 * 10


def test_kv_traffic_grows_with_n_past() -> None:
    assert tick_bytes(P, [101], []) - tick_bytes(P, [100], []) == 10
    assert tick_bytes(P, [2000], []) == 1000 + 2000 * 10


def test_prefill_chunk_reads_its_cells_once_per_micro_batch_it_spans() -> None:
    # 8 tokens from 0: 2 micro-batches, each reading the 8 cells up to start+n.
    assert tick_bytes(P, [], [(0, 8)]) == 2 * 1000 + 8 * 2 * 10
    # 3 tokens from 100: 1 micro-batch reading 103 cells.
    assert tick_bytes(P, [], [(100, 3)]) == 1000 + 103 * 10


def test_mixed_tick() -> None:
    # 1 decode + 5 prompt tokens = 6 tokens -> 2 micro-batches;
    # cells: 10 (decoder) + 25 * ceil(5/4) = 50 (chunk) -> 60.
    assert tick_bytes(P, [10], [(20, 5)]) == 2 * 1000 + 60 * 10


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        MemoryProfile(weight_bytes=1, kv_bytes_per_cell=1, n_ubatch=0)
    with pytest.raises(ValueError):
        MemoryProfile(weight_bytes=-1, kv_bytes_per_cell=1, n_ubatch=1)


# -- trim_to_budget --------------------------------------------------------------

INTERACTIVE = [(1, 10)]
BACKGROUND = [(2, 10), (3, 10)]
PREFILL = [(4, 0, 8)]


def test_nothing_trimmed_under_budget() -> None:
    full = tick_bytes(P, [10, 10, 10], [(0, 8)])  # 11 tokens -> 3 ubatches + 46 cells = 3460
    assert full == 3460
    result = trim_to_budget(P, full, interactive=INTERACTIVE, background=BACKGROUND, prefill=PREFILL)
    assert result.interactive == tuple(INTERACTIVE)
    assert result.background == tuple(BACKGROUND)
    assert result.prefill == tuple(PREFILL)
    assert result.trimmed == ()
    assert result.n_bytes == full
    assert result.within_budget


def test_prefill_is_shrunk_before_any_decoder_goes() -> None:
    # 3 decoders + 1 prompt token = 4 tokens, one micro-batch: 1000 + 31 cells = 1310.
    # 2 prompt tokens would need a second micro-batch, over 1400.
    result = trim_to_budget(P, 1400, interactive=INTERACTIVE, background=BACKGROUND, prefill=PREFILL)
    assert result.prefill == ((4, 0, 1),)
    assert result.background == tuple(BACKGROUND)
    assert result.trimmed == ()
    assert result.n_bytes == 1310


def test_background_decoders_dropped_from_the_end_after_prefill() -> None:
    # Even 1 prompt token (1310) is over 1250, and so are the 3 decoders alone
    # (1300): drop the chunk, then the last background decoder (1200).
    result = trim_to_budget(P, 1250, interactive=INTERACTIVE, background=BACKGROUND, prefill=PREFILL)
    assert result.prefill == ()
    assert result.background == ((2, 10),)
    assert result.trimmed == ((4, "bmt"), (3, "bmt"))
    assert result.n_bytes == 1200
    assert result.within_budget


def test_last_chunk_goes_first_then_the_one_before_shrinks() -> None:
    chunks = [(4, 0, 4), (5, 0, 4)]  # together 8 tokens: 2000 + 80
    # Chunk 4 alone fits (1040); any of chunk 5 needs a second micro-batch.
    result = trim_to_budget(P, 1100, prefill=chunks)
    assert result.prefill == ((4, 0, 4),)
    assert result.trimmed == ((5, "bmt"),)
    # Below 1040, chunk 4 shrinks too: 1000 + 10·n <= 1030 -> n = 3.
    result = trim_to_budget(P, 1030, prefill=chunks)
    assert result.prefill == ((4, 0, 3),)
    assert result.trimmed == ((5, "bmt"),)
    # ...unless that would go below min_chunk, in which case it is dropped too.
    result = trim_to_budget(P, 1030, prefill=chunks, min_chunk=4)
    assert result.prefill == ()
    assert result.trimmed == ((5, "bmt"), (4, "bmt"))


def test_interactive_decoders_are_never_trimmed() -> None:
    result = trim_to_budget(P, 0, interactive=INTERACTIVE, background=BACKGROUND, prefill=PREFILL)
    assert result.interactive == tuple(INTERACTIVE)
    assert result.background == ()
    assert result.prefill == ()
    assert result.trimmed == ((4, "bmt"), (3, "bmt"), (2, "bmt"))
    assert result.n_bytes == 1000 + 10 * 10
    assert not result.within_budget


_decoders = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 4000)), max_size=6)
_chunks = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 4000), st.integers(1, 300)), max_size=4)


@given(
    interactive=_decoders,
    background=_decoders,
    prefill=_chunks,
    budget=st.integers(0, 200_000),
    n_ubatch=st.integers(1, 64),
)
def test_trim_fits_the_budget_whenever_possible(
    interactive: list[tuple[int, int]],
    background: list[tuple[int, int]],
    prefill: list[tuple[int, int, int]],
    budget: int,
    n_ubatch: int,
) -> None:
    profile = MemoryProfile(weight_bytes=5000, kv_bytes_per_cell=3, n_ubatch=n_ubatch)
    result = trim_to_budget(profile, budget, interactive=interactive, background=background, prefill=prefill)
    kept_ctx = [n for _, n in result.interactive] + [n for _, n in result.background]
    assert result.n_bytes == tick_bytes(profile, kept_ctx, [(s, n) for _, s, n in result.prefill])
    floor = tick_bytes(profile, [n for _, n in interactive], [])
    assert result.within_budget == (result.n_bytes <= budget)
    if floor <= budget:  # only the interactive decoders can keep it over budget
        assert result.within_budget
    # Kept work is a prefix of each list (chunks possibly shrunk); nothing else changes.
    assert result.interactive == tuple(interactive)
    assert result.background == tuple(background[: len(result.background)])
    for kept, original in zip(result.prefill, prefill, strict=False):
        assert kept[:2] == original[:2] and 1 <= kept[2] <= original[2]
    assert len(result.trimmed) == (len(background) - len(result.background)) + (
        len(prefill) - len(result.prefill)
    )
    # Background decoders only go once all prefill is gone.
    if len(result.background) < len(background):
        assert result.prefill == ()


# -- the real model ----------------------------------------------------------------


@pytest.mark.model
def test_memory_profile_of_the_default_model(llama_model: LlamaModel, model_path: Path) -> None:
    profile = memory_profile(llama_model, n_ubatch=32)
    file_size = model_path.stat().st_size
    assert abs(profile.weight_bytes - file_size) <= 0.2 * file_size
    assert profile.n_ubatch == 32
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; f16 K + f16 V = 4 bytes/element.
    assert profile.kv_bytes_per_cell == 30 * 3 * 64 * 4 == 23040
    assert memory_profile(llama_model, 32, kv_type_bytes=1.0).kv_bytes_per_cell == 23040 // 2


def test_probe_bandwidth_is_plausible() -> None:
    gbps = probe_bandwidth_gbps()
    assert 0.5 < gbps < 1000
