"""The mdi-trace event schema (ARCHITECTURE.md §5), version 2: one source of truth for the recorder,
the reader, verify, the exporters and tracing/SCHEMA.md (a test checks that the document and this
module agree).

Version 3 (issue #19) appends what a latency question needs: a request's `arrival` (when it reached the
engine's front door: the HTTP request, or its replayed arrival time; at or before `t`, when the engine took it in
between two steps) and a cancellation's `cause`. Older logs are read as version 3 (below).

A log is a msgpack stream: a header map, then events, each a positional array `[kind, *fields]`
(positional, not string-keyed, so hot events stay small), then a footer event. Times are nanoseconds
since the header's `t0_ns` (time.perf_counter_ns of the recording process).

Readers never index an event by position: the reader yields one typed record per event, a NamedTuple made
here from EVENTS (`RECORDS`, `Schedule`, `Token`, ...), whose fields are the schema's names, plus the byte
`offset` the event starts at; a schedule event's rows are `Row`s. Version-1 logs are read too, converted to
version 2 as they are read (`V1_RENAMED`, `V1_EPOCH_REASONS`), and version-1 and version-2 logs to version 3
(`V3_APPENDED`).
"""
from __future__ import annotations

from collections import namedtuple

MAGIC = "mdi-trace"
SCHEMA_VERSION = 3
READ_VERSIONS = (1, 2, 3)   # the versions the reader reads: versions 1 and 2 converted (below)
READ_VERSIONS_TEXT = ", ".join(map(str, READ_VERSIONS[:-1])) + f" and {READ_VERSIONS[-1]}"   # "1, 2 and 3"

# kind code -> (name, field names). The field order is the array order after the kind code.
EVENTS: dict[int, tuple[str, tuple[str, ...]]] = {
    0: ("request_added", ("t", "seq_id", "prompt_token_ids", "temperature", "seed", "max_tokens", "ignore_eos",
                          "stop_token_ids", "arrival")),
    1: ("schedule", ("t", "step", "batch_kind", "rows", "preempted")),
    2: ("reservation", ("t", "step", "seq_id", "epoch", "output_position")),
    3: ("epoch_bump", ("t", "seq_id", "epoch", "reason")),
    4: ("block_alloc", ("t", "seq_id", "block_ids")),
    5: ("block_free", ("t", "seq_id", "block_ids")),
    6: ("slot_alloc", ("t", "seq_id", "state_slot")),
    7: ("slot_free", ("t", "seq_id", "state_slot")),
    8: ("preempt", ("t", "step", "seq_id")),
    9: ("cancel", ("t", "step", "seq_id", "cause")),
    10: ("token", ("t", "step", "seq_id", "epoch", "position", "token_id", "appended")),
    11: ("finish", ("t", "step", "seq_id", "reason")),
    12: ("cpu_span", ("step", "phase", "start", "end")),
    13: ("device_span", ("step", "start", "end")),
    14: ("step_digest", ("step", "digest")),
    15: ("footer", ("counts", "num_steps", "step_offsets", "clean")),
}
KIND = {name: code for code, (name, _) in EVENTS.items()}

# a schedule row: one chunk of one sequence (engine.scheduler.ScheduledRow), as an array
ROW_FIELDS = ("seq_id", "epoch", "start", "token_ids", "block_table", "state_slot", "sample", "seed",
              "temperature", "output_position")
BATCH_KINDS = ("prefill", "decode")
PHASES = ("schedule", "execute", "process")
EPOCH_REASONS = ("preempt", "cancel")   # what bumped the epoch: a preemption, or a cancellation (engine.abort)
FINISH_REASONS = ("stop", "length", "abort")  # a cancelled request finishes with "abort"
# why a request was cancelled: `abort(seq_id)` called by the user (LLMEngine.abort, record's drawn cancellations),
# its client disconnected (serve), or the engine shut down with it unfinished (SIGINT/SIGTERM, serve's cancel)
CANCEL_CAUSES = ("abort", "disconnect", "shutdown")

# Version 1 differs from version 2 in names only: the same kinds, codes, field order and types. Its names that
# changed (event kind -> {version-1 field: version-2 field}) and its epoch reasons, which the reader maps by name
# (a version-1 reason "abort" is version 2's "cancel") as it reads a version-1 log.
V1_RENAMED = {"schedule": {"kind": "batch_kind"}, "slot_alloc": {"slot": "state_slot"},
              "slot_free": {"slot": "state_slot"}}
V1_EPOCH_REASONS = ("preempt", "abort")
V1_REASON_RENAMED = {"abort": "cancel"}
# Version 3 appended one field to two kinds, which a version-1 or version-2 event gets as the reader converts it:
# kind -> (the field, where its value comes from). A request arrived when it was added (its `t`); a cancellation
# was the user's abort.
V3_APPENDED = {"request_added": ("arrival", "t"), "cancel": ("cause", CANCEL_CAUSES.index("abort"))}

# The type of every field, written as SCHEMA.md writes it: int, float, bool, str, nil, map (str keys), list[...],
# map[...], and "A or B" for either. An int is never a bool (msgpack keeps them apart). The reader checks the
# top-level type of every field of every event, of every header field present and of the engine and platform
# values below (what lists and maps hold is the consumers' to check, except argv's items and the header maps'
# keys); a header field may be absent (old logs lack some), except magic and schema_version.
EVENT_TYPES: dict[int, tuple[str, ...]] = {
    0: ("int", "int", "list[int]", "float or int", "int", "int", "bool", "list[int]", "int"),
    1: ("int", "int", "int", "list[row]", "list[int]"),
    2: ("int", "int", "int", "int", "int"),
    3: ("int", "int", "int", "int"),
    4: ("int", "int", "list[int]"),
    5: ("int", "int", "list[int]"),
    6: ("int", "int", "int"),
    7: ("int", "int", "int"),
    8: ("int", "int", "int"),
    9: ("int", "int", "int", "int"),
    10: ("int", "int", "int", "int", "int", "int", "bool"),
    11: ("int", "int", "int", "int"),
    12: ("int", "int", "int", "int"),
    13: ("int", "int", "int"),
    14: ("int", "str"),
    15: ("map[str, int]", "int", "list[[int, int]]", "bool"),
}
assert all(len(EVENT_TYPES[code]) == len(fields) for code, (_, fields) in EVENTS.items())

# header field -> type, in the header table's order. Besides its type: world_size >= 1, 0 <= rank < world_size
# (world_size 1 when absent), intra_op_threads >= 1, argv's items are str and the maps' keys are str.
HEADER_TYPES: dict[str, str] = {
    "magic": "str", "schema_version": "int", "time": "str", "argv": "list[str]", "t0_ns": "int", "engine": "map",
    "model": "map", "checkpoint_digest": "str", "device": "str", "torch": "str", "triton": "str or nil",
    "dtype": "str", "seed": "int", "rank": "int", "world_size": "int", "intra_op_threads": "int",
    "model_source": "str", "run_id": "str or nil", "platform": "map"}
HEADER_FIELDS = tuple(HEADER_TYPES)
# the values of the header's engine and platform maps that readers use, checked when present
ENGINE_TYPES: dict[str, str] = {
    "max_num_seqs": "int", "max_num_batched_tokens": "int", "num_kv_blocks": "int", "num_state_slots": "int",
    "eos_token_id": "int or nil", "enable_zos": "bool", "block_size": "int", "batch_invariant": "bool",
    "scheduler_version": "int"}
# the engine's counts and sizes: a header with less is damaged (a pool of -5 blocks is no pool)
ENGINE_LEAST: dict[str, int] = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "num_kv_blocks": 0,
                                "num_state_slots": 0, "block_size": 1, "scheduler_version": 1}
PLATFORM_TYPES: dict[str, str] = {
    "device_type": "str", "cpu_model": "str", "cpu_isa": "str", "onednn_isa": "str", "cpu_capability": "str",
    "isa_overrides": "map[str, str]", "torch": "str", "triton": "str or nil", "intra_op_threads": "int",
    "gpu_name": "str", "gpu_capability": "str", "cuda": "str or nil"}



# ---- the typed records: one NamedTuple per event kind, made from EVENTS (not written out by hand) ----------
class Event:
    """What every record is besides a NamedTuple of its kind's fields: `kind` (its name), `code` and `names`
    (the schema's field names, in order) on the class; `offset`, the byte offset of the event in its log
    (None for a record made by hand), the last item."""
    __slots__ = ()
    kind: str
    code: int
    names: tuple[str, ...]


def _record(code: int, name: str, fields: tuple[str, ...]) -> type:
    assert not {"kind", "code", "names", "offset"} & set(fields), f"{name}: a field name the record class uses"
    base = namedtuple("".join(w.capitalize() for w in name.split("_")), (*fields, "offset"), defaults=(None,))
    return type(base.__name__, (base, Event), {"__slots__": (), "kind": name, "code": code, "names": fields,
                                               "__doc__": f"A {name} event: {', '.join(fields)}, offset."})


RECORDS: dict[int, type] = {code: _record(code, name, fields) for code, (name, fields) in EVENTS.items()}
RECORD = {cls.kind: cls for cls in RECORDS.values()}       # by kind name
Row = namedtuple("Row", ROW_FIELDS)                        # a schedule event's row
(RequestAdded, Schedule, Reservation, EpochBump, BlockAlloc, BlockFree, SlotAlloc, SlotFree, Preempt, Cancel, Token,
 Finish, CpuSpan, DeviceSpan, StepDigest, Footer) = (RECORDS[code] for code in sorted(RECORDS))

# The last 9 bytes of a cleanly closed log are a msgpack uint64 (0xcf + 8 big-endian bytes): the byte offset
# of the footer event. A log without them was cut short (a crash, or a run still going) and is indexed by a scan.
TRAILER_SIZE = 9
TRAILER_TAG = 0xCF
