"""A trace's numbers at a glance: what `mdi-trace info` and `mdi-trace record` print (ARCHITECTURE.md §5).

One pass over `TraceFile.events()`, pure Python (no torch, no engine/). Times in a log are nanoseconds
since the header's `t0_ns`; the run's duration is from its first event to its last.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tracing.reader import TraceError, TraceFile
from tracing.schema import BATCH_KINDS, FINISH_REASONS


@dataclass(slots=True)
class Summary:
    requests: int = 0
    prompt_tokens: int = 0             # sum of the requests' prompt lengths
    computed_tokens: int = 0           # every scheduled row's input tokens, recomputation included
    output_tokens: int = 0             # sampled tokens appended to their sequence
    stale_tokens: int = 0              # sampled tokens discarded: preempted, cancelled or finished since
    steps: Counter = field(default_factory=Counter)            # batch kind -> steps
    preemptions: int = 0
    cancellations: int = 0
    finish_reasons: Counter = field(default_factory=Counter)   # "stop" / "length" / "abort" -> requests
    first_ns: int | None = None
    last_ns: int = 0
    device_busy_ns: int = 0            # the sum of device spans
    events: int = 0

    @property
    def num_steps(self) -> int:
        return sum(self.steps.values())

    @property
    def duration_s(self) -> float:
        return 0.0 if self.first_ns is None else (self.last_ns - self.first_ns) / 1e9

    def per_second(self, n: int) -> float:
        return n / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def device_busy(self) -> float:
        """The fraction of the run's duration the device was running a step."""
        span = self.last_ns - (self.first_ns or 0)
        return self.device_busy_ns / span if span > 0 else 0.0


def summarize(trace: TraceFile) -> Summary:
    """Reads every event of `trace` (setting `trace.cut` if it was cut short)."""
    s = Summary()
    for e in trace.events():
        s.events += 1
        try:
            _see_times(s, e.kind, e.fields)
            if e.kind in _HANDLERS:
                _HANDLERS[e.kind](s, e.fields)
        except (IndexError, KeyError, TypeError, ValueError):
            raise TraceError(f"{trace.path} is damaged at byte {e.offset}: a malformed {e.kind} event.") from None
    return s


def _see_times(s: Summary, kind: str, f: list) -> None:
    if kind in ("cpu_span", "device_span"):
        start, end = f[-2], f[-1]
    elif kind == "step_digest":
        return
    else:
        start = end = f[0]  # every other event starts with its time "t"
    s.first_ns = start if s.first_ns is None else min(s.first_ns, start)
    s.last_ns = max(s.last_ns, end)


def _request_added(s: Summary, f: list) -> None:
    s.requests += 1
    s.prompt_tokens += len(f[2])


def _schedule(s: Summary, f: list) -> None:
    s.steps[BATCH_KINDS[f[2]]] += 1
    s.computed_tokens += sum(len(row[3]) for row in f[3])  # ROW_FIELDS: token_ids is the 4th


def _token(s: Summary, f: list) -> None:
    if f[6]:
        s.output_tokens += 1
    else:
        s.stale_tokens += 1


def _preempt(s: Summary, f: list) -> None:
    s.preemptions += 1


def _cancel(s: Summary, f: list) -> None:
    s.cancellations += 1


def _finish(s: Summary, f: list) -> None:
    s.finish_reasons[FINISH_REASONS[f[3]]] += 1


def _device_span(s: Summary, f: list) -> None:
    s.device_busy_ns += f[2] - f[1]


_HANDLERS = {"request_added": _request_added, "schedule": _schedule, "token": _token, "preempt": _preempt,
             "cancel": _cancel, "finish": _finish, "device_span": _device_span}
