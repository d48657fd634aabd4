"""The replica router: plain Python, no Ray. Invariants under random histories (hypothesis), and
the router's block hashes against the block manager's own prefix-cache hits (the oracle)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.block_manager import BlockManager
from kvserve.engine.input_processor import new_sequences
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence
from kvserve.server.replicas.router import (
    BlockIndex,
    NoReplicaError,
    Router,
    RouterConfig,
    block_hashes,
    salt_keys,
)

BS = 4


@dataclass
class _Params:  # what Sequence reads of SamplingParams in the block manager
    n: int = 1
    max_tokens: int = 16


def _seq(sid: int, ids: list[int], salt: str | None = None) -> Sequence:
    s = Sequence(sid, f"r{sid}", list(ids), _Params(), 0.0)
    s.cache_salt = salt_keys(salt)
    return s


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Prefill the whole prompt, register its blocks, free the sequence (blocks stay cached)."""
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    bm.free(seq)


# ------------------------------------------------------------------ the hashes are the engine's
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=6),
       query=st.lists(st.integers(0, 3), min_size=1, max_size=24), salt=st.sampled_from([None, "a"]))
@settings(max_examples=150, deadline=None)
def test_prefix_match_equals_the_block_managers_hit(prompts, query, salt):
    """Route every prompt to the one replica and compute it in a real block manager with room for
    all: the router's match for a new prompt is exactly what the prefix cache then supplies."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    router = Router(1, RouterConfig(block_size=BS, cache_threshold=0.0))
    for i, ids in enumerate(prompts):
        router.pick(ids, salt_keys(salt))
        _compute(bm, _seq(i, ids, salt))
    q = _seq(99, query, salt)
    hashes = block_hashes(query, BS, salt_keys(salt))
    # The engine never takes the prompt's last token from the cache (it needs its logits).
    usable = min(router.indexes[0].match(hashes), (len(query) - 1) // BS)
    assert usable * BS == bm.num_cached_tokens(q)


def test_salt_keys_are_the_engines():
    seqs = new_sequences(iter(range(1)), "r", [1, 2, 3], SamplingParams(max_tokens=1), 0.0, "tenant", "cpu")
    assert seqs[0].cache_salt == salt_keys("tenant")
    assert salt_keys(None) == ()


def test_a_salted_prompt_matches_only_its_salt():
    router = Router(2, RouterConfig(block_size=BS))
    ids = list(range(4 * BS))
    first = router.pick(ids, salt_keys("a")).replica
    router.finished(first)
    assert router.pick(ids, salt_keys("a")).reason == "prefix"
    assert router.pick(ids, salt_keys("b")).reason == "least_loaded"


# ------------------------------------------------------------------ invariants on random histories
_OPS = st.lists(st.one_of(
    st.tuples(st.just("pick"), st.integers(0, 5), st.integers(0, 40)),  # prefix id, suffix length
    st.tuples(st.just("finish"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("dead"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("alive"), st.integers(0, 3), st.just(0)),
), max_size=80)


def _prompt(prefix: int, suffix: int, k: int) -> list[int]:
    return [prefix] * (3 * BS) + [1000 + k] * suffix


def _run(policy: str, n: int, ops, cap: int, check: bool) -> list:
    cfg = RouterConfig(policy=policy, block_size=BS, balance_abs_threshold=2, balance_rel_threshold=1.5, seed=7)
    router = Router(n, cfg, capacities=[cap] * n)
    sent: list[int] = []  # replicas of outstanding requests
    trace = []
    for k, (op, a, b) in enumerate(ops):
        if op == "pick":
            ids = _prompt(a, b, k)
            live = [r for r in range(n) if router.alive[r]]
            before = list(router.load)
            matches = {r: router.indexes[r].match(block_hashes(ids, BS)) for r in live}
            try:
                d = router.pick(ids)
            except NoReplicaError:
                assert not live
                trace.append(None)
                continue
            if check:
                assert d.replica in live, "routed to a dead replica"
                assert router.load[d.replica] == before[d.replica] + 1
                if policy == "prefix":
                    lo = min(before[r] for r in live)
                    hi = max(before[r] for r in live)
                    if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
                        assert before[d.replica] == lo, "the load guard did not pick the least loaded"
                        assert d.reason == "unbalanced"
                    elif d.reason == "prefix":
                        assert matches[d.replica] == max(matches.values()) == d.matched_blocks
                        assert d.matched_blocks >= cfg.cache_threshold * len(block_hashes(ids, BS))
                    else:
                        assert before[d.replica] == lo
                for idx in router.indexes:
                    assert len(idx) <= cap, "the index outgrew its bound"
            sent.append(d.replica)
            trace.append((d.replica, d.reason))
        elif op == "finish" and sent:
            router.finished(sent.pop(a % len(sent)))
        elif op == "dead" and a < n:
            router.mark_dead(a)
            assert len(router.indexes[a]) == 0
        elif op == "alive" and a < n:
            router.mark_alive(a)
    if check:
        assert sum(router.load) == len(sent)
    return trace


@pytest.mark.parametrize("policy", ["prefix", "round_robin", "pow2"])
@given(ops=_OPS, n=st.integers(1, 4), cap=st.integers(1, 30))
@settings(max_examples=60, deadline=None)
def test_router_invariants(policy, ops, n, cap):
    """Never a dead replica; the load guard holds; the index stays bounded; a prefix decision is
    the longest match; the same history gives the same decisions."""
    first = _run(policy, n, ops, cap, check=True)
    assert _run(policy, n, ops, cap, check=False) == first


# ------------------------------------------------------------------ behaviour
def test_prefix_affinity_and_spread():
    """Eight prefixes, requests in random order: each prefix sticks to one replica, and the
    prefixes spread over both."""
    router = Router(2, RouterConfig(block_size=BS))
    rng = random.Random(0)
    home: dict[int, set[int]] = {}
    for k in range(64):
        p = rng.randrange(8)
        d = router.pick(_prompt(p, 5, k))
        router.finished(d.replica)
        home.setdefault(p, set()).add(d.replica)
    assert all(len(h) == 1 for h in home.values())
    assert min(router.num_routed) >= 16


def test_a_burst_of_one_prefix_spills_once_unbalanced():
    router = Router(2, RouterConfig(block_size=BS, balance_abs_threshold=4, balance_rel_threshold=1.5))
    picks = [router.pick(_prompt(0, 3, k)).replica for k in range(40)]
    assert min(picks.count(0), picks.count(1)) >= 40 * 0.25
    assert abs(router.load[0] - router.load[1]) <= 5


def test_round_robin_and_pow2_skip_dead_replicas():
    for policy in ("round_robin", "pow2"):
        router = Router(3, RouterConfig(policy=policy))
        router.mark_dead(1)
        assert {router.pick([1, 2, 3]).replica for _ in range(30)} == {0, 2}
        router.mark_dead(0)
        router.mark_dead(2)
        with pytest.raises(NoReplicaError):
            router.pick([1])


def test_round_robin_alternates():
    router = Router(2, RouterConfig(policy="round_robin"))
    assert [router.pick([1]).replica for _ in range(4)] == [0, 1, 0, 1]


def test_lru_forgets_tails_first():
    idx = BlockIndex(capacity=3)
    idx.add([b"a", b"b", b"c", b"d"])  # a prompt of four blocks in a pool of three
    assert idx.match([b"a", b"b", b"c", b"d"]) == 3
    assert b"d" not in idx


@pytest.mark.parametrize("field,value", [("policy", "random"), ("block_size", 0), ("cache_threshold", 1.5),
                                         ("balance_abs_threshold", -1), ("balance_rel_threshold", 0.5)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        RouterConfig(**{field: value})
