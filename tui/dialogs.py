"""Small screens and the command palette's provider: `Ask` (one line of input: a step, a time, a request,
an event kind) and `JumpCommands`, which turns what is typed in the palette (`step 4812`, `time 2s`,
`request 12`, `next preempt`) into a jump.
"""
from __future__ import annotations

from functools import partial

from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from tui.data import KIND_NAMES


class Ask(ModalScreen[str | None]):
    """A prompt and an input; dismisses with the text on Enter, None on Escape."""

    DEFAULT_CSS = """
    Ask { align: center middle; }
    Ask > Vertical { width: 64; height: auto; border: thick $accent; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, prompt: str, placeholder: str = ""):
        super().__init__()
        self.prompt, self.placeholder = prompt, placeholder

    def compose(self):
        with Vertical():
            yield Label(self.prompt)
            yield Input(placeholder=self.placeholder)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class JumpCommands(Provider):
    """`step N`, `time T`, `request N`, `next KIND`, `previous KIND` typed in the command palette."""

    async def search(self, query: str) -> Hits:
        app = self.app
        word, _, rest = query.strip().partition(" ")
        rest = rest.strip()
        jumps = {"step": app.jump_step, "time": app.jump_time, "request": app.jump_request}
        if word in jumps and rest:
            yield Hit(1.0, f"{word} {rest}", partial(jumps[word], rest), help=f"go to {word} {rest}")
        if word in ("next", "previous", "prev"):
            for kind in KIND_NAMES:
                if kind.startswith(rest):
                    forward = word == "next"
                    yield Hit(0.9 if rest else 0.5, f"{'next' if forward else 'previous'} {kind}",
                              partial(app.jump_kind, kind, forward), help=f"the {word} {kind} event")
