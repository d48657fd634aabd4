"""Which replica serves a request: prefix-aware, round-robin or power-of-two-choices routing.

Plain Python, no Ray: the replica set (kvserve/server/replicas/pool.py) asks `pick` for a replica,
tells `finished` when the request ends, and marks replicas dead or alive as it learns.

The prefix policy keeps, per replica, an approximate index of the KV blocks it holds: the chained
block hashes (kvserve's own `hash_block`, so the router's keys are the replica's keys) of every
prompt it was sent, in an LRU bounded by the replica's pool size, the way the replica's own cached
free list forgets the least recently used blocks. It never asks a replica what it holds; the index
only has to be right often enough to send a prompt where its prefix probably is (SGLang's router
keeps an approximate radix tree for the same reason). A request goes to the replica holding the
longest chain of its blocks, unless

* the match covers less than `cache_threshold` of the prompt's full blocks (a short shared
  preamble is not worth queueing behind a busy replica), or
* the load is unbalanced: max - min outstanding requests > `balance_abs_threshold` AND
  max > `balance_rel_threshold` x min (SGLang's two-threshold guard),

and then it goes to the least-loaded replica (ties: the one whose index is emptiest, then the
lowest index), which records the prompt's blocks from then on.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from kvserve.engine.block_manager import hash_block

POLICIES = ("prefix", "round_robin", "pow2")
ROOT_HASH = bytes(32)  # the parent of a sequence's first block, as in the block manager


class NoReplicaError(RuntimeError):
    """Every replica is dead (or there are none): nothing can take the request."""


def salt_keys(cache_salt: str | None) -> tuple:
    """The extra block-hash keys a request's cache salt becomes in the engine's sequences."""
    return () if cache_salt is None else ("salt", cache_salt)


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`, exactly as a replica's block manager
    computes them (`extra_keys`: ("salt", cache_salt) for a salted request)."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"
    block_size: int = 16
    cache_threshold: float = 0.5  # prefix: the least share of a prompt's blocks a match must cover
    balance_abs_threshold: int = 16  # prefix: unbalanced when max - min outstanding exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this times min
    max_blocks_per_replica: int = 65536  # the index's LRU bound when a replica's pool size is unknown
    seed: int = 0  # pow2's sampling

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy (--router) must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold (--router-cache-threshold) must be in [0, 1], "
                             f"got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold (--router-balance-abs-threshold) must be >= 0, "
                             f"got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold (--router-balance-rel-threshold) must be >= 1, "
                             f"got {self.balance_rel_threshold}")
        if self.max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be >= 1, got {self.max_blocks_per_replica}")


@dataclass
class BlockIndex:
    """The block hashes one replica is believed to hold, least recently used first."""

    capacity: int
    _lru: OrderedDict = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` held (a chain: a miss ends it)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[bytes]) -> None:
        """Record a prompt's blocks as just used. Last block first, so a prefix's first blocks are
        the most recent and the tails are forgotten first, as a pool evicts them."""
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


@dataclass
class Decision:
    replica: int
    matched_blocks: int  # blocks the chosen replica is believed to hold (0 when not by prefix)
    reason: str  # "prefix", "least_loaded", "unbalanced", "round_robin", "pow2"


class Router:
    """The routing state of one replica set. Not thread-safe: call it from one event loop."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None,
                 capacities: Sequence[int] | None = None):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.config = cfg = config or RouterConfig()
        caps = list(capacities) if capacities is not None else [cfg.max_blocks_per_replica] * num_replicas
        if len(caps) != num_replicas:
            raise ValueError(f"{len(caps)} capacities for {num_replicas} replicas")
        self.indexes = [BlockIndex(max(1, min(c, cfg.max_blocks_per_replica))) for c in caps]
        self.load = [0] * num_replicas  # outstanding requests sent and not finished
        self.alive = [True] * num_replicas
        self.num_routed = [0] * num_replicas
        self._next = 0  # round-robin cursor
        self._rng = random.Random(cfg.seed)

    @property
    def num_replicas(self) -> int:
        return len(self.load)

    # ---------------------------------------------------------------- health
    def mark_dead(self, replica: int) -> None:
        """No new request goes there; what it held is forgotten (a restart starts empty)."""
        self.alive[replica] = False
        self.indexes[replica].clear()

    def mark_alive(self, replica: int) -> None:
        self.alive[replica] = True

    def set_capacity(self, replica: int, num_blocks: int) -> None:
        index = self.indexes[replica]
        index.capacity = max(1, min(num_blocks, self.config.max_blocks_per_replica))
        index.add([])  # trims to the new bound

    # ---------------------------------------------------------------- routing
    def pick(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> Decision:
        """Choose a live replica for a prompt and count the request as outstanding there."""
        live = [r for r in range(self.num_replicas) if self.alive[r]]
        if not live:
            raise NoReplicaError("no replica is alive")
        policy = self.config.policy
        hashes: list[bytes] = []
        if policy == "round_robin":
            decision = Decision(self._round_robin(live), 0, "round_robin")
        elif policy == "pow2":
            decision = Decision(self._pow2(live), 0, "pow2")
        else:
            hashes = block_hashes(token_ids, self.config.block_size, extra_keys)
            decision = self._by_prefix(live, hashes)
        self.load[decision.replica] += 1
        self.num_routed[decision.replica] += 1
        if hashes:
            self.indexes[decision.replica].add(hashes)
        return decision

    def finished(self, replica: int) -> None:
        """The request sent to `replica` ended (any way)."""
        self.load[replica] = max(0, self.load[replica] - 1)

    def _round_robin(self, live: list[int]) -> int:
        for _ in range(self.num_replicas):
            r = self._next % self.num_replicas
            self._next += 1
            if self.alive[r]:
                return r
        return live[0]  # unreachable: `live` is not empty

    def _pow2(self, live: list[int]) -> int:
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if (self.load[a], a) <= (self.load[b], b) else b

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda r: (self.load[r], len(self.indexes[r]), r))

    def unbalanced(self, live: list[int]) -> bool:
        loads = [self.load[r] for r in live]
        hi, lo = max(loads), min(loads)
        cfg = self.config
        return hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo

    def _by_prefix(self, live: list[int], hashes: list[bytes]) -> Decision:
        if self.unbalanced(live):
            return Decision(self._least_loaded(live), 0, "unbalanced")
        best, matched = None, 0
        for r in live:
            m = self.indexes[r].match(hashes)
            if m > matched or (m == matched and m > 0 and best is not None
                               and (self.load[r], r) < (self.load[best], best)):
                best, matched = r, m
        if best is None or matched < self.config.cache_threshold * len(hashes):
            return Decision(self._least_loaded(live), 0, "least_loaded")
        return Decision(best, matched, "prefix")
