"""The grouped MoE's SwiGLU as one Triton kernel (spec §5; mirrors `Expert.forward` of DeepSeek's inference/model.py).

Between its two GEMMs: clamps, silu, the routing weight, and the layout the second GEMM wants; and the
combine after the second GEMM.

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
    def _route_kernel(sp_ptr, bias_ptr, ids_ptr, w_ptr, E, route_scale, K: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        slot = tl.arange(0, BLOCK_K)
        scores = tl.sqrt_rn(tl.load(sp_ptr + n * E + e, mask=e < E, other=1.0))
        biased = tl.where(e < E, scores + tl.load(bias_ptr + e, mask=e < E, other=0.0), -float("inf"))
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        ws = tl.zeros((BLOCK_K,), dtype=tl.float32)
        total = 0.0
        for j in tl.static_range(K):  # the k largest biased scores in descending order, ties to the lower id
            top = tl.max(biased, axis=0)
            pick = tl.min(tl.where(biased == top, e, BLOCK_E), axis=0)
            w = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)  # one term: exact
            ids = tl.where(slot == j, pick.to(tl.int64), ids)
            ws = tl.where(slot == j, w, ws)
            total += w  # in order: for k = 2 one add, as torch's sum of a pair
            biased = tl.where(e == pick, -float("inf"), biased)
        if NORM:
            ws = tl.div_rn(ws, tl.zeros((BLOCK_K,), dtype=tl.float32) + (total + 1e-20))
        tl.store(ids_ptr + n * K + slot, ids, mask=slot < K)
        tl.store(w_ptr + n * K + slot, ws * route_scale, mask=slot < K)


def route(softplus: torch.Tensor, bias: torch.Tensor, k: int, norm: bool, route_scale: float):
    """The gate after its softplus (spec §5): scores = sqrt(softplus), the top k of scores + bias (the bias
    only selects), their scores normalised over the k (when `norm` and k > 1) and scaled. softplus fp32
    [N, E], bias fp32 [E] -> (weights fp32 [N, k], ids int64 [N, k] in descending biased score). One
    launch for model/moe.py's eight (sqrt, add, topk, gather, sum, add, div, mul); the same IEEE
    operations, the k weights summed in order (k = 2 adds one pair, so the same bits as torch's sum)."""
    N, E = softplus.shape
    ids = torch.empty(N, k, dtype=torch.long, device=softplus.device)
    w = torch.empty(N, k, dtype=torch.float32, device=softplus.device)
    if N:
        _route_kernel[(N,)](softplus.contiguous(), bias.contiguous(), ids, w, E, float(route_scale), K=k,
                            NORM=bool(norm and k > 1), BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(k))
    return w, ids


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
