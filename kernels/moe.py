"""The grouped MoE's SwiGLU as one Triton kernel (spec §5; mirrors `Expert.forward` of DeepSeek's inference/model.py).

Between its two GEMMs: clamps, silu, the routing weight, and the layout the second GEMM wants; and the
combine after the second GEMM. Before them, the gate: `route` (after the softplus) and `gate` (all of it).

Mirrors the expert activation of DeepSeek's inference/model.py (`Expert.forward` between w1/w3 and w2).
model/moe.py's grouped path runs every expert and the shared one on every row; between its GEMMs the
torch ops (upcast, two clamps, silu, product, a routing table built by zeros + scatter + fill, the
weight, the downcast, the transpose for the batched GEMM) cost ~10 launches a layer. Here one program
takes one (row, expert) pair: it reads the pair's w1 and w3 outputs (bf16), computes in fp32
u = clamp(u, ±limit), g = min(g, limit), h = silu(g)·u, times the routing weight (the row's weight for
that expert, 0 if unselected, 1 for the shared expert), and writes gu's dtype into [E+1, N, inter].

Numerics: the same operations in the same order; silu as g / (1 + exp(-g)) with an IEEE division and the
exponential through fp64 (torch's expf may differ by an ulp), so the bf16 hidden can differ from the
torch path's by one ulp where the fp32 value sits at a rounding boundary.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/moe.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.attention import _mm
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _swiglu_route_kernel(gu_ptr, ids_ptr, weights_ptr, out_ptr, N, E, I, K, limit,
                             BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
        n, e = tl.program_id(0).to(tl.int64), tl.program_id(1)  # row, expert (E = the shared expert)
        i = tl.arange(0, BLOCK_I)
        base = gu_ptr + (n * (E + 1) + e) * 2 * I  # gu [N, E+1, 2, I]: w1 output, then w3 output
        g = tl.load(base + i, mask=i < I, other=0.0).to(tl.float32)
        u = tl.load(base + I + i, mask=i < I, other=0.0).to(tl.float32)
        if limit > 0:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        hidden = tl.div_rn(g, 1.0 + tl.exp((-g).to(tl.float64)).to(tl.float32)) * u  # silu(g)·u
        k = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + n * K + k, mask=k < K, other=-1)
        weights = tl.load(weights_ptr + n * K + k, mask=k < K, other=0.0)
        route = tl.sum(tl.where(ids == e, weights, 0.0), axis=0)  # at most one selected slot: exact
        route = tl.where(e == E, 1.0, route)
        tl.store(out_ptr + (e * N + n) * I + i, (route * hidden).to(out_ptr.dtype.element_ty), mask=i < I)


    @triton.jit
    def _combine_kernel(out_ptr, ids_ptr, y_ptr, N, E, D, K, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        k = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + n * K + k, mask=k < K, other=-1)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for e in range(0, E):  # ascending expert id: the selected ones, each once
            if tl.sum((ids == e).to(tl.int32), axis=0) > 0:
                acc += tl.load(out_ptr + (e * N + n) * D + d, mask=d < D, other=0.0).to(tl.float32)
        acc += tl.load(out_ptr + (E * N + n) * D + d, mask=d < D, other=0.0).to(tl.float32)  # the shared expert
        tl.store(y_ptr + n * D + d, acc.to(y_ptr.dtype.element_ty), mask=d < D)


    @triton.jit
    def _route_rows(sp, e, bias_ptr, E, K: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows of softplus values sp [ROWS, BLOCK_E] (lanes e >= E ignored) -> (ids int64 [ROWS, BLOCK_K],
        weights fp32 [ROWS, BLOCK_K]) before route_scale: model/moe.py's sqrt, biased top-k, gather and
        normalisation, the same IEEE operations in the same order."""
        slot = tl.arange(0, BLOCK_K)
        scores = tl.sqrt_rn(tl.where(e[None, :] < E, sp, 1.0))
        biased = tl.where(e[None, :] < E, scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :],
                          -float("inf"))
        ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int64)
        ws = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        total = tl.zeros((ROWS,), dtype=tl.float32)
        for j in tl.static_range(K):  # the k largest biased scores in descending order, ties to the lower id
            top = tl.max(biased, axis=1)
            pick = tl.min(tl.where(biased == top[:, None], e[None, :], BLOCK_E), axis=1)
            hit = e[None, :] == pick[:, None]
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # one term: exact
            ids = tl.where(slot[None, :] == j, pick[:, None].to(tl.int64), ids)
            ws = tl.where(slot[None, :] == j, w[:, None], ws)
            total += w  # in order: for k = 2 one add, as torch's sum of a pair
            biased = tl.where(hit, -float("inf"), biased)
        if NORM:
            ws = tl.div_rn(ws, tl.zeros_like(ws) + (total + 1e-20)[:, None])
        return ids, ws

    @triton.jit
    def _softplus(x):
        """F.softplus (beta 1, threshold 20) through fp64: log1p(exp(x)), where exp(x) < 1e-8 is its own
        log1p within an fp32 rounding; one rounding to fp32 (torch's expf and log1pf may differ by an ulp)."""
        ex = tl.exp(x.to(tl.float64))
        return tl.where(x > 20.0, x, tl.where(ex < 1e-8, ex, tl.log(1.0 + ex)).to(tl.float32))

    @triton.jit
    def _route_kernel(sp_ptr, bias_ptr, ids_ptr, w_ptr, N, E, temp, route_scale, K: tl.constexpr,
                      NORM: tl.constexpr, PARTS: tl.constexpr, TEMP: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """A row's route from its softplus values [N, E], or with PARTS > 0 from its logits in PARTS partial
        sums [PARTS, N, E] (`_gate_kernel` split over d): added in part order, / temp, softplus, then the route."""
        n = tl.program_id(0).to(tl.int64)
        e, slot = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
        if PARTS == 0:
            sp = tl.load(sp_ptr + n * E + e[None, :], mask=e[None, :] < E, other=1.0)  # [1, BLOCK_E]
        else:
            acc = tl.load(sp_ptr + n * E + e[None, :], mask=e[None, :] < E, other=0.0)
            for part in tl.static_range(1, PARTS):
                acc += tl.load(sp_ptr + (part * N + n) * E + e[None, :], mask=e[None, :] < E, other=0.0)
            if TEMP:
                acc = tl.div_rn(acc, temp)
            sp = tl.where(e[None, :] < E, _softplus(acc), 1.0)
        ids, ws = _route_rows(sp, e, bias_ptr, E, K, NORM, 1, BLOCK_E, BLOCK_K)
        tl.store(ids_ptr + n * K + slot[None, :], ids, mask=slot[None, :] < K)
        tl.store(w_ptr + n * K + slot[None, :], ws * route_scale, mask=slot[None, :] < K)

    @triton.jit
    def _gate_kernel(x_ptr, w_ptr, bias_ptr, sp_ptr, ids_ptr, wout_ptr, N, D, E, temp, route_scale, part_d,
                     TEMP: tl.constexpr, ROUTE: tl.constexpr, PARTS: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                     TC: tl.constexpr, BF16: tl.constexpr):
        """Program (rows block, experts block): logits = fp32(x)·Wᵀ by IEEE fp32 FMAs over d in order (each
        value's chain of adds is the same in any tile or batch), or with TC (bf16 x and W) on the tensor cores:
        each product exact in fp32, the sums in fp32 in the MMA's order (which depends on the tile); / temp,
        softplus; then, when one block holds every expert (ROUTE), the route of each row, else the softplus
        values for `route`. With PARTS, program (rows, experts, part) sums d over [part·part_d, (part+1)·part_d)
        only and stores that partial logit to sp_ptr [PARTS, N, E] for `_route_kernel` to finish."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        rows, experts = n[:, None] < N, e[None, :] < E
        acc = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
        lo, hi = 0, D
        if PARTS:
            lo = tl.program_id(2) * part_d
            hi = tl.minimum(lo + part_d, D)
        for start in range(lo, hi, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + n[:, None].to(tl.int64) * D + d[None, :], mask=rows & (d[None, :] < hi), other=0.0)
            w = tl.load(w_ptr + e[None, :].to(tl.int64) * D + d[:, None], mask=experts & (d[:, None] < hi), other=0.0)
            if TC:
                acc += _mm(x, w, BF16)
            else:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        if PARTS:
            tl.store(sp_ptr + (tl.program_id(2) * N + n[:, None]).to(tl.int64) * E + e[None, :], acc,
                     mask=rows & experts)
        else:
            if TEMP:
                acc = tl.div_rn(acc, temp)
            sp = _softplus(acc)
            if ROUTE:
                slot = tl.arange(0, BLOCK_K)
                ids, ws = _route_rows(sp, e, bias_ptr, E, K, NORM, BLOCK_N, BLOCK_E, BLOCK_K)
                out = n[:, None].to(tl.int64) * K + slot[None, :]
                tl.store(ids_ptr + out, ids, mask=rows & (slot[None, :] < K))
                tl.store(wout_ptr + out, ws * route_scale, mask=rows & (slot[None, :] < K))
            else:
                tl.store(sp_ptr + n[:, None].to(tl.int64) * E + e[None, :], sp, mask=rows & experts)


def route(softplus: torch.Tensor, bias: torch.Tensor, k: int, norm: bool, route_scale: float,
          temp: float = 1.0):
    """The gate after its softplus (spec §5): scores = sqrt(softplus), the top k of scores + bias (the bias
    only selects), their scores normalised over the k (when `norm` and k > 1) and scaled. softplus fp32
    [N, E], bias fp32 [E] -> (weights fp32 [N, k], ids int64 [N, k] in descending biased score). One
    launch for model/moe.py's eight (sqrt, add, topk, gather, sum, add, div, mul); the same IEEE
    operations, the k weights summed in order (k = 2 adds one pair, so the same bits as torch's sum).
    Given [P, N, E] instead, the P partial sums of each logit over d (`gate`'s parts): added in order,
    / temp, the softplus, then the same."""
    parts = softplus.size(0) if softplus.dim() == 3 else 0
    N, E = softplus.shape[-2:]
    ids = torch.empty(N, k, dtype=torch.long, device=softplus.device)
    w = torch.empty(N, k, dtype=torch.float32, device=softplus.device)
    if N:
        _route_kernel[(N,)](softplus.contiguous(), bias.contiguous(), ids, w, N, E, float(temp), float(route_scale),
                            K=k, NORM=bool(norm and k > 1), PARTS=parts, TEMP=temp != 1,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k))
    return w, ids


# Each logit is one chain of IEEE FMAs over d in order (or over each part of d, below) whatever the tile (tl.dot
# in "ieee" fp32 on the CUDA cores), so the tile may follow the batch without a row's bits following it
# (tests/gpu: a row alone and in a batch of 1,000 give the same bits; on an H200 every tile of the sweep in
# benchmarks/RESULTS.md gave the same bits).
# Outside the batch-invariant mode a bf16 weight's logits go on the tensor cores instead: from TC_ROWS rows (a
# prefill chunk; the FMA chains took 2.2 ms a layer at the slice's 8,192 x 384 x 5,120, 15 TFLOP/s, on an H200, the
# tensor cores 0.19 ms), and at any rows beyond ROUTE_EXPERTS experts (a decode step of the slice's 384: gate and
# route 0.091 -> 0.010 ms at 64 rows on an H100, bench_fp4.py --gate-sweep --prefill 64). Below TC_ROWS the tile
# and the parts of d are fixed by the shape, so a row's bits are the same alone or among up to TC_ROWS - 1 rows.
ROUTE_EXPERTS = 128  # up to this many experts a program holds them all and routes in the same launch
# Beyond ROUTE_EXPERTS below TC_ROWS rows, the logits run in parts of PART_D values of d, a program each, and the
# route's launch adds a logit's parts in order: a decode step's 64 rows of the slice's 384 experts by FMA
# chains were 96 programs (16 x 16 logits each, 105 us a layer on an H200, latency-bound) and are 960; on the
# tensor cores 12 tiles are 120 programs. The parts are fixed by d alone, never by the batch, so a row's bits stay
# its own (the batch-invariant mode's promise).
PART_D = 512
TC_ROWS = 4096  # above the H200 example trace's chunks (2,048 tokens): its gate bits are the FMA chain's


def use_tensor_cores(N: int, weight: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether the gate's logits of N rows go on the tensor cores: a bf16 weight outside the batch-invariant
    mode, from TC_ROWS rows or beyond ROUTE_EXPERTS experts."""
    wide = N >= TC_ROWS or weight.size(0) > ROUTE_EXPERTS
    return wide and weight.dtype == torch.bfloat16 and not batch_invariant


def gate_tiles(N: int, E: int, tc: bool = False) -> tuple[int, int, int, int, int]:
    """(rows, experts, d a step, warps, stages) a program of the gate's logits for N rows of E experts, on the
    tensor cores (`tc`) or by FMA chains, by the shape only: the fastest of H200 sweeps (benchmarks/RESULTS.md,
    bench_fp4.py --gate-sweep) at the slice's 384 x 5,120 and tiny-68m's 16 x 128 for 64, 256 and 8,192 rows.
    Few rows want many programs (16 experts each) and long steps of d; a prefill chunk of 8,192 rows wants the
    weight read few times (128 experts a program). Up to ROUTE_EXPERTS experts one program holds them all."""
    every = max(16, triton.next_power_of_2(E)) if E <= ROUTE_EXPERTS else None
    if tc and N < TC_ROWS and every is None:  # 64 decode rows of the slice's 384, d in parts: 0.010 ms (H100)
        return 64, 32, 64, 4, 3
    if tc:  # the slice at 8,192 rows: 0.19 ms (the FMA chains 2.2 ms), the best of 8 tiles
        return 64, every or 64, 64, 4, 3
    if N >= 8192:  # the slice: 4.97 -> 2.13 ms (8 warps, d in steps of 16 on 4 stages, the best of 12)
        return (64, every, 64, 4, 3) if every else (128, 128, 16, 8, 4)
    if N > 16 and every is None:  # 64 decode rows of the slice's 384 experts: 91 -> 50 us (H100, the best of 14)
        return (64, 16, 256, 4, 3) if N > 64 else (32, 32, 128, 4, 3)
    if N <= 64 and every is not None and every <= 32:  # tiny-68m's 64 decode rows of 16: 7.5 -> 3.7 us (H100)
        return 8, every, 128, 2, 1
    return 16, every or 16, 256, 4, 3


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, temp: float, k: int, norm: bool,
         route_scale: float, tiles: tuple[int, int, int, int, int] | None = None, batch_invariant: bool = False,
         tc: bool | None = None, part_d: int | None = None):
    """The whole gate (spec §5) from x [N, d] (bf16) and the weight [E, d] (bf16 or fp32, taken in fp32):
    logits in IEEE fp32 (on the tensor cores where `use_tensor_cores`, `tc` overriding it),
    / temp (skipped at 1), softplus, then `route`'s selection and weights -> (weights fp32 [N, k], ids int64
    [N, k]). One launch up to ROUTE_EXPERTS experts (tiny-68m: 16), else two (the softplus values, then
    `route`; the slice's 384), where torch takes five (the upcast, the GEMM and its split-K reduction, the
    softplus, the route). Within fp32 rounding of model/moe.py's torch lines (another order of the d sums,
    the softplus through fp64; on the tensor cores the sums in fp32 in the MMA's order), so a near tie in
    the top-k may pick the other expert. Beyond ROUTE_EXPERTS below TC_ROWS rows: d in parts of PART_D (`part_d`
    overrides it; 0: one part), each logit's parts added in order by `route`. `tiles` overrides `gate_tiles`
    (benchmarks)."""
    N, D = x.shape
    E = weight.size(0)
    ids = torch.empty(N, k, dtype=torch.long, device=x.device)
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    if not N:
        return w, ids
    one = E <= ROUTE_EXPERTS
    tc = use_tensor_cores(N, weight, batch_invariant) if tc is None else tc
    rows, block_e, depth, warps, stages = tiles or gate_tiles(N, E, tc)
    part_d = PART_D if part_d is None else part_d
    parts = triton.cdiv(D, part_d) if part_d and not one and (not tc or N < TC_ROWS) else 1
    parts = parts if parts > 1 else 0
    # one launch: sp_ptr unused; else the softplus values [N, E], or the logits' partial sums [parts, N, E]
    sp = w if one else torch.empty(max(parts, 1), N, E, dtype=torch.float32, device=x.device)
    _gate_kernel[(triton.cdiv(N, rows), triton.cdiv(E, block_e), max(parts, 1))](
        x.contiguous(), weight.contiguous(), bias.contiguous(), sp, ids, w, N, D, E, float(temp), float(route_scale),
        part_d or D, TEMP=temp != 1, ROUTE=one, PARTS=parts, K=k, NORM=bool(norm and k > 1), BLOCK_N=rows,
        BLOCK_E=block_e, BLOCK_D=depth, BLOCK_K=triton.next_power_of_2(k), TC=tc, BF16=x.is_cuda, num_warps=warps,
        num_stages=stages)
    if one:
        return w, ids
    return route(sp, bias, k, norm, route_scale, temp) if parts else route(sp[0], bias, k, norm, route_scale)


def combine(out: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [E+1, N, d] (every expert's w2 output, the shared one last), ids [N, k] -> [N, d] in `dtype`: each
    row's selected experts added in fp32 in ascending expert id, the shared expert last, rounded once. The
    same adds in the same order as model/moe.py's torch lines (zeros, a sort, a gather, k adds, one more
    add, the cast: 5 + k launches), so the same bits."""
    E1, N, D = out.shape
    y = torch.empty(N, D, dtype=dtype, device=out.device)
    if N:
        block = min(1024, triton.next_power_of_2(D))
        _combine_kernel[(N, triton.cdiv(D, block))](out.contiguous(), ids.contiguous(), y, N, E1 - 1, D, ids.size(1),
                                                    BLOCK_D=block, BLOCK_K=triton.next_power_of_2(ids.size(1)))
    return y


def swiglu_route(gu: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """gu bf16 [N, E+1, 2, inter] (w1 and w3 outputs of every expert, the shared one last), ids [N, k],
    weights fp32 [N, k] -> the weighted hidden [E+1, N, inter] for the batched w2 GEMM, in gu's dtype
    (bf16; fp32 in the fp32 debugging mode, where the torch path does not round either)."""
    N, E1, _, inter = gu.shape
    out = torch.empty(E1, N, inter, dtype=gu.dtype, device=gu.device)
    if N:
        _swiglu_route_kernel[(N, E1)](gu.contiguous(), ids.contiguous(), weights.contiguous(), out, N, E1 - 1, inter,
                                      ids.size(1), float(limit), BLOCK_I=triton.next_power_of_2(inter),
                                      BLOCK_K=triton.next_power_of_2(ids.size(1)))
    return out
