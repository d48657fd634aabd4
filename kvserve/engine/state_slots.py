"""The books of a hybrid model's recurrent state pool: which sequence holds which state slot.

Pure Python (no torch), beside the page books of `block_pool.BlockPool`: the model runner owns
the state tensors (kvserve/model/state_cache.py) and performs the copies asked for here.

A sequence takes one slot when it is first allocated (admission, or re-admission after
preemption: preemption is by recompute, so the state is rebuilt from the prompt) and gives it
back when it is freed (finish, abort, preemption). A request of n > 1 samples runs only sample 0
until its prompt is computed, then forks the others from it: each fork needs a slot holding a copy
of the parent's state. Those n - 1 slots are reserved when sample 0 takes its own, so a fork can
never find the pool empty (pages are shared by a fork; a state cannot be).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from kvserve.sequence import Sequence


def forks_to_come(seq: Sequence) -> int:
    """Samples that will fork from `seq`: n - 1 for sample 0 of a request that has not yet
    sampled (the engine forks right after the prompt's last chunk), else 0."""
    n = getattr(seq.params, "n", 1) or 1
    return n - 1 if seq.index == 0 and not seq.output_token_ids else 0


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._reserved: dict[int, int] = {}  # seq_id -> slots kept for its forks to come
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        """Slots neither held nor reserved for a fork."""
        return len(self._free) - sum(self._reserved.values())

    def needed(self, seq: Sequence) -> int:
        """Slots that allocating `seq` takes: none if it holds one, else its own and its forks'."""
        return 0 if seq.state_slot is not None else 1 + forks_to_come(seq)

    def allocate(self, seq: Sequence) -> None:
        need = self.needed(seq)
        if need == 0:
            return
        if need > self.num_free:
            raise RuntimeError(f"need {need} free state slots, have {self.num_free}")
        seq.state_slot = self._free.pop()
        if need > 1:
            self._reserved[seq.seq_id] = need - 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child takes a slot (one of the parent's reserved ones when left) holding a copy of the
        parent's state, copied before the next forward pass (`take_copies`)."""
        if parent.state_slot is None:
            raise ValueError(f"fork: parent seq {parent.seq_id} holds no state slot")
        if child.state_slot is not None:
            raise ValueError(f"fork: child seq {child.seq_id} already holds state slot {child.state_slot}")
        reserved = self._reserved.get(parent.seq_id, 0)
        if reserved:
            self._reserved[parent.seq_id] = reserved - 1
            if reserved == 1:
                del self._reserved[parent.seq_id]
        elif self.num_free < 1:
            raise RuntimeError("fork: no free state slot")
        child.state_slot = self._free.pop()
        self._pending_copies.append((parent.state_slot, child.state_slot))

    def free(self, seq: Sequence) -> None:
        """Give back seq's slot and its reservations. Safe to call twice."""
        self._reserved.pop(seq.seq_id, None)
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) slot copies recorded by `fork` since the last call (then cleared)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Every slot is free or held by exactly one live sequence; reservations belong to live ones."""
        held = [s.state_slot for s in seqs if s.state_slot is not None]
        assert len(set(held)) == len(held), f"a state slot is held twice: {sorted(held)}"
        assert len(set(self._free)) == len(self._free), "a state slot is free twice"
        assert not set(held) & set(self._free), "a held state slot is also free"
        assert len(held) + len(self._free) == self.num_slots, (
            f"{len(held)} held + {len(self._free)} free state slots of {self.num_slots}: a slot leaked")
        assert self.num_free >= 0, "more state slots reserved than free"
