"""The trace reader and index (ARCHITECTURE.md §5, §7): the schema document agrees with tracing/schema.py,
a real engine run round-trips every event kind, a log cut at any byte serves its complete prefix and says it
was cut, a damaged or hostile file is one sentence of TraceError in bounded memory, and the columnar index
agrees with the events, uses the footer's step index, scans a cut log, and imports no torch.

The engine trace (micro preset, random weights) is made once per module: two 120-token prompts in two KV
blocks force a preemption at position 128 (under ZOS its in-flight token comes back stale), a third request
is cancelled, a fourth stops on a stop token; prompts use token ids below 128 (one msgpack byte each) so the
log stays small enough to cut at every byte.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracing import schema
from tracing.index import TraceIndex
from tracing.reader import TraceError, TraceFile

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_MD = ROOT / "tracing" / "SCHEMA.md"


# ---- the schema document ---------------------------------------------------------------------------
def doc_tables(text: str) -> dict[str, list[list[str]]]:
    """Heading text -> the rows of the first `|` table under it (header and separator rows dropped)."""
    tables, heading, rows = {}, None, None
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            heading, rows = line.lstrip("#").strip(), None
        elif line.startswith("|") and heading is not None and heading not in tables:
            rows = [] if rows is None else rows
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows is not None:
            tables[heading], rows = rows[1:], None  # rows[0]: the column names
    return tables


def split(cell: str) -> list[str]:
    return [f.strip() for f in cell.split(",") if f.strip()]


def schema_mismatches(text: str, s=schema) -> list[str]:
    """Every disagreement between SCHEMA.md's tables and the schema module `s`."""
    t, bad = doc_tables(text), []

    def check(what, doc, code):
        if doc != code:
            bad.append(f"{what}: SCHEMA.md has {doc}, schema.py has {code}")

    constants = {r[0]: r[1] for r in t.get("Constants", [])}
    check("constants", constants, {"MAGIC": s.MAGIC, "SCHEMA_VERSION": str(s.SCHEMA_VERSION),
                                   "TRAILER_SIZE": str(s.TRAILER_SIZE), "TRAILER_TAG": f"{s.TRAILER_TAG:#x}"})
    check("header fields", tuple(r[0] for r in t.get("Header", [])), s.HEADER_FIELDS)
    check("header types", tuple((r[0], r[1]) for r in t.get("Header", [])), tuple(s.HEADER_TYPES.items()))
    check("engine value types", {r[0]: r[1] for r in t.get("Engine", [])}, s.ENGINE_TYPES)
    check("platform value types", {r[0]: r[1] for r in t.get("Platform", [])}, s.PLATFORM_TYPES)
    check("row fields", tuple(r[0] for r in t.get("Schedule row", [])), s.ROW_FIELDS)
    events = {int(r[0]): (r[1], tuple(split(r[2]))) for r in t.get("Events", [])}
    for code in sorted(events.keys() | s.EVENTS.keys()):
        check(f"event code {code}", events.get(code), s.EVENTS.get(code))
    for code, (name, fields) in s.EVENTS.items():
        check(f"fields of {code} {name}", tuple(r[0] for r in t.get(f"{code} {name}", [])), fields)
        check(f"field types of {code} {name}", tuple(r[1] for r in t.get(f"{code} {name}", [])),
              s.EVENT_TYPES.get(code))
    enums = {}
    for name, code, value in (r[:3] for r in t.get("Enums", [])):
        enums.setdefault(name, []).append((int(code), value))
    code_enums = {k: getattr(s, k) for k in ("BATCH_KINDS", "PHASES", "EPOCH_REASONS", "FINISH_REASONS",
                                             "CANCEL_CAUSES")}
    for name in sorted(enums.keys() | code_enums.keys()):
        codes = sorted(enums.get(name, []))
        if [c for c, _ in codes] != list(range(len(codes))):
            bad.append(f"enum {name}: SCHEMA.md's codes are not 0, 1, 2...")
        check(f"enum {name}", tuple(v for _, v in codes), code_enums.get(name))
    renamed = {(event, old): new for event, names in s.V1_RENAMED.items() for old, new in names.items()}
    renamed |= {(f"EPOCH_REASONS {code}", old): s.V1_REASON_RENAMED[old] for code, old in enumerate(s.V1_EPOCH_REASONS)
                if old in s.V1_REASON_RENAMED}
    check("version-1 names", {(r[0], r[1]): r[2] for r in t.get("Version 1", [])}, renamed)
    check("version-3 fields", {(r[0], r[1]): r[2] for r in t.get("Version 2", [])},
          {(event, field): str(value) for event, (field, value) in s.V3_APPENDED.items()})
    return bad


def test_schema_document_agrees_with_schema_module():
    assert schema_mismatches(SCHEMA_MD.read_text()) == []


@pytest.mark.parametrize("old, new", [
    ("| 10 | token | t, step, seq_id, epoch, position, token_id, appended |",
     "| 10 | token | t, step, seq_id, position, epoch, token_id, appended |"),    # two fields swapped
    ("| 13 | device_span |", "| 14 | device_span |"),                               # a code
    ("| FINISH_REASONS | 1 | length |", "| FINISH_REASONS | 1 | max_tokens |"),     # an enum value
    ("| t0_ns | int |", "| t0 | int |"),                                            # a header field
    ("| state_slot | int | its state slot |\n", ""),                                # a row field dropped
    ("| output_position | int | which output token (0", "| position | int | which output token (0"),
    ("| SCHEMA_VERSION | 3 |", "| SCHEMA_VERSION | 2 |"),
    ("| cancel | cause | 0 |\n", ""),                                             # a version-3 field dropped
    ("| slot_free | slot | state_slot |\n", ""),                                   # a version-1 rename dropped
    ("| temperature | float or int | sampling", "| temperature | float | sampling"),   # an event field's type
    ("| world_size | int |", "| world_size | str |"),                                # a header field's type
    ("| num_kv_blocks | int |", "| num_kv_blocks | float |"),                          # an engine value's type
    ("| isa_overrides | map[str, str] |\n", ""),                                    # a platform value dropped
])
def test_schema_check_fails_when_the_document_drifts(old, new):
    text = SCHEMA_MD.read_text()
    assert old in text
    assert schema_mismatches(text.replace(old, new, 1))


def test_schema_check_fails_when_the_code_drifts(monkeypatch):
    events = dict(schema.EVENTS)
    events[16] = ("kv_swap", ("t", "seq_id"))
    monkeypatch.setattr(schema, "EVENTS", events)
    assert schema_mismatches(SCHEMA_MD.read_text())
    monkeypatch.setattr(schema, "EVENTS", dict(schema.EVENTS))
    monkeypatch.setattr(schema, "PHASES", ("schedule", "execute", "sample", "process"))
    assert schema_mismatches(SCHEMA_MD.read_text())


# ---- a real engine trace ---------------------------------------------------------------------------
def prompt(n: int, salt: int) -> list[int]:
    return [(salt + 13 * k) % 120 + 2 for k in range(n)]   # ids below 128: one byte each


@pytest.fixture(scope="module")
def engine_trace(tmp_path_factory) -> Path:
    from engine import LLM, SamplingParams
    from model.checkpoint import init_checkpoint
    from tracing import Recorder
    root = tmp_path_factory.mktemp("trace")
    init_checkpoint("micro", 0, root / "ckpt")
    probe = LLM(str(root / "ckpt"), num_kv_blocks=2)
    stop = probe.generate([[9, 8]], SamplingParams(temperature=0.0, max_tokens=1), progress=False)[0].token_ids[0]
    probe.engine.shutdown()
    path = root / "run.mdt"
    llm = LLM(str(root / "ckpt"), tracer=Recorder(path, argv=["test"]), num_kv_blocks=2,
              max_num_batched_tokens=64)
    engine = llm.engine
    for i in range(2):
        engine.add_request(prompt(120, i), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    victim = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.add_request([9, 8], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=(stop,)))
    for step in range(200):
        if not engine.has_unfinished():
            break
        if step == 2:
            engine.abort(victim)
        engine.step()
    engine.shutdown()
    return path


@pytest.fixture(scope="module")
def full(engine_trace):
    tf = TraceFile(engine_trace)
    return tf, list(tf.events())


TYPES = {"int": int, "float": float, "bool": bool, "str": str, "map": dict}


def conforms(value, spec: str) -> bool:
    """Whether a decoded value has the type SCHEMA.md writes, e.g. `list[int or nil]`, `list[[int, int]]`."""
    if " or " in spec and not spec.startswith("list["):
        return any(conforms(value, s) for s in spec.split(" or "))
    if spec == "nil":
        return value is None
    if spec.startswith("list[["):
        return type(value) is list and all(conforms(v, f"list[{spec[6:-2].split(',')[0]}]") for v in value)
    if spec.startswith("list[row]"):
        return type(value) is list and all(type(r) is list and len(r) == len(schema.ROW_FIELDS) for r in value)
    if spec.startswith("list["):
        return type(value) is list and all(conforms(v, spec[5:-1]) for v in value)
    if spec.startswith("map["):
        return type(value) is dict and all(type(k) is str and type(v) is int for k, v in value.items())
    return type(value) is TYPES[spec]


def test_round_trip_of_every_event_kind(full):
    """Every kind appears, every field decodes to the type SCHEMA.md gives it, enums are in range, and the
    run held what it was built for: a preemption, a stale token, a cancellation, every finish reason."""
    tf, events = full
    tables = doc_tables(SCHEMA_MD.read_text())
    assert tf.clean and tf.cut is None
    kinds = Counter(e.kind for e in events)
    assert set(kinds) | {"footer"} == {name for name, _ in schema.EVENTS.values()}
    assert tf.footer.counts == dict(kinds) and tf.footer.num_steps == kinds["schedule"] and tf.footer.clean is True
    for code, (name, fields) in schema.EVENTS.items():
        types = [r[1] for r in tables[f"{code} {name}"]]
        for e in ([e for e in events if e.kind == name] if name != "footer" else [tf.footer]):
            assert type(e) is schema.RECORDS[code] and e.names == fields and e._fields == (*fields, "offset")
            values = [getattr(e, f) for f in fields]
            if name == "schedule":   # rows are Rows: as the arrays they were
                values[fields.index("rows")] = [list(r) for r in e.rows]
            assert [conforms(v, ty) for v, ty in zip(values, types)] == [True] * len(fields), (name, e)
    row_types = [r[1] for r in tables["Schedule row"]]
    for e in events:
        if e.kind == "schedule":
            assert e.batch_kind in (0, 1)   # (e.kind is the event's kind name)
            for row in e.rows:
                assert type(row) is schema.Row
                assert all(conforms(v, ty) for v, ty in zip(row, row_types)), row
    header_types = {r[0]: r[1] for r in tables["Header"]}
    assert set(tf.header) == set(schema.HEADER_FIELDS)
    assert all(conforms(tf.header[k], header_types[k]) for k in schema.HEADER_FIELDS)
    assert {schema.FINISH_REASONS[e.reason] for e in events if e.kind == "finish"} == {"stop", "length", "abort"}
    assert {schema.EPOCH_REASONS[e.reason] for e in events if e.kind == "epoch_bump"} == {"preempt", "cancel"}
    assert {e.appended for e in events if e.kind == "token"} == {True, False}
    assert {schema.PHASES[e.phase] for e in events if e.kind == "cpu_span"} == set(schema.PHASES)
    assert all(e.start <= e.end for e in events if e.kind in ("cpu_span", "device_span"))


def test_event_at_decodes_the_event_at_an_offset(full):
    tf, events = full
    assert [tf.event_at(e.offset) for e in events[::7]] == events[::7]
    with pytest.raises(TraceError):
        tf.event_at(events[0].offset + 1)   # inside an event: not an event array
    with pytest.raises(TraceError):
        tf.event_at(len(tf.data))


# ---- cut short ---------------------------------------------------------------------------------------
def read_prefix(data: bytes, n: int, path: Path):
    """(events, cut) of the first n bytes of a log, or the TraceError."""
    path.write_bytes(data[:n])
    try:
        with TraceFile(path) as tf:
            events = list(tf.events())
            return events, tf.cut, tf.clean
    except TraceError as e:
        return e, None, False


def test_a_log_cut_at_every_byte_gives_its_complete_prefix(full, tmp_path):
    """Any prefix of a log reads as the events that end within it and says it was cut; a cut inside the
    header is one TraceError; only the whole log is clean. Never another exception."""
    tf, events = full
    data = bytes(tf.data)
    assert len(data) < 8192, "the trace grew; the every-byte cut test would slow down"
    footer_offset = int.from_bytes(data[-8:], "big")           # the trailer
    ends = [e.offset for e in events[1:]] + [footer_offset]   # where each event ends
    for n in range(1, len(data) + 1):
        got, cut, clean = read_prefix(data, n, tmp_path / "cut.mdt")
        if n < tf.body_offset:
            assert isinstance(got, TraceError) and "inside its header" in str(got), n
            continue
        assert not isinstance(got, TraceError), (n, got)
        complete = sum(end <= n for end in ends)
        assert got == events[:complete], n
        if n == len(data):
            assert clean and cut is None
        else:
            assert not clean and cut.events == complete and cut.size == n, (n, cut)
            assert cut.offset == ([tf.body_offset] + ends)[complete]


def test_a_cut_log_is_indexed_by_a_scan(full, tmp_path):
    tf, events = full
    whole = TraceIndex(tf)
    data = bytes(tf.data)
    for n in (tf.body_offset, (tf.body_offset + len(data)) // 2, int.from_bytes(data[-8:], "big"), len(data) - 1):
        (tmp_path / "cut.mdt").write_bytes(data[:n])
        index = TraceIndex(TraceFile(tmp_path / "cut.mdt"))
        k = len(index)
        assert index.cut is not None and index.cut.events == k and not index.trace.clean
        assert np.array_equal(index.offset, whole.offset[:k]) and np.array_equal(index.t, whole.t[:k])
        m = len(index.steps)
        assert np.array_equal(index.steps.step, whole.steps.step[:m])
        assert np.array_equal(index.steps.tokens, whole.steps.tokens[:m])


# ---- the index ---------------------------------------------------------------------------------------
def test_index_columns_agree_with_the_events(full):
    tf, events = full
    index = TraceIndex(tf)
    assert len(index) == len(events) and index.cut is None
    for i, e in enumerate(events):
        field = lambda *ns: next((getattr(e, n) for n in ns if n in e.names), -1)
        assert (index.offset[i], index.kind[i], index.step[i], index.seq_id[i], index.t[i]) == \
            (e.offset, schema.KIND[e.kind], field("step"), field("seq_id"), field("t", "start")), e
        assert index.event_at(i) == e
    assert index.offset.dtype == np.int64 and index.kind.dtype == np.uint8 and index.step.dtype == np.int32
    assert index.seq_id.dtype == np.int32 and index.t.dtype == np.int64
    assert np.array_equal(index.step_offsets, [o for _, o in tf.footer.step_offsets])


def test_index_random_access_by_step_request_and_kind(full):
    tf, events = full
    index = TraceIndex(tf)
    steps = sorted({e.step for e in events if "step" in schema.EVENTS[schema.KIND[e.kind]][1]})
    for s in steps:
        assert [events[i] for i in index.events_of_step(s)] == [e for e in events if getattr(e, "step", None) == s]
    for q in range(4):
        want = [e for e in events if getattr(e, "seq_id", None) == q
                or e.kind == "schedule" and any(r.seq_id == q for r in e.rows)]
        assert [events[i] for i in index.events_of_request(q)] == want
    for name in schema.KIND:
        assert [events[i] for i in index.events_of_kind(name)] == [e for e in events if e.kind == name]
    assert len(index.events_of_step(10**6)) == len(index.events_of_request(10**6)) == 0
    with pytest.raises(KeyError):
        index.events_of_kind("tokens")


def test_index_step_table_summarises_each_step(full):
    tf, events = full
    st_ = TraceIndex(tf).steps
    schedules = [e for e in events if e.kind == "schedule"]
    assert len(st_) == len(schedules) == tf.footer.num_steps
    for r, e in enumerate(schedules):
        assert (st_.step[r], st_.batch_kind[r], st_.rows[r], st_.tokens[r], st_.preemptions[r]) == \
            (e.step, e.batch_kind, len(e.rows), sum(len(row.token_ids) for row in e.rows), len(e.preempted))
        spans = {(x.phase if x.kind == "cpu_span" else 3): (x.start, x.end) for x in events
                 if x.kind in ("cpu_span", "device_span") and x.step == e.step}
        got = [(st_.schedule_start[r], st_.schedule_end[r]), (st_.execute_start[r], st_.execute_end[r]),
               (st_.process_start[r], st_.process_end[r]), (st_.device_start[r], st_.device_end[r])]
        assert got == [spans.get(lane, (-1, -1)) for lane in range(4)]
    assert st_.preemptions.sum() == sum(1 for e in events if e.kind == "preempt")


def test_importing_tracing_and_indexing_loads_no_torch(engine_trace):
    code = ("import sys, tracing; from tracing.reader import TraceFile; from tracing.index import TraceIndex; "
            f"TraceIndex(TraceFile({str(engine_trace)!r})); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'model', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# ---- synthetic logs: scale, footer checks ------------------------------------------------------------
def synthetic_log(path: Path, num_events: int, seqs: int = 8, clean: bool = True, tamper=None) -> int:
    """A log in the recorder's format, written directly: decode steps of `seqs` rows, each with its
    reservations, spans, tokens and digest. Returns the number of events (footer excluded)."""
    pack, out, counts, offsets = msgpack.Packer(use_bin_type=True).pack, bytearray(), Counter(), []

    def emit(name, *fields):
        out.extend(pack([schema.KIND[name], *fields]))
        counts[name] += 1

    out += pack({"magic": schema.MAGIC, "schema_version": schema.SCHEMA_VERSION, "t0_ns": 0})
    for q in range(seqs):
        emit("request_added", 0, q, [1, 2, 3], 0.0, q, 1 << 30, True, [], 0)
    t = step = 0
    while sum(counts.values()) < num_events:
        offsets.append([step, len(out)])
        emit("schedule", t, step, 1, [[q, 0, 100 + step, [None], [q], q, True, q, 0.0, step] for q in range(seqs)], [])
        for q in range(seqs):
            emit("reservation", t + 1, step, q, 0, step)
        emit("cpu_span", step, 0, t, t + 10)
        emit("cpu_span", step, 1, t + 10, t + 20)
        emit("device_span", step, t + 20, t + 90)
        for q in range(seqs):
            emit("token", t + 95, step, q, 0, 100 + step, 7, True)
        emit("step_digest", step, "0123456789abcdef")
        emit("cpu_span", step, 2, t + 90, t + 99)
        t, step = t + 100, step + 1
    footer_offset = len(out)
    if clean:
        footer = [dict(counts), len(offsets), offsets, True]
        if tamper:
            tamper(footer)
        out += pack([schema.KIND["footer"], *footer]) + bytes([schema.TRAILER_TAG]) + footer_offset.to_bytes(8, "big")
    path.write_bytes(out)
    return sum(counts.values())


def test_index_scan_speed(tmp_path):
    """The index of a large log builds by one scan at >= 100k events/s (about 0.8M/s measured on 2 CPU
    cores); MDI_INDEX_EVENTS=1000000 for the full-size measurement."""
    n = synthetic_log(tmp_path / "big.mdt", int(os.environ.get("MDI_INDEX_EVENTS", 100_000)))
    start = time.perf_counter()
    index = TraceIndex(TraceFile(tmp_path / "big.mdt"))
    seconds = time.perf_counter() - start
    print(f"\nindexed {n} events in {seconds:.2f} s: {n / seconds / 1e6:.2f} M events/s")
    assert len(index) == n and index.cut is None and len(index.steps) == index.trace.footer.num_steps
    assert n / seconds > 100_000
    assert np.all(index.steps.device_end - index.steps.device_start == 70)


def test_a_log_without_footer_indexes_like_the_clean_one(tmp_path):
    synthetic_log(tmp_path / "clean.mdt", 2000)
    synthetic_log(tmp_path / "cut.mdt", 2000, clean=False)
    clean, cut = TraceIndex(TraceFile(tmp_path / "clean.mdt")), TraceIndex(TraceFile(tmp_path / "cut.mdt"))
    assert cut.cut is not None and cut.cut.events == len(cut) and clean.cut is None
    assert np.array_equal(clean.offset, cut.offset) and np.array_equal(clean.steps.tokens, cut.steps.tokens)


@pytest.mark.parametrize("tamper", [
    lambda f: f.__setitem__(2, [[0, "x"]] + f[2][1:]),      # a step index entry that is no offset
    lambda f: f.__setitem__(0, [1, 2]),                     # counts that are not a map
    lambda f: f[2].pop(),                                   # a step missing from the index
    lambda f: f[2].__setitem__(3, [3, f[2][3][1] + 1]),   # a step offset off by one
    lambda f: f[0].__setitem__("token", f[0]["token"] - 1),  # a count
    lambda f: f.__setitem__(1, f[1] + 1),                   # num_steps
])
def test_a_footer_that_disagrees_with_the_events_is_an_error(tmp_path, tamper):
    synthetic_log(tmp_path / "bad.mdt", 500, tamper=tamper)
    with pytest.raises(TraceError, match="footer"):
        TraceIndex(TraceFile(tmp_path / "bad.mdt"))


# ---- damaged and hostile files -----------------------------------------------------------------------
HEADER = msgpack.packb({"magic": schema.MAGIC, "schema_version": schema.SCHEMA_VERSION, "t0_ns": 0})
TOKEN = msgpack.packb([schema.KIND["token"], 1, 0, 0, 0, 5, 7, True])


def one_sentence(message: str) -> bool:
    return message.endswith(".") and "\n" not in message and not re.search(r"[.!?] [A-Z]", message)


def read_all(path: Path):
    """Read a log end to end as the tools do: every event, then the index."""
    with TraceFile(path) as tf:
        list(tf.events())
        TraceIndex(tf)
        return tf.cut


HOSTILE = {
    "an array of 2**31 elements": b"\xdd\x80\x00\x00\x00",
    "an array of 2**32-1 elements": b"\xdd\xff\xff\xff\xff",
    "a str of 2**30 bytes, 17 MiB of it there": b"\xdb\x40\x00\x00\x00" + b"a" * (17 << 20),
    "a bin of 2**30 bytes, 17 MiB of it there": b"\xc6\x40\x00\x00\x00" + bytes(17 << 20),
    "a map of 2**31 entries": b"\xdf\x80\x00\x00\x00",
    "an ext type": b"\xd4\x01\x00",
    "arrays nested 100000 deep": b"\x91" * 100_000,
    "an event inside 2**22-element arrays 2000 deep": b"\xdd\x00\x3f\xff\xff" * 2000,
    "a reserved byte": b"\xc1",
    "an unknown kind": msgpack.packb([99, 1, 2]),
    "a token with a field missing": msgpack.packb([schema.KIND["token"], 1, 0, 0, 0, 5, 7]),
    "a kind that is a bool": msgpack.packb([True, 1, 2, 3]),
    "a map for an event": msgpack.packb({"kind": 10}),
    "a step that is a str": msgpack.packb([schema.KIND["token"], 1, "0", 0, 0, 5, 7, True]),
    "a seq_id beyond int32": msgpack.packb([schema.KIND["token"], 1, 0, 2**40, 0, 5, 7, True]),
    "a time that is a float": msgpack.packb([schema.KIND["token"], 1.5, 0, 0, 0, 5, 7, True]),
    "a span of a step never scheduled": msgpack.packb([schema.KIND["device_span"], 3, 0, 1]),
    "a schedule whose rows are ints": msgpack.packb([schema.KIND["schedule"], 0, 0, 1, [1, 2], []]),
    "a map with a list key": b"\x91\x81\x91\x01\x02",
    "a schedule row whose seq_id is a str": msgpack.packb([schema.KIND["schedule"], 0, 0, 1, [["x"] * 10], []]),
    "a footer in the middle": msgpack.packb([schema.KIND["footer"], {}, 0, [], True]) + TOKEN,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_event_is_one_sentence_in_bounded_memory(tmp_path, name, traced_peak):
    path = tmp_path / "hostile.mdt"
    path.write_bytes(HEADER + TOKEN + HOSTILE[name] + TOKEN)
    with traced_peak() as traced:
        with pytest.raises(TraceError) as err:
            read_all(path)
    peak = traced.bytes
    assert one_sentence(str(err.value)), str(err.value)
    assert peak < 200 << 20, f"{name}: {peak >> 20} MiB"


# (bytes after HEADER + TOKEN, the byte the error names): each claims more than reader.LIMITS allow, and the file
# ends before the bytes it claims. msgpack checks a str's, bin's or ext's length only once its bytes are there,
# so without the reader's own check these would read as a log cut short.
OVERCLAIMS = {
    "a 4 GiB str in an event": (b"\x95\x0a\xdb\xff\xff\xff\xff", 2),
    "a 1 GiB str": (b"\xdb\x40\x00\x00\x00", 0),
    "a 1 GiB bin": (b"\xc6\x40\x00\x00\x00", 0),
    "a str one byte over the limit, in a row": (b"\x96\x01\x00\x00\x01\x91\xdb\x00\x10\x00\x01" + b"x" * 10, 6),
    "an ext of 100 bytes": (b"\x93\x0a\x01\xc7\x64\x01", 3),
    "a fixext in an event": (b"\x93\x0a\x01\xd4", 3),
    "nested 2**22-element arrays (an object beyond the 16 MiB buffer)": (b"\xdd\x00\x3f\xff\xff" * 1000, 0),
    "2**22-element arrays nested 5 deep (at least 20 MiB)": (b"\xdd\x00\x3f\xff\xff" * 5, 0),
}


@pytest.mark.parametrize("name", OVERCLAIMS)
def test_a_length_claimed_beyond_the_limits_is_an_error_even_past_the_end(tmp_path, name, traced_peak):
    """A claim beyond a bound of reader.LIMITS is damage, never "cut short", even where the file ends first:
    one sentence naming the byte of the claim, without allocating what it claims, from events(), the index and
    event_at()."""
    claim, at = OVERCLAIMS[name]
    path = tmp_path / "claims.mdt"
    path.write_bytes(HEADER + TOKEN + claim)
    with traced_peak() as traced:
        with pytest.raises(TraceError) as err:
            read_all(path)
    peak = traced.bytes
    byte = len(HEADER) + len(TOKEN) + at
    assert one_sentence(str(err.value)) and f"damaged at byte {byte}" in str(err.value), str(err.value)
    assert "cut short" not in str(err.value) and peak < 200 << 20
    with TraceFile(path) as tf, pytest.raises(TraceError, match=f"damaged at byte {byte}"):
        tf.event_at(len(HEADER) + len(TOKEN))


@pytest.mark.parametrize("claim", [b"\xdd\x00\x3f\xff\xff" * 3, b"\xdb\x00\x10\x00\x00", b"\xc6\x00\x00\x10\x00abc",
                                   b"\x98\x0a\x01\x00\x00\x00\x05\xdb\x00\x00\x00", b"\xdf\x00\x00\x10\x00\xa1k",
                                   b"\x91" * 1000, b"\xdb"],
                         ids=["nested 2**22-element arrays, 3 deep", "a 1 MiB str", "a 4 KiB bin",
                              "an event cut in a str's length", "a map of 4096 entries", "arrays nested 1000 deep",
                              "a type byte alone"])
def test_length_claims_within_the_limits_beyond_the_end_are_a_cut(tmp_path, claim, traced_peak):
    """Lengths within reader.LIMITS that claim more than the file holds look like a log cut inside an event:
    read as cut, without allocating what they claim."""
    path = tmp_path / "claims.mdt"
    path.write_bytes(HEADER + TOKEN + claim)
    with traced_peak() as traced:
        cut = read_all(path)
    peak = traced.bytes
    assert cut.events == 1 and cut.offset == len(HEADER) + len(TOKEN) and peak < 200 << 20


@pytest.mark.parametrize("data, words", [
    (msgpack.packb({"magic": "other", "schema_version": 1}), "wrong magic"),
    (msgpack.packb([1, 2, 3]), "wrong magic"),
    (msgpack.packb({"magic": schema.MAGIC, "schema_version": 4}), "schema version 4; this mdi-trace reads versions 1, 2 and 3"),
    (msgpack.packb({"magic": schema.MAGIC}), "schema version None"),
    (b"\xc1garbage", "no readable header"),
    (b"", "empty"),
    (HEADER[:7], "inside its header"),
    (b"\x82\xa5magic\xa9mdi-trace\xa4time\xdb\xff\xff\xff\xff",   # a header claiming a 4 GiB str, the file ending
     "damaged at byte 22: a str claiming 4,294,967,295 bytes"),
    (b"\x82\xa5magic\xa9mdi-trace\xa4argv\xdd\xff\xff\xff\xff", "unreadable header (an array claiming 4,294,967,295"),
    (b"\x82\xa5magic\xa9mdi-trace\xa4argv" + b"\xdd\x00\x3f\xff\xff" * 5,
     "damaged at byte 0 (an object larger than 16 MiB)"),
])
def test_wrong_magic_or_version_is_one_clear_sentence(tmp_path, data, words):
    path = tmp_path / "log.mdt"
    path.write_bytes(data)
    with pytest.raises(TraceError) as err:
        TraceFile(path)
    assert words in str(err.value) and one_sentence(str(err.value)), str(err.value)


# (header fields replaced, words the one sentence must hold): the framing intact, a field of the wrong type or range
BAD_HEADERS = [
    ({"schema_version": True}, "schema_version is a bool, not an int"),
    ({"schema_version": 1.0}, "schema_version is a float, not an int"),
    ({"schema_version": "1"}, "schema_version is a str, not an int"),
    ({"engine": [1, 2]}, "engine is a list, not a map"),
    ({"engine": "max_num_seqs 8"}, "engine is a str, not a map"),
    ({"engine": {"num_kv_blocks": "24"}}, "engine's num_kv_blocks is a str, not an int"),
    ({"engine": {"max_num_seqs": 8.0}}, "engine's max_num_seqs is a float, not an int"),
    ({"engine": {"block_size": None}}, "engine's block_size is nil, not an int"),
    ({"engine": {"enable_zos": 1}}, "engine's enable_zos is an int, not a bool"),
    ({"engine": {"eos_token_id": "1"}}, "engine's eos_token_id is a str, not an int or nil"),
    ({"engine": {1: 2}}, "engine has a key that is an int, not a str"),
    ({"argv": 3}, "argv is an int, not a list"),
    ({"argv": ["mdi-trace", 7]}, "argv[1] is an int, not a str"),
    ({"model": "micro"}, "model is a str, not a map"),
    ({"platform": ["cpu"]}, "platform is a list, not a map"),
    ({"platform": {"isa_overrides": ["MKL_CBWR"]}}, "platform's isa_overrides is a list, not a map"),
    ({"platform": {"intra_op_threads": "1"}}, "platform's intra_op_threads is a str, not an int"),
    ({"world_size": "2"}, "world_size is a str, not an int"),
    ({"world_size": 0}, "world_size is 0, not at least 1"),
    ({"world_size": 2, "rank": 2}, "rank is 2, not between 0 and world_size - 1 (1)"),
    ({"rank": -1}, "rank is -1, not between 0 and world_size - 1 (0)"),
    ({"rank": 1}, "rank is 1, not between 0 and world_size - 1 (0)"),
    ({"rank": True}, "rank is a bool, not an int"),
    ({"t0_ns": "0"}, "t0_ns is a str, not an int"),
    ({"t0_ns": 1.5}, "t0_ns is a float, not an int"),
    ({"run_id": 12}, "run_id is an int, not a str or nil"),
    ({"time": None}, "time is nil, not a str"),
    ({"device": {"name": "cpu"}}, "device is a map, not a str"),
    ({"triton": 3}, "triton is an int, not a str or nil"),
    ({"seed": "0"}, "seed is a str, not an int"),
    ({"intra_op_threads": 0}, "intra_op_threads is 0, not at least 1"),
    ({"intra_op_threads": [1]}, "intra_op_threads is a list, not an int"),
    ({"checkpoint_digest": b"\x00"}, "checkpoint_digest is a bin, not a str"),
    ({"model_source": 1}, "model_source is an int, not a str"),
    ({"dtype": False}, "dtype is a bool, not a str"),
    ({"torch": 2}, "torch is an int, not a str"),
    ({"magic": 1}, "wrong magic"),
]


@pytest.mark.parametrize("fields, words", BAD_HEADERS, ids=[w for _, w in BAD_HEADERS])
def test_a_header_field_of_the_wrong_type_is_one_sentence_naming_it(tmp_path, fields, words):
    path = tmp_path / "log.mdt"
    header = {"magic": schema.MAGIC, "schema_version": schema.SCHEMA_VERSION, "t0_ns": 0, **fields}
    path.write_bytes(msgpack.packb(header, use_bin_type=True) + TOKEN)
    with pytest.raises(TraceError) as err:
        TraceFile(path)
    assert words in str(err.value) and one_sentence(str(err.value)), str(err.value)


def test_every_header_field_has_a_checked_type():
    """Each field of HEADER_TYPES, and each value of ENGINE_TYPES and PLATFORM_TYPES, is refused with a value of
    another type: the schema's types are what the reader checks."""
    import tracing.reader as reader
    wrong = {"int": "x", "str": 1, "map": [], "list[str]": {}, "str or nil": 1.5, "int or nil": "x", "bool": 0,
             "map[str, str]": 1}
    for name, spec in schema.HEADER_TYPES.items():
        if name not in ("magic", "schema_version"):
            with pytest.raises(TraceError, match=f"damaged header: {re.escape(name)} is"):
                reader._check_header({name: wrong[spec]}, "log.mdt")
    for name, types in (("engine", schema.ENGINE_TYPES), ("platform", schema.PLATFORM_TYPES)):
        for key, spec in types.items():
            with pytest.raises(TraceError, match=f"{name}'s {key} is"):
                reader._check_header({name: {key: wrong[spec]}}, "log.mdt")


def test_a_header_with_only_some_fields_reads(tmp_path):
    """Fields an old log lacks are absent, not wrong: magic and schema_version are all a log needs; nil reads as an
    absent run_id; the committed example logs read."""
    for header in ({"magic": schema.MAGIC, "schema_version": 1}, {"magic": schema.MAGIC, "schema_version": 1,
                                                                 "run_id": None, "triton": None, "engine": {}}):
        path = tmp_path / "old.mdt"
        path.write_bytes(msgpack.packb(header) + TOKEN)
        with TraceFile(path) as tf:
            assert len(list(tf.events())) == 1 and tf.cut is not None
    for example in sorted((ROOT / "traces" / "examples").glob("*.mdt")):
        with TraceFile(example) as tf:
            assert tf.clean and set(tf.header) == set(schema.HEADER_FIELDS)


def _wrong_value(types: tuple) -> object:
    """A value of none of `types`."""
    return next(v for v in ("x", 1, 1.5, True, None, [1], {"a": 1}) if type(v) not in types)


def test_every_event_field_of_the_wrong_type_is_one_sentence_naming_it(tmp_path):
    """For each kind and field, an event with that field of another type is refused by objects() and event_at()
    with one sentence naming the kind, the field and the byte."""
    import tracing.reader as reader
    good = {"int": 3, "float or int": 0.5, "bool": True, "str": "0123456789abcdef", "list[int]": [1],
            "list[row]": [], "map[str, int]": {}, "list[[int, int]]": []}
    at = len(HEADER) + len(TOKEN)
    for code, (name, fields) in schema.EVENTS.items():
        event = [code] + [good[t] for t in schema.EVENT_TYPES[code]]
        assert reader._check_event(event, "log.mdt", 0) == code
        for i, field in enumerate(fields):
            bad = list(event)
            bad[i + 1] = _wrong_value(reader._types(schema.EVENT_TYPES[code][i]))
            path = tmp_path / f"{name}-{field}.mdt"
            path.write_bytes(HEADER + TOKEN + msgpack.packb(bad) + TOKEN)
            with pytest.raises(TraceError) as err:
                list(TraceFile(path).objects())
            message = str(err.value)
            assert f"damaged at byte {at}: a {name} event whose {field} is not " in message, message
            assert one_sentence(message), message
            with pytest.raises(TraceError, match=f"a {name} event whose {field} is not"):
                TraceFile(path).event_at(at)


def test_an_int_temperature_reads_and_a_bool_is_never_an_int(tmp_path):
    path = tmp_path / "log.mdt"
    added = [schema.KIND["request_added"], 0, 0, [1, 2], 0, 7, 4, False, [], 0]   # temperature=0, as SamplingParams(0)
    path.write_bytes(HEADER + msgpack.packb(added) + TOKEN)
    assert [e.kind for e in TraceFile(path).events()] == ["request_added", "token"]
    path.write_bytes(HEADER + msgpack.packb([schema.KIND["token"], 1, 0, True, 0, 5, 7, True]))
    with pytest.raises(TraceError, match="a token event whose seq_id is not an int"):
        list(TraceFile(path).events())


def test_a_footer_field_of_the_wrong_type_is_refused_on_open(tmp_path):
    synthetic_log(tmp_path / "bad.mdt", 200, tamper=lambda f: f.__setitem__(3, 1))
    with pytest.raises(TraceError, match="a footer event whose clean is not a bool"):
        TraceFile(tmp_path / "bad.mdt")


def test_a_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(TraceError) as err:
        TraceFile(tmp_path / "nope.mdt")
    assert one_sentence(str(err.value)), str(err.value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=200), with_header=st.booleans())
def test_random_bytes_are_read_or_refused_never_a_traceback(tmp_path, body, with_header):
    path = tmp_path / "random.mdt"
    path.write_bytes((HEADER if with_header else b"") + body)
    try:
        read_all(path)
    except TraceError as e:
        assert one_sentence(str(e)), str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_real_log_is_read_or_refused_never_a_traceback(full, tmp_path, data):
    tf, _ = full
    log = bytearray(tf.data)
    for _ in range(data.draw(st.integers(1, 4))):
        log[data.draw(st.integers(0, len(log) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path / "damaged.mdt"
    path.write_bytes(bytes(log))
    try:
        read_all(path)
    except TraceError as e:
        assert one_sentence(str(e)), str(e)


# ---- version 1, read as version 2 ----------------------------------------------------------------------
V1_LOG = ROOT / "tests" / "data" / "v1-micro-preempt-cancel.mdt"   # traces/examples/micro-preempt-cancel.mdt
                                                                 # as committed before schema version 2


def test_a_version_1_log_reads_as_version_2():
    """The version-1 example (written before the renames) is served in version 2's names: a schedule event's
    batch_kind, a slot event's state_slot, and the epoch bump after its cancellation reads reason "cancel" (it
    was written as "abort"); its index, summary and verify work as on a version-2 log."""
    from tracing.summary import summarize
    from tracing.verify import verify
    with TraceFile(V1_LOG) as tf:
        assert tf.header["schema_version"] == tf.version == 1 and tf.clean
        events = list(tf.events())
        assert {e.batch_kind for e in events if e.kind == "schedule"} == {0, 1}
        assert all(type(e.state_slot) is int for e in events if e.kind in ("slot_alloc", "slot_free"))
        after = {e.kind for prev, e in zip(events, events[1:]) if prev.kind == "cancel"}
        bumps = [(prev.kind, schema.EPOCH_REASONS[e.reason]) for prev, e in zip(events, events[1:])
                 if e.kind == "epoch_bump"]
        assert after == {"epoch_bump"} and ("cancel", "cancel") in bumps and ("preempt", "preempt") in bumps
        assert set(bumps) == {("cancel", "cancel"), ("preempt", "preempt")}
        from tracing import reader
        assert reader._V1_REASON == tuple(schema.EPOCH_REASONS.index(r) for r in ("preempt", "cancel"))
        assert [tf.event_at(e.offset) for e in events[::11]] == events[::11]
        assert len(TraceIndex(tf)) == len(events) and summarize(tf).cancellations == 1
        assert verify(tf).total == 0


# ---- one summary: info's and the viewer's Overview -----------------------------------------------------
def naive_summary(tf: TraceFile) -> dict:
    """The summary's numbers counted event by event from the records, by name: the oracle."""
    out = dict(requests=0, prompt_tokens=0, computed_tokens=0, output_tokens=0, stale_tokens=0, preemptions=0,
               cancellations=0, epoch_bumps=0, device_busy_ns=0, events=0, steps=Counter(), finish_reasons=Counter())
    first, last = None, 0
    for e in tf.events():
        out["events"] += 1
        if e.kind in ("cpu_span", "device_span"):
            start, end = e.start, e.end
        elif e.kind != "step_digest":
            start = end = e.t
        if e.kind != "step_digest":
            first, last = start if first is None else min(first, start), max(last, end)
        if e.kind == "request_added":
            out["requests"] += 1
            out["prompt_tokens"] += len(e.prompt_token_ids)
        elif e.kind == "schedule":
            out["steps"][schema.BATCH_KINDS[e.batch_kind]] += 1
            out["computed_tokens"] += sum(len(r.token_ids) for r in e.rows)
        elif e.kind == "token":
            out["output_tokens" if e.appended else "stale_tokens"] += 1
        elif e.kind in ("preempt", "cancel", "epoch_bump"):
            out[{"preempt": "preemptions", "cancel": "cancellations", "epoch_bump": "epoch_bumps"}[e.kind]] += 1
        elif e.kind == "finish":
            out["finish_reasons"][schema.FINISH_REASONS[e.reason]] += 1
        elif e.kind == "device_span":
            out["device_busy_ns"] += e.end - e.start
    return {**out, "first_ns": first, "last_ns": last}


@pytest.mark.parametrize("name", ["micro-preempt-cancel.mdt", "micro-2rank.rank1.mdt", "h200-tiny68m-zos.mdt"])
def test_info_and_the_overview_show_one_summary(name):
    """`mdi-trace info` (summarize: the index's scan, keeping nothing) and the viewer's Overview (the index's
    summary) give the same numbers, the ones an event-by-event count gives."""
    from tracing.summary import summarize
    from tui.data import TraceModel
    path = ROOT / "traces" / "examples" / name
    with TraceFile(path) as tf:
        info, want = summarize(tf), naive_summary(tf)
    assert {k: getattr(info, k) for k in want} == want
    model = TraceModel(path)
    model.load()
    assert model.index.summary == info
    rows = dict(model.overview())
    assert rows["events"] == f"{info.events:,}" and rows["steps"].startswith(
        f"{info.num_steps:,} ({info.steps['prefill']:,} prefill, {info.steps['decode']:,} decode)")
    assert rows["tokens"] == (f"{info.computed_tokens:,} computed, {info.sampled_tokens:,} sampled, "
                              f"{info.output_tokens:,} appended as output")
    assert rows["preemptions"] == f"{info.preemptions}, cancellations {info.cancellations}, epoch bumps {info.epoch_bumps}"
    assert rows["device"].startswith(f"busy {100 * info.device_busy:.0f}%")
    assert rows["requests"].startswith(f"{info.requests}; finished: ")


def test_a_summary_keeps_no_columns(tmp_path, traced_peak):
    """summarize() (what info prints) holds a chunk of events at a time, not the index's columns: its memory stays
    flat as the log grows."""
    from tracing.summary import summarize
    peaks = []
    for size in (20_000, 400_000):
        n = synthetic_log(tmp_path / f"{size}.mdt", size)
        with TraceFile(tmp_path / f"{size}.mdt") as tf, traced_peak() as traced:
            s = summarize(tf)
        assert s.events == n
        peaks.append(traced.bytes)
    assert peaks[1] < 2 * peaks[0], peaks
