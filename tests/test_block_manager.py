"""BlockManager: prefix caching, LRU reuse, copy-on-write, and invariants under random ops.

No model and no torch: a dict stands in for the KV pool (slot -> token id written there), so
the tests check that every computed position of every live sequence really reads back its
own token, through prefix hits, forks, copy-on-write and block reuse.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvserve.engine.block_manager import NULL_BLOCK, BlockManager
from kvserve.sequence import Sequence


@dataclass
class Params:  # stand-in for SamplingParams: Sequence only reads these two
    max_tokens: int | None = 16
    n: int = 1


_ids = iter(range(10**9))


def make_seq(prompt: list[int], salt=None) -> Sequence:
    sid = next(_ids)
    seq = Sequence(sid, f"req-{sid}", list(prompt), Params(), 0.0)
    if salt is not None:
        seq.cache_salt = salt if isinstance(salt, tuple) else (salt,)
    return seq


class FakeKV:
    """The model runner's side: copies blocks, writes tokens at their slots (in every layer
    group's table), reads them back."""

    def __init__(self, bm: BlockManager):
        self.bm, self.slots = bm, {}

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.bm.block_size
        for src, dst in pairs:
            for off in range(bs):
                self.slots[dst * bs + off] = self.slots.get(src * bs + off)

    def forward(self, seq: Sequence, n: int) -> None:
        """Write positions [computed, computed + n) and advance, like a forward pass."""
        toks = seq.all_token_ids
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            for g in range(self.bm.num_groups):
                self.slots[self.bm.slot(seq, p, g)] = toks[p]
        seq.num_computed_tokens += n
        self.bm.mark_computed(seq)

    def check(self, seq: Sequence) -> None:
        """Every position the next query may read, in every group, holds seq's own token: all
        of them in a full group, the last W - 1 before the next query in a sliding one (reading
        a released position raises)."""
        toks, n = seq.all_token_ids, seq.num_computed_tokens
        for g in range(self.bm.num_groups):
            read = self.bm.needed_positions(g, n, n)
            got = [self.slots.get(self.bm.slot(seq, p, g)) for p in read]
            assert got == [toks[p] for p in read], f"seq {seq.seq_id} reads wrong KV in group {g}"



def run_prefill(bm: BlockManager, kv: FakeKV, seq: Sequence) -> int:
    """Allocate and compute seq's whole known tail; returns the cached tokens."""
    n = seq.num_tokens - bm.num_cached_tokens(seq) - seq.num_computed_tokens
    cached = bm.allocate(seq, n)
    kv.copy(bm.take_block_copies())
    kv.forward(seq, seq.num_tokens - seq.num_computed_tokens)
    return cached


# ---- targeted tests ---------------------------------------------------------------------
def test_prefix_hit_reuses_full_blocks_and_never_the_last_token():
    bm = BlockManager(16, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(list(range(10)))
    assert run_prefill(bm, kv, a) == 0
    b = make_seq(list(range(10)) + [99])
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b, 3) == 8
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # a's third block is partial: never shared
    assert bm.blocks[a.block_table[0]].ref_count == 2
    kv.forward(b, 3)
    kv.check(a), kv.check(b)
    # A prompt that is exactly two cached blocks still recomputes its last block.
    c = make_seq(list(range(8)))
    assert bm.allocate(c, 4) == 4 and c.num_computed_tokens == 4
    assert bm.prefix_cache_queries == 10 + 11 + 8 and bm.prefix_cache_hits == 8 + 4
    bm.check_invariants([a, b, c])


def test_hash_registered_only_after_mark_computed():
    bm = BlockManager(16, block_size=4)
    a = make_seq(list(range(12)))
    bm.allocate(a, 12)
    assert bm.num_cached_tokens(make_seq(list(range(12)))) == 0  # allocated, not computed
    a.num_computed_tokens = 6
    assert bm.num_cached_tokens(make_seq(list(range(12)))) == 0  # computed, not marked
    bm.mark_computed(a)
    assert bm.num_cached_tokens(make_seq(list(range(12)))) == 4  # only the full computed block
    a.num_computed_tokens = 12
    bm.mark_computed(a)
    assert bm.num_cached_tokens(make_seq(list(range(12)))) == 8  # last token is recomputed
    bm.check_invariants([a])


def test_hit_is_verified_by_tokens_not_hash():
    bm = BlockManager(8, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, kv := FakeKV(bm), a)
    blk = bm.blocks[a.block_table[0]]
    blk.token_ids = (9, 9, 9, 9)  # simulate a collision: same hash, other tokens
    assert bm.num_cached_tokens(make_seq([1, 2, 3, 4, 5])) == 0
    with pytest.raises(AssertionError, match="differ"):
        bm.check_invariants([a])
    del kv


def test_cache_salt_separates_prefixes():
    bm = BlockManager(16, block_size=4)
    run_prefill(bm, FakeKV(bm), make_seq(list(range(9)), salt="lora-a"))
    assert bm.num_cached_tokens(make_seq(list(range(9)), salt="lora-a")) == 8
    assert bm.num_cached_tokens(make_seq(list(range(9)), salt="lora-b")) == 0
    assert bm.num_cached_tokens(make_seq(list(range(9)))) == 0


def test_freed_blocks_keep_hash_and_are_reused_lru():
    bm = BlockManager(3, block_size=2)
    kv = FakeKV(bm)
    a = make_seq([1, 2, 9])
    run_prefill(bm, kv, a)
    a0 = a.block_table[0]
    bm.free(a)
    b = make_seq([3, 4, 9])
    assert run_prefill(bm, kv, b) == 0
    assert a0 not in b.block_table  # blocks without a hash are used before cached ones
    b0 = b.block_table[0]
    bm.free(b)
    assert bm.num_free_blocks == 3 and bm.usage() == 0.0
    # Both prefixes still hit while their blocks sit in the free pool.
    assert bm.num_cached_tokens(make_seq([1, 2, 0])) == 2
    assert bm.num_cached_tokens(make_seq([3, 4, 0])) == 2
    c = make_seq([5, 6, 7, 8, 0])  # needs all 3 blocks: evicts a0 (least recently freed) last
    bm.allocate(c, 5)
    assert bm.num_cached_tokens(make_seq([1, 2, 0])) == 0
    bm.free(c)
    d = make_seq([5, 6, 0, 0, 0])
    bm.allocate(d, 2)  # one block: the LRU cached block is b0, since a0 was reused
    bm.check_invariants([d])
    e = make_seq([9, 9, 9, 9, 9])
    bm.allocate(e, 4)
    assert b0 in d.block_table + e.block_table
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    bm.check_invariants([d, e])


def test_lru_order_evicts_least_recently_freed_first():
    bm = BlockManager(4, block_size=2)
    kv = FakeKV(bm)
    seqs = [make_seq([i, i, 0]) for i in (1, 2)]
    for s in seqs:
        run_prefill(bm, kv, s)
    first, second = (s.block_table[0] for s in seqs)
    bm.free(seqs[1])  # freed first: evicted first, although allocated later
    bm.free(seqs[0])
    x = make_seq([7, 7, 7])
    bm.allocate(x, 3)  # 2 plain free blocks remain from the partial tails: no eviction yet
    assert bm.num_cached_tokens(make_seq([1, 1, 0])) == 2 and bm.num_cached_tokens(make_seq([2, 2, 0])) == 2
    y = make_seq([8, 8, 8])
    bm.allocate(y, 1)
    assert y.block_table == [second]
    assert bm.num_cached_tokens(make_seq([2, 2, 0])) == 0 and bm.num_cached_tokens(make_seq([1, 1, 0])) == 2
    assert first not in x.block_table + y.block_table


def test_copy_on_write_for_forks_appending_into_shared_partial_block():
    bm = BlockManager(8, block_size=4)
    kv = FakeKV(bm)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, kv, parent)
    parent.append_token(7, 0.0)
    child = make_seq(parent.prompt_token_ids)
    child.output_token_ids = [8]  # the fork sampled a different first token
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    shared = parent.block_table[1]
    assert bm.blocks[shared].ref_count == 2
    bm.check_invariants([parent, child])

    bm.allocate(parent, 1)
    copies = bm.take_block_copies()
    assert copies == [(shared, parent.block_table[1])] and parent.block_table[1] != shared
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    bm.allocate(child, 1)  # now the sole holder: writes in place
    assert bm.take_block_copies() == [] and child.block_table[1] == shared
    kv.copy(copies)
    kv.forward(parent, 1), kv.forward(child, 1)
    kv.check(parent), kv.check(child)
    bm.check_invariants([parent, child])
    bm.free(parent), bm.free(child)
    assert bm.num_free_blocks == 8


def test_copy_on_write_public_method_and_block_aligned_fork():
    bm = BlockManager(8, block_size=4)
    kv = FakeKV(bm)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, kv, parent)
    child = make_seq(parent.prompt_token_ids)
    bm.fork(parent, child)
    pairs = bm.copy_on_write(child)
    assert pairs == [(parent.block_table[1], child.block_table[1])]
    assert bm.copy_on_write(child) == [] and bm.copy_on_write(parent) == []
    bm.check_invariants([parent, child])
    # Block-aligned prompt: the next token opens a new block, nothing to copy.
    p2 = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    run_prefill(bm, kv, p2)
    c2 = make_seq(p2.prompt_token_ids)
    bm.fork(p2, c2)
    c2.append_token(0, 0.0)
    bm.allocate(c2, 1)
    assert bm.take_block_copies() == [] and len(c2.block_table) == 3


def test_can_allocate_counts_revived_cached_blocks_and_copies():
    bm = BlockManager(3, block_size=2)
    kv = FakeKV(bm)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, kv, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 5, 6])  # hits 2 blocks (both free) and needs 1 more
    assert bm.num_cached_tokens(b) == 4
    assert bm.can_allocate(b, 2) and not bm.can_allocate(b, 3)
    assert not bm.can_allocate(b, 2, reserve_blocks=1)
    assert bm.allocate(b, 2) == 4 and bm.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq([9]), 1)
    bm.check_invariants([b])


def test_reset_prefix_cache_and_slot():
    bm = BlockManager(8, block_size=4)
    a = make_seq(list(range(9)))
    run_prefill(bm, FakeKV(bm), a)
    assert bm.slot(a, 5) == a.block_table[1] * 4 + 1
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_tokens(make_seq(list(range(9)))) == 0 and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_check_invariants_catches_corruption():
    bm = BlockManager(4, block_size=2)
    a = make_seq([1, 2, 3])
    bm.allocate(a, 3)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="holders"):
        bm.check_invariants([])  # a's blocks are referenced but no live table holds them
    a.block_table.append(99)
    with pytest.raises(AssertionError, match="out of range"):
        bm.check_invariants([a])
    a.block_table.pop()
    bm.blocks[a.block_table[0]].ref_count = 0
    bm.pool._free_plain.append(a.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants([a])


def test_prefix_caching_disabled():
    bm = BlockManager(8, block_size=2, enable_prefix_caching=False)
    run_prefill(bm, FakeKV(bm), make_seq([1, 2, 3]))
    assert bm.num_cached_tokens(make_seq([1, 2, 3])) == 0 and bm.prefix_cache_queries == 0


def test_in_flight_prefix_blocks_are_pending_for_other_sequences():
    bm = BlockManager(32, block_size=4)
    kv = FakeKV(bm)
    system = list(range(100, 112))  # 3 full blocks
    a = make_seq(system + [1, 2])
    bm.allocate(a, 14)  # blocks 0-2 are full prompt blocks, allocated, not computed
    b = make_seq(system + [3])
    assert bm.num_cached_tokens(b) == 0 and bm.num_pending_prefix_tokens(b) == 12
    assert bm.num_pending_prefix_tokens(make_seq(system[:8] + [3])) == 8  # never the last token
    assert bm.num_pending_prefix_tokens(make_seq(system)) == 8
    assert bm.num_pending_prefix_tokens(make_seq(system + [3], salt="other")) == 0
    assert bm.num_pending_prefix_tokens(make_seq([5] + system)) == 0
    assert bm.num_pending_prefix_tokens(a) == 0  # a holds blocks: not a waiter
    bm.check_invariants([a])
    kv.forward(a, 6)  # block 0 computed and cached; block 1 half computed: still in flight
    assert bm.num_cached_tokens(b) == 4 and bm.num_pending_prefix_tokens(b) == 8
    bm.check_invariants([a])
    kv.forward(a, 8)
    assert bm.num_cached_tokens(b) == 12 and bm.num_pending_prefix_tokens(b) == 0
    assert not bm._inflight
    bm.check_invariants([a])


def test_in_flight_bookkeeping_through_fork_free_reset_and_hits():
    bm = BlockManager(32, block_size=4)
    kv = FakeKV(bm)
    system = list(range(100, 116))  # 4 full blocks
    a = make_seq(system + [1])
    bm.allocate(a, 6)
    kv.forward(a, 6)  # block 0 cached, block 1 in flight
    child = make_seq(a.prompt_token_ids)
    bm.fork(a, child)  # the child will compute block 1 too
    bm.check_invariants([a, child])
    b = make_seq(system + [2])
    assert bm.num_pending_prefix_tokens(b) == 4
    bm.free(a)
    assert bm.num_pending_prefix_tokens(b) == 4  # the child still computes it
    bm.reset_prefix_cache()  # forgets block 0, keeps the live child's in-flight block
    assert bm.num_cached_tokens(b) == 0 and bm.num_pending_prefix_tokens(b) == 0  # block 0 is a miss now
    bm.check_invariants([child])
    bm.free(child)
    bm.free(child)  # twice is safe
    assert not bm._inflight and bm.num_free_blocks == 32
    bm.check_invariants([])
    # A later block cached behind an in-flight one counts once that one lands.
    c = make_seq(system + [3])
    run_prefill(bm, kv, c)  # blocks 0-3 cached
    blocks = list(c.block_table)
    bm.free(c)
    bm.pool._unregister(blocks[1])  # as if block 1 alone had been evicted (move it to the plain pool)
    del bm.pool._free_cached[blocks[1]]
    bm.pool._free_plain.append(blocks[1])
    d = make_seq(system + [4])
    assert bm.num_cached_tokens(d) == 4
    bm.allocate(d, 5)  # hit block 0; blocks 1 and (a fresh) 2 in flight
    assert bm.num_pending_prefix_tokens(make_seq(system + [5])) == 12  # blocks 1, 2 in flight; 3 cached
    bm.check_invariants([d])


def test_preemption_style_free_and_disabled_caching_leave_nothing_in_flight():
    bm = BlockManager(16, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    assert bm.num_pending_prefix_tokens(make_seq([1, 2, 3, 4, 9])) == 4
    bm.free(a)
    a.num_computed_tokens = 0  # what the scheduler does on preemption
    assert bm.num_pending_prefix_tokens(make_seq([1, 2, 3, 4, 9])) == 0
    bm.check_invariants([])
    off = BlockManager(16, block_size=2, enable_prefix_caching=False)
    off.allocate(make_seq([1, 2, 3, 4, 5]), 5)
    assert not off._inflight and off.num_pending_prefix_tokens(make_seq([1, 2, 3, 4, 9])) == 0


def test_check_invariants_catches_a_stale_in_flight_entry():
    bm = BlockManager(8, block_size=2)
    a = make_seq([1, 2, 3])
    bm.allocate(a, 3)
    bm.check_invariants([a])
    bm._inflight.setdefault(b"x" * 32, set()).add(a.seq_id)
    with pytest.raises(AssertionError, match="in-flight index"):
        bm.check_invariants([a])


# ---- layer groups and sliding-window release ---------------------------------------------
def test_sliding_groups_release_blocks_that_left_the_window():
    bm = BlockManager(64, block_size=4, group_windows=(None, 6, 6))
    kv = FakeKV(bm)
    a = make_seq(list(range(30)))
    for n in (5, 7, 9, 9):  # chunked prefill: 30 tokens
        bm.allocate(a, n)
        kv.forward(a, n)
        kv.check(a)
        bm.check_invariants([a])
        released = max(0, a.num_computed_tokens - 6 + 1) // 4  # blocks wholly before the next query's window
        assert a.block_tables[1][:released] == [NULL_BLOCK] * released == a.block_tables[2][:released]
        assert NULL_BLOCK not in a.block_table + a.block_tables[1][released:]
        assert bm.seq_blocks(a) == 3 * bm.blocks_for(a.num_computed_tokens) - 2 * released
        assert bm.num_free_blocks == 64 - bm.seq_blocks(a)
    assert a.num_computed_tokens == 30 and a.block_tables[1].count(NULL_BLOCK) == 6  # 25 // 4
    with pytest.raises(ValueError, match="released"):
        bm.slot(a, 3, group=1)
    bm.free(a)
    assert bm.num_free_blocks == 64 and not a.group_block_tables
    bm.check_invariants([])


def test_prefix_hit_needs_only_the_window_blocks_of_sliding_groups():
    bm = BlockManager(64, block_size=4, group_windows=(None, 6))
    kv = FakeKV(bm)
    a = make_seq(list(range(25)))
    run_prefill(bm, kv, a)
    assert a.block_tables[1][:5] == [NULL_BLOCK] * 5  # released, but still registered (cached free pool)
    bm.free(a)
    b = make_seq(list(range(25)) + [99])
    # 6 full blocks hit; the first recomputed token (position 24) reads positions 19.. : blocks 4, 5.
    assert bm.num_cached_tokens(b) == 24
    assert bm.allocate(b, 2) == 24
    assert b.block_tables[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in b.block_tables[1][4:]
    kv.forward(b, 2)
    kv.check(b)
    bm.check_invariants([b])
    bm.free(b)
    # Evict group 1's block 5: a hit of 6 blocks is no longer possible; 5 blocks need blocks 3, 4.
    c = make_seq(list(range(25)) + [98])
    page5 = bm.pool._hash_to_block[1][bm._hashes(c, 6)[5]]
    del bm.pool._free_cached[page5]
    bm.pool._unregister(page5)
    bm.pool._free_plain.append(page5)
    assert bm.num_cached_tokens(c) == 20
    # Without group 1's block 3 as well, no hit ends inside blocks 4..5: the longest is 3 blocks.
    page3 = bm.pool._hash_to_block[1][bm._hashes(c, 6)[3]]
    del bm.pool._free_cached[page3]
    bm.pool._unregister(page3)
    bm.pool._free_plain.append(page3)
    assert bm.num_cached_tokens(c) == 12
    bm.allocate(c, c.num_tokens - 12)
    kv.forward(c, c.num_tokens - 12)
    kv.check(c)
    bm.check_invariants([c])
    # A window of 1 reads no earlier position, yet a hit still needs the block before it cached:
    # a hit is never made of nothing.
    w1 = BlockManager(16, block_size=4, group_windows=(1,))
    assert w1.num_cached_tokens(make_seq(list(range(9)))) == 0
    run_prefill(w1, FakeKV(w1), make_seq(list(range(9))))
    d = make_seq(list(range(9)))
    assert w1.num_cached_tokens(d) == 8 and w1.allocate(d, 1) == 8 and d.block_table[0] == NULL_BLOCK


def test_fork_copy_on_write_and_trim_cover_every_group():
    bm = BlockManager(40, block_size=4, group_windows=(None, 5, 5))
    kv = FakeKV(bm)
    parent = make_seq(list(range(14)))
    run_prefill(bm, kv, parent)
    child = make_seq(parent.prompt_token_ids)
    bm.fork(parent, child)
    assert child.block_tables == parent.block_tables and NULL_BLOCK in child.block_tables[1]
    bm.check_invariants([parent, child])
    parent.append_token(7, 0.0)
    child.append_token(8, 0.0)
    bm.allocate(parent, 1)  # position 14 is in the shared partial block 3 of every group
    copies = bm.take_block_copies()
    assert len(copies) == 3 and all(src == t[3] for (src, _), t in zip(copies, child.block_tables))
    kv.copy(copies)
    kv.forward(parent, 1)
    bm.allocate(child, 1)
    assert bm.take_block_copies() == []
    kv.forward(child, 1)
    kv.check(parent), kv.check(child)
    bm.check_invariants([parent, child])
    # Speculative rollback: 1 + 6 draft slots allocated, 1 accepted; every group is trimmed.
    bm.allocate(child, 7)
    assert {len(t) for t in child.block_tables} == {6}
    child.append_token(9, 0.0)
    child.num_computed_tokens += 1
    bm.trim(child)
    bm.mark_computed(child)
    assert {len(t) for t in child.block_tables} == {bm.blocks_for(child.num_computed_tokens)}
    bm.check_invariants([parent, child])
    bm.free(parent), bm.free(child)
    assert bm.num_free_blocks == 40
    bm.check_invariants([])


def test_a_lagging_draft_cache_holds_release_back():
    bm = BlockManager(40, block_size=4, group_windows=(None, 5))
    a = make_seq(list(range(20)))
    a.num_draft_computed = 0
    bm.allocate(a, 20)
    a.num_computed_tokens = 20
    bm.mark_computed(a)
    assert NULL_BLOCK not in a.block_tables[1]  # the draft model still has to read everything
    a.num_draft_computed = 13
    bm.mark_computed(a)
    assert a.block_tables[1][:2] == [NULL_BLOCK] * 2 and a.block_tables[1][2] != NULL_BLOCK  # (13 - 5 + 1) // 4
    bm.check_invariants([a])


def test_peak_blocks_and_the_longest_lone_sequence():
    bm = BlockManager(100, block_size=16, group_windows=(None,) + (512,) * 5)
    # 8K tokens fed in 2048-token chunks: the full group holds 512 blocks, a sliding group at most
    # the chunk plus the 511 positions before it (161 blocks).
    assert bm.peak_blocks(8192, 2048) == 512 + 5 * 161
    assert bm.peak_blocks(8192, 2048, keep_all=True) == 6 * 512
    assert bm.peak_blocks(100, 2048) == 6 * 7
    one = BlockManager(100, block_size=16)
    assert one.peak_blocks(8192, 2048) == 512 and one.max_tokens_per_seq(2048) == 1600
    big = BlockManager(6000, block_size=16, group_windows=(None,) + (512,) * 5)
    longest = big.max_tokens_per_seq(64)
    assert big.peak_blocks(longest, 64) <= 6000 < big.peak_blocks(longest + 1, 64)
    assert big.max_tokens_per_seq(64, keep_all=True) == 1000 * 16
    assert BlockManager(10, 4, group_windows=(8,)).max_tokens_per_seq(4) is None  # every layer slides
    # A hit keeps the block before the first recomputed token even for a window of 1.
    w1 = BlockManager(16, block_size=4, group_windows=(None, 1))
    run_prefill(w1, FakeKV(w1), make_seq(list(range(13))))
    b = make_seq(list(range(13)))
    assert w1.allocate(b, 1) == 12
    assert w1.seq_blocks(b) == 4 + 2 == w1.peak_blocks(13, 1)


def test_check_invariants_catches_a_released_block_the_window_needs():
    bm = BlockManager(32, block_size=2, group_windows=(None, 3))
    a = make_seq(list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.mark_computed(a)
    bm.check_invariants([a])
    assert a.block_tables[1][:4] == [NULL_BLOCK] * 4
    a.num_computed_tokens = 7  # as if the window still needed block 3
    with pytest.raises(AssertionError, match="still needs"):
        bm.check_invariants([a])


# ---- random operation sequences ---------------------------------------------------------
OPS = ["new", "step", "step", "step", "append", "append", "fork", "free"]
ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10**6)), min_size=20, max_size=60)
# Three prompt families over a tiny vocabulary: prefixes are shared often.
STEMS = [[1, 2, 1, 2, 1, 2, 1, 2, 1], [1, 2, 1, 2, 0, 0, 0, 0, 0], [2, 2, 2, 2, 2, 2, 2, 2, 2]]


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 24))
def test_random_ops_keep_invariants(ops, block_size, num_blocks):
    run_random_ops(ops, lambda r: STEMS[r % 3][: 1 + (r >> 2) % 9], block_size, num_blocks)


# Longer shared system prompts with short suffixes: many sequences hold the same prefix in flight.
SYSTEMS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [3, 1, 4, 1, 5, 9, 0, 0, 0, 0, 0, 0], [7] * 12]
prompts = st.builds(lambda sys, cut, suffix: (SYSTEMS[sys][: 12 - cut] + suffix) or [0],
                    st.integers(0, 2), st.sampled_from([0, 0, 0, 4, 8, 12]), st.lists(st.integers(0, 2), max_size=5))
shared_ops = st.lists(
    st.one_of(st.tuples(st.just("new"), prompts),
              st.tuples(st.sampled_from(["step", "step", "step", "alloc", "alloc", "append", "fork", "free",
                                         "probe", "probe"]),
                        st.integers(0, 10**6))),
    min_size=20, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=shared_ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 40))
def test_random_ops_with_shared_prefixes_keep_invariants(ops, block_size, num_blocks):
    run_random_ops(ops, lambda prompt: prompt, block_size, num_blocks)


def probe_pending(bm: BlockManager, kv: FakeKV, live: list[Sequence], r: int) -> None:
    """Pending tokens of a waiter really become cache hits once the owners compute their blocks."""
    waiters = [s for s in live if not s.block_table and s.num_computed_tokens == 0]
    if not waiters:
        return
    w = waiters[r % len(waiters)]
    cached, pending = bm.num_cached_tokens(w), bm.num_pending_prefix_tokens(w)
    assert pending % bm.block_size == 0 and cached + pending < w.num_tokens
    if not pending:
        return
    event("pending prefix")
    # Finish every in-flight block. Its positions are already allocated, so nothing is evicted,
    # unless a forked block needs copy-on-write first: then skip (that copy could evict).
    todo = []
    for s in live:
        stop = min(len(s.block_table), s.num_prompt_tokens // bm.block_size) * bm.block_size
        if s is not w and stop > s.num_computed_tokens:
            first = s.num_computed_tokens // bm.block_size
            if any(bm.blocks[b].ref_count > 1 for b in s.block_table[first : stop // bm.block_size]):
                return
            todo.append((s, stop - s.num_computed_tokens))
    for s, n in todo:
        kv.forward(s, n)
    if bm.num_groups == 1:
        assert bm.num_cached_tokens(w) >= cached + pending
    else:  # group 0 has the pending blocks now; other groups may lack a block cached behind them
        lo, hi = cached // bm.block_size, (cached + pending) // bm.block_size
        assert all(h in bm.pool._hash_to_block[0] for h in bm._hashes(w, hi)[lo:hi])


# Layer groups: a full group beside sliding ones (Gemma 3), and a model whose layers all slide.
WINDOWS = st.sampled_from([1, 2, 3, 5, 8])
group_windows = st.one_of(WINDOWS.map(lambda w: (None, w, w)), WINDOWS.map(lambda w: (w,)),
                          WINDOWS.map(lambda w: (None, None, w, w)))


SINKS = st.sampled_from([0, 0, 1, 3, 5])  # StreamingLLM attention sinks kept by sliding groups


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 60), windows=group_windows,
       sinks=SINKS)
def test_random_ops_with_sliding_groups_keep_invariants(ops, block_size, num_blocks, windows, sinks):
    run_random_ops(ops, lambda r: (STEMS[r % 3] * 3)[: 1 + (r >> 2) % 27], block_size, num_blocks, windows, sinks)


@settings(max_examples=150, deadline=None)
@given(ops=shared_ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 80), windows=group_windows,
       sinks=SINKS)
def test_random_shared_prefixes_with_sliding_groups_keep_invariants(ops, block_size, num_blocks, windows, sinks):
    run_random_ops(ops, lambda prompt: prompt, block_size, num_blocks, windows, sinks)


def run_random_ops(ops, prompt_of, block_size: int, num_blocks: int, windows=(None,), sinks: int = 0) -> None:
    bm = BlockManager(num_blocks, block_size, group_windows=windows, sink_tokens=sinks)
    kv = FakeKV(bm)
    live: list[Sequence] = []
    for op, r in ops:
        if op == "new":
            live.append(make_seq(prompt_of(r)))
        elif op == "probe":
            probe_pending(bm, kv, live, r)
        elif live:
            seq = live[r % len(live)]
            if op == "step" and seq.num_uncomputed_tokens > 0:
                first = not seq.block_table and seq.num_computed_tokens == 0
                cached = bm.num_cached_tokens(seq)
                assert cached < seq.num_tokens and cached % block_size == 0
                remaining = seq.num_tokens - seq.num_computed_tokens - cached
                n = remaining if r % 2 else 1 + (r >> 4) % remaining  # whole or a chunk
                if bm.can_allocate(seq, n):
                    free_before = bm.num_free_blocks
                    assert bm.allocate(seq, n) == cached
                    assert first or cached == 0
                    if cached and any(NULL_BLOCK in t for t in seq.block_tables):
                        event("prefix hit holding only the window's blocks")
                    copies = bm.take_block_copies()
                    assert free_before - bm.num_free_blocks >= len(copies)
                    kv.copy(copies)
                    kv.forward(seq, n)
                    if cached:
                        event("prefix hit")
                    if copies:
                        event("copy-on-write")
                    if any(NULL_BLOCK in t for t in seq.block_tables):
                        event("sliding-window release")
            elif op == "alloc" and seq.num_uncomputed_tokens > 0:
                # Allocate a chunk but do not compute it yet, like schedule() before update():
                # its full prompt blocks are in flight until a later "step" computes them.
                cached = bm.num_cached_tokens(seq)
                remaining = seq.num_tokens - seq.num_computed_tokens - cached
                n = 1 + (r >> 4) % remaining
                if bm.can_allocate(seq, n):
                    assert bm.allocate(seq, n) == cached
                    kv.copy(bm.take_block_copies())
            elif op == "append" and seq.num_uncomputed_tokens == 0:
                seq.append_token((r >> 2) % 3, 0.0)
            elif op == "fork" and seq.block_table:
                child = make_seq(seq.prompt_token_ids)
                child.output_token_ids = list(seq.output_token_ids)
                bm.fork(seq, child)
                live.append(child)
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
        bm.check_invariants(live)
        for s in live:
            kv.check(s)
    for s in live:
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks and bm.usage() == 0.0


def test_released_sliding_pages_age_with_their_prefix():
    """A sequence's sliding-window pages released early are evicted no sooner than its other
    prefix pages: another prompt that came and went before it ended is evicted first, and a
    prompt sharing the first one's head still hits (its first recomputed token reads the
    released blocks)."""
    bm = BlockManager(40, block_size=4, group_windows=(None, 8))
    kv = FakeKV(bm)
    a = make_seq(list(range(25)))  # group 1 releases blocks 0..3 during prefill
    run_prefill(bm, kv, a)
    assert a.block_tables[1][:4] == [NULL_BLOCK] * 4
    b = make_seq([100 + t for t in range(9)])
    run_prefill(bm, kv, b)
    b_pages = {bm.pool.get_cached_block(h, g) for h in bm._hashes(b, 2) for g in range(2)} - {None}
    bm.free(b)  # b's pages are freed after a's released ones ...
    bm.free(a)  # ... and before a's others
    assert len(b_pages) == 4 and b_pages <= set(bm.pool._free_cached)
    bm.pool.get_new_blocks(len(bm.pool._free_plain) + len(b_pages))  # memory pressure: evicts 4 cached pages
    again = make_seq(list(range(12)) + [99, 98])  # a 3-block hit; position 12 reads blocks 1..3 of group 1
    assert bm.num_cached_tokens(again) == 12
