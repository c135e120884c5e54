"""Text helpers of the viewer, with no Textual imports: times in ns as short human units, the user's
time and filter syntax parsed, one event as one line of text (ARCHITECTURE.md §7).

Every time in a log is an integer of nanoseconds since the header's t0_ns (tracing/SCHEMA.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tracing.schema import BATCH_KINDS, CANCEL_CAUSES, EPOCH_REASONS, FINISH_REASONS, KIND, PHASES, Event

UNITS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def fmt_ns(ns: int | float) -> str:
    """A duration or a time in ns, in the largest unit that keeps it at least 1: 850 ns, 12.3 µs, 4.56 ms."""
    ns = float(ns)
    if abs(ns) < 1_000:
        return f"{ns:.0f} ns"
    for unit, scale in (("µs", 1e3), ("ms", 1e6)):
        if abs(ns) < scale * 1_000:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns / 1e9:.4g} s"


def plural(n, one: str, many: str | None = None, spec: str = "") -> str:
    """`n` and the noun that agrees with it: 1 row, 2 rows, 0 rows (`many` for an irregular plural, `spec`
    formats the number: "," gives 1,024)."""
    return f"{n:{spec}} {noun(n, one, many)}"


def noun(n, one: str, many: str | None = None) -> str:
    """The noun alone that agrees with `n`, for a count with words between ("3 sampled tokens")."""
    return one if n == 1 else many or one + "s"


def parse_time(text: str) -> int:
    """ns since t0 from `1.5s`, `120 ms`, `40us`, `900ns` or a bare number (milliseconds); ValueError
    with one sentence otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ns|us|µs|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a time; write e.g. 1.5s, 120ms, 40us or 900ns.")
    return int(float(m.group(1)) * UNITS[m.group(2) or "ms"])


def parse_int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a {what} number.") from None


@dataclass(slots=True)
class EventFilter:
    """Which events the Events view shows: kinds (empty: all), one request, a step range (inclusive)."""
    kinds: tuple[str, ...] = ()
    seq_id: int | None = None
    steps: tuple[int, int] | None = None

    def __str__(self) -> str:
        parts = [f"kind={','.join(self.kinds)}"] if self.kinds else []
        parts += [f"seq={self.seq_id}"] if self.seq_id is not None else []
        parts += [f"step={self.steps[0]}:{self.steps[1]}"] if self.steps else []
        return " ".join(parts) or "all events"


def parse_filter(text: str) -> EventFilter:
    """`kind=preempt,cancel seq=12 step=100:200` (any subset, any order; empty: all events)."""
    f = EventFilter()
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "kind":
            kinds = tuple(k for k in value.split(",") if k)
            bad = [k for k in kinds if k not in KIND or k == "footer"]
            if bad or not kinds:
                raise ValueError(f"no event kind {bad[0] if bad else value!r}; the kinds are "
                                 f"{', '.join(k for k in KIND if k != 'footer')}.")
            f.kinds = kinds
        elif key in ("seq", "request", "seq_id"):
            f.seq_id = parse_int(value, "request")
        elif key == "step":
            lo, sep, hi = value.partition(":")
            f.steps = (parse_int(lo or "0", "step"), parse_int(hi, "step") if sep and hi else
                       (2**31 - 1 if sep else parse_int(lo, "step")))
        else:
            raise ValueError(f"{word!r} is not a filter; write kind=NAME[,NAME] seq=N step=A:B.")
    return f


def short_list(values, limit: int = 8) -> str:
    """[3 4 5 … 19] (24): a long list cut to its first items and its length."""
    values = list(values)
    shown = " ".join("·" if v is None else str(v) for v in values[:limit])
    return f"[{shown} … ] ({len(values)})" if len(values) > limit else f"[{shown}]"


def describe(e: Event) -> str:
    """The fields of one event that are not its time, step or seq_id, as text; enum codes by name."""
    f = dict(zip(e.names, e))
    k = e.kind
    try:
        if k == "schedule":
            rows = " ".join(f"{r.seq_id}@{r.start}+{len(r.token_ids)}" for r in f["rows"][:6])   # seq@start+num_tokens
            rows += " …" if len(f["rows"]) > 6 else ""
            pre = f", preempted {short_list(f['preempted'])}" if f["preempted"] else ""
            return f"{BATCH_KINDS[f['batch_kind']]}, {plural(len(f['rows']), 'row')}: {rows}{pre}"
        if k == "request_added":
            return (f"prompt {plural(len(f['prompt_token_ids']), 'token')}, max_tokens {f['max_tokens']}, "
                    f"temperature {f['temperature']:g}, seed {f['seed']}")
        if k == "epoch_bump":
            return f"epoch {f['epoch']} ({EPOCH_REASONS[f['reason']]})"
        if k == "finish":
            return FINISH_REASONS[f["reason"]]
        if k == "cancel":
            return f"cause {CANCEL_CAUSES[f['cause']]}"
        if k == "cpu_span":
            return f"{PHASES[f['phase']]} {fmt_ns(f['end'] - f['start'])}"
        if k == "device_span":
            return f"device {fmt_ns(f['end'] - f['start'])}"
        if k == "token":
            return (f"token {f['token_id']} at position {f['position']}, epoch {f['epoch']}"
                    + ("" if f["appended"] else ", stale"))
    except (IndexError, KeyError, TypeError, ValueError):
        pass
    skip = ("t", "step", "seq_id", "start", "end")
    return " ".join(f"{n}={short_list(v) if isinstance(v, list) else v}" for n, v in f.items() if n not in skip)
