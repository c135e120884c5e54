"""The Steps view: every step (kind, rows, tokens, preemptions, duration, device time) in a Line API list,
and the selected step's detail under it: its spans, and per batch row the request (seq_id), epoch,
positions, num_tokens, state slot, sampled token and block_table (decoded from the step's schedule event).
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tui.data import STEP_HEADER
from tui.lines import LineList
from tui.messages import LineHighlighted, StepChosen
from tui.views.base import View


def _style_step(i: int, line: str) -> Text:
    text = Text(line)
    if " prefill " in line:
        text.stylize("#87afff", 8, 15)
    if line[28:35].strip() not in ("", "0"):   # preemptions
        text.stylize("bold #ff5f5f", 28, 35)
    return text


def _style_detail(i: int, line: str) -> Text:
    return Text(line, "bold yellow" if i == 0 else "dim" if i == 2 else "")


class StepsView(View):
    DEFAULT_CSS = """
    StepsView .header { background: $panel; color: $text-muted; height: 1; }
    StepsView #step-list { height: 1fr; }
    StepsView #step-detail { height: 1fr; border-top: solid $panel; }
    """
    title, key = "Steps", "3"

    def compose(self):
        yield Static(STEP_HEADER, classes="header")
        yield LineList(id="step-list", width=len(STEP_HEADER) + 2, styler=_style_step)
        yield LineList(id="step-detail", width=240, styler=_style_detail)

    def loaded(self) -> None:
        steps = self.query_one("#step-list", LineList)
        steps.show(len(self.model.steps), self.model.step_line, steps.cursor)

    def show_step(self, row: int) -> None:
        if not self.ready or not len(self.model.steps):
            return
        self.query_one("#step-list", LineList).set_cursor(row)
        lines = self.model.step_detail(row)
        self.query_one("#step-detail", LineList).show(len(lines), lines.__getitem__, -1)

    def on_line_highlighted(self, message: LineHighlighted) -> None:
        message.stop()
        if message.lines.id == "step-list":
            self.post_message(StepChosen(message.index))
