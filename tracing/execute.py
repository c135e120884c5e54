"""Re-execution: rebuild the model from a trace's header and run its recorded batches again
(`mdi-trace check TRACE`, ARCHITECTURE.md §6 "Replay").

Every recorded `schedule` event is turned back into the ScheduledBatch the engine executed (same rows,
order, token counts, block tables and state slots) and run through a fresh ModelRunner, step after step;
an in-flight input token is taken on the device from the previous step's output, as in the recorded run.
Every sampled token is compared with the recorded one, stale ones included. On the recording's platform
(engine/platform.py) the computation is the same, so the comparison is exact. On another platform the
cross-platform rule applies. Each logit may move by the end-to-end tolerance, so a recorded token that lies
within twice the tolerance of the re-executed winner is a near tie. A token further away (a discrete choice
that flipped on one platform moves the logits by more) is put to the plain reference: the requests that hold
one are checked against it (tracing/divergence.py). Where this platform's engine agrees with the reference
there, the recording platform computed other bits: a platform difference, named as one; where it does not,
it is a mismatch. After a near tie or a platform difference the request goes on being compared: its in-flight input tokens
are the recorded ones from then on, so every later position is still checked.

This module loads torch and the model (the rest of tracing/ does not); it is imported only by `check`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

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
    note: str = ""       # what the reference said of it, on another platform

    def __str__(self) -> str:
        return (f"step {self.step}, request {self.seq_id}, position {self.position}: recorded token "
                f"{self.expected}, re-executed {self.got} (logit margin {self.margin:.4g})"
                + (f"; {self.note}" if self.note else ""))


@dataclass(slots=True)
class ExecuteResult:
    steps: int = 0
    tokens: int = 0                      # sampled tokens compared
    mismatch: TokenMismatch | None = None
    near_ties: list[TokenMismatch] = field(default_factory=list)   # another platform only
    platform_differences: list[TokenMismatch] = field(default_factory=list)  # beyond a tie, and no divergence here
    against: object = None               # the check against the reference that judged them (an AgainstResult)
    after_ties: int = 0                  # tokens compared in requests after their first near tie or difference
    same_platform: bool = True           # the recording's platform (engine/platform.py)
    platform_note: str = ""
    cut: Cut | None = None


def load_recorded_model(trace: TraceFile, model: str | None, device: str):
    """The recorded weights on `device` (a digest mismatch is a TraceError), in the recorded dtype, covering
    the recorded max_seq_len (the engine's max_model_len, header `model`) and, on CPU, with the recorded
    intra-op thread count (the CPU kernels' bits depend on it)."""
    import torch

    from model.checkpoint import CheckpointError
    from model.load import load_model

    header = trace.header
    source = model or header.get("model_source") or "tiny-68m"
    from engine.kv_budget import MAX_MODEL_LEN

    max_seq_len = (header.get("model") or {}).get("max_seq_len")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or not 1 <= max_seq_len <= MAX_MODEL_LEN):
        raise TraceError(f"the trace's header has max_seq_len {max_seq_len!r}, not a number of positions between 1 "
                         f"and {MAX_MODEL_LEN:,}.")
    try:
        weights, digest = load_model(source, device, max_seq_len=max_seq_len)
    except CheckpointError as e:
        raise TraceError(f"cannot rebuild the recorded model from {source!r} ({e}); pass --model.") from None
    if header.get("checkpoint_digest") and digest != header["checkpoint_digest"]:
        from model.checkpoint import seed_draws_note
        from model.config import PRESETS, RELEASED_PRESETS
        seeded_on_cpu = source in PRESETS and source not in RELEASED_PRESETS and not Path(source).is_dir()
        why = seed_draws_note() if seeded_on_cpu else ""  # the released presets are drawn on the device
        raise TraceError(f"the weights at {source!r} (digest {digest[:12]}…) are not the recorded ones "
                         f"({header['checkpoint_digest'][:12]}…){': ' + why if why else ''}; pass --model with "
                         "the recorded checkpoint" + (" (a copy of its folder)." if why else "."))
    if header.get("dtype") == "float32":
        weights.to_fp32()
    if header.get("intra_op_threads"):  # the CPU kernels' bits depend on it, also beside a GPU
        torch.set_num_threads(header["intra_op_threads"])
    if not (header.get("engine") or {}).get("num_kv_blocks"):
        raise TraceError("the trace's header has no engine configuration (num_kv_blocks), so its steps cannot "
                         "be re-executed.")
    return weights


def platform_note(trace: TraceFile, weights) -> str:
    """Empty on the recording's platform (engine/platform.py: device, CPU and its instruction-set paths,
    versions, threads); else one sentence naming what differs."""
    from engine.platform import differences, platform_of

    header = trace.header
    differ = differences(header.get("platform"), platform_of(weights.head.weight.device))
    if not differ:
        return ""
    return (f"another platform than the recording's ({'; '.join(differ)}): bits may differ, so a token that "
            f"differs at a near tie is named as one, not a mismatch")


def recorded_tokens(trace: TraceFile) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(step, seq_id, epoch) -> (position, token_id) of every sampled token, stale ones included."""
    return {(e.step, e.seq_id, e.epoch): (e.position, e.token_id) for e in trace.events() if e.kind == "token"}


def request_tokens(trace: TraceFile) -> dict[int, list[int]]:
    """Each request's prompt followed by the tokens the engine appended, in position order."""
    prompts, outputs = {}, {}
    for e in trace.events():
        if e.kind == "request_added":
            prompts[e.seq_id] = list(e.prompt_token_ids)
        elif e.kind == "token" and e.appended:
            outputs.setdefault(e.seq_id, {})[e.position] = e.token_id
    seqs = {}
    for s, prompt in prompts.items():
        out = outputs.get(s, {})
        expected = list(range(len(prompt), len(prompt) + len(out)))
        if sorted(out) != expected:
            raise TraceError(f"request {s}'s appended tokens are not at consecutive positions after its prompt, "
                             f"so its token list cannot be rebuilt.")
        seqs[s] = prompt + [out[p] for p in expected]
    return seqs


def recorded_batches(trace: TraceFile, until: int | None = None):
    """The recorded ScheduledBatches in step order, up to and including step `until`."""
    from engine.step import ScheduledBatch, ScheduledRow

    for e in trace.events():
        if e.kind == "schedule" and (until is None or e.step <= until):
            yield ScheduledBatch(e.step, BATCH_KINDS[e.batch_kind], [ScheduledRow(**r._asdict()) for r in e.rows])


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
    batches = list(recorded_batches(trace, step if step is not None else until))
    if step is not None and not any(b.step == step for b in batches):
        raise TraceError(f"the trace has no step {step}.")
    note = platform_note(trace, weights)
    result = ExecuteResult(cut=trace.cut, same_platform=not note, platform_note=note)
    tokens = _Tokens(trace, weights, result)
    runner = ModelRunner(weights, engine["num_kv_blocks"], engine["num_state_slots"],
                         batch_invariant=engine.get("batch_invariant", False))  # recorded in the mode: replay in it
    try:
        for i, batch in enumerate(batches):
            if on_step:
                on_step(i, len(batches))
            if not batch.rows:
                continue
            got = runner.execute(tokens.feed(batch)).wait().tokens
            result.steps += 1
            if step is None or batch.step == step:
                tokens.compare(batch, got, runner.last_logits)
            if result.mismatch is not None:
                break
    finally:
        runner.shutdown()
    if result.platform_differences:
        _judge_by_the_reference(trace, model, device, batches[-1].step, result)
    return result


def _judge_by_the_reference(trace: TraceFile, model: str | None, device: str, until: int, result: ExecuteResult):
    """Another platform's tokens that differ beyond a near tie: a platform difference where this platform's
    engine agrees with the reference over those requests, else the first of them is the mismatch."""
    from tracing.divergence import check_against_reference

    against = result.against = check_against_reference(trace, model, device, until,
                                                       seq_ids={m.seq_id for m in result.platform_differences})
    d = against.divergence
    if d is None:
        return
    first = next((m for m in result.platform_differences if m.seq_id == d.seq_id), result.platform_differences[0])
    first.note = f"checked against the reference, this platform's engine diverges: {d}" + (
        f"; first module: {d.module}" if d.module else "")
    result.mismatch = first
    result.platform_differences.remove(first)


class _Tokens:
    """The recorded tokens, compared with the re-executed ones by the rule of the module docstring."""

    def __init__(self, trace: TraceFile, weights, result: ExecuteResult):
        from tracing.compare import tolerance

        self.result, self.tol = result, tolerance(weights)
        self.recorded = recorded_tokens(trace)
        self.by_position = {(s, epoch, pos): token for (_, s, epoch), (pos, token) in self.recorded.items()}
        self.tied: set[int] = set()  # requests past a near tie or a platform difference: recorded inputs from then on

    def feed(self, batch):
        """The batch, with the recorded token as the in-flight input of every row of a request past a tie."""
        rows = [replace(r, token_ids=[self.by_position.get((r.seq_id, r.epoch, r.start))])
                if r.seq_id in self.tied and r.token_ids[0] is None else r for r in batch.rows]
        return replace(batch, rows=rows)

    def compare(self, batch, got: list, logits) -> None:
        result = self.result
        for b, (row, token) in enumerate(zip(batch.rows, got)):
            want = self.recorded.get((batch.step, row.seq_id, row.epoch)) if row.sample else None
            if want is None:
                continue  # a step the recording never processed (a log cut short)
            result.tokens += 1
            result.after_ties += row.seq_id in self.tied
            if want[1] == token:
                continue
            m = TokenMismatch(batch.step, row.seq_id, want[0], want[1], token, margin(logits[b], row, token, want[1]))
            if result.same_platform:
                result.mismatch = m
                return
            if m.margin <= 2 * self.tol:  # each logit may move by the tolerance
                result.near_ties.append(m)
            else:  # judged by the reference at the end (_judge_by_the_reference)
                result.platform_differences.append(m)
            self.tied.add(row.seq_id)
