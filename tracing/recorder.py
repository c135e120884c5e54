"""The recorder: the engine's tracer (engine/tracer.py) writing a msgpack event log (tracing/SCHEMA.md).

    from engine import LLM
    from tracing import Recorder
    llm = LLM("tiny-68m", tracer=Recorder("run.mdt"))

Events are kept as lists during a step, then packed together (one C-level pass over the packer) and
written to the log's final path once per engine step (`step_end`), so a hook costs the engine's loop a
list and a counter, a run still going can be followed and a crash leaves every complete step readable. `close()` (called
by the engine's shutdown) writes the footer: event counts and the byte offset of every step's
`schedule` event, then a 9-byte trailer pointing at the footer, so readers seek instead of scanning.
The file is created at the first write (the first step, or `close()`), not before: an engine that fails
to start or a run whose requests are refused leaves no file, and `discard()` removes only a file this
recorder created. With `exclusive=True` an existing file is never replaced (FileExistsError).
Imports neither torch nor engine/: it reads the engine's objects by attribute.
"""
from __future__ import annotations

import datetime
import sys
import time
from collections import Counter
from operator import attrgetter, itemgetter
from pathlib import Path

import msgpack

from tracing.schema import BATCH_KINDS, CANCEL_CAUSES, EPOCH_REASONS, EVENTS, FINISH_REASONS, KIND, MAGIC, PHASES, ROW_FIELDS, \
    SCHEMA_VERSION, TRAILER_TAG

_now_ns = time.perf_counter_ns
_kind_of = itemgetter(0)
_row_fields = attrgetter(*ROW_FIELDS)  # a ScheduledRow's fields in the schema's order, read in C
_RESERVATION, _TOKEN = KIND["reservation"], KIND["token"]  # the hooks called once per row and step


class Recorder:
    enabled = True

    def __init__(self, path: str | Path, argv: list[str] | None = None, exclusive: bool = False):
        self.path = Path(path)
        self.exclusive = exclusive
        self.file = None                      # opened at the first write
        self.argv = list(sys.argv if argv is None else argv)
        self.packer = msgpack.Packer(use_bin_type=True)
        self.buf = bytearray()
        self.written = 0                      # bytes already in the file
        self.code_counts: Counter[int] = Counter()  # events per kind code, counted when packed
        self.step_offsets: list[list[int]] = []  # [step, byte offset of its schedule event]
        self.pending: list[list] = []            # this step's events, packed together at step_end
        self.pending_schedules: list[tuple[int, int]] = []  # (index in pending, step) of schedule events
        self.t0 = time.perf_counter_ns()
        self.started = self.closed = False

    def _emit(self, name: str, *fields) -> None:
        self.pending.append([KIND[name], *fields])

    @property
    def counts(self) -> Counter[str]:
        """Events per kind name, those of the step not packed yet included."""
        codes = self.code_counts + Counter(map(_kind_of, self.pending))
        return Counter({EVENTS[code][0]: n for code, n in codes.items()})

    def _pack_pending(self) -> None:
        """Pack the step's events into the buffer, one C-level pass per run of events between schedule
        events (whose byte offsets the footer's step index needs)."""
        pack, start = self.packer.pack, 0
        self.code_counts.update(map(_kind_of, self.pending))
        for i, step in self.pending_schedules:
            self.buf += b"".join(map(pack, self.pending[start:i]))
            self.step_offsets.append([step, self.written + len(self.buf)])
            start = i
        self.buf += b"".join(map(pack, self.pending[start:]))
        self.pending.clear()
        self.pending_schedules.clear()

    def _now(self) -> int:
        return time.perf_counter_ns() - self.t0

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "xb" if self.exclusive else "wb")

    def _flush(self) -> None:
        self._pack_pending()
        if self.buf:
            if self.file is None:
                self._open()
            self.file.write(self.buf)
            self.file.flush()
            self.written += len(self.buf)
            self.buf.clear()

    # ---- the tracer protocol -----------------------------------------------------------------
    def start(self, header: dict) -> None:
        full = {"magic": MAGIC, "schema_version": SCHEMA_VERSION,
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "argv": self.argv, "t0_ns": self.t0, **header}
        self.buf += self.packer.pack(full)  # written with the first step
        self.started = True

    def request_added(self, seq_id, prompt_token_ids, params, seed, arrival_ns=None):  # None: it arrived now
        t = self._now()
        self._emit("request_added", t, seq_id, list(prompt_token_ids), params.temperature, seed, params.max_tokens,
                   params.ignore_eos, list(params.stop_token_ids), t if arrival_ns is None else arrival_ns - self.t0)

    def schedule(self, batch):
        self.pending_schedules.append((len(self.pending), batch.step))
        # a row as a tuple of its fields (msgpack writes it as an array, like a list), read in C; no copies: a
        # ScheduledRow is a value, its token_ids and block_table lists are the scheduler's copies, never changed
        rows = list(map(_row_fields, batch.rows))
        self._emit("schedule", self._now(), batch.step, BATCH_KINDS.index(batch.batch_kind), rows, list(batch.preempted))

    def reservation(self, step, seq_id, epoch, output_position):  # once per row: no _emit/_now calls
        self.pending.append([_RESERVATION, _now_ns() - self.t0, step, seq_id, epoch, output_position])

    def epoch_bump(self, seq_id, epoch, reason):
        self._emit("epoch_bump", self._now(), seq_id, epoch, EPOCH_REASONS.index(reason))

    def block_alloc(self, seq_id, block_ids):
        self._emit("block_alloc", self._now(), seq_id, list(block_ids))

    def block_free(self, seq_id, block_ids):
        self._emit("block_free", self._now(), seq_id, list(block_ids))

    def slot_alloc(self, seq_id, state_slot):
        self._emit("slot_alloc", self._now(), seq_id, state_slot)

    def slot_free(self, seq_id, state_slot):
        self._emit("slot_free", self._now(), seq_id, state_slot)

    def preempt(self, step, seq_id):
        self._emit("preempt", self._now(), step, seq_id)

    def cancel(self, step, seq_id, cause="abort"):
        self._emit("cancel", self._now(), step, seq_id, CANCEL_CAUSES.index(cause))

    def token(self, step, seq_id, epoch, position, token_id, appended):  # once per row, as reservation
        self.pending.append([_TOKEN, _now_ns() - self.t0, step, seq_id, epoch, position, token_id, bool(appended)])

    def finish(self, step, seq_id, reason):
        self._emit("finish", self._now(), step, seq_id, FINISH_REASONS.index(reason))

    def cpu_span(self, step, phase, start_ns, end_ns):
        self._emit("cpu_span", step, PHASES.index(phase), start_ns - self.t0, end_ns - self.t0)

    def device_span(self, step, start_ns, end_ns):
        self._emit("device_span", step, start_ns - self.t0, end_ns - self.t0)

    def step_digest(self, step, digest):
        self._emit("step_digest", step, digest)

    def step_end(self, step):
        self._flush()

    def close(self) -> None:
        """Footer (counts, step index, clean end) and the trailer that points at it."""
        if self.closed:
            return
        if not self.started:  # the engine never started: nothing to record
            self.closed = True
            return
        self._flush()
        footer_offset = self.written
        self._emit("footer", dict(self.counts), len(self.step_offsets), self.step_offsets, True)
        self._pack_pending()
        self.buf += bytes([TRAILER_TAG]) + footer_offset.to_bytes(8, "big")  # a msgpack uint64, always 9 bytes
        self._flush()
        self.file.close()
        self.closed = True

    def discard(self) -> None:
        """Stop without a log: close, and remove the file if this recorder created it."""
        if self.closed:
            return
        self.closed = True
        if self.file is not None:
            self.file.close()
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
