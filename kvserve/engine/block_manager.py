"""Paged KV-cache policy: per-sequence block tables, prefix caching, copy-on-write, fork, and
sliding-window release per layer group.

Pure Python (no torch): this module only does the bookkeeping; the model runner owns the
tensors and performs the block copies this module asks for. The pages themselves (reference
counts, free lists, LRU eviction, the hash -> block registry) are `block_pool.BlockPool`'s;
`BlockManager` decides which sequence holds which page and calls the pool.

Prefix caching in one paragraph. Every FULL block of a sequence has a chained hash
`sha256(parent_hash, token ids, extra_keys)`, so equal hashes mean equal whole prefixes.
A block's hash is registered only once its K/V were computed (`mark_computed`). A new
sequence's first allocation walks its full blocks, reusing every registered block whose
stored tokens, parent hash and extra keys match exactly (the hash alone is not trusted),
and stops at the first miss; the last known token is always recomputed so the model
produces logits for it. A freed block keeps its hash and stays findable until the
pool reuses it; among cached free blocks, the least recently freed is reused first.

Layer groups (sliding-window release). The model's layers may be split into G groups of
equal size (`kvserve/model/config.py: kv_layer_groups`); every sequence then has one block
table per group, all drawing pages (a "block" here: `block_size` tokens of one group's
layers) from ONE `BlockPool`. Group 0 is `seq.block_table`, groups 1.. are
`seq.group_block_tables`. A group with a sliding window W only ever reads the last W
positions before a query, so once a block lies wholly before `basis - W + 1` (`basis` = the
first position any cache will still compute, i.e. the next query) it is released (one
reference dropped, back to the pool keeping its hash) and its table entry becomes
`NULL_BLOCK`: a table's NULL entries are always one run, leading unless `sink_tokens` > 0
(StreamingLLM: sliding groups also keep the blocks of the first `sink_tokens` positions, the
attention sinks, and the run starts after them). Full groups keep every block.
With one group and no window (the default) this is exactly the classic single-table manager.

Prefix hits with groups. Each group registers its own pages under the shared chained hashes
(the pool keeps one hash -> page map per group). A hit of k blocks needs, in every full
group, blocks [0, k) cached, and in every sliding group only the blocks covering positions
[k*bs - W + 1, k*bs), the context of the first recomputed token; its earlier entries start
out NULL. The manager takes the largest such k (bounded by the full groups' common prefix).

In-flight prefixes. A full prompt block that is allocated but not yet computed is "in flight":
its hash is known, its K/V will exist after a forward pass or two. The manager indexes these
hashes so the scheduler can hold back a new sequence whose next blocks another sequence is
computing right now (`num_pending_prefix_tokens`): it waits a step and hits the cache instead
of computing the same prefix again. Only prompt blocks count: their tokens never change, so
the set of in-flight blocks of a sequence is always the logical range
`[num_registered, min(len(block_table), num_prompt_tokens // block_size))`. Logical blocks are
the same in every group, so group 0's table and hash map stand for all.

Extra keys: a request may carry `seq.cache_salt`, a tuple (a LoRA name, a per-user salt,
...). It is mixed into every block hash so requests with different salts never share K/V.
Use ints and strings in it (it is hashed through `repr`).

Recurrent state (hybrid models). With `num_state_slots`, every sequence also holds one slot of a
fixed state pool (`state_slots.StateSlots`): taken by its first allocation, given back by `free`,
copied by `fork`. Such a manager never serves prefix hits: a hit would supply K/V for the
attention layers but no recurrent state at that position.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple
from typing import Sequence as Seq

from kvserve.engine.block_pool import BlockHash, BlockPool
from kvserve.engine.state_slots import StateSlots

if TYPE_CHECKING:
    from kvserve.sequence import Sequence

NULL_BLOCK = -1  # a table entry whose block a sliding-window group released: never read or written
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


def _num_registrable(seq: Sequence) -> int:
    """Leading tokens whose K/V every cache holds (a draft model's pool may lag the target's):
    only blocks within them may be registered, so a hit finds both caches filled. It is also
    the first position some cache will compute next: the basis of sliding-window release."""
    if seq.num_draft_computed is None:
        return seq.num_computed_tokens
    return min(seq.num_computed_tokens, seq.num_draft_computed)


def blocks_touched(num_positions: int, block_size: int) -> int:
    """Most blocks that `num_positions` consecutive positions can touch (worst alignment)."""
    if num_positions <= 0:
        return 0
    return (num_positions + block_size - 2) // block_size + 1


@dataclass
class _SeqState:
    """Per-sequence cache bookkeeping, dropped by `free`."""

    hashes: list[BlockHash] = field(default_factory=list)  # hashes of the known full blocks
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    inflight: range = range(0)  # logical blocks currently indexed in BlockManager._inflight
    released: dict[int, int] = field(default_factory=dict)  # sliding group -> end of its NULL run


class _Plan(NamedTuple):
    """What allocating some tokens for a sequence would take (see `BlockManager._plan`)."""

    hits: list[list[int]] | None  # per group, prefix-cache hit pages (first allocation only)
    num_cow: int  # shared blocks in the write range that need a private copy
    num_new: int  # fresh blocks appended to the tables
    num_from_free_pool: int  # total blocks leaving the free pool


class BlockManager:
    """Hands out `num_blocks` physical blocks (pages, kept by `self.pool`) of `block_size`
    token slots each to sequences.

    `group_windows`: one entry per KV layer group, its sliding window or None (full attention,
    keeps every block). The default, one full group, is the classic single-table manager.

    API contract for a step (what the scheduler does):
      1. `num_cached_tokens(seq)` on a not-yet-allocated sequence: how many tokens the
         prefix cache would supply (no side effects), to size its first chunk.
      2. `can_allocate(seq, n)` / `allocate(seq, n)`: make every table of seq cover positions
         `[0, seq.num_computed_tokens + n)`, where `num_computed_tokens` is taken AFTER the
         prefix-cache hits of a first allocation. `allocate` also performs copy-on-write of
         shared blocks in the write range and records the copies; the caller drains them with
         `take_block_copies()` and the runner copies them before the forward pass.
      3. After the forward pass advanced `num_computed_tokens`: `mark_computed(seq)` (registers
         full blocks, releases blocks that left every sliding window).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 group_windows: Seq[int | None] = (None,), sink_tokens: int = 0, num_state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        group_windows = tuple(group_windows)
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"group_windows must be a non-empty list of windows >= 1 or None, got {group_windows}")
        if sink_tokens < 0 or (sink_tokens and all(w is None for w in group_windows)):
            raise ValueError(f"sink_tokens must be >= 0 and needs a sliding group, got {sink_tokens}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # StreamingLLM: sliding groups also keep the blocks of the first `sink_tokens` positions
        # for good; their released entries are then the run [sink_blocks, ...), not a leading one.
        self.sink_tokens = sink_tokens
        self.sink_blocks = -(-sink_tokens // block_size)
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a model with recurrent state (num_state_slots > 0): "
                             "a cached prefix has K/V but no saved state")
        self.enable_prefix_caching = enable_prefix_caching
        # A hybrid model's recurrent state pool (None: no recurrent layers).
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self._sliding = [g for g, w in enumerate(group_windows) if w is not None]
        self.pool = BlockPool(num_blocks, self.num_groups)
        self.blocks = self.pool.blocks  # the pool's list itself: ref counts and registered prefixes
        # Hashes of in-flight prompt blocks -> ids of the live sequences computing them.
        self._inflight: dict[BlockHash, set[int]] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up (vLLM semantics)
        self.prefix_cache_hits = 0  # tokens found
        self.num_window_released = 0  # blocks sliding groups gave back early (cumulative)

    # ---- capacity ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached-but-free blocks count as free)."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, basis: int, window: int) -> int:
        """First logical block a sliding group still needs when the next query is at `basis`:
        that query reads positions from basis - window + 1 on."""
        return max(0, basis - window + 1) // self.block_size

    def peak_blocks(self, num_tokens: int, max_chunk: int, keep_all: bool = False) -> int:
        """Most blocks one sequence holds at once on its way to `num_tokens` tokens, fed in
        chunks of at most `max_chunk` tokens: every block in full groups; in a sliding group
        the chunk plus the W - 1 positions before it (at least 1: a prefix hit keeps the block
        before its first recomputed token). `keep_all`: nothing is released (a lagging draft
        cache holds the release back, see `_num_registrable`)."""
        full = self.blocks_for(num_tokens)
        total = 0
        for w in self.group_windows:
            if w is None or keep_all:
                total += full
            else:
                total += min(full, self.sink_blocks + blocks_touched(max(w - 1, 1) + max_chunk, self.block_size))
        return total

    def max_tokens_per_seq(self, max_chunk: int, keep_all: bool = False) -> int | None:
        """Longest sequence that fits the pool alone (`peak_blocks` <= num_blocks); None when
        there is no bound (every group slides and a window's worth fits)."""
        if keep_all or not self._sliding:
            return self.num_blocks // self.num_groups * self.block_size
        if len(self._sliding) == self.num_groups:
            big = self.peak_blocks(10**12, max_chunk)
            return None if big <= self.num_blocks else self._largest_fitting(max_chunk)
        return self._largest_fitting(max_chunk)

    def _largest_fitting(self, max_chunk: int) -> int:
        lo, hi = 0, (self.num_blocks + 1) * self.block_size  # peak_blocks is monotone in tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid, max_chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def seq_blocks(self, seq: Sequence) -> int:
        """Blocks seq's tables hold now (shared ones counted once per holder)."""
        return sum(1 for t in seq.block_tables for b in t if b != NULL_BLOCK)

    # ---- tables -----------------------------------------------------------------------
    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table of every layer group (group 0 is `seq.block_table`), created
        empty on first use."""
        extra = seq.group_block_tables
        while len(extra) < self.num_groups - 1:
            extra.append([])
        return [seq.block_table, *extra] if extra else [seq.block_table]

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
        extra = seq.cache_salt
        while len(st.hashes) < num_full_blocks:
            parent = st.hashes[-1] if st.hashes else _ROOT_HASH
            st.hashes.append(hash_block(parent, self._block_tokens(seq, len(st.hashes)), extra))
        return st.hashes

    def _is_first_allocation(self, seq: Sequence) -> bool:
        return not seq.block_table and seq.num_computed_tokens == 0

    def _page_finder(self, seq: Sequence, hashes: list[BlockHash], verify: bool) -> Callable[[int, int], int | None]:
        """page(g, i): group g's cached page for seq's logical block i, or None (memoized).
        `verify`: check the stored tokens, parent hash and extra keys too (a hit), not only
        the hash (a cheap guess, where a collision could only cost time)."""
        extra = seq.cache_salt
        memo: dict[tuple[int, int], int | None] = {}

        def page(g: int, i: int) -> int | None:
            key = (g, i)
            if key not in memo:
                bid = self.pool.get_cached_block(hashes[i], g)
                if bid is not None and verify:
                    b = self.blocks[bid]
                    parent = hashes[i - 1] if i else _ROOT_HASH
                    if b.token_ids != self._block_tokens(seq, i) or b.parent_hash != parent or b.extra_keys != extra:
                        bid = None  # hash collision: trust the tokens, not the hash
                memo[key] = bid
            return memo[key]

        return page

    def _hit_first_block(self, k: int, window: int) -> int:
        """First block a sliding group must have cached for a hit of k >= 1 blocks: those the
        first recomputed token's window reads, and at least the last one (so a hit is always
        backed by cached pages, even for a window of 1)."""
        return min(self.first_needed_block(k * self.block_size, window), k - 1)

    def _hit_length(self, max_blocks: int, page: Callable[[int, int], int | None]) -> int:
        """Largest k <= max_blocks such that full groups have blocks [0, k) and sliding groups
        the blocks from `_hit_first_block(k)` to k."""
        k = max_blocks
        for g, w in enumerate(self.group_windows):
            if w is None:  # full groups: the common run of cached blocks from the start
                run = 0
                while run < k and page(g, run) is not None:
                    run += 1
                k = run
        # Sliding groups: k only decreases, so each block is looked at once per group.
        changed = True
        while changed and k > 0:
            changed = False
            for g in self._sliding:
                w = self.group_windows[g]
                i = k - 1
                while k > 0 and i >= self._hit_first_block(k, w):
                    if page(g, i) is None:
                        k, changed = i, True  # no hit may include block i for this group
                    i -= 1
            if self.sink_blocks:  # the sink blocks, kept by every sliding group
                for g in self._sliding:
                    for i in range(min(self.sink_blocks, k)):
                        if page(g, i) is None:
                            k, changed = i, True
                            break
        return k

    def _hit_row(self, g: int, k: int, page: Callable[[int, int], int | None]) -> list[int]:
        """Group g's table for a hit of k blocks: cached pages, NULL_BLOCK where a sliding
        group needs none (between its sink blocks and its window)."""
        w = self.group_windows[g]
        lo = 0 if w is None else self._hit_first_block(k, w)
        keep = min(self.sink_blocks, lo)
        return ([page(g, i) for i in range(keep)] + [NULL_BLOCK] * (lo - keep)  # type: ignore[misc]
                + [page(g, i) for i in range(lo, k)])

    def _lookup(self, seq: Sequence) -> list[list[int]] | None:
        """Per group, the pages of seq's longest usable cached prefix (NULL_BLOCK where a
        sliding group needs none); None when nothing hits."""
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache or not self._is_first_allocation(seq):
            return None
        # Never the whole sequence: the last known token must be recomputed for its logits.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return None
        page = self._page_finder(seq, self._hashes(seq, max_blocks), verify=True)
        k = self._hit_length(max_blocks, page)
        if k == 0:
            return None
        return [self._hit_row(g, k, page) for g in range(self.num_groups)]

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens the prefix cache would supply if seq were allocated now (no side effects)."""
        hits = self._lookup(seq)
        return len(hits[0]) * self.block_size if hits else 0

    def num_pending_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens beyond seq's cached prefix that OTHER sequences are computing right now.

        Walks seq's full blocks from where a hit would end today while they are in flight
        elsewhere (or cached behind an in-flight block), stopping where a hit would stop (the
        last known token is never a hit). 0 when the next block is not in flight, when seq
        already holds blocks, without prefix caching, or for a sequence that reads no cached prefix
        (`skip_reading_prefix_cache`). Hashes alone decide, without the
        token-by-token check of a hit: the scheduler asks this of every waiting sequence each
        step, and a collision would only delay seq a step, never make it read wrong K/V. Past
        the hit, group 0's map stands for every group (with sliding groups a pending block may
        still fall short of a hit: again only a delay).
        """
        if (not self._inflight or not self.enable_prefix_caching or seq.skip_reading_prefix_cache
                or not self._is_first_allocation(seq)):
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return 0
        cached_page = self.pool.get_cached_block  # group 0's map
        if self.num_groups > 1 or self._sliding:  # where a hit would end, by hashes
            hashes = self._hashes(seq, max_blocks)
            block_hash = hashes.__getitem__
            start = self._hit_length(max_blocks, self._page_finder(seq, hashes, verify=False))
        else:
            def block_hash(i: int) -> BlockHash:  # hash lazily: most waiters stop at an early block
                return self._hashes(seq, i + 1)[i]

            start = 0
            while start < max_blocks and cached_page(block_hash(start)) is not None:
                start += 1  # the cached prefix
        end = start
        while end < max_blocks:
            h = block_hash(end)
            if any(sid != seq.seq_id for sid in self._inflight.get(h, ())):
                end += 1
            elif end > start and cached_page(h) is not None:
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
        tables = self.tables(seq)
        if hits:  # the tables are empty: nothing in them can need a copy
            target = self.blocks_for(len(hits[0]) * self.block_size + num_new_tokens)
            num_new = sum(max(0, target - len(h)) for h in hits)
            revived = sum(1 for h in hits for b in h if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
            return _Plan(hits, 0, num_new, revived + num_new)
        # All tables have the same length: one write range and one growth for every group.
        start, table_len = seq.num_computed_tokens, len(seq.block_table)
        writes = self._write_range(table_len, start, num_new_tokens)
        num_cow = sum(1 for table in tables for i in writes if self._shared(table[i]))
        num_new = len(tables) * max(0, self.blocks_for(start + num_new_tokens) - table_len)
        return _Plan(None, num_cow, num_new, num_cow + num_new)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed (cached hits included) and
        still leave `reserve_blocks` free (a watermark for admissions)."""
        if self.state_slots is not None and self.state_slots.needed(seq) > self.state_slots.num_free:
            return False
        return self._plan(seq, num_new_tokens).num_from_free_pool + reserve_blocks <= self.num_free_blocks

    def fits_in_place(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` has nothing to do: seq's tables already cover
        the new positions and none of the blocks they write is shared (no copy-on-write). A
        decode inside its last block (most steps): the scheduler skips the room check and the
        allocation, the per-sequence cost of a large batch's step."""
        table = seq.block_table  # (every group's table has its length)
        end = seq.num_computed_tokens + num_new_tokens
        if not table or num_new_tokens <= 0 or self.blocks_for(end) > len(table):
            return False
        if self.state_slots is not None and seq.state_slot is None:
            return False
        writes = self._write_range(len(table), seq.num_computed_tokens, num_new_tokens)
        return not any(self._shared(t[i]) for t in self.tables(seq) for i in writes)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """Cover positions [0, num_computed_tokens + num_new_tokens) with blocks in every group.

        On a first allocation (empty tables, nothing computed) the cached prefix is reused
        first and `seq.num_computed_tokens` is set to its length; `num_new_tokens` then counts
        from there. Shared blocks in the write range get private copies (recorded for
        `take_block_copies`). Returns the number of prefix-cache hit tokens (0 if none).
        Raises RuntimeError if there are not enough free blocks (check `can_allocate`).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        plan = self._plan(seq, num_new_tokens)
        needed = plan.num_from_free_pool
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} free KV blocks, have {self.num_free_blocks}")
        if self.state_slots is not None:
            self.state_slots.allocate(seq)  # (raises before any block moves when none is free)
        num_hit = len(plan.hits[0]) if plan.hits else 0
        if self._is_first_allocation(seq) and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit * self.block_size
        tables = self.tables(seq)
        if plan.hits:
            for table, hit in zip(tables, plan.hits):
                self.pool.touch(bid for bid in hit if bid != NULL_BLOCK)  # revives cached free pages
                table.extend(hit)
            seq.num_computed_tokens = num_hit * self.block_size
            if seq.num_draft_computed is not None:  # registered blocks hold the draft's K/V too
                seq.num_draft_computed = seq.num_computed_tokens
            st = self._state(seq)
            st.num_registered = num_hit
            st.released = {g: stop for g in self._sliding
                           if (stop := self._hit_first_block(num_hit, self.group_windows[g])) > self.sink_blocks}
        self._pending_copies.extend(self.copy_on_write(seq, num_new_tokens))
        target = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        for table in tables:
            if len(table) < target:
                table.extend(self.pool.get_new_blocks(target - len(table)))
        self._sync_inflight(seq)
        return num_hit * self.block_size

    def copy_on_write(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Give seq private copies of the shared blocks it is about to write, in every group.

        The write range is positions [num_computed_tokens, num_computed_tokens + num_new_tokens);
        in practice only a forked sequence's partial last block is ever shared there.
        Returns (src, dst) block pairs whose K/V the runner must copy before the forward pass.
        `allocate` calls this itself, so the scheduler never needs to; it is public for callers
        that manage blocks by hand. Raises RuntimeError when no block is free.
        """
        copies: list[tuple[int, int]] = []
        writes = self._write_range(len(seq.block_table), seq.num_computed_tokens, num_new_tokens)
        for table in self.tables(seq):
            for i in writes:
                if not self._shared(table[i]):
                    continue
                src = table[i]
                dst = self.pool.get_new_blocks(1)[0]
                self.pool.free_blocks([src])  # still >= 1 reference: the other holders keep it
                table[i] = dst
                copies.append((src, dst))
        return copies

    def _write_range(self, table_len: int, start: int, num_tokens: int) -> range:
        """Logical indices of the EXISTING blocks (of tables this long) that positions
        [start, start+n) touch."""
        if num_tokens <= 0:
            return range(0)
        return range(start // self.block_size, min(table_len, self.blocks_for(start + num_tokens)))

    def _shared(self, bid: int) -> bool:
        return bid != NULL_BLOCK and self.blocks[bid].ref_count > 1

    def take_state_copies(self) -> list[tuple[int, int]]:
        """Recurrent-state slot copies (src, dst) recorded by `fork` since the last call."""
        return self.state_slots.take_copies() if self.state_slots is not None else []

    @property
    def num_free_state_slots(self) -> int | None:
        return self.state_slots.num_free if self.state_slots is not None else None

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs recorded by `allocate` since the last call (then cleared)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- after the forward pass ------------------------------------------------------
    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed since the last call, then
        release the blocks every sliding window has left behind."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self._sliding:
            self._release_out_of_window(seq)

    def _register(self, seq: Sequence) -> None:
        st = self._state(seq)
        num_full = min(_num_registrable(seq) // self.block_size, len(seq.block_table))
        if num_full <= st.num_registered:
            return
        hashes = self._hashes(seq, num_full)
        extra = seq.cache_salt
        for g, table in enumerate(self.tables(seq)):
            for i in range(st.num_registered, num_full):
                bid = table[i]
                if bid == NULL_BLOCK:
                    continue  # released before it was ever registered (not reachable: defensive)
                # A no-op if already registered (a hit) or another block holds this prefix.
                self.pool.register(bid, hashes[i], hashes[i - 1] if i else _ROOT_HASH,
                                   self._block_tokens(seq, i), extra, g)
        st.num_registered = num_full
        self._sync_inflight(seq)  # these blocks are computed now: no longer in flight

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Return the blocks that lie wholly before every future query's window, per sliding
        group. Registered ones stay findable in the cached free pool (a later hit needs the
        blocks just before its first recomputed token)."""
        basis = _num_registrable(seq)
        tables = None
        for g in self._sliding:
            stop = self.first_needed_block(basis, self.group_windows[g])
            if stop == 0:
                continue
            st = self._state(seq)
            done = max(st.released.get(g, 0), self.sink_blocks)
            if tables is None:
                tables = self.tables(seq)
            table = tables[g]
            stop = min(stop, len(table))
            if stop > done:
                self.pool.free_blocks(table[done:stop])
                table[done:stop] = [NULL_BLOCK] * (stop - done)
                st.released[g] = stop
                self.num_window_released += stop - done

    def trim(self, seq: Sequence) -> None:
        """Speculative rollback: return every table's blocks past `num_computed_tokens`.

        They held slots for draft tokens that were rejected (or never proposed). The accepted
        tokens' K/V stay; stale K/V after them in the last kept block is overwritten by later
        writes and never read (attention reads [0, context length) only).
        """
        keep = self.blocks_for(seq.num_computed_tokens)
        for table in self.tables(seq):
            self.pool.free_blocks(bid for bid in reversed(table[keep:]) if bid != NULL_BLOCK)
            del table[keep:]
        self._sync_inflight(seq)

    # ---- sharing and release ---------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks in every group (ref counts +1) and its computed
        length.

        The engine copies the token ids; writes into a shared block trigger copy-on-write.
        """
        if any(child.block_tables):
            raise ValueError(f"fork: child seq {child.seq_id} already holds blocks")
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)
        self.pool.touch(bid for table in self.tables(parent) for bid in table if bid != NULL_BLOCK)
        child.block_table = list(parent.block_table)
        child.group_block_tables = [list(t) for t in parent.group_block_tables]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_draft_computed = parent.num_draft_computed
        pst = self._state(parent)
        self._seqs[child.seq_id] = _SeqState(list(pst.hashes), pst.num_registered, released=dict(pst.released))
        self._sync_inflight(child)  # the child will compute the same uncomputed prompt blocks

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks reaching 0 go back to the pool keeping their hash.

        Tail blocks are released first (the last logical block of every group, then the one
        before, ...) so they are evicted before the shared-prefix blocks. The pages a sliding
        group released earlier, while still cached, take their place in that order too: a prefix
        hit needs them as much as the full groups' pages, so a prefix's pages age together rather
        than the released ones being evicted first. Leaves `num_computed_tokens` alone
        (preemption resets it). Safe to call twice.
        """
        if self.state_slots is not None:
            self.state_slots.free(seq)
        tables = seq.block_tables
        st = self._seqs.get(seq.seq_id)
        for i in reversed(range(max(map(len, tables)))):
            for g, table in enumerate(tables):
                if i >= len(table):
                    continue
                if table[i] != NULL_BLOCK:
                    self.pool.free_blocks((table[i],))
                elif st is not None and i < st.num_registered:
                    page = self.pool.get_cached_block(st.hashes[i], g)
                    if page is not None:
                        self.pool.refresh(page)
        seq.block_table = []
        seq.group_block_tables = []
        st = self._seqs.pop(seq.seq_id, None)
        if st is not None:  # its in-flight blocks will never be computed: waiters stop waiting
            for i in st.inflight:
                self._drop_inflight(st.hashes[i], seq.seq_id)

    def slot(self, seq: Sequence, position: int, group: int = 0) -> int:
        """Flat KV-pool slot of a token position in a layer group's table."""
        table = seq.block_table if group == 0 else seq.group_block_tables[group - 1]
        bid = table[position // self.block_size]
        if bid == NULL_BLOCK:
            raise ValueError(f"seq {seq.seq_id}: position {position} of group {group} was released")
        return bid * self.block_size + position % self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (e.g. after weights change). Counters are kept.

        In-flight blocks stay indexed: they belong to live sequences and are registered (with
        whatever K/V those sequences compute) once computed, as usual.
        """
        self.pool.reset_prefix_cache()

    # ---- testing aid ------------------------------------------------------------------
    def needed_positions(self, group: int, basis: int, n: int) -> list[int]:
        """Positions < n whose K/V group `group` must still hold when the next query comes at
        `basis` or later: all in a full group; the sinks and the last window - 1 positions
        before `basis` in a sliding one."""
        w = self.group_windows[group]
        if w is None:
            return list(range(n))
        return sorted(set(range(min(self.sink_tokens, n))) | set(range(max(0, basis - w + 1), n)))

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the bookkeeping is consistent with the given live sequences' block tables."""
        seqs = list(seqs)  # walked several times
        holders: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for s in seqs:
            self._check_tables(s)
            for g, table in enumerate(s.block_tables):
                for bid in table:
                    if bid == NULL_BLOCK:
                        continue
                    assert 0 <= bid < self.num_blocks, f"seq {s.seq_id}: block id {bid} out of range"
                    assert group_of.setdefault(bid, g) == g, f"block {bid} is in tables of two layer groups"
                    holders[bid] = holders.get(bid, 0) + 1
        for b in self.blocks:
            n = holders.get(b.block_id, 0)
            assert b.ref_count == n, f"block {b.block_id}: ref count {b.ref_count} but {n} holders"
        # Free lists vs ref counts (so vs holders), free lists vs hashes, registry both ways.
        self.pool.check_invariants()
        for b in self.blocks:
            if b.hash is None:
                continue
            assert b.parent_hash is not None and hash_block(b.parent_hash, b.token_ids, b.extra_keys) == b.hash, (
                f"block {b.block_id}: stored tokens differ from those it was registered with"
            )
            assert group_of.get(b.block_id, b.group) == b.group, (
                f"block {b.block_id} is registered in group {b.group} but held by another"
            )
        self._check_contents(seqs)
        self._check_inflight(seqs)
        if self.state_slots is not None:
            self.state_slots.check_invariants(seqs)

    def _check_tables(self, s: Sequence) -> None:
        """Shapes of one sequence's tables: one per group (or none), equal lengths, distinct
        blocks, NULL entries only as a sliding group's leading run outside the window."""
        tables = s.block_tables
        if not any(tables):
            assert not s.group_block_tables or len(tables) == self.num_groups, f"seq {s.seq_id}: stray tables"
            return
        assert len(tables) == self.num_groups, f"seq {s.seq_id} has {len(tables)} tables for {self.num_groups} groups"
        assert len({len(t) for t in tables}) == 1, f"seq {s.seq_id}: tables of different lengths"
        assert len(s.block_table) * self.block_size >= s.num_computed_tokens, (
            f"seq {s.seq_id}: {s.num_computed_tokens} computed tokens but {len(s.block_table)} blocks"
        )
        st = self._seqs.get(s.seq_id)
        for g, table in enumerate(tables):
            real = [b for b in table if b != NULL_BLOCK]
            assert len(set(real)) == len(real), f"seq {s.seq_id} repeats a block"
            nulls = len(table) - len(real)
            w = self.group_windows[g]
            if nulls == 0:
                continue
            assert w is not None, f"seq {s.seq_id}: a full-attention group released a block"
            lo = self.sink_blocks
            assert all(b == NULL_BLOCK for b in table[lo:lo + nulls]), (
                f"seq {s.seq_id}: released blocks are not one run after the sink blocks")
            assert st is not None and st.released.get(g, 0) == lo + nulls, f"seq {s.seq_id}: release count is off"
            assert lo + nulls <= self.first_needed_block(_num_registrable(s), w), (
                f"seq {s.seq_id}: group {g} released a block its window still needs"
            )

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
                h, extra = _ROOT_HASH, s.cache_salt
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
            for table in s.block_tables:
                for i in range(min(s.num_computed_tokens // self.block_size, len(table))):
                    if table[i] == NULL_BLOCK:
                        continue
                    b = self.blocks[table[i]]
                    if b.hash is not None:
                        assert b.token_ids == self._block_tokens(s, i), (
                            f"seq {s.seq_id} block {i} (physical {b.block_id}) holds other tokens"
                        )
