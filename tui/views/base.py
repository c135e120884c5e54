"""`View`: what every view of the viewer has: a name and a key on the view bar, the data model of the app,
and two hooks the app calls: `loaded()` when the log has been (re)indexed and `show_step(row)` when the
shared selected step moves (tui/app.py owns the selection in its reactive attributes).
"""
from __future__ import annotations

from textual.containers import Vertical

from tui.data import TraceModel


class View(Vertical):
    """One view; subclasses set `name_` and `key` and override the hooks they need."""

    DEFAULT_CSS = """
    View { height: 1fr; }
    View .waiting { color: $text-muted; padding: 1 2; }
    """
    title = ""
    key = ""
    generation = -1    # the app's model generation this view last loaded

    @property
    def model(self) -> TraceModel:
        return self.app.model

    @property
    def ready(self) -> bool:
        return self.app.model.ready

    def loaded(self) -> None:
        """The model has (new) data: redraw everything."""

    def show_step(self, row: int) -> None:
        """The selected step is StepTable row `row`."""

    def show_request(self, seq_id: int) -> None:
        """The selected request is `seq_id`."""

    def show_event(self, index: int) -> None:
        """The selected event is `index`."""
