"""The columnar index of a log (ARCHITECTURE.md §7): numpy columns over every event, built by one scan,
so the viewer and the tools find a step, a request or a kind without decoding the log again.

    from tracing.reader import TraceFile
    from tracing.index import TraceIndex
    index = TraceIndex(TraceFile("run.mdt"))
    for i in index.events_of_request(3):
        print(index.event_at(i))

Columns, one entry per event (the footer excluded), in log order: `offset` (int64 byte offset), `kind`
(uint8 code, tracing/schema.py), `step` and `seq_id` (int32, -1 when the event has none; a schedule event
names no sequence itself, its rows do), `t` (int64 ns since the header's t0_ns; a span's start; -1 for a
step_digest, which has no time). `steps` summarises each step, one row per schedule event; `resources`
lists every KV block and state slot allocation and free, one row per block or slot. A clean log's
footer (event counts, step offsets) is checked against the scan; a log without one is indexed by the
scan alone and `cut` says where it stops. Imports neither torch nor engine/.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracing.reader import Event, TraceError, TraceFile
from tracing.schema import EVENTS, KIND, PHASES

SCHEDULE, CPU_SPAN, DEVICE_SPAN = KIND["schedule"], KIND["cpu_span"], KIND["device_span"]
BLOCK_EVENTS = (KIND["block_alloc"], KIND["block_free"])     # fields: t, seq_id, block_ids
SLOT_EVENTS = (KIND["slot_alloc"], KIND["slot_free"])        # fields: t, seq_id, slot
PROGRESS_EVERY = 1 << 16                                     # events between two progress callbacks


def _position(fields: tuple[str, ...], *names: str) -> int:
    """The array index of the first of `names` in an event, or -1: the sentinel appended to each event."""
    return next((fields.index(n) + 1 for n in names if n in fields), -1)


# kind code -> array positions of (step, seq_id, time); -1 reads the -1 appended to the array
LAYOUT = {code: (_position(f, "step"), _position(f, "seq_id"), _position(f, "t", "start"))
          for code, (_, f) in EVENTS.items()}


@dataclass(slots=True)
class StepTable:
    """One row per step (per schedule event), in log order. Times in ns since t0; -1 where the log has no
    span (a step cut short before its process phase, or one that ran no rows)."""
    step: np.ndarray             # int32
    kind: np.ndarray             # uint8: an index into BATCH_KINDS (0 prefill, 1 decode)
    rows: np.ndarray             # int32: batch rows
    tokens: np.ndarray           # int32: scheduled tokens, summed over the rows
    preemptions: np.ndarray      # int32: sequences preempted to make room for this step
    schedule_start: np.ndarray   # int64, and likewise for every span below
    schedule_end: np.ndarray
    execute_start: np.ndarray
    execute_end: np.ndarray
    process_start: np.ndarray
    process_end: np.ndarray
    device_start: np.ndarray
    device_end: np.ndarray

    def __len__(self) -> int:
        return len(self.step)


@dataclass(slots=True)
class ResourceTable:
    """One row per KV block or state slot in a block_alloc, block_free, slot_alloc or slot_free event, in log
    order: replaying the rows up to an event gives who owns what at that event."""
    event: np.ndarray      # int64: index of the event (a TraceIndex row)
    kind: np.ndarray       # uint8: the event's kind code
    seq_id: np.ndarray     # int32: the owner
    resource: np.ndarray   # int32: the block id or the slot

    def __len__(self) -> int:
        return len(self.event)


class TraceIndex:
    """Columns over one log's events, and random access by step, request, kind and position."""

    def __init__(self, trace: TraceFile, progress=None):
        """`progress(byte_offset)`, if given, is called every PROGRESS_EVERY events of the scan."""
        self.trace = trace
        offset, kind, step, seq_id, t, rows, spans, res = _scan(trace, progress)
        self.cut = trace.cut
        self.offset = np.array(offset, dtype=np.int64)
        self.kind = np.array(kind, dtype=np.uint8)
        self.step = _int_column(step, np.int32, "step", self.offset, trace.path)
        self.seq_id = _int_column(seq_id, np.int32, "seq_id", self.offset, trace.path)
        self.t = _int_column(t, np.int64, "time", self.offset, trace.path)
        self.steps = _step_table(rows, spans, trace.path)
        self.resources = _resource_table(res, trace.path)
        self._row_event = np.array([r[0] for r in rows.seqs], dtype=np.int64)  # schedule event index per row
        self._row_seq = _int_column([r[1] for r in rows.seqs], np.int32, "row's seq_id",
                                    self.offset[self._row_event], trace.path)
        self._by_step = np.argsort(self.step, kind="stable")
        self._by_seq = np.argsort(self.seq_id, kind="stable")
        self._step_sorted, self._seq_sorted = self.step[self._by_step], self.seq_id[self._by_seq]
        self._rows_by_seq = np.argsort(self._row_seq, kind="stable")
        self._row_seq_sorted = self._row_seq[self._rows_by_seq]
        self.step_offsets = self.offset[self.kind == SCHEDULE]
        if trace.clean:
            self._check_footer()

    def __len__(self) -> int:
        return len(self.offset)

    def _check_footer(self) -> None:
        counts, num_steps, step_offsets = self.trace.footer[:3]
        scanned = {EVENTS[int(k)][0]: int(n) for k, n in zip(*np.unique(self.kind, return_counts=True))}
        scanned_index = [[int(s), int(o)] for s, o in zip(self.steps.step, self.step_offsets)]
        if counts != scanned or num_steps != len(self.steps) or step_offsets != scanned_index:
            raise TraceError(f"{self.trace.path} is damaged: its footer's event counts or step index disagree "
                             f"with its events.")

    # ---- random access -------------------------------------------------------------------------
    def events_of_step(self, step: int) -> np.ndarray:
        """Indices of the events that name `step`, in log order."""
        return self._group(self._by_step, self._step_sorted, step)

    def events_of_request(self, seq_id: int) -> np.ndarray:
        """Indices of the events of one request, in log order: those that name it, and the schedule events
        with a row of it."""
        named = self._group(self._by_seq, self._seq_sorted, seq_id)
        scheduled = self._row_event[self._group(self._rows_by_seq, self._row_seq_sorted, seq_id)]
        # a schedule event names no seq_id, so the two are disjoint; a stable sort merges two sorted runs fast
        merged = np.sort(np.concatenate([named, scheduled]), kind="stable")
        return merged[np.concatenate([[True], merged[1:] != merged[:-1]])] if len(merged) else merged

    def events_of_kind(self, name: str) -> np.ndarray:
        if name not in KIND:
            raise KeyError(f"no event kind {name!r}; the kinds are {', '.join(KIND)}.")
        return np.flatnonzero(self.kind == KIND[name])

    def event_at(self, i: int) -> Event:
        """The i-th event, decoded on demand."""
        return self.trace.event_at(int(self.offset[i]))

    def step_of_time(self, t: int) -> int:
        """The row of `steps` whose schedule span starts last at or before time `t` (0 if none)."""
        return max(int(np.searchsorted(self.steps.schedule_start, t, side="right")) - 1, 0)

    @staticmethod
    def _group(order: np.ndarray, ordered: np.ndarray, value: int) -> np.ndarray:
        """The positions (sorted) whose value is `value`, given `order` that sorts the column into `ordered`.
        `value` is cast to the column's dtype: a Python int would make numpy convert the whole column first."""
        info = np.iinfo(ordered.dtype)
        if not info.min <= value <= info.max:  # e.g. a request id typed by hand: nothing has it
            return order[:0]
        value = ordered.dtype.type(value)
        lo, hi = np.searchsorted(ordered, value, "left"), np.searchsorted(ordered, value, "right")
        return order[lo:hi]   # ascending: `order` is a stable argsort


class _Rows:
    """Per-step facts gathered during the scan: the schedule events, and (event index, seq_id) per row."""

    def __init__(self):
        self.steps: list[tuple[int, int, int, int, int]] = []   # step, kind, rows, tokens, preemptions
        self.seqs: list[tuple[int, int]] = []


def _scan(trace: TraceFile, progress=None):
    """One pass over the log: the five columns, the schedule summaries, the spans and the resource rows.
    An event's array gets a -1 appended so that a field it lacks reads as -1 without a branch."""
    offset, kind, step, seq_id, t = [], [], [], [], []
    rows, spans = _Rows(), []          # spans: (step, lane, start, end); lane 0-2 a PHASE, 3 the device
    res: list[tuple] = []              # (event index, kind, seq_id, block or slot)
    for i, (start, obj) in enumerate(trace.objects()):
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(start)
        code = obj[0]
        obj.append(-1)
        s, q, tt = LAYOUT[code]
        offset.append(start)
        kind.append(code)
        step.append(obj[s])
        seq_id.append(obj[q])
        t.append(obj[tt])
        if code == SCHEDULE:
            _schedule(obj, i, start, rows, trace)
        elif code == CPU_SPAN:
            spans.append((obj[1], obj[2], obj[3], obj[4]))
        elif code == DEVICE_SPAN:
            spans.append((obj[1], len(PHASES), obj[2], obj[3]))
        elif code in BLOCK_EVENTS:
            if type(obj[3]) is not list:
                raise TraceError(f"{trace.path} is damaged at byte {start}: its block_ids are not a list.")
            res.extend((i, code, obj[2], b) for b in obj[3])
        elif code in SLOT_EVENTS:
            res.append((i, code, obj[2], obj[3]))
    return offset, kind, step, seq_id, t, rows, spans, res


def _schedule(obj: list, i: int, start: int, rows: _Rows, trace: TraceFile) -> None:
    _, _, step, kind, batch, preempted, _ = obj
    try:
        rows.steps.append((step, kind, len(batch), sum(len(r[3]) for r in batch), len(preempted)))
        rows.seqs.extend((i, r[0]) for r in batch)
    except (TypeError, IndexError):
        raise TraceError(f"{trace.path} is damaged at byte {start}: a schedule event with malformed rows.") \
            from None


def _int_column(values: list, dtype, name: str, offset: np.ndarray, path) -> np.ndarray:
    """A column of Python ints as `dtype`; TraceError naming the first event whose value is not an
    integer in range (msgpack hands back whatever a damaged log holds: floats, strings, lists)."""
    try:
        a = np.array(values) if values else np.zeros(0, np.int64)
    except (ValueError, TypeError, OverflowError):  # lists among the ints
        a = np.zeros(0, np.float64)
    info = np.iinfo(dtype)
    if a.dtype.kind in "iu" and a.ndim == 1:
        bad = np.flatnonzero((a < info.min) | (a > info.max))
    else:  # which one: a slow path, for the message
        bad = [i for i, v in enumerate(values) if type(v) is not int or not info.min <= v <= info.max]
    if len(bad):
        raise TraceError(f"{path} is damaged at byte {offset[bad[0]]}: its {name} is not a {dtype.__name__}.")
    return a.astype(dtype)


def _step_table(rows: _Rows, spans: list, path) -> StepTable:
    n = len(rows.steps)
    cols = _int_rows(rows.steps, 5, path)
    span = _int_rows(spans, 4, path)
    order = np.argsort(cols[:, 0], kind="stable")
    sorted_steps = cols[order, 0]
    if n > 1 and np.any(sorted_steps[1:] == sorted_steps[:-1]):
        raise TraceError(f"{path} is damaged: a step is scheduled twice.")
    pos = np.minimum(np.searchsorted(sorted_steps, span[:, 0]), max(n - 1, 0))
    lane = span[:, 1]
    if len(span) and (n == 0 or np.any(sorted_steps[pos] != span[:, 0]) or np.any((lane < 0) | (lane > len(PHASES)))):
        raise TraceError(f"{path} is damaged: a span names a step that was never scheduled, or no lane.")
    times = np.full((len(PHASES) + 1, 2, n), -1, dtype=np.int64)   # lane, start/end, step row
    r = order[pos]
    times[lane, 0, r], times[lane, 1, r] = span[:, 2], span[:, 3]
    return StepTable(cols[:, 0].astype(np.int32), cols[:, 1].astype(np.uint8), *cols[:, 2:].T.astype(np.int32),
                     *times.reshape(2 * (len(PHASES) + 1), n))


def _resource_table(res: list, path) -> ResourceTable:
    a = _int_rows(res, 4, path, "a block or slot event")
    if len(a) and (a[:, 2:].min() < 0 or a[:, 2:].max() > np.iinfo(np.int32).max):
        raise TraceError(f"{path} is damaged: a block or slot event names a negative or huge id.")
    return ResourceTable(a[:, 0], a[:, 1].astype(np.uint8), a[:, 2].astype(np.int32), a[:, 3].astype(np.int32))


def _int_rows(rows: list, width: int, path, what: str = "a schedule or span event") -> np.ndarray:
    try:
        a = np.array(rows) if rows else np.zeros((0, width), np.int64)
    except (ValueError, TypeError, OverflowError):
        a = np.zeros(0, np.float64)
    if a.dtype.kind not in "iu" or a.shape != (len(rows), width):
        raise TraceError(f"{path} is damaged: {what} has a field that is not an integer.")
    return a.astype(np.int64)
