"""The model against DeepSeek's own code: tests/data holds its outputs for tiny-68m seed 0
(copied from shared/golden; its README says how to use them).

The bits depend on the CPU (golden README, last section): tests/data/golden-digests.json lists the official
digests per platform, and which platform each was measured on. Where one applies (`golden_platform`: the
CPU's widest ISA (AMX counted), torch's dispatch, no ISA override), the full-logit digests are bitwise; the
golden outputs themselves are one run's (AVX512, `OUTPUTS_APPLY`), and on their platform the tests are bitwise
against them too, as they always were: with DeepSeek's top-k tie order (`topk_tie_rule="torch"`, same torch
build) the reference model reproduces the official prefill logits bit for bit; with the project's lower-index
tie rule every position over the tolerance is explained by a named exact tie; the paged model's teacher-forced
decode of prompt A matches the official decode within the bf16 tolerance.

Elsewhere (the outputs on another digest's platform included) they compare within the tolerance rules (golden README
"How a test should use these", ARCHITECTURE.md §6), and say so (a print, shown with -rA, and the `golden_mode`
property). The golden data hold no discrete choices of the official run, so a choice that flipped between the two
platforms cannot be seen directly; `GoldenComparison` therefore goes position by position in causal order, and at the
first position that breaks a rule it demands a confirmed near tie: a choice of this run at that position within the
noise (tracing/compare.py `explain_choice`) whose other side, forced, brings the position back within the
rules. Everything after it is downstream and is held to lse only. A break that no such choice explains is a
failure, except on a capability where the project is known not to reproduce the official code
(golden-digests.json, `reproduced_by_project` false: DEFAULT), where it is reported as that known difference.
"""
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import DATA, ROOT
from engine.platform import ISA_OVERRIDES, cpu_platform
from model.checkpoint import init_weights, weights_digest
from model.config import preset
from model.paged import ForwardBatch, PagedModel
from model.reference import ReferenceModel
from model.transformer import Transformer
from tracing.compare import (TOL_BF16, Choices, NearTie, _block_scores, compare_rows, explain, explain_choice,
                           first_rounding_flip)

# The golden outputs are bits of torch 2.13's CPU kernels: another build computes other bits.
pytestmark = pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                                reason="golden bits were produced by torch 2.13 on CPU")
GOLDEN = load_file(DATA / "tiny-68m-seed0.outputs.safetensors")
PROMPTS = json.loads((DATA / "tiny-68m-seed0.prompts.json").read_text())
DIGESTS = json.loads((DATA / "golden-digests.json").read_text())
BOUND = 2 * TOL_BF16  # a top-1 swap is a near tie when the reference margin is within this (two logits' errors)
MAX_FORCED = 4  # choices within the noise forced, smallest gap first, before a break counts as unexplained


def golden_platform() -> tuple[dict | None, dict | None, str]:
    """(the digest row that applies here or None, the row of a known project difference on this capability
    or None, the mode in words)."""
    here = cpu_platform()
    rows = DIGESTS["platforms"]
    row = next((r for r in rows if r["reproduced_by_project"] and not here["isa_overrides"]
                and all(here[k] == v for k, v in r["platform"].items())), None)
    known = next((r for r in rows if not r["reproduced_by_project"] and r["capability"] == here["cpu_capability"]),
                 None)
    if row is not None:
        return row, None, f"bitwise ({row['capability']} digests)"
    overrides = " ".join(f"{k}={v}" for k, v in here["isa_overrides"].items())
    return None, known, (f"within tolerance (no official digest for cpu_isa={here['cpu_isa']}, capability="
                         f"{here['cpu_capability']}" + (f", overrides {overrides}" if overrides
                                                                            else "") + ")")


OFFICIAL, KNOWN_DIFFERENCE, MODE = golden_platform()
# The golden outputs (top-k values, lse, the last rows, the decode) are bits of one official run, the one whose
# digests are the row marked "outputs" (the golden README: AVX512). On another digest's platform the digests are
# bitwise, and the outputs are compared by the tolerance rules, as anywhere else: the official decode of A
# itself takes another token after 4 there (the golden README, last section).
OUTPUTS_APPLY = OFFICIAL is not None and OFFICIAL.get("outputs", False)
if OFFICIAL is not None and not OUTPUTS_APPLY:
    MODE += f"; the golden outputs ({next(r['capability'] for r in DIGESTS['platforms'] if r.get('outputs'))}) " \
            "within tolerance"


def say(record_property, text: str) -> None:
    record_property("golden_mode", MODE)
    record_property("golden_result", text)
    print(f"[{MODE}] {text}")


def build(tie_rule: str) -> Transformer:
    args = preset("tiny-68m")
    args.topk_tie_rule = tie_rule
    model = Transformer(args)
    init_weights(model.named_parameters(), seed=0)
    return model


# torch.randn of 16 or more values takes a vectorised path on AVX2 and AVX-512 and a scalar one under the
# DEFAULT dispatch, which draws other normals: there init_weights gives other weights (734 of 865 tensors, ALL
# 015f565f...), and nothing of the golden data would apply (README "Weights first"). The golden tests then
# draw the weights in a child process at the CPU's own dispatch, and test_weights says so.
DRAW_IN_CHILD = """import sys, torch
sys.path.insert(0, sys.argv[2])
from model.checkpoint import init_weights
from model.config import preset
from model.transformer import Transformer
model = Transformer(preset("tiny-68m"))
init_weights(model.named_parameters(), seed=0)
torch.save(model.state_dict(), sys.argv[1])
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.fixture(scope="module")
def official_ties(tmp_path_factory):
    model = build("torch")
    model.drawn = f"init_weights in this process (capability {torch.backends.cpu.get_cpu_capability()})"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        here = weights_digest(model.state_dict().items())[1]
        path = tmp_path_factory.mktemp("golden-weights") / "state_dict.pt"
        env = {k: v for k, v in os.environ.items() if k not in ISA_OVERRIDES}
        child = subprocess.run([sys.executable, "-c", DRAW_IN_CHILD, str(path), str(ROOT)], env=env,
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, child.stderr
        model.load_state_dict(torch.load(path))
        model.drawn = (f"init_weights in a child process without ISA overrides (capability {child.stdout.strip()}): "
                       f"on DEFAULT this process draws other weights (ALL {here[:12]}...)")
    return model


@pytest.fixture(scope="module")
def project_ties(official_ties):
    model = build("lower-index")
    model.load_state_dict(official_ties.state_dict())
    return model


# ---- the cross-platform rule (tolerance mode) ------------------------------------------------------------------
def rule_break(logits: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor) -> str | None:
    """One row against the golden top-8 (README "Prefill"): the values at the reference ids within the
    tolerance, and the top-1 wherever the reference margin exceeds the bound. None if it holds."""
    diff = float((logits[ids] - vals).abs().max())
    if diff > TOL_BF16:
        return f"logits at the reference top-8 ids differ by {diff:.4g} > {TOL_BF16}"
    margin = float(vals[0] - vals[1])
    if int(logits.argmax()) != int(ids[0]) and margin > BOUND:
        return f"top-1 {int(logits.argmax())} vs the reference's {int(ids[0])} at a reference margin {margin:.3g}"
    return None


def other_side(choices: Choices, row: int, layer: int, name: str) -> set[int] | None:
    """The choice `name` of `layer` at `row` with its boundary swapped: the last one kept replaced by the
    best one dropped (experts and entries by score, candidate blocks by block score). None if not made."""
    args, data = choices.args, choices.data
    kept = choices.chosen(layer, name, row)
    if not kept:
        return None
    if name == "experts":
        order = data[(layer, "expert_scores")][row].argsort(descending=True).tolist()
        k = args.n_activated_experts
        return set(order[:k - 1] + [order[k]])
    scores = data[(layer, "index_scores")][row].float()
    if name == "candidates":
        scores, kept = _block_scores(args, scores), {e // args.candidate_block_size for e in kept}
    worst = min((e for e in kept if scores[e] < torch.inf), key=lambda e: float(scores[e]), default=None)
    dropped = scores.clone()
    dropped[sorted(kept)] = -torch.inf
    if worst is None or not bool((dropped > -torch.inf).any()):
        return None
    return (kept - {worst}) | {int(dropped.argmax())}


def swapped(choices: Choices, row: int, layer: int, name: str, new: set[int]) -> Choices:
    """`choices` with that one choice replaced by `new` (for explain_choice to judge the swap)."""
    out = Choices(choices.args)
    out.data = dict(choices.data)
    t = choices.data[(layer, name)].clone()
    if name == "candidates":
        bs = choices.args.candidate_block_size
        t[row] = False
        for b in new:
            t[row, b * bs:(b + 1) * bs] = True
    else:
        t[row] = torch.tensor(sorted(new) + [-1] * (t.size(1) - len(new)), dtype=t.dtype)
    out.data[(layer, name)] = t
    return out


def forced_forward(model: Transformer, tokens, layer: int, name: str, row: int, new: set[int],
                   observe=None) -> torch.Tensor:
    """The reference forward with one discrete choice forced to `new` at `row` (everything else as it comes);
    `observe(layer, what, t)` sees every capture."""
    hooks = []
    if name == "experts":
        def gate_hook(gate, inputs, output):
            weights, ids = (t.clone() for t in output)
            x = inputs[0].flatten(0, -2)[row:row + 1]
            scores = F.softplus(F.linear(x.float(), gate.weight.float()) / gate.temp).sqrt()[0]
            chosen = torch.tensor(sorted(new, key=lambda e: -float(scores[e] + gate.bias[e])))
            w = scores[chosen]
            if gate.norm_topk_prob and len(chosen) > 1:
                w = w / (w.sum() + 1e-20)
            weights[row], ids[row] = w * gate.route_scale, chosen
            return weights, ids
        hooks.append(model.layers[layer].ffn.gate.register_forward_hook(gate_hook))

    def capture(at: int, what: str, t: torch.Tensor) -> None:  # the model uses t after this call
        if observe is not None:
            observe(at, what, t)
        if at == layer and what == name:
            r = t.view(-1, t.size(-1))[row]
            if name == "topk":
                r.copy_(torch.tensor(sorted(new) + [-1] * (r.numel() - len(new))))
            else:
                bs = model.args.candidate_block_size
                r.zero_()
                for b in new:
                    r[b * bs:(b + 1) * bs] = True
    try:
        return ReferenceModel(model).forward(tokens, capture=capture)
    finally:
        for h in hooks:
            h.remove()


@dataclass
class GoldenComparison:
    """The reference model on this platform against the golden prefill of one prompt, in causal order."""
    compared: int = 0                      # positions within the rules before the first break
    near_tie: str | None = None            # the confirmed near tie at the first break (then downstream)
    known: str | None = None               # an unexplained break accepted as the capability's known difference
    failures: list[str] = field(default_factory=list)
    logit_ties: list[str] = field(default_factory=list)  # top-1 swaps at margins within the bound (README)
    lse_max: float = 0.0

    def __str__(self) -> str:
        end = self.near_tie or self.known or "no break"
        return (f"{self.compared} positions within the rules, then {end}; lse within {self.lse_max:.3g} at every "
                f"position; top-1 swaps at near ties: {', '.join(self.logit_ties) or 'none'}")


def confirmed_near_tie(model, tokens, choices: Choices, row: int, ids, vals) -> tuple[str | None, list[str]]:
    """A choice of this run at `row` within the noise whose other side, forced, brings the row within the
    rules: (its description, or None; what was tried)."""
    candidates = [(tie.gap, layer, name, new, tie)
                  for layer, name, new, tie in near_ties(choices, row, model.args.n_layers)]
    tried = []
    for _, layer, name, new, tie in sorted(candidates, key=lambda c: (c[0], c[1]))[:MAX_FORCED]:
        logits = forced_forward(model, tokens, layer, name, row, new)[row]
        why = rule_break(logits, ids, vals)
        diff = float((logits[ids] - vals).abs().max())
        if why is None:
            kept = choices.chosen(layer, name, row)
            if name == "candidates":
                kept = {e // model.args.candidate_block_size for e in kept}
            return (f"{tie.choice} of layer {tie.layer} at a near tie ({sorted(kept - new)} vs {sorted(new - kept)}, "
                    f"gap {tie.gap:.3g}), confirmed: with the other side forced, position {row} is within the rules "
                    f"({diff:.3g})"), tried
        tried.append(f"{tie.choice} of layer {tie.layer} (gap {tie.gap:.3g}) gives {diff:.3g}")
    return None, tried


def near_ties(choices: Choices, row: int, layers: int):
    """(layer, name, other side, NearTie) of each choice at `row` in the first `layers` layers within the noise."""
    for layer in range(layers):
        for name in ("experts", "topk", "candidates"):
            new = other_side(choices, row, layer, name) if (layer, name) in choices.data else None
            tie = new and explain_choice(choices, row, swapped(choices, row, layer, name, new), row, layer, name)
            if isinstance(tie, NearTie):
                yield layer, name, new, tie


def rms_differences(model, got: torch.Tensor, golden: torch.Tensor, choices: Choices, what: str, rtol: float = 1e-2):
    """Per-layer RMS [layers, positions] of `what` ("attn_out", or "stream": what a block passes on) beyond
    `rtol` of the official one, split into those a confirmed near tie explains (a choice of this run within the
    noise at that position, in that layer or an earlier one, whose other side, forced, brings it within `rtol`),
    and the rest."""
    explained, unexplained = [], []
    for layer, pos in ((got - golden).abs() > rtol * golden.abs()).nonzero().tolist():
        where = f"layer {layer} position {pos} ({float(got[layer, pos] / golden[layer, pos] - 1):+.3%})"
        tie = next((tie for at, name, new, tie in near_ties(choices, pos, layer + 1)
                    if abs(forced_rms(model, what, layer, pos, at, name, new) / float(golden[layer, pos]) - 1) <= rtol),
                   None)
        if tie is None:
            unexplained.append(where)
        else:
            explained.append(f"{where}: {tie}, confirmed by forcing its other side")
    return explained, unexplained


def forced_rms(model, what: str, layer: int, pos: int, at: int, name: str, new: set[int]) -> float:
    """The RMS of `what` at (layer, pos) in the forward with one choice forced (forced_forward)."""
    key, seen = (layer, "block" if what == "stream" else what), {}
    forced_forward(model, PROMPTS["A"], at, name, pos, new,
                   lambda i, w, t: seen.setdefault("t", t[0, pos].clone()) if (i, w) == key else None)
    return float(seen["t"].float().square().mean().sqrt())


_CACHE: dict = {}  # (what, prompt, id of the model) -> result: the module's models live as long as it


def reference_run(model: Transformer, name: str):
    """The reference forward of a golden prompt with its choices and per-layer attention RMS (cached)."""
    key = ("run", name, id(model))
    if key not in _CACHE:
        choices, attn = Choices(model.args), {}
        hooks = choices.hooks(model)

        def capture(layer, what, t):
            choices.capture(layer, what, t)
            if what == "attn_out":
                attn[layer] = t[0].float().square().mean(-1).sqrt()
        try:
            logits = ReferenceModel(model).forward(PROMPTS[name], capture=capture)
        finally:
            for h in hooks:
                h.remove()
        _CACHE[key] = logits, choices, attn
    return _CACHE[key]


def golden_comparison(model: Transformer, name: str) -> GoldenComparison:
    """This platform's reference prefill of a golden prompt against the golden one (cached)."""
    key = ("golden", name, id(model))
    if key not in _CACHE:
        _CACHE[key] = compare_with_golden(model, name)
    return _CACHE[key]


def compare_with_golden(model: Transformer, name: str) -> GoldenComparison:
    logits, choices, _ = reference_run(model, name)
    ids, vals = GOLDEN[f"{name}.prefill.topk_ids"].long(), GOLDEN[f"{name}.prefill.topk_vals"]
    result = GoldenComparison()
    lse = (torch.logsumexp(logits, -1) - GOLDEN[f"{name}.prefill.lse"]).abs()
    result.lse_max = float(lse.max())
    if result.lse_max > TOL_BF16:
        result.failures.append(f"lse differs by {result.lse_max:.4g} > {TOL_BF16} at position {int(lse.argmax())}")
    for i in range(logits.size(0)):
        why = rule_break(logits[i], ids[i], vals[i])
        if why is None:
            if int(logits[i].argmax()) != int(ids[i, 0]):
                result.logit_ties.append(f"{i} (margin {float(vals[i, 0] - vals[i, 1]):.2g})")
            result.compared += 1
            continue
        tie, tried = confirmed_near_tie(model, PROMPTS[name], choices, i, ids[i], vals[i])
        if tie is not None:
            result.near_tie = f"position {i} ({why}): {tie}"
        elif KNOWN_DIFFERENCE is not None:
            result.known = (f"position {i}: {why}, which no discrete choice explains (tried: "
                            f"{'; '.join(tried) or 'none'}): on {KNOWN_DIFFERENCE['capability']} the project is known "
                            "not to reproduce the official code (golden-digests.json), so it is reported, not failed")
        else:
            result.failures.append(f"position {i}: {why}, and no discrete choice within the noise at position {i} "
                                   f"explains it (tried: {'; '.join(tried) or 'none'})")
        break
    return result


# ---- the tests ---------------------------------------------------------------------------------------------
def test_weights_reproduce_the_golden_digests(official_ties, record_property):
    rows = [line.split("\t") for line in (DATA / "tiny-68m-seed0.weights.tsv").read_text().splitlines()]
    _, all_digest = weights_digest(official_ties.state_dict().items())
    say(record_property, f"weights: ALL {all_digest[:12]}..., drawn by {official_ties.drawn}")
    assert all_digest == rows[-1][1] == "bd3c96bfd05260ac05e2ec607aa35a3b5a9da4fd8eeb7e1f6216742379988ab2"


@pytest.mark.parametrize("name", ["A", "B"])
def test_reference_prefill_is_bitwise_the_official_code(official_ties, name, record_property):
    """Bitwise where an official digest applies; against the golden outputs bitwise on their own platform, and
    elsewhere within the tolerance rules up to the first near tie (the module docstring), lse everywhere,
    per-layer RMS (A) at the positions compared."""
    if OFFICIAL is not None:
        capture = {}
        logits = ReferenceModel(official_ties).forward(
            PROMPTS[name], capture=lambda layer, what, t: capture.__setitem__((layer, what), t[0].float()))
        digest = hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()
        say(record_property, f"prefill {name}: sha256 {digest[:12]}...")
        assert digest == OFFICIAL[name], f"{MODE}: the full-logit digest of {name} differs"
    if not OUTPUTS_APPLY:
        result = golden_comparison(official_ties, name)
        say(record_property, f"prefill {name}: {result}")
        assert not result.failures, f"{MODE}: {result.failures}"
        if name == "A":
            _, choices, attn = reference_run(official_ties, "A")
            n = result.compared
            stream = torch.stack([choices.data[(i, "block")][:n].square().mean(-1).sqrt() for i in range(12)])
            attn = torch.stack([attn[i][:n] for i in range(12)])
            for what, got in (("stream", stream), ("attn_out", attn)):
                explained, unexplained = rms_differences(official_ties, got, GOLDEN[f"A.layers.{what}_rms"][:, :n],
                                                         choices, what)
                say(record_property, f"A {what} RMS beyond 1% of the official one: {explained or 'none'}")
                if unexplained and KNOWN_DIFFERENCE is not None:  # as prefill's logits there: reported, not failed
                    say(record_property, f"A {what} RMS beyond 1% with no confirmed near tie, on "
                                         f"{KNOWN_DIFFERENCE['capability']} a known difference: {unexplained}")
                else:
                    assert not unexplained, (f"{MODE}: {what} RMS beyond 1% that no confirmed near tie explains: "
                                             f"{unexplained}")
        return
    assert torch.equal(logits[-1], GOLDEN[f"{name}.prefill.last"])
    if name == "A":  # per-layer RMS, the localisation aid: exact too on the same computation
        stream = torch.stack([capture[(i, "block")].flatten(-2).square().mean(-1).sqrt() for i in range(12)])
        attn = torch.stack([capture[(i, "attn_out")].square().mean(-1).sqrt() for i in range(12)])
        torch.testing.assert_close(stream, GOLDEN["A.layers.stream_rms"], rtol=1e-2, atol=0)
        torch.testing.assert_close(attn, GOLDEN["A.layers.attn_out_rms"], rtol=1e-2, atol=0)


@pytest.mark.parametrize("name", ["A", "B"])
def test_project_tie_rule_differs_only_at_named_exact_ties(official_ties, project_ties, name, record_property):
    runs = []
    for model in (official_ties, project_ties):
        choices = Choices(model.args)
        hooks = choices.hooks(model)
        logits = ReferenceModel(model).forward(PROMPTS[name], capture=choices.capture)
        for h in hooks:
            h.remove()
        runs.append((logits, choices))
    (ref_logits, ref_choices), (got_logits, got_choices) = runs
    result = compare_rows(ref_logits, got_logits, TOL_BF16, lambda i: explain(ref_choices, i, got_choices, i))
    assert result.ok, result.failures
    # the golden prompts do hit ties once the top-k binds (spec §2.7: 8-17% of such rows)
    assert result.near_tie is not None and result.near_tie.gap == 0.0, result.near_tie
    golden_ids, golden_vals = GOLDEN[f"{name}.prefill.topk_ids"].long(), GOLDEN[f"{name}.prefill.topk_vals"]
    if OUTPUTS_APPLY:
        say(record_property, f"tie rule {name}: {result.compared} positions, then {result.near_tie}; golden top-1 "
                             "bit for bit")
        top1 = golden_ids[: result.compared, 0]
        assert torch.equal(got_logits[: result.compared].argmax(-1), top1), MODE
        return
    # against the golden only up to the first near tie between this platform and the official one
    n = min(result.compared, golden_comparison(official_ties, name).compared)
    margin = golden_vals[:n, 0] - golden_vals[:n, 1]
    differs = (got_logits[:n].argmax(-1) != golden_ids[:n, 0]).nonzero().flatten().tolist()
    say(record_property, f"tie rule {name}: {result.compared} positions, then {result.near_tie}; golden top-1 at "
                         f"{n} positions, swaps at near ties {differs}")
    assert all(float(margin[i]) <= BOUND for i in differs), f"{MODE}: top-1 differs at positions {differs}"


def test_paged_decode_of_A_matches_the_official_decode(official_ties, record_property):
    """Teacher-forced: prefill A, then feed the official tokens one at a time (golden README, Decode). Where
    an official digest applies, every step within the tolerance of the official decode. Elsewhere the
    decode rows are downstream of the prefill's first near tie with the official run (they attend to every
    position of A), so they are compared with the reference model on this platform instead (compare_rows:
    within the tolerance up to the first discrete choice that differs at a near tie, a clear gap or an
    unexplained difference fails), and with the golden rows only if the prefill had no near tie."""
    tokens = GOLDEN["A.decode.tokens"].long()
    ids, vals = GOLDEN["A.decode.topk_ids"].long(), GOLDEN["A.decode.topk_vals"]
    model = PagedModel(official_ties, num_blocks=4, num_slots=1)
    table, slot = torch.tensor([[0, 1, 2, 3]]), torch.tensor([0])
    prompt = torch.tensor(PROMPTS["A"])[None]
    steps = [(ForwardBatch(prompt, torch.tensor([0]), torch.tensor([300]), table, slot, 300, False), 299)]
    for i in range(19):
        pos = 300 + i
        steps.append((ForwardBatch(tokens[i].view(1, 1), torch.tensor([pos]), torch.tensor([1]), table, slot,
                                   pos + 1, True), 0))
    rows, choices = [], []
    for batch, _ in steps:
        c = Choices(official_ties.args)
        hooks = c.hooks(official_ties) if not OUTPUTS_APPLY else []
        rows.append(model.forward(batch, capture=c.capture if not OUTPUTS_APPLY else None))
        for h in hooks:
            h.remove()
        choices.append(c)
    logits = torch.cat(rows)
    diff = (logits.gather(1, ids) - vals).abs().max().item()
    if OUTPUTS_APPLY:
        say(record_property, f"decode of A: max diff {diff:.3g} at the official top-8 ids over 20 steps")
        assert diff <= TOL_BF16, (MODE, diff)
        assert torch.equal(logits.argmax(-1), tokens), MODE
        return
    # this platform's reference over the same tokens, step by step (row 0: the prefill's last position),
    # computed only as far as the comparison goes
    ref_rows, quads = [], []
    while True:
        k = len(ref_rows)
        c = Choices(official_ties.args)
        hooks = c.hooks(official_ties)
        seq = PROMPTS["A"] + tokens[:k].tolist()
        ref_rows.append(ReferenceModel(official_ties).forward(seq, capture=c.capture)[-1])
        for h in hooks:
            h.remove()
        quads.append((c, 299 + k, choices[k], steps[k][1]))
        local = compare_rows(torch.stack(ref_rows), logits[:k + 1], TOL_BF16, lambda i: explain(*quads[i]),
                             lambda i: first_rounding_flip(quads[:i + 1]))
        if local.near_tie is not None or not local.ok or k == 19:
            break
    prefill = golden_comparison(official_ties, "A")
    if prefill.compared < 300:
        against_golden = f"golden decode rows downstream of the prefill's {prefill.near_tie or prefill.known}"
    else:
        against_golden = f"golden decode rows within {diff:.3g}"
    say(record_property, f"decode of A against this platform's reference: {local.compared} of 20 steps within "
                         f"{local.max_diff:.3g}, then {local.near_tie}; {against_golden}")
    assert local.ok, f"{MODE}: {local.failures}"
    assert not prefill.failures, f"{MODE}: {prefill.failures}"
    if prefill.compared == 300:
        assert diff <= TOL_BF16, (MODE, diff)
