"""Issue #20 item 3: the FP8 dense GEMM and the FP4 grouped MoE kernels against the paths they replace, at the
v41-slice's widths (synthetic weights: random codes and scales of the released storage, one layer's MoE).

- dense: FP8Linear on CUDA now (kernels/quant.py act_quant, kernels/fp8_gemm.py) against its torch path
  (model/quant.py act_quant, the weight dequantised to fp32 then bf16, F.linear), per slice linear shape.
- MoE: model/moe.py MoE.forward over 384 FP4 experts top 6 (dim 5120, inter 2304) and the FP8 shared expert:
  the grouped path (kernels/fp4_moe.py) eager and replayed from a CUDA graph, against the masked path
  (`MoE.grouped = False`: every expert's FP4Linear dequantising on every row; at decode batches only).
Each: 3 warm-up calls (compilation, the stacking of the experts), then the mean of `--iters` calls between
CUDA events. Bytes floor: the weight bytes a call must read (the selected experts' codes and scales, the
shared expert, the gate's fp32 copy) over 4.8 TB/s, the H200's HBM3e peak.

Usage: python benchmarks/bench_fp4.py [--batches 1,16,64] [--prefill 4096] [--iters 20] [--tiny] [--sweep]
                                      [--gate-sweep] [--chain] [--decode-rows [--ids FILE]]
(`--tiny`: micro widths on the CPU, to check the script; not a measurement.)
"""
from __future__ import annotations

import argparse
import time

import torch

from model.config import preset
from model.moe import MoE
from model.released import FP4Linear, FP8Linear

HBM = 4.8e12  # bytes/s, H200 peak


def timed(fn, iters: int, device: str, warmup: int = 3) -> float:
    """Mean seconds per call after `warmup` calls."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def graphed(fn):
    """fn captured once in a CUDA graph (after fn's warm-up); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def random_fp8(lin: FP8Linear, gen, scale_byte: int) -> None:
    """Codes 0..0x7e with a random sign (no NaN code), one e8m0 byte for every scale."""
    codes = torch.randint(0, 0x7f, lin.weight.shape, generator=gen, device=gen.device, dtype=torch.uint8)
    codes |= torch.randint(0, 2, lin.weight.shape, generator=gen, device=gen.device, dtype=torch.uint8) << 7
    lin.weight.data = codes.view(torch.float8_e4m3fn)
    lin.scale.data = torch.full(lin.scale.shape, scale_byte, dtype=torch.uint8, device=gen.device).view(lin.scale.dtype)


def synthetic_moe(args, device: str, gen) -> MoE:
    """One MoE of `args` in the released storage: FP4 routed experts, FP8 shared expert, random codes."""
    with torch.device("meta"):
        moe = MoE(args)
        for e in [*moe.experts, moe.shared_experts]:
            cls = FP4Linear if e is not moe.shared_experts else FP8Linear
            for name in ("w1", "w2", "w3"):
                out_features, in_features = getattr(e, name).weight.shape
                setattr(e, name, cls(in_features, out_features))
    moe.to_empty(device=device)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=gen, device=device) * 0.02)
        moe.gate.bias.zero_()
        for e in moe.experts:
            for lin in (e.w1, e.w2, e.w3):
                lin.weight.data = torch.randint(0, 256, lin.weight.shape, generator=gen, device=device,
                                                dtype=torch.uint8).view(lin.weight.dtype)
                lin.scale.data = torch.full(lin.scale.shape, 118, dtype=torch.uint8, device=device).view(
                    lin.scale.dtype)  # 2^-9: values up to 6·2^-9
        for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            random_fp8(lin, gen, 115)  # 2^-12: values up to 448·2^-12
    return moe


def moe_bytes(moe: MoE, ids: torch.Tensor) -> int:
    """Weight bytes one forward must read: the selected experts' FP4 codes and scales, the shared expert's
    FP8 codes and scales, the gate's fp32 weight."""
    per_expert = sum(p.numel() * p.element_size() for p in moe.experts[0].parameters())
    shared = sum(p.numel() * p.element_size() for p in moe.shared_experts.parameters())
    return torch.unique(ids).numel() * per_expert + shared + moe.gate.weight.numel() * 4


def bench_moe(moe: MoE, batches: list[int], prefill: int, iters: int, device: str, gen, masked_max: int) -> None:
    print("| MoE rows | path | ms/call | weight bytes read | bytes floor ms | floor/measured |")
    print("|---|---|---|---|---|---|")
    for n in [*batches, *([prefill] if prefill else [])]:
        x = (torch.randn(n, moe.gate.weight.size(1), generator=gen, device=device) * 0.5).bfloat16()
        with torch.inference_mode():
            _, ids = moe.gate(x)
            floor = moe_bytes(moe, ids) / HBM
            rows = [("grouped FP4 kernels, eager", lambda: moe(x))]
            if device == "cuda" and n <= max(batches):
                rows.append(("grouped FP4 kernels, CUDA graph", graphed(lambda: moe(x))))
            for name, fn in rows:
                s = timed(fn, iters, device)
                print(f"| {n} | {name} | {s * 1e3:.3f} | {moe_bytes(moe, ids) / 1e6:.1f} MB | {floor * 1e3:.3f} | "
                      f"{floor / s:.1%} |", flush=True)
            if n <= masked_max:
                MoE.grouped = False
                try:
                    s = timed(lambda: moe(x), 2, device, warmup=1)
                finally:
                    MoE.grouped = True
                print(f"| {n} | masked (before: every expert dequantised, on every row), eager | {s * 1e3:.1f} | "
                      f"- | {floor * 1e3:.3f} | {floor / s:.2%} |", flush=True)


def dense_shapes(args) -> list[tuple[int, int]]:
    """The slice's FP8 linears (out x in): wq_a, wq_b, wkv, wo_b, the shared expert's w1 (and w3) and w2, and
    Engram's wkv."""
    d, inter = args.dim, args.moe_inter_dim
    return [(1280, d), (args.n_heads * args.head_dim, 1280), (512, d), (d, 8192), (inter, d), (d, inter),
            (d * (args.hc_mult + 1), args.n_hash_cols * args.engram_head_dim)]


def bench_dense(shapes, batches: list[int], iters: int, device: str, gen) -> None:
    import kernels.fp8_gemm as k

    print("| FP8 linear (out x in) | rows | new ms (graph) | before ms (graph) | speed-up | bytes floor ms "
          "| floor/new |")
    print("|---|---|---|---|---|---|---|")
    for N, K in shapes:
        with torch.device("meta"):
            lin = FP8Linear(K, N)
        lin.to_empty(device=device)
        random_fp8(lin, gen, 118)
        floor = (N * K + lin.scale.numel()) / HBM
        for m in batches:
            x = torch.randn(m, K, generator=gen, device=device).bfloat16()
            with torch.inference_mode():
                run = graphed(lambda: lin(x)) if device == "cuda" else lambda: lin(x)
                new = timed(run, iters, device)
                applies, k.applies = k.applies, lambda x: False
                try:
                    run = graphed(lambda: lin(x)) if device == "cuda" else lambda: lin(x)
                    before = timed(run, max(2, iters // 4), device, warmup=1)
                finally:
                    k.applies = applies
            print(f"| {N} x {K} | {m} | {new * 1e3:.4f} | {before * 1e3:.4f} | {before / new:.1f}x | "
                  f"{floor * 1e3:.4f} | {floor / new:.1%} |", flush=True)


# (BN, U, warps, stages, B) at decode, (BM, BN, U, warps, stages, B) at prefill: B=0 the e4m3 decode
# (kernels/fp4_moe.py config); the e4m3 decode's former best first
MOE_SWEEP = {"decode": [dict(BM=16, BN=bn, U=u, B=bits, num_warps=w, num_stages=st)
                        for bn, u, w, st, bits in
                        [(64, 4, 4, 3, 0), (64, 4, 4, 3, 1), (128, 4, 4, 3, 1), (32, 4, 4, 3, 1),
                         (64, 4, 4, 4, 1), (128, 4, 8, 3, 1), (64, 2, 4, 3, 1), (256, 4, 8, 3, 1)]]
                       # K in the dot's slot order (KS=1: a thread's code bytes one word) at the best tiles; U = 2:
                       # an iteration's codes one load (kernels/fp4_moe.py `_code_groups`, U of 1, 2 or 4)
                       + [dict(BM=16, BN=bn, U=u, KS=1, num_warps=w, num_stages=st)
                          for bn, u, w, st in [(128, 2, 8, 3), (128, 4, 8, 3), (64, 2, 4, 3), (128, 2, 8, 4),
                                               (64, 4, 4, 3), (128, 4, 4, 3),
                                               # 256 weight rows a program: x's rows, re-read from L2 by every
                                               # block of outputs (half the weight's bytes again at 128), halved
                                               (256, 2, 8, 3), (256, 2, 8, 4), (256, 2, 16, 3),
                                               # one warpgroup at U = 4 (config's decode tile) by its stages
                                               (128, 4, 4, 2), (128, 4, 4, 4)]],
             "prefill": [dict(BM=bm, BN=bn, U=u, B=bits, num_warps=w, num_stages=st)
                         for bm, bn, u, w, st, bits in
                         [(128, 128, 2, 4, 3, 0), (128, 128, 2, 4, 3, 1), (64, 128, 2, 4, 3, 0), (64, 128, 2, 4, 3, 1),
                          (128, 128, 2, 8, 3, 1), (128, 256, 2, 8, 3, 1), (64, 256, 2, 8, 3, 1), (128, 128, 4, 8, 3, 1),
                          (64, 128, 4, 4, 3, 1), (128, 64, 2, 4, 3, 1), (128, 64, 4, 4, 3, 1), (64, 64, 2, 4, 3, 1)]]
                        + [dict(BM=64, BN=bn, U=2, KS=1, num_warps=4, num_stages=3) for bn in (128, 64)]}
# (BM, BN, BK, warps, swap): swap computes the product transposed, the decoded weight the dot's first operand
DENSE_SWEEP = {"decode": [(16, 64, 256, 4, False), (16, 64, 256, 4, True), (16, 128, 256, 4, True),
                          (16, 128, 128, 8, True), (32, 64, 256, 4, True), (64, 64, 256, 4, True),
                          (64, 64, 128, 4, True), (64, 128, 128, 4, True), (64, 128, 256, 8, True),
                          (64, 128, 128, 8, True), (64, 128, 64, 8, True)],
               "prefill": [(128, 128, 64, 8, False), (128, 256, 64, 8, False), (64, 128, 64, 4, False),
                           (128, 128, 128, 8, False)]}


# the gate's logits (rows, experts, d a step, warps, stages) at a decode step (d in parts of kernels/moe.py
# PART_D) and at a prefill chunk, by FMA chains (gate_tiles' former tiles first) and on the tensor cores
GATE_DECODE_SWEEP = {"FMA": [(16, 16, 256, 4, 3), (16, 32, 256, 4, 3), (32, 16, 256, 4, 3), (64, 16, 256, 4, 3),
                             (16, 16, 128, 4, 3), (16, 16, 512, 4, 3), (16, 16, 256, 2, 3), (16, 16, 256, 1, 3),
                             (32, 32, 128, 4, 3), (64, 32, 64, 4, 3), (16, 64, 128, 4, 3), (64, 64, 64, 8, 3),
                             (16, 16, 64, 1, 3), (32, 16, 128, 2, 3)],
                     "tensor cores": [(64, 32, 64, 4, 3), (64, 64, 64, 4, 3), (32, 32, 64, 4, 3), (64, 16, 64, 4, 3),
                                      (16, 32, 64, 4, 3), (64, 32, 128, 4, 3), (64, 32, 64, 8, 3), (64, 128, 64, 4, 3),
                                      (16, 16, 128, 4, 3), (32, 64, 64, 4, 3)]}
GATE_SWEEP = {"FMA": [(64, 128, 64, 4, 3), (64, 128, 32, 4, 3), (128, 128, 16, 8, 4), (64, 64, 32, 4, 3),
                      (32, 128, 32, 4, 3)],
              "tensor cores": [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                               (128, 128, 32, 8, 4), (64, 64, 64, 4, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3)]}


def gate_sweep(args, rows: int, iters: int, gen) -> None:
    """The gate (logits, softplus, route; kernels/moe.py `gate`) by tiles at `rows` rows: each one's time and
    whether it gives the first FMA tile's bits (each logit one chain of FMAs over d in order, whatever the tile),
    or else how many rows pick other experts."""
    from kernels.moe import gate

    E, D = args.n_routed_experts, args.dim
    x = torch.randn(rows, D, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(E, D, generator=gen, device="cuda") * D ** -0.5).bfloat16()
    bias, k = torch.randn(E, generator=gen, device="cuda") * 0.1, args.n_activated_experts
    print("| gate rows | logits | rows, experts, d, warps, stages | ms | TFLOP/s | bits |")
    print("|---|---|---|---|---|---|")
    base = None
    decode = rows <= 64  # decode rows: d in parts (kernels/moe.py PART_D), replayed from a graph
    for path, tiles_list in (GATE_DECODE_SWEEP if decode else GATE_SWEEP).items():
        for tiles in tiles_list:
            call = lambda: gate(x, weight, bias, 1.0, k, True, 1.5, tiles=tiles, tc=path != "FMA")  # noqa: E731
            try:
                out = call()
                s = timed(graphed(call) if decode else call, iters, "cuda")
            except Exception as e:  # a tile the compiler cannot fit: say so, go on
                print(f"| {rows} | {path} | {tiles} | failed: {type(e).__name__}: {str(e).splitlines()[0][:60]} |||")
                continue
            base = out if base is None else base
            other = (out[1].sort(-1).values != base[1].sort(-1).values).any(-1).sum().item()
            same = "same" if torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]) else \
                f"other bits; {other} rows other experts"
            print(f"| {rows} | {path} | {', '.join(map(str, tiles))} | {s * 1e3:.3f} | "
                  f"{2 * rows * E * D / s / 1e12:.1f} | {same} |", flush=True)


def routed_among(n: int, among: int, E: int, k: int, gen) -> torch.Tensor:
    """ids [n, k]: each row's k distinct experts drawn among the same `among` of E (all E: uniform routing)."""
    chosen = torch.randperm(E, generator=gen, device="cuda")[:among]
    return chosen[torch.rand(n, among, generator=gen, device="cuda").topk(k, dim=-1).indices]


def tile_spec(text: str) -> dict:
    """"BM,BN,U,WARPS" -> kernels/fp4_moe.py DECODE_TILE with those four set; ValueError unless four integers."""
    from kernels import fp4_moe

    return dict(fp4_moe.DECODE_TILE, **dict(zip(("BM", "BN", "U", "num_warps"), map(int, text.split(",")),
                                                strict=True)))


def sweep(args, batches: list[int], prefill: int, iters: int, gen) -> None:
    """Tile configurations of both kernels, each timed (CUDA graph at decode rows, eager at prefill)."""
    from kernels import fp4_moe, fp8_gemm

    E, D, inter, k = args.n_routed_experts, args.dim, args.moe_inter_dim, args.n_activated_experts
    rnd = lambda *shape, hi=256: torch.randint(0, hi, shape, generator=gen, device="cuda", dtype=torch.uint8)
    w13, w2 = rnd(E, 2 * inter, D // 2), rnd(E, D, inter // 2)
    s13 = torch.full((E, 2 * inter, D // 32), 118, dtype=torch.uint8, device="cuda")
    s2 = torch.full((E, D, inter // 32), 118, dtype=torch.uint8, device="cuda")
    print("| routed FP4 experts rows | routing | BM, BN, U, B, KS, warps, stages | ms | floor/measured | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    # uniform routing (a trained gate's aim), and every row's k among the same 32 experts (v41-slice's random
    # gate sends 64 rows to ~30 experts a layer: bench_slice.py's count)
    routings = {"uniform": E, "32 experts": 32}
    for n in [*batches, prefill]:
        x = torch.randn(n, D, generator=gen, device="cuda").bfloat16()
        w = torch.rand(n, k, generator=gen, device="cuda")
        for routing, among in routings.items():
            if routing != "uniform" and n > max(batches):
                continue
            ids = routed_among(n, among, E, k, gen)
            floor = torch.unique(ids).numel() * 3 * D * inter * (0.5 + 1 / 32) / HBM
            for cfg in MOE_SWEEP["decode" if n * k <= 4 * E else "prefill"]:
                fn = lambda: fp4_moe.routed_experts(x, w, ids, w13, s13, w2, s2, 10.0, cfg=cfg)
                s = timed(graphed(fn) if n <= max(batches) else fn, iters, "cuda")
                flops = 2 * 3 * D * inter * n * k  # w1, w3 and w2 for every (row, slot) pair
                shape = ", ".join(str(cfg.get(key, 0 if key == "KS" else 1))
                                  for key in ("BM", "BN", "U", "B", "KS", "num_warps", "num_stages"))
                print(f"| {n} | {routing} | {shape} | {s * 1e3:.3f} | {floor / s:.1%} | {flops / s / 1e12:.0f} |",
                      flush=True)
    print("| FP8 GEMM (out x in) | rows | BM, BN, BK, warps | ms (graph) | floor/measured |")
    print("|---|---|---|---|---|")
    for N, K in dense_shapes(args):
        codes = (rnd(N, K, hi=0x7f)).view(torch.float8_e4m3fn)
        scale = torch.full((N // 32, K // 32), 118, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
        for m in [*batches, prefill]:
            x = torch.randn(m, K, generator=gen, device="cuda").bfloat16()
            for cfg in DENSE_SWEEP["decode" if m <= 64 else "prefill"]:
                s = timed(graphed(lambda: fp8_gemm.fp8_gemm(x, codes, scale, cfg=cfg)), iters, "cuda")
                print(f"| {N} x {K} | {m} | {', '.join(map(str, cfg))} | {s * 1e3:.4f} | {N * K / HBM / s:.1%} |",
                      flush=True)


def chain(args, rows: int, iters: int, gen) -> None:
    """A decode step's FP8 linears in a row (act_quant, then the GEMM: FP8Linear on CUDA), the slice's seven
    a layer (wq_a, wq_b, wkv, wo_b, the shared expert's w1, w3, w2) over n_layers layers of their own weights,
    in one CUDA graph: by the split's programs (kernels/fp8_gemm.py TARGET_PROGRAMS, MAX_SPLIT), all of them,
    each shape's n_layers alone, and Engram's wkv (one a step, 157 MB)."""
    from kernels import fp8_gemm
    from kernels.quant import act_quant_fp8

    d, inter = args.dim, args.moe_inter_dim
    shapes = [(1280, d), (args.n_heads * args.head_dim, 1280), (512, d), (d, 8192), (inter, d), (inter, d), (d, inter)]
    layers = []
    for _ in range(args.n_layers):
        for N, K in shapes:
            codes = torch.randint(0, 0x7f, (N, K), generator=gen, device="cuda", dtype=torch.uint8)
            scale = torch.full((N // 32, K // 32), 118, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
            layers.append((torch.randn(rows, K, generator=gen, device="cuda").bfloat16(),
                           codes.view(torch.float8_e4m3fn), scale))
    groups = {"all": layers, **{f"{N} x {K}": layers[i::len(shapes)] for i, (N, K) in enumerate(shapes)}}
    engram = (args.dim * (args.hc_mult + 1), args.n_hash_cols * args.engram_head_dim)  # its wkv: one a step, 157 MB
    codes = torch.randint(0, 0x7f, engram, generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.full((engram[0] // 32, engram[1] // 32), 118, dtype=torch.uint8, device="cuda")
    x = torch.randn(rows, engram[1], generator=gen, device="cuda").bfloat16()
    groups[f"Engram wkv {engram[0]} x {engram[1]}"] = [(x, codes.view(torch.float8_e4m3fn),
                                                       scale.view(torch.float8_e8m0fnu))]
    print(f"| FP8 linears in a row ({rows} rows) | TARGET_PROGRAMS, MAX_SPLIT | launches | ms (graph) | us a linear "
          "| floor/measured |")
    print("|---|---|---|---|---|---|")
    kept = fp8_gemm.TARGET_PROGRAMS, fp8_gemm.MAX_SPLIT
    try:
        for name, group in groups.items():
            floor = sum(w.numel() for _, w, _ in group) / HBM
            for setting in [kept, (132, 16), (396, 16), (528, 16), (264, 8), (264, 32), kept]:
                fp8_gemm.TARGET_PROGRAMS, fp8_gemm.MAX_SPLIT = setting
                fn = lambda: [fp8_gemm.fp8_gemm(act_quant_fp8(x, 32), w, s) for x, w, s in group]
                s = timed(graphed(fn), iters, "cuda")
                print(f"| {name} | {', '.join(map(str, setting))} | {len(group)} | {s * 1e3:.3f} | "
                      f"{s * 1e6 / len(group):.1f} | {floor / s:.1%} |", flush=True)
    finally:  # the module's split as it was, whatever failed
        fp8_gemm.TARGET_PROGRAMS, fp8_gemm.MAX_SPLIT = kept


def decode_rows(args, batches: list[int], iters: int, gen, ids_file: str | None, tiles: str) -> None:
    """The routed experts at decode rows by the decode tile (`tiles`: "BM,BN,U,warps;..." over kernels/fp4_moe.py
    DECODE_TILE, the first the baseline): uniform routing, every row among the same 32 experts, and (`ids_file`,
    bench_slice.py --json) each layer's ids of the slice's counted decode step. Bits checked against the first
    tile (a pair's sums are the same dots in the same K order whatever the tile's other pairs and rows); two
    rounds each."""
    import json

    from kernels import fp4_moe

    E, D, inter, k = args.n_routed_experts, args.dim, args.moe_inter_dim, args.n_activated_experts
    rnd = lambda *shape: torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)  # noqa: E731
    w13, w2 = rnd(E, 2 * inter, D // 2), rnd(E, D, inter // 2)
    s13 = torch.randint(100, 128, (E, 2 * inter, D // 32), generator=gen, device="cuda", dtype=torch.uint8)
    s2 = torch.randint(100, 128, (E, D, inter // 32), generator=gen, device="cuda", dtype=torch.uint8)
    cfgs = [tile_spec(t) for t in tiles.split(";")]
    cases = []
    for n in batches:
        for routing, among in (("uniform", E), ("32 experts", 32)):
            cases.append((n, routing, routed_among(n, among, E, k, gen)))
    if ids_file:
        with open(ids_file) as f:
            runs = [r for r in json.load(f)["decode"] if "ids" in r]
        for r in runs:
            for layer, ids in enumerate(r["ids"]):
                cases.append((len(ids), f"slice B={r['batch']} ctx {r['context']} layer {layer}",
                              torch.tensor(ids, device="cuda")))
    names = [f"{c['BM']}, {c['BN']}, {c['U']}, {c['num_warps']}" for c in cfgs]
    print("| routed FP4 experts rows | routing | most rows an expert | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(cfgs))
    sums = [0.0] * len(cfgs)
    for n, routing, ids in cases:
        x = torch.randn(n, D, generator=gen, device="cuda").bfloat16()
        w = torch.rand(n, k, generator=gen, device="cuda")
        cells, base = [], None
        for c, cfg in enumerate(cfgs):
            fn = lambda: fp4_moe.routed_experts(x, w, ids, w13, s13, w2, s2, 10.0, cfg=cfg)  # noqa: E731
            out = fn()[0].clone()
            base = out if base is None else base
            ms = [timed(graphed(fn), iters, "cuda") * 1e3 for _ in range(2)]
            sums[c] += ms[1] if routing.startswith("slice") else 0.0
            same = "" if torch.equal(out, base) else f" ({(out != base).float().mean():.2%} differ)"
            cells.append(f"{ms[0]:.3f}, {ms[1]:.3f}{same}")
        print(f"| {n} | {routing} | {int(torch.bincount(ids.flatten()).max())} | " + " | ".join(cells) + " |",
              flush=True)
    if ids_file:
        print("| | the slice's layers, summed (second rounds) | | " + " | ".join(f"{t:.3f}" for t in sums) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--masked-max", type=int, default=64, help="largest row count the masked path is timed at")
    p.add_argument("--tiny", action="store_true", help="micro widths (CPU check of the script)")
    p.add_argument("--gate-sweep", action="store_true",
                   help="time the gate's tiles at --prefill rows (decode tiles at 64 or fewer), then stop")
    p.add_argument("--sweep", action="store_true",
                   help="time tile configurations of both kernels (the MoE's under uniform routing and, at decode "
                        "rows, with every row among the same 32 experts), then stop")
    p.add_argument("--chain", action="store_true",
                   help="time a decode step's FP8 linears in a row at the largest of --batches by the K split's "
                        "programs, then stop")
    p.add_argument("--decode-rows", action="store_true",
                   help="time the routed experts' decode tiles (--tiles) at --batches rows, then stop")
    p.add_argument("--tiles", default="16,128,4,4;32,128,4,4",
                   help="with --decode-rows: BM,BN,U,warps tiles separated by ';', the first the baseline")
    p.add_argument("--ids", default=None, help="with --decode-rows: bench_slice.py --json's file; its decode steps' "
                                                "routing per layer is timed too")
    a = p.parse_args()
    device = "cpu" if a.tiny else "cuda"
    args = preset("micro" if a.tiny else "v41-slice")
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [int(b) for b in a.batches.split(",")]
    if device == "cuda":
        print(f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"torch {torch.__version__}")
    if a.gate_sweep:
        return gate_sweep(args, a.prefill, a.iters, gen)
    if a.chain:
        return chain(args, max(batches), a.iters, gen)
    if a.sweep:
        return sweep(args, batches, a.prefill, a.iters, gen)
    if a.decode_rows:
        return decode_rows(args, batches, a.iters, gen, a.ids, a.tiles)
    shapes = dense_shapes(args)
    if a.tiny:
        shapes = [(64, 64)]
    bench_dense(shapes, [*batches, *([a.prefill] if a.prefill else [])], a.iters, device, gen)
    moe = synthetic_moe(args, device, gen)
    bench_moe(moe, batches, a.prefill, a.iters, device, gen, a.masked_max)


if __name__ == "__main__":
    main()
