"""The viewer's data model, with no Textual imports (ARCHITECTURE.md §7): one log opened by the reader,
its columnar index (tracing/index.py) and what each view asks of them, as plain strings and numpy arrays.

    model = TraceModel("run.mdt")     # opens the log and reads its header and footer: fast
    model.load()                      # the index: one scan, run in a worker thread by the app
    model.step_line(model.step_row(12)), model.step_detail(...), model.event_line(i), model.owners(row)

Nothing here draws; the widgets (tui/views/) ask for the lines they show, so only visible rows are decoded,
each once (an LRU cache per kind of line). Vocabulary as in tracing/SCHEMA.md: step, seq_id (a request),
epoch, block_table, state_slot, num_tokens, batch_kind; a "row" is a row of `TraceIndex.steps` (one per step, in
log order), a "batch row" one of a schedule event's rows. Column headers abbreviate (seq, slot).
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from tracing.index import BLOCK_EVENTS, SLOT_EVENTS, TraceIndex, check_budget
from tracing.latency import request_latency, wall_time
from tracing.ranks import open_run
from tracing.reader import TraceError, TraceFile
from tracing.spill import blocks_of, release, take
from tracing.schema import BATCH_KINDS, EVENTS, FINISH_REASONS, KIND, Event
from tui.format import EventFilter, describe, fmt_ns, plural, short_list
from tui.lanes import Lanes

SCHEDULE, TOKEN, FINISH = KIND["schedule"], KIND["token"], KIND["finish"]
KIND_NAMES = [EVENTS[k][0] for k in sorted(EVENTS) if EVENTS[k][0] != "footer"]
STEP_HEADER = f"{'step':>7} {'kind':<7} {'rows':>4} {'tokens':>6} {'preempt':>7} {'duration':>10} {'device':>10}"
EVENT_HEADER = f"{'#':>8} {'time':>10} {'step':>6} {'seq':>4} {'kind':<13} fields"
MAX_POOL = 1 << 22         # KV blocks or state slots at most (the ownership arrays are this long)
LIFELINE_TOKENS = 24      # output tokens decoded for a lifeline's summary line (each is listed anyway)
DETAIL_HEADER = (f"  {'seq':>5} {'epoch':>5} {'positions':>11} {'num_tokens':>10} {'slot':>4} {'sampled':>9}  "
                 "block_table")
REQUEST_HEADER = (f"{'seq':>5} {'prompt':>6} {'output':>6} {'preempt':>7} {'ttft':>7} finish")  # output: tokens appended


class TraceModel:
    """One log and its index; `load()` must have run before anything but `path`, `header`, `trace`."""

    def __init__(self, path: str | Path, trace: TraceFile | None = None, rank: int | None = None, offset: int = 0):
        self.path = Path(path)
        self.trace = trace or TraceFile(self.path)   # TraceError for a missing, empty or foreign file
        self.header = self.trace.header
        self.size = len(self.trace.data)
        self.index: TraceIndex | None = None
        self.rank = rank         # this log's rank in a run of several, else None
        self.offset = offset     # ns added to this log's times to put every rank of the run on one axis

    @property
    def ready(self) -> bool:
        return self.index is not None

    def load(self, progress=None, budget: int | None = None) -> None:
        """The slow part: scan the log (TraceError if damaged) and derive what the views need. `budget`: the bytes
        of memory it may plan on (TooBig, one sentence, for a log that needs more); None: no limit."""
        ix = TraceIndex(self.trace, progress, budget)
        self.steps, self.lanes = ix.steps, Lanes(ix.steps)
        self.sched_event = ix.events_of_kind("schedule")                      # event index per step row
        self._step_sorted = np.argsort(ix.steps.step, kind="stable")
        self._steps_in_order = ix.steps.step[self._step_sorted]
        self.seq_ids = ix.request_ids()                    # every request of the log, ascending
        self.prompt_len = self._per_seq(ix, "request_added", lambda e: len(e.prompt_token_ids))
        self.appended = ix.appended                        # per event: a token event that was appended
        # per request: output tokens appended (stale ones not), stale tokens, preemptions
        self.request_tokens, self.request_stale, self.request_preemptions = self._per_request(ix)
        self.finish_reasons = self._per_seq(ix, "finish", lambda e: FINISH_REASONS[_enum(e.reason, FINISH_REASONS)])
        engine = self.header.get("engine")
        engine = engine if isinstance(engine, dict) else {}
        res = ix.resources
        self.num_blocks = max(_count(engine.get("num_kv_blocks")), _max_id(res, BLOCK_EVENTS, self.path) + 1)
        self.num_slots = max(_count(engine.get("num_state_slots")), _max_id(res, SLOT_EVENTS, self.path) + 1)
        self.blocks_in_use, self.slots_in_use = self._occupancy(res, BLOCK_EVENTS), self._occupancy(res, SLOT_EVENTS)
        self.index = ix
        self._event_cache = lru_cache(maxsize=8192)(self._event_line)
        self.latency = lru_cache(maxsize=4096)(lambda seq: request_latency(ix, seq))  # seq_id -> RequestLatency

    def _per_seq(self, ix: TraceIndex, kind: str, value) -> dict:
        """seq_id -> value(event) over the events of one kind; TraceError naming a malformed one."""
        out = {}
        events = ix.events_of_kind(kind)
        for i, seq in zip(events.tolist(), take(ix.seq_id, events).tolist()):
            e = ix.event_at(i)
            try:
                out[seq] = value(e)
            except (TypeError, ValueError, IndexError, KeyError):
                raise TraceError(f"{self.path} is damaged at byte {e.offset}: a malformed {kind} event.") from None
        return out

    # ---- steps -----------------------------------------------------------------------------------
    def step_row(self, step: int) -> int | None:
        """The StepTable row of step number `step`, or None."""
        order = self._step_sorted
        k = int(np.searchsorted(self._steps_in_order, _i32(step)))
        return int(order[k]) if k < len(order) and self.steps.step[order[k]] == step else None

    def rows_of_steps(self, steps: np.ndarray) -> np.ndarray:
        """StepTable rows of step numbers that exist (vectorized `step_row`)."""
        order = self._step_sorted
        k = np.clip(np.searchsorted(self._steps_in_order, steps.astype(np.int32)), 0, max(len(order) - 1, 0))
        return order[k] if len(order) else np.zeros(0, np.int64)

    def row_of_event(self, i: int) -> int:
        """The step row an event belongs to: its own step, else the last step scheduled before it."""
        step = int(self.index.step[i])
        row = self.step_row(step) if step >= 0 else None
        return row if row is not None else max(int(np.searchsorted(self.sched_event, i, "right")) - 1, 0)

    def step_line(self, r: int) -> str:
        s = self.steps
        dur = s.process_end[r] - s.schedule_start[r] if s.process_end[r] >= 0 and s.schedule_start[r] >= 0 else -1
        dev = s.device_end[r] - s.device_start[r] if s.device_start[r] >= 0 else -1
        kind = BATCH_KINDS[s.batch_kind[r]] if s.batch_kind[r] < len(BATCH_KINDS) else "?"
        return (f"{s.step[r]:>7} {kind:<7} {s.rows[r]:>4} "
                f"{s.tokens[r]:>6} {s.preemptions[r]:>7} {_dur(dur):>10} {_dur(dev):>10}")

    def schedule_event(self, r: int) -> Event:
        return self.index.event_at(int(self.sched_event[r]))

    def step_detail(self, r: int) -> list[str]:
        """The selected step: its spans, then one line per batch row with the token it sampled."""
        s, e = self.steps, self.schedule_event(r)
        step = int(s.step[r])
        sampled = {}
        for i in self.index.events_of_step(_i32(step), "token"):
            t = self.index.event_at(i)
            sampled[t.seq_id] = f"{t.token_id}" + ("" if t.appended else " stale")
        spans = "  ".join(f"{name} {_dur(end - start)}" for name, start, end in (
            ("schedule", s.schedule_start[r], s.schedule_end[r]), ("execute", s.execute_start[r], s.execute_end[r]),
            ("process", s.process_start[r], s.process_end[r]), ("device", s.device_start[r], s.device_end[r]))
            if start >= 0)
        gap = self.lanes.gap_before(r)
        lines = [f"step {step}: {batch_kind(e)}, {plural(len(e.rows), 'row')}, {plural(s.tokens[r], 'token')}, "
                 f"scheduled at {fmt_ns(e.t + self.offset)}"
                 + (f", preempted {short_list(e.preempted)}" if e.preempted else ""),
                 f"  {spans}" + (f"  device idle {fmt_ns(gap)} before it" if gap else ""),
                 DETAIL_HEADER]
        for row in e.rows:
            try:
                n = len(row.token_ids)
                pos = f"{row.start}-{row.start + n - 1}" if n > 1 else f"{row.start}"
                tok = sampled.get(row.seq_id, "pending") if row.sample else "-"
                lines.append(f"  {row.seq_id:>5} {row.epoch:>5} {pos:>11} {n:>10} {row.state_slot:>4} "
                             f"{tok:>9}  {short_list(row.block_table, 12)}")
            except (TypeError, ValueError, KeyError):
                lines.append(f"  a malformed row: {list(row)!r:.80}")
        return lines

    # ---- requests --------------------------------------------------------------------------------
    def _per_request(self, ix: TraceIndex) -> np.ndarray:
        """Per request (in `seq_ids` order): token events appended, stale token events, preemptions. One pass
        over the columns, a block at a time (a spilled index's pages handed back as it goes)."""
        out = np.zeros((3, len(self.seq_ids)), np.int64)
        for _, (kind, seq, appended) in blocks_of(ix.kind, ix.seq_id, ix.appended):
            for row, mask in enumerate((appended, (kind == TOKEN) & ~appended, kind == KIND["preempt"])):
                pos = np.searchsorted(self.seq_ids, seq[mask & (seq >= 0)])
                out[row] += np.bincount(pos, minlength=len(self.seq_ids))
        return out

    def request_line(self, i: int) -> str:
        """One request: seq_id, prompt length, output tokens appended (stale ones not), preemptions, TTFT (arrival
        to first token, tracing/latency.py), finish."""
        seq = int(self.seq_ids[i])
        ttft = self.latency(seq).ttft_ns
        return (f"{seq:>5} {self.prompt_len.get(seq, '?'):>6} {self.request_tokens[i]:>6} "
                f"{self.request_preemptions[i]:>7} {'-' if ttft is None else fmt_ns(ttft):>7} "
                f"{self.finish_reasons.get(seq, 'running')}")

    def lifeline(self, seq: int) -> tuple[list[str], np.ndarray]:
        """(summary lines, event indices) of one request: every event that names it or schedules it. The lines:
        its arrival and parameters, its phases and latency, its event counts, its output tokens."""
        ix = self.index
        evs = ix.events_of_request(_i32(seq))
        kinds = ix.kind[evs]
        rows = self.rows_of_steps(ix.step[evs[kinds == SCHEDULE]])
        prefill = int(np.count_nonzero(self.steps.batch_kind[rows] == 0)) if len(rows) else 0
        added = evs[kinds == KIND["request_added"]]
        head, lat = f"request {seq}", self.latency(int(seq))
        if len(added):
            a = ix.event_at(int(added[0]))
            wall = wall_time(self.header, a.arrival)
            head += (f": arrived at {fmt_ns(a.arrival + self.offset)}" + (f" (≈ {wall[11:]})" if wall else "")
                     + (f", added {fmt_ns(a.t - a.arrival)} later" if a.t > a.arrival else "") + ", "
                     f"prompt {plural(self.prompt_len[seq], 'token') if seq in self.prompt_len else '? tokens'}, "
                     f"max_tokens {a.max_tokens}, temperature {a.temperature}")
        count = lambda kind: int(np.count_nonzero(kinds == KIND[kind]))  # noqa: E731
        counts = (f"  {plural(prefill, 'prefill chunk')}, {plural(len(rows) - prefill, 'decode step')}, "
                  f"{plural(count('reservation'), 'reservation')}, {plural(count('epoch_bump'), 'epoch bump')}, "
                  f"{plural(count('preempt'), 'preemption')}, {plural(count('cancel'), 'cancellation')}; "
                  f"finish: {self.finish_reasons.get(seq, 'not finished')}")
        k = int(np.searchsorted(self.seq_ids, seq))
        known = k < len(self.seq_ids) and self.seq_ids[k] == seq
        n, stale = (int(self.request_tokens[k]), int(self.request_stale[k])) if known else (0, 0)
        appended = evs[self.appended[evs]]     # the same count as the Requests list's `output` column
        ids = [ix.event_at(int(i)).token_id for i in appended[:LIFELINE_TOKENS]]
        shown = " ".join(map(str, ids)) + (" …" if n > len(ids) else "")
        out = f"  output: {plural(n, 'token')} appended" + (f" ({stale} stale, discarded)" if stale else "") + \
            f": [{shown}]"
        self._marks = (seq, self._phase_marks(lat, evs, kinds))
        return [head, "  " + phases_text(lat), counts, out], evs

    def _phase_marks(self, lat, evs: np.ndarray, kinds: np.ndarray) -> dict[int, str]:
        """event index -> the phase its lifeline line ends or starts (tracing/latency.py): queued up to the first
        schedule, prefill up to the first token, each preemption up to the next schedule, decode up to the finish."""
        marks, sched = {}, evs[kinds == SCHEDULE]
        tokens = evs[self.appended[evs]]
        if len(sched) and lat.queued_ns is not None:
            marks[int(sched[0])] = f"queued: {fmt_ns(lat.queued_ns)}"
        if len(tokens) and lat.ttft_ns is not None:
            marks[int(tokens[0])] = (f"first token, TTFT {fmt_ns(lat.ttft_ns)}; prefill: "
                                     f"{fmt_ns(lat.first_token - lat.first_scheduled)}")
        for p, (start, stop) in zip(evs[kinds == KIND["preempt"]], lat.preemptions):
            k = int(np.searchsorted(sched, p))
            if k < len(sched) and stop is not None:
                marks[int(sched[k])] = f"preempted: {fmt_ns(stop - start)}"
        for i in evs[kinds == KIND["cancel"]][:1]:
            marks[int(i)] = lat.outcome or "cancelled"
        for i in evs[kinds == FINISH][:1]:
            if lat.first_token is not None:
                marks[int(i)] = f"decode: {fmt_ns(lat.end - lat.first_token)}"
        return marks

    def lifeline_line(self, seq: int, i: int) -> str:
        """One event of a request's lifeline; a schedule event shows the request's own row."""
        try:
            return self._lifeline_line(seq, i)
        except (TypeError, ValueError, KeyError, IndexError):
            return f"{fmt_ns(self.index.t[i] + self.offset):>10} a malformed {EVENTS[int(self.index.kind[i])][0]} event"

    def _lifeline_line(self, seq: int, i: int) -> str:
        e = self.index.event_at(i)
        when = f"{fmt_ns(self.index.t[i] + self.offset):>10}"
        marks = self._marks[1] if getattr(self, "_marks", (None,))[0] == seq else {}
        mark = f"[{marks[i]}] " if i in marks else ""    # the phase this event ends or starts
        if e.kind != "schedule":
            step = self.index.step[i]
            return f"{when} {'' if step < 0 else f'step {step}':>10} {e.kind:<13} {mark}{describe(e)}".rstrip()
        for row in e.rows:
            if row.seq_id == seq:
                n = len(row.token_ids)
                what = "prefill chunk" if batch_kind(e) == "prefill" else "decode"
                pos = f"positions {row.start}-{row.start + n - 1} ({n} tokens)" if n > 1 else f"position {row.start}"
                return (f"{when} {f'step {e.step}':>10} {what:<13} {mark}{pos}, epoch {row.epoch}, "
                        f"slot {row.state_slot}, block_table {short_list(row.block_table)}"
                        + (", samples" if row.sample else ""))
        return f"{when} {f'step {e.step}':>10} schedule"

    # ---- events ----------------------------------------------------------------------------------
    def event_line(self, i: int) -> str:
        return self._event_cache(int(i))

    def _event_line(self, i: int) -> str:
        t = int(self.index.t[i])
        return format_event(i, self.index.event_at(i), t + self.offset if t >= 0 else t)

    def filtered(self, f: EventFilter) -> np.ndarray:
        """Indices of the events that pass `f`, in log order."""
        ix = self.index
        named = ix.events_of_request(_i32(f.seq_id)) if f.seq_id is not None else None
        sink = ix.column(np.intp)            # a spilled index's list goes to a file of its own
        pieces = [] if sink is None else sink
        for lo, (kind, step) in blocks_of(ix.kind, ix.step):
            keep = np.ones(len(kind), dtype=bool)
            if f.kinds:
                keep &= np.isin(kind, [KIND[k] for k in f.kinds])
            if named is not None:
                mask = np.zeros(len(kind), dtype=bool)
                mask[named[np.searchsorted(named, lo):np.searchsorted(named, lo + len(kind))] - lo] = True
                keep &= mask
            if f.steps is not None:
                keep &= (step >= f.steps[0]) & (step <= f.steps[1])
            pieces.append(np.flatnonzero(keep) + lo)
        if sink is not None:
            return sink.array()
        return np.concatenate(pieces) if pieces else np.zeros(0, np.intp)

    def search(self, pattern: re.Pattern, shown: np.ndarray, pos: int, forward: bool, stop=lambda: False):
        """The position in `shown` of the next (or previous) event after `pos` whose line matches, or None.
        `stop()` is polled so that a worker can give up."""
        step = 1 if forward else -1
        p = pos + step
        while 0 <= p < len(shown):
            if p % 4096 == 0 and stop():
                return None
            if pattern.search(self.event_line(int(shown[p]))):
                return p
            p += step
        return None

    def next_of_kind(self, kind: str, after: int, forward: bool = True) -> int | None:
        """The index of the next (or previous) event of `kind` after event `after`, or None."""
        return self.index.next_of_kind(kind, after, forward)

    # ---- resources -------------------------------------------------------------------------------
    def owners(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(owner seq_id per KV block, per state slot; -1 if free) just after step row r was scheduled."""
        res = self.index.resources
        k = int(np.searchsorted(res.event, self.sched_event[r], "right"))
        release(res.event)
        out = []
        for codes, n in ((BLOCK_EVENTS, self.num_blocks), (SLOT_EVENTS, self.num_slots)):
            last = np.full(n, -1, dtype=np.int64)      # per resource: its last row up to k
            for lo, (kind, resource) in blocks_of(res.kind[:k], res.resource[:k]):
                sel = np.flatnonzero(np.isin(kind, codes))
                np.maximum.at(last, resource[sel], sel + lo)
            owner = np.full(n, -1, dtype=np.int64)
            held = last >= 0
            held[held] = take(res.kind, last[held]) == codes[0]
            owner[held] = take(res.seq_id, last[held])
            out.append(owner)
        return out[0], out[1]

    def _occupancy(self, res, codes) -> np.ndarray:
        """Blocks (or slots) owned just after each step row was scheduled: a running sum over the resource rows,
        a block at a time, read where each step's rows end."""
        ends = np.searchsorted(res.event, self.sched_event, "right")    # ascending, as the steps' events are
        release(res.event)
        out, total = np.zeros(len(ends), np.int64), 0
        for lo, (kind,) in blocks_of(res.kind):
            cum = np.cumsum(np.where(kind == codes[0], 1, np.where(kind == codes[1], -1, 0))) + total
            a, b = np.searchsorted(ends, [lo, lo + len(kind)], "right")
            out[a:b] = cum[ends[a:b] - lo - 1]
            total = int(cum[-1])
        return out

    # ---- overview --------------------------------------------------------------------------------
    def overview(self) -> list[tuple[str, str]]:
        """(label, text) rows of the run: the header, the counts, the throughput and the device's time."""
        h, e = self.header, self.header.get("engine") or {}
        rows = [("trace", f"{self.path} ({self.size / 1024:,.0f} KiB)"),
                ("recorded", f"{h.get('time')} on {h.get('device')}, {h.get('model_source')} {h.get('dtype')}, "
                             f"seed {h.get('seed')}"),
                ("engine", ", ".join(f"{k} {v}" for k, v in e.items() if k != "eos_token_id"))]
        if not self.ready:
            counts = self.trace.footer.counts if self.trace.clean else {}
            rows.append(("events", f"{sum(counts.values()):,} (from the footer; indexing…)" if counts
                         else "indexing…"))
            return rows
        lanes, sm = self.lanes, self.index.summary   # the run's numbers: the same as `mdi-trace info`'s
        dur = max(sm.duration_ns, 1)
        rows += [("events", f"{sm.events:,}"),
                 ("requests", f"{sm.requests}; finished: "
                              + (", ".join(f"{k} {v}" for k, v in sorted(sm.finish_reasons.items())) or "none")),
                 ("steps", f"{sm.num_steps:,} ({sm.steps['prefill']:,} prefill, {sm.steps['decode']:,} decode)"),
                 ("tokens", f"{sm.computed_tokens:,} computed, {sm.sampled_tokens:,} sampled, "
                            f"{sm.output_tokens:,} appended as output"),
                 ("preemptions", f"{sm.preemptions}, cancellations {sm.cancellations}, epoch bumps {sm.epoch_bumps}"),
                 ("duration", f"{fmt_ns(dur)}"),
                 ("throughput", f"{sm.computed_tokens / dur * 1e9:,.0f} computed tokens/s, "
                                f"{sm.sampled_tokens / dur * 1e9:,.0f} sampled tokens/s, "
                                f"{sm.num_steps / dur * 1e9:,.1f} steps/s"),
                 ("device", f"busy {100 * sm.device_busy:.0f}%; ZOS overlap: the CPU phases ran "
                            f"{100 * lanes.overlap / max(lanes.cpu_busy, 1):.0f}% of their time "
                            f"({fmt_ns(lanes.overlap)} of {fmt_ns(lanes.cpu_busy)}) while the device was busy"),
                 ("idle gaps", self._gaps_text())]
        return rows

    def counts(self) -> str:
        """One line of this log's counts: the Overview's row for a rank of a run."""
        if not self.ready:
            return "indexing…"
        sm = self.index.summary
        return (f"{plural(sm.events, 'event', spec=',')}, {plural(sm.requests, 'request')}, "
                f"{plural(sm.num_steps, 'step', spec=',')} ({sm.steps['prefill']:,} prefill), "
                f"{plural(sm.sampled_tokens, 'token', spec=',')} sampled, "
                f"{plural(sm.preemptions, 'preemption')}, device busy {fmt_ns(sm.device_busy_ns)}")

    def _gaps_text(self) -> str:
        lanes = self.lanes
        if not len(lanes.gap_len):
            return "none"
        top = np.argsort(-lanes.gap_len, kind="stable")[:3]
        worst = ", ".join(f"{fmt_ns(lanes.gap_len[g])} before step {self.steps.step[lanes.gap_row[g]]}" for g in top)
        return f"{len(lanes.gap_len):,}, {fmt_ns(lanes.gap_len.sum())} in all; longest {worst}"

    def warnings(self) -> list[str]:
        cut = self.index.cut if self.ready else None
        return [f"{cut}."] if cut else []


MEMORY_MARGIN = 256 << 20   # bytes left to the rest of the process (Textual, the widgets, the caches)


def available_memory() -> int | None:
    """Bytes this process can still use: the kernel's MemAvailable, or less where a cgroup limit (a container,
    a systemd slice) leaves less; None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in dict.fromkeys(_cgroup_files()):
        try:
            with open(limit) as f:
                text = f.read().strip()
            with open(usage) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text.isdigit() and int(text) < 1 << 60:   # "max", or v1's huge number: no limit
            found.append(int(text) - used)
    return min(found) if found else None


def _cgroup_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup, v2 then v1, and the mount's root (where a container
    sees its own cgroup)."""
    out = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
           ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and controllers == "":
                    base = "/sys/fs/cgroup" + path.rstrip("/")
                    out.append((base + "/memory.max", base + "/memory.current"))
                elif "memory" in controllers.split(","):
                    base = "/sys/fs/cgroup/memory" + path.rstrip("/")
                    out.append((base + "/memory.limit_in_bytes", base + "/memory.usage_in_bytes"))
    except (OSError, ValueError):
        pass
    return out


class RunModel:
    """The logs of one run (tracing/ranks.py): one TraceModel per rank, each with its rank and time offset,
    or a single TraceModel for a single-process log. `start_rank`: the rank whose own file was named."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        run = open_run(self.path)    # TraceError for a missing, foreign or mismatched set of files
        several = run.world_size > 1
        self.models = [TraceModel(t.path, t, k if several else None, run.offset_ns(k) if several else 0)
                       for k, t in enumerate(run.traces)]
        self.start_rank = run.named_rank or 0
        self.header = run.header

    @property
    def world_size(self) -> int:
        return len(self.models)

    @property
    def size(self) -> int:
        return sum(m.size for m in self.models)

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.models)

    @property
    def clean(self) -> bool:
        return all(m.trace.clean for m in self.models)

    def grown(self) -> bool:
        """Whether any rank's log has changed size since it was opened (OSError if one is gone)."""
        return any(m.path.stat().st_size != m.size for m in self.models)

    def load(self, progress=None, budget: int | None = -1) -> None:
        """Index every rank's log in turn; `progress(offset)` counts bytes over the whole run. `budget`: the bytes
        of memory the indexes may plan on together (-1: what this machine has available now, less a margin;
        None: no limit); an index that needs more (or over tracing/index.py's RAM_LIMIT) is spilled to disk, and a
        run that neither can hold raises TooBig, one sentence, instead of running out of memory."""
        budget = self.budget() if budget == -1 else budget
        done = 0
        for m in self.models:
            m.load(None if progress is None else lambda offset, base=done: progress(base + offset), budget)
            done += m.size
            if budget is not None:
                # what this rank keeps in memory, and the Events view's list (in a file of its own if spilled)
                budget -= m.index.memory + (0 if m.index.spilled else 8 * len(m.index))

    @staticmethod
    def budget() -> int | None:
        """The bytes the indexes may plan on: what this machine has available now, less a margin (None: unknown)."""
        free = available_memory()
        return None if free is None else free - MEMORY_MARGIN

    def check_memory(self) -> None:
        """TooBig, before any scan, if the footers of the run's logs count more events than memory or disk can
        index."""
        budget = self.budget()
        for m in self.models if budget is not None else ():
            budget -= check_budget(m.trace, budget)

    def time_range(self) -> tuple[int, int]:
        """(first, last) ns of every rank's lanes on the run's time axis."""
        return (min(int(m.lanes.t_min) + m.offset for m in self.models),
                max(int(m.lanes.t_max) + m.offset for m in self.models))

    def overview(self, rank: int) -> list[tuple[str, str]]:
        """The Overview's rows: a single log's own, or the run's, one counts row per rank, then rank `rank`'s."""
        model = self.models[rank]
        rows = model.overview()
        if self.world_size == 1:
            return rows
        rows[0] = ("trace", f"{self.path} ({self.size / 1024:,.0f} KiB in {self.world_size} rank logs)")
        rows.insert(3, ("ranks", f"{self.world_size} (EP x DP, run id {self.header.get('run_id')}): "
                                 + ", ".join(f"rank {m.rank} {m.path.name} (t0 +{fmt_ns(m.offset)})"
                                             for m in self.models)))
        for m in self.models:
            rows.insert(4 + m.rank, (f"rank {m.rank}", m.counts()))
        rows.insert(4 + self.world_size, ("", ""))
        rows.insert(5 + self.world_size, (f"rank {rank} ▸", "the rows below (R: next rank)"))
        return rows


def phases_text(lat) -> str:
    """A request's phases and latency in one line (tracing/latency.py): "queued 1.2 ms, prefill 30 ms, decode
    0.9 s, preempted 2 ms (1×); TTFT 31 ms, TPOT 9.1 ms; cancelled: disconnect"."""
    spans = [(name, end - start) for name, start, end in lat.phases() if name != "preempted" and end is not None]
    parts = [f"{name} {fmt_ns(ns)}" for name, ns in spans]
    if lat.preemptions:
        parts.append(f"preempted {fmt_ns(lat.preempted_ns)} ({len(lat.preemptions)}×)")
    times = [f"{k} {fmt_ns(v)}" for k, v in (("TTFT", lat.ttft_ns), ("TPOT", lat.tpot_ns)) if v is not None]
    return "; ".join(p for p in (", ".join(parts), ", ".join(times), lat.outcome or "not finished") if p)


def format_event(i: int, e: Event, t: int) -> str:
    """One line of the Events view."""
    step = getattr(e, "step", None) if e.kind != "request_added" else None
    seq = getattr(e, "seq_id", None) if e.kind not in ("schedule", "cpu_span", "device_span", "step_digest") else None
    return (f"{i:>8} {fmt_ns(t) if t >= 0 else '':>10} {'' if step is None else step:>6} "
            f"{'' if seq is None else seq:>4} {e.kind:<13} {describe(e)}").rstrip()


def batch_kind(e: Event) -> str:
    """A schedule event's batch kind by name ("?" for a code outside BATCH_KINDS)."""
    code = e.batch_kind
    return BATCH_KINDS[code] if code in range(len(BATCH_KINDS)) else "?"


def _i32(value: int) -> np.int32:
    """A step or seq_id to search the index's int32 columns with: a Python int would make numpy convert the
    whole column to int64 first, 20 ms a lookup at 10M events (the key budget is 50 ms)."""
    return np.int32(max(min(int(value), np.iinfo(np.int32).max), np.iinfo(np.int32).min))


def _dur(ns) -> str:
    return fmt_ns(ns) if ns >= 0 else "-"


def _max_id(res, codes, path) -> int:
    top = -1
    for _, (kind, resource) in blocks_of(res.kind, res.resource):
        sel = np.isin(kind, codes)
        top = max(top, int(resource[sel].max()) if sel.any() else -1)
    if top >= MAX_POOL:
        raise TraceError(f"{path} is damaged: it names block or slot {top}, beyond any pool this viewer draws "
                         f"({MAX_POOL}).")
    return top


def _count(value) -> int:
    """A pool size from the header, or 0 if it is not a sane one."""
    return value if type(value) is int and 0 <= value < MAX_POOL else 0


def _enum(code, values) -> int:
    if type(code) is not int or not 0 <= code < len(values):
        raise ValueError(code)
    return code

