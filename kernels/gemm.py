"""A batch-invariant GEMM for the batch-invariant mode on CUDA (issue #11, model/invariant.py); DeepInfer has none.

C[b] = A[b] · B[b]ᵀ for A [batch, M, K] and B [batch, N, K] (B's rows are the outputs, as a weight's), with
fp32 accumulation and one rounding to A's dtype. One configuration for every shape (block sizes, warps,
stages; no autotuning, no split-K): a program computes one BLOCK_M x BLOCK_N tile of one matrix, walking K
in steps of BLOCK_K in order, so an output element's arithmetic is a function of its own row and column
alone, never of M, of the batch count or of where the row sits. That is what cuBLAS does not promise: it
picks its kernel (tile shape, split-K) by the shape, so a row's bits depend on how many rows share the call
(Thinking Machines' batch-invariant kernels fix the tiles in the same way).

fp32 inputs take IEEE fp32 products (no TF32), as torch's default `allow_tf32=False`. The torch path of the
mode (row tiles of fixed size through F.linear, model/invariant.py) serves CPU and `USE_KERNELS = False`.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere the torch path is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32

if triton is not None:

    @triton.jit
    def _gemm_nt_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                        sab, sam, sak, sbb, sbn, sbk, scb, scm, scn,
                        IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_base = a_ptr + batch.to(tl.int64) * sab
        b_base = b_ptr + batch.to(tl.int64) * sbb
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(a_base + rm.to(tl.int64)[:, None] * sam + kk[None, :] * sak,
                        mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            b = tl.load(b_base + rn.to(tl.int64)[None, :] * sbn + kk[:, None] * sbk,
                        mask=(rn < N)[None, :] & (kk < K)[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        c = c_ptr + batch.to(tl.int64) * scb + rm.to(tl.int64)[:, None] * scm + rn[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """CUDA, Triton present, both bf16 or both fp32."""
    return (triton is not None and a.is_cuda and b.is_cuda and a.dtype == b.dtype
            and a.dtype in (torch.bfloat16, torch.float32))


def gemm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [batch, M, K] · b [batch, N, K]ᵀ -> [batch, M, N] in a's dtype (any strides)."""
    batch, M, K = a.shape
    N = b.size(1)
    c = torch.empty(batch, M, N, dtype=a.dtype, device=a.device)
    if c.numel():
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), batch)
        _gemm_nt_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                              IEEE=a.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                              num_warps=4, num_stages=3)
    return c


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) [..., K] x [N, K] -> [..., N], batch-invariant."""
    rows = x.reshape(-1, x.size(-1))
    return gemm_nt(rows[None], w[None])[0].view(*x.shape[:-1], w.size(0))
