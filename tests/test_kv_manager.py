"""The KV manager's decisions, alone: which id a request gets, what it reuses, what is evicted."""

from __future__ import annotations

import numpy as np
import pytest

from uma_trio.sched.kv_manager import Claim, KvManager, Move, common_prefix


def toks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


SYSTEM = seq(1000, 40)  # a shared 40-token prefix


def prompt(tail_start: int, tail: int = 10) -> np.ndarray:
    return np.concatenate([SYSTEM, seq(tail_start, tail)])


def test_common_prefix() -> None:
    assert common_prefix(toks(1, 2, 3), toks(1, 2, 4)) == 2
    assert common_prefix(toks(1, 2), toks(1, 2, 3)) == 2
    assert common_prefix(toks(), toks(1)) == 0
    assert common_prefix(toks(5), toks(6)) == 0


def test_cold_request_takes_a_free_id_and_its_end_leaves_it_cached() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    claim = kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    assert claim == Claim(seq_id=0)
    assert kv.release(0, prompt(1)) == []
    assert kv.cached() and kv.free_seqs == 1 and kv.cached_cells == 50
    assert (kv.stats.hits, kv.stats.misses) == (0, 1)


def test_shared_prefix_is_copied_and_the_source_stays_cached() -> None:
    kv = KvManager(n_seqs=3, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    kv.release(0, prompt(1))
    claim = kv.claim(prompt(500), {}, cells_needed=60, cells_reserved=0)
    assert claim == Claim(seq_id=1, source=0, reused=40)
    assert not claim.adopted and 0 in kv.cached()
    assert kv.stats.reused_tokens == 40


def test_next_turn_adopts_the_whole_conversation_without_copying() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    history = np.concatenate([prompt(1), seq(7000, 5)])  # prompt plus the answer fed back
    kv.release(0, history)
    turn2 = np.concatenate([history, seq(9000, 8)])
    claim = kv.claim(turn2, {}, cells_needed=80, cells_reserved=0)
    assert claim == Claim(seq_id=0, source=0, reused=len(history))
    assert claim.adopted and not kv.cached() and kv.free_seqs == 1


def test_the_same_prompt_again_adopts_the_old_answer_s_sequence_without_copying() -> None:
    kv = KvManager(n_seqs=3, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    answered = np.concatenate([prompt(1), seq(7000, 30)])  # its answer: 30 tokens fed back
    kv.release(0, answered, prompt_len=len(prompt(1)))
    again = kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)  # regenerate / re-send
    assert again == Claim(seq_id=0, source=0, reused=len(prompt(1)) - 1)
    assert again.adopted and not kv.cached()


def test_among_equal_matches_the_adopted_sequence_is_the_one_next_to_the_running_ids() -> None:
    kv = KvManager(n_seqs=4, n_cells=1000)
    for seq_id in range(4):
        assert kv.claim(prompt(seq_id * 100), {}, cells_needed=60, cells_reserved=0) is not None
    same = prompt(7)
    kv.release(3, same, prompt_len=len(same))  # least recently used: scanned first
    kv.release(2, same, prompt_len=len(same))  # the same prompt, next to the running 0 and 1
    claim = kv.claim(same, {}, cells_needed=60, cells_reserved=0)
    assert claim is not None and claim.adopted and claim.seq_id == 2  # 3 would run apart


def test_a_prompt_sharing_only_part_of_another_s_prompt_copies_and_keeps_it() -> None:
    kv = KvManager(n_seqs=3, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    kv.release(0, np.concatenate([prompt(1), seq(7000, 30)]), prompt_len=len(prompt(1)))
    other = kv.claim(prompt(500), {}, cells_needed=60, cells_reserved=0)  # the system prompt only
    assert other == Claim(seq_id=1, source=0, reused=len(SYSTEM))
    assert 0 in kv.cached()


def test_the_last_prompt_token_is_always_computed() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    kv.release(0, prompt(1))
    claim = kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)  # the very same prompt
    assert claim is not None and claim.reused == len(prompt(1)) - 1


def test_running_sequences_are_sources_too() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    claim = kv.claim(prompt(2), {0: prompt(1)[:45]}, cells_needed=60, cells_reserved=60)
    assert claim == Claim(seq_id=1, source=0, reused=40)


def test_short_matches_are_not_worth_a_copy() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000, min_reuse=16)
    kv.claim(seq(0, 20), {}, cells_needed=30, cells_reserved=0)
    kv.release(0, seq(0, 20))
    claim = kv.claim(np.concatenate([seq(0, 10), seq(500, 10)]), {}, cells_needed=30, cells_reserved=0)
    assert claim == Claim(seq_id=1)


def test_a_short_prompt_sent_again_or_grown_adopts_its_sequence() -> None:
    """Adoption copies nothing, so a match under min_reuse still counts when the cached
    sequence would be adopted: a warm-up's 8-token prompt that the next prompt starts with
    (compare.py's scaling: 74 ms to the first token against llama-server's 49, which reuses
    its slot)."""
    kv = KvManager(n_seqs=3, n_cells=1000, min_reuse=16)
    kv.claim(seq(0, 8), {}, cells_needed=20, cells_reserved=0)
    kv.release(0, np.concatenate([seq(0, 8), seq(900, 3)]), prompt_len=8)  # prompt + answer
    claim = kv.claim(seq(0, 32), {}, cells_needed=160, cells_reserved=0)
    assert claim == Claim(seq_id=0, source=0, reused=8) and claim.adopted
    # A short match that would need a copy is still not taken, nor one whose id would split
    # the running ids where a free id would not.
    kv.release(0, seq(0, 32), prompt_len=32)
    assert kv.claim(np.concatenate([seq(0, 8), seq(500, 8)]), {}, cells_needed=30, cells_reserved=0) == Claim(
        1
    )
    kv = KvManager(n_seqs=4, n_cells=1000, min_reuse=16)
    for start in range(4):
        kv.claim(seq(100 * start + 100, 20), {}, cells_needed=30, cells_reserved=0)
    kv.release(3, seq(0, 8), prompt_len=8)
    kv.release(0, seq(0, 0))  # ids 0 and 2 free, 1 running, 3 cached
    kv.release(2, seq(0, 0))
    assert kv.claim(seq(0, 12), {}, cells_needed=30, cells_reserved=0) == Claim(seq_id=0)
    kv.release(0, seq(0, 0))
    kv.release(1, seq(0, 0))  # nothing running now: id 3 is as good as any
    assert kv.claim(seq(0, 12), {}, cells_needed=30, cells_reserved=0) == Claim(seq_id=3, source=3, reused=8)


def test_cache_yields_ids_least_recently_used_first() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    for i in (0, 1):
        kv.claim(seq(100 * i, 30), {}, cells_needed=40, cells_reserved=0)
    kv.release(0, seq(0, 30))
    kv.release(1, seq(100, 30))
    # A hit on id 0 makes id 1 the least recently used.
    assert kv.claim(
        np.concatenate([seq(0, 20), seq(900, 5)]), {}, cells_needed=30, cells_reserved=0
    ) == Claim(seq_id=1, source=0, reused=20, evicted=(1,))
    assert kv.stats.evictions == 1 and list(kv.cached()) == [0]


def test_the_match_is_adopted_when_its_id_is_the_only_one_left() -> None:
    kv = KvManager(n_seqs=1, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    kv.release(0, prompt(1))
    claim = kv.claim(prompt(500), {}, cells_needed=60, cells_reserved=0)
    assert claim == Claim(seq_id=0, source=0, reused=40)  # trimmed to the shared part
    assert claim.adopted


def test_cached_cells_yield_to_a_reservation_source_last() -> None:
    """One unified pool of 100 cells: two cached prefixes hold 85 of them."""
    kv = KvManager(n_seqs=4, n_cells=100)
    kv.claim(prompt(1), {}, cells_needed=50, cells_reserved=0)
    kv.release(0, prompt(1)[:45])
    kv.claim(seq(5000, 40), {}, cells_needed=40, cells_reserved=0)
    kv.release(1, seq(5000, 40))
    claim = kv.claim(prompt(2), {}, cells_needed=50, cells_reserved=0)
    assert claim == Claim(seq_id=2, source=0, reused=40, evicted=(1,))
    assert kv.free_seqs == 2  # 3 and the evicted 1: no id is lost
    # Needing more still, the source goes too; it is copied before it is freed.
    kv.release(2, np.array([], dtype=np.int32))
    claim = kv.claim(prompt(3), {}, cells_needed=90, cells_reserved=0)
    assert claim is not None and claim.source == 0 and 0 in claim.evicted and claim.seq_id != 0
    assert kv.free_seqs + kv.cached_seqs == 3 and kv.available_seqs() == 3  # all but the new request's


def test_no_id_or_no_cells_means_no_claim_and_nothing_changes() -> None:
    kv = KvManager(n_seqs=1, n_cells=100)
    assert kv.claim(prompt(1), {}, cells_needed=50, cells_reserved=60) is None
    assert kv.free_seqs == 1
    kv.claim(prompt(1), {}, cells_needed=50, cells_reserved=0)
    assert kv.claim(prompt(2), {}, cells_needed=10, cells_reserved=50) is None  # the one id is running


def test_budget_evicts_on_release() -> None:
    kv = KvManager(n_seqs=3, n_cells=1000, budget_cells=70)
    for i in range(3):
        kv.claim(seq(100 * i, 40), {}, cells_needed=50, cells_reserved=0)
    assert kv.release(0, seq(0, 40)) == []
    assert kv.release(1, seq(100, 40)) == [0]  # 80 > 70: the older one goes
    assert kv.cached_cells == 40 and kv.free_seqs == 1


def test_disabled_cache_frees_at_once_and_never_matches() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000, budget_cells=0)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    assert kv.release(0, prompt(1)) == [0]
    assert kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0) == Claim(seq_id=0)  # no reuse


def test_pinned_sequence_is_a_source_but_never_evicted_or_adopted() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000, budget_cells=0)  # pinning works with the cache off
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    assert kv.release(0, prompt(1), pin=True) == []
    assert kv.available_seqs() == 1 and kv.pinned_cells == 50
    assert kv.find(prompt(1)) == 0
    assert kv.unpin(0) == [0]  # the cache is off: unpinned, it is freed
    assert kv.free_seqs == 2


def test_pinned_source_is_copied_not_adopted() -> None:
    kv = KvManager(n_seqs=2, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
    kv.release(0, prompt(1), pin=True)
    claim = kv.claim(np.concatenate([prompt(1), seq(3, 4)]), {}, cells_needed=60, cells_reserved=0)
    assert claim == Claim(seq_id=1, source=0, reused=50)


@pytest.mark.parametrize("free_first", [True, False])
def test_restore_gets_an_empty_id(free_first: bool) -> None:
    kv = KvManager(n_seqs=1, n_cells=1000)
    if not free_first:
        kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0)
        kv.release(0, prompt(1))
    assert kv.claim_empty(cells_needed=50, cells_reserved=0) == (0, () if free_first else (0,))
    assert kv.add(0, prompt(9)) == []
    assert kv.find(prompt(9)) == 0


def test_forget_cached_frees_every_prefix_but_a_pinned_id_stays_taken_and_empty() -> None:
    """After a context rebuild: nothing is reused, no id is on the free list twice, and a
    snapshot's pinned id is not handed to anyone before its pin is released."""
    kv = KvManager(n_seqs=3, n_cells=1000)
    for seq_id, tail in ((0, 1), (1, 500), (2, 900)):
        assert kv.claim(prompt(tail), {}, cells_needed=60, cells_reserved=0) is not None
        kv.release(seq_id, prompt(tail), pin=seq_id == 2)
    kv.forget_cached()
    assert kv.free_seqs == 2 and kv.cached_cells == 0 and kv.cached_seqs == 1
    claims = [kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0) for _ in range(3)]
    assert claims[2] is None and {c.seq_id for c in claims[:2] if c} == {0, 1}  # id 2 stays held
    assert all(c is None or c.reused == 0 for c in claims)
    assert kv.unpin(2) == [] and kv.available_seqs() == 1  # now it may be evicted for a request


def test_one_principals_cached_prefix_is_never_reused_by_another() -> None:
    """Issue 17: `cached_tokens` (and the first token's time) told one client how much of its
    prompt another client's cached prompt shared: a guessed secret could be confirmed token
    by token.  Cached prefixes are partitioned by owner."""
    kv = KvManager(n_seqs=4, n_cells=1000)
    kv.claim(prompt(1), {}, cells_needed=60, cells_reserved=0, owner="uid:1000")
    kv.release(0, prompt(1), owner="uid:1000")
    other = kv.claim(prompt(500), {}, cells_needed=60, cells_reserved=0, owner="http")
    assert other is not None and other.reused == 0 and other.source is None
    kv.release(other.seq_id, prompt(500), owner="http")
    same = kv.claim(prompt(700), {}, cells_needed=60, cells_reserved=0, owner="uid:1000")
    assert same is not None and same.source == 0 and same.reused == 40
    assert kv.find(prompt(1), "uid:1000") == 0 and kv.find(prompt(1), "http") is None


def _claim_new(kv: KvManager, n: int) -> int:
    return kv.claim(seq(1000 * n, 40), {}, cells_needed=50, cells_reserved=0).seq_id  # type: ignore[union-attr]


def test_new_requests_fill_the_holes_between_running_ids() -> None:
    # Per-sequence KV streams decode one micro-batch per run of consecutive ids.
    kv = KvManager(n_seqs=8, n_cells=10_000, budget_cells=0)
    assert [_claim_new(kv, i) for i in range(6)] == [0, 1, 2, 3, 4, 5]
    for seq_id in (1, 3, 4):
        kv.release(seq_id, seq(0, 40))
    # Running {0, 2, 5}: 1 joins two runs into one, then 3 and 4 close the last hole.
    assert [_claim_new(kv, i) for i in (10, 11, 12)] == [1, 3, 4]
    assert sorted(kv._running()) == [0, 1, 2, 3, 4, 5]


def test_a_cached_sequence_moves_out_of_the_way_of_running_ids() -> None:
    kv = KvManager(n_seqs=6, n_cells=10_000)
    assert [_claim_new(kv, i) for i in range(6)] == [0, 1, 2, 3, 4, 5]
    for seq_id in (4, 1, 3, 0, 5):  # all but 2 finish, cached least recently used first
        kv.release(seq_id, seq(1000 * seq_id, 40))
    # LRU evicts 4's prefix, but id 4 would start a run of its own: the request takes id 1
    # (next to running 2) and the prefix cached there moves into 4, keeping its LRU place.
    first = kv.claim(seq(9000, 40), {}, cells_needed=50, cells_reserved=0)
    assert first == Claim(seq_id=1, evicted=(4,), moved=Move(src=1, dst=4, cells=40))
    assert list(kv.cached()) == [4, 3, 0, 5]
    assert np.array_equal(kv.cached()[4], seq(1000, 40))
    # Next, LRU evicts what now sits on 4; 3 (next to 2) is taken and moves there.
    second = kv.claim(seq(9100, 40), {}, cells_needed=50, cells_reserved=0)
    assert second == Claim(seq_id=3, evicted=(4,), moved=Move(src=3, dst=4, cells=40))
    assert sorted(kv._running()) == [1, 2, 3] and kv.stats.moves == 2


def test_no_moves_without_packing_or_for_an_adopted_or_source_sequence() -> None:
    kv = KvManager(n_seqs=4, n_cells=10_000, pack_ids=False)
    assert [_claim_new(kv, i) for i in range(4)] == [0, 1, 2, 3]
    for seq_id in (3, 0, 1):
        kv.release(seq_id, seq(1000 * seq_id, 40))
    assert kv.claim(seq(9000, 40), {}, cells_needed=50, cells_reserved=0) == Claim(seq_id=3, evicted=(3,))
    packing = KvManager(n_seqs=4, n_cells=10_000)
    assert [_claim_new(packing, i) for i in range(4)] == [0, 1, 2, 3]
    packing.release(0, seq(0, 40))
    packing.release(1, seq(1000, 40))
    # The prompt continues 1's tokens: 1 is adopted in place.
    adopted = packing.claim(seq(1000, 60), {}, cells_needed=70, cells_reserved=0)
    assert adopted == Claim(seq_id=1, source=1, reused=40)
    packing.release(1, seq(1000, 60))
    # A prompt sharing 1's first 30 tokens copies them into 0 (LRU); 1 would sit next to
    # running 2, but it is the source, so it stays where it is.
    shared = np.concatenate([seq(1000, 30), seq(5000, 10)])
    copied = packing.claim(shared, {}, cells_needed=50, cells_reserved=0)
    assert copied == Claim(seq_id=0, source=1, reused=30, evicted=(0,))
