"""Issue #20 item 3: the index top-k (kernels/indexer.py `topk_entries`) in one launch or in parts, side by side.

Rows of bf16 scores with ties (every 7th entry equal to the first) and -inf past a random V(p), k = 512 (the
slice's index_topk). Each shape: one launch (part = 0: the row held in registers up to RESIDENT_ENTRIES, else
read again for each of the 16 passes) against two (each part of `--parts` entries its own program's top k, then
the top k of the candidates), each the mean of `--iters` CUDA-graph replays after a warm-up, and whether the two
lists are equal (they must be: a set is a set).

Usage: python benchmarks/bench_topk.py [--shapes 64x16384,64x32788,64x65536,64x131072] [--parts 2048,4096,8192]
"""
from __future__ import annotations

import argparse

import torch

from bench_fp4 import graphed, timed
from kernels.indexer import TOPK_PART, topk_entries


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="64x16384,64x32788,64x65536,64x131072,1x32788,4096x16384",
                   help="queries x entries, comma-separated")
    p.add_argument("--parts", default=f"{TOPK_PART}", help="part lengths to time beside one launch (powers of two)")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk.py needs CUDA (the kernel's CPU path is the Triton interpreter).")
    gen = torch.Generator(device="cuda").manual_seed(0)
    parts = [int(x) for x in a.parts.split(",")]
    print(f"| queries x entries (k = {a.k}) | one launch, ms | " + " | ".join(f"parts of {x:,}, ms" for x in parts)
          + " | same list |")
    print("|---|---|" + "---|" * len(parts) + "---|")
    for shape in a.shapes.split(","):
        Q, E = map(int, shape.split("x"))
        scores = torch.randn(1, Q, E, device="cuda", generator=gen).bfloat16()
        scores[..., ::7] = scores[..., :1]
        visible = torch.randint(a.k, E + 1, (1, Q), device="cuda", generator=gen)
        scores = scores.masked_fill(torch.arange(E, device="cuda") >= visible.unsqueeze(-1), -torch.inf)
        want = topk_entries(scores, visible, a.k, part=0)
        times, same = [], True
        for part in [0] + parts:
            call = lambda: topk_entries(scores, visible, a.k, part=part)  # noqa: E731
            same &= torch.equal(call(), want)
            times.append(timed(graphed(call), a.iters, "cuda") * 1e3)
        print(f"| {Q} x {E:,} | " + " | ".join(f"{t:.4f}" for t in times) + f" | {'yes' if same else 'NO'} |",
              flush=True)


if __name__ == "__main__":
    main()
