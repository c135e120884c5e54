"""The keys of `mdi-trace view`, in one table (the help screen shows it; the README copies it), and the
help screen itself. `?` opens it; Escape, `q` or `?` close it. Every key is listed, the rank key too (on a
single log it says that the trace has one rank).
"""
from __future__ import annotations

from rich.table import Table
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# (where, the keys as shown, what they do, the binding keys behind them: tests/test_view.py checks that every
# binding of the app, its views, lists and dialogs is listed here, and that nothing here is bound to no key)
KEYS = [
    ("everywhere", "1 … 6", "Overview, Timeline, Steps, Requests, Resources, Events", ("1", "2", "3", "4", "5", "6")),
    ("everywhere", ", / .", "previous / next step (the selected step is shared by every view)", ("comma", "full_stop")),
    ("everywhere", "g", "go to a step by number", ("g",)),
    ("everywhere", "t", "go to a time (1.5s, 120ms, 40us; a bare number is ms)", ("t",)),
    ("everywhere", "r", "go to a request by seq_id", ("r",)),
    ("everywhere", "k", "choose an event kind, then [ / ] for its previous / next event",
     ("k", "left_square_bracket", "right_square_bracket")),
    ("everywhere", "R", "next rank of a run of several ranks (the Timeline draws every rank; the other views "
                        "show one)", ("R",)),
    ("everywhere", "ctrl+p", "command palette: type `step 4812`, `time 2s`, `request 12`, `next preempt`", ("ctrl+p",)),
    ("everywhere", "tab / shift+tab", "next / previous list in the view", ("tab", "shift+tab")),
    ("everywhere", "?  /  q", "this help  /  quit", ("question_mark", "q")),
    ("everywhere", "Escape", "close this help or a prompt", ("escape",)),
    ("lists", "↑ ↓ PgUp PgDn Home End", "move; Enter on a lifeline event selects its step",
     ("up", "down", "pageup", "pagedown", "home", "end", "enter")),
    ("Timeline", "+ / -", "zoom in / out around the selected step", ("plus", "equals_sign", "minus")),
    ("Timeline", "← → (h l)", "pan", ("left", "right", "h", "l")),
    ("Timeline", "0 / c", "fit the whole run / center the selected step", ("0", "c")),
    ("Timeline", "i / I / L", "next / previous / longest device idle gap", ("i", "I", "L")),
    ("Events", "/ then n / N", "regex search, next / previous match", ("slash", "n", "N")),
    ("Events", "f / x", "filter (kind=preempt,cancel seq=12 step=100:200) / clear it", ("f", "x")),
]


def keys_table() -> Table:
    table = Table(box=None, padding=(0, 2), show_header=True, header_style="bold")
    for col in ("where", "keys", "what"):
        table.add_column(col)
    for where, keys, what, _bound in KEYS:
        table.add_row(where, keys, what)
    return table


class HelpScreen(ModalScreen):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 80%; border: thick $accent;
                                  background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self):
        with VerticalScroll():
            yield Static("[b]mdi-trace view[/b]: the keys (Escape closes)\n")
            yield Static(keys_table())
