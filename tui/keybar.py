"""`KeyBar`: the footer line of the viewer: the keys that work where the focus is (the screen's active
bindings that are marked `show`), redrawn only when they change. Textual's Footer rebuilds a widget per
key on every focus change, which costs a keypress more than the 50 ms budget on a slow machine. The app calls
`show_keys` itself right after it moves the focus, so that the new keys reach the screen in the same frame
as the view they belong to (the screen's signal comes a frame later and then finds nothing to change).
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


FIRST = {"Help": 0, "Quit": 1, "Rank": 2}   # Rank: shown only for a run of several ranks (tui/app.py)


class KeyBar(Static):
    DEFAULT_CSS = """
    KeyBar { dock: bottom; height: 1; background: $panel; color: $text-muted; }
    """

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self.show_keys)
        self._shown = None
        self.call_after_refresh(self.show_keys, self.screen)

    def show_keys(self, screen) -> None:
        seen, keys = set(), []
        for _node, binding, enabled, _tip in screen.active_bindings.values():
            if binding.description == "Rank" and getattr(self.app, "logs", None) and self.app.logs.world_size == 1:
                continue   # R on a single log only says there is one rank: the bar keeps its room
            if binding.show and binding.description not in seen:
                seen.add(binding.description)
                keys.append((binding.key_display or self.app.get_key_display(binding), binding.description))
        keys.sort(key=lambda k: FIRST.get(k[1], len(FIRST)))   # these first: they must fit
        if keys != self._shown:
            self._shown = keys
            text = Text()
            for key, what in keys:
                text.append(f" {key} ", "bold reverse")
                text.append(f" {what} ")
            text.append("  ^p palette", "dim")
            self.update(text, layout=False)
