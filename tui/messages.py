"""The viewer's messages, in one place (the toolong way): small dataclasses that widgets post and the app
handles, so that views never reach into each other. Selection (the step, the request, the event) lives in
the app's reactive attributes; a view asks for a change by posting one of these.
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class StepChosen(Message):
    """Select a step: `row` is a row of the trace's StepTable (one per step, in log order)."""
    row: int


@dataclass
class RequestChosen(Message):
    """Select a request by its seq_id."""
    seq_id: int


@dataclass
class EventChosen(Message):
    """Select an event by its index in the log (a TraceIndex row); the selected step follows it."""
    index: int


@dataclass
class _LineMessage(Message):
    lines: object      # the LineList (tui/lines.py)
    index: int         # its row

    @property
    def control(self):
        return self.lines


class LineHighlighted(_LineMessage):
    """A LineList's cursor moved to row `index` (by a key or a click, not by the app)."""


class LineSelected(_LineMessage):
    """Enter on row `index` of a LineList."""


@dataclass
class Loaded(Message):
    """The worker has indexed the log (again, in follow mode): every view redraws from the model."""


@dataclass
class Progress(Message):
    """The index scan has reached byte `offset` of `size`."""
    offset: int
    size: int


@dataclass
class Verified(Message):
    """`mdi-trace verify` finished: its findings (and notes), one line each, and its exit code (0 none, 1
    findings, None if it did not finish)."""
    lines: list[str]
    code: int | None = 0
