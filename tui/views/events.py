"""The Events view: the raw event log, one line per event (index, time, step, seq_id, kind, fields) in a
Line API list over the whole log or a filtered subset (kind, request, step range: `f`), with regex search
(`/`, then `n` / `N` for the next and previous match) run in a worker thread so a long search never blocks
the keyboard.
"""
from __future__ import annotations

import re

import numpy as np
from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.widgets import Input, Static

from tui.data import EVENT_HEADER
from tui.format import EventFilter, parse_filter, plural
from tui.lines import LineList
from tui.messages import EventChosen, LineHighlighted
from tui.views.base import View

KIND_STYLES = {"schedule": "bold #5fafff", "preempt": "bold #ff5f5f", "cancel": "bold #ff5f5f",
               "epoch_bump": "#ff875f", "finish": "#5fd75f", "request_added": "#5fafff", "device_span": "#d78700",
               "cpu_span": "#808080", "block_alloc": "#af87d7", "block_free": "#af87d7", "slot_alloc": "#af87d7",
               "slot_free": "#af87d7"}


class EventsView(View):
    DEFAULT_CSS = """
    EventsView .header { background: $panel; color: $text-muted; height: 1; }
    EventsView #event-status { height: 1; padding: 0 1; }
    EventsView Input { display: none; }
    EventsView Input.open { display: block; }
    """
    title, key = "Events", "6"
    BINDINGS = [Binding("slash", "ask('search')", "Search", key_display="/"),
                Binding("n", "find(1)", "Next match"), Binding("N", "find(-1)", "Prev match", show=False),
                Binding("f", "ask('filter')", "Filter"), Binding("x", "clear_filter", "Clear filter")]

    def compose(self):
        self.shown = np.zeros(0, np.int64)
        self.filter, self.pattern, self.asking = EventFilter(), None, ""
        yield Static(id="event-status")
        yield Static(EVENT_HEADER, classes="header")
        yield LineList(id="event-list", width=240, styler=self._style)
        yield Input(id="event-input")

    def _style(self, i: int, line: str) -> Text:
        text = Text(line)
        kind = line[32:45].strip()
        if kind in KIND_STYLES:
            text.stylize(KIND_STYLES[kind], 32, 45)
        if self.pattern is not None:
            text.highlight_regex(self.pattern, "reverse")
        return text

    @property
    def list(self) -> LineList:
        return self.query_one("#event-list", LineList)

    def loaded(self) -> None:
        self._apply(self.filter, keep=self.app.event_index)

    def _apply(self, f: EventFilter, keep: int) -> None:
        self.filter, self.shown = f, self.model.filtered(f)
        shown = self.shown
        self.list.show(len(shown), lambda i: self.model.event_line(int(shown[i])), self._position(keep))
        self._status()

    def _position(self, index: int) -> int:
        return int(min(np.searchsorted(self.shown, max(index, 0)), max(len(self.shown) - 1, 0)))

    def _status(self, note: str = "") -> None:
        pattern = f"   search /{self.pattern.pattern}/" if self.pattern else ""
        events = plural(len(self.model.index), "event", spec=",")
        text = Text(f"{len(self.shown):,} of {events}: {self.filter}{pattern}   ")
        text.append(note, "bold #ff875f")
        self.query_one("#event-status", Static).update(text, layout=False)

    def show_event(self, index: int) -> None:
        if self.ready:
            self.list.set_cursor(self._position(index))

    def on_line_highlighted(self, message: LineHighlighted) -> None:
        message.stop()
        if len(self.shown):
            self.post_message(EventChosen(int(self.shown[message.index])))

    # ---- search and filter -------------------------------------------------------------------------
    def action_ask(self, what: str) -> None:
        box = self.query_one(Input)
        self.asking = what
        box.placeholder = ("regex over the lines, Enter searches forward" if what == "search"
                           else "kind=NAME[,NAME] seq=N step=A:B   (empty: every event)")
        box.value = self.pattern.pattern if what == "search" and self.pattern else (
            str(self.filter) if what == "filter" and self.filter != EventFilter() else "")
        box.add_class("open")
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        box = self.query_one(Input)
        box.remove_class("open")
        self.list.focus()
        try:
            if self.asking == "search":
                self.pattern = re.compile(event.value) if event.value else None
                self.list.refresh()
                self._status()
                if self.pattern:
                    self.action_find(1)
            else:
                self._apply(parse_filter(event.value), keep=self.app.event_index)
        except (re.error, ValueError) as e:
            self.app.notify(f"{e}", severity="error")

    def on_key(self, event) -> None:
        if event.key == "escape" and self.query_one(Input).has_class("open"):
            event.stop()
            self.query_one(Input).remove_class("open")
            self.list.focus()

    def action_clear_filter(self) -> None:
        self._apply(EventFilter(), keep=self.app.event_index)

    def action_find(self, direction: int) -> None:
        if self.pattern is None:
            self.app.notify("no search yet: press / and type a regex", severity="warning")
            return
        self._status("searching…")
        self._search(self.pattern, self.shown, self.list.cursor, direction > 0)

    @work(thread=True, exclusive=True, group="search")
    def _search(self, pattern, shown, pos: int, forward: bool) -> None:
        from textual.worker import get_current_worker
        worker = get_current_worker()
        found = self.model.search(pattern, shown, pos, forward, stop=lambda: worker.is_cancelled)
        if not worker.is_cancelled:
            self.app.call_from_thread(self._found, found)

    def _found(self, pos: int | None) -> None:
        if pos is None:
            self._status("no more matches")
            return
        self._status()
        self.list.cursor = pos
