"""The reader: opens a log, checks its header, iterates its events with their byte offsets, and says
whether it ended cleanly (ARCHITECTURE.md §5). Imports neither torch nor engine/.

A damaged or hostile file gives a `TraceError` with one sentence, never a traceback, and memory stays
bounded: msgpack's unpacker limits every string, array and map to what a sane log can hold (`LIMITS`), and
an object that claims more than a limit is an error even where the file ends before the object would. The
header's fields and every event's fields are type-checked against tracing/schema.py (HEADER_TYPES,
EVENT_TYPES: the top-level type of each field), so that what the tools index into is what they expect. A
log cut short (a crash, or a run still going) serves every complete event before the cut and reports the
cut.

What a consumer gets is a typed record per event (tracing/schema.py RECORDS: `Schedule`, `Token`, ..., each a
NamedTuple of its kind's fields by name, plus `offset`, the byte it starts at; a schedule event's rows are
`Row`s), from `events()` and `event_at()`; `objects()` gives the raw arrays, for the index's columnar scan. A
version-1 log is read as version 2: its arrays are laid out alike and only names changed, so the one value to
convert is an epoch bump's reason code (by name, V1_EPOCH_REASONS to EPOCH_REASONS). A version-1 or version-2 log
is read as version 3: its request_added and cancel events are checked with the fields they had, then get the one
field version 3 appended to each (V3_APPENDED: a request's arrival is its `t`, a cancellation's cause "abort").
"""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NoReturn

import msgpack

from tracing.schema import ENGINE_LEAST, ENGINE_TYPES, EPOCH_REASONS, EVENT_TYPES, EVENTS, HEADER_TYPES, KIND, \
    MAGIC, PLATFORM_TYPES, READ_VERSIONS, READ_VERSIONS_TEXT, RECORDS, ROW_FIELDS, SCHEMA_VERSION, TRAILER_SIZE, TRAILER_TAG, \
    V1_EPOCH_REASONS, V1_REASON_RENAMED, V3_APPENDED, Event, Row

FOOTER, SCHEDULE, EPOCH_BUMP = KIND["footer"], KIND["schedule"], KIND["epoch_bump"]
_ROWS_AT = EVENTS[SCHEDULE][1].index("rows")                  # in a record (the array's index less one)
_REASON_AT = EVENTS[EPOCH_BUMP][1].index("reason") + 1        # in an event array
# a version-1 epoch reason code -> version 2's, by name
_V1_REASON = tuple(EPOCH_REASONS.index(V1_REASON_RENAMED.get(r, r)) for r in V1_EPOCH_REASONS)
CHUNK = 1 << 20  # bytes fed to the streaming unpacker at a time

# Bounds on any single object of a log (a prompt is at most max_seq_len tokens; a batch a few thousand rows).
# A buffer bound is also the memory bound: a decoded object takes at most ~64 bytes per byte of input.
LIMITS = dict(max_buffer_size=16 << 20, max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 22,
              max_map_len=1 << 12, max_ext_len=0)

_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "nil": type(None)}
_TYPE_WORDS = {int: "an int", float: "a float", bool: "a bool", str: "a str", type(None): "nil", list: "a list",
               dict: "a map", bytes: "a bin"}


def _types(spec: str) -> tuple[type, ...]:
    """The Python types that a schema type allows at the top level: "float or int" -> (float, int),
    "list[int or nil]" -> (list,), "map[str, int]" -> (dict,)."""
    out, part = [], ""
    for word in spec.split(" or "):
        part = f"{part} or {word}" if part else word
        if part.count("[") == part.count("]"):   # an "or" inside list[...] belongs to the items
            out.append(list if part.startswith("list") else dict if part.startswith("map") else _PY_TYPES[part])
            part = ""
    return tuple(out)


def _a(value) -> str:
    """What a decoded value is, in words: "an int", "a list"."""
    return _TYPE_WORDS.get(type(value), "an object of another type")


def _either(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_WORDS[t] for t in types)


_FIELD_TYPES = {code: tuple(map(_types, EVENT_TYPES[code])) for code in EVENTS}
# kind code -> (array index of the field version 3 appended, the array index it is copied from or a constant)
_APPENDED = {KIND[kind]: (EVENTS[KIND[kind]][1].index(field) + 1,
                          EVENTS[KIND[kind]][1].index(source) + 1 if isinstance(source, str) else None, source)
             for kind, (field, source) in V3_APPENDED.items()}
assert all(at == len(EVENTS[code][1]) for code, (at, _, _) in _APPENDED.items()), "version 3 appends at the end"


def _event_check(code: int, old: bool = False):
    """A function of a decoded object that says whether it is a well-formed event of kind `code`: a list of
    an int (the kind code) and the kind's fields, each of the top-level type EVENT_TYPES gives it. Written out
    as one expression per kind (`f0.__class__ is int and ...`: about 3x faster than comparing `map(type, obj)`
    with a signature; the index's scan checks millions of events). A list of another length raises
    ValueError, which callers count as False. `old`: as a version-1 or version-2 log has it, without the field
    version 3 appended."""
    count = len(EVENT_TYPES[code]) - (old and code in _APPENDED)
    names = [f"f{i}" for i in range(count)]
    tests = ["k.__class__ is int"] + [
        "(" + " or ".join(f"{name} is None" if t is type(None) else f"{name}.__class__ is {t.__name__}"
                          for t in types) + ")"
        for name, types in zip(names, _FIELD_TYPES[code])]
    source = (f"def check(o, list=list, int=int, float=float, bool=bool, str=str, dict=dict):\n"
              f"    if o.__class__ is not list:\n"
              f"        return False\n"
              f"    k, {', '.join(names)} = o\n"
              f"    return {' and '.join(tests)}\n")
    namespace: dict = {}
    exec(source, namespace)
    return namespace["check"]


# kind code -> its check, built once; and as versions 1 and 2 have it
_CHECKS = {code: _event_check(code) for code in EVENTS}
_OLD_CHECKS = {code: _event_check(code, old=True) for code in EVENTS}
_HEADER_TYPES = {name: _types(spec) for name, spec in HEADER_TYPES.items()}
_MAP_TYPES = {"engine": {k: _types(v) for k, v in ENGINE_TYPES.items()},
              "platform": {k: _types(v) for k, v in PLATFORM_TYPES.items()}}


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


def record(obj: list, offset: int | None, path="the log") -> Event:
    """The typed record of a well-formed event array (as `objects()` yields them): its kind's NamedTuple, with
    the byte `offset`; a schedule event's rows as `Row`s (TraceError, one sentence, for a row that is not an
    array of the row's fields: what a row holds is its consumers' to check)."""
    cls = RECORDS[obj[0]]
    if obj[0] != SCHEDULE:
        return cls(*obj[1:], offset)
    fields = obj[1:]
    rows = fields[_ROWS_AT]
    if any(r.__class__ is not list or len(r) != len(ROW_FIELDS) for r in rows):
        raise TraceError(f"{path} is damaged at byte {offset}: a malformed schedule event (rows that are not arrays of "
                         f"{len(ROW_FIELDS)} fields).")
    fields[_ROWS_AT] = [Row(*r) for r in rows]
    return cls(*fields, offset)


def _upgrade(objects: Iterator[tuple[int, list]], version: int) -> Iterator[tuple[int, list]]:
    """A version-1 or version-2 log's (offset, event array) pairs as version 3 writes them: a version-1 epoch
    bump's reason code mapped by name (a code outside V1_EPOCH_REASONS is left for verify to report), and the
    field version 3 appended to request_added and cancel events (`_APPENDED`)."""
    appended, v1 = _APPENDED, version == 1
    for start, obj in objects:
        code = obj[0]
        if code in appended:
            _, source, value = appended[code]
            obj.append(obj[source] if source is not None else value)
        elif v1 and code == EPOCH_BUMP and 0 <= obj[_REASON_AT] < len(_V1_REASON):
            obj[_REASON_AT] = _V1_REASON[obj[_REASON_AT]]
        yield start, obj


class TraceFile:
    """One log: `header`, `version` (its schema version, 1, 2 or 3: every event is served as version 3),
    `footer` (a Footer record, None if cut short), `cut` (None if clean; set once `events()` or `objects()`
    has read to the end), `events()`, `event_at(offset)`."""

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
        self.version: int = self.header["schema_version"]
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
                self._refuse_overclaim(0, min(len(self.data), LIMITS["max_buffer_size"]))
                raise TraceError(f"{self.path} ends inside its header: it was cut short before its first "
                                 f"event.") from None
            raise TraceError(f"{self.path} is not an mdi-trace log (no readable header).") from None
        except Exception as e:
            if _is_map_start(self.data[0]):
                raise TraceError(f"{self.path} has an unreadable header ({_why(e)}).") from None
            raise TraceError(f"{self.path} is not an mdi-trace log (no readable header).") from None
        if type(header) is not dict or header.get("magic") != MAGIC:
            raise TraceError(f"{self.path} is not an mdi-trace log (wrong magic).")
        version = header.get("schema_version")
        if version is not None and type(version) is not int:  # True and 1.0 equal 1, but are no version
            raise TraceError(f"{self.path} has a damaged header: schema_version is {_a(version)}, not an int.")
        if version not in READ_VERSIONS:
            raise TraceError(f"{self.path} has schema version {version!r}; this mdi-trace reads versions "
                             f"{READ_VERSIONS_TEXT}, so open it with the mdi-trace that wrote it.")
        _check_header(header, self.path)
        return header, u.tell()

    def _read_footer(self) -> tuple[int | None, Event | None]:
        """(offset, record) of the footer the trailer points at: a footer event ending exactly at the
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
        if offset + u.tell() != end or type(footer) is not list or not footer or type(footer[0]) is not int \
                or footer[0] != FOOTER or len(footer) != len(EVENTS[FOOTER][1]) + 1:
            return None, None
        _check_event(footer, self.path, offset)  # a footer in its place with a field of the wrong type
        return offset, record(footer, offset)

    @property
    def clean(self) -> bool:
        return self.footer is not None

    def objects(self, offset: int | None = None) -> Iterator[tuple[int, list]]:
        """(byte offset, event array `[kind, *fields]`) of every complete event from `offset` (default:
        the first), each checked for a known kind, its field count and the top-level type of each field
        (tracing/schema.py EVENT_TYPES), through one streaming unpacker (the index's fast path), laid out as
        version 3 (an older log converted, `_upgrade`). Stops before the footer. At the end sets `cut` if the log has
        no clean end; raises TraceError on a malformed event, and on an object that claims more than `LIMITS`
        allow, even one the file ends inside (an object merely cut by the end of the file is the cut)."""
        objects = self._objects(offset)
        return objects if self.version == SCHEMA_VERSION else _upgrade(objects, self.version)

    def _objects(self, offset: int | None) -> Iterator[tuple[int, list]]:
        base = start = fed = self.body_offset if offset is None else offset
        end = self.footer_offset if self.clean else len(self.data)
        u, count, checks = _unpacker(), 0, _CHECKS if self.version == SCHEMA_VERSION else _OLD_CHECKS
        while True:
            try:
                obj = u.unpack()
            except msgpack.OutOfData:
                if fed >= end:
                    self._refuse_overclaim(start, end)
                    break
                fed = self._feed(u, fed, min(fed + CHUNK, end), start)
                continue
            except Exception as e:
                raise TraceError(f"{self.path} is damaged at byte {start} ({_why(e)}).") from None
            try:  # a known kind, its field count and every field's type
                good = checks[obj[0]](obj)
            except (IndexError, KeyError, TypeError, ValueError):
                good = False
            if not good:
                _refuse(obj, self.path, start, checks is _OLD_CHECKS)
            if obj[0] == FOOTER:  # a footer with its trailer cut short
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

    def _refuse_overclaim(self, start: int, end: int) -> None:
        """TraceError if the object at `start`, which the bytes up to `end` do not complete, claims more
        than `LIMITS` allow; else nothing (it is merely cut short)."""
        if start < end and (why := _overclaim(self.data, start, end)) is not None:
            raise TraceError(f"{self.path} is damaged at byte {why[0]}{why[1]}.")

    def _feed(self, u: msgpack.Unpacker, start: int, end: int, event: int) -> int:
        """Feed bytes [start, end) to `u`; returns `end`. An event larger than the buffer is an error."""
        try:
            u.feed(self.data[start:end])
        except msgpack.BufferFull:
            raise TraceError(f"{self.path} is damaged at byte {event} (an object larger than "
                             f"{LIMITS['max_buffer_size'] >> 20} MiB).") from None
        return end

    def events(self, offset: int | None = None) -> Iterator[Event]:
        """Every complete event from `offset` (default: the first), in order, as typed records (`record`);
        see `objects`."""
        path = self.path
        for start, obj in self.objects(offset):
            yield record(obj, start, path)

    def event_at(self, offset: int) -> Event:
        """The one event that starts at byte `offset` (an offset from `events()` or the footer's step
        index), decoded alone (a window that doubles until the event is complete) and checked as `objects`
        checks each event."""
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
                    self._refuse_overclaim(offset, end)
                    raise TraceError(f"{self.path} has no complete event at byte {offset}.") from None
                fed, window = self._feed(u, fed, min(fed + window, end), offset), min(window * 2, CHUNK)
            except Exception as e:
                raise TraceError(f"{self.path} is damaged at byte {offset} ({_why(e)}).") from None
        if self.version == SCHEMA_VERSION:
            _check_event(obj, self.path, offset)
        else:
            _check_event(obj, self.path, offset, _OLD_CHECKS)
            obj = next(_upgrade(iter([(offset, obj)]), self.version))[1]
        return record(obj, offset, self.path)


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=False, **LIMITS)


def _is_map_start(byte: int) -> bool:
    return 0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF)


_EXCEEDS = re.compile(r"(\d+) exceeds max_(str|bin|array|map|ext)_len\((\d+)\)")
_CLAIMS = {"str": ("a str", "bytes"), "bin": ("a bin", "bytes"), "array": ("an array", "elements"),
           "map": ("a map", "entries"), "ext": ("an ext object", "bytes")}


def _claim(what: str, n: int, limit: int) -> str:
    article, unit = _CLAIMS[what]
    return f"{article} claiming {n:,} {unit}, more than the reader's limit of {limit:,}"


def _why(e: Exception) -> str:
    """A few words on why msgpack refused an object."""
    if isinstance(e, msgpack.StackError):
        return "objects nested too deeply"
    text = str(e).split("\n")[0].rstrip(".")
    if m := _EXCEEDS.fullmatch(text):
        return _claim(m[2], int(m[1]), int(m[3]))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# msgpack type bytes of a str, bin or ext with a length field: (kind, bytes of the length); of an array or map
# header with a count: (entries per count, bytes of the count); of fixed-size scalars: their size
_SIZED = {0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4), 0xC4: ("bin", 1), 0xC5: ("bin", 2),
          0xC6: ("bin", 4), 0xC7: ("ext", 1), 0xC8: ("ext", 2), 0xC9: ("ext", 4)}
_COUNTED = {0xDC: ("array", 1, 2), 0xDD: ("array", 1, 4), 0xDE: ("map", 2, 2), 0xDF: ("map", 2, 4)}
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3,
          0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}


def _overclaim(data, start: int, end: int) -> tuple[int, str] | None:
    """(byte, why) when the msgpack object at `start`, which `data[start:end]` does not complete, claims a
    length beyond `LIMITS` (msgpack checks a str's, bin's or ext's only once its bytes are there) or needs
    more bytes than the unpacker's buffer holds; None when it is merely cut short. Walks the object's type
    bytes only: msgpack has refused anything else in them already."""
    pos, pending = start, 1   # objects still to read, each at least one byte
    while pending and pos < end:
        b, pending = data[pos], pending - 1
        if b <= 0x7F or b >= 0xE0:                       # fixints
            pos += 1
        elif b <= 0x8F:                                  # fixmap
            pending, pos = pending + 2 * (b & 0x0F), pos + 1
        elif b <= 0x9F:                                  # fixarray
            pending, pos = pending + (b & 0x0F), pos + 1
        elif b <= 0xBF:                                  # fixstr (at most 31 bytes)
            pos += 1 + (b & 0x1F)
        elif b in _FIXED:
            if 0xD4 <= b <= 0xD8:                        # fixext: 1 to 16 bytes
                return pos, ": " + _claim("ext", _FIXED[b] - 2, LIMITS["max_ext_len"])
            pos += _FIXED[b]
        elif b in _SIZED:
            what, width = _SIZED[b]
            if pos + 1 + width > end:
                break                                    # cut inside the length itself
            n = int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            if n > LIMITS[f"max_{what}_len"]:
                return pos, ": " + _claim(what, n, LIMITS[f"max_{what}_len"])
            pos += 1 + width + (what == "ext") + n
        elif b in _COUNTED:
            what, per, width = _COUNTED[b]
            if pos + 1 + width > end:
                break
            n = int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            if n > LIMITS[f"max_{what}_len"]:
                return pos, ": " + _claim(what, n, LIMITS[f"max_{what}_len"])
            pending, pos = pending + per * n, pos + 1 + width
        else:                                            # 0xc1, which msgpack refuses
            return None
    if max(pos, end) - start + pending > LIMITS["max_buffer_size"]:
        return start, f" (an object larger than {LIMITS['max_buffer_size'] >> 20} MiB)"
    return None


def _check_event(obj, path, offset, checks=_CHECKS) -> int:
    """The kind code of a well-formed event array; TraceError for anything else."""
    try:
        if checks[obj[0]](obj):
            return obj[0]
    except (IndexError, KeyError, TypeError, ValueError):
        pass
    _refuse(obj, path, offset, checks is _OLD_CHECKS)


def _refuse(obj, path, offset, old: bool = False) -> NoReturn:
    """The TraceError of one sentence for an object that is not a well-formed event (`old`: of a version-1 or
    version-2 log, whose request_added and cancel events lack version 3's last field)."""
    if type(obj) is not list or not obj or type(obj[0]) is not int or obj[0] not in EVENTS:
        raise TraceError(f"{path} is damaged at byte {offset}: not an event.")
    name, fields = EVENTS[obj[0]]
    if old and obj[0] in _APPENDED:
        fields = fields[:-1]
    if len(obj) != len(fields) + 1:
        raise TraceError(f"{path} is damaged at byte {offset}: a {name} event with {len(obj) - 1} fields, "
                         f"expected {len(fields)}.")
    for field, types, value in zip(fields, _FIELD_TYPES[obj[0]], obj[1:]):
        if type(value) not in types:
            raise TraceError(f"{path} is damaged at byte {offset}: a {name} event whose {field} is not "
                             f"{_either(types)}.")
    raise TraceError(f"{path} is damaged at byte {offset}: not an event.")  # unreachable: it was refused


_NO_KEY = object()


def _check_header(header: dict, path) -> None:
    """TraceError naming the first header field of the wrong type (tracing/schema.py HEADER_TYPES), an engine
    or platform value of the wrong type, or a rank, world size or thread count out of range."""
    def bad(what: str) -> NoReturn:
        raise TraceError(f"{path} has a damaged header: {what}.")

    for name, types in _HEADER_TYPES.items():
        if name in header and type(header[name]) not in types:
            bad(f"{name} is {_a(header[name])}, not {_either(types)}")
    argv = header.get("argv", [])
    if (i := next((i for i, a in enumerate(argv) if type(a) is not str), None)) is not None:
        bad(f"argv[{i}] is {_a(argv[i])}, not a str")
    for name in ("engine", "model", "platform"):
        if (key := next((k for k in header.get(name, {}) if type(k) is not str), _NO_KEY)) is not _NO_KEY:
            bad(f"{name} has a key that is {_a(key)}, not a str")
    for name, expected in _MAP_TYPES.items():
        values = header.get(name, {})
        for key, types in expected.items():
            if key in values and type(values[key]) not in types:
                bad(f"{name}'s {key} is {_a(values[key])}, not {_either(types)}")
    world, rank = header.get("world_size", 1), header.get("rank", 0)
    if world < 1:
        bad(f"world_size is {world}, not at least 1")
    if not 0 <= rank < world:
        bad(f"rank is {rank}, not between 0 and world_size - 1 ({world - 1})")
    if header.get("intra_op_threads", 1) < 1:
        bad(f"intra_op_threads is {header['intra_op_threads']}, not at least 1")
    engine = header.get("engine", {})
    for key, least in ENGINE_LEAST.items():
        if type(engine.get(key)) is int and engine[key] < least:
            bad(f"engine's {key} is {engine[key]}, not at least {least}")


def open_trace(path: str | Path) -> TraceFile:
    return TraceFile(path)
