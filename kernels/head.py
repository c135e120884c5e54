"""The fp32 head of a wide model on the tensor cores (spec §6: `head.weight` [vocab, d] fp32, fp32 logits).

logits = x · Wᵀ for x the final norm's bf16 output (its values exact in fp32) and W fp32. The torch path
(model/transformer.py `logits` through model/invariant.py `head`: F.linear in fp32) is a SIMT GEMM: at the
released width (vocab 129,280, d 5,120) and a decode batch of 64 it is bound by the CUDA cores' fp32 FMAs
(85 GFLOP a step; 1.72 ms on an H200, where reading the 2.65 GB weight takes 0.55 ms). Here each fp32 weight value is split in registers into
three bf16 parts, W = hi + mid + lo, exactly (hi the value rounded to bf16, mid the remainder rounded, lo the
rest: 8 + 8 + 8 significant bits cover fp32's 24), and x · Wᵀ = x · hiᵀ + x · midᵀ + x · loᵀ is three bf16
tensor-core dots, each product exact in fp32, summed in the fp32 accumulator (kernels/hc.py's handoff splits
fn the same way). Only the weight's stored fp32 bytes are read, once per block of 64 rows.

The released checkpoint stores the head in bf16 (upcast to fp32 at load), so there mid and lo are zero and the
fp32 bytes carry half information: where every value is a bf16 value (`bf16_copy`, found once), the kernel reads
a bf16 copy kept beside the weight and makes one dot a block, the three parts' bits (their dots added exact
zeros) from half the bytes (1.33 of 2.65 GB a step at the released shape; the copy costs that much memory).

Numerics: the same exact products as the fp32 GEMM, summed in another order: each block of BK values of K
by the tensor cores (whose fp32 accumulation truncates) into a fresh accumulator, the blocks then added in
fp32 (round to nearest) in K order, as DeepGEMM promotes its partial sums. Within K·2^-24·Σ|x·w| of the
exact sum and within 1e-5 of cuBLAS's fp32 product at d 5,120 (tests/test_kernels.py,
tests/gpu/test_kernels_gpu.py), not cuBLAS's bits. So it serves only outside the batch-invariant mode and
only at wide heads (`applies`, WIDE_HEAD): tiny-68m's head (d 128), whose H200 trace's bits are cuBLAS's,
keeps F.linear.

The weight is the dot's first operand (a [BV, BK] tile of vocab rows, split in registers, where a tensor-core
dot takes it without a trip through shared memory), x's rows the second: the product is computed transposed,
[vocab rows, x rows], and stored as [x rows, vocab]. Nothing here is Hopper-only: plain tl.dot on bf16.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere the torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.fp8_gemm import _dot
except ImportError:
    triton = None

WIDE_HEAD = 1024  # from this model width the head runs here (the released 5,120; tiny-68m's 128 stays on cuBLAS)
MIN_ROWS = 16  # below this many rows cuBLAS's fp32 GEMV already streams the weight at the HBM rate
USE_BF16_COPY = True  # read a bf16-valued weight from its bf16 copy (`bf16_copy`; benchmarks/bench_slice.py
# --head-fp32 turns it off for a side-by-side run)


if triton is not None:

    @triton.jit
    def _split(w):
        """fp32 [., .] -> three bf16-valued parts with w = hi + mid + lo exactly (each an fp32 tensor here)."""
        hi = w.to(tl.bfloat16).to(tl.float32)
        r = w - hi  # exact: w and hi share the leading bits
        mid = r.to(tl.bfloat16).to(tl.float32)
        return hi, mid, r - mid  # r - mid has at most 8 significant bits left: exact in bf16

    @triton.jit
    def _head_kernel(x_ptr, w_ptr, out_ptr, M, V, K, zero, BF16: tl.constexpr,
                     BV: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PARTS: tl.constexpr):
        rv = tl.program_id(0) * BV + tl.arange(0, BV)
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        acc = tl.zeros((BV, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + rv.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=(rv < V)[:, None] & (kk < K)[None, :], other=0.0)
            xt = tl.load(x_ptr + rm.to(tl.int64)[None, :] * K + kk[:, None],
                         mask=(rm < M)[None, :] & (kk < K)[:, None], other=0.0)
            # a block's fresh accumulator from `zero`, a 0.0 the compiler cannot see: Triton rewrites
            # acc + dot(a, b, constant 0) into dot(a, b, acc), the running sum in the tensor cores' accumulation
            part = tl.full((BV, BM), zero, tl.float32)
            if PARTS == 3:  # fp32 values: this block's three dots into a fresh accumulator (the small parts first),
                # then one fp32 add: the tensor cores' truncating accumulation spans BK values only (into the
                # running sum, mid's and lo's products fell below its last bit: ~1e-4 off cuBLAS's fp32 at d 5,120)
                hi, mid, lo = _split(w)
                part = _dot(mid, xt, _dot(lo, xt, part, BF16), BF16)
            else:  # bf16 values (`bf16_copy`): mid and lo are zero, and their dots added exact zeros
                hi = w
            acc += _dot(hi, xt, part, BF16)
        tl.store(out_ptr + rm.to(tl.int64)[None, :] * V + rv[:, None], acc,
                 mask=(rm < M)[None, :] & (rv < V)[:, None])


def applies(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> bool:
    """CUDA, Triton, bf16 x of at least MIN_ROWS rows, an fp32 weight of at least WIDE_HEAD columns, outside the
    batch-invariant mode."""
    return (triton is not None and x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
            and weight.size(1) >= WIDE_HEAD and x.numel() // x.size(-1) >= MIN_ROWS and not batch_invariant)


def config(M: int) -> dict:
    """Tiles by the row count only: BM x rows (16 to 64, tl.dot's least upward), BV vocab rows and BK of K a step."""
    return dict(BV=64, BM=min(64, max(16, triton.next_power_of_2(M))), BK=64, num_warps=4, num_stages=3)


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 weight's bf16 copy if every value is a bf16 value (the released checkpoint stores the head bf16,
    upcast at load: model/released.py BF16_IN_FILE), else None; found once per version of the weight (one host
    sync, in an eager step: the model runner's warm-up runs before a graph's capture; during a capture without
    it, None). Kept beside the weight, half its bytes: the kernel reads it in place of the fp32 values."""
    kept = getattr(weight, "_head_bf16", None)
    if kept is not None and kept[0] == weight._version:
        return kept[1]
    if not USE_BF16_COPY or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    copy = weight.bfloat16()
    rows = max(1, (1 << 24) // max(1, weight.size(1)))  # compared in parts: no weight-sized temporary beside the copy
    exact = all(torch.equal(copy[i:i + rows].float(), weight[i:i + rows]) for i in range(0, weight.size(0), rows))
    weight._head_bf16 = (weight._version, copy if exact else None)
    return weight._head_bf16[1]


def head(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x bf16 [..., K], weight fp32 [V, K] -> fp32 [..., V] = x·Wᵀ (F.linear(x.float(), weight) within fp32
    rounding): from the weight's bf16 copy where its values are bf16 (`bf16_copy`: one dot a block, the three
    parts' bits, half the bytes read), else from its fp32 values in three parts. `cfg` overrides the tiles (BV,
    BM, BK, num_warps: tests, benchmarks)."""
    V, K = weight.shape
    copy = bf16_copy(weight)
    rows = x.reshape(-1, K).contiguous()
    M = rows.size(0)
    out = torch.empty(M, V, dtype=torch.float32, device=x.device)
    if M:
        cfg = dict(config(M), **(cfg or {}))
        BV, BM = cfg["BV"], cfg["BM"]
        _head_kernel[(triton.cdiv(V, BV), triton.cdiv(M, BM))](rows, weight.contiguous() if copy is None else copy,
                                                              out, M, V, K, 0.0, BF16=x.is_cuda,
                                                              PARTS=3 if copy is None else 1, **cfg)
    return out.view(*x.shape[:-1], V)
