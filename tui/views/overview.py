"""The Overview view: the run's header (when, where, which model and engine settings), its counts,
throughput and device time, and the warnings a user must see first: a log cut short, `mdi-trace verify`
findings, the longest device idle gaps. For a run of several ranks: a row naming the ranks, one row of
counts per rank, then the rows of the rank on show.
"""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.views.base import View


class OverviewView(View):
    DEFAULT_CSS = """
    OverviewView #overview { padding: 0 1; height: auto; }
    OverviewView #warnings { padding: 1 1 0 1; height: auto; }
    """
    title, key = "Overview", "1"

    def compose(self):
        with VerticalScroll():
            yield Static(id="overview")
            yield Static(id="warnings")

    def on_mount(self) -> None:
        self.loaded()

    def loaded(self) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", justify="right", no_wrap=True)
        table.add_column()
        for label, value in self.app.logs.overview(self.app.rank):
            table.add_row(label, value)
        self.query_one("#overview", Static).update(table)
        self.show_warnings()

    def show_warnings(self) -> None:
        text = Text()
        for w in self.model.warnings():
            text.append("⚠ " + w + "\n", "bold #ff5f5f")
        verify = self.app.verify_lines
        if verify is None:
            text.append("verify: not run (mdi-trace view --verify runs it)\n" if not self.app.run_verify
                        else "verify: running…\n", "dim")
        else:
            bad = [v for v in verify if not v.startswith(("note:", "no findings"))]
            head, style = (f"verify: {len(bad)} finding(s)", "bold #ff5f5f") if bad else ("verify: no findings",
                                                                                        "#5fd75f")
            text.append(head + "\n", style)
            for v in verify[:12]:
                text.append(f"  {v}\n", "#ff875f" if v in bad else "dim")
        self.query_one("#warnings", Static).update(text)
