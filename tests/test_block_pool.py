"""BlockPool on its own: reference counts, the two free lists, LRU eviction and the hash
registry, checked against a plain-list model of what the pool should hold after every step.

The stateful test drives random take/touch/free/register/reset sequences (lookups after each); the mutant
tests run the same machine against deliberately broken pools to show it catches each bug.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvserve.engine.block_pool import BlockPool

HASHES = [bytes([i]) * 32 for i in range(4)]  # few, so registrations collide often
ROOT = bytes(32)


def free_lists(pool: BlockPool) -> tuple[list[int], list[int]]:
    """(plain, cached) free block ids in reuse order: the pool's private lists, read here only."""
    return list(pool._free_plain), list(pool._free_cached)


@dataclass
class Model:
    """What the pool should hold: ref counts, free lists in reuse order, registered prefixes."""

    ref: list[int]
    plain: list[int]
    cached: list[int] = field(default_factory=list)  # least recently freed first
    reg: dict[int, tuple[int, bytes, tuple[int, ...]]] = field(default_factory=dict)  # bid -> (group, hash, tokens)

    def owner(self, group: int, h: bytes) -> int | None:
        return next((b for b, (g, hh, _) in self.reg.items() if (g, hh) == (group, h)), None)

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.plain:
                bid = self.plain.pop(0)
            else:
                bid = self.cached.pop(0)  # evict the least recently freed cached block
                del self.reg[bid]
            assert self.ref[bid] == 0
            self.ref[bid] = 1
            out.append(bid)
        return out

    def free(self, bid: int) -> None:
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            (self.cached if bid in self.reg else self.plain).append(bid)


class PoolMachine(RuleBasedStateMachine):
    pool_cls: type[BlockPool] = BlockPool

    @initialize(num_blocks=st.integers(1, 6), num_groups=st.integers(1, 3))
    def make(self, num_blocks: int, num_groups: int) -> None:
        self.pool = self.pool_cls(num_blocks, num_groups)
        self.groups = num_groups
        self.model = Model([0] * num_blocks, list(range(num_blocks)))

    def in_use(self) -> list[int]:
        return [b for b, r in enumerate(self.model.ref) if r > 0]

    # ---- operations ----------------------------------------------------------------------
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        num_free = len(self.model.plain) + len(self.model.cached)
        n = data.draw(st.integers(0, num_free + 1), label="n")  # often all, sometimes one too many
        if n > num_free:
            before = (free_lists(self.pool), [b.ref_count for b in self.pool.blocks])
            with pytest.raises(RuntimeError, match="out of KV cache blocks"):
                self.pool.get_new_blocks(n)
            assert (free_lists(self.pool), [b.ref_count for b in self.pool.blocks]) == before, "a failed take took blocks"
            return
        held = set(self.in_use())
        got = self.pool.get_new_blocks(n)
        assert not held & set(got), f"took referenced blocks {held & set(got)}"
        assert got == self.model.take(n), "plain blocks first, then the least recently freed cached ones"

    @precondition(lambda self: self.model.cached)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Take every plain block and some cached ones: the take that evicts prefixes."""
        k = data.draw(st.integers(1, len(self.model.cached)), label="evicted")
        got = self.pool.get_new_blocks(len(self.model.plain) + k)
        assert got == self.model.take(len(self.model.plain) + k), "evicted other than the least recently freed"

    @precondition(lambda self: any(self.model.ref) or self.model.cached)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(self.in_use() + self.model.cached), label="bid")
        self.pool.touch([bid])
        if self.model.ref[bid] == 0:
            self.model.cached.remove(bid)  # revived: keeps its prefix
        self.model.ref[bid] += 1

    @precondition(lambda self: any(self.model.ref))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Some referenced blocks, each at most as often as it is referenced, in random order:
        # the order given is the order they join the free lists.
        refs = [b for b in self.in_use() for _ in range(self.model.ref[b])]
        bids = data.draw(st.permutations(refs).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])),
                         label="bids")
        self.pool.free_blocks(iter(bids))  # any iterable
        for bid in bids:
            self.model.free(bid)

    @precondition(lambda self: any(self.model.ref))
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        bids = data.draw(st.lists(st.sampled_from(self.in_use()), min_size=1, max_size=3, unique=True), label="bids")
        for bid in bids:
            h = data.draw(st.sampled_from(HASHES), label="hash")
            group = data.draw(st.integers(0, self.groups - 1), label="group")
            tokens = data.draw(st.lists(st.integers(0, 9), max_size=3).map(tuple), label="tokens")
            want = bid not in self.model.reg and self.model.owner(group, h) is None
            assert self.pool.register(bid, h, ROOT, tokens, ("salt",), group) == want
            if want:
                self.model.reg[bid] = (group, h, tokens)

    @rule()
    def reset(self) -> None:
        self.pool.reset_prefix_cache()
        self.model.plain += self.model.cached
        self.model.cached = []
        self.model.reg.clear()

    # ---- after every step ----------------------------------------------------------------
    @invariant()
    def pool_books_agree(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def matches_the_model(self) -> None:
        pool, m = self.pool, self.model
        refs = [b.ref_count for b in pool.blocks]
        assert min(refs) >= 0, f"negative ref count: {refs}"
        assert refs == m.ref, f"ref counts {refs}, expected {m.ref}"
        plain, cached = free_lists(pool)
        assert (plain, cached) == (m.plain, m.cached), f"free lists {plain}, {cached}; expected {m.plain}, {m.cached}"
        assert all(refs[b] == 0 for b in plain + cached), "a free block is referenced"
        assert pool.num_free_blocks + sum(r > 0 for r in refs) == pool.num_blocks
        for b in pool.blocks:  # every registered prefix, and only those, with what it holds
            want = m.reg.get(b.block_id)
            got = None if b.hash is None else (b.group, b.hash, b.token_ids)
            assert got == want, f"block {b.block_id} registered as {got}, expected {want}"
            assert (b.parent_hash, b.extra_keys) == ((ROOT, ("salt",)) if want else (None, ()))
        for g in range(self.groups):  # the registry maps each hash to exactly one block and back
            for h in HASHES:
                bid = pool.get_cached_block(h, g)
                assert bid == m.owner(g, h)
                assert bid is None or (pool.blocks[bid].hash, pool.blocks[bid].group) == (h, g)


PoolMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
TestBlockPool = PoolMachine.TestCase


# ---- the machine catches broken pools ----------------------------------------------------
class EvictsMostRecent(BlockPool):
    def _take_free_block(self) -> int:
        if self._free_plain:
            bid = self._free_plain.popleft()
        else:
            bid, _ = self._free_cached.popitem(last=True)  # MRU instead of LRU
            self._unregister(bid)
        self.blocks[bid].ref_count = 1
        return bid


class EvictsReferenced(BlockPool):
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        out = super().get_new_blocks(num_blocks)
        for b in self.blocks:  # also drops the prefix of a referenced block
            if b.hash is not None and b.ref_count > 0 and out:
                self._unregister(b.block_id)
                break
        return out


class TouchLeavesFreeList(BlockPool):
    def touch(self, block_ids) -> None:
        for bid in block_ids:
            self.blocks[bid].ref_count += 1  # a revived block stays in the cached free list


class RegistersTwice(BlockPool):
    def register(self, block_id, block_hash, parent_hash, token_ids, extra_keys=(), group=0) -> bool:
        b = self.blocks[block_id]
        b.hash, b.parent_hash, b.token_ids, b.extra_keys, b.group = block_hash, parent_hash, token_ids, extra_keys, group
        self._hash_to_block[group][block_hash] = block_id  # overwrites another block's entry
        return True


class FreesBelowZero(BlockPool):
    def free_blocks(self, block_ids) -> None:
        block_ids = list(block_ids)
        super().free_blocks(block_ids)
        if block_ids:
            self.blocks[block_ids[0]].ref_count -= 1


class ResetForgetsFreeOrder(BlockPool):
    def reset_prefix_cache(self) -> None:
        cached = list(self._free_cached)
        super().reset_prefix_cache()
        for bid in cached:  # cached blocks jump ahead of the plain ones
            self._free_plain.remove(bid)
            self._free_plain.appendleft(bid)


@pytest.mark.parametrize("broken", [EvictsMostRecent, EvictsReferenced, TouchLeavesFreeList, RegistersTwice,
                                    FreesBelowZero, ResetForgetsFreeOrder])
def test_the_machine_catches_a_broken_pool(broken):
    machine = type(f"Machine{broken.__name__}", (PoolMachine,), {"pool_cls": broken})
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=settings(max_examples=500, stateful_step_count=40, deadline=None,
                                                             database=None, derandomize=True,
                                                             phases=[Phase.generate]))


# ---- examples ----------------------------------------------------------------------------
def registered_pool(n: int) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(n)
    bids = pool.get_new_blocks(n)
    for bid, h in zip(bids, HASHES):
        assert pool.register(bid, h, ROOT, (bid,))
    return pool, bids


def test_eviction_takes_the_least_recently_freed_cached_block():
    pool, (a, b, c) = registered_pool(3)
    pool.free_blocks([b, c, a])
    assert pool.get_new_blocks(1) == [b]
    assert pool.blocks[b].hash is None and pool.get_cached_block(HASHES[1]) is None  # b's prefix evicted
    assert pool.get_cached_block(HASHES[0]) == a and pool.get_cached_block(HASHES[2]) == c
    pool.touch([c])  # revived: no longer evictable, keeps its prefix
    assert pool.get_new_blocks(1) == [a]
    assert pool.num_free_blocks == 0 and pool.get_cached_block(HASHES[2]) == c
    pool.check_invariants()


def test_plain_blocks_are_taken_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.register(a, HASHES[0], ROOT, (1,))
    pool.free_blocks([a, b])
    assert pool.get_new_blocks(1) == [b] and pool.get_cached_block(HASHES[0]) == a
    pool.check_invariants()


def test_get_new_blocks_is_all_or_nothing():
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_a_hash_maps_to_one_block_per_group():
    pool = BlockPool(3, num_groups=2)
    a, b, c = pool.get_new_blocks(3)
    assert pool.register(a, HASHES[0], ROOT, (1,), group=0)
    assert not pool.register(b, HASHES[0], ROOT, (1,), group=0)  # another block holds it
    assert not pool.register(a, HASHES[1], ROOT, (2,), group=0)  # a is registered already
    assert pool.register(c, HASHES[0], ROOT, (1,), group=1)  # each group has its own map
    assert (pool.get_cached_block(HASHES[0], 0), pool.get_cached_block(HASHES[0], 1)) == (a, c)
    assert pool.blocks[b].hash is None
    pool.check_invariants()


def test_reset_forgets_every_prefix_and_keeps_the_free_order():
    pool, (a, b, c) = registered_pool(3)
    pool.free_blocks([c, a])
    pool.reset_prefix_cache()
    assert all(blk.hash is None for blk in pool.blocks) and pool.get_cached_block(HASHES[1]) is None
    assert pool.blocks[b].ref_count == 1 and free_lists(pool) == ([c, a], [])
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool, (a, b) = registered_pool(2)
    pool.free_blocks([a])
    pool._free_plain.append(b)  # referenced, yet free
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants()
    pool._free_plain.pop()
    pool._hash_to_block[0][HASHES[3]] = b  # a second hash for b
    with pytest.raises(AssertionError, match="another hash"):
        pool.check_invariants()
