"""`LineList`: a list of any length drawn with the Line API (ScrollView + render_line returning Strips), so
a view of a million events builds only the rows on screen. The rows come from a function `line(i) -> str`
of the data model (tui/data.py), which caches them; this widget keeps a cursor and posts `LineHighlighted`
when it moves and `LineSelected` on Enter (tui/messages.py). Rendered rows are kept in a small LRU cache of
Strips (kept when only the focus moves), and moving the cursor without scrolling redraws two rows, not the
widget.
"""
from __future__ import annotations

from typing import Callable

from rich.segment import Segment
from textual.cache import LRUCache
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.messages import LineHighlighted, LineSelected

Styler = Callable[[int, str], Text]


class LineList(ScrollView, can_focus=True):
    """`count` rows; row i is `line(i)`, styled by `styler(i, text)` when given."""

    DEFAULT_CSS = """
    LineList { height: 1fr; background: $surface; }
    LineList > .linelist--cursor { background: $accent 40%; }
    LineList:focus > .linelist--cursor { background: $accent; color: $text; }
    """
    COMPONENT_CLASSES = {"linelist--cursor"}
    BINDINGS = [Binding("up", "move(-1)", "Up", show=False), Binding("down", "move(1)", "Down", show=False),
                Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
                Binding("home", "edge(0)", show=False), Binding("end", "edge(1)", show=False),
                Binding("enter", "select", show=False)]

    cursor = reactive(0, always_update=True)

    def __init__(self, *, width: int = 200, styler: Styler | None = None, id: str | None = None):
        super().__init__(id=id)
        self.count, self.line, self.styler, self.line_width = 0, (lambda i: ""), styler, width
        self._strips: LRUCache[tuple, Strip] = LRUCache(512)
        self._styles: dict[bool, tuple[Style, Style]] = {}   # has_focus -> (base, cursor) styles
        self._sizes: tuple | None = None                      # what _size_updated last passed on

    def show(self, count: int, line: Callable[[int], str], cursor: int = 0) -> None:
        """Show `count` rows from `line`, the cursor on row `cursor` (without posting LineHighlighted)."""
        self.count, self.line = count, line
        self.redraw()
        self.virtual_size = Size(self.line_width, count)
        if self._sizes is not None and self.virtual_size != self._sizes[1]:
            # laid out already: set the scrollbars now, so that they are drawn in the frame of the new rows
            # (left to the next layout, they would be marked during it and drawn a frame later)
            self._scroll_update(self.virtual_size)
            self._sizes = (self._sizes[0], self.virtual_size, self._sizes[2])
        self.set_cursor(cursor)
        self.refresh()

    def redraw(self) -> None:
        """Forget the rendered rows (their text or style changed) and redraw."""
        self._strips.clear()
        self.refresh()

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        """Textual's ScrollView compares the compositor's virtual size (none, for a Line API widget) with
        its own on every layout and, finding them unequal, redraws its scrollbars each time: one frame more
        after every view switch. Pass the update on only when a size really changed."""
        sizes = (size, self.virtual_size, container_size)
        if sizes == self._sizes:
            return False
        self._sizes = sizes
        return super()._size_updated(size, virtual_size, container_size, layout)

    def notify_style_update(self) -> None:
        """Forget the rendered rows when the styles change (a theme, the CSS), not when only the focus moves:
        the base style does not depend on the focus, and the cursor's row is cached per focus state, so a
        view switch or Tab redraws from the cache."""
        super().notify_style_update()
        base = next(iter(self._styles.values()))[0] if self._styles else None
        if base is None or base != self.rich_style:
            self._styles.clear()
            self._strips.clear()

    def set_cursor(self, index: int) -> None:
        """Move the cursor without posting LineHighlighted (the app moved the selection)."""
        old = self.cursor
        self.set_reactive(LineList.cursor, -1 if index < 0 else min(index, self.count - 1))  # -1: no cursor
        self._moved(old, self.cursor)

    def _style(self) -> tuple[Style, Style]:
        focus = self.has_focus
        if focus not in self._styles:
            self._styles[focus] = (self.rich_style, self.get_component_rich_style("linelist--cursor"))
        return self._styles[focus]

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        i = scroll_y + y
        width = self.scrollable_content_region.width
        base, cursor = self._style()
        if i >= self.count:
            return Strip.blank(width, base)
        key = (i, scroll_x, width, i == self.cursor and self.has_focus, i == self.cursor)  # focus: the cursor only
        strip = self._strips.get(key)
        if strip is None:
            rich_text = self.styler(i, self.line(i)) if self.styler else Text(self.line(i))
            rich_text.no_wrap = True
            segments = [Segment(s.text, base + s.style if s.style else base)
                        for s in rich_text.render(self.app.console)]
            strip = Strip(segments).crop_extend(scroll_x, scroll_x + width, base)
            if i == self.cursor:
                strip = strip.apply_style(cursor)
            self._strips[key] = strip
        return strip

    def watch_cursor(self, old: int, new: int) -> None:
        self._moved(old, new)
        if self.count:
            self.post_message(LineHighlighted(self, new))

    def _moved(self, old: int, new: int) -> None:
        """Redraw the two rows, or the whole list if it has to scroll."""
        top = self.scroll_offset.y
        if top <= new < top + self.size.height:
            self.refresh_line(old)
            self.refresh_line(new)
        else:
            self._scroll_to_cursor()
            self.refresh()

    def _scroll_to_cursor(self) -> None:
        if self.count and self.size.height:
            self.scroll_to_region(Region(0, self.cursor, 1, 1), animate=False, force=True, x_axis=False,
                                  immediate=True)

    def action_move(self, delta: int) -> None:
        if self.count:
            self.cursor = max(0, min(self.cursor + delta, self.count - 1))

    def action_page(self, direction: int) -> None:
        self.action_move(direction * max(self.size.height - 1, 1))

    def action_edge(self, end: int) -> None:
        if self.count:
            self.cursor = self.count - 1 if end else 0

    def action_select(self) -> None:
        if self.count:
            self.post_message(LineSelected(self, self.cursor))

    def on_resize(self) -> None:
        self._scroll_to_cursor()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def on_click(self, event) -> None:
        i = self.scroll_offset.y + event.y
        if 0 <= i < self.count:
            self.cursor = i
