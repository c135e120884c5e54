"""Against the reference: `mdi-trace check TRACE --against reference` (ARCHITECTURE.md §6).

Pass 1 compares. For every row, the request's tokens up to the row's end (its prompt and the tokens the
engine appended, read from the trace) go through the plain reference model (model/reference.py), which
gives the logits, the discrete choices and every layer's inputs at every position. The reference is a
single-shot prefill of that prefix, not of the whole request: its attention lists take their lengths from
the whole sequence (as the official code's), so a longer sequence changes the bits of earlier positions
(on tiny-68m by up to 0.19 in the logits). Once a prefix is long enough for every list to reach its full
length, the whole request gives the same bits, so it is computed once. The recorded batches are
re-executed in order on the paged model with every input token taken from the trace, so a token that
flipped at a near tie never derails the rows after it. Every position's logits are compared with the
reference's by the rules of tracing/compare.py: a discrete choice that differs at a near tie, or an FP8
window code one step away, is a named near tie, and comparison goes on (the summary counts the positions
compared after a request's first tie). A position over the tolerance that no near tie explains, or a
choice that differs by a clear gap, is a suspect for pass 2. A sampled token is compared with the token the
reference's logits give under the row's sampler: within twice the tolerance of it (each logit may move by
the tolerance) it is a token near tie; further, where the re-execution samples the reference's token, the
recording computed other bits: on another platform (engine/platform.py) a platform difference, named as
one; on the recording's own platform a divergence, since the recorded token is not what its computation
gives.

Pass 2 localises. A second replay, `lag`, runs every step after the first with every compared row
teacher-forced: each layer's inputs (the stream entering the Engram block and the block, and the
pre-mix) are replaced by those of the whole request through the reference (one reference per request,
for every step: a prefix's bits at a shared position can differ from the whole's by shape noise, most on
CUDA, where the GEMMs' kernels depend on the row count) through forward pre-hooks, so its state (rings,
tails, KV blocks, Engram history) is what the engine writes from that reference's inputs, and the modules
are compared with that same reference. At a step with a suspect (pass 1's position over the tolerance,
or its choice flipped by a clear gap), that row's modules are compared in order within each layer (Engram,
attention input, window, compressor, index keys, indexer top-k and candidates, sparse attention,
attention output, MoE input, MoE routing, MoE experts, layer output); the window and the compressed
entries are what the row reads from lag's state, by position and by entry, and a stored FP8/FP4 code one
step from the reference's is rounding. The first module over the per-module tolerance, or whose discrete
choice differs by a clear gap, is named and is the divergence. Where the teacher-forced pass makes the
reference's choices (or differs from them only at near ties) and no module is over its tolerance, pass 1's
suspect is shape noise: the bits of a decode shape against a prefill shape, carried downstream, not a bug.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from model.attention import stream
from tracing.execute import (load_recorded_model, margin, platform_note, recorded_batches, recorded_tokens,
                             request_tokens)
from tracing.reader import Cut, TraceError, TraceFile

# Per-module tolerance on the relative L2 of a row's output with teacher-forced inputs. Identical inputs
# leave bf16 shape noise (an ulp, ~2^-8) plus what the engine's own earlier steps left in its state;
# a broken module is off by O(1).
MODULE_TOL_BF16, MODULE_TOL_FP32 = 2 ** -4, 1e-3


@dataclass(slots=True)
class ModuleDiff:
    layer: int
    module: str
    max_diff: float    # max |engine - reference| over the compared values
    rel: float         # relative L2
    detail: str = ""

    def __str__(self) -> str:
        what = self.detail or f"max diff {self.max_diff:.4g}, relative L2 {self.rel:.3g}"
        return f"layer {self.layer}, {self.module}: {what}"


@dataclass(slots=True)
class Divergence:
    step: int
    seq_id: int
    epoch: int
    position: int           # the row's last token: its logits predict position + 1
    detail: str
    max_diff: float         # logits, engine vs reference
    module: ModuleDiff | None = None
    module_note: str = ""   # why no module is named, when none is

    def __str__(self) -> str:
        return f"step {self.step}, request {self.seq_id} (epoch {self.epoch}), position {self.position}: {self.detail}"


@dataclass(slots=True)
class AgainstResult:
    steps: int = 0
    rows: int = 0                    # token positions whose logits were compared
    tokens: int = 0                  # sampled tokens compared
    max_diff: float = 0.0            # over the rows within tolerance
    tolerance: float = 0.0
    near_ties: list[tuple[int, int, object]] = field(default_factory=list)  # (step, seq_id, NearTie or token note)
    platform_differences: list[tuple[int, int, str]] = field(default_factory=list)  # (step, seq_id, note)
    after_ties: int = 0              # positions compared in requests (at an epoch) after their first near tie
    divergence: Divergence | None = None
    noise: int = 0                   # positions over the tolerance (or choices flipped) where no module differs
    noise_max: float = 0.0
    noise_notes: list[tuple[int, int, str]] = field(default_factory=list)  # (step, seq_id, what pass 1 saw)
    platform_note: str = ""
    cut: Cut | None = None


class _Reference:
    """One request's prefix through the reference model: the final stream of every position (the logits of
    a chunk are computed from it on demand), the discrete choices, and every layer's inputs at every
    position (the stream entering the Engram block and the block, and the pre-mix), for teacher forcing.
    With `tap`, also every module's output at every position (`self.tap`, for pass 2)."""

    def __init__(self, weights, tokens: list[int], tap: bool = False):
        from tracing.compare import Choices
        from model.reference import ReferenceModel

        self.weights, self.tokens = weights, tokens
        self.tap = _Tap(weights, lambda t: t[0], whole=True) if tap else None
        self.choices = self.tap.choices if tap else Choices(weights.args)
        self.inputs: dict[tuple[int, str, int], torch.Tensor] = {}
        model, hooks = ReferenceModel(weights), [] if tap else self.choices.hooks(weights)
        for block in weights.layers:
            if block.engram is not None:
                hooks.append(block.engram.register_forward_pre_hook(self._keep(block.layer, "engram_in", 1)))
            hooks.append(block.register_forward_pre_hook(self._keep(block.layer, "block_in", 2)))
        try:
            with torch.inference_mode():
                capture = self.tap.capture if tap else self.choices.capture
                h, pre_mix, row_ids, shared = model.start(tokens, capture)
                for block in weights.layers:
                    h, pre_mix = model.layer(block, h, pre_mix, row_ids, shared)
        finally:
            for hook in hooks:
                hook.remove()
            if tap:
                self.tap.remove()
        self.h, self.pre_mix = h[0], pre_mix[0]

    def _keep(self, layer: int, name: str, n: int):
        def hook(module, args):
            for k in range(n):
                self.inputs[(layer, name, k)] = args[k][0].clone()  # [S, ...]
        return hook

    def logits(self, start: int, end: int) -> torch.Tensor:
        """fp32 logits [end - start, vocab] of positions [start, end), from the final stream."""
        with torch.inference_mode():
            return self.weights.logits(self.h[start:end], self.pre_mix[start:end]).float().cpu()


class _Force:
    """Teacher forcing of a replayed step, as a context around its forward (the modules are shared with the
    reference, which must not be forced): at each listed row's chunk, every layer's inputs (as the reference
    computed them) replace the replay's own. Rows are (batch row, chunk start, chunk length, _Reference)."""

    def __init__(self, weights, rows: list):
        self.weights, self.rows, self.hooks = weights, rows, []

    def __enter__(self) -> "_Force":
        for block in self.weights.layers:
            if block.engram is not None:
                self.hooks.append(block.engram.register_forward_pre_hook(self._hook(block.layer, "engram_in", 1)))
            self.hooks.append(block.register_forward_pre_hook(self._hook(block.layer, "block_in", 2)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def _hook(self, layer: int, name: str, n: int):
        def hook(module, args):
            args = list(args)
            for k in range(n):
                args[k] = args[k].clone()
                for b, start, count, ref in self.rows:
                    args[k][b, :count] = ref.inputs[(layer, name, k)][start:start + count].to(args[k].device)
            return tuple(args)
        return hook



class _Replay:
    """The paged model re-executing recorded batches, every input token from the request's token list. The
    inputs are built as the engine builds them (ModelRunner.logits), always eagerly."""

    def __init__(self, weights, engine: dict, seqs: dict[int, list[int]]):
        from engine.model_runner import ModelRunner

        self.runner = ModelRunner(weights, engine["num_kv_blocks"], engine["num_state_slots"],
                                  batch_invariant=engine.get("batch_invariant", False))
        self.runner.use_cuda_graphs = False  # the forward runs here, with capture hooks
        self.model, self.seqs = self.runner.model, seqs

    def run(self, batch, capture=None) -> torch.Tensor:
        """Logits [B, S, vocab] of every token of the batch, on the host."""
        from engine.step import ScheduledBatch

        rows = []
        for r in batch.rows:
            tokens = self.seqs[r.seq_id][r.start:r.start + r.num_tokens]
            if len(tokens) < r.num_tokens:
                raise TraceError(f"step {batch.step}: request {r.seq_id}'s row reaches position "
                                 f"{r.start + r.num_tokens - 1}, past the tokens the trace holds for it.")
            rows.append(replace(r, token_ids=tokens))
        return self.runner.logits(ScheduledBatch(batch.step, batch.batch_kind, rows), capture).float().cpu()


@dataclass(slots=True)
class _Track:
    """One request at one epoch (a recomputation after preemption starts a new track)."""
    tied: bool = False       # past its first near tie: later positions count as compared after ties


def check_against_reference(trace: TraceFile, model: str | None = None, device: str = "cpu",
                            until: int | None = None, on_step=None, localise: bool = True,
                            seq_ids: set[int] | None = None) -> AgainstResult:
    """Pass 1 (and, at a position over the tolerance, pass 2) of the module docstring; with `seq_ids`, the
    rows of those requests alone (a row's computation never reads another row's state)."""
    weights = load_recorded_model(trace, model, device)
    check = _Check(weights, trace, localise)
    batches = []
    for batch in recorded_batches(trace, until):
        if seq_ids is not None:
            batch.rows = [r for r in batch.rows if r.seq_id in seq_ids]
        if batch.rows:
            batches.append(batch)
    check.last_step = {r.seq_id: b.step for b in batches for r in b.rows}
    for i, batch in enumerate(batches):
        if on_step:
            on_step(i, len(batches))
        if check.step(batch):
            break
    return check.result


@dataclass(slots=True)
class _Suspect:
    """A row of a step that pass 1 could not clear: its first position over the tolerance that no near tie
    explains, or a discrete choice that differs by a clear gap. Pass 2 decides: a module, or shape noise."""
    b: int                   # batch row
    divergence: Divergence
    over: int                # positions of the row over the tolerance


class _Check:
    """The state of pass 1: the replay under test, the teacher-forced `lag` replay (its state is what the
    engine writes when every row's inputs are the reference's, so a state module compared at a divergent
    step differs only by a bug or by that step's own arithmetic), the references and the requests' tracks."""

    def __init__(self, weights, trace: TraceFile, localise: bool):
        from tracing.compare import tolerance

        self.weights, self.localise = weights, localise
        self.seqs, self.recorded = request_tokens(trace), recorded_tokens(trace)
        self.tol = tolerance(weights)
        self.note = platform_note(trace, weights)
        self.result = AgainstResult(tolerance=self.tol, platform_note=self.note, cut=trace.cut)
        engine = trace.header["engine"]
        self.replay, self.lag = _Replay(weights, engine, self.seqs), _Replay(weights, engine, self.seqs)
        # A prefix at least `saturated` long has the attention lists' full lengths (window_size entries and
        # index_topk entries at every ratio), so it gives the same bits as the whole request at every position
        # it shares: the whole request is computed once and serves every row that ends there or later.
        args = weights.args
        self.saturated = max([args.window_size] + [r * args.index_topk for r in args.compress_ratios])
        self.refs: dict[int, _Reference] = {}
        self.tracks: dict[tuple[int, int], _Track] = {}
        self.last_step: dict[int, int] = {}

    def reference(self, row) -> _Reference:
        """The reference pass 1 compares a row's logits with: its prefix, or the whole request once saturated."""
        end = row.start + row.num_tokens
        return _Reference(self.weights, self.seqs[row.seq_id][:end]) if end < self.saturated else self.whole(row.seq_id)

    def whole(self, seq_id: int, tap: bool = False) -> _Reference:
        """The whole request through the reference, computed once (again with taps, the first time pass 2 needs
        them: the same tokens and shapes give the same bits). It also forces every step of the request on
        `lag`, and localising compares with it: a prefix reference's bits at a shared position may differ
        from a longer one's by shape noise (on CUDA the GEMMs' kernels depend on the row count), and state
        written from one reference's inputs compares with that reference alone."""
        ref = self.refs.get(seq_id)
        if ref is None or (tap and ref.tap is None):
            ref = self.refs[seq_id] = _Reference(self.weights, self.seqs[seq_id], tap)
        return ref

    def step(self, batch) -> bool:
        """Compare one step's rows, then run it teacher-forced on `lag`, where pass 2 decides every row pass 1
        could not clear. True when the check is over (a divergence)."""
        from tracing.compare import Choices

        choices = Choices(self.weights.args)
        hooks = choices.hooks(self.weights)
        try:
            logits = self.replay.run(batch, choices.capture)
        finally:
            for h in hooks:
                h.remove()
        self.result.steps += 1
        forced, suspects = [], []
        for b, row in enumerate(batch.rows):
            track = self.tracks.setdefault((row.seq_id, row.epoch), _Track())
            forced.append((b, row.start, row.num_tokens, self.whole(row.seq_id)))
            verdict = self.compare_row(batch, b, row, self.reference(row), track, logits, choices)
            if isinstance(verdict, Divergence):  # a recorded token that neither computation gives
                self.result.divergence = verdict
                return True
            if verdict is not None:
                suspects.append(verdict)
        force = _Force(self.weights, forced)
        if suspects and self.localise:
            refs = {s.b: self.whole(batch.rows[s.b].seq_id, tap=True) for s in suspects}
            divergence = _localise(self.weights, self.lag, batch, force, suspects, refs)
        else:
            with force:
                self.lag.run(batch)
            divergence = suspects[0].divergence if suspects else None
        for s in suspects:
            if s.divergence is not divergence:
                self.result.noise += s.over
                self.result.noise_notes.append((batch.step, batch.rows[s.b].seq_id, s.divergence.detail))
        self.result.divergence = divergence
        for seq_id in [q for q, last in self.last_step.items() if last == batch.step]:
            self.refs.pop(seq_id, None)
        return divergence is not None

    def compare_row(self, batch, b: int, row, ref: _Reference, track: _Track, logits, choices):
        """Every position of one row, then its sampled token. Near ties are recorded and comparison goes on
        (the inputs are the recorded tokens, so every later position is still checked). Returns None when
        the row is clear, a _Suspect for pass 2, or a Divergence (the recorded token, which neither the
        re-execution nor the reference gives)."""
        from tracing.compare import NearTie, explain, rounding_flip

        result, tol, S = self.result, self.tol, logits.size(1)
        ref_logits = ref.logits(row.start, row.start + row.num_tokens)
        suspect = None
        for j in range(row.num_tokens):  # every token of the chunk, in causal order
            p, got_row = row.start + j, b * S + j
            result.rows += 1
            result.after_ties += track.tied
            why = explain(ref.choices, p, choices, got_row)
            diff = float((logits[b, j] - ref_logits[j]).abs().max())
            if why is None and diff > tol:
                why = rounding_flip(ref.choices, p, choices, got_row)
            if isinstance(why, NearTie):
                track.tied = True
                result.near_ties.append((batch.step, row.seq_id, why))
                continue
            if why is None and diff <= tol:
                result.max_diff = max(result.max_diff, diff)
                continue
            result.noise_max = max(result.noise_max, diff)
            if suspect is None:
                detail = why or f"logits differ from the reference's by {diff:.4g} > {tol}, and no near tie explains it"
                suspect = _Suspect(b, Divergence(batch.step, row.seq_id, row.epoch, p, detail, diff), 0)
            suspect.over += 1
        want = self.recorded.get((batch.step, row.seq_id, row.epoch)) if row.sample else None
        if want is None or suspect is not None:
            return suspect  # a row over the tolerance: pass 2 judges its token with it
        result.tokens += 1
        return self.compare_token(batch, b, row, want, ref_logits[-1], logits[b, row.num_tokens - 1], track)

    def compare_token(self, batch, b: int, row, want, ref_logits, got_logits, track: _Track) -> Divergence | None:
        """The recorded token against the reference's under the row's sampler, the row's logits being within
        the tolerance (or explained). The same, within twice the tolerance of it (each logit may move by the
        tolerance), or what the re-execution samples: a token near tie. Else, on another platform, the
        recording platform computed other bits: a platform difference. On the recording's own platform it is
        a divergence: the recorded token is not what its computation gives."""
        position, recorded = want
        ref_token, got_token = self.sample(ref_logits, row), self.sample(got_logits, row)
        if ref_token == recorded:
            return None
        m = margin(ref_logits, row, ref_token, recorded)
        note = (f"token at position {position}: recorded {recorded}, the reference samples {ref_token} with margin "
                f"{m:.4g}, the re-execution here {got_token}")
        track.tied = True
        if m <= 2 * self.tol or got_token == recorded:
            self.result.near_ties.append((batch.step, row.seq_id, f"{note} (a token near tie)"))
            return None
        if self.note:
            self.result.platform_differences.append((batch.step, row.seq_id, f"{note}: the re-execution agrees with "
                                                     "the reference, the recording platform computed other bits"))
            return None
        return Divergence(batch.step, row.seq_id, row.epoch, row.start + row.num_tokens - 1, note, 0.0)

    @staticmethod
    def sample(logits, row) -> int:
        from kernels.sampling import sample
        return int(sample(logits[None].float(), torch.tensor([row.temperature], dtype=torch.float32),
                          torch.tensor([row.seed]), torch.tensor([row.output_position]))[0])


# ---- pass 2 ------------------------------------------------------------------------------------------------

class _Tap:
    """Module outputs of one forward: `rows(t)` picks what is kept of a [B, S, ...] tensor (the reference keeps
    its sequence's every position, a replay the whole batch). `whole=True` (the reference) also keeps the
    whole sequence's compressed entries and index keys."""

    OUTPUTS = ("engram", "window_kv", "sparse_attn", "attn_out", "block")

    def __init__(self, weights, rows, whole: bool = False):
        from tracing.compare import Choices

        self.rows, self.whole = rows, whole
        self.out: dict[tuple[int, str], torch.Tensor] = {}
        self.choices = Choices(weights.args)
        self.hooks = self.choices.hooks(weights)
        for block in weights.layers:
            L = block.layer
            self.hooks.append(block.attn_norm.register_forward_pre_hook(self._keep(L, "attn_in")))
            self.hooks.append(block.ffn_norm.register_forward_pre_hook(self._keep(L, "ffn_in")))
            self.hooks.append(block.ffn.register_forward_hook(lambda m, i, o, L=L: self._put(L, "ffn_out", o)))

    def _put(self, layer: int, name: str, t: torch.Tensor) -> None:
        self.out[(layer, name)] = self.rows(t).float().cpu()

    def _keep(self, layer: int, name: str):
        return lambda module, args: self._put(layer, name, args[0])

    def capture(self, layer: int, name: str, t: torch.Tensor) -> None:
        self.choices.capture(layer, name, t)
        if name in self.OUTPUTS:
            self._put(layer, name, t)
        if self.whole and name in ("compressed_kv", "index_keys"):
            self.out[(layer, name + "_all")] = t[0].float().cpu()  # every entry of the sequence

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


# The modules whose outputs are stored rounded to a low-precision code (spec §2.5): (format, group size,
# scale format). An element one code away from the reference's is a value that sat within an ulp of a
# rounding boundary (ARCHITECTURE.md §6), not a divergence.
CODED = {"window": ("fp8", 0, ""), "compressor": ("fp4", 16, "e4m3"), "index keys": ("fp4", 32, "ue8m0")}


def _one_code_apart(got: torch.Tensor, ref: torch.Tensor, fmt: str, block: int, scale_fmt: str) -> bool:
    """Every element within one code of the reference's: e4m3 codes are at most 2^-3 of the larger value
    apart; e2m1 codes 0.5, 1 and 2 group scales apart below 2, 4 and 6 scales, the scale amax / 6 (rounded
    up to a power of two for ue8m0 scales, and allowed an e4m3 ulp otherwise)."""
    from tracing.compare import E4M3_STEP
    from model.quant import pow2ceil

    a, b = got.float(), ref.float()
    if fmt == "fp8":
        return bool(((a - b).abs() <= E4M3_STEP * torch.maximum(a.abs(), b.abs())).all())
    a, b = a.reshape(-1, block), b.reshape(-1, block)
    amax = torch.maximum(a.abs().amax(-1, keepdim=True), b.abs().amax(-1, keepdim=True)).clamp_min(1e-30)
    scale = pow2ceil(amax / 6) if scale_fmt == "ue8m0" else amax / 6 * (1 + 2 ** -3)
    m = torch.maximum(a.abs(), b.abs())
    step = torch.where(m <= 2 * scale, 0.5, torch.where(m <= 4 * scale, 1.0, 2.0)) * scale
    return bool(((a - b).abs() <= step).all())


def _rel(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (got.float() - ref.float())
    return float(d.abs().max()) if d.numel() else 0.0, float(d.norm() / ref.float().norm().clamp_min(1e-30))


def _localise(weights, lag: _Replay, batch, force: _Force, suspects: list[_Suspect], refs: dict) -> Divergence | None:
    """Pass 2: run the step on `lag` (the state before it, written by teacher-forced steps) with every compared
    row teacher-forced, and name the first module of each suspect row that differs (its divergence's module);
    the first suspect with a module named is the divergence, the others are shape noise (their module_note
    says why). `refs` maps a suspect's batch row to its request's tapped whole reference."""
    rings = {s.b: lag.model.ring[:, batch.rows[s.b].state_slot].float().cpu() for s in suspects}  # [L, W, D] before
    got = _Tap(weights, lambda t: t)  # the whole batch [B, S, ...]
    try:
        with force:
            lag.run(batch, got.capture)
    finally:
        got.remove()
    S = max(r.num_tokens for r in batch.rows)
    for s in suspects:
        module = _first_module(weights, lag, batch.rows[s.b], s, got, refs[s.b].tap, rings[s.b], S)
        if isinstance(module, ModuleDiff):
            s.divergence.module = module
            return s.divergence
        s.divergence.module_note = module
    return None


def _first_module(weights, lag: _Replay, row, suspect: _Suspect, got: _Tap, ref: _Tap, ring, S: int):
    """The first module of the suspect's row whose output (with teacher-forced inputs) is over the per-module
    tolerance, or whose discrete choice differs by a clear gap; else a sentence saying why none is."""
    from tracing.compare import CHOICES, NearTie, explain_choice

    args, b, p = weights.args, suspect.b, suspect.divergence.position
    start, j = row.start, p - row.start  # the suspect position's index in the row's chunk
    tol = MODULE_TOL_FP32 if weights.embed.weight.dtype == torch.float32 else MODULE_TOL_BF16
    W, ties = args.window_size, []
    at = lambda L, name: (got.out[(L, name)][b, j], ref.out[(L, name)][p])  # noqa: E731
    for block in weights.layers:
        L, r = block.layer, args.compress_ratios[block.layer]
        stages = [("Engram", *at(L, "engram"))] if block.engram is not None else []
        stages.append(("attention input (hyper-connection pre-mix)", *at(L, "attn_in")))
        window = range(max(0, p - W + 1), p + 1)
        got_window = torch.stack([got.out[(L, "window_kv")][b, q - start] if q >= start else ring[L, q % W]
                                  for q in window])
        stages.append(("window", got_window, ref.out[(L, "window_kv")][window.start:p + 1]))
        if r and args.is_kv_source(L):
            n = (p + 1) // r
            for pool, name, module in zip(lag.model.entries[L], ("compressed_kv_all", "index_keys_all"),
                                          ("compressor", "index keys")):
                stages.append((module, stream(pool, torch.tensor([row.block_table], device=pool.device),
                                              n)[0].float().cpu(), ref.out[(L, name)][:n]))
        stages += [(name, None, None) for name, _ in CHOICES[:2]]
        stages += [("sparse attention", *at(L, "sparse_attn")), ("attention output", *at(L, "attn_out")),
                   ("MoE input (hyper-connection post and pre-mix)", *at(L, "ffn_in")),
                   ("experts", None, None), ("MoE experts", *at(L, "ffn_out")),
                   ("layer output (hyper-connection post)", *at(L, "block"))]
        for module, a, c in stages:
            if a is None:  # a discrete choice: the reference's, or a near tie; a clear gap is the divergence
                why = explain_choice(ref.choices, p, got.choices, b * S + j, L, module)
                if isinstance(why, NearTie):
                    ties.append(str(why))
                elif why is not None:
                    label = {"candidates": "candidate blocks", "topk": "indexer top-k", "experts": "MoE routing"}[module]
                    return ModuleDiff(L, label, 0.0, 0.0, why)
                continue
            max_diff, rel = _rel(a, c)
            if rel > tol and not (module in CODED and _one_code_apart(a, c, *CODED[module])):
                return ModuleDiff(L, module, max_diff, rel)
    tied = f" ({len(ties)} near ties, the first: {ties[0]})" if ties else ""
    return (f"shape noise: with teacher-forced inputs every discrete choice is the reference's or a near tie{tied} and no module "
            f"differs by more than {tol:.3g} relative L2; the difference builds up across layers or lies in the head")
