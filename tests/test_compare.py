"""The comparison rules of tracing/compare.py (ARCHITECTURE.md §6): a discrete choice that flips is a near
tie only when its deciding scores, measured over the entries actually ranked, were within the noise."""
import torch

from model.config import preset
from tracing.compare import NOISE, Choices, NearTie, explain_choice


def candidate_run(args, index_scores: torch.Tensor, kept_blocks: set[int]) -> Choices:
    """A Choices holding one row of the candidate source layer: its index scores and the kept blocks."""
    c, bs = Choices(args), args.candidate_block_size
    layer = args.candidate_source_layer
    mask = torch.zeros(index_scores.numel(), dtype=torch.bool)
    for block in kept_blocks:
        mask[block * bs:(block + 1) * bs] = True
    c.data[(layer, "index_scores")] = index_scores[None]
    c.data[(layer, "candidates")] = mask[None]
    return c


def test_a_candidate_block_flip_at_a_near_tie_is_not_a_divergence():
    """The flip of issue #16 (seed 7, step 42, request 7, position 166): tiny-68m keeps 16 candidate blocks,
    the newest forced; block 0 (-0.000557) was the last kept, block 13 (-0.000610) the first dropped. Measured
    over the blocks ranked (the forced one among them), the gap is 0.0074 of the row's scale: a near tie. The
    old measure left the forced block out but still counted 16 kept: the gap between the 17th and 18th."""
    args = preset("tiny-68m")
    bs, k = args.candidate_block_size, args.candidate_topk_blocks
    others = [b for b in range(1, 20) if b != 13]             # blocks 1..19 but 13; block 20 is the newest
    block_max = dict(zip(others, torch.linspace(0.00716, -0.00030, 14).tolist() + [-0.0050, -0.0060, -0.0070,
                                                                                   -0.0071]))
    block_max |= {0: -0.000557, 13: -0.000610}
    scores = torch.full((21 * bs,), -torch.inf)
    for block, value in block_max.items():
        scores[block * bs:(block + 1) * bs] = value
    scores[20 * bs:20 * bs + 3] = -0.0001                      # the newest block, 3 entries visible: forced
    ranked = sorted(block_max, key=lambda b: -block_max[b])
    kept = set(ranked[:k - 1]) | {20}
    assert 0 in kept and 13 not in kept and len(kept) == k
    ref = candidate_run(args, scores, kept)
    got = candidate_run(args, scores, (kept - {0}) | {13})
    why = explain_choice(ref, 0, got, 0, args.candidate_source_layer, "candidates")
    assert isinstance(why, NearTie), why
    assert abs(why.gap - (0.000610 - 0.000557) / 0.00716) < 1e-4 and why.gap <= NOISE


def test_a_candidate_block_flip_by_a_clear_gap_is_a_divergence():
    args = preset("tiny-68m")
    bs, k = args.candidate_block_size, args.candidate_topk_blocks
    scores = torch.arange(20 * bs, dtype=torch.float32).flip(0) / (20 * bs)  # block b scores above block b+1
    ref = candidate_run(args, scores, set(range(k - 1)) | {19})              # the newest, block 19, forced
    got = candidate_run(args, scores, set(range(k - 2)) | {17, 19})          # block 14 dropped for block 17
    why = explain_choice(ref, 0, got, 0, args.candidate_source_layer, "candidates")
    assert isinstance(why, str) and "clear gap" in why, why
