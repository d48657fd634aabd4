"""Paged KV-cache blocks: block tables, ref counts, prefix caching, copy-on-write.

Pure Python (no torch): this module only does the bookkeeping; the model runner owns the
tensors and performs the block copies this module asks for.

Prefix caching in one paragraph. Every FULL block of a sequence has a chained hash
`sha256(parent_hash, token ids, extra_keys)`, so equal hashes mean equal whole prefixes.
A block's hash is registered only once its K/V were computed (`mark_computed`). A new
sequence's first allocation walks its full blocks, reusing every registered block whose
stored tokens, parent hash and extra keys match exactly (the hash alone is not trusted),
and stops at the first miss; the last known token is always recomputed so the model
produces logits for it. A freed block keeps its hash and stays findable until the
allocator reuses it; among cached free blocks, the least recently freed is reused first.

In-flight prefixes. A full prompt block that is allocated but not yet computed is "in flight":
its hash is known, its K/V will exist after a forward pass or two. The manager indexes these
hashes so the scheduler can hold back a new sequence whose next blocks another sequence is
computing right now (`num_pending_prefix_tokens`): it waits a step and hits the cache instead
of computing the same prefix again. Only prompt blocks count: their tokens never change, so
the set of in-flight blocks of a sequence is always the logical range
`[num_registered, min(len(block_table), num_prompt_tokens // block_size))`.

Extra keys: a request may carry `seq.extra["cache_salt"]` (a LoRA name, a per-user salt,
...). It is mixed into every block hash so requests with different salts never share K/V.
Use ints, strings or tuples of them (it is hashed through `repr`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple

if TYPE_CHECKING:
    from kvserve.sequence import Sequence

BlockHash = bytes
CACHE_SALT_KEY = "cache_salt"  # key in `Sequence.extra` holding the request's extra hash keys
_ROOT_HASH: BlockHash = bytes(32)  # parent hash of a sequence's first block


def hash_block(parent: BlockHash, tokens: tuple[int, ...], extra_keys: tuple = ()) -> BlockHash:
    """Chained block hash. sha256 (not Python's hash) so a collision is not a practical risk
    and the value is stable across processes. The fields are fixed-width except the last,
    so the concatenation is unambiguous."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extra_keys_of(seq: Sequence) -> tuple:
    """The request's extra hash keys as a tuple (a bare value counts as a 1-tuple)."""
    salt = seq.extra.get(CACHE_SALT_KEY, ())
    if salt is None:
        return ()
    return salt if isinstance(salt, tuple) else (salt,)


def _num_registrable(seq: Sequence) -> int:
    """Leading tokens whose K/V every cache holds (a draft model's pool may lag the target's):
    only blocks within them may be registered, so a hit finds both caches filled."""
    if seq.num_draft_computed is None:
        return seq.num_computed_tokens
    return min(seq.num_computed_tokens, seq.num_draft_computed)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache: what it was registered with,
    # so a hit can be verified token by token.
    hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple = ()

    def forget(self) -> None:
        self.hash, self.parent_hash, self.token_ids, self.extra_keys = None, None, (), ()


@dataclass
class _SeqState:
    """Per-sequence cache bookkeeping, dropped by `free`."""

    hashes: list[BlockHash] = field(default_factory=list)  # hashes of the known full blocks
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    inflight: range = range(0)  # logical blocks currently indexed in BlockManager._inflight


class _Plan(NamedTuple):
    """What allocating some tokens for a sequence would take (see `BlockManager._plan`)."""

    hit_blocks: list[int]  # prefix-cache hits (first allocation only)
    num_cow: int  # shared blocks in the write range that need a private copy
    num_new: int  # fresh blocks appended to the table
    num_from_free_pool: int  # total blocks leaving the free pool


class BlockManager:
    """Owns `num_blocks` physical blocks of `block_size` token slots each.

    API contract for a step (what the scheduler does):
      1. `num_cached_tokens(seq)` on a not-yet-allocated sequence: how many tokens the
         prefix cache would supply (no side effects), to size its first chunk.
      2. `can_allocate(seq, n)` / `allocate(seq, n)`: make `seq.block_table` cover positions
         `[0, seq.num_computed_tokens + n)`, where `num_computed_tokens` is taken AFTER the
         prefix-cache hits of a first allocation. `allocate` also performs copy-on-write of
         shared blocks in the write range and records the copies; the caller drains them with
         `take_block_copies()` and the runner copies them before the forward pass.
      3. After the forward pass advanced `num_computed_tokens`: `mark_computed(seq)`.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without a hash are reused first: reusing them forgets nothing.
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold a registered prefix, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        # Hashes of in-flight prompt blocks -> ids of the live sequences computing them.
        self._inflight: dict[BlockHash, set[int]] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up (vLLM semantics)
        self.prefix_cache_hits = 0  # tokens found

    # ---- capacity ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached-but-free blocks count as free)."""
        return len(self._free_plain) + len(self._free_cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup ----------------------------------------------------------
    def _state(self, seq: Sequence) -> _SeqState:
        return self._seqs.setdefault(seq.seq_id, _SeqState())

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        """Token ids of logical block i, sliced without concatenating prompt and output."""
        bs, p = self.block_size, seq.prompt_token_ids
        lo, hi = i * bs, (i + 1) * bs
        if hi <= len(p):
            return tuple(p[lo:hi])
        out = seq.output_token_ids
        return tuple(p[lo:]) + tuple(out[max(0, lo - len(p)) : hi - len(p)])

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of seq's first `num_full_blocks` blocks (memoized: tokens only grow)."""
        st = self._state(seq)
        extra = extra_keys_of(seq)
        while len(st.hashes) < num_full_blocks:
            parent = st.hashes[-1] if st.hashes else _ROOT_HASH
            st.hashes.append(hash_block(parent, self._block_tokens(seq, len(st.hashes)), extra))
        return st.hashes

    def _is_first_allocation(self, seq: Sequence) -> bool:
        return not seq.block_table and seq.num_computed_tokens == 0

    def _lookup(self, seq: Sequence) -> list[int]:
        """Physical blocks holding seq's longest cached prefix of full blocks."""
        if not self.enable_prefix_caching or not self._is_first_allocation(seq):
            return []
        # Never the whole sequence: the last known token must be recomputed for its logits.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)
        extra = extra_keys_of(seq)
        hits: list[int] = []
        for i in range(max_blocks):
            bid = self._hash_to_block.get(hashes[i])
            if bid is None:
                break
            b = self.blocks[bid]
            parent = hashes[i - 1] if i else _ROOT_HASH
            if b.token_ids != self._block_tokens(seq, i) or b.parent_hash != parent or b.extra_keys != extra:
                break  # hash collision: trust the tokens, not the hash
            hits.append(bid)
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens the prefix cache would supply if seq were allocated now (no side effects)."""
        return len(self._lookup(seq)) * self.block_size

    def num_pending_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens beyond seq's cached prefix that OTHER sequences are computing right now.

        Walks seq's full blocks from the first cache miss while they are in flight elsewhere
        (or cached behind an in-flight block), stopping where a hit would stop (the last known
        token is never a hit). 0 when the next block is not in flight, when seq already holds
        blocks, or without prefix caching. Hashes alone decide, without the token-by-token check
        of a hit: the scheduler asks this of every waiting sequence each step, and a collision
        would only delay seq a step, never make it read wrong K/V.
        """
        if not self._inflight or not self.enable_prefix_caching or not self._is_first_allocation(seq):
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size

        def block_hash(i: int) -> BlockHash:  # hash lazily: most waiters stop at an early block
            return self._hashes(seq, i + 1)[i]

        start = 0
        while start < max_blocks and block_hash(start) in self._hash_to_block:
            start += 1  # the cached prefix
        end = start
        while end < max_blocks:
            h = block_hash(end)
            if any(sid != seq.seq_id for sid in self._inflight.get(h, ())):
                end += 1
            elif end > start and h in self._hash_to_block:
                end += 1  # cached, but only reachable once the in-flight blocks before it land
            else:
                break
        return (end - start) * self.block_size

    def _sync_inflight(self, seq: Sequence) -> None:
        """Re-index seq's in-flight blocks after its table or registered count changed."""
        if not self.enable_prefix_caching:
            return
        st = self._state(seq)
        stop = min(len(seq.block_table), seq.num_prompt_tokens // self.block_size)
        new = range(st.num_registered, max(st.num_registered, stop))
        old = st.inflight
        if new == old:
            return
        hashes = self._hashes(seq, max(new.stop, old.stop))
        for i in old:
            if i not in new:
                self._drop_inflight(hashes[i], seq.seq_id)
        for i in new:
            if i not in old:
                self._inflight.setdefault(hashes[i], set()).add(seq.seq_id)
        st.inflight = new

    def _drop_inflight(self, h: BlockHash, seq_id: int) -> None:
        owners = self._inflight.get(h)
        if owners is not None:
            owners.discard(seq_id)
            if not owners:
                del self._inflight[h]

    # ---- allocation -------------------------------------------------------------------
    def _plan(self, seq: Sequence, num_new_tokens: int) -> _Plan:
        hits = self._lookup(seq)
        table_len = len(seq.block_table) + len(hits)
        # With hits the table is empty, so nothing in it can need a copy.
        start = len(hits) * self.block_size if hits else seq.num_computed_tokens
        end = start + num_new_tokens
        num_cow = sum(1 for i in self._write_range(seq, start, num_new_tokens) if self._shared(seq, i))
        num_new = max(0, self.blocks_for(end) - table_len)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return _Plan(hits, num_cow, num_new, revived + num_cow + num_new)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed (cached hits included) and
        still leave `reserve_blocks` free (a watermark for admissions)."""
        return self._plan(seq, num_new_tokens).num_from_free_pool + reserve_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """Cover positions [0, num_computed_tokens + num_new_tokens) with blocks.

        On a first allocation (empty table, nothing computed) the cached prefix is reused
        first and `seq.num_computed_tokens` is set to its length; `num_new_tokens` then counts
        from there. Shared blocks in the write range get private copies (recorded for
        `take_block_copies`). Returns the number of prefix-cache hit tokens (0 if none).
        Raises RuntimeError if there are not enough free blocks (check `can_allocate`).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        plan = self._plan(seq, num_new_tokens)
        hits, needed = plan.hit_blocks, plan.num_from_free_pool
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} free KV blocks, have {self.num_free_blocks}")
        if self._is_first_allocation(seq) and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size
        for bid in hits:
            self._ref(bid)
        if hits:
            seq.block_table.extend(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            if seq.num_draft_computed is not None:  # registered blocks hold the draft's K/V too
                seq.num_draft_computed = seq.num_computed_tokens
            self._state(seq).num_registered = len(hits)
        self._pending_copies.extend(self.copy_on_write(seq, num_new_tokens))
        target = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take_free_block())
        self._sync_inflight(seq)
        return len(hits) * self.block_size

    def copy_on_write(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Give seq private copies of the shared blocks it is about to write.

        The write range is positions [num_computed_tokens, num_computed_tokens + num_new_tokens);
        in practice only a forked sequence's partial last block is ever shared there.
        Returns (src, dst) block pairs whose K/V the runner must copy before the forward pass.
        `allocate` calls this itself, so the scheduler never needs to; it is public for callers
        that manage blocks by hand. Raises RuntimeError when no block is free.
        """
        copies: list[tuple[int, int]] = []
        for i in self._write_range(seq, seq.num_computed_tokens, num_new_tokens):
            if not self._shared(seq, i):
                continue
            src = seq.block_table[i]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1  # still >= 1: the other holders keep it
            seq.block_table[i] = dst
            copies.append((src, dst))
        return copies

    def _write_range(self, seq: Sequence, start: int, num_tokens: int) -> range:
        """Logical indices of the EXISTING table blocks that positions [start, start+n) touch."""
        if num_tokens <= 0:
            return range(0)
        return range(start // self.block_size, min(len(seq.block_table), self.blocks_for(start + num_tokens)))

    def _shared(self, seq: Sequence, i: int) -> bool:
        return self.blocks[seq.block_table[i]].ref_count > 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs recorded by `allocate` since the last call (then cleared)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _ref(self, bid: int) -> None:
        """Add a reference; a block coming back from the cached free pool keeps its hash."""
        b = self.blocks[bid]
        if b.ref_count == 0:
            self._free_cached.pop(bid)  # hits are always registered, hence in the cached pool
        b.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_plain:
            bid = self._free_plain.popleft()
        elif self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)  # LRU eviction
            self._unregister(bid)
        else:
            raise RuntimeError("out of KV cache blocks")
        self.blocks[bid].ref_count = 1
        return bid

    def _unregister(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.hash is not None and self._hash_to_block.get(b.hash) == bid:
            del self._hash_to_block[b.hash]
        b.forget()

    # ---- after the forward pass ------------------------------------------------------
    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        st = self._state(seq)
        num_full = min(_num_registrable(seq) // self.block_size, len(seq.block_table))
        if num_full <= st.num_registered:
            return
        hashes = self._hashes(seq, num_full)
        extra = extra_keys_of(seq)
        for i in range(st.num_registered, num_full):
            b = self.blocks[seq.block_table[i]]
            if b.hash is not None or hashes[i] in self._hash_to_block:
                continue  # already registered (a hit), or another block holds this prefix
            b.hash, b.parent_hash = hashes[i], hashes[i - 1] if i else _ROOT_HASH
            b.token_ids, b.extra_keys = self._block_tokens(seq, i), extra
            self._hash_to_block[b.hash] = b.block_id
        st.num_registered = num_full
        self._sync_inflight(seq)  # these blocks are computed now: no longer in flight

    def trim(self, seq: Sequence) -> None:
        """Speculative rollback: return the table's blocks past `num_computed_tokens`.

        They held slots for draft tokens that were rejected (or never proposed). The accepted
        tokens' K/V stay; stale K/V after them in the last kept block is overwritten by later
        writes and never read (attention reads [0, context length) only).
        """
        keep = self.blocks_for(seq.num_computed_tokens)
        for bid in reversed(seq.block_table[keep:]):
            self._unref(bid)
        del seq.block_table[keep:]
        self._sync_inflight(seq)

    def _unref(self, bid: int) -> None:
        """Drop one reference; at 0 the block goes back to the pool keeping its hash."""
        b = self.blocks[bid]
        b.ref_count -= 1
        if b.ref_count == 0:
            if b.hash is not None:
                self._free_cached[bid] = None
            else:
                self._free_plain.append(bid)

    # ---- sharing and release ---------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks (ref counts +1) and its computed length.

        The engine copies the token ids; writes into a shared block trigger copy-on-write.
        """
        if child.block_table:
            raise ValueError(f"fork: child seq {child.seq_id} already holds blocks")
        for bid in parent.block_table:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_draft_computed = parent.num_draft_computed
        pst = self._state(parent)
        self._seqs[child.seq_id] = _SeqState(list(pst.hashes), pst.num_registered)
        self._sync_inflight(child)  # the child will compute the same uncomputed prompt blocks

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks reaching 0 go back to the pool keeping their hash.

        Tail blocks are released first so they are evicted before the shared-prefix blocks.
        Leaves `num_computed_tokens` alone (preemption resets it). Safe to call twice.
        """
        for bid in reversed(seq.block_table):
            self._unref(bid)
        seq.block_table = []
        st = self._seqs.pop(seq.seq_id, None)
        if st is not None:  # its in-flight blocks will never be computed: waiters stop waiting
            for i in st.inflight:
                self._drop_inflight(st.hashes[i], seq.seq_id)

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat KV-pool slot of a token position."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (e.g. after weights change). Counters are kept.

        In-flight blocks stay indexed: they belong to live sequences and are registered (with
        whatever K/V those sequences compute) once computed, as usual.
        """
        for bid in list(self._hash_to_block.values()):
            self.blocks[bid].forget()
        self._hash_to_block.clear()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()

    # ---- testing aid ------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the bookkeeping is consistent with the given live sequences' block tables."""
        seqs = list(seqs)  # walked several times
        holders: dict[int, int] = {}
        for s in seqs:
            assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} repeats a block"
            assert len(s.block_table) * self.block_size >= s.num_computed_tokens, (
                f"seq {s.seq_id}: {s.num_computed_tokens} computed tokens but {len(s.block_table)} blocks"
            )
            for bid in s.block_table:
                assert 0 <= bid < self.num_blocks, f"seq {s.seq_id}: block id {bid} out of range"
                holders[bid] = holders.get(bid, 0) + 1
        free_plain, free_cached = list(self._free_plain), list(self._free_cached)
        free = set(free_plain) | set(free_cached)
        assert len(free) == len(free_plain) + len(free_cached), "a block is in the free pool twice"
        for b in self.blocks:
            n = holders.get(b.block_id, 0)
            assert b.ref_count == n, f"block {b.block_id}: ref count {b.ref_count} but {n} holders"
            assert (b.block_id in free) == (n == 0), (
                f"block {b.block_id}: free={b.block_id in free} but referenced by {n} tables"
            )
        for bid in free_cached:
            assert self.blocks[bid].hash is not None, f"cached free block {bid} has no hash"
        for bid in free_plain:
            assert self.blocks[bid].hash is None, f"plain free block {bid} still has a hash"
        for h, bid in self._hash_to_block.items():
            assert 0 <= bid < self.num_blocks, f"hash maps to block id {bid}, out of range"
            b = self.blocks[bid]
            assert b.hash == h, f"block {bid} is registered under another hash"
            assert b.parent_hash is not None and hash_block(b.parent_hash, b.token_ids, b.extra_keys) == h, (
                f"block {bid}: stored tokens differ from those it was registered with"
            )
        for b in self.blocks:
            assert b.hash is None or self._hash_to_block.get(b.hash) == b.block_id, (
                f"block {b.block_id} holds a hash the cache does not map to it"
            )
        self._check_contents(seqs)
        self._check_inflight(seqs)

    def _check_inflight(self, seqs: Iterable[Sequence]) -> None:
        """The in-flight index holds exactly the uncomputed full prompt blocks of live tables."""
        expected: dict[BlockHash, set[int]] = {}
        if self.enable_prefix_caching:
            for s in seqs:
                st = self._seqs.get(s.seq_id)
                if st is None:
                    assert not s.block_table, f"seq {s.seq_id} holds blocks but has no state"
                    continue
                stop = min(len(s.block_table), s.num_prompt_tokens // self.block_size)
                want = range(st.num_registered, max(st.num_registered, stop))
                assert st.inflight == want, f"seq {s.seq_id}: in-flight blocks {st.inflight}, expected {want}"
                # Recompute the chain instead of trusting the memoized hashes.
                h, extra = _ROOT_HASH, extra_keys_of(s)
                for i in range(want.stop):
                    h = hash_block(h, self._block_tokens(s, i), extra)
                    if i not in want:
                        continue
                    assert i >= _num_registrable(s) // self.block_size, (
                        f"seq {s.seq_id}: block {i} is computed but still in flight"
                    )
                    b = self.blocks[s.block_table[i]]
                    # A forked sequence whose draft cache lags may still count a block in flight
                    # that its parent (or child), which shared it, already registered.
                    assert b.hash is None or s.num_draft_computed is not None, (
                        f"seq {s.seq_id}: in-flight block {i} is already registered"
                    )
                    expected.setdefault(h, set()).add(s.seq_id)
        assert self._inflight == expected, "in-flight index does not match the live sequences"

    def _check_contents(self, seqs: Iterable[Sequence]) -> None:
        """A registered block in a live table holds exactly that sequence's tokens there."""
        for s in seqs:
            for i in range(min(s.num_computed_tokens // self.block_size, len(s.block_table))):
                b = self.blocks[s.block_table[i]]
                if b.hash is not None:
                    assert b.token_ids == self._block_tokens(s, i), (
                        f"seq {s.seq_id} block {i} (physical {b.block_id}) holds other tokens"
                    )
