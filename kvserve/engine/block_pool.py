"""The physical KV-cache pages: who references each block, which blocks are free, and which
hold a registered prefix that a later request may reuse.

Pure Python (no torch), like the block manager above it: the manager decides which sequence
gets which block (tables, prefix hits, copy-on-write, sliding windows); this pool only keeps
the pages' books, named after vLLM v1's `BlockPool` where one fits.

Free blocks come in two kinds. A plain free block holds nothing anyone can find; a cached free
block is unreferenced but still registered under its content hash, so a prefix hit can revive
it (`touch`). New blocks come from the plain ones first (reusing them forgets nothing), then
from the cached ones, least recently freed first: taking one evicts its prefix.

The registry maps a content hash to at most one block per layer group, and a registered block
records what it was registered with (parent hash, token ids, extra keys), so the manager can
verify a hit token by token instead of trusting the hash. The pool treats hashes as opaque.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable

BlockHash = bytes


@dataclass
class Block:
    """One page of the pool: its reference count and, while registered, its prefix."""

    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache: what it was registered with,
    # so a hit can be verified token by token, and in which layer group's map.
    hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple = ()
    group: int = 0

    def forget(self) -> None:
        self.hash, self.parent_hash, self.token_ids, self.extra_keys = None, None, (), ()


class BlockPool:
    """`num_blocks` blocks with reference counts, two free lists and one hash registry per
    layer group (every group draws its pages from this one pool)."""

    def __init__(self, num_blocks: int, num_groups: int = 1):
        if num_blocks < 1 or num_groups < 1:
            raise ValueError(f"need num_blocks >= 1 and num_groups >= 1, got {num_blocks}, {num_groups}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without a hash are reused first: reusing them forgets nothing.
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold a registered prefix, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached-but-free blocks count as free)."""
        return len(self._free_plain) + len(self._free_cached)

    # ---- reference counts ----------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with one reference: plain ones first, then the
        least recently freed cached ones, whose prefix is evicted. All or nothing: raises
        RuntimeError (taking none) when fewer are free."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError("out of KV cache blocks")
        return [self._take_free_block() for _ in range(num_blocks)]

    def _take_free_block(self) -> int:
        if self._free_plain:
            bid = self._free_plain.popleft()
        else:
            bid, _ = self._free_cached.popitem(last=False)  # LRU eviction
            self._unregister(bid)
        self.blocks[bid].ref_count = 1
        return bid

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block. One coming back from the cached free pool keeps its
        hash; touching a free block that is not registered is an error (KeyError): take a new
        one instead."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._free_cached.pop(bid)  # prefix hits are always registered, hence in the cached pool
            b.ref_count += 1

    def refresh(self, block_id: int) -> None:
        """A cached free block goes to the back of the eviction order, as if freed now (nothing
        happens to a block that is in use or no longer cached)."""
        if block_id in self._free_cached:
            self._free_cached.move_to_end(block_id)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order. A block reaching 0 goes to the back of
        its free list keeping its hash, so the order given is the order of later eviction."""
        for bid in block_ids:
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_plain.append(bid)

    # ---- hash registry -------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The block registered under `block_hash` in `group`'s map, or None. Hash only: the
        caller verifies the stored tokens when it matters."""
        return self._hash_to_block[group].get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash,
                 token_ids: tuple[int, ...], extra_keys: tuple = (), group: int = 0) -> bool:
        """Register a (computed, referenced) block under `block_hash` in `group`'s map, with
        what it holds. A no-op, returning False, when the block is registered already (a
        prefix hit) or another block holds the hash: each hash maps to one block and back."""
        b = self.blocks[block_id]
        cached = self._hash_to_block[group]
        if b.hash is not None or block_hash in cached:
            return False
        b.hash, b.parent_hash, b.token_ids, b.extra_keys, b.group = block_hash, parent_hash, token_ids, extra_keys, group
        cached[block_hash] = block_id
        return True

    def _unregister(self, block_id: int) -> None:
        """Forget the block's prefix (it stays in whichever free list holds it)."""
        b = self.blocks[block_id]
        cached = self._hash_to_block[b.group]
        if b.hash is not None and cached.get(b.hash) == block_id:
            del cached[b.hash]
        b.forget()

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix, referenced blocks' too; cached free blocks become
        plain ones, behind those already plain, least recently freed first."""
        for cached in self._hash_to_block:
            for bid in list(cached.values()):
                self.blocks[bid].forget()
            cached.clear()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()

    # ---- testing aid ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool's own books agree: free lists vs reference counts, free lists vs
        hashes, and the registry vs the blocks' hashes, both ways."""
        free_plain, free_cached = list(self._free_plain), list(self._free_cached)
        free = set(free_plain) | set(free_cached)
        assert len(free) == len(free_plain) + len(free_cached), "a block is in the free pool twice"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id}: negative ref count {b.ref_count}"
            assert (b.block_id in free) == (b.ref_count == 0), (
                f"block {b.block_id}: free={b.block_id in free} but ref count {b.ref_count}"
            )
        for bid in free_cached:
            assert self.blocks[bid].hash is not None, f"cached free block {bid} has no hash"
        for bid in free_plain:
            assert self.blocks[bid].hash is None, f"plain free block {bid} still has a hash"
        for g, cached in enumerate(self._hash_to_block):
            for h, bid in cached.items():
                assert 0 <= bid < self.num_blocks, f"hash maps to block id {bid}, out of range"
                b = self.blocks[bid]
                assert b.hash == h and b.group == g, f"block {bid} is registered under another hash or group"
        for b in self.blocks:
            assert b.hash is None or self._hash_to_block[b.group].get(b.hash) == b.block_id, (
                f"block {b.block_id} holds a hash the cache does not map to it"
            )
