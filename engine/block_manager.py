"""KV blocks and state slots, one owner each (mirrors DeepInfer's csrc/engine/block_manager.hpp; ARCHITECTURE.md §4).

A KV block holds 128 token positions of every
kv-source layer's compressed entries and index keys (`BlockManager`); a state slot holds one sequence's
window rings, compressor tails and Engram history (`StateManager`). Each id has exactly one owner. The
scheduler frees both together, always: preemption, finish and cancellation call `free` on both.
"""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence
from engine.tracer import NullTracer


class _Pool:
    """Ids 0..n-1 with one owner each; freed ids are reused first in, first out."""

    def __init__(self, n: int):
        self.free_ids = deque(range(n))
        self.owner: list[int | None] = [None] * n

    def take(self, seq_id: int, n: int) -> list[int]:
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            assert self.owner[i] is None, f"id {i} already owned by {self.owner[i]}"
            self.owner[i] = seq_id
        return ids

    def give_back(self, seq_id: int, ids: list[int]) -> None:
        for i in ids:
            assert self.owner[i] == seq_id, f"id {i} is owned by {self.owner[i]}, not {seq_id}"
            self.owner[i] = None
            self.free_ids.append(i)


class BlockManager:
    """KV blocks. Invariant: a sequence that has computed positions [0, n) owns ceil(n / 128) blocks,
    block_table[j] holding positions [128j, 128j + 128); so a step that writes position p needs a new
    block exactly when p is a multiple of 128 and p // 128 == len(block_table)."""

    def __init__(self, num_blocks: int, tracer=None):
        self.pool, self.tracer = _Pool(num_blocks), tracer or NullTracer()

    @property
    def num_free(self) -> int:
        return len(self.pool.free_ids)

    def can_allocate(self, seq: Sequence, num_positions: int) -> bool:
        return seq.blocks_needed(num_positions) <= self.num_free

    def allocate(self, seq: Sequence, num_positions: int) -> None:
        """Grow the block table to cover positions [0, num_positions)."""
        need = seq.blocks_needed(num_positions)
        if need:  # a decode row needs a new block once every 128 steps
            new = self.pool.take(seq.seq_id, need)
            seq.block_table += new
            self.tracer.block_alloc(seq.seq_id, new)

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.give_back(seq.seq_id, seq.block_table)
            self.tracer.block_free(seq.seq_id, seq.block_table)
            seq.block_table = []


class StateManager:
    """State slots: one per sequence from its first scheduled token until it is released."""

    def __init__(self, num_slots: int, tracer=None):
        self.pool, self.tracer = _Pool(num_slots), tracer or NullTracer()

    @property
    def num_free(self) -> int:
        return len(self.pool.free_ids)

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.state_slot is not None or self.num_free > 0

    def allocate(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            (seq.state_slot,) = self.pool.take(seq.seq_id, 1)
            self.tracer.slot_alloc(seq.seq_id, seq.state_slot)

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.pool.give_back(seq.seq_id, [seq.state_slot])
            self.tracer.slot_free(seq.seq_id, seq.state_slot)
            seq.state_slot = None
