"""The mdi-trace event schema (ARCHITECTURE.md §5), version 1: one source of truth for the recorder,
the reader, verify, the exporters and tracing/SCHEMA.md (a test checks that the document and this
module agree).

A log is a msgpack stream: a header map, then events, each a positional array `[kind, *fields]`
(positional, not string-keyed, so hot events stay small), then a footer event. Times are nanoseconds
since the header's `t0_ns` (time.perf_counter_ns of the recording process).
"""
from __future__ import annotations

MAGIC = "mdi-trace"
SCHEMA_VERSION = 1

# kind code -> (name, field names). The field order is the array order after the kind code.
EVENTS: dict[int, tuple[str, tuple[str, ...]]] = {
    0: ("request_added", ("t", "seq_id", "prompt_token_ids", "temperature", "seed", "max_tokens", "ignore_eos",
                          "stop_token_ids")),
    1: ("schedule", ("t", "step", "kind", "rows", "preempted")),
    2: ("reservation", ("t", "step", "seq_id", "epoch", "output_position")),
    3: ("epoch_bump", ("t", "seq_id", "epoch", "reason")),
    4: ("block_alloc", ("t", "seq_id", "block_ids")),
    5: ("block_free", ("t", "seq_id", "block_ids")),
    6: ("slot_alloc", ("t", "seq_id", "slot")),
    7: ("slot_free", ("t", "seq_id", "slot")),
    8: ("preempt", ("t", "step", "seq_id")),
    9: ("cancel", ("t", "step", "seq_id")),
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
EPOCH_REASONS = ("preempt", "abort")
FINISH_REASONS = ("stop", "length", "abort")

HEADER_FIELDS = ("magic", "schema_version", "time", "argv", "t0_ns", "engine", "model", "checkpoint_digest",
                 "device", "torch", "triton", "dtype", "seed", "rank", "world_size", "intra_op_threads", "model_source",
                 "run_id", "platform")

# The last 9 bytes of a cleanly closed log are a msgpack uint64 (0xcf + 8 big-endian bytes): the byte offset
# of the footer event. A log without them was cut short (a crash, or a run still going) and is indexed by a scan.
TRAILER_SIZE = 9
TRAILER_TAG = 0xCF
