"""Re-execution: rebuild the model from a trace's header and run its recorded batches again
(`mdi-trace check TRACE`, ARCHITECTURE.md §6 "Replay").

Every recorded `schedule` event is turned back into the ScheduledBatch the engine executed (same rows,
order, token counts, block tables and state slots) and run through a fresh ModelRunner, step after step;
an in-flight input token is taken on the device from the previous step's output, as in the recorded run.
Every sampled token is compared with the recorded one, stale ones included. On the device and library
versions that recorded the run the computation is the same, so the comparison is exact; elsewhere the
result says so, and a mismatch may be a near tie (ARCHITECTURE.md §6).

This module loads torch and the model (the rest of tracing/ does not); it is imported only by `check`.
"""
from __future__ import annotations

from dataclasses import dataclass

from tracing.reader import Cut, TraceError, TraceFile
from tracing.schema import BATCH_KINDS


@dataclass(slots=True)
class TokenMismatch:
    step: int
    seq_id: int
    position: int        # the token's position in its sequence
    expected: int        # recorded
    got: int             # re-executed

    def __str__(self) -> str:
        return (f"step {self.step}, request {self.seq_id}, position {self.position}: recorded token "
                f"{self.expected}, re-executed {self.got}")


@dataclass(slots=True)
class ExecuteResult:
    steps: int = 0
    tokens: int = 0                      # sampled tokens compared
    mismatch: TokenMismatch | None = None
    same_platform: bool = True           # device and torch version equal to the recording's
    platform_note: str = ""
    cut: Cut | None = None


def check_tokens(trace: TraceFile, model: str | None = None, device: str = "cpu", until: int | None = None,
                 on_step=None) -> ExecuteResult:
    """Re-execute the recorded steps (up to and including `until`) and compare every sampled token.
    `on_step(i, n)` reports progress. Raises TraceError for a header that cannot be re-executed."""
    import torch

    from engine.model_runner import ModelRunner, device_name
    from engine.scheduler import ScheduledBatch, ScheduledRow
    from model.checkpoint import CheckpointError, load_model

    header = trace.header
    source = model or header.get("model_source") or "tiny-68m"
    try:
        weights, digest = load_model(source, device)
    except CheckpointError as e:
        raise TraceError(f"cannot rebuild the recorded model from {source!r} ({e}); pass --model.") from None
    if header.get("checkpoint_digest") and digest != header["checkpoint_digest"]:
        raise TraceError(f"the weights at {source!r} (digest {digest[:12]}…) are not the recorded ones "
                         f"({header['checkpoint_digest'][:12]}…); pass --model with the recorded checkpoint.")
    if header.get("dtype") == "float32":
        weights.to_fp32()
    if device == "cpu" and header.get("intra_op_threads"):
        torch.set_num_threads(header["intra_op_threads"])  # the CPU kernels' bits depend on the thread count
    engine = header.get("engine") or {}
    recorded, schedules = {}, []
    for e in trace.events():
        if e.kind == "schedule" and (until is None or e.fields[1] <= until):
            schedules.append(e)
        elif e.kind == "token":
            recorded[(e.fields[1], e.fields[2], e.fields[3])] = (e.fields[4], e.fields[5])  # position, token
    result = ExecuteResult(cut=trace.cut)
    here = device_name(weights.head.weight.device)
    if here != header.get("device") or header.get("torch") != torch.__version__:
        result.same_platform = False
        result.platform_note = (f"recorded on {header.get('device')} with torch {header.get('torch')}, re-executed "
                                f"on {here} with torch {torch.__version__}: bits may differ, so a mismatch may "
                                f"be a near tie")
    runner = ModelRunner(weights, engine["num_kv_blocks"], engine["num_state_slots"])
    try:
        for i, e in enumerate(schedules):
            rows = [ScheduledRow(*r) for r in e.fields[3]]
            if on_step:
                on_step(i, len(schedules))
            if not rows:
                continue
            tokens = runner.execute(ScheduledBatch(e.fields[1], BATCH_KINDS[e.fields[2]], rows)).wait()
            result.steps += 1
            for row, got in zip(rows, tokens):
                want = recorded.get((e.fields[1], row.seq_id, row.epoch)) if row.sample else None
                if want is None:
                    continue  # a step the recording never processed (a log cut short)
                result.tokens += 1
                if want[1] != got:
                    result.mismatch = TokenMismatch(e.fields[1], row.seq_id, want[0], want[1], got)
                    return result
    finally:
        runner.shutdown()
    return result
