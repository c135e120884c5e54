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

NOISE = 2 ** -5  # relative gap under which two bf16-derived scores count as tied (a few bf16 ulps)
TOL_BF16, TOL_FP32 = 0.05, 1e-3  # end-to-end logit tolerances (ARCHITECTURE.md §6)


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
    """Records, per token row, every discrete choice of one forward: use `capture` as the model's
    capture hook, and `hooks(weights)` around the forward for the expert choices."""

    def __init__(self, args):
        self.args = args
        self.data: dict[tuple[int, str], torch.Tensor] = {}

    def capture(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name == "index_scores":
            self.data[(layer, name)] = t.flatten(0, -2).float().cpu()

    def hooks(self, weights):
        def gate_hook(layer):
            def hook(gate, inputs, output):
                x = inputs[0].flatten(0, -2)
                scores = F.softplus(F.linear(x.float(), gate.weight.float()) / gate.temp).sqrt() + gate.bias
                self.data[(layer, "expert_scores")] = scores.float().cpu()
            return hook
        return [b.ffn.gate.register_forward_hook(gate_hook(b.layer)) for b in weights.layers]


def _top_set(scores: torch.Tensor, k: int) -> set[int]:
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return {int(i) for i in order if scores[i] > -torch.inf}


def _gap(scores: torch.Tensor, k: int) -> float:
    """Score of the k-th kept minus the best dropped, relative to their size."""
    s = torch.sort(scores[scores > -torch.inf], descending=True).values
    if len(s) <= k:
        return float("inf")
    return float((s[k - 1] - s[k]) / max(float(s[k - 1].abs()), 1e-30))


def explain(ref: Choices, ref_row: int, got: Choices, got_row: int) -> NearTie | str | None:
    """The first discrete choice (layer order) that differs between the two runs at this row: a
    NearTie if the reference's own gap was within NOISE, a message if it was a real difference, None
    if every choice agrees."""
    args = ref.args
    for layer in range(args.n_layers):
        for name, k in (("index_scores", args.index_topk), ("expert_scores", args.n_activated_experts)):
            if (layer, name) not in ref.data or (layer, name) not in got.data:
                continue
            a, b = ref.data[(layer, name)][ref_row], got.data[(layer, name)][got_row]
            if layer == args.candidate_source_layer and name == "index_scores":
                tie = _blocks_differ(args, layer, ref_row, a, b)
                if tie is not None:
                    return tie
            if _top_set(a, k) != _top_set(b, k):
                choice = "indexer top-k" if name == "index_scores" else "experts"
                gap = _gap(a, k)
                detail = f"kept {sorted(_top_set(a, k) - _top_set(b, k))} vs {sorted(_top_set(b, k) - _top_set(a, k))}"
                if gap <= NOISE:
                    return NearTie(layer, choice, ref_row, gap, detail)
                return f"row {ref_row}: {choice} of layer {layer} differ ({detail}) with a clear gap {gap:.3g}"
    return None


def _blocks_differ(args, layer, row, a, b) -> NearTie | str | None:
    """Candidate blocks (spec §2.7 level 1) from the source's scores, compared like the top-k."""
    bs, nb = args.candidate_block_size, args.candidate_topk_blocks

    def block_max(s):
        return F.pad(s, (0, -len(s) % bs), value=-torch.inf).view(-1, bs).amax(-1)

    ba, bb = block_max(a), block_max(b)
    if _top_set(ba, nb) == _top_set(bb, nb):
        return None
    gap = _gap(ba, nb)
    if gap <= NOISE:
        return NearTie(layer, "candidate blocks", row, gap, "block maxima at the boundary")
    return f"row {row}: candidate blocks of layer {layer} differ with a clear gap {gap:.3g}"


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


def compare_rows(ref_logits: torch.Tensor, got_logits: torch.Tensor, tol: float, explain_row) -> Comparison:
    """Rows in order; a row over `tol` must be explained by a near tie (`explain_row(i)`), after which
    the rest is downstream of that tie and not compared."""
    result = Comparison()
    for i in range(ref_logits.size(0)):
        diff = float((ref_logits[i].float() - got_logits[i].float()).abs().max())
        if diff > tol:
            why = explain_row(i)
            if isinstance(why, NearTie):
                result.near_tie = why
                return result
            result.failures.append(f"row {i}: logits differ by {diff:.4g} > {tol} and "
                                   + (why or "no discrete choice differs, so no near tie explains it"))
            return result
        result.max_diff, result.compared = max(result.max_diff, diff), result.compared + 1
    return result
