"""Chrome trace JSON for Perfetto (ui.perfetto.dev) and chrome://tracing (ARCHITECTURE.md §5: exporters).

One process per rank ("engine" for a single-process log, "rank R" for each rank of an EP x DP run, on one
time axis: tracing/ranks.py's `offset_ns`), with a track per CPU phase (schedule, execute, process) and a
"device" track:
- a complete slice ("X") per phase per step, named "<phase> <step>", with the batch's batch_kind and size;
- a flow ("s" -> "f", bound to the enclosing slices) from each step's execute slice to its device slice,
  which under ZOS shows step N enqueued while the device still runs N-1;
- counters ("C") of free KV blocks and free state slots, rebuilt from the alloc/free events starting
  from the header's engine config (`num_kv_blocks`, `num_state_slots`);
- instants ("i") for preemptions and cancellations, on the schedule track;
- per request, nested async slices ("b"/"e", category "request", id its seq_id, so a track of its own):
  "request S" from its arrival to its end, holding its phases "queued", "prefill", "decode" and each
  "preempted" interval inside them (tracing/latency.py); the outer slice's args carry its TTFT, TPOT, queue
  time, time preempted and end. A request unfinished when the log ends closes there, with "end": "unfinished".
Times in the JSON are microseconds since the recorder's t0 (the log's are nanoseconds). Pure Python.
"""
from __future__ import annotations

import json
from pathlib import Path

from tracing.latency import Latency, RequestLatency
from tracing.ranks import Run
from tracing.reader import TraceError, TraceFile
from tracing.schema import BATCH_KINDS, PHASES

TRACKS = (*PHASES, "device")          # thread ids 1..4, in this order
TID = {name: i + 1 for i, name in enumerate(TRACKS)}


def chrome_trace(logs: TraceFile | Run) -> dict:
    """One log, or the selected ranks of a run, as a Chrome trace JSON object ({"traceEvents": [...]})."""
    run = logs if isinstance(logs, Run) else Run(logs.path, [logs])
    out: list[dict] = []
    for rank in run.selected:
        trace = run.traces[rank]
        try:
            _Builder(trace, out, rank, run.world_size, run.offset_ns(rank)).build()
        except (IndexError, KeyError, TypeError, ValueError, OverflowError) as e:   # TraceError is a ValueError
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"{trace.path} has malformed events ({type(e).__name__}); cannot export it.") from None
    header = run.header
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"device": str(header.get("device")), "world_size": run.world_size,
                          "checkpoint_digest": str(header.get("checkpoint_digest"))}}


def export_perfetto(logs: TraceFile | Run, out: str | Path, force: bool = True) -> int:
    """Writes the JSON to `out` (an existing file only with `force`); returns the number of trace events."""
    doc = chrome_trace(logs)
    with open(out, "w" if force else "x") as f:
        json.dump(doc, f, separators=(",", ":"))
    return len(doc["traceEvents"])


class _Builder:
    """One log's trace events, appended to `out` as process `rank + 1`, its times shifted by `offset_ns`."""

    def __init__(self, trace: TraceFile, out: list[dict], rank: int = 0, world_size: int = 1, offset_ns: int = 0):
        self.trace, self.out = trace, out
        self.pid, self.world_size, self.offset_ns = rank + 1, world_size, offset_ns
        self.name = "engine" if world_size == 1 else f"rank {rank}"
        engine = trace.header.get("engine") or {}
        self.free = {"free KV blocks": int(engine.get("num_kv_blocks", 0)),
                     "free state slots": int(engine.get("num_state_slots", 0))}
        self.batches: dict[int, dict] = {}          # step -> args of its slices
        self.flow_start: dict[int, float] = {}      # step -> ts of its execute slice
        self.flow_end: dict[int, float] = {}        # step -> ts of its device slice
        self.latency = Latency()                    # every request's phases, fed as the events go by
        self.last = 0                               # the log's last time

    def build(self) -> None:
        self._metadata()
        for name, value in self.free.items():
            self.out.append(self._counter(name, 0, value))
        for e in self.trace.events():
            handler = getattr(self, "_" + e.kind, None)
            if handler:
                try:
                    handler(e)
                except (IndexError, KeyError, TypeError, ValueError, OverflowError) as err:
                    raise TraceError(f"{self.trace.path} is damaged at byte {e.offset}: a malformed {e.kind} event "
                                     f"({type(err).__name__}); cannot export it.") from None
            self.last = max(self.last, getattr(e, "end", None) or getattr(e, "t", 0) or 0)
        for r in self.latency.requests.values():
            self._request(r)
        for step, ts in self.flow_start.items():
            if step in self.flow_end:  # flow ids are global: one per (step, rank)
                flow = {"name": f"step {step}", "cat": "step", "id": step * self.world_size + self.pid - 1,
                        "pid": self.pid}
                self.out.append({**flow, "ph": "s", "tid": TID["execute"], "ts": ts})
                self.out.append({**flow, "ph": "f", "bp": "e", "tid": TID["device"], "ts": self.flow_end[step]})

    def _metadata(self) -> None:
        pid = self.pid
        self.out.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": self.name}})
        self.out.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        for name, tid in TID.items():
            self.out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
            self.out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                             "args": {"sort_index": tid}})

    def _us(self, ns: int) -> float:
        return (ns + self.offset_ns) / 1000

    def _slice(self, track: str, step: int, start: int, end: int) -> None:
        ts = self._us(start)
        self.out.append({"ph": "X", "pid": self.pid, "tid": TID[track], "name": f"{track} {step}", "ts": ts,
                         "dur": (end - start) / 1000, "args": self.batches.get(step, {"step": step})})
        if track == "execute":
            self.flow_start[step] = ts
        elif track == "device":
            self.flow_end[step] = ts

    def _counter(self, name: str, t: int, value: int) -> dict:
        return {"ph": "C", "pid": self.pid, "name": name, "ts": self._us(t), "args": {"free": value}}

    def _count(self, name: str, t: int, delta: int) -> None:
        self.free[name] += delta
        self.out.append(self._counter(name, t, self.free[name]))

    def _instant(self, what: str, t: int, step: int, seq_id: int) -> None:
        self.out.append({"ph": "i", "s": "t", "pid": self.pid, "tid": TID["schedule"], "ts": self._us(t),
                         "name": f"{what} seq {seq_id}", "args": {"step": step, "seq_id": seq_id}})

    def _request(self, r: RequestLatency) -> None:
        """One request's nested async slices: the request, its phases in order, each preemption inside the phase
        it began in (clipped to it, so that they nest)."""
        if r.arrival is None:   # added before the log's first event we hold: nothing to start from
            return
        ms = lambda ns: None if ns is None else round(ns / 1e6, 6)  # noqa: E731
        args = {"seq_id": r.seq_id, "tokens": r.tokens, "ttft_ms": ms(r.ttft_ns), "tpot_ms": ms(r.tpot_ns),
                "queued_ms": ms(r.queued_ns), "preempted_ms": ms(r.preempted_ns), "end": r.outcome or "unfinished"}
        phases = r.phases(self.last)
        base = {"cat": "request", "id": r.seq_id, "pid": self.pid}
        out = self.out
        out.append({**base, "ph": "b", "name": f"request {r.seq_id}", "ts": self._us(r.arrival), "args": args})
        for name, start, end in phases:
            if name == "preempted":
                continue
            out.append({**base, "ph": "b", "name": name, "ts": self._us(start)})
            for inner, a, b in phases:
                if inner == "preempted" and start <= a < end:
                    out.append({**base, "ph": "b", "name": inner, "ts": self._us(a)})
                    out.append({**base, "ph": "e", "name": inner, "ts": self._us(min(b, end))})
            out.append({**base, "ph": "e", "name": name, "ts": self._us(end)})
        out.append({**base, "ph": "e", "name": f"request {r.seq_id}",
                    "ts": self._us(r.end if r.end is not None else self.last)})

    # ---- one method per event kind (tracing/schema.py), each given the event's record ------------------
    def _request_added(self, e):
        self.latency.request(e.seq_id).on_added(e.t, e.arrival)

    def _token(self, e):
        if e.appended is True:
            self.latency.request(e.seq_id).on_token(e.t)

    def _finish(self, e):
        self.latency.request(e.seq_id).on_finish(e.t, e.reason)

    def _schedule(self, e):
        for row in e.rows:
            self.latency.request(row.seq_id).on_scheduled(e.t)
        self.batches[e.step] = {"step": e.step, "batch_kind": BATCH_KINDS[e.batch_kind], "rows": len(e.rows),
                                "tokens": sum(len(r.token_ids) for r in e.rows), "preempted": list(e.preempted)}

    def _cpu_span(self, e):
        self._slice(PHASES[e.phase], e.step, e.start, e.end)

    def _device_span(self, e):
        self._slice("device", e.step, e.start, e.end)

    def _block_alloc(self, e):
        self._count("free KV blocks", e.t, -len(e.block_ids))

    def _block_free(self, e):
        self._count("free KV blocks", e.t, len(e.block_ids))

    def _slot_alloc(self, e):
        self._count("free state slots", e.t, -1)

    def _slot_free(self, e):
        self._count("free state slots", e.t, 1)

    def _preempt(self, e):
        self._instant("preempt", e.t, e.step, e.seq_id)
        self.latency.request(e.seq_id).on_preempt(e.t)

    def _cancel(self, e):
        self._instant("cancel", e.t, e.step, e.seq_id)
        self.latency.request(e.seq_id).on_cancel(e.cause)
