"""The grouped MoE's SwiGLU between its two GEMMs (spec §5) as one Triton kernel: clamps, silu, the
routing weight, and the layout the second GEMM wants.

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
