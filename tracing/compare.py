"""The comparison rules of ARCHITECTURE.md §6, used by the tests and by `mdi-trace check`.

Two runs of the model that differ in shape (batching, chunking, prefill vs decode) or device differ in
their bits, and the discrete choices amplify those bits (spec §10): an indexer top-k entry, a
candidate block or an expert whose deciding scores were within the noise can flip, and everything
downstream of the flip then differs. So logits are compared by maximum absolute difference, and a
position over the tolerance is accepted only when the first discrete choice that differs (in layer
order) was a near tie in the reference run. `Choices` records the choices and their scores through
the models' `capture` hook and forward hooks on the MoE gates; `explain` names the near tie.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NOISE = 2 ** -6  # gap, relative to the row's largest |score|, under which two scores count as tied (~4 bf16 ulps)
# The index scores pass through FP4 queries and keys (spec §2.5c): a value within an ulp of an FP4
# rounding boundary moves a score by a whole FP4 step, and neighbouring e2m1 codes near the top of a
# group (4 and 6) are a third of its amax apart. A flip of entries (or of candidate blocks, ranked by their
# best entry) is also a near tie when the two runs' own scores
# of the swapped entries moved towards each other by more than the gap (the larger move of an entry
# dropped plus that of an entry taken), as long as that move stays under half the row's largest score:
# a few code flips, not a different computation. Measured: a decode row of `micro` against the reference's
# prefill, the streams 0.6% apart, moved two scores by 8% and 14%.
MAX_MOVE = 2 ** -1
E4M3_STEP = 2 ** -3  # the largest gap between neighbouring e4m3 codes, relative to the larger one
TOL_BF16, TOL_FP32 = 0.05, 1e-3  # end-to-end logit tolerances (ARCHITECTURE.md §6)


def tolerance(weights) -> float:
    """The end-to-end logit tolerance of a model: bf16 (the official numerics) or the fp32 debugging mode."""
    return TOL_FP32 if weights.embed.weight.dtype == torch.float32 else TOL_BF16


@dataclass(slots=True)
class NearTie:
    layer: int
    choice: str      # "indexer top-k", "candidate blocks" or "experts"
    row: int         # row of the compared tokens (position for a whole-sequence run)
    gap: float       # the reference's score gap at the selection boundary
    detail: str

    def __str__(self) -> str:
        return f"near tie at row {self.row}: {self.choice} of layer {self.layer} ({self.detail}, gap {self.gap:.3g})"


class Choices:
    """Records, per token row, every discrete choice of one forward and the scores that decided it:
    use `capture` as the model's capture hook, and `hooks(weights)` around the forward for experts."""

    def __init__(self, args):
        self.args = args
        self.data: dict[tuple[int, str], torch.Tensor] = {}

    def capture(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name in ("index_scores", "candidates", "topk"):
            self.data[(layer, name)] = t.flatten(0, -2).cpu()
        elif name == "block":  # the stream leaving each layer [rows, hc·d]
            self.data[(layer, name)] = t.flatten(-2).flatten(0, -2).float().cpu()
        elif name == "window_kv":  # FP8-rounded window latents [rows, D]
            self.data[(layer, name)] = t.flatten(0, -2).float().cpu()

    def hooks(self, weights):
        def gate_hook(layer):
            def hook(gate, inputs, output):
                x = inputs[0].flatten(0, -2)
                scores = F.softplus(F.linear(x.float(), gate.weight.float()) / gate.temp).sqrt() + gate.bias
                self.data[(layer, "expert_scores")] = scores.float().cpu()
                self.data[(layer, "experts")] = output[1].cpu()
            return hook
        return [b.ffn.gate.register_forward_hook(gate_hook(b.layer)) for b in weights.layers]

    def chosen(self, layer: int, name: str, row: int) -> set[int] | None:
        t = self.data.get((layer, name))
        if t is None:
            return None
        t = t[row]
        ids = t.nonzero().flatten() if t.dtype == torch.bool else t[t >= 0]
        return {int(i) for i in ids}


def _gap(scores: torch.Tensor, k: int) -> float:
    """Score of the k-th kept minus the best dropped, relative to the row's largest finite |score| (bf16
    rounding noise scales with the terms' size, not with a difference that may cancel). The ranking holds
    every entry that was ranked: a forced entry (+inf) keeps its place in it, one that could not be chosen
    (-inf: not visible, or masked) is left out."""
    ranked = torch.sort(scores[scores > -torch.inf], descending=True).values
    if len(ranked) <= k or ranked[k - 1] == torch.inf:
        return float("inf")
    finite = ranked[ranked < torch.inf]
    return float((ranked[k - 1] - ranked[k]) / max(float(finite.abs().max()), 1e-30))


def _moved(ref: torch.Tensor, got: torch.Tensor, entries: set[int]) -> float:
    """How far the swapped entries' scores moved between the runs, relative to the row's scale."""
    idx = torch.tensor(sorted(entries))
    scale = max(float(ref[ref.abs() < torch.inf].abs().max()), 1e-30)
    return float((ref[idx] - got[idx]).abs().nan_to_num(0.0).max()) / scale


def _stream_close(ref: Choices, ref_row: int, got: Choices, got_row: int, layer: int) -> bool:
    """The stream entering the next layer agrees within bf16 noise in both runs: relative L2 <= NOISE."""
    if layer < 0 or (layer, "block") not in got.data:  # teacher-forced layers: identical inputs
        return True
    a, b = ref.data[(layer, "block")][ref_row], got.data[(layer, "block")][got_row]
    return float((a - b).norm()) <= NOISE * float(a.norm())


def _block_scores(args, scores: torch.Tensor) -> torch.Tensor:
    """Candidate block scores (spec §2.7 level 1) with the forced newest block at +inf."""
    bs = args.candidate_block_size
    blocks = F.pad(scores.float(), (0, -len(scores) % bs), value=-torch.inf).view(-1, bs).amax(-1)
    visible = int((scores > -torch.inf).sum())
    if visible:
        blocks[(visible - 1) // bs] = torch.inf
    return blocks


CHOICES = (("candidates", "candidate blocks"), ("topk", "indexer top-k"), ("experts", "experts"))


def explain(ref: Choices, ref_row: int, got: Choices, got_row: int) -> NearTie | str | None:
    """The first discrete choice (layer order) that differs between the two runs at this row: a
    NearTie if the reference's own gap was within NOISE, a message if it was a real difference, None
    if every choice agrees."""
    for layer in range(ref.args.n_layers):
        for name, _ in CHOICES:
            why = explain_choice(ref, ref_row, got, got_row, layer, name)
            if why is not None:
                return why
    return None


def explain_choice(ref: Choices, ref_row: int, got: Choices, got_row: int, layer: int, name: str) -> NearTie | str | None:
    """One discrete choice (`name` of CHOICES) of one layer at this row: None if it agrees (or was not made),
    a NearTie if it differs within the noise, else a message naming the clear gap."""
    ta, tb = ref.data.get((layer, name)), got.data.get((layer, name))
    if ta is None or tb is None or (ta.shape[1:] == tb.shape[1:] and torch.equal(ta[ref_row], tb[got_row])):
        return None  # not made, or the same selection (explain() was 17.7 of a 16k-position check's 129 s)
    args, choice = ref.args, dict(CHOICES)[name]
    a, b = ref.chosen(layer, name, ref_row), got.chosen(layer, name, got_row)
    if name == "candidates" and a is not None and b is not None:  # compare blocks, whatever the width
        a, b = ({i // args.candidate_block_size for i in s} for s in (a, b))
    if a is None or b is None or a == b:
        return None
    if not _stream_close(ref, ref_row, got, got_row, layer - 1):
        return f"row {ref_row}: the stream entering layer {layer} already differs beyond bf16 noise"
    if name == "experts":
        gap = _gap(ref.data[(layer, "expert_scores")][ref_row], args.n_activated_experts)
    else:  # entries or candidate blocks, both ranked by index scores (a block by its best entry)
        scores, got_scores = (c.data[(layer, "index_scores")][row].float()
                              for c, row in ((ref, ref_row), (got, got_row)))
        if name == "candidates":
            scores, got_scores = _block_scores(args, scores), _block_scores(args, got_scores)
        gap = _gap(scores, len(a) if name == "topk" else args.candidate_topk_blocks)
        moved = _moved(scores, got_scores, a - b) + _moved(scores, got_scores, b - a)  # the swap closed the gap
        if gap <= moved <= MAX_MOVE:
            return NearTie(layer, choice, ref_row, gap, f"{sorted(a - b)} vs {sorted(b - a)}, "
                           f"scores moved by {moved:.3g} (an FP4 rounding boundary upstream)")
    detail = f"{sorted(a - b)} vs {sorted(b - a)}"
    if gap <= NOISE:
        return NearTie(layer, choice, ref_row, gap, detail)
    return f"row {ref_row}: {choice} of layer {layer} differ ({detail}) with a clear gap {gap:.3g}"


def rounding_flip(ref: Choices, ref_row: int, got: Choices, got_row: int) -> NearTie | None:
    """A near tie of the second kind (ARCHITECTURE.md §6): the first layer whose FP8 window latent
    differs at this row, when the stream entering it agrees within bf16 noise and every differing
    element is one e4m3 code away (a value within an ulp of an FP8 rounding or scale boundary)."""
    for layer in range(ref.args.n_layers):
        a, b = ref.data.get((layer, "window_kv")), got.data.get((layer, "window_kv"))
        if a is None or b is None or torch.equal(a[ref_row], b[got_row]):
            continue
        a, b = a[ref_row], b[got_row]
        differ = a != b
        one_code = (a - b).abs() <= E4M3_STEP * torch.maximum(a.abs(), b.abs())
        if bool(one_code[differ].all()) and _stream_close(ref, ref_row, got, got_row, layer - 1):
            return NearTie(layer, "FP8 rounding of the window KV", ref_row, 0.0,
                           f"{int(differ.sum())} of {len(a)} elements one e4m3 code apart")
        return None
    return None


def first_rounding_flip(rows) -> NearTie | None:
    """The first FP8 rounding flip over (ref, ref_row, got, got_row) rows given in causal order."""
    return next((tie for tie in (rounding_flip(*r) for r in rows) if tie is not None), None)


@dataclass
class Comparison:
    """Logits of `got` against `ref` over rows in order, up to the first near tie."""
    max_diff: float = 0.0
    compared: int = 0
    near_tie: NearTie | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def compare_rows(ref_logits: torch.Tensor, got_logits: torch.Tensor, tol: float, explain_row,
                 explain_rounding=None) -> Comparison:
    """Rows in causal order (positions of one sequence, or decode steps). At each row the discrete
    choices are compared first (`explain_row(i)`): a near tie ends the comparison, since everything
    after it is downstream of the tie; a choice that differs with a clear gap is a failure. Otherwise
    the logits must agree within `tol`, or `explain_rounding(i)` must name an FP8 rounding flip at a
    row up to i (its effect travels to later rows through the window)."""
    result = Comparison()
    for i in range(ref_logits.size(0)):
        why = explain_row(i)
        if isinstance(why, NearTie):
            result.near_tie = why
            return result
        diff = float((ref_logits[i].float() - got_logits[i].float()).abs().max())
        if why is None and diff > tol and explain_rounding is not None:
            why = explain_rounding(i)
            if isinstance(why, NearTie):
                result.near_tie = why
                return result
        if why is not None or diff > tol:
            result.failures.append(why or f"row {i}: logits differ by {diff:.4g} > {tol} "
                                          "and no discrete choice differs, so no near tie explains it")
            return result
        result.max_diff, result.compared = max(result.max_diff, diff), result.compared + 1
    return result


@dataclass
class LayerComparison:
    """One layer of `compare_layers`: its output stream against the reference's, per position."""
    layer: int
    max_rel: float = 0.0                       # relative L2 of the stream, worst position not excused
    near_ties: list[NearTie] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _to(value, device):
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def compare_layers(ref, got, tokens, rel_tol: float) -> list[LayerComparison]:
    """Per layer with identical inputs (teacher forcing, ARCHITECTURE.md §6): each layer of `got` (a
    ReferenceModel, on any device) gets exactly the inputs `ref` computed for that layer, including what
    earlier sources handed down; its output stream must match per position within `rel_tol` relative
    L2, or a discrete choice inside the layer must have flipped at a near tie."""
    ref_choices, got_choices = Choices(ref.args), Choices(got.args)
    h, pre_mix, row_ids, shared = ref.start(tokens, ref_choices.capture)
    device = got.weights.head.weight.device
    hooks = ref_choices.hooks(ref.weights) + got_choices.hooks(got.weights)
    results = []
    try:
        for a, b in zip(ref.weights.layers, got.weights.layers):
            given = {k: _to(v, device) for k, v in shared.items()}
            given["capture"] = got_choices.capture
            out, _ = got.layer(b, _to(h, device), _to(pre_mix, device), _to(row_ids, device), given)
            h, pre_mix = ref.layer(a, h, pre_mix, row_ids, shared)
            diff = (out.float().cpu() - h.float().cpu()).flatten(2).norm(dim=-1)[0]
            rel = diff / h.float().cpu().flatten(2).norm(dim=-1)[0].clamp_min(1e-30)
            result = LayerComparison(a.layer)
            for p in torch.nonzero(rel > rel_tol).flatten().tolist():
                why = explain(ref_choices, p, got_choices, p)
                if isinstance(why, NearTie):
                    result.near_ties.append(why)
                else:
                    result.failures.append(why or f"layer {a.layer} position {p}: output differs by "
                                                  f"{float(rel[p]):.3g} relative with identical inputs")
            excused = {t.row for t in result.near_ties}
            result.max_rel = max((float(r) for p, r in enumerate(rel) if p not in excused), default=0.0)
            results.append(result)
    finally:
        for hook in hooks:
            hook.remove()
    return results
