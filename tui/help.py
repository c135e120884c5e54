"""The keys of `mdi-trace view`, in one table (the help screen shows it; the README copies it), and the
help screen itself. `?` opens it; Escape, `q` or `?` close it. The rank key is listed only for a run of
several ranks, the only place it works.
"""
from __future__ import annotations

from rich.table import Table
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("everywhere", "1 … 6", "Overview, Timeline, Steps, Requests, Resources, Events"),
    ("everywhere", ", / .", "previous / next step (the selected step is shared by every view)"),
    ("everywhere", "g", "go to a step by number"),
    ("everywhere", "t", "go to a time (1.5s, 120ms, 40us; a bare number is ms)"),
    ("everywhere", "r", "go to a request by seq_id"),
    ("everywhere", "k", "choose an event kind, then [ / ] for its previous / next event"),
    ("everywhere", "ctrl+p", "command palette: type `step 4812`, `time 2s`, `request 12`, `next preempt`"),
    ("everywhere", "tab", "next list in the view"),
    ("everywhere", "?  /  q", "this help  /  quit"),
    ("everywhere", "R", "next rank of a run (the Timeline draws every rank; the other views show one)"),
    ("lists", "↑ ↓ PgUp PgDn Home End", "move; Enter on a lifeline event selects its step"),
    ("Timeline", "+ / -", "zoom in / out around the selected step"),
    ("Timeline", "← → (h l)", "pan"),
    ("Timeline", "0 / c", "fit the whole run / center the selected step"),
    ("Timeline", "i / I / L", "next / previous / longest device idle gap"),
    ("Events", "/ then n / N", "regex search, next / previous match"),
    ("Events", "f / x", "filter (kind=preempt,cancel seq=12 step=100:200) / clear it"),
]


def keys_table(several_ranks: bool = True) -> Table:
    table = Table(box=None, padding=(0, 2), show_header=True, header_style="bold")
    for col in ("where", "keys", "what"):
        table.add_column(col)
    for row in KEYS:
        if several_ranks or row[1] != "R":
            table.add_row(*row)
    return table


class HelpScreen(ModalScreen):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 80%; border: thick $accent;
                                  background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, several_ranks: bool = False):
        super().__init__()
        self.several_ranks = several_ranks

    def compose(self):
        with VerticalScroll():
            yield Static("[b]mdi-trace view[/b]: the keys (Escape closes)\n")
            yield Static(keys_table(self.several_ranks))
