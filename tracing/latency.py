"""Per-request latency from a log (issue #19): each request's phases, and the run's TTFT, TPOT, queue time and
time preempted as percentiles. What `mdi-trace info` prints, the Requests view's lifeline and TTFT column, and
the Perfetto export's request slices. No DeepInfer file: its benchmarks measure these from the client side.

A request's life, in a log's times (ns since t0; tracing/SCHEMA.md):

    arrival ── queued ── first scheduled ── prefill ── first token ── decode ── end (finish)
                                               ╰ preempted: preempt → its next schedule (or its end) ╯

- arrival: `request_added`'s `arrival`, when it reached the engine's front door (serve's HTTP receipt, or
  record's replayed arrival); at or before it was added.
- queued: arrival → the first schedule event with a row of it. prefill: → its first appended token (a stale
  token, discarded, is no output). decode: → its finish.
- preempted: each `preempt` → its next schedule (it was waiting, its KV recomputed after), or its end when it
  never ran again. They lie inside prefill or decode; `preempted_ns` is their sum.
- TTFT = first token − arrival; TPOT = (last token − first token) / (tokens − 1), for 2 tokens or more.
- the end: "stop", "length", or for a cancelled request "cancelled: CAUSE" (CANCEL_CAUSES: abort, disconnect,
  shutdown); None while unfinished (a log cut short, a run still going).

Percentiles are numpy's default (linear between the closest ranks), over the requests that have the value:
TTFT over those with a token, TPOT over those with two, queue time over those scheduled, time preempted over
those preempted at least once. A wall-clock time is the header's `time` plus the log time; the header's time is
whole seconds, so a wall time is at most one second early.

    from tracing.latency import scan_latency
    lat = scan_latency(open_trace("run.mdt"))      # one pass, memory per request only
    lat.stats("ttft").p99, lat.requests[3].phases()

`scan_latency` reads the log's raw event arrays in one pass (as the index's scan does); `request_latency` builds
one request's from a TraceIndex's columns, decoding only its request_added, cancel and finish events.
"""
from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tracing.reader import TraceError
from tracing.schema import CANCEL_CAUSES, EVENTS, FINISH_REASONS, KIND, ROW_FIELDS

ADDED, SCHEDULE, PREEMPT, TOKEN = KIND["request_added"], KIND["schedule"], KIND["preempt"], KIND["token"]
CANCEL, FINISH = KIND["cancel"], KIND["finish"]
METRICS = {"ttft": "TTFT", "tpot": "TPOT", "queued": "queue time", "preempted": "time preempted"}


def _at(kind: int, name: str) -> int:
    """The array index of field `name` in an event of `kind` (`[kind, *fields]`)."""
    return EVENTS[kind][1].index(name) + 1


_T = {code: _at(code, "t") for code in (ADDED, SCHEDULE, PREEMPT, TOKEN, CANCEL, FINISH)}
_SEQ = {code: _at(code, "seq_id") for code in (ADDED, PREEMPT, TOKEN, CANCEL, FINISH)}
_ARRIVAL, _ROWS, _APPENDED = _at(ADDED, "arrival"), _at(SCHEDULE, "rows"), _at(TOKEN, "appended")
_CAUSE, _REASON, _ROW_SEQ = _at(CANCEL, "cause"), _at(FINISH, "reason"), ROW_FIELDS.index("seq_id")


@dataclass(slots=True)
class RequestLatency:
    """One request's times (ns since t0, None where the log has none yet), fed its events in log order."""
    seq_id: int
    arrival: int | None = None
    added: int | None = None
    first_scheduled: int | None = None
    first_token: int | None = None
    last_token: int | None = None
    tokens: int = 0                                   # output tokens appended
    preemptions: list[list] = field(default_factory=list)   # [preempt t, next scheduled t or None]
    end: int | None = None
    reason: str | None = None                         # FINISH_REASONS
    cause: str | None = None                          # CANCEL_CAUSES, once cancelled

    # ---- fed in log order ------------------------------------------------------------------------
    def on_added(self, t: int, arrival: int) -> None:
        self.added, self.arrival = t, arrival

    def on_scheduled(self, t: int) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = t
        if self.preemptions and self.preemptions[-1][1] is None:
            self.preemptions[-1][1] = t

    def on_preempt(self, t: int) -> None:
        self.preemptions.append([t, None])

    def on_token(self, t: int) -> None:   # an appended token
        if self.first_token is None:
            self.first_token = t
        self.last_token, self.tokens = t, self.tokens + 1

    def on_cancel(self, cause: int) -> None:
        self.cause = CANCEL_CAUSES[cause] if 0 <= cause < len(CANCEL_CAUSES) else f"cause {cause}"

    def on_finish(self, t: int, reason: int) -> None:
        self.end = t
        self.reason = FINISH_REASONS[reason] if 0 <= reason < len(FINISH_REASONS) else f"reason {reason}"

    # ---- what they give --------------------------------------------------------------------------
    @property
    def ttft_ns(self) -> int | None:
        return _minus(self.first_token, self.arrival)

    @property
    def tpot_ns(self) -> float | None:
        return (self.last_token - self.first_token) / (self.tokens - 1) if self.tokens >= 2 else None

    @property
    def queued_ns(self) -> int | None:
        return _minus(self.first_scheduled, self.arrival)

    @property
    def preempted_ns(self) -> int:
        """Time spent preempted, the intervals still open when the log ends not counted."""
        return sum(b - a for a, b in self._preempted() if b is not None)

    @property
    def outcome(self) -> str | None:
        """"stop", "length", "cancelled: CAUSE", or None while unfinished."""
        return f"cancelled: {self.cause or 'abort'}" if self.reason == "abort" else self.reason

    def _preempted(self) -> list[tuple[int, int | None]]:
        return [(a, b if b is not None else self.end) for a, b in self.preemptions]

    def phases(self, last_ns: int | None = None) -> list[tuple[str, int, int | None]]:
        """(phase, start, end) in time order: queued, prefill, decode, and each preempted interval inside them;
        a phase under way when the log ends ends at `last_ns` (None if not given)."""
        end = self.end if self.end is not None else last_ns
        bounds = [("queued", self.arrival), ("prefill", self.first_scheduled), ("decode", self.first_token)]
        bounds = [(name, t) for name, t in bounds if t is not None]
        out = [(name, t, bounds[k + 1][1] if k + 1 < len(bounds) else end) for k, (name, t) in enumerate(bounds)]
        out += [("preempted", a, b if b is not None else last_ns) for a, b in self._preempted()]
        return sorted(out, key=lambda p: p[1])


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


@dataclass(slots=True)
class Stat:
    """Percentiles of one metric, in ns, over `count` requests."""
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def stat(values) -> Stat | None:
    """The Stat of `values` (ns), None if there are none."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if not len(a):
        return None
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Stat(len(a), float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))


@dataclass(slots=True)
class Latency:
    """Every request of one log (by seq_id, in the order they were added) and the log's last time."""
    requests: dict[int, RequestLatency] = field(default_factory=dict)
    last_ns: int = 0

    def request(self, seq_id: int) -> RequestLatency:
        r = self.requests.get(seq_id)
        if r is None:
            r = self.requests[seq_id] = RequestLatency(seq_id)
        return r

    def stats(self, metric: str) -> Stat | None:
        """The Stat of one of METRICS over the requests that have it."""
        rs = self.requests.values()
        if metric == "preempted":
            return stat(r.preempted_ns for r in rs if r.preemptions)
        return stat(getattr(r, metric + "_ns") for r in rs)

    def outcomes(self) -> Counter:
        """How many requests ended each way ("stop", "length", "cancelled: CAUSE", "unfinished")."""
        return Counter(r.outcome or "unfinished" for r in self.requests.values())

    def outcomes_text(self) -> str:
        """"stop 3, length 10, cancelled 2 (disconnect 1, shutdown 1), unfinished 1", or "no requests"."""
        ends = self.outcomes()
        cancelled = {k.removeprefix("cancelled: "): v for k, v in sorted(ends.items()) if k.startswith("cancelled")}
        parts = [f"{k} {ends[k]}" for k in ("stop", "length") if ends[k]]
        if cancelled:
            parts.append(f"cancelled {sum(cancelled.values())} ("
                         + ", ".join(f"{k} {v}" for k, v in cancelled.items()) + ")")
        parts += [f"{k} {v}" for k, v in sorted(ends.items())
                  if k not in ("stop", "length") and not k.startswith("cancelled")]
        return ", ".join(parts) or "no requests"

    def arrivals(self) -> tuple[int, int] | None:
        """The first and the last arrival, or None without requests."""
        times = [r.arrival for r in self.requests.values() if r.arrival is not None]
        return (min(times), max(times)) if times else None


def scan_latency(trace) -> Latency:
    """Every request's latency in one pass over the log's raw events (a TraceFile), keeping a few numbers per
    request; a log cut short gives what it holds (the reader's TraceError for a damaged event)."""
    lat = Latency()
    try:
        lat.last_ns = _scan(trace, lat.request)
    except (TypeError, IndexError, ValueError, AttributeError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{trace.path} has malformed request events ({type(e).__name__}); cannot measure its "
                         f"latency.") from None
    return lat


def _scan(trace, get) -> int:
    last = 0
    for _, obj in trace.objects():
        code = obj[0]
        if code == TOKEN:
            if obj[_APPENDED] is True:
                get(obj[_SEQ[TOKEN]]).on_token(obj[_T[TOKEN]])
        elif code == SCHEDULE:
            t = obj[_T[SCHEDULE]]
            for row in obj[_ROWS]:
                get(row[_ROW_SEQ]).on_scheduled(t)
        elif code == ADDED:
            get(obj[_SEQ[ADDED]]).on_added(obj[_T[ADDED]], obj[_ARRIVAL])
        elif code == PREEMPT:
            get(obj[_SEQ[PREEMPT]]).on_preempt(obj[_T[PREEMPT]])
        elif code == CANCEL:
            get(obj[_SEQ[CANCEL]]).on_cancel(obj[_CAUSE])
        elif code == FINISH:
            get(obj[_SEQ[FINISH]]).on_finish(obj[_T[FINISH]], obj[_REASON])
        else:
            continue
        last = max(last, obj[_T[code]])
    return last


def request_latency(index, seq_id: int) -> RequestLatency:
    """One request's latency from a TraceIndex: its schedule, preempt and token events from the columns, its
    request_added, cancel and finish events decoded."""
    r = RequestLatency(int(seq_id))
    evs = index.events_of_request(np.int32(seq_id))
    kinds, times, appended = index.kind[evs], index.t[evs], index.appended[evs]
    for i, code, t, app in zip(evs.tolist(), kinds.tolist(), times.tolist(), appended.tolist()):
        if code == TOKEN:
            if app:
                r.on_token(t)
        elif code == SCHEDULE:
            r.on_scheduled(t)
        elif code == PREEMPT:
            r.on_preempt(t)
        elif code in (ADDED, CANCEL, FINISH):
            e = index.event_at(i)
            if code == ADDED:
                r.on_added(e.t, e.arrival)
            elif code == CANCEL:
                r.on_cancel(e.cause)
            else:
                r.on_finish(e.t, e.reason)
    return r


def wall_time(header: dict, ns: int) -> str | None:
    """The wall-clock time of log time `ns`, "YYYY-MM-DD HH:MM:SS UTC" (the header's `time` is whole seconds:
    at most one second early), or None without a readable header time."""
    try:
        start = datetime.datetime.fromisoformat(str(header.get("time")))
    except ValueError:
        return None
    when = start + datetime.timedelta(microseconds=ns // 1000)
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
