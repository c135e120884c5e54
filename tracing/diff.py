"""`mdi-trace diff A B`: where two traces first part (ARCHITECTURE.md §6). Imports neither torch nor engine/.

Three comparisons, each reporting its first difference with both sides:
- arrivals: the requests (prompt tokens and sampling parameters), by request id;
- decisions: step by step, the batch kind and rows (request, epoch, chunk, block table, state slot,
  sampling) and the preemptions;
- tokens: request by request, the tokens the engine appended, in position order; the first difference
  is the one sampled earliest in A.
Runs that should decide differently (ZOS on vs off) but sample the same tokens compare with `tokens_only`.
A log cut short (a crash, a run still going) is compared on what both logs hold: the steps up to its last,
the requests both saw, the tokens both recorded.
Header differences that explain a diff (device, torch, engine configuration, weights) are listed first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.platform import differences

from tracing.reader import TraceFile
from tracing.schema import BATCH_KINDS

_HEADER_KEYS = ("checkpoint_digest", "device", "torch", "triton", "dtype", "engine", "seed", "intra_op_threads")


class _Request(NamedTuple):
    """What diff compares of a request_added event: everything but its time."""
    prompt_token_ids: tuple
    temperature: float
    seed: int
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple


class _Row(NamedTuple):
    """What diff compares of a schedule row (its tokens by count: ZOS changes which are in flight)."""
    seq_id: int
    epoch: int
    start: int
    num_tokens: int
    block_table: tuple
    state_slot: int
    sample: bool


class _Step(NamedTuple):
    step: int
    batch_kind: str
    rows: tuple
    preempted: tuple


@dataclass(slots=True)
class DiffFinding:
    what: str
    a: str
    b: str


@dataclass
class DiffResult:
    steps: tuple[int, int] = (0, 0)
    tokens: tuple[int, int] = (0, 0)
    findings: list[DiffFinding] = field(default_factory=list)
    header_notes: list[str] = field(default_factory=list)


@dataclass
class _Run:
    """What diff compares of one trace, read in one pass."""
    requests: dict = field(default_factory=dict)    # seq_id -> (prompt, temperature, seed, max_tokens, ...)
    steps: list = field(default_factory=list)       # _Step in order
    tokens: dict = field(default_factory=dict)      # seq_id -> {position: (token_id, step)}

    @classmethod
    def read(cls, trace: TraceFile) -> "_Run":
        run = cls()
        for e in trace.events():
            if e.kind == "request_added":
                run.requests[e.seq_id] = _Request(tuple(e.prompt_token_ids), e.temperature, e.seed, e.max_tokens,
                                                  e.ignore_eos, tuple(e.stop_token_ids))
            elif e.kind == "schedule":
                rows = tuple(_Row(r.seq_id, r.epoch, r.start, len(r.token_ids), tuple(r.block_table), r.state_slot,
                                  r.sample) for r in e.rows)
                run.steps.append(_Step(e.step, BATCH_KINDS[e.batch_kind], rows, tuple(e.preempted)))
            elif e.kind == "token" and e.appended:
                run.tokens.setdefault(e.seq_id, {})[e.position] = (e.token_id, e.step)
        return run

    def clip(self, last_step: int, requests: set[int]) -> None:
        """Keep what a log cut short can be compared on: the steps up to `last_step` and the `requests`."""
        self.steps = [s for s in self.steps if s.step <= last_step]
        self.requests = {q: r for q, r in self.requests.items() if q in requests}
        self.tokens = {q: t for q, t in self.tokens.items() if q in requests}


def _rows(rows, mark: int | None = None) -> str:
    """`request@start+n [blocks] slot s` per row; the row at `mark` in bold."""
    parts = []
    for i, r in enumerate(rows[:6]):
        text = f"{r.seq_id}.{r.epoch}@{r.start}+{r.num_tokens} {list(r.block_table)} slot {r.state_slot}"
        parts.append(f"[bold]{text}[/]" if i == mark else text)
    return ", ".join(parts) + (f", … ({len(rows)} rows)" if len(rows) > 6 else "")


def _step(s: _Step) -> str:
    return f"step {s.step} {s.batch_kind}: {_rows(s.rows)}" + (f"; preempted {list(s.preempted)}" if s.preempted else "")


def _first_decision(a: _Run, b: _Run) -> DiffFinding | None:
    for sa, sb in zip(a.steps, b.steps):
        if sa == sb:
            continue
        if sa.batch_kind != sb.batch_kind or len(sa.rows) != len(sb.rows):
            return DiffFinding(f"decisions differ at step {sa.step}", _step(sa), _step(sb))
        i = next((i for i, (x, y) in enumerate(zip(sa.rows, sb.rows)) if x != y), None)
        if i is None:
            return DiffFinding(f"preemptions differ at step {sa.step}", _step(sa), _step(sb))
        return DiffFinding(f"decisions differ at step {sa.step}, row {i}",
                           f"step {sa.step} {sa.batch_kind}: {_rows(sa.rows, i)}",
                           f"step {sb.step} {sb.batch_kind}: {_rows(sb.rows, i)}")
    if len(a.steps) != len(b.steps):
        n = min(len(a.steps), len(b.steps))
        extra = a.steps[n] if len(a.steps) > n else b.steps[n]
        side = "A" if len(a.steps) > n else "B"
        return DiffFinding(f"only {side} has step {extra.step}", _step(extra) if side == "A" else "(no more steps)",
                           _step(extra) if side == "B" else "(no more steps)")
    return None


def _first_token(a: _Run, b: _Run) -> DiffFinding | None:
    found = []  # (step in A, seq, position, A side, B side)
    for seq in sorted(set(a.tokens) | set(b.tokens)):
        ta, tb = a.tokens.get(seq, {}), b.tokens.get(seq, {})
        for pos in sorted(set(ta) | set(tb)):
            if ta.get(pos, (None,))[0] != tb.get(pos, (None,))[0]:
                found.append((ta.get(pos, tb.get(pos))[1], seq, pos, ta.get(pos), tb.get(pos)))
                break
    if not found:
        return None
    _, seq, pos, x, y = min(found)
    show = lambda t: f"token {t[0]} (step {t[1]})" if t else "no token"  # noqa: E731
    return DiffFinding(f"tokens differ: request {seq}, position {pos}", show(x), show(y))


def diff_traces(ta: TraceFile, tb: TraceFile, tokens_only: bool = False) -> DiffResult:
    a, b = _Run.read(ta), _Run.read(tb)
    result = DiffResult(steps=(len(a.steps), len(b.steps)),
                        tokens=tuple(sum(len(t) for t in r.tokens.values()) for r in (a, b)))
    for key in _HEADER_KEYS:
        va, vb = ta.header.get(key), tb.header.get(key)
        if va != vb:
            result.header_notes.append(f"the headers differ in {key}: {va} vs {vb}")
    if ta.header.get("platform") != tb.header.get("platform"):  # other bits: token differences may be near ties
        result.header_notes.append("recorded on other platforms (" + "; ".join(
            differences(ta.header.get("platform"), tb.header.get("platform") or {}, ("in A", "in B"))) + ")")
    if ta.cut or tb.cut:  # compare what both hold: the cut log's steps, the requests both saw, shared tokens
        last = min(r.steps[-1].step if r.steps else -1 for r, t in ((a, ta), (b, tb)) if t.cut)
        both = set(a.requests) & set(b.requests)
        for run in (a, b):
            run.clip(last, both)
        for run, other in ((a, b), (b, a)):  # a token the cut log never recorded is not a difference
            for q, tokens in run.tokens.items():
                run.tokens[q] = {p: t for p, t in tokens.items() if p in other.tokens.get(q, {})}
        for cut, side in ((ta.cut, "A"), (tb.cut, "B")):
            if cut:
                result.header_notes.append(f"{side}: {cut}; compared up to step {last}, on what both logs hold")
    if a.requests != b.requests:
        seq = next(s for s in sorted(set(a.requests) | set(b.requests)) if a.requests.get(s) != b.requests.get(s))
        show = lambda r: (f"prompt of {len(r.prompt_token_ids)} tokens, temperature {r.temperature}, seed {r.seed}"  # noqa: E731
                          if r else "absent")
        result.findings.append(DiffFinding(f"request {seq} arrives differently", show(a.requests.get(seq)),
                                           show(b.requests.get(seq))))
    if not tokens_only and (finding := _first_decision(a, b)):
        result.findings.append(finding)
    if finding := _first_token(a, b):
        result.findings.append(finding)
    return result
