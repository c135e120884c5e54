"""The reader: opens a log, checks its header, iterates its events with their byte offsets, and says
whether it ended cleanly (ARCHITECTURE.md §5). Imports neither torch nor engine/.

A damaged or hostile file gives a `TraceError` with one sentence, never a traceback, and memory stays
bounded: msgpack's unpacker limits every string, array and map to what a sane log can hold. A log cut
short (a crash, or a run still going) serves every complete event before the cut and reports the cut.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import msgpack

from tracing.schema import EVENTS, KIND, MAGIC, SCHEMA_VERSION, TRAILER_SIZE, TRAILER_TAG

# Bounds on any single object of a log (a prompt is at most max_seq_len tokens; a batch a few thousand rows).
LIMITS = dict(max_buffer_size=64 << 20, max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 22,
              max_map_len=1 << 12, max_ext_len=0)


class TraceError(ValueError):
    """An unreadable log; the message is one sentence for the user."""


@dataclass(slots=True)
class Cut:
    """Where a log without a clean end stops."""
    events: int        # complete events before the cut
    offset: int        # byte offset just after the last complete event
    size: int          # file size

    def __str__(self) -> str:
        return (f"the log was cut short: {self.events} complete events, the last ending at byte {self.offset} "
                f"of {self.size}")


@dataclass(slots=True)
class Event:
    offset: int
    kind: str
    fields: list

    def __getattr__(self, name):
        names = EVENTS[KIND[self.kind]][1]
        if name in names:
            return self.fields[names.index(name)]
        raise AttributeError(name)


class TraceFile:
    """One log: `header`, `footer` (None if cut short), `cut` (None if clean), `events()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise TraceError(f"{path} is empty, not an mdi-trace log.")
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # pages read on demand
        except OSError as e:
            raise TraceError(f"cannot read {path}: {e.strerror or e}.") from None
        self.header, self.body_offset = self._read_header()
        self.footer = self._read_footer()
        self.cut: Cut | None = None

    def _unpacker(self, offset: int) -> msgpack.Unpacker:
        u = msgpack.Unpacker(raw=False, strict_map_key=False, **LIMITS)
        u.feed(memoryview(self.data)[offset:offset + LIMITS["max_buffer_size"]])
        return u

    def _read_header(self) -> tuple[dict, int]:
        u = self._unpacker(0)
        try:
            header = u.unpack()
        except Exception:
            raise TraceError(f"{self.path} is not an mdi-trace log (no readable header).") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise TraceError(f"{self.path} is not an mdi-trace log (wrong magic).")
        version = header.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"{self.path} has schema version {version!r}; this mdi-trace reads version "
                             f"{SCHEMA_VERSION}.")
        return header, u.tell()

    def _read_footer(self) -> list | None:
        if len(self.data) < self.body_offset + TRAILER_SIZE or self.data[-TRAILER_SIZE] != TRAILER_TAG:
            return None
        offset = int.from_bytes(self.data[-TRAILER_SIZE + 1:], "big")
        if not self.body_offset <= offset < len(self.data) - TRAILER_SIZE:
            return None
        try:
            footer = self._unpacker(offset).unpack()
        except Exception:
            return None
        if isinstance(footer, list) and footer and footer[0] == KIND["footer"]:
            return footer[1:]
        return None

    @property
    def clean(self) -> bool:
        return self.footer is not None

    def events(self, offset: int | None = None) -> Iterator[Event]:
        """Every complete event from `offset` (default: the first), in order. Sets `cut` if the log ends
        in the middle of an event or without a footer. Raises TraceError on a malformed event."""
        offset = self.body_offset if offset is None else offset
        end = len(self.data) - (TRAILER_SIZE if self.clean else 0)
        count = 0
        while offset < end:
            u = self._unpacker(offset)
            try:
                obj = u.unpack()
            except msgpack.OutOfData:
                break
            except Exception as e:
                raise TraceError(f"{self.path} is damaged at byte {offset} ({type(e).__name__}).") from None
            kind = _check_event(obj, self.path, offset)
            if kind == "footer":
                return
            yield Event(offset, kind, obj[1:])
            offset += u.tell()
            count += 1
        if not self.clean:
            self.cut = Cut(count, offset, len(self.data))


def _check_event(obj, path, offset) -> str:
    if not isinstance(obj, list) or not obj or obj[0] not in EVENTS:
        raise TraceError(f"{path} is damaged at byte {offset}: not an event.")
    name, fields = EVENTS[obj[0]]
    if len(obj) != len(fields) + 1:
        raise TraceError(f"{path} is damaged at byte {offset}: a {name} event with {len(obj) - 1} fields, "
                         f"expected {len(fields)}.")
    return name


def open_trace(path: str | Path) -> TraceFile:
    return TraceFile(path)
