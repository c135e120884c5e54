"""Issue #20 item 3: the sparse attention kernel (kernels/attention.py) at the v41-slice's widths, against its
bytes floor, by tile configuration.

The shapes of a slice layer: 64 heads of 512 sharing one KV row per index (spec §1.1), each query listing
the window (128) and the index top-k (512) entries: 640 indices. Decode is B rows of one query; prefill is
one row of S queries. The KV rows are drawn at random positions of a [B, N, 512] bf16 tensor (N = 4,096), so
every listed row is a gather, as from the paged pool. Each configuration: `--warmup` calls (the compile),
then the mean of `--iters` calls between CUDA events; its output compared bit for bit with the first
configuration's (one head block of all heads: the kernel before heads were split over programs).
Bytes floor: the listed rows (B·S·L·D·2, each query reads its own list) plus q and the output, over
4.8 TB/s; FLOP floor: 4·B·S·H·L·D over 989 TFLOP/s (bf16 dense).

With `--rope`, each configuration runs twice: q's RoPE (its last 64 dims) in the kernel's load of q (the
fused launches' form) and kernels/rope.py rotating q first (two launches, timed together); their outputs must
be the same bits.

Usage: python benchmarks/bench_attention.py [--decode 64] [--prefill 8192] [--sweep] [--rope] [--iters 20]
Prints a line per configuration; `--sweep` times every (BLOCK_H, num_warps, num_stages), otherwise the
kernel's own `config` (a chunk's, and at decode a decode step's) beside the one-block baseline.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from bench_fp4 import timed
from kernels.attention import config, paged_sparse_attn, sparse_attn
from kernels.rope import apply_rope

HBM, BF16_PEAK = 4.8e12, 989e12
H, D, L, N, R = 64, 512, 640, 4096, 64


def inputs(B: int, S: int, gen):
    q = torch.randn(B, S, H, D, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(H, device="cuda", generator=gen)
    idx = torch.randint(0, N, (B, S, L), device="cuda", generator=gen)
    return q, kv, sink, idx


def rope_forms(q, kv, sink, idx, cfg, gen) -> dict:
    """The two ways q gets its RoPE: {"at load": call, "rope first": call}, each returning the attention."""
    angles = torch.rand(q.size(0), q.size(1), R // 2, device="cuda", generator=gen) * 6.3
    freqs = torch.polar(torch.ones_like(angles), angles)  # complex [B, S, R/2]
    at_load = lambda: paged_sparse_attn(q, None, idx, kv, None, idx, sink, idx, D ** -0.5, cfg, freqs=freqs)

    def first():
        rotated = q.clone()
        apply_rope(rotated[..., -R:], freqs)
        return sparse_attn(rotated, kv, sink, idx, D ** -0.5, cfg)
    return {"at load": at_load, "rope first": first}


def run(name: str, B: int, S: int, cfgs: list[dict], iters: int, warmup: int, gen, rope: bool = False) -> None:
    q, kv, sink, idx = inputs(B, S, gen)
    floor_bytes = (B * S * L * D + 2 * B * S * H * D) * 2 / HBM
    floor_flops = 4 * B * S * H * L * D / BF16_PEAK
    print(f"{name}: B={B} S={S} H={H} D={D} L={L}; floor {max(floor_bytes, floor_flops) * 1e3:.3f} ms "
          f"(bytes {floor_bytes * 1e3:.3f}, FLOPs {floor_flops * 1e3:.3f})")
    base = None
    for cfg in cfgs:
        if rope:
            calls = rope_forms(q, kv, sink, idx, cfg, gen)
            outs = {form: call() for form, call in calls.items()}
            same = "same bits" if torch.equal(*outs.values()) else "OTHER BITS"
            times = {form: timed(call, iters, "cuda", warmup) * 1e3 for form, call in calls.items()}
            print(f"  {cfg}: " + ", ".join(f"{form} {ms:.3f} ms" for form, ms in times.items()) + f"; {same}")
            continue
        try:
            out = sparse_attn(q, kv, sink, idx, D ** -0.5, cfg)
            ms = timed(lambda: sparse_attn(q, kv, sink, idx, D ** -0.5, cfg), iters, "cuda", warmup) * 1e3
        except Exception as e:  # a configuration the compiler cannot fit (shared memory): say so, go on
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            continue
        base = out if base is None else base
        same = "same bits" if torch.equal(out, base) else f"{(out != base).float().mean().item():.3%} differ"
        print(f"  {cfg}: {ms:.3f} ms, {max(floor_bytes, floor_flops) * 1e3 / ms:.1%} of floor; {same}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--decode", type=int, default=64, help="decode rows (one query each)")
    p.add_argument("--prefill", type=int, default=8192, help="prefill queries of one row (0: none)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rope", action="store_true", help="q's RoPE at the kernel's load against rotated first")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs CUDA (the kernel's CPU path is the Triton interpreter).")
    gen = torch.Generator(device="cuda").manual_seed(0)
    baseline = dict(BLOCK_H=64, num_warps=4, num_stages=3)
    if a.sweep:
        cfgs = [baseline] + [dict(BLOCK_H=bh, num_warps=w, num_stages=st)
                             for bh, w, st in itertools.product((16, 32, 64), (4, 8), (2, 3))]
    else:
        cfgs = [baseline, config(H, D)]
    if a.decode:  # and the decode step's own tile (kernels/attention.py DECODE_WIDE)
        run("decode", a.decode, 1, cfgs if a.sweep else [*cfgs, config(H, D, decode=True)], a.iters, a.warmup, gen,
            a.rope)
    if a.prefill:
        run("prefill", 1, a.prefill, cfgs, max(2, a.iters // 4), a.warmup, gen, a.rope)


if __name__ == "__main__":
    main()
