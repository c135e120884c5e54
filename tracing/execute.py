"""Re-execution: rebuild the model from a trace's header and run its recorded batches again
(`mdi-trace check TRACE`, ARCHITECTURE.md §6 "Replay").

Every recorded `schedule` event is turned back into the ScheduledBatch the engine executed (same rows,
order, token counts, block tables and state slots) and run through a fresh ModelRunner, step after step;
an in-flight input token is taken on the device from the previous step's output, as in the recorded run.
Every sampled token is compared with the recorded one, stale ones included. On the device and library
versions that recorded the run the computation is the same, so the comparison is exact. Elsewhere the
result says so and the near-tie rule applies: a token that differs where the re-executed logits put the
recorded token within the end-to-end tolerance of the winner is a near tie, and that request is compared
no further (everything after a flip is downstream of it); any other difference is a mismatch.

This module loads torch and the model (the rest of tracing/ does not); it is imported only by `check`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tracing.reader import Cut, TraceError, TraceFile
from tracing.schema import BATCH_KINDS


@dataclass(slots=True)
class TokenMismatch:
    step: int
    seq_id: int
    position: int        # the token's position in its sequence
    expected: int        # recorded
    got: int             # re-executed
    margin: float        # how far the recorded token's score lies below the winner's, in logit units

    def __str__(self) -> str:
        return (f"step {self.step}, request {self.seq_id}, position {self.position}: recorded token "
                f"{self.expected}, re-executed {self.got} (logit margin {self.margin:.4g})")


@dataclass(slots=True)
class ExecuteResult:
    steps: int = 0
    tokens: int = 0                      # sampled tokens compared
    mismatch: TokenMismatch | None = None
    near_ties: list[TokenMismatch] = field(default_factory=list)  # other platforms only
    same_platform: bool = True           # device and torch version equal to the recording's
    platform_note: str = ""
    cut: Cut | None = None


def load_recorded_model(trace: TraceFile, model: str | None, device: str):
    """The recorded weights on `device` (a digest mismatch is a TraceError), in the recorded dtype and, on
    CPU, with the recorded intra-op thread count (the CPU kernels' bits depend on it)."""
    import torch

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
        torch.set_num_threads(header["intra_op_threads"])
    if not (header.get("engine") or {}).get("num_kv_blocks"):
        raise TraceError("the trace's header has no engine configuration (num_kv_blocks), so its steps cannot "
                         "be re-executed.")
    return weights


def platform_note(trace: TraceFile, weights) -> str:
    """Empty on the recording's device and torch version; else a sentence saying bits may differ."""
    import torch

    from engine.model_runner import device_name

    header, here = trace.header, device_name(weights.head.weight.device)
    if here == header.get("device") and header.get("torch") == torch.__version__:
        return ""
    return (f"recorded on {header.get('device')} with torch {header.get('torch')}, re-executed on {here} with "
            f"torch {torch.__version__}: bits may differ, so a token that differs at a near tie is not a mismatch")


def recorded_tokens(trace: TraceFile) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(step, seq_id, epoch) -> (position, token_id) of every sampled token, stale ones included."""
    return {(e.fields[1], e.fields[2], e.fields[3]): (e.fields[4], e.fields[5])
            for e in trace.events() if e.kind == "token"}


def recorded_batches(trace: TraceFile, until: int | None = None):
    """The recorded ScheduledBatches in step order, up to and including step `until`."""
    from engine.scheduler import ScheduledBatch, ScheduledRow

    for e in trace.events():
        if e.kind == "schedule" and (until is None or e.fields[1] <= until):
            yield ScheduledBatch(e.fields[1], BATCH_KINDS[e.fields[2]], [ScheduledRow(*r) for r in e.fields[3]])


def margin(logits, row, winner: int, other: int) -> float:
    """The winner's score minus `other`'s under the row's sampler (greedy: logits; else logits/T plus the
    row's Gumbel noise), in logit units (times T)."""
    import torch

    from kernels.sampling import gumbel_noise

    x = logits.float().cpu()
    if row.temperature > 0:
        noise = gumbel_noise(torch.tensor([row.seed]), torch.tensor([row.output_position]), x.numel())[0]
        x = (x / row.temperature + noise) * row.temperature
    return float(x[winner] - x[other])


def check_tokens(trace: TraceFile, model: str | None = None, device: str = "cpu", until: int | None = None,
                 step: int | None = None, on_step=None) -> ExecuteResult:
    """Re-execute the recorded steps (up to and including `until`) and compare every sampled token; with
    `step`, re-execute what step N depends on (every earlier step) and compare step N alone.
    `on_step(i, n)` reports progress. Raises TraceError for a header that cannot be re-executed."""
    from engine.model_runner import ModelRunner

    weights = load_recorded_model(trace, model, device)
    engine = trace.header["engine"]
    recorded = recorded_tokens(trace)
    batches = list(recorded_batches(trace, step if step is not None else until))
    if step is not None and not any(b.step == step for b in batches):
        raise TraceError(f"the trace has no step {step}.")
    note = platform_note(trace, weights)
    result = ExecuteResult(cut=trace.cut, same_platform=not note, platform_note=note)
    runner = ModelRunner(weights, engine["num_kv_blocks"], engine["num_state_slots"],
                         batch_invariant=engine.get("batch_invariant", False))  # recorded in the mode: replay in it
    tied: set[int] = set()  # requests past a near tie (other platforms only)
    try:
        for i, batch in enumerate(batches):
            if on_step:
                on_step(i, len(batches))
            if not batch.rows:
                continue
            tokens = runner.execute(batch).wait()
            result.steps += 1
            if step is not None and batch.step != step:
                continue
            for b, (row, got) in enumerate(zip(batch.rows, tokens)):
                want = recorded.get((batch.step, row.seq_id, row.epoch)) if row.sample else None
                if want is None or row.seq_id in tied:
                    continue  # a step the recording never processed (a log cut short)
                result.tokens += 1
                if want[1] == got:
                    continue
                m = TokenMismatch(batch.step, row.seq_id, want[0], want[1], got,
                                  margin(runner.last_logits[b], row, got, want[1]))
                if note and m.margin <= _tolerance(weights):
                    result.near_ties.append(m)
                    tied.add(row.seq_id)
                    continue
                result.mismatch = m
                return result
    finally:
        runner.shutdown()
    return result


def _tolerance(weights) -> float:
    from model.compare import tolerance
    return tolerance(weights)
