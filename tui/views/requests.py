"""The Requests view: every request (seq_id, prompt length, output tokens appended, preemptions, TTFT, finish
reason) on the left, and the selected request's lifeline on the right: arrival, prefill chunks, decode steps,
reservations, epoch bumps, preemptions, cancellation, finish and its tokens, one line per event, in log
order; the events where a phase ends say so in brackets (queued up to the first schedule, prefill up to the
first token, a preemption up to the next schedule, decode up to the finish), and the head sums the phases
(tracing/latency.py). The list's `output` and the lifeline's "output: N tokens appended" are one number: the request's token
events with appended=True (a stale token, sampled under an old epoch or after the finish, is counted apart).
Enter on a lifeline line selects that event's step in every view.
"""
from __future__ import annotations

from rich.text import Text
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from tui.data import REQUEST_HEADER
from tui.lines import LineList
from tui.messages import EventChosen, LineHighlighted, LineSelected, RequestChosen
from tui.views.base import View

STYLES = {"preempt": "bold #ff5f5f", "epoch_bump": "#ff875f", "cancel": "bold #ff5f5f", "finish": "bold #5fd75f",
          "request_added": "bold #5fafff", "prefill chunk": "#87afff", "stale": "#ff875f", "queued:": "#d7af5f",
          "first token": "bold #5fd75f", "cancelled": "bold #ff5f5f"}


def _style_event(i: int, line: str) -> Text:
    text = Text(line)
    for word, style in STYLES.items():
        k = line.find(word, 22)
        if k >= 0:
            text.stylize(style, k, k + len(word))
    return text


class RequestsView(View):
    DEFAULT_CSS = """
    RequestsView #request-side { width: 46; border-right: solid $panel; }
    RequestsView .header { background: $panel; color: $text-muted; height: 1; }
    RequestsView #lifeline-head { height: 5; padding: 0 1; }
    """
    title, key = "Requests", "4"

    def compose(self):
        with Horizontal():
            with Vertical(id="request-side"):
                yield Static(REQUEST_HEADER, classes="header")
                yield LineList(id="request-list", width=46)
            with Vertical():
                yield Static(id="lifeline-head")
                yield LineList(id="lifeline", width=220, styler=_style_event)
        self.evs = None

    def loaded(self) -> None:
        self.query_one("#request-list", LineList).show(len(self.model.seq_ids), self.model.request_line)

    def show_request(self, seq_id: int) -> None:
        if not self.ready or not len(self.model.seq_ids):
            return
        ids = self.model.seq_ids
        k = int(min(max(ids.searchsorted(seq_id), 0), len(ids) - 1))
        self.query_one("#request-list", LineList).set_cursor(k)
        head, evs = self.model.lifeline(seq_id)
        self.evs = evs
        text = Text("\n".join(head))
        text.stylize("bold", 0, len(head[0]))
        self.query_one("#lifeline-head", Static).update(text, layout=False)
        self.query_one("#lifeline", LineList).show(len(evs), lambda i: self.model.lifeline_line(seq_id, int(evs[i])))

    def show_event(self, index: int) -> None:
        if self.evs is not None and len(self.evs):
            k = int(self.evs.searchsorted(index))
            if k < len(self.evs) and self.evs[k] == index:
                self.query_one("#lifeline", LineList).set_cursor(k)

    def on_line_highlighted(self, message: LineHighlighted) -> None:
        message.stop()
        if message.lines.id == "request-list":
            self.post_message(RequestChosen(int(self.model.seq_ids[message.index])))

    def on_line_selected(self, message: LineSelected) -> None:
        message.stop()
        if message.lines.id == "lifeline" and self.evs is not None:
            self.post_message(EventChosen(int(self.evs[message.index])))
