"""A trace's numbers at a glance: what `mdi-trace info` and `mdi-trace record` print, and the numbers of the
viewer's Overview (ARCHITECTURE.md §5, §7). One summary, computed in one place: the index's scan
(tracing/index.py) feeds each chunk of events it decodes to `Summary.add_*`, as numpy columns, so the viewer
gets it with its index (`TraceIndex.summary`) and `summarize(trace)` runs the same scan keeping nothing but
the summary (bounded memory, however long the log). No torch, no engine/.

Times in a log are nanoseconds since the header's `t0_ns`; the run's duration is from its first event (a
span's start) to its last (a span's end); a step_digest has no time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tracing.schema import BATCH_KINDS, EVENTS, FINISH_REASONS, KIND, PHASES

_COUNTED = {name: KIND[name] for name in ("request_added", "preempt", "cancel", "epoch_bump", "token")}
_UNTIMED = KIND["step_digest"]
_SPANS = (KIND["cpu_span"], KIND["device_span"])
DEVICE_LANE = len(PHASES)   # a span's lane: 0-2 the CPU PHASES, then the device


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
    epoch_bumps: int = 0
    finish_reasons: Counter = field(default_factory=Counter)   # "stop" / "length" / "abort" -> requests
    first_ns: int | None = None
    last_ns: int = 0
    device_busy_ns: int = 0            # the sum of device spans
    events: int = 0

    @property
    def num_steps(self) -> int:
        return sum(self.steps.values())

    @property
    def sampled_tokens(self) -> int:
        return self.output_tokens + self.stale_tokens

    @property
    def duration_ns(self) -> int:
        return 0 if self.first_ns is None else self.last_ns - self.first_ns

    @property
    def duration_s(self) -> float:
        return self.duration_ns / 1e9

    def per_second(self, n: int) -> float:
        return n / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def device_busy(self) -> float:
        """The fraction of the run's duration the device was running a step."""
        span = self.last_ns - (self.first_ns or 0)
        return self.device_busy_ns / span if span > 0 else 0.0

    # ---- fed by the index's scan, one chunk of events at a time ------------------------------------------
    def add_events(self, kind: np.ndarray, t: np.ndarray, appended: np.ndarray) -> None:
        """A chunk's event kinds, times (an event's `t`, a span's start) and token `appended` flags."""
        count = np.bincount(kind, minlength=len(EVENTS))
        self.events += len(kind)
        self.requests += int(count[_COUNTED["request_added"]])
        self.preemptions += int(count[_COUNTED["preempt"]])
        self.cancellations += int(count[_COUNTED["cancel"]])
        self.epoch_bumps += int(count[_COUNTED["epoch_bump"]])
        out = int(np.count_nonzero(appended))
        self.output_tokens += out
        self.stale_tokens += int(count[_COUNTED["token"]]) - out
        timed = kind != _UNTIMED
        if timed.any():
            first = int(t[timed].min())
            self.first_ns = first if self.first_ns is None else min(self.first_ns, first)
        points = timed & ~np.isin(kind, _SPANS)   # a span's last time is its end (add_spans)
        if points.any():
            self.last_ns = max(self.last_ns, int(t[points].max()))

    def add_spans(self, lane: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """A chunk's CPU and device spans (every one, in log order)."""
        if len(end):
            self.last_ns = max(self.last_ns, int(end.max()))
            device = lane == DEVICE_LANE
            self.device_busy_ns += int((end[device] - start[device]).sum())

    def add_steps(self, batch_kind: np.ndarray, tokens: np.ndarray) -> None:
        """A chunk's schedule events: their batch kinds (BATCH_KINDS codes) and scheduled tokens."""
        for code, n in Counter(batch_kind.tolist()).items():
            self.steps[BATCH_KINDS[code] if 0 <= code < len(BATCH_KINDS) else f"unknown kind {code}"] += n
        self.computed_tokens += int(tokens.sum())

    def add_request(self, prompt_len: int) -> None:
        self.prompt_tokens += prompt_len

    def add_finish(self, reason: int) -> None:
        self.finish_reasons[FINISH_REASONS[reason]] += 1


def summarize(trace) -> Summary:
    """The summary of `trace` (a TraceFile), in one scan that keeps nothing else; sets `trace.cut` if the log
    was cut short, raises the index's TraceError for a damaged one."""
    from tracing.index import scan_summary

    return scan_summary(trace)
