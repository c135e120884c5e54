"""Issue #20 item 3: the hyper-connection handoff (kernels/hc.py `hc_handoff`) by launch form, at tiny-68m's and
the v41-slice's widths, for a decode step's rows and a prefill chunk's.

A handoff is the expand of one sublayer, the next one's mixes (a [24, hc·d] fp32 GEMM and its Sinkhorn), the
collapse and its RMSNorm, for every token (model/hc.py `handoff`). Forms: a token a program (`T=1`, tiny-68m's
form, each program reading all of fn, at a wide stream in parts of PART_K positions), or T tokens a program
sharing each block of fn, the mixes on the tensor cores (fn in three bf16 parts; at a wide stream a prefill
chunk's form in one launch, a decode step's a part of PART_K a program), by tiles. Each form:
`--warmup` calls, then the mean of `--iters` between CUDA events (graphs up to 64 rows); its values against the
first form's (max difference of pre, post and comb, and of the normed collapse). Bytes floor: h, y, the
stream, x and normed (bf16) once, over 4.8 TB/s.

Usage: python benchmarks/bench_handoff.py [--rows 64,8192] [--widths 128,5120] [--iters 20]
"""
from __future__ import annotations

import argparse

import torch

from bench_fp4 import graphed, timed
from kernels import hc as hc_kernel

HBM = 4.8e12
CHUNK_FORMS = [dict(T=1)] + [dict(T=t, BLOCK_K=bk, BLOCK_D=bd, num_warps=w)
                             for t, bk, bd, w in [(64, 64, 64, 8), (64, 32, 64, 4), (32, 64, 128, 4), (32, 32, 64, 4),
                                                  (128, 32, 64, 8), (16, 64, 128, 4), (64, 64, 128, 8),
                                                  (128, 64, 64, 8)]]
# below a chunk's rows at a wide stream the mixes' sums come in parts: a token a program, or T a part program
DECODE_FORMS = [dict(T=1, PART_K=2048)] + [dict(T=t, PART_K=pk, BLOCK_K=bk, num_warps=w) for t, pk, bk, w in
                                           [(16, 2048, 64, 4), (16, 512, 64, 4), (16, 256, 64, 4), (16, 128, 64, 4),
                                            (16, 256, 32, 4), (16, 256, 64, 2), (32, 256, 64, 4), (64, 256, 64, 8)]]


def forms(n: int, d: int) -> list[dict]:
    """The forms timed for n tokens of a stream 4·d wide (a narrow one: a token a program and two chunk forms)."""
    if 4 * d < hc_kernel.WIDE_STREAM:
        return CHUNK_FORMS[:3]
    return CHUNK_FORMS if n >= hc_kernel.CHUNK_ROWS else DECODE_FORMS


def inputs(n: int, d: int, gen):
    h = torch.randn(n, 4, d, device="cuda", generator=gen).bfloat16()
    y = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    post, comb = torch.rand(n, 4, device="cuda", generator=gen) * 2, torch.rand(n, 4, 4, device="cuda", generator=gen)
    fn = torch.randn(24, 4 * d, device="cuda", generator=gen) * 0.05
    scale, base = torch.randn(3, device="cuda", generator=gen), torch.randn(24, device="cuda", generator=gen)
    pre = torch.rand(n, 4, device="cuda", generator=gen)
    weight = (torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16()
    return y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20, weight, 1e-6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="64,8192")
    p.add_argument("--widths", default="128,5120", help="d (the stream is 4 copies of it)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_handoff.py needs CUDA (the kernels' CPU path is the Triton interpreter).")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for d in map(int, a.widths.split(",")):
        print(f"d={d} (stream {4 * d})")
        print("| d | rows | form | ms | floor/measured | mixes max diff | normed max diff |")
        print("|---|---|---|---|---|---|---|")
        for n in map(int, a.rows.split(",")):
            args = inputs(n, d, gen)
            floor = n * 4 * d * 2 * (1 + 1 / 4 + 1 + 1 / 4 + 1 / 4) / HBM
            base = None
            for cfg in forms(n, d):
                try:
                    out = hc_kernel.hc_handoff(*args, cfg=cfg)
                    fn = lambda: hc_kernel.hc_handoff(*args, cfg=cfg)  # noqa: E731
                    s = timed(graphed(fn) if n <= 64 else fn, a.iters, "cuda", a.warmup)
                except Exception as e:  # a form the compiler cannot fit: say so, go on
                    print(f"| {d} | {n} | {cfg} | failed: {type(e).__name__}: {str(e).splitlines()[0][:60]} |||")
                    continue
                base = out if base is None else base
                mixes = max((u - v).abs().max().item() for u, v in zip(out[1], base[1]))
                normed = (out[3].float() - base[3].float()).abs().max().item()
                mine = " (default)" if cfg == hc_kernel.handoff_config(args[1]) else ""
                print(f"| {d} | {n} | {cfg}{mine} | {s * 1e3:.4f} | {floor / s:.1%} | {mixes:.2g} | {normed:.2g} |",
                      flush=True)


if __name__ == "__main__":
    main()
