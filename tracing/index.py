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
step_digest, which has no time), `appended` (bool: a token event appended to its request's output, not a stale
one; False for every other kind). `steps` summarises each step, one row per schedule event; `resources`
lists every KV block and state slot allocation and free, one row per block or slot. A clean log's
footer (event counts, step offsets) is checked against the scan; a log without one is indexed by the
scan alone and `cut` says where it stops. Imports neither torch nor engine/.

Memory (issue #17): about 40 bytes per event kept (26 of them the six columns, 8 per batch row, 17 per
resource row) and under 64 at the peak of the build, on a decode log. The scan decodes a chunk of events at a
time (CHUNK_EVENTS at most, spanning CHUNK_BYTES at most) and turns it into numpy pieces at once: no Python
list of Python ints outlives a chunk. The columns are preallocated from a clean log's footer counts when its
bytes can hold that many events, else joined from the pieces at the end. A lookup by step or by request is an
int32 order and a CSR (the distinct values, where each starts in the order), built by sorting an int64 key
(value << 32 | position) in place: no int64 argsort, no sorted copy. The pages of the mapped log that the
scan or `event_at` read are handed back to the kernel (`madvise`; the page cache keeps them), so that a log
read once does not stay resident. A damaged log raises the TraceError the one-pass build before raised.

Given a `budget` of bytes (the viewer gives what the machine has free), an index planned (BYTES_PER_EVENT per
event, BYTES_PER_RESOURCE per block or slot named) over the budget or over RAM_LIMIT is spilled to disk instead
(tracing/spill.py): its columns, resource rows and batch rows' seq_ids are written chunk by chunk during the scan
to nameless files in the cache (MDI_CACHE/index) and mapped read-only at its end, and its lookups by step and by
request are sorted into such files a range of values at a time; every pass over a whole column then reads it a
block at a time and hands the block's pages back. What stays in memory is the step table (BYTES_PER_STEP a step),
the viewer's per-request tables (BYTES_PER_REQUEST) and the build's working set (SPILL_MEMORY): so a 1 GB log of
250M 4-byte events, 8.5 GB of index, opens in the viewer under 2 GB. A clean log's footer decides before the scan;
a log without one spills once its scan has seen that many events. The disk must hold planned_bytes (checked
first; a full or unwritable cache is a SpillError, one sentence). TooBig (one sentence) only when neither the
memory nor the disk can hold the index. Without a budget (the tools, the tests) the index is always in memory.
"""
from __future__ import annotations

import gc
import mmap
from dataclasses import dataclass
from itertools import islice, repeat
from operator import getitem, itemgetter

import numpy as np

from tracing.reader import TraceError, TraceFile
from tracing.schema import EVENTS, FINISH_REASONS, KIND, PHASES, ROW_FIELDS, Event
from tracing.spill import Column, Spill, blocks, disk_free, flatnonzero, groups, mapped, release, spill_folder, take
from tracing.summary import Summary

SCHEDULE, CPU_SPAN, DEVICE_SPAN, TOKEN = KIND["schedule"], KIND["cpu_span"], KIND["device_span"], KIND["token"]
BLOCK_EVENTS = (KIND["block_alloc"], KIND["block_free"])     # fields: t, seq_id, block_ids
SLOT_EVENTS = (KIND["slot_alloc"], KIND["slot_free"])        # fields: t, seq_id, state_slot
PROGRESS_EVERY = 1 << 16                                     # events between two progress callbacks
CHUNK_EVENTS = 1 << 12                                       # events decoded and converted at a time at most,
CHUNK_BYTES = 1 << 18                                        # and the bytes of log they span at most (+1 event)
RELEASE_BYTES = 4 << 20                                      # scanned bytes handed back to the kernel at a time
BIG_LIST = 1 << 12                                           # block ids converted at once, not gathered
MIN_EVENT_BYTES = 4                                          # the smallest event: [14, 0, ""] (step_digest)
BYTES_PER_EVENT = 64             # planned memory per event: the build's peak (~42-61) and what the viewer adds
BYTES_PER_RESOURCE = 17          # and per KV block or state slot an event names (one resource row each)
RAM_LIMIT = 1 << 30              # planned bytes above which an index given a budget spills to disk, whatever is free
BYTES_PER_STEP = 128             # memory a spilled index still plans per step (its step table and lookups),
BYTES_PER_REQUEST = 256          # per request (the viewer's tables of them),
SPILL_MEMORY = 384 << 20         # and for the build's working set (tracing/spill.py's sort of one range of keys)
DISK_MARGIN = 1 << 30            # disk left free beside a spilled index (planned as planned_bytes: an upper bound)


def _position(fields: tuple[str, ...], *names: str) -> int:
    """The array index of the first of `names` in an event (`[kind, *fields]`), or -1 if it has none."""
    return next((fields.index(n) + 1 for n in names if n in fields), -1)


# kind code -> array positions of (step, seq_id, time); -1 for a field the kind lacks
LAYOUT = {code: (_position(f, "step"), _position(f, "seq_id"), _position(f, "t", "start"))
          for code, (_, f) in EVENTS.items()}
# the same as arrays indexed by kind code, 0 for a field the kind lacks (it reads the kind code, then set to -1)
_STEP_AT, _SEQ_AT, _T_AT = (np.array([max(LAYOUT.get(code, (0, 0, 0))[k], 0) for code in range(256)], np.intp)
                            for k in range(3))
_SPECIAL = np.zeros(256, bool)             # the kinds whose events feed the step and resource tables
_SPECIAL[[SCHEDULE, *BLOCK_EVENTS, *SLOT_EVENTS]] = True
# the other array positions the scan reads, by name: a token's appended flag; a schedule event's step, batch kind,
# rows and preempted; a span's step, phase, start and end; a block event's seq_id and ids, a slot event's slot
_APPENDED = _position(EVENTS[TOKEN][1], "appended")
_SCHED_AT = itemgetter(*(_position(EVENTS[SCHEDULE][1], n) for n in ("step", "batch_kind", "rows", "preempted")))
_CPU_AT = itemgetter(*(_position(EVENTS[CPU_SPAN][1], n) for n in ("step", "phase", "start", "end")))
_DEVICE_AT = itemgetter(*(_position(EVENTS[DEVICE_SPAN][1], n) for n in ("step", "start", "end")))
_RES_SEQ = _position(EVENTS[BLOCK_EVENTS[0]][1], "seq_id")
_RES_IDS = {code: _position(EVENTS[code][1], "block_ids" if code in BLOCK_EVENTS else "state_slot")
            for code in (*BLOCK_EVENTS, *SLOT_EVENTS)}
assert all(_position(EVENTS[code][1], "seq_id") == _RES_SEQ for code in _RES_IDS)
_REQUEST_ADDED, _FINISH = KIND["request_added"], KIND["finish"]
_PROMPT = _position(EVENTS[_REQUEST_ADDED][1], "prompt_token_ids")
_REASON = _position(EVENTS[_FINISH][1], "reason")
_kind_code = itemgetter(0)                       # an event array's kind code
_row_seq_id = itemgetter(ROW_FIELDS.index("seq_id"))
_row_token_ids = itemgetter(ROW_FIELDS.index("token_ids"))

def _device_span(obj: list) -> tuple:
    """A device span's (step, lane, start, end), as a CPU span's (step, phase, start, end): its lane is the one
    after the CPU phases."""
    step, start, end = _DEVICE_AT(obj)
    return step, len(PHASES), start, end


# A damaged log raises the first of these, in this order (as the one-pass build did: its columns were checked
# in this order after the scan); errors found during the scan (the reader's, malformed rows) come first.
(E_STEP, E_SEQ, E_TIME, E_TABLE_INT, E_TWICE, E_SPAN, E_RES_INT, E_RES_RANGE, E_ROW_SEQ) = range(9)


@dataclass(slots=True)
class StepTable:
    """One row per step (per schedule event), in log order. Times in ns since t0; -1 where the log has no
    span (a step cut short before its process phase, or one that ran no rows)."""
    step: np.ndarray             # int32
    batch_kind: np.ndarray       # uint8: an index into BATCH_KINDS (0 prefill, 1 decode)
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

    def __init__(self, trace: TraceFile, progress=None, budget: int | None = None):
        """`progress(byte_offset)`, if given, is called every PROGRESS_EVERY events of the scan. `budget`, if
        given, is the bytes of memory the index may plan on: a log whose events would need more (BYTES_PER_EVENT
        each, BYTES_PER_RESOURCE per block or slot named) raises TooBig, before the scan when a clean footer
        counts them, else as soon as the scan has seen that many. Above RAM_LIMIT planned bytes, or the budget,
        the index spills to disk instead (`spilled`), if the disk has room: TooBig only when neither can hold it."""
        self.trace = trace
        b = _scan(trace, progress, budget)
        self._spill = b.spill      # None: every array in memory; else the big ones are mapped files (tracing/spill.py)
        try:
            self._build(b)
        except BaseException:
            self.close()
            raise

    def _build(self, b: _Build) -> None:
        self.cut = self.trace.cut
        self.summary: Summary = b.summary     # the run's numbers (tracing/summary.py): the Overview's, info's
        self.offset, self.kind, self.step, self.seq_id, self.t, self.appended = b.columns()
        b.check(E_TWICE)  # the column errors first, then the step table's
        self.steps = b.step_table()
        self.resources = b.resource_table()
        self._row_seq = b.rows()                          # per batch row (all steps' rows in log order): seq_id
        b.check(None)
        del b
        self._by_step = _Groups(self.step, self._spill)
        self._by_seq = _Groups(self.seq_id, self._spill)
        self._rows_by_seq = _Groups(self._row_seq, self._spill)
        self._sched_event = flatnonzero(self.kind, lambda k: k == SCHEDULE)   # per step row: its event
        self._row_end = np.cumsum(self.steps.rows, dtype=np.int64)            # per step row: where its rows end
        self.step_offsets = take(self.offset, self._sched_event)
        if self.trace.clean:
            self._check_footer()

    @property
    def spilled(self) -> bool:
        """Whether the index's big arrays are files on disk (mapped), not memory."""
        return self._spill is not None

    def close(self) -> None:
        """Drop the arrays mapped from a spilled index's files: their disk space comes back once no other view of
        them is alive (the files have no name, so none is left behind in any case). Nothing for an index in
        memory; the index is unusable afterwards."""
        if self._spill is None:
            return
        self._spill.close()
        for obj in (self, getattr(self, "steps", None), getattr(self, "resources", None),
                    *(getattr(self, g, None) for g in ("_by_step", "_by_seq", "_rows_by_seq"))):
            for name in _arrays(obj):
                a = getattr(obj, name)
                if mapped(a) is not None:
                    setattr(obj, name, np.zeros(0, a.dtype))

    def __len__(self) -> int:
        return len(self.offset)

    def _all_arrays(self) -> list[np.ndarray]:
        arrays = [self.offset, self.kind, self.step, self.seq_id, self.t, self.appended, self._row_seq,
                  self._sched_event, self._row_end, self.step_offsets]
        arrays += [getattr(tab, f) for tab in (self.steps, self.resources) for f in tab.__slots__]
        return arrays + [getattr(g, f) for g in (self._by_step, self._by_seq, self._rows_by_seq)
                         for f in ("order", "values", "starts")]

    @property
    def nbytes(self) -> int:
        """Bytes of the numpy arrays the index keeps (its columns, tables and lookups), in memory or mapped."""
        return sum(a.nbytes for a in self._all_arrays())

    @property
    def memory(self) -> int:
        """Bytes of those arrays that are in memory (all of them unless `spilled`)."""
        return sum(a.nbytes for a in self._all_arrays() if mapped(a) is None)

    def _check_footer(self) -> None:
        footer = self.trace.footer
        counts, num_steps, step_offsets = footer.counts, footer.num_steps, footer.step_offsets
        per_kind = np.zeros(256, np.int64)
        for _, block in blocks(self.kind):
            per_kind += np.bincount(block, minlength=256)
        scanned = {EVENTS[k][0]: int(n) for k, n in enumerate(per_kind) if n and k in EVENTS}
        same_index = type(step_offsets) is list and len(step_offsets) == len(self.steps) and all(
            type(e) is list and e == [s, o] for e, s, o in zip(step_offsets, self.steps.step.tolist(),
                                                                  self.step_offsets.tolist()))
        if counts != scanned or num_steps != len(self.steps) or not same_index:
            raise TraceError(f"{self.trace.path} is damaged: its footer's event counts or step index disagree "
                             f"with its events.")

    # ---- random access -------------------------------------------------------------------------
    def events_of_step(self, step: int, kind: str | None = None) -> np.ndarray:
        """Indices of the events that name `step` (those of one `kind`, if given), in log order. With a kind,
        the step's events are read block by block: a step of 250M events costs no array of them."""
        if kind is None:
            return self._by_step.positions(step)
        code = _code(kind)
        found = [pos[take(self.kind, pos) == code] for _, pos in blocks(self._by_step.slice(step))]
        return np.concatenate(found).astype(np.intp) if found else np.zeros(0, np.intp)

    def events_of_request(self, seq_id: int) -> np.ndarray:
        """Indices of the events of one request, in log order: those that name it, and the schedule events
        with a row of it."""
        named = self._by_seq.positions(seq_id)
        rows = self._rows_by_seq.positions(seq_id)
        scheduled = self._sched_event[np.searchsorted(self._row_end, rows, "right")]   # the steps they are in
        # a schedule event names no seq_id, so the two are disjoint; a stable sort merges two sorted runs fast
        merged = np.sort(np.concatenate([named, scheduled]), kind="stable")
        return merged[np.concatenate([[True], merged[1:] != merged[:-1]])] if len(merged) else merged

    def events_of_kind(self, name: str) -> np.ndarray:
        code = _code(name)
        return flatnonzero(self.kind, lambda k: k == code)

    def next_of_kind(self, name: str, after: int, forward: bool = True) -> int | None:
        """The index of the first event of kind `name` after event `after` (before it, if not `forward`), or None;
        read block by block from there (no list of every event of the kind)."""
        code, n, size = _code(name), len(self), 1 << 16
        lo, hi = (max(after + 1, 0), min(after + 1 + size, n)) if forward else (max(after - size, 0), min(after, n))
        while lo < hi:
            block = self.kind[lo:hi]
            hits = np.flatnonzero(block == code)
            release(block)
            if len(hits):
                return lo + int(hits[0] if forward else hits[-1])
            size *= 2
            lo, hi = (hi, min(hi + size, n)) if forward else (max(lo - size, 0), lo)
        return None

    def column(self, dtype) -> Column | None:
        """A new file of a spilled index's folder, for a list as long as the log (the Events view's); else None."""
        return None if self._spill is None else self._spill.column(dtype)

    def request_ids(self) -> np.ndarray:
        """Every seq_id the log names (its events' and its batch rows'), ascending, as int64."""
        named = np.asarray(self._by_seq.values)
        return np.union1d(named[named >= 0], self._rows_by_seq.values).astype(np.int64)

    def event_at(self, i: int) -> Event:
        """The i-th event, decoded on demand. The pages of the mapped log it read are handed back to the kernel
        (they stay in the page cache): the viewer decodes events all over a log (every request_added, every
        finish, the lines on show), and each read maps 64 KiB around it (the kernel's fault-around), which
        would stay resident, up to the whole log."""
        n = len(self.offset)
        k = int(i) + (n if int(i) < 0 else 0)
        start = int(self.offset[k])
        event = self.trace.event_at(start)
        end = int(self.offset[k + 1]) if k + 1 < n else len(self.trace.data)
        _release(self.trace.data, start, start + 2 * (end - start) + 4096)   # the reader's doubling windows
        return event

    def step_of_time(self, t: int) -> int:
        """The row of `steps` whose schedule span starts last at or before time `t` (0 if none)."""
        return max(int(np.searchsorted(self.steps.schedule_start, t, side="right")) - 1, 0)


def _code(name: str) -> int:
    if name not in KIND:
        raise KeyError(f"no event kind {name!r}; the kinds are {', '.join(KIND)}.")
    return KIND[name]


def _arrays(obj) -> list[str]:
    """The names of an object's numpy array attributes (its __dict__'s and __slots__')."""
    names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
    return [n for n in names if isinstance(getattr(obj, n, None), np.ndarray)]


class _Groups:
    """The positions of a column grouped by value, a CSR: `order` (int32 when the column allows) lists the
    positions sorted by value and, within a value, ascending; value `values[k]` owns order[starts[k]:starts[k+1]].
    Built by sorting an int64 key (value << 32 | position) in place: no int64 argsort, no sorted copy kept; for a
    spilled index, by tracing/spill.py's `groups` into files, a range of values at a time."""

    BLOCK = 1 << 20   # positions converted at a time (temporaries of 8 MiB)

    def __init__(self, column: np.ndarray, spill: Spill | None = None):
        n = len(column)
        self.dtype = column.dtype
        if spill is not None and column.dtype == np.int32 and n < 1 << 31:
            self.order, self.values, self.starts = groups(column, spill)
            return
        if n >= 1 << 31 or column.dtype.itemsize > 4:  # beyond the key's 32 bits of position: argsort
            self.order = np.argsort(column, kind="stable")
            ordered = column[self.order]
            cuts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
            self.values = ordered[np.concatenate([[0], cuts])] if n else ordered
            self.starts = np.concatenate([[0], cuts, [n]]).astype(np.int64)
            return
        key = column.astype(np.int64)
        key <<= 32
        for a in range(0, n, self.BLOCK):
            key[a:a + self.BLOCK] |= np.arange(a, min(a + self.BLOCK, n), dtype=np.int64)
        key.sort()
        cuts = [np.zeros(min(n, 1), np.int64)]
        for a in range(0, n - 1, self.BLOCK):
            hi = key[a:a + self.BLOCK + 1] >> 32
            cuts.append(np.flatnonzero(hi[1:] != hi[:-1]) + (a + 1))
        first = np.concatenate(cuts)
        self.values = (key[first] >> 32).astype(column.dtype)
        self.starts = np.concatenate([first, [n]]).astype(np.int64)
        self.order = np.empty(n, np.int32)
        for a in range(0, n, self.BLOCK):
            self.order[a:a + self.BLOCK] = key[a:a + self.BLOCK] & 0xFFFFFFFF
        del key

    @property
    def nbytes(self) -> int:
        return self.order.nbytes + self.values.nbytes + self.starts.nbytes

    def positions(self, value: int) -> np.ndarray:
        """The positions (ascending, as intp) whose value is `value`. `value` is cast to the column's dtype: a
        Python int would make numpy convert the whole column first."""
        return self.slice(value).astype(np.intp)

    def slice(self, value: int) -> np.ndarray:
        """The same, as a view of `order` (no copy)."""
        info = np.iinfo(self.dtype)
        if not info.min <= value <= info.max:  # e.g. a request id typed by hand: nothing has it
            return self.order[:0]
        k = int(np.searchsorted(self.values, self.dtype.type(value)))
        if k == len(self.values) or self.values[k] != value:
            return self.order[:0]
        return self.order[int(self.starts[k]):int(self.starts[k + 1])]


class TooBig(TraceError):
    """A log with more events than the memory available can index, in memory or spilled to disk (one sentence,
    as every TraceError)."""


def planned_bytes(events: int, resources: int = 0) -> int:
    """The memory an index of `events` events naming `resources` blocks and slots is planned to need."""
    return events * BYTES_PER_EVENT + resources * BYTES_PER_RESOURCE


def spilled_bytes(steps: int, requests: int) -> int:
    """The memory a spilled index (and the viewer over it) is planned to need: its per-step and per-request
    tables, and the build's working set."""
    return steps * BYTES_PER_STEP + requests * BYTES_PER_REQUEST + SPILL_MEMORY


def check_budget(trace: TraceFile, budget: int) -> int:
    """TooBig if a clean log's footer counts more events than `budget` bytes of memory or the disk can index;
    else the bytes of memory planned for them (0 for a log without a footer, which only its scan can count)."""
    claimed = _claimed_events(trace)
    if claimed is None:
        return 0
    steps, requests = _claimed_steps(trace)
    if _spills(trace, claimed, 0, steps, requests, budget, counted=True):
        return spilled_bytes(steps, requests)
    return planned_bytes(claimed)


def _spills(trace: TraceFile, events: int, resources: int, steps: int, requests: int, budget: int, counted: bool,
            scale: float = 1.0) -> bool:
    """Whether an index of this many events (and resource rows, steps, requests) spills to disk: it plans more
    than RAM_LIMIT or `budget` bytes of memory, and the disk has room for it (planned_bytes) and the budget for
    what stays in memory. False if it fits in memory; TooBig if neither holds it. `scale`: the log's bytes over
    those scanned, for a log without a footer (what it holds at the end, if the rest is like the start)."""
    need = planned_bytes(events, resources)
    if need <= min(budget, RAM_LIMIT):
        return False
    free = disk_free()
    if (free is not None and need * scale + DISK_MARGIN <= free and events * scale < 1 << 31
            and spilled_bytes(int(steps * scale), int(requests * scale)) <= budget):
        return True
    if need <= budget:
        return False
    raise _too_big(trace, events, resources, budget, counted, free)


def _too_big(trace: TraceFile, events: int, resources: int, budget: int, counted: bool, free: int | None) -> TooBig:
    held = "holds" if counted else "holds at least"
    disk = "its free disk space is unknown" if free is None else f"{free / 2**30:.1f} GiB of disk is free"
    return TooBig(f"{trace.path} is too big to index in this machine's memory or on its disk: it {held} {events:,} "
                  f"events, about {planned_bytes(events, resources) / 2**30:.1f} GiB indexed, "
                  f"{max(budget, 0) / 2**30:.1f} GiB of memory is available and {disk} in {spill_folder()} "
                  f"(`mdi-trace info` and `mdi-trace verify` read it in bounded memory; MDI_CACHE moves the "
                  f"folder).")


def scan_summary(trace: TraceFile) -> Summary:
    """The log's Summary by the index's scan, keeping no column (`summarize`: bounded memory); the TraceError
    the index would raise for a damaged event."""
    b = _scan(trace, keep=False)
    b.check(None)
    return b.summary


def _scan(trace: TraceFile, progress=None, budget: int | None = None, keep: bool = True) -> _Build:
    """One pass over the log, CHUNK_EVENTS events at a time: each chunk's columns, schedule summaries, spans
    and resource rows become numpy pieces before the next is decoded (and fed to the Summary; with
    `keep=False` the pieces are then dropped). The reader's TraceError for an event is
    raised once the events before it are converted (their own errors come first, as in log order).

    The cyclic garbage collector is off meanwhile (the scan makes no cycles): a chunk's decoded events are
    alive together, and each of its collections would walk them all, a third of the scan's time."""
    claimed = _claimed_events(trace) if budget is not None else None   # TooBig before the scan, if it says so
    spill = claimed is not None and _spills(trace, claimed, 0, *_claimed_steps(trace), budget, counted=True)
    b = _Build(trace, keep, Spill(trace.path) if spill else None)
    objects = trace.objects()
    collecting = gc.isenabled()
    gc.disable()
    try:
        done = False
        while not done:
            chunk, done, error = _chunk(objects)
            if chunk:
                if progress is not None:   # at every PROGRESS_EVERY-th event, with its offset
                    for k in range(-b.n % PROGRESS_EVERY, len(chunk), PROGRESS_EVERY):
                        progress(chunk[k][0])
                b.add(chunk)
                b.release_pages(chunk[-1][0])
                if budget is not None:
                    _plan(b, chunk[-1][0], budget)
            if error is not None:
                raise error
        return b
    except BaseException:
        if b.spill is not None:
            b.spill.close()
        raise
    finally:
        if collecting:
            gc.enable()


def _plan(b: _Build, offset: int, budget: int) -> None:
    """During the scan of a log given a budget: spill once what it holds at the end (scaled from what the scan
    has seen) is planned over the budget or RAM_LIMIT; TooBig once neither memory nor disk can hold it."""
    trace, sm = b.trace, b.summary
    if b.spill is None:
        if planned_bytes(b.n, b.resource_rows) <= min(budget, RAM_LIMIT):
            return
        body = (trace.footer_offset if trace.clean else len(trace.data)) - trace.body_offset
        scale = max(body / max(offset - trace.body_offset, 1), 1.0)
        if _spills(trace, b.n, b.resource_rows, sm.num_steps, sm.requests, budget, False, scale):
            b.spill_to(Spill(trace.path))
    elif spilled_bytes(sm.num_steps, sm.requests) > budget:
        raise _too_big(trace, b.n, b.resource_rows, budget, False, disk_free())


def _claimed_steps(trace: TraceFile) -> tuple[int, int]:
    """(steps, requests) a clean log's footer counts (0 where it does not say)."""
    counts, steps = trace.footer.counts, trace.footer.num_steps
    requests = counts.get("request_added", 0) if type(counts) is dict else 0
    return (steps if type(steps) is int and steps >= 0 else 0), (requests if type(requests) is int else 0)


def _chunk(objects) -> tuple[list, bool, TraceError | None]:
    """The next (offset, event) pairs: CHUNK_EVENTS at most, spanning CHUNK_BYTES at most (and one event, which
    the reader bounds), so that the decoded events alive together stay a few MB whatever their size. Returns
    (the pairs, whether the log ends there, the reader's error after them if any)."""
    chunk: list = []
    try:
        first = next(objects, None)
        if first is None:
            return chunk, True, None
        chunk.append(first)
        limit, append = first[0] + CHUNK_BYTES, chunk.append
        for item in islice(objects, CHUNK_EVENTS - 1):
            append(item)
            if item[0] >= limit:
                return chunk, False, None
        return chunk, len(chunk) < CHUNK_EVENTS, None
    except TraceError as e:   # the events before it stay in `chunk`
        return chunk, True, e


class _Build:
    """The pieces of the index, chunk by chunk, and the first damage found in each category (E_*)."""

    def __init__(self, trace: TraceFile, keep: bool = True, spill: Spill | None = None):
        self.trace, self.path, self.n, self.keep, self.spill = trace, trace.path, 0, keep, None
        self.summary = Summary()
        self.errors: dict[int, str] = {}
        self.released = 0                 # bytes of the mapped log handed back to the kernel
        self.resource_rows = 0            # KV blocks and state slots named so far
        # the five columns: preallocated from a clean log's footer if its counts are plausible, else pieces
        self.cols: list[list[np.ndarray]] = [[] for _ in _DTYPES]
        self.full: list[np.ndarray] | None = None
        claimed = _claimed_events(trace)
        if claimed is not None and keep and spill is None:
            self.full = [np.empty(claimed, dt) for dt in _DTYPES]
        self._pieces()
        if spill is not None:
            self.spill_to(spill)

    def spill_to(self, spill: Spill) -> None:
        """From now on the columns, the resource rows and the batch rows' seq_ids go to `spill`'s files (what
        the scan has gathered so far first)."""
        self.spill = spill
        if self.full is not None:
            self.cols = [[col[:self.n]] for col in self.full]
            self.full = None
        self.cols = [_sink(spill, dt, pieces) for dt, pieces in zip(_DTYPES, self.cols)]
        self.res = [_sink(spill, dt, pieces) for dt, pieces in zip(_RES_DTYPES, self.res)]
        self.row_seq = _sink(spill, np.int32, self.row_seq)

    def _pieces(self) -> None:
        """Empty lists of the pieces of the step and resource tables."""
        self.sched: list[list[np.ndarray]] = [[], [], [], [], []]   # step, batch kind, rows, tokens, preemptions
        self.spans: list[list[np.ndarray]] = [[], [], [], []]       # step, lane, start, end
        self.res: list[list[np.ndarray]] = [[], [], [], []]         # event, kind, seq_id, resource
        self.row_seq: list[np.ndarray] = []

    def fail(self, category: int, message: str) -> None:
        self.errors.setdefault(category, message)

    def check(self, before: int | None) -> None:
        """Raise the first error of a category before `before` (None: of any category)."""
        found = [c for c in self.errors if before is None or c < before]
        if found:
            raise TraceError(self.errors[min(found)])

    def release_pages(self, upto: int) -> None:
        """Hand the scanned pages of the mapped log (up to byte `upto`) back to the kernel: they are in the page
        cache still, and an event read later maps its page again. Without it a log read once stays resident."""
        data = self.trace.data
        end = upto - upto % mmap.PAGESIZE
        if end - self.released < RELEASE_BYTES or not isinstance(data, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        try:
            data.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end
        except (OSError, ValueError):
            self.released = len(data)  # not supported here: stop trying

    # ---- one chunk -------------------------------------------------------------------------------
    def add(self, chunk: list) -> None:
        base, n = self.n, len(chunk)
        starts, objs = zip(*chunk)
        offset = np.array(starts, np.int64)
        kind = np.array(list(map(_kind_code, objs)), np.uint8)
        cols = []
        for at, dtype, category, name in ((_STEP_AT, np.int32, E_STEP, "step"), (_SEQ_AT, np.int32, E_SEQ, "seq_id"),
                                          (_T_AT, np.int64, E_TIME, "time")):
            pos = at[kind]
            col = self._column(list(map(getitem, objs, pos.tolist())), dtype, category, name, starts)
            col[pos == 0] = -1   # a field the kind lacks
            cols.append(col)
        appended = np.zeros(n, bool)   # a token event's last field, True only if it is the bool True
        tokens = np.flatnonzero(kind == TOKEN).tolist()
        if tokens:
            appended[tokens] = [objs[j][_APPENDED] is True for j in tokens]
        self._put((offset, kind, *cols, appended))
        self.summary.add_events(kind, cols[2], appended)
        self._requests_and_finishes(objs, kind, starts)
        self._spans(objs, kind)
        self._special(objs, kind, starts, base)
        self.n += n
        if not self.keep:   # a summary only: nothing outlives the chunk
            self.cols = [[] for _ in _DTYPES]
            self._pieces()

    def _requests_and_finishes(self, objs: list, kind: np.ndarray, starts) -> None:
        """The Summary's prompt tokens and finish reasons."""
        for j in np.flatnonzero((kind == _REQUEST_ADDED) | (kind == _FINISH)).tolist():
            obj = objs[j]
            if obj[0] == _REQUEST_ADDED:
                self.summary.add_request(len(obj[_PROMPT]))
            elif 0 <= obj[_REASON] < len(FINISH_REASONS):
                self.summary.add_finish(obj[_REASON])
            else:
                raise TraceError(f"{self.path} is damaged at byte {starts[j]}: a malformed finish event (reason "
                                 f"{obj[_REASON]}).")

    def _put(self, pieces) -> None:
        a, b = self.n, self.n + len(pieces[0])
        if self.full is not None and b > len(self.full[0]):   # more events than the footer counts: pieces
            self.cols = [[col[:a]] for col in self.full]
            self.full = None
        if self.full is not None:
            for col, piece in zip(self.full, pieces):
                col[a:b] = piece
        else:
            for col, piece in zip(self.cols, pieces):
                col.append(piece)

    def _column(self, values: list, dtype, category: int, name: str, starts: list) -> np.ndarray:
        """A chunk's column as `dtype`; the first event whose value is not an integer in range is noted."""
        info = np.iinfo(dtype)
        a = _ints(values)
        if a is not None:
            bad = np.flatnonzero((a < info.min) | (a > info.max)) if len(a) else []
        else:  # which one: a slow path, for the message
            bad = [i for i, v in enumerate(values) if type(v) is not int or not info.min <= v <= info.max] or [0]
        if len(bad):
            self.fail(category, f"{self.path} is damaged at byte {starts[bad[0]]}: its {name} is not a "
                                f"{dtype.__name__}.")
            return np.zeros(len(values), dtype)
        return a.astype(dtype)

    def _spans(self, objs: list, kind: np.ndarray) -> None:
        """(step, lane, start, end) of the CPU and device spans, in log order; lane 0-2 a PHASE, 3 the device.
        Only the last span of a (step, lane) in the chunk is kept: it is the one the step table shows."""
        at = np.flatnonzero((kind == CPU_SPAN) | (kind == DEVICE_SPAN)).tolist()
        if not at:
            return
        sp = [_CPU_AT(o) if o[0] == CPU_SPAN else _device_span(o) for o in map(objs.__getitem__, at)]
        cols = list(zip(*sp))   # step, lane, start, end
        arrays = [_ints(c) for c in cols]
        if any(a is None for a in arrays):
            self.fail(E_TABLE_INT, f"{self.path} is damaged: a schedule or span event has a field that is not an "
                                   f"integer.")
            return
        step, lane, start, end = arrays
        self.summary.add_spans(lane, start, end)
        if len(step) > 1:
            order = np.lexsort((np.arange(len(step)), lane, step))   # by step, lane, then log order
            last = np.ones(len(order), bool)
            last[:-1] = (step[order][1:] != step[order][:-1]) | (lane[order][1:] != lane[order][:-1])
            keep = np.sort(order[last])
            step, lane, start, end = step[keep], lane[keep], start[keep], end[keep]
        for col, piece in zip(self.spans, (step, lane, start, end)):
            col.append(piece)

    def _special(self, objs: list, kind: np.ndarray, starts: list, base: int) -> None:
        """Schedule events (summaries and rows) and block and slot events (resource rows), in log order."""
        sched: list[tuple] = []
        row_event: list[int] = []
        row_seq: list = []
        res = _Resources(self)
        for j in np.flatnonzero(_SPECIAL[kind]).tolist():
            obj, code, i = objs[j], objs[j][0], base + j
            if code == SCHEDULE:
                step, batch_kind, batch, preempted = _SCHED_AT(obj)
                try:
                    if any(len(r) != len(ROW_FIELDS) for r in batch):
                        raise TypeError
                    sched.append((step, batch_kind, len(batch), sum(map(len, map(_row_token_ids, batch))),
                                  len(preempted)))
                    seqs = list(map(_row_seq_id, batch))
                except (TypeError, IndexError):
                    raise TraceError(f"{self.path} is damaged at byte {starts[j]}: a schedule event with malformed "
                                     f"rows.") from None
                row_event.extend(repeat(i, len(seqs)))
                row_seq.extend(seqs)
            elif code in BLOCK_EVENTS:
                if type(obj[_RES_IDS[code]]) is not list:
                    raise TraceError(f"{self.path} is damaged at byte {starts[j]}: its block_ids are not a list.")
                res.add(i, code, obj[_RES_SEQ], obj[_RES_IDS[code]])
            else:
                res.add(i, code, obj[_RES_SEQ], [obj[_RES_IDS[code]]])
        res.flush()
        if sched:
            cols = [_ints(c) for c in zip(*sched)]
            if any(c is None for c in cols):
                self.fail(E_TABLE_INT, f"{self.path} is damaged: a schedule or span event has a field that is not "
                                       f"an integer.")
            else:
                self.summary.add_steps(cols[1], cols[3])
                for col, piece, dt in zip(self.sched, cols, (np.int32, np.uint8, np.int32, np.int32, np.int32)):
                    col.append(piece.astype(dt))
        if row_seq:
            events = np.array(row_event, np.int64)
            seq = _ints(row_seq)
            info = np.iinfo(np.int32)
            if seq is not None:
                bad = np.flatnonzero((seq < info.min) | (seq > info.max))
            else:
                bad = [k for k, v in enumerate(row_seq) if type(v) is not int or not info.min <= v <= info.max]
            if len(bad):
                self.fail(E_ROW_SEQ, f"{self.path} is damaged at byte {starts[int(events[bad[0]]) - base]}: its "
                                     f"row's seq_id is not a int32.")
            else:
                self.row_seq.append(seq.astype(np.int32))

    # ---- the end ---------------------------------------------------------------------------------
    def columns(self) -> list[np.ndarray]:
        """offset, kind, step, seq_id, t, appended; the pieces are freed as they are joined."""
        if self.full is not None:
            out = [col[:self.n] for col in self.full]
            self.full = None
            return [col if col.base is None or len(col) == len(col.base) else col.copy() for col in out]
        return [_join(col, dt) for col, dt in zip(self.cols, _DTYPES)]

    def step_table(self) -> StepTable:
        step, batch_kind, rows, tokens, preempted = (_join(c, dt) for c, dt in
                                                     zip(self.sched, (np.int32, np.uint8, np.int32, np.int32, np.int32)))
        span_step, lane, start, end = (_join(c, np.int64) for c in self.spans)
        n, path = len(step), self.path
        order = np.argsort(step, kind="stable")
        sorted_steps = step[order]
        if n > 1 and np.any(sorted_steps[1:] == sorted_steps[:-1]):
            raise TraceError(f"{path} is damaged: a step is scheduled twice.")
        pos = np.minimum(np.searchsorted(sorted_steps, span_step), max(n - 1, 0))
        if len(span_step) and (n == 0 or np.any(sorted_steps[pos] != span_step)
                               or np.any((lane < 0) | (lane > len(PHASES)))):
            raise TraceError(f"{path} is damaged: a span names a step that was never scheduled, or no lane.")
        times = np.full((len(PHASES) + 1, 2, n), -1, dtype=np.int64)   # lane, start/end, step row
        r = order[pos]
        times[lane, 0, r], times[lane, 1, r] = start, end
        self.check(None)  # a resource or row error before the footer's
        return StepTable(step, batch_kind, rows, tokens, preempted, *times.reshape(2 * (len(PHASES) + 1), n))

    def resource_table(self) -> ResourceTable:
        return ResourceTable(*(_join(c, dt) for c, dt in zip(self.res, _RES_DTYPES)))

    def rows(self) -> np.ndarray:
        return _join(self.row_seq, np.int32)


class _Resources:
    """A chunk's block and slot events gathered into resource rows; a long id list is converted alone."""

    def __init__(self, build: _Build):
        self.build = build
        self.events: list[int] = []
        self.codes: list[int] = []
        self.seqs: list = []
        self.lens: list[int] = []
        self.ids: list = []

    def add(self, i: int, code: int, seq, ids: list) -> None:
        if not ids:
            return
        if len(ids) > BIG_LIST:
            self.flush()
            self._convert([i], [code], [seq], [len(ids)], ids)
            return
        self.events.append(i)
        self.codes.append(code)
        self.seqs.append(seq)
        self.lens.append(len(ids))
        self.ids.extend(ids)
        if len(self.ids) > BIG_LIST:
            self.flush()

    def flush(self) -> None:
        if self.events:
            self._convert(self.events, self.codes, self.seqs, self.lens, self.ids)
            self.__init__(self.build)

    def _convert(self, events, codes, seqs, lens, ids) -> None:
        b = self.build
        if E_RES_INT in b.errors:
            return
        seq, rid = _ints(seqs), _ints(ids)
        if seq is None or rid is None:
            b.fail(E_RES_INT, f"{b.path} is damaged: a block or slot event has a field that is not an integer.")
            return
        top = np.iinfo(np.int32).max
        if seq.min() < 0 or seq.max() > top or rid.min() < 0 or rid.max() > top:
            b.fail(E_RES_RANGE, f"{b.path} is damaged: a block or slot event names a negative or huge id.")
            return
        lens = np.array(lens, np.int64)
        pieces = (np.repeat(np.array(events, np.int64), lens), np.repeat(np.array(codes, np.uint8), lens),
                  np.repeat(seq.astype(np.int32), lens), rid.astype(np.int32))
        for col, piece in zip(b.res, pieces):
            col.append(piece)
        b.resource_rows += len(rid)


_DTYPES = (np.int64, np.uint8, np.int32, np.int32, np.int64, np.bool_)   # offset, kind, step, seq_id, t, appended
_RES_DTYPES = (np.int64, np.uint8, np.int32, np.int32)                   # event, kind, seq_id, resource


def _sink(spill: Spill, dtype, pieces: list[np.ndarray]) -> Column:
    """A spilled column holding `pieces` (which are freed)."""
    column = spill.column(dtype)
    while pieces:
        column.append(pieces.pop(0))
    return column


FAULT_AROUND = 1 << 16   # bytes the kernel maps around a page fault of a file mapping (fault_around_bytes)


def _release(data, start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) the mapped log's 64 KiB blocks that bytes [start, end) touch, if it can."""
    if not isinstance(data, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    a = start - start % FAULT_AROUND
    b = min(end + (-end) % FAULT_AROUND, len(data))
    if a < b:
        try:
            data.madvise(mmap.MADV_DONTNEED, a, b - a)
        except (OSError, ValueError):
            pass


def _claimed_events(trace: TraceFile) -> int | None:
    """The events a clean log's footer counts, if that many fit in its bytes (a claim is no allocation)."""
    if not trace.clean or type(trace.footer.counts) is not dict:
        return None
    counts = trace.footer.counts.values()
    if not all(type(c) is int and c >= 0 for c in counts):
        return None
    n = sum(counts)
    return n if n * MIN_EVENT_BYTES <= trace.footer_offset - trace.body_offset else None


def _ints(values) -> np.ndarray | None:
    """`values` (a list or tuple) as int64, or None if one is not an integer within int64 (bools count as 0
    and 1, as numpy reads them among ints)."""
    try:
        a = np.array(values) if len(values) else np.zeros(0, np.int64)
    except (ValueError, TypeError, OverflowError):  # lists among the ints
        return None
    if a.ndim != 1:
        return None
    if a.dtype.kind == "u" and len(a) and a.max() > np.iinfo(np.int64).max:
        return None
    if a.dtype.kind not in "iub":
        return None
    return a.astype(np.int64, copy=False)


def _join(pieces: list[np.ndarray], dtype) -> np.ndarray:
    """The pieces end to end as one array, each freed once copied (the result's pages are touched as they are
    written, so the peak is the pieces and little more, not twice them). A spilled column: its file, mapped."""
    if isinstance(pieces, Column):
        return pieces.array()
    if len(pieces) == 1 and pieces[0].dtype == dtype:
        return pieces.pop()
    out = np.empty(sum(len(p) for p in pieces), dtype)
    pos = 0
    pieces.reverse()
    while pieces:
        p = pieces.pop()
        out[pos:pos + len(p)] = p
        pos += len(p)
        del p
    return out
