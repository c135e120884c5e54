"""The Overview view: the run's header (when, where, which model and engine settings), its counts,
throughput and device time, and the warnings a user must see first: a log cut short, `mdi-trace verify`
findings, the longest device idle gaps. For a run of several ranks: a row naming the ranks, one row of
counts per rank, then the rows of the rank on show. A log followed (--follow) is labelled "live" until its
footer arrives, then "complete" (never "cut short"); the verify findings are those of the last run, whose
count is verify's own summary line (every violation it found, also those it does not list).
"""
from __future__ import annotations

import re

from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.format import plural
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
        app, text = self.app, Text()
        live = app.followed and not app.logs.clean   # followed and no footer yet: still being written
        cut = self.model.index.cut if self.model.ready else None
        if live:
            so_far = f": {plural(cut.events, 'complete event', spec=',')} so far" if cut else ""
            text.append(f"● live: the log is still being written{so_far} (following; no footer yet)\n",
                        "bold #5fd75f")
        else:
            for w in self.model.warnings():
                text.append("⚠ " + w + "\n", "bold #ff5f5f")
            if app.followed:
                text.append("● complete: the footer is written\n", "bold #5fd75f")
        text.append_text(self._verify_text())
        self.query_one("#warnings", Static).update(text)

    def _verify_text(self) -> Text:
        """The findings of the last verify run, and whether another is under way."""
        app, text = self.app, Text()
        lines = app.verify_lines
        if lines is None:
            text.append("verify: not run (mdi-trace view --verify runs it)\n" if not app.run_verify
                        else "verify: running…\n", "dim")
            return text
        if app.followed:   # a followed log without its footer is live, not cut short: the line above says so
            lines = [v for v in lines if not (v.startswith("note:") and "cut short" in v)]
        total, bad = verify_summary(lines)
        again = " (re-running on the log as it is now…)" if app.verify_running else ""
        if app.verify_code not in (0, 1):   # not a finding: verify itself failed (its sentence follows)
            failed = "did not finish" if app.verify_code is None else f"failed (exit {app.verify_code})"
            text.append(f"verify: {failed}{again}\n", "bold #ff5f5f")
        elif total:
            text.append(f"verify: {plural(total, 'finding')}{again}\n", "bold #ff5f5f")
        else:
            text.append(f"verify: no findings{again}\n", "#5fd75f")
        shown = [v for v in lines if not SUMMARY.fullmatch(v)][:12]
        for v in shown:
            text.append(f"  {v}\n", "#ff875f" if v in bad else "dim")
        more = total - sum(v in bad for v in shown)
        if total and more > 0:
            text.append(f"  … and {plural(more, 'finding')} more (mdi-trace verify {app.logs.path} lists them)\n",
                        "dim")
        return text


SUMMARY = re.compile(r"no findings|\d+ findings?")   # the last line of `mdi-trace verify`


def verify_summary(lines: list[str]) -> tuple[int, list[str]]:
    """(number of findings, the finding lines) of verify's output. The number is its summary line's, which
    counts every violation found, also those it does not print (tracing/verify.py keeps at most a number of
    them: `Findings.total`); without that line, the finding lines counted."""
    bad = [v for v in lines if not v.startswith("note:") and not SUMMARY.fullmatch(v)]
    summary = next((v for v in reversed(lines) if SUMMARY.fullmatch(v)), None)
    if summary is None:
        return len(bad), bad
    return (0 if summary == "no findings" else int(summary.split()[0])), bad
