"""The Resources view: who owns each KV block and each state slot just after the selected step was
scheduled (replayed from the index's resource rows, tracing/index.py), the rows of that step marked, and
the pools' occupancy over the whole run as bar charts with the selected step marked under them.
"""
from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.format import plural
from tui.views.base import View

BARS = " ▁▂▃▄▅▆▇█"
CHART_HEIGHT = 4


def grid(owners: np.ndarray, batch: set[int], width: int, name: str) -> Text:
    """One cell per block (or slot): `id:owner`, free ones dim, those of the step's batch bold."""
    cell = max(len(str(len(owners))) + len(str(max(int(owners.max(initial=0)), 0))) + 3, 7)
    per_line = max((width - 2) // cell, 1)
    text = Text()
    for k, owner in enumerate(owners.tolist()):
        label = f"{k}:{'·' if owner < 0 else owner}"
        style = "dim" if owner < 0 else ("bold reverse #ffff5f" if owner in batch else f"color({16 + owner * 7 % 200})")
        text.append(f"{label:>{cell - 1}}", style)
        text.append("\n" if (k + 1) % per_line == 0 else " ")
    return text


def chart(values: np.ndarray, total: int, row: int, width: int) -> Text:
    """Occupancy over the run, one column per bucket of steps (its maximum), `▲` under the selected step."""
    n = len(values)
    w = max(min(width - 8, n), 1)
    edges = np.linspace(0, n, w + 1).astype(np.int64)
    edges[1:] = np.maximum(edges[1:], edges[:-1] + 1)
    peak = np.maximum.reduceat(values, np.minimum(edges[:-1], n - 1)) if n else np.zeros(w)
    levels = np.round(peak / max(total, 1) * CHART_HEIGHT * 8).astype(int)
    text = Text()
    for line in range(CHART_HEIGHT, 0, -1):
        fill = np.clip(levels - (line - 1) * 8, 0, 8)
        label = f"{total if line == CHART_HEIGHT else 0 if line == 1 else '':>6} "
        text.append(label, "dim")
        text.append("".join(BARS[f] for f in fill) + "\n", "#5fafd7")
    col = int(np.searchsorted(edges, row, "right")) - 1
    text.append(" " * 7 + " " * max(col, 0) + "▲", "bold yellow")
    return text


class ResourcesView(View):
    DEFAULT_CSS = """
    ResourcesView #resources { padding: 0 1; height: auto; }
    """
    title, key = "Resources", "5"

    def compose(self):
        with VerticalScroll():
            yield Static(id="resources")

    def on_resize(self) -> None:
        if self.ready:
            self.show_step(self.app.step_row)

    def show_step(self, row: int) -> None:
        if not self.ready or not len(self.model.steps):
            return
        m = self.model
        blocks, slots = m.owners(row)
        batch = {r.seq_id for r in m.schedule_event(row).rows}
        width = max(self.size.width - 6, 40)   # padding and the scrollbar
        text = Text()
        text.append(f"step {m.steps.step[row]}", "bold yellow")
        text.append(f": KV blocks {np.count_nonzero(blocks >= 0)}/{len(blocks)} owned, state slots "
                    f"{np.count_nonzero(slots >= 0)}/{len(slots)} owned; each cell is id:seq_id, highlighted: the "
                    f"requests of this step's batch\n\n", "")
        text.append("KV blocks\n", "bold")
        text.append_text(grid(blocks, batch, width, "block"))
        text.append("\nstate slots\n", "bold")
        text.append_text(grid(slots, batch, width, "slot"))
        text.append(f"\n\nKV blocks owned over {plural(len(m.steps), 'step')}\n", "bold")
        text.append_text(chart(m.blocks_in_use, m.num_blocks, row, width))
        text.append("\n\nstate slots owned\n", "bold")
        text.append_text(chart(m.slots_in_use, m.num_slots, row, width))
        self.query_one("#resources", Static).update(text)
