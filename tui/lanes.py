"""The timeline's data, with no Textual imports: each lane's spans sorted by start, what covers a column
of the time axis, the device's idle gaps, and how much CPU work ran while the device was busy (the ZOS
overlap). Built from `TraceIndex.steps` (tracing/index.py); times are ns since the header's t0_ns.
"""
from __future__ import annotations

import numpy as np

from tracing.index import StepTable
from tracing.schema import PHASES

LANES = (*PHASES, "device")   # the CPU phases, then the device


class Lane:
    """One lane's spans, sorted by start: `start`, `end` (ns) and `row` (the StepTable row of each)."""

    def __init__(self, start: np.ndarray, end: np.ndarray):
        valid = np.flatnonzero((start >= 0) & (end >= start))
        order = valid[np.argsort(start[valid], kind="stable")]
        self.start, self.end, self.row = start[order], end[order], order
        self.end_max = np.maximum.accumulate(self.end) if len(self.end) else self.end  # sorted, for searches

    def cover(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For columns [lo, hi): (number of spans touching each, the StepTable row of the last of them or -1)."""
        first = np.searchsorted(self.end_max, lo, "right")
        last = np.searchsorted(self.start, hi, "left")
        n = np.maximum(last - first, 0)
        row = np.where(n > 0, self.row[np.clip(last - 1, 0, max(len(self.row) - 1, 0))] if len(self.row) else -1, -1)
        return n, row


class Lanes:
    """The four lanes of a run, its time range, the device's idle gaps and the ZOS overlap."""

    def __init__(self, steps: StepTable):
        self.lanes = [Lane(steps.schedule_start, steps.schedule_end), Lane(steps.execute_start, steps.execute_end),
                      Lane(steps.process_start, steps.process_end), Lane(steps.device_start, steps.device_end)]
        starts = [lane.start[:1] for lane in self.lanes] + [np.zeros(0, np.int64)]
        ends = [lane.end_max[-1:] for lane in self.lanes] + [np.zeros(0, np.int64)]
        self.t_min = int(np.concatenate(starts).min()) if any(len(s) for s in starts) else 0
        self.t_max = max(int(np.concatenate(ends).max()) if any(len(e) for e in ends) else 0, self.t_min + 1)
        dev = self.lanes[3]
        # idle gap i: the device waits from gap_start[i] for gap_len[i] ns, then runs StepTable row gap_row[i]
        if len(dev.start) > 1:
            wait = dev.start[1:] - dev.end_max[:-1]
            keep = np.flatnonzero(wait > 0)
            self.gap_start, self.gap_len, self.gap_row = dev.end_max[:-1][keep], wait[keep], dev.row[1:][keep]
        else:
            self.gap_start = self.gap_len = self.gap_row = np.zeros(0, np.int64)
        self.device_busy = int(_union_length(dev.start, dev.end))
        self.overlap = self._overlap()

    def _overlap(self) -> int:
        """ns during which the device was busy and the CPU ran any phase: ZOS at work."""
        cpu_s = np.concatenate([lane.start for lane in self.lanes[:3]])
        cpu_e = np.concatenate([lane.end for lane in self.lanes[:3]])
        cs, ce = _merge(cpu_s, cpu_e)
        ds, de = _merge(self.lanes[3].start, self.lanes[3].end)
        if not len(cs) or not len(ds):
            return 0
        cum = np.concatenate([[0], np.cumsum(ce - cs)])

        def busy_before(x):  # CPU busy time in [-inf, x)
            k = np.searchsorted(cs, x, "right") - 1
            inside = np.where(k >= 0, np.clip(x - cs[np.maximum(k, 0)], 0, (ce - cs)[np.maximum(k, 0)]), 0)
            return cum[np.maximum(k, 0)] * (k >= 0) + inside
        return int(np.sum(busy_before(de) - busy_before(ds)))

    def gaps_in(self, lo: int, hi: int) -> np.ndarray:
        """Indices of the idle gaps that overlap [lo, hi)."""
        a = np.searchsorted(self.gap_start + self.gap_len, lo, "right")
        b = np.searchsorted(self.gap_start, hi, "left")
        return np.arange(a, max(a, b))

    def gap_before(self, row: int) -> int:
        """The idle gap that ends where StepTable row `row`'s device span starts, in ns (0 if none)."""
        hit = np.flatnonzero(self.gap_row == row)
        return int(self.gap_len[hit[0]]) if len(hit) else 0


def _merge(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals, as sorted disjoint intervals."""
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    s, e = start[order], np.maximum.accumulate(end[order])
    new = np.concatenate([[True], s[1:] > e[:-1]])
    heads = np.flatnonzero(new)
    tails = np.concatenate([heads[1:] - 1, [len(s) - 1]])
    return s[heads], e[tails]


def _union_length(start: np.ndarray, end: np.ndarray) -> int:
    s, e = _merge(start, end)
    return int(np.sum(e - s))
