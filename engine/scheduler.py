"""The scheduler (mirrors DeepInfer's csrc/engine/scheduler.hpp): which sequences run next, and the step's input.

As nano-vllm's engine/scheduler.py. `schedule()` returns a
`ScheduledBatch` value (promise 1 of ARCHITECTURE.md §2) and is the only place that changes the queues
before the device runs; `process()` applies a step's sampled tokens afterwards.

A step is a prefill step or a decode step, never both:
- prefill: FCFS over the waiting queue, stopping at the first prompt whose next chunk does not fit (no
  skipping ahead). `max_num_batched_tokens` limits query tokens; a prompt longer than the budget is
  split into chunks over several steps and only its last chunk samples. A preempted sequence comes back
  through here and recomputes its prompt and outputs.
- decode: every running sequence advances one token. When no KV block is left for a row, the running
  sequence with the longest output is preempted to the head of the waiting queue (epoch + 1).
- A partly prefilled prompt waits with its blocks and slot. Those are reclaimed first (it is preempted
  in place: epoch + 1, its chunks recomputed later) when decode needs a block, or when a prompt ahead
  of it in the queue does not fit. Otherwise a prompt started behind the head could hold the blocks
  the head needs while the head waits for it: a deadlock (ZOS off) or a preemption livelock (ZOS on).
Under ZOS, step N is scheduled before step N-1's tokens are known: decisions use only the reservations
(`num_cached_tokens`, `num_inflight`), and a decode row whose input token is still in flight takes it
on the device from the previous step's output (`input_token_id is None`: remap by state slot).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager, StateManager
from engine.sequence import Sequence, SequenceStatus
from engine.step import ScheduledBatch, ScheduledRow, digest_text
from engine.tracer import NullTracer

# The version of the scheduling rules, written in a trace's header (engine map) so that a replay by other
# rules says so. 1: a prefill step counted a finished prompt twice against max_num_seqs (it admitted about
# half); 2: each sequence once (traces recorded from 2026-11-29 on).
SCHEDULER_VERSION = 2


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 256
    num_state_slots: int = 64
    eos_token_id: int | None = 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, tracer=None):
        self.config, self.tracer = config, tracer or NullTracer()
        self.blocks = BlockManager(config.num_kv_blocks, self.tracer)
        self.states = StateManager(config.num_state_slots, self.tracer)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self.step = 0
        self._preempted: list[int] = []  # every sequence preempted while scheduling the current step
        self._digest_rows: dict[int, tuple[tuple, str]] = {}  # seq_id -> (epoch, slot, block count), repr of its row

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def digest(self) -> str:
        """`tables_digest` (engine/step.py) of every unfinished sequence's epoch, state slot and block table, the
        same text hashed, with each row's repr kept from the last digest while its (epoch, slot, block count)
        holds: within an epoch a block table only grows (blocks are freed only by preemption, which bumps the
        epoch, and by finishing), so its length names its contents. The reprs were most of the cost of a step's
        digest."""
        rows = {}
        for seq in self.seqs.values():
            key = (seq.epoch, seq.state_slot, len(seq.block_table))
            kept = self._digest_rows.get(seq.seq_id)
            if not kept or kept[0] != key:
                kept = key, repr((seq.seq_id, seq.epoch, seq.state_slot, tuple(seq.block_table)))
            rows[seq.seq_id] = kept
        self._digest_rows = rows
        return digest_text("[" + ", ".join(text for _, (_, text) in sorted(rows.items())) + "]")  # repr of the list

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run (all done, or waiting on results)."""
        self._preempted = []
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None and self._preempted:  # a step that only took resources back
            batch = ScheduledBatch(self.step, "decode", [])
        if batch is not None:
            batch.preempted = list(self._preempted)
            self.tracer.schedule(batch)
            self.step += 1
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        rows, budget, partial = [], self.config.max_num_batched_tokens, 0  # partial: rows whose prompt goes on
        for seq in list(self.waiting):  # a finished prompt moves to running below: count each seq once
            if budget == 0 or len(self.running) + partial >= self.config.max_num_seqs:
                break
            chunk = min(len(seq) - seq.num_cached_tokens, budget)
            end = seq.num_cached_tokens + chunk
            fits = lambda: self.blocks.can_allocate(seq, end) and self.states.can_allocate(seq)  # noqa: E731
            while not fits() and self._reclaim_partial(behind=seq):
                pass
            if not fits():
                break  # FCFS: a head-of-line prompt that does not fit blocks the ones behind it
            rows.append(self._reserve(seq, seq.token_ids[seq.num_cached_tokens:end]))
            budget -= chunk
            if seq.num_cached_tokens == len(seq):  # its last chunk: it samples and starts running
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:
                partial += 1
        return ScheduledBatch(self.step, "prefill", rows) if rows else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        rows = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or not self._wants_token(seq):
                continue
            length = seq.get_len()  # preempting another sequence below leaves this one's length as it is
            assert seq.num_cached_tokens == length - 1, "decode needs every earlier token cached"
            while not self.blocks.can_allocate(seq, length):
                if self._reclaim_partial():
                    continue
                victim = max(self.running, key=lambda s: (s.get_len() - s.num_prompt_tokens, s.seq_id))
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                last = seq.token_ids[-1] if seq.num_inflight == 0 else None  # None: in flight, remap
                rows.append(self._reserve(seq, [last]))
        if self._preempted:  # a later preemption may hit an earlier row
            rows = [r for r in rows if r.seq_id not in self._preempted]
        return ScheduledBatch(self.step, "decode", rows) if rows else None

    def _wants_token(self, seq: Sequence) -> bool:
        """Not yet at max_tokens, counting the tokens in flight (they may all be kept)."""
        return seq.num_output_tokens + seq.num_inflight < seq.params.max_tokens

    def _reserve(self, seq: Sequence, token_ids: list[int | None]) -> ScheduledRow:
        """Allocate what the chunk writes, advance the cached count, reserve the sampled token."""
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + len(token_ids)
        self.states.allocate(seq)
        self.blocks.allocate(seq, end)
        seq.num_cached_tokens = end
        length = seq.get_len()
        sample = end == length
        output_position = length - seq.num_prompt_tokens  # the output token this row draws
        if sample:
            seq.num_inflight += 1  # reservation: the token is appended when this step is processed
            self.tracer.reservation(self.step, seq.seq_id, seq.epoch, output_position)
        return ScheduledRow(seq.seq_id, seq.epoch, start, token_ids, list(seq.block_table), seq.state_slot,
                            sample, seq.seed, seq.params.temperature, output_position)

    # ---- preemption and cancellation ----------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """Both kinds of state, always together (ARCHITECTURE.md §4)."""
        self.blocks.free(seq)
        self.states.free(seq)

    def _reclaim_partial(self, behind: Sequence | None = None) -> bool:
        """Preempt, in place, the latest-arrived partly prefilled waiting prompt (one that owns blocks
        or a slot), behind `behind` in the queue if given. False if there is none."""
        queue = list(self.waiting)
        candidates = queue[queue.index(behind) + 1:] if behind is not None else queue
        victim = next((s for s in reversed(candidates) if s.block_table or s.state_slot is not None), None)
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def _preempt(self, seq: Sequence) -> None:
        """Take the sequence's resources back; its in-flight results become stale (epoch + 1) and it
        recomputes its prompt and outputs in a later prefill. A running sequence is requeued at the
        head of the waiting queue, a partly prefilled one keeps its place."""
        self._release(seq)
        seq.num_cached_tokens, seq.num_inflight = 0, 0
        seq.epoch += 1
        self._preempted.append(seq.seq_id)
        if seq.status == SequenceStatus.RUNNING:
            seq.status = SequenceStatus.WAITING
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self.tracer.preempt(self.step, seq.seq_id)
        self.tracer.epoch_bump(seq.seq_id, seq.epoch, "preempt")

    def abort(self, seq_id: int, cause: str = "abort") -> Sequence | None:
        """Cancel a request (`cause`: "abort", "disconnect" or "shutdown"): a terminal state. Its in-flight results are discarded as stale; the device
        may still be writing its blocks, but runs steps in order, so a new owner's later step writes
        after it."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return None
        seq.epoch += 1
        self.tracer.cancel(self.step, seq_id, cause)
        self.tracer.epoch_bump(seq_id, seq.epoch, "cancel")
        (self.waiting if seq.status == SequenceStatus.WAITING else self.running).remove(seq)
        self._finish(seq, "abort")
        return seq

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason, seq.num_inflight = SequenceStatus.FINISHED, reason, 0
        self._release(seq)
        del self.seqs[seq.seq_id]
        self.tracer.finish(self.step, seq.seq_id, reason)

    # ---- process ------------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, tokens: list[int | None]) -> list[Sequence]:
        """Apply a step's sampled tokens (one per row, None for rows that did not sample). A token whose
        sequence was preempted or cancelled since (stale epoch), or has finished since (a stop token
        found one step late under ZOS), is discarded. Returns the sequences that finished."""
        finished = []
        for row, token in zip(batch.rows, tokens):
            if not row.sample:
                continue
            seq = self.seqs.get(row.seq_id)
            position = row.start + len(row.token_ids)
            if seq is None or seq.epoch != row.epoch:
                self.tracer.token(batch.step, row.seq_id, row.epoch, position, token, False)
                continue
            seq.num_inflight -= 1
            seq.token_ids.append(token)
            self.tracer.token(batch.step, row.seq_id, row.epoch, position, token, True)
            reason = self._stop_reason(seq, token)
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.config.eos_token_id):
            return "stop"
        return "length" if seq.num_output_tokens >= p.max_tokens else None
