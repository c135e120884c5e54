"""`View`: what every view of the viewer has: a name and a key on the view bar, the data model of the app,
and two hooks the app calls: `loaded()` when the log has been (re)indexed and `show_step(row)` when the
shared selected step moves (tui/app.py owns the selection in its reactive attributes).
"""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical

from tui.data import TraceModel


class View(Vertical):
    """One view; subclasses set `title` (its name on the view bar) and `key`, and override the hooks they need."""

    DEFAULT_CSS = """
    View { height: 1fr; }
    View .waiting { color: $text-muted; padding: 1 2; }
    """
    BINDINGS = [Binding("tab", "cycle(1)", "Next list", show=False),
                Binding("shift+tab", "cycle(-1)", "Previous list", show=False)]
    title = ""
    key = ""
    generation: object = None   # the (model generation, rank) this view last loaded
    shown_selection: tuple = (None, None, None)   # the (step row, seq_id, event) it last showed (tui/app.py)

    @property
    def model(self) -> TraceModel:
        return self.app.model

    @property
    def ready(self) -> bool:
        return self.app.model.ready

    def action_cycle(self, direction: int) -> None:
        """Tab: the next widget of this view that takes the focus. The views not on show are laid out off
        screen (tui/app.py), so the screen's own focus chain would wander into them."""
        chain = [w for w in self.query("*") if w.can_focus and w.display]
        if chain:
            here = chain.index(self.screen.focused) if self.screen.focused in chain else -1
            self.screen.set_focus(chain[(here + direction) % len(chain)])

    def loaded(self) -> None:
        """The model has (new) data: redraw everything."""

    def show_step(self, row: int) -> None:
        """The selected step is StepTable row `row`."""

    def show_request(self, seq_id: int) -> None:
        """The selected request is `seq_id`."""

    def show_event(self, index: int) -> None:
        """The selected event is `index`."""
