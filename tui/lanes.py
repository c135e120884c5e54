"""The timeline's data, with no Textual imports: each lane's spans sorted by start, what covers a column
of the time axis, the device's idle gaps, and how much CPU work ran while the device was busy (the ZOS
overlap). Built from `TraceIndex.steps` (tracing/index.py); times are ns since the header's t0_ns.

The ZOS overlap has one definition, used by the Overview's figure and the Timeline's marks alike: the time
during which a CPU phase (schedule, execute, process: the engine's host thread) ran while the device lane was
busy, i.e. the intersection of the two lanes' unions (`overlap_lane`, sorted disjoint intervals). On CUDA the
device span is the stream's work between two CUDA events; on CPU it is the device worker thread's forward
(engine/model_runner.py `_run_cpu`), which starts inside the execute phase that submits it and runs on
while the host thread processes the previous step and schedules the next. ZOS hides CPU work behind the
device, so the Overview gives the overlap as a share of the CPU phases' time (`cpu_busy`): on a CPU trace the
device is busy ~500x longer than the CPU phases, and a share of the device's time read 0% while the Timeline
marked overlap at every step.
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
        cs, ce = _merge(np.concatenate([lane.start for lane in self.lanes[:3]]),
                        np.concatenate([lane.end for lane in self.lanes[:3]]))
        ds, de = _merge(dev.start, dev.end)
        self.device_busy = int(np.sum(de - ds))
        self.cpu_busy = int(np.sum(ce - cs))         # ns during which the host thread ran a phase
        # the ZOS overlap: where a CPU phase ran while the device was busy (the Timeline marks these columns)
        self.overlap_lane = Lane(*_intersect(cs, ce, ds, de))
        self.overlap = int(np.sum(self.overlap_lane.end - self.overlap_lane.start))

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


def _intersect(a_start, a_end, b_start, b_end) -> tuple[np.ndarray, np.ndarray]:
    """The intersection of two sets of sorted disjoint intervals, as sorted disjoint intervals of positive
    length: a sweep over every endpoint (an end before a start at the same time), inside both at depth 2."""
    points = np.concatenate([a_start, b_start, a_end, b_end]).astype(np.int64)
    step = np.concatenate([np.ones(len(a_start) + len(b_start), np.int64), -np.ones(len(a_end) + len(b_end),
                                                                                     np.int64)])
    if not len(points):
        return points, points
    order = np.lexsort((step, points))
    points, depth = points[order], np.cumsum(step[order])
    k = np.flatnonzero(depth[:-1] == 2)
    start, end = points[k], points[k + 1]
    keep = end > start
    return start[keep], end[keep]
