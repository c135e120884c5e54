"""Scheduler replay: a recorded run's scheduling decisions, re-made by a fresh Scheduler with no model
(ARCHITECTURE.md §6, "Scheduler replay needs no model"; `mdi-trace check TRACE --scheduler`).

No DeepInfer file does this. The recorded inputs of the scheduler are fed back in log order, exactly where
the engine's step contract (engine/llm_engine.py) applied them:

- `request_added`: a new Sequence with the recorded prompt, sampling params and seed (`Scheduler.add`);
- `cancel`: `Scheduler.abort`, at the start of the step, before its schedule;
- `schedule`: `Scheduler.schedule()`, whose batch is compared with the recorded one field by field (batch
  kind, every row's ROW_FIELDS, preempted);
- `token` ... `step_digest`: the recorded token ids of one step are collected, and at that step's digest
  (written right after the engine processed it: under ZOS one step late) `Scheduler.process(batch, tokens)`
  runs and the resource tables of the unfinished sequences are compared with the recorded digest.

The first mismatch stops the replay (after it the two runs hold different state). A log cut short is
replayed up to its last complete event. Imports no torch: engine/scheduler.py and engine/sequence.py need
none, and engine/__init__.py loads LLM lazily.

    from tracing.reader import open_trace
    from tracing.replay import replay_scheduler
    result = replay_scheduler(open_trace("run.mdt"))
    print(result.mismatch or f"{result.steps} steps match")
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine import scheduler, sequence
from model.config import BLOCK_SIZE

from tracing.reader import Cut, TraceError, TraceFile
from tracing.schema import BATCH_KINDS, CANCEL_CAUSES, ROW_FIELDS, Event


@dataclass(slots=True)
class Mismatch:
    """The first place where the replayed scheduler and the log disagree."""
    step: int
    seq_id: int | None       # the request, None for a step-wide field (batch_kind, rows, preempted, digest)
    field: str
    expected: object         # what the log recorded
    got: object              # what the replayed scheduler did
    offset: int              # byte offset of the event compared

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", request {self.seq_id}" if self.seq_id is not None else "")
        return f"{where}: {self.field} expected {self.expected!r}, got {self.got!r}"


@dataclass(slots=True)
class ReplayResult:
    steps: int = 0           # schedule events compared
    rows: int = 0            # rows compared
    digests: int = 0         # step digests compared
    tokens: int = 0          # recorded tokens fed to process()
    cancellations: int = 0
    mismatch: Mismatch | None = None
    cut: Cut | None = None   # the log was cut short: replayed up to there
    note: str | None = None  # the trace was recorded by other scheduling rules (engine/scheduler.py)
    kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BATCH_KINDS, 0))


def replay_scheduler(trace: TraceFile) -> ReplayResult:
    """Replay `trace` through a fresh Scheduler up to its end or the first mismatch."""
    r = _Replay(trace.header)
    for event in trace.events():
        handler = getattr(r, "on_" + event.kind, None)
        if handler is not None:
            r.event = event
            try:
                handler(event)
            except (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError) as e:
                r.differ(None, event.kind, "an event the scheduler can take", f"{type(e).__name__}: {e}")
        if r.result.mismatch is not None:
            break
    r.result.cut = trace.cut
    version = (trace.header.get("engine") or {}).get("scheduler_version")
    if version is not None and version != scheduler.SCHEDULER_VERSION:
        r.result.note = (f"the trace was recorded by scheduler version {version} and is replayed by version "
                         f"{scheduler.SCHEDULER_VERSION} (engine/scheduler.py says what changed), so decisions "
                         f"may differ by design.")
    elif version is None and r.result.mismatch is not None:
        r.result.note = ("the trace's header has no scheduler_version: if it was recorded before 2026-11-29, "
                         "its prefill steps admitted about half of max_num_seqs (scheduler version 1), which "
                         "this scheduler (version 2) does not, so its decisions differ by design.")
    return r.result


class _Replay:
    def __init__(self, header: dict):
        self.Sequence, self.SamplingParams = sequence.Sequence, sequence.SamplingParams
        engine = header.get("engine") or {}
        block_size = engine.get("block_size", BLOCK_SIZE)
        if block_size != BLOCK_SIZE:
            raise TraceError(f"the trace was recorded with {block_size}-token KV blocks, this scheduler uses "
                             f"{BLOCK_SIZE}; replay it with the mini-DeepInfer that recorded it.")
        names = [f.name for f in dataclasses.fields(scheduler.SchedulerConfig)]
        missing = [n for n in names if n not in engine]
        if missing:
            raise TraceError(f"the trace's header lacks the engine config {', '.join(missing)}, so its scheduler "
                             "cannot be rebuilt.")
        self.scheduler = scheduler.Scheduler(scheduler.SchedulerConfig(**{n: engine[n] for n in names}))
        self.batches: dict = {}                       # step -> replayed ScheduledBatch not processed yet
        self.tokens: dict[int, dict[int, int]] = {}   # step -> seq_id -> recorded token, not processed yet
        self.result = ReplayResult()
        self.event: Event | None = None

    def differ(self, seq_id: int | None, name: str, expected, got, step: int | None = None) -> None:
        if self.result.mismatch is None:
            step = self.scheduler.step if step is None else step
            self.result.mismatch = Mismatch(step, seq_id, name, expected, got, self.event.offset)

    # ---- the recorded inputs ------------------------------------------------------------------------
    def on_request_added(self, e) -> None:
        params = self.SamplingParams(e.temperature, e.seed, e.max_tokens, e.ignore_eos, tuple(e.stop_token_ids))
        self.scheduler.add(self.Sequence(e.seq_id, list(e.prompt_token_ids), params, e.seed))

    def on_cancel(self, e) -> None:
        step, s = e.step, e.seq_id
        if step != self.scheduler.step:
            return self.differ(s, "cancel step", step, self.scheduler.step, step)
        cause = CANCEL_CAUSES[e.cause] if 0 <= e.cause < len(CANCEL_CAUSES) else "abort"  # verify names a bad one
        if self.scheduler.abort(s, cause) is None:  # the engine writes a cancel only for a live request
            return self.differ(s, "cancel", "a live request", "no unfinished request", step)
        self.result.cancellations += 1

    def on_token(self, e) -> None:
        step, s, token_id = e.step, e.seq_id, e.token_id
        batch = self.batches.get(step)
        if batch is None or not any(r.seq_id == s and r.sample for r in batch.rows):
            return self.differ(s, "token", f"a sampled row of step {step}", "none", step)
        self.tokens.setdefault(step, {})[s] = token_id

    def on_step_digest(self, e) -> None:
        """The engine processed `step` just before writing its digest: process it here too, then compare."""
        step, digest = e.step, e.digest
        batch = self.batches.pop(step, None)
        if batch is None:
            return self.differ(None, "step_digest", f"step {step} scheduled and not yet processed", "none", step)
        tokens = self.tokens.pop(step, {})
        self.scheduler.process(batch, [tokens.get(r.seq_id) if r.sample else None for r in batch.rows])
        self.result.tokens += len(tokens)
        got = self.scheduler.digest()
        if got != digest:
            return self.differ(None, "digest", digest, got, step)
        self.result.digests += 1

    # ---- the decision compared ---------------------------------------------------------------------------
    def on_schedule(self, e) -> None:
        step, kind, rows, preempted = e.step, BATCH_KINDS[e.batch_kind], e.rows, e.preempted
        batch = self.scheduler.schedule()
        if batch is None:
            return self.differ(None, "batch", f"a {kind} batch", "none (nothing to schedule)", step)
        if batch.step != step:
            return self.differ(None, "step", step, batch.step, step)
        if batch.batch_kind != kind:
            return self.differ(None, "batch_kind", kind, batch.batch_kind, step)
        want, got = [row.seq_id for row in rows], [row.seq_id for row in batch.rows]
        if want != got:
            odd = [s for s in want if s not in got] + [s for s in got if s not in want]  # missing, then extra
            s = odd[0] if odd else next(a for a, b in zip(want, got) if a != b)
            return self.differ(s, "rows (requests)", want, got, step)
        for recorded, row in zip(rows, batch.rows):
            for name in ROW_FIELDS:
                mine, value = getattr(row, name), getattr(recorded, name)
                if (list(mine) if isinstance(mine, list) else mine) != value:
                    return self.differ(row.seq_id, name, value, mine, step)
        if list(batch.preempted) != list(preempted):
            return self.differ(None, "preempted", list(preempted), list(batch.preempted), step)
        if batch.rows:  # a batch without rows (it only took resources back) is never executed nor processed
            self.batches[step] = batch
        self.result.steps += 1
        self.result.rows += len(rows)
        self.result.kinds[batch.batch_kind] += 1
