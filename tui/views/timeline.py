"""The Timeline view: the CPU lanes (schedule, execute, process) and the device lane of every step on one
time axis, with the ZOS overlap (a CPU phase running while the device is busy: the columns where the two
lanes' spans intersect in time, tui/lanes.py, as the Overview counts it) and the device's idle gaps, each labelled
with its length where it is wide enough. Zoom and pan with the keyboard; the selected step is drawn in the
highlight colour. `TimelineChart` draws only its few lines, from numpy searches over the spans
(tui/lanes.py), so a million steps cost what ten do. A run of several ranks gets the same rows for each
rank, labelled r0, r1, ..., on one time axis (each rank's times shifted by its offset, tracing/ranks.py);
the rank on show is labelled in bold and its selected step marked, the same step number on the others too.
"""
from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from tui.format import fmt_ns
from tui.lanes import LANES
from tui.messages import StepChosen
from tui.views.base import View

LABEL = 10                       # columns of the lane names (RANK_LABEL for a run of several ranks)
RANK_LABEL = 13
ROWS = ("time", *LANES, "overlap", "idle", "")
LANE_STYLES = [(Style(color="#5f87d7"), Style(color="#87afff")), (Style(color="#5faf5f"), Style(color="#87d787")),
               (Style(color="#af87d7"), Style(color="#d7afff")), (Style(color="#d78700"), Style(color="#ffaf5f"))]
SELECTED = Style(color="#ffff5f", bold=True)
OVERLAP = Style(color="#ff5fff")
IDLE = Style(color="#ff5f5f", bold=True)
MUTED = Style(color="#808080")
SHOWN = Style(color="#5fd7ff", bold=True)


def chart_rows(world_size: int) -> list[tuple[str, int, str]]:
    """(label, rank, what) of each line of the chart: the axis, then each rank's lanes, overlap and idle
    rows, then the marker of the selected step. One rank: the labels of a single-process log."""
    if world_size == 1:
        return [(name, 0, name or "marker") for name in ROWS]
    rows = [("time", 0, "time")]
    for rank in range(world_size):
        rows += [(f"r{rank} {name}", rank, name) for name in ROWS[1:-1]]
    return rows + [("step", -1, "marker")]


class TimelineChart(Widget, can_focus=True):
    """The lanes over the window [t0, t0 + span) of the run."""

    DEFAULT_CSS = """
    TimelineChart { height: 9; background: $surface; }
    TimelineChart:focus { background: $boost; }
    """
    t0 = reactive(0)
    span = reactive(1)
    selected = reactive(-1)

    def on_mount(self) -> None:
        self.set_rows()

    def set_rows(self) -> None:
        """Lay the chart out for the run's ranks (its height: one line per row)."""
        world = self.app.logs.world_size
        self.rows, self.label = chart_rows(world), LABEL if world == 1 else RANK_LABEL
        if world > 1:
            self.styles.height = len(self.rows)

    def chart_width(self) -> int:
        return max(self.size.width - self.label, 1)

    def selected_row(self, rank: int) -> int:
        """The StepTable row to mark on rank `rank`: the selection on the rank on show, the same step
        number on the others (-1 if it has none)."""
        app = self.app
        if rank == app.rank or self.selected < 0:
            return self.selected
        row = app.logs.models[rank].step_row(int(app.model.steps.step[self.selected]))
        return -1 if row is None else row

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        w = self.chart_width()
        edges = self.t0 + (np.arange(w + 1, dtype=np.float64) * self.span / w)
        edges = edges.astype(np.int64)
        return edges[:-1], np.maximum(edges[1:], edges[:-1] + 1)

    def render_line(self, y: int) -> Strip:
        app, width = self.app, self.size.width
        if not app.logs.ready or y >= len(self.rows):
            return Strip.blank(width)
        name, rank, what = self.rows[y]
        several = app.logs.world_size > 1
        if several and what == "marker":
            name, rank = f"r{app.rank} step", app.rank
        label = [Segment(f"{name:>{self.label - 1}} ", SHOWN if several and rank == app.rank else MUTED)]
        lo, hi = self.columns()
        model = app.logs.models[max(rank, 0)]
        lanes = model.lanes
        if what == "time":
            body = self._axis(lo)
        elif what == "marker":
            body = self._marker(lo, hi)
        else:   # this rank's own times
            lo, hi = lo - model.offset, hi - model.offset
            if what in LANES:
                body = self._lane(lanes, LANES.index(what), lo, hi, self.selected_row(rank))
            elif what == "overlap":   # a CPU phase ran while the device was busy (the Overview's figure)
                n, _ = lanes.overlap_lane.cover(lo, hi)
                body = _runs(np.where(n > 0, "▀", " "), [OVERLAP] * len(lo))
            else:
                body = self._idle(lanes, lo, hi)
        return Strip(label + body).crop_extend(0, width, None)

    def _axis(self, lo: np.ndarray) -> list[Segment]:
        w = len(lo)
        chars = [" "] * w
        for c in range(0, w, 14):   # the first tick absolute, the others after it: readable at any zoom
            label = fmt_ns(lo[0]) if c == 0 else "+" + fmt_ns(lo[c] - lo[0])
            for k, ch in enumerate("╵" + label):
                if c + k < w:
                    chars[c + k] = ch
        return [Segment("".join(chars), MUTED)]

    def _lane(self, lanes, k: int, lo: np.ndarray, hi: np.ndarray, selected: int) -> list[Segment]:
        n, row = lanes.lanes[k].cover(lo, hi)
        glyph = np.where(n == 0, " ", np.where(n == 1, "█", "▒"))
        even, odd = LANE_STYLES[k]
        styles = [SELECTED if r == selected and r >= 0 else (odd if r % 2 else even) for r in row.tolist()]
        return _runs(glyph, styles)

    def _idle(self, lanes, lo: np.ndarray, hi: np.ndarray) -> list[Segment]:
        dev = lanes.lanes[3]
        n, _ = dev.cover(lo, hi)
        inside = (len(dev.start) > 0) & (lo >= (dev.start[0] if len(dev.start) else 0)) & \
                 (hi <= (dev.end_max[-1] if len(dev.start) else 0))
        chars = np.where((n == 0) & inside, "━", " ").astype("<U1")
        width = hi[0] - lo[0] if len(lo) else 1
        gaps = lanes.gaps_in(int(lo[0]), int(hi[-1])) if len(lo) else []
        for g in sorted(gaps, key=lambda g: -lanes.gap_len[g])[:64]:
            text = fmt_ns(lanes.gap_len[g])
            a = int((lanes.gap_start[g] - lo[0]) // max(width, 1))
            cols = int(lanes.gap_len[g] // max(width, 1))
            if cols >= len(text) + 2:
                start = max(a + (cols - len(text)) // 2, 0)
                for k, ch in enumerate(text):
                    if 0 <= start + k < len(chars):
                        chars[start + k] = ch
        return _runs(chars, [IDLE] * len(chars))

    def _marker(self, lo: np.ndarray, hi: np.ndarray) -> list[Segment]:
        r = self.selected
        model = self.app.model
        s = model.steps
        if r < 0:
            return []
        a = (s.schedule_start[r] if s.schedule_start[r] >= 0 else s.device_start[r]) + model.offset
        b = max(s.process_end[r], s.device_end[r], s.execute_end[r]) + model.offset
        mark = np.where((hi > a) & (lo < b), "▔", " ")
        return _runs(mark, [SELECTED] * len(mark))

    def on_resize(self) -> None:
        if self.app.model.ready:
            self.parent._info()

    def watch_t0(self) -> None:
        self.refresh()

    def watch_span(self) -> None:
        self.refresh()

    def watch_selected(self) -> None:
        self.refresh()


def _runs(chars, styles) -> list[Segment]:
    """Segments of consecutive columns with the same style."""
    out, buf, cur = [], [], None
    for ch, st in zip(chars, styles):
        if st is not cur and buf:
            out.append(Segment("".join(buf), cur))
            buf = []
        cur = st
        buf.append(str(ch))
    if buf:
        out.append(Segment("".join(buf), cur))
    return out


class TimelineView(View):
    """The chart, then the selected step's spans and the window under the chart."""

    DEFAULT_CSS = """
    TimelineView #timeline-info { padding: 1 1 0 1; height: 6; }
    """
    title, key = "Timeline", "2"
    BINDINGS = [Binding("plus,equals_sign", "zoom(0.5)", "Zoom in", key_display="+"),
                Binding("minus", "zoom(2)", "Zoom out", key_display="-"),
                Binding("left,h", "pan(-1)", "Pan", key_display="←→"),
                Binding("right,l", "pan(1)", "Pan", show=False),
                Binding("0", "fit", "Fit all"), Binding("c", "center", "Center step"),
                Binding("i", "gap(1)", "Next idle"), Binding("I", "gap(-1)", "Prev idle", show=False),
                Binding("L", "longest_gap", "Longest idle", show=False)]

    def compose(self):
        yield TimelineChart(id="chart")
        yield Static(id="timeline-info")

    @property
    def chart(self) -> TimelineChart:
        return self.query_one(TimelineChart)

    def loaded(self) -> None:
        s, chart = self.model.steps, self.chart
        if not len(s):
            self.query_one("#timeline-info", Static).update("no steps yet")
            return
        if chart.span <= 1:  # first load: the first 20 steps
            last = min(19, len(s) - 1)
            end = max(s.device_end[last], s.process_end[last], s.schedule_end[last]) + self.model.offset
            chart.t0 = self.app.logs.time_range()[0]
            chart.span = max(int(end) - chart.t0, 1)
        chart.refresh()   # another rank on show: other labels and marks

    def show_step(self, row: int) -> None:
        if not self.ready or not len(self.model.steps):
            return
        chart, s, off = self.chart, self.model.steps, self.model.offset
        chart.selected = row
        a = s.schedule_start[row] if s.schedule_start[row] >= 0 else s.device_start[row]
        b = max(s.schedule_end[row], s.execute_end[row], s.process_end[row], s.device_end[row]) + off
        a += off if a >= 0 else 0
        if a >= 0 and (b < chart.t0 or a >= chart.t0 + chart.span):   # none of the step in the window
            chart.t0 = max(int(a) - chart.span // 4, 0)
        self._info()

    def _info(self) -> None:
        chart, s, lanes, off = self.chart, self.model.steps, self.model.lanes, self.model.offset
        r = chart.selected
        text = Text()
        text.append(f"window {fmt_ns(chart.t0)} – {fmt_ns(chart.t0 + chart.span)} ({fmt_ns(chart.span)}, "
                    f"{fmt_ns(chart.span / chart.chart_width())} per column)\n", "dim")
        if r >= 0:
            parts = [f"{name} {fmt_ns(s_[r] + off)}+{fmt_ns(e_[r] - s_[r])}" for name, s_, e_ in (
                ("schedule", s.schedule_start, s.schedule_end), ("execute", s.execute_start, s.execute_end),
                ("process", s.process_start, s.process_end), ("device", s.device_start, s.device_end)) if s_[r] >= 0]
            if self.app.logs.world_size > 1:
                text.append(f"rank {self.app.rank} ", "bold #5fd7ff")
            text.append(f"step {s.step[r]}", "bold yellow")
            text.append(": " + ", ".join(parts))
            gap = lanes.gap_before(r)
            if gap:
                text.append(f"; device idle {fmt_ns(gap)} before it", "bold red")
            text.append("\n")
        text.append("█ a span (two shades: alternate steps)  ▒ several steps in a column  ", "dim")
        text.append("▀ ZOS overlap  ", "#ff5fff")
        text.append("━ device idle", "bold red")
        self.query_one("#timeline-info", Static).update(text, layout=False)

    def action_zoom(self, factor: float) -> None:
        chart, s = self.chart, self.model.steps
        r = chart.selected
        focus = s.schedule_start[r] + self.model.offset if r >= 0 and s.schedule_start[r] >= 0 else \
            chart.t0 + chart.span // 2
        span = int(min(max(chart.span * factor, chart.chart_width()), 2 * (self.app.logs.time_range()[1] + 1)))
        chart.t0 = max(int(focus - (focus - chart.t0) * span / chart.span), 0)
        chart.span = span
        self._info()

    def action_pan(self, direction: int) -> None:
        chart = self.chart
        chart.t0 = max(chart.t0 + direction * max(chart.span // 8, 1), 0)
        self._info()

    def action_fit(self) -> None:
        t_min, t_max = self.app.logs.time_range()
        self.chart.t0, self.chart.span = t_min, max(t_max - t_min, 1)
        self._info()

    def action_center(self) -> None:
        chart, s = self.chart, self.model.steps
        if chart.selected >= 0 and s.schedule_start[chart.selected] >= 0:
            chart.t0 = max(int(s.schedule_start[chart.selected]) + self.model.offset - chart.span // 2, 0)
            self._info()

    def action_gap(self, direction: int) -> None:
        """Select the step after the next (or previous) device idle gap."""
        lanes, s, r = self.model.lanes, self.model.steps, self.chart.selected
        here = s.device_start[r] if r >= 0 else -1
        ends = lanes.gap_start + lanes.gap_len
        k = np.searchsorted(ends, here, "right") if direction > 0 else np.searchsorted(ends, here, "left") - 1
        if 0 <= k < len(ends):
            self._select_gap(int(k))
        else:
            self.app.notify("no more device idle gaps that way", severity="warning")

    def action_longest_gap(self) -> None:
        if len(self.model.lanes.gap_len):
            self._select_gap(int(np.argmax(self.model.lanes.gap_len)))

    def _select_gap(self, g: int) -> None:
        chart, lanes = self.chart, self.model.lanes
        start, length = int(lanes.gap_start[g]) + self.model.offset, int(lanes.gap_len[g])
        chart.span = max(length * 4, chart.chart_width())   # the gap fills a quarter of the chart
        chart.t0 = max(start - chart.span // 2 + length // 2, 0)
        self.post_message(StepChosen(int(lanes.gap_row[g])))
