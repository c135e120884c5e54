"""The step record: the batch DeepInfer's csrc/engine/scheduler.hpp hands deepinfer/worker/worker.py.

One step's explicit input (ScheduledBatch), its packed device layout, and its digest. A leaf module
(no torch, no other engine module): the scheduler builds a `ScheduledBatch` (promise 1 of ARCHITECTURE.md §2),
the model runner packs it with `pack` and reads it back on the device with `split`, and the recorder, scheduler
replay, verify and check read and rebuild the same values. One form of a step, one layout, one digest.

The packed layout, one int64 row per batch row (padded to a CUDA graph's batch size with `padding_row`):

    [ COLUMNS (7) | S input ids | nb block table entries ]

COLUMNS: remap (1 where the input token is in flight: the device takes next_tokens[state_slot]), start,
num_tokens, state_slot, sample, seed, output_position. The S input ids are 0 where padding or in flight; the
block table is padded with the trash block.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

COLUMNS = ("remap", "start", "num_tokens", "state_slot", "sample", "seed", "output_position")
NCOL = len(COLUMNS)


@dataclass(slots=True)
class ScheduledRow:
    """One row of a step: a chunk [start, start + num_tokens) of one sequence."""
    seq_id: int
    epoch: int
    start: int                        # position of the first token
    token_ids: list[int | None]       # inputs; None = in flight, gathered on the device from the slot
    block_table: list[int]
    state_slot: int
    sample: bool                      # the last chunk of a prefill, or a decode row
    seed: int
    temperature: float
    output_position: int              # which output token a sampled row draws (keys the sampler)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ScheduledBatch:
    """The explicit input of one step: everything the model runner and a replay need."""
    step: int
    batch_kind: str                    # "prefill" or "decode": a step is one or the other, never both
    rows: list[ScheduledRow]
    preempted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


def padding_row(S: int, nb: int, trash_block: int, trash_slot: int) -> list[int]:
    """A row that pads a CUDA-graph batch: one token at position 1 into the trash slot and trash blocks,
    never sampled."""
    return [0, 1, 1, trash_slot, 0, 0, 0] + [0] * S + [trash_block] * nb


def pack(batch: ScheduledBatch, S: int, nb: int, size: int, trash_block: int, trash_slot: int) -> np.ndarray:
    """The batch's rows in the packed layout above: [size, NCOL + S + nb] int64; rows past the batch's own
    are `padding_row`s."""
    trash = [trash_block] * nb
    table = []  # the rows one after the other in one flat Python list, one numpy conversion: ~0.5 µs a row
    for r in batch.rows:
        tokens = r.token_ids
        ids = [tokens[0] or 0] if S == 1 else [t or 0 for t in tokens] + [0] * (S - len(tokens))
        table += (tokens[0] is None, r.start, len(tokens), r.state_slot, r.sample, r.seed, r.output_position,
                  *ids, *(r.block_table + trash)[:nb])
    table += padding_row(S, nb, trash_block, trash_slot) * (size - len(batch.rows))
    return np.array(table, dtype=np.int64).reshape(size, NCOL + S + nb)


def split(ints, S: int):
    """The packed rows' parts: (columns [NCOL, B] in COLUMNS order, input ids [B, S], block tables [B, nb])."""
    return ints[:, :NCOL].T, ints[:, NCOL:NCOL + S], ints[:, NCOL + S:]


def digest_text(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def tables_digest(rows) -> str:
    """The per-step digest of the resource tables: rows of (seq_id, epoch, state_slot, block_table), one per
    unfinished sequence. Written by the engine (Scheduler.digest, incrementally), recomputed by verify and by
    scheduler replay."""
    rows = sorted((s, e, slot, tuple(blocks)) for s, e, slot, blocks in rows)
    return digest_text(repr(rows))
