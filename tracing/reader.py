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

FOOTER = KIND["footer"]
CHUNK = 1 << 20  # bytes fed to the streaming unpacker at a time

# Bounds on any single object of a log (a prompt is at most max_seq_len tokens; a batch a few thousand rows).
# A buffer bound is also the memory bound: a decoded object takes at most ~64 bytes per byte of input.
LIMITS = dict(max_buffer_size=16 << 20, max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 22,
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
    """One log: `header`, `footer` (None if cut short), `cut` (None if clean; set once `events()` or
    `objects()` has read to the end), `events()`, `event_at(offset)`."""

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
        self.footer_offset, self.footer = self._read_footer()
        self.cut: Cut | None = None

    def close(self) -> None:
        self.data.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read_header(self) -> tuple[dict, int]:
        u = _unpacker()
        u.feed(self.data[:LIMITS["max_buffer_size"]])
        try:
            header = u.unpack()
        except msgpack.OutOfData:
            if _is_map_start(self.data[0]):
                raise TraceError(f"{self.path} ends inside its header: it was cut short before its first "
                                 f"event.") from None
            raise TraceError(f"{self.path} is not an mdi-trace log (no readable header).") from None
        except Exception:
            raise TraceError(f"{self.path} is not an mdi-trace log (no readable header).") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise TraceError(f"{self.path} is not an mdi-trace log (wrong magic).")
        version = header.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"{self.path} has schema version {version!r}; this mdi-trace reads version "
                             f"{SCHEMA_VERSION}, so open it with the mdi-trace that wrote it.")
        return header, u.tell()

    def _read_footer(self) -> tuple[int | None, list | None]:
        """(offset, fields) of the footer the trailer points at: a footer event ending exactly at the
        trailer. (None, None) for a log without a clean end."""
        end = len(self.data) - TRAILER_SIZE
        if end < self.body_offset or self.data[end] != TRAILER_TAG:
            return None, None
        offset = int.from_bytes(self.data[end + 1:], "big")
        if not self.body_offset <= offset < end:
            return None, None
        u = _unpacker()
        u.feed(self.data[offset:end])
        try:
            footer = u.unpack()
        except Exception:
            return None, None
        if offset + u.tell() != end or not isinstance(footer, list) or not footer or footer[0] != FOOTER \
                or len(footer) != len(EVENTS[FOOTER][1]) + 1:
            return None, None
        return offset, footer[1:]

    @property
    def clean(self) -> bool:
        return self.footer is not None

    def objects(self, offset: int | None = None) -> Iterator[tuple[int, list]]:
        """(byte offset, event array `[kind, *fields]`) of every complete event from `offset` (default:
        the first), each checked for a known kind and its field count, through one streaming unpacker
        (the index's fast path). Stops before the footer. At the end sets `cut` if the log has no
        clean end; raises TraceError on a malformed event."""
        base = start = fed = self.body_offset if offset is None else offset
        end = self.footer_offset if self.clean else len(self.data)
        u, count = _unpacker(), 0
        while True:
            try:
                obj = u.unpack()
            except msgpack.OutOfData:
                if fed >= end:
                    break
                fed = self._feed(u, fed, min(fed + CHUNK, end), start)
                continue
            except Exception as e:
                raise TraceError(f"{self.path} is damaged at byte {start} ({_why(e)}).") from None
            if _check_event(obj, self.path, start) == FOOTER:  # a footer with its trailer cut short
                rest = self.data[base + u.tell():]
                if self.clean or len(rest) >= TRAILER_SIZE or rest[:1] not in (b"", bytes([TRAILER_TAG])):
                    raise TraceError(f"{self.path} is damaged at byte {start}: a footer before the end.")
                break
            yield start, obj
            count += 1
            start = base + u.tell()
        if self.clean and start != end:
            raise TraceError(f"{self.path} is damaged at byte {start}: an incomplete event before the footer.")
        if not self.clean:
            self.cut = Cut(count, start, len(self.data))

    def _feed(self, u: msgpack.Unpacker, start: int, end: int, event: int) -> int:
        """Feed bytes [start, end) to `u`; returns `end`. An event larger than the buffer is an error."""
        try:
            u.feed(self.data[start:end])
        except msgpack.BufferFull:
            raise TraceError(f"{self.path} is damaged at byte {event} (an object larger than "
                             f"{LIMITS['max_buffer_size'] >> 20} MiB).") from None
        return end

    def events(self, offset: int | None = None) -> Iterator[Event]:
        """Every complete event from `offset` (default: the first), in order, as `Event`s; see `objects`."""
        for start, obj in self.objects(offset):
            yield Event(start, EVENTS[obj[0]][0], obj[1:])

    def event_at(self, offset: int) -> Event:
        """The one event that starts at byte `offset` (an offset from `events()` or the footer's step
        index), decoded alone: a window that doubles until the event is complete."""
        end = self.footer_offset if self.clean else len(self.data)
        if not self.body_offset <= offset < end:
            raise TraceError(f"{self.path} has no event at byte {offset} (events lie in bytes "
                             f"{self.body_offset}-{end}).")
        u, fed, window = _unpacker(), offset, 4096
        while True:
            try:
                obj = u.unpack()
                break
            except msgpack.OutOfData:
                if fed >= end:
                    raise TraceError(f"{self.path} has no complete event at byte {offset}.") from None
                fed, window = self._feed(u, fed, min(fed + window, end), offset), min(window * 2, CHUNK)
            except Exception as e:
                raise TraceError(f"{self.path} is damaged at byte {offset} ({_why(e)}).") from None
        kind = _check_event(obj, self.path, offset)
        return Event(offset, EVENTS[kind][0], obj[1:])


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=False, **LIMITS)


def _is_map_start(byte: int) -> bool:
    return 0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF)


def _why(e: Exception) -> str:
    """A few words on why msgpack refused an object."""
    if isinstance(e, msgpack.StackError):
        return "objects nested too deeply"
    text = str(e).split("\n")[0].rstrip(".")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _check_event(obj, path, offset) -> int:
    """The kind code of a well-formed event array; TraceError for anything else."""
    if type(obj) is not list or not obj or type(obj[0]) is not int or obj[0] not in EVENTS:
        raise TraceError(f"{path} is damaged at byte {offset}: not an event.")
    name, fields = EVENTS[obj[0]]
    if len(obj) != len(fields) + 1:
        raise TraceError(f"{path} is damaged at byte {offset}: a {name} event with {len(obj) - 1} fields, "
                         f"expected {len(fields)}.")
    return obj[0]


def open_trace(path: str | Path) -> TraceFile:
    return TraceFile(path)
