"""`mdi-trace view`: the Textual app over one log, or over every rank's log of a run (ARCHITECTURE.md §7-§8).

The app owns the selection, shared by every view, in reactive attributes: `step_row` (a row of the
index's StepTable), `seq_id` (a request) and `event_index` (an event). Views ask for a change with the
messages of tui/messages.py; only the view on screen redraws when the selection moves, the others catch up
when shown. A run of several ranks (tracing/ranks.py) is one `RunModel` (`logs`): the Timeline draws every
rank on one time axis, the other views show one rank at a time (`rank`, switched with R; each rank keeps
its own selection, and step numbers are per rank). The log is indexed in a worker thread after the first
paint (the header and footer are read at once), `--follow` re-indexes a log that grows (labelled "live" until
its footer arrives, then "complete"), and `--verify` runs `mdi-trace verify` in a subprocess (the viewer
itself imports neither torch nor engine/): once at the start and, under `--follow`, again after each
re-index, one run at a time (a re-index during a run asks for one more, so the last run always sees the
footer). `mdi-trace view` needs a terminal on stdin and stdout (`run_view` says so before Textual starts).

Every key is drawn in one frame (issue #5: under 50 ms): all six views stay laid out, the ones not on show
off screen, so a switch moves two of them and resizes nothing; a key's effects are gathered for a few ms
before the screen draws them (`hold_frame`); a view catches up only with the selection that changed. Once
the log is in, the views off screen are synced and their lines rendered while idle (`_prerender`), and
what is loaded is frozen out of the cyclic garbage collector (`_freeze`).
"""
from __future__ import annotations

import gc
import subprocess
import sys
import time

from rich.text import Text
from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import reactive
from textual.containers import Container
from textual.widgets import Input, Static
from textual.worker import get_current_worker

from tracing.index import TooBig
from tracing.spill import SpillError
from tracing.reader import TraceError
from tui.data import KIND_NAMES, RunModel, TraceModel
from tui.dialogs import Ask, JumpCommands
from tui.format import parse_int, parse_time
from tui.help import HelpScreen
from tui.keybar import KeyBar
from tui.messages import EventChosen, Loaded, Progress, RequestChosen, StepChosen, Verified
from tui.views.base import View
from tui.views.events import EventsView
from tui.views.overview import OverviewView
from tui.views.requests import RequestsView
from tui.views.resources import ResourcesView
from tui.views.steps import StepsView
from tui.views.timeline import TimelineView

VIEWS = (OverviewView, TimelineView, StepsView, RequestsView, ResourcesView, EventsView)
FOLLOW_EVERY = 1.0     # seconds between two looks at a followed log's size
VERIFY_TIMEOUT = 600   # seconds
OFF_SCREEN = 10000     # rows: where the views not on show lie (see watch_view)
KEY_FRAME = 0.008      # seconds: what a key changes (lists, bars, the focus) is gathered into one frame


class TraceApp(App):
    """One log (or one run of rank logs), six views. `error` holds the sentence that ended the app, if a
    damaged log did."""

    TITLE = "mdi-trace view"
    CSS = """
    #viewbar { height: 1; background: $panel; }
    #views { height: 1fr; }
    #views > View { position: absolute; width: 100%; height: 100%; offset-y: 10000; }  /* OFF_SCREEN */
    #views > #OverviewView { offset-y: 0; }
    """
    COMMANDS = App.COMMANDS | {JumpCommands}
    BINDINGS = [*(Binding(v.key, f"view('{v.__name__}')", v.title, show=False) for v in VIEWS),
                Binding("comma", "step(-1)", "Prev step", key_display=","),
                Binding("full_stop", "step(1)", "Next step", key_display="."),
                Binding("g", "ask_step", "Step"), Binding("t", "ask_time", "Time"),
                Binding("r", "ask_request", "Request"), Binding("k", "ask_kind", "Kind"),
                Binding("R", "rank(1)", "Rank"),
                Binding("left_square_bracket", "kind(-1)", "Prev kind", show=False, key_display="["),
                Binding("right_square_bracket", "kind(1)", "Next kind", show=False, key_display="]"),
                Binding("question_mark", "help", "Help", key_display="?"), Binding("q", "quit", "Quit")]

    step_row = reactive(0)
    seq_id = reactive(0)
    event_index = reactive(0)
    view = reactive("OverviewView")

    def __init__(self, path: str, follow: bool = False, verify: bool = False, run: RunModel | None = None):
        started = time.perf_counter()
        super().__init__()
        self.started = started
        self.logs = run or RunModel(path)   # TraceError for a missing or unreadable file, before any drawing
        self.rank = self.logs.start_rank    # the rank the views other than the Timeline show
        self.kept: dict[int, tuple[int, int, int]] = {}   # rank -> (step_row, seq_id, event_index) left there
        self.follow, self.run_verify = follow, verify
        self.followed = follow                   # --follow was given (`follow` turns off once the footer is in)
        self.verify_lines: list[str] | None = None
        self.verify_code: int | None = None      # the exit code of the last verify run (None: it did not finish)
        self.verify_running = self.verify_again = False
        self.verify_runs: list[bool] = []        # per verify run started: whether the log was complete then
        self.error: str | None = None
        self.first_paint: float | None = None    # seconds from __init__ to the first screen
        self.loaded_at: float | None = None      # seconds from __init__ to the index being ready
        self.generation, self.kind, self.progress, self.loading, self.at_tail = 0, "preempt", "", False, False

    def compose(self):
        yield Static(id="viewbar")
        with Container(id="views"):   # every view laid out at once, one visible: see watch_view
            for v in VIEWS:
                yield v(id=v.__name__)
        yield KeyBar()

    async def on_event(self, event: events.Event) -> None:
        # A key's effects reach the screen over several message hops (a list's cursor, then the selection,
        # then the other widgets, the focus, the bars); drawn as they come, they took up to four frames. Held
        # back a few ms, they are drawn in one. Not while typing into a box: its Enter closes it, and what
        # the box asked for (a search, a filter) must find the view laid out without it.
        if isinstance(event, events.Key) and not isinstance(self.focused, Input):
            self.hold_frame()
        await super().on_event(event)

    def hold_frame(self) -> None:
        """Draw nothing for KEY_FRAME seconds, then only what changed (`delay_update` would then repaint the
        whole screen, a frame's worth of time more)."""
        batch = self.batch_update()
        batch.__enter__()

        def release() -> None:
            batch.__exit__(None, None, None)
            self.screen.check_idle()   # the screen then draws what its widgets marked meanwhile
        self.set_timer(KEY_FRAME, release, name="hold_frame")

    def on_mount(self) -> None:
        self._viewbar()
        self.call_after_refresh(self._painted)
        if self.follow:
            self.set_interval(FOLLOW_EVERY, self._look)
        if self.run_verify:
            self.request_verify()

    def _painted(self) -> None:
        """The first screen is up (header and footer only): now index the log, in a worker."""
        self.first_paint = time.perf_counter() - self.started
        self.loading = True
        self._load(self.logs)

    @property
    def model(self) -> TraceModel:
        """The log of the rank on show (the only one for a single-process log)."""
        return self.logs.models[self.rank]

    @property
    def current(self) -> View:
        return self.query_one(f"#{self.view}", View)

    # ---- loading, following, verifying -----------------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def _load(self, run: RunModel) -> None:
        try:
            run.load(lambda offset: self.post_message(Progress(offset, run.size)))
        except (TooBig, SpillError) as e:   # no room in memory nor on disk: a followed log stays as it was
            self.call_from_thread(self._stop_following if self.generation else self._failed, str(e))
            return
        except TraceError as e:
            self.call_from_thread(self._failed, str(e))
            return
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as e:   # a log no check foresaw
            self.call_from_thread(self._failed, f"{run.path} could not be indexed ({type(e).__name__}: {e}).")
            return
        if not get_current_worker().is_cancelled:   # a newer load replaced this one
            self.call_from_thread(self._swap, run)

    def _swap(self, run: RunModel) -> None:
        old = self.model
        self.at_tail = bool(old.ready and len(old.steps) and self.step_row >= len(old.steps) - 1)
        self.logs = run
        self.post_message(Loaded())

    def _stop_following(self, message: str) -> None:
        """--follow: the grown log no longer fits in memory; keep showing what was indexed, and say so."""
        self.follow, self.loading = False, False
        self.notify(f"{message} No longer following: this is the log as it was.", severity="error", timeout=30)
        self._viewbar()

    def _failed(self, message: str) -> None:
        self.error = message
        self.exit(return_code=2)

    def on_progress(self, message: Progress) -> None:
        if not self.loading or self.generation:   # the first index only: --follow re-indexes quietly
            return
        self.progress = f"indexing {100 * message.offset // max(message.size, 1)}%"
        self._viewbar()

    def on_loaded(self, message: Loaded) -> None:
        self.loaded_at = self.loaded_at or time.perf_counter() - self.started
        self.generation += 1
        self.progress, self.loading = "", False
        steps = self.model.steps
        if self.follow and self.at_tail:
            self._select_step(len(steps) - 1)   # it was at the tail: it stays there
        self.step_row = min(self.step_row, max(len(steps) - 1, 0))
        self.query_one("#OverviewView", View).loaded()
        self._sync(self.current)
        self.call_after_refresh(self._sync_all, self.generation)   # the others: a switch then finds them ready
        for m in self.logs.models:
            if m.index.cut and not self.follow:
                self.notify(str(m.index.cut), severity="warning", timeout=8)
        if self.follow and self.logs.clean:
            self.follow = False
            self.notify("the log is complete (footer written): no longer following")
        self._viewbar()
        if self.followed and self.generation > 1:   # a re-index of a followed log: verify what it holds now
            self.request_verify()

    def _look(self) -> None:
        """--follow: re-index when the file has grown (once the previous index is in)."""
        if not self.follow or self.loading:
            return
        try:
            if self.logs.grown():
                self.loading = True
                self._load(RunModel(self.logs.path))
        except (OSError, TraceError) as e:
            self.notify(f"following {self.logs.path}: {e}", severity="error")

    def request_verify(self) -> None:
        """Run verify in the background, or once more after the run in progress (never two at a time)."""
        if not self.run_verify:
            return
        if self.verify_running:
            self.verify_again = True
            return
        self.verify_running, self.verify_again = True, False
        self.verify_runs.append(self.logs.clean)
        self._verify(str(self.logs.path))
        if self.verify_lines is not None:   # "re-running" beside the last findings
            self.query_one(OverviewView).show_warnings()

    @work(thread=True, group="verify")
    def _verify(self, path: str) -> None:
        cmd = [sys.executable, "-m", "tui.cli", "verify", path]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=VERIFY_TIMEOUT)
            lines, code = (out.stdout + out.stderr).splitlines() or ["verify printed nothing"], out.returncode
        except (OSError, subprocess.TimeoutExpired) as e:
            lines, code = [f"verify did not finish: {e}"], None
        self.post_message(Verified(lines, code))

    def on_verified(self, message: Verified) -> None:
        self.verify_lines, self.verify_code = message.lines, message.code
        self.verify_running = False
        if self.verify_again:
            self.request_verify()
        self.query_one(OverviewView).show_warnings()

    # ---- the selection -------------------------------------------------------------------------------
    def _sync(self, view: View) -> None:
        """Bring a view up to date with the model and the selection: only what changed since it was last on
        show, so that going back to a view redraws nothing that it already shows."""
        if not self.model.ready:
            return
        if view.generation != (self.generation, self.rank):
            view.generation = (self.generation, self.rank)
            view.shown_selection = (None, None, None)
            view.loaded()
        self._show(view, 0, self.step_row)
        self._show(view, 1, self.seq_id)
        self._show(view, 2, self.event_index)

    def _sync_all(self, generation: int) -> None:
        """Bring the views not on show up to date too (off screen, they are laid out but not drawn), so that
        the first switch to one redraws only what a later one would."""
        if generation == self.generation:
            for view in self.query(View):
                self._sync(view)
            self.call_after_refresh(self._prerender, generation)

    def _prerender(self, generation: int) -> None:
        """Render the lines of the views not on show into their widgets' caches, once laid out with the
        data, so that the first switch to one draws from the caches as a later one does (a first draw of the
        Requests view rendered every line of its widgets: 60 ms at 1M events). A widget marked since redraws
        only what it has to."""
        if generation != self.generation:
            return
        for view in self.query(View):
            if view is not self.current:
                for widget in (view, *view.query("*")):
                    if widget.display and widget.outer_size:
                        widget.render_lines(widget.outer_size.region)
        self._freeze()

    @staticmethod
    def _freeze() -> None:
        """Keep the objects of the loaded log and of the laid-out views out of Python's cyclic garbage
        collector: a full collection walked all of them (the reader's per-step lists, Textual's caches),
        45 ms at 1M events and more at 10M, in the middle of whichever key it fell on. Unfrozen and collected
        first, so that the log a --follow re-index replaced is freed."""
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    @staticmethod
    def _show(view: View, k: int, value: int) -> None:
        """Tell `view` that selection `k` (step row, request, event) is `value`, unless it already shows it."""
        if view.shown_selection[k] != value:
            (view.show_step, view.show_request, view.show_event)[k](value)
            view.shown_selection = (*view.shown_selection[:k], value, *view.shown_selection[k + 1:])

    def watch_step_row(self, row: int) -> None:
        if self.model.ready:
            self._show(self.current, 0, row)
        self._viewbar()

    def watch_seq_id(self, seq_id: int) -> None:
        if self.model.ready:
            self._show(self.current, 1, seq_id)
        self._viewbar()

    def watch_event_index(self, index: int) -> None:
        if self.model.ready:
            self._show(self.current, 2, index)

    def watch_view(self, old: str, name: str) -> None:
        # Every view keeps its place and size, those not on show OFF_SCREEN rows down: a switch moves two of
        # them, so no widget is resized or shown anew (a ContentSwitcher's display toggle made every widget of
        # the view new to the compositor: resize and show events, scrollbars rebuilt, frames more per key).
        self.hold_frame()   # a switch from the command palette: one frame too
        self.query_one(f"#{old}", View).styles.offset = (0, OFF_SCREEN)
        view = self.current
        view.styles.offset = (0, 0)
        self._sync(view)
        focusable = [w for w in view.query("*") if w.can_focus]
        self.screen.set_focus(focusable[0] if focusable else None)
        self.query_one(KeyBar).show_keys(self.screen)   # in this frame, not the next
        self._viewbar()

    def on_step_chosen(self, message: StepChosen) -> None:
        self._select_step(message.row)

    def on_request_chosen(self, message: RequestChosen) -> None:
        self.seq_id = message.seq_id

    def on_event_chosen(self, message: EventChosen) -> None:
        self._select_event(message.index)

    def _select_step(self, row: int) -> None:
        if not self.model.ready or not len(self.model.steps):
            return
        self.step_row = max(0, min(row, len(self.model.steps) - 1))
        self.event_index = int(self.model.sched_event[self.step_row])

    def _select_event(self, index: int) -> None:
        self.event_index = index
        self.step_row = self.model.row_of_event(index)
        seq = int(self.model.index.seq_id[index])
        if seq >= 0 and self.view != "RequestsView":
            self.seq_id = seq

    def on_resize(self) -> None:
        self._viewbar()

    def _viewbar(self) -> None:
        """The views' keys, the selection, the rank on show and the follow state, in one line. The rank is
        never cut: when the line is too wide the rest gives way first (padding, "request" to "req", the
        follow state to one word, the titles of the views not on show, the request, the step)."""
        width = self.size.width
        rank = Text(f" · rank {self.rank}/{self.logs.world_size}", "bold #5fd7ff") if self.logs.world_size > 1 \
            else Text()
        for tabs, status, state in ((0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 3, 1)):
            text = self._tabs(tabs)
            text.append_text(self._status(status))
            text.append_text(rank)
            text.append_text(self._state(state))
            if text.cell_len <= width:
                break
        else:   # narrower still: the left part is cut, the rank kept
            keep = Text.assemble(rank, self._state(1))
            text.truncate(max(width - keep.cell_len, 0))
            text.append_text(keep)
        self.query_one("#viewbar", Static).update(text, layout=False)

    def _tabs(self, level: int) -> Text:
        """The views' keys: 0 padded titles, 1 titles, 2 the title of the view on show only."""
        text = Text()
        for v in VIEWS:
            on = v.__name__ == self.view
            label = f" {v.key} {v.title} " if level == 0 else f"{v.key} {v.title}" if level == 1 or on else v.key
            text.append(label, "bold reverse" if on else "")
            text.append("│", "dim")
        return text

    def _status(self, level: int) -> Text:
        """The indexing progress, or the selection: 0 "step N · request M", 1 "req", 2 the step, 3 none."""
        if self.progress:
            return Text(f"  {self.progress}", "bold #ffaf5f")
        if not (self.model.ready and len(self.model.steps)) or level == 3:
            return Text()
        step = f" step {self.model.steps.step[self.step_row]}"
        return Text(step if level == 2 else f"{step} · {'request' if level == 0 else 'req'} {self.seq_id}", "bold")

    def _state(self, level: int) -> Text:
        """A followed log's state: live (no footer yet), then complete."""
        if self.follow:
            return Text("  following: live" if level == 0 else " live", "#5fd75f")
        if self.followed and self.logs.clean:
            return Text("  complete" if level == 0 else " complete", "#5fd75f")
        return Text()

    # ---- actions and jumps -------------------------------------------------------------------------
    def action_view(self, name: str) -> None:
        self.view = name

    def action_step(self, delta: int) -> None:
        self._select_step(self.step_row + delta)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_rank(self, delta: int) -> None:
        """R: the next rank; on a single log, a note that there is none (the key bar shows R only for a run)."""
        if self.logs.world_size == 1:
            self.notify("this trace has one rank: R switches between the ranks of a run of several "
                        "(record --nproc N)", severity="warning")
            return
        self.switch_rank((self.rank + delta) % self.logs.world_size)

    def switch_rank(self, rank: int) -> None:
        """Show rank `rank` in the views: its own last selection, else the same step number and its first
        request. The Timeline keeps every rank and marks the one on show."""
        if rank == self.rank or not self.logs.ready:
            self.rank = rank
            self._viewbar()
            return
        step = int(self.model.steps.step[self.step_row]) if len(self.model.steps) else 0
        self.kept[self.rank] = (self.step_row, self.seq_id, self.event_index)
        self.rank = rank
        m = self.model
        if rank in self.kept:
            row, seq, event = self.kept[rank]
        else:
            row = m.step_row(step) if len(m.steps) else 0
            row = max(min(len(m.steps) - 1, self.step_row) if row is None else row, 0)
            seq = int(m.seq_ids[0]) if len(m.seq_ids) else 0
            event = int(m.sched_event[row]) if len(m.steps) else 0
        self.set_reactive(TraceApp.step_row, row)
        self.set_reactive(TraceApp.seq_id, seq)
        self.set_reactive(TraceApp.event_index, event)
        self._sync(self.current)
        self._viewbar()

    def action_ask_step(self) -> None:
        self.push_screen(Ask("Go to step", "a step number"), lambda v: v and self.jump_step(v))

    def action_ask_time(self) -> None:
        self.push_screen(Ask("Go to time since the start", "1.5s, 120ms, 40us, 900ns (bare number: ms)"),
                         lambda v: v and self.jump_time(v))

    def action_ask_request(self) -> None:
        self.push_screen(Ask("Go to request", "a seq_id"), lambda v: v and self.jump_request(v))

    def action_ask_kind(self) -> None:
        self.push_screen(Ask("Event kind for [ and ]", ", ".join(KIND_NAMES)), lambda v: v and self.jump_kind(v))

    def action_kind(self, direction: int) -> None:
        self.jump_kind(self.kind, direction > 0)

    def _guard(self, fn, *args) -> bool:
        """Run a jump; a bad input or a log still being indexed is a notification, never a crash."""
        if not self.model.ready:
            self.notify("the log is still being indexed", severity="warning")
            return False
        try:
            fn(*args)
            return True
        except ValueError as e:
            self.notify(str(e), severity="error")
            return False

    def jump_step(self, text: str) -> None:
        def go():
            step = parse_int(text, "step")
            row = self.model.step_row(step)
            if row is None:
                raise ValueError(f"there is no step {step} in this log (steps {self.model.steps.step.min()}"
                                 f"-{self.model.steps.step.max()}).")
            self._select_step(row)
            if self.view == "OverviewView":
                self.view = "StepsView"
        self._guard(go)

    def jump_time(self, text: str) -> None:
        def go():
            if not len(self.model.steps):
                raise ValueError("this log has no steps yet.")
            self._select_step(self.model.index.step_of_time(parse_time(text) - self.model.offset))
            if self.view == "OverviewView":
                self.view = "TimelineView"
        self._guard(go)

    def jump_request(self, text: str) -> None:
        def go():
            seq = parse_int(text, "request")
            if seq not in self.model.seq_ids:
                ranks = [m.rank for m in self.logs.models if seq in m.seq_ids]
                if not ranks:
                    raise ValueError(f"there is no request {seq} in this log.")
                self.switch_rank(ranks[0])   # a run's requests are spread over its ranks
            self.seq_id = seq
            self.view = "RequestsView"
        self._guard(go)

    def jump_kind(self, kind: str, forward: bool = True) -> None:
        def go():
            name = kind.strip()
            if name not in KIND_NAMES:
                raise ValueError(f"no event kind {name!r}; the kinds are {', '.join(KIND_NAMES)}.")
            self.kind = name
            i = self.model.next_of_kind(name, self.event_index, forward)
            if i is None:
                raise ValueError(f"no {'later' if forward else 'earlier'} {name} event.")
            self._select_event(i)
        self._guard(go)

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for v in VIEWS:
            yield SystemCommand(f"View: {v.title}", f"key {v.key}", lambda n=v.__name__: self.action_view(n))
        yield SystemCommand("Go to step…", "key g; or type `step 4812`", self.action_ask_step)
        yield SystemCommand("Go to time…", "key t; or type `time 2s`", self.action_ask_time)
        yield SystemCommand("Go to request…", "key r; or type `request 12`", self.action_ask_request)
        yield SystemCommand("Next event of a kind…", "key k, then ]; or type `next preempt`", self.action_ask_kind)
        for name in KIND_NAMES:
            yield SystemCommand(f"Next {name}", f"the next {name} event",
                                lambda n=name: self.jump_kind(n, True), discover=False)
            yield SystemCommand(f"Previous {name}", f"the previous {name} event",
                                lambda n=name: self.jump_kind(n, False), discover=False)


def run_view(path: str, follow: bool = False, verify: bool | None = None) -> int:
    """`mdi-trace view`: the exit code; a damaged log raises TraceError (one sentence) after the app ends. PATH is
    a log, one rank's log, or the OUT of `record --nproc N` (every rank's log is opened). Without a terminal on
    stdout (Textual would write its escape codes into the pipe and wait for keys forever) or on stdin (no
    key would ever reach it) it raises SystemExit with one sentence, after the log has been opened (so a bad
    path is still the first thing said) and before Textual starts."""
    run = RunModel(path)
    run.check_memory()   # a log whose footer counts more events than memory can index: said before Textual starts
    for name, stream in (("stdout", sys.stdout), ("stdin", sys.stdin)):
        if not _is_terminal(stream):
            raise SystemExit(f"mdi-trace: view needs a terminal; {name} is not one (use `mdi-trace info` or "
                             f"`mdi-trace export` for a pipe).")
    app = TraceApp(path, follow=follow, verify=run.size < (32 << 20) if verify is None else verify, run=run)
    app.run()
    if app.error:
        raise TraceError(app.error)
    return app.return_code or 0


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):   # a closed stream
        return False
