"""The FP8 dense GEMM of the released storage (spec §2.5a, §5 "Storage"; mirrors `fp8_gemm` of DeepSeek's inference/kernel.py).

y = x_q · dequant(W)ᵀ for x_q the activation already quantised to FP8 and back (act_quant, one ue8m0 scale
per 32 values: kernels/quant.py), W float8_e4m3fn [N, K] and its float8_e8m0fnu scales [ceil(N/32), K/32],
one per 32x32 tile (V4.1's tile; V3 used 128x128). Out bf16, as the official GEMM.

What it replaces (model/released.py FP8Linear, the torch path, kept for CPU and the batch-invariant mode):
`dequantize_fp8_tiles` materialises the weight in fp32 (two repeat_interleaves, a product: 4 bytes a value
written, read back), `.to(bf16)` writes it again (2 bytes), then F.linear reads that copy: about 13 bytes of
traffic a weight value per call where the stored weight is 1. Here each program reads its [BN, BK] tile of
FP8 codes and the tile's scales once, decodes them in registers to bf16 (exact: an e4m3 code times a power of
two), and feeds a bf16 tensor-core dot with an fp32 accumulator: only the stored bytes cross HBM.

Numerics. The official kernel multiplies FP8 codes (x's and W's) and scales each 32-wide K block's partial
sum by both scales; the torch path multiplies the dequantised values in bf16. Both compute exact products
(an e4m3 code times a power of two is exact in bf16, and so is the product of two in fp32) summed in fp32:
only the order of the fp32 additions differs, then one rounding to bf16.

Portability: the decode from e4m3 bits uses the hardware conversion where it exists (`HW_FP8`, sm_89 and
newer: Ada, Hopper, Blackwell) and integer arithmetic on the bits elsewhere (sm_80); both give the same
values, and both run under the CPU interpreter (tests/test_fp4_kernels.py). The dot is a plain bf16 tl.dot,
so nothing here is Hopper-only (no wgmma, no TMA descriptors): Triton lowers it per architecture.

A prefill chunk (DEQUANT_ROWS rows or more) takes another path: `dequantize` writes the weight's bf16 values
once (a transient copy of this one linear's weight, freed after the call), then F.linear multiplies as the
torch path does, bit for bit. At such rows this kernel decodes every weight tile again for each block of
rows, between the loads and the dot: it ran at ~420 TFLOP/s at 8,192 rows on an H200, the cuBLAS path at
~760 (benchmarks/RESULTS.md). An FP8 MMA a 32-wide scale group at a time, both scales applied to the fp32
accumulator, ran at ~180: the per-group rescale of the accumulator costs as much as the MMA on Hopper. On
sm_100 the MX block-scaled MMA (Triton's tl.dot_scaled) takes these scales natively; not tried here.

Decode shapes (a few rows) are bound by the weight bytes: with few output tiles the K loop is split over
programs (`split`), the partial sums written in fp32 and added in split order by `_sum_parts_kernel` (a fixed
order: deterministic; atomics would not be). The split and tiles depend on the shape only. From 17 to 64 rows
the product is computed transposed (`SWAP`: the decoded weight the dot's first operand, all the rows one block),
so each weight tile is decoded once: decode is bound by issuing the decode as much as by the bytes.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/released.py's torch path is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE = 32  # the weight's scale tile (model/quant.py WEIGHT_TILE)
# From this many rows (a prefill chunk) the weight is decoded to a transient bf16 copy by `dequantize` (one pass
# over the codes: 3 bytes a value of traffic), then cuBLAS's bf16 GEMM: the torch path's product, bit for bit,
# at about twice this kernel's rate on an H200 (benchmarks/RESULTS.md), the copy's traffic small beside M·N·K.
# Below it, the kernel (the weight's bytes are the cost at decode rows). A dense weight only; the routed
# experts never have a bf16 copy (kernels/fp4_moe.py).
DEQUANT_ROWS = 1024
TARGET_PROGRAMS = 264  # enough programs to keep an H200's 132 SMs busy twice over (a constant: same split anywhere)
MAX_SPLIT = 16  # parts of K at most


if triton is not None:

    @triton.jit
    def _e4m3_values(bits, HW_FP8: tl.constexpr):
        """uint8/int e4m3 bit patterns -> fp32 values (the NaN codes 0x7f/0xff are never stored)."""
        if HW_FP8:
            return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b = bits.to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        binade = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e-10)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * binade)  # subnormal m·2^-9, else (8+m)·2^(e-10)
        return tl.where((b & 128) != 0, -mag, mag)

    @triton.jit
    def _e8m0_values(bits, shift):
        """e8m0 scale bytes -> fp32 2^(bits-127+shift), exact for the stored range (1 <= bits+shift <= 254)."""
        return ((bits.to(tl.int32) + shift) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _dot(a, b, acc, BF16: tl.constexpr):
        """acc + a·b for a, b holding bf16 values: a bf16 tensor-core dot compiled; under the CPU interpreter,
        which has no bf16 matmul, in fp32 (the same exact products, fp32 sums)."""
        if BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _round_bf16(v, COMPILED: tl.constexpr):
        """fp32 -> bf16, round to nearest even: the compiled cast; Triton's CPU interpreter truncates in its
        cast, so there the rounding is done on the bits first (finite values), then the cast is exact."""
        if not COMPILED:
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return v.to(tl.bfloat16)

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, split_stride, k_per_split,
                         HW_FP8: tl.constexpr, BF16: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr):
        """out [BM, BN] of x's rows rm and W's rows rn over this program's part of K. SWAP: the product is
        computed transposed, [BN, BM] = W·xᵀ, the decoded weight the dot's first operand (a tensor-core dot
        takes it from registers: wgmma's A) and x's rows its second (from shared memory), so a block of rows
        as few as 16 fills the MMA's N side and a weight tile is decoded once for up to 64 rows; unswapped,
        x·Wᵀ, whose first operand must have 64 rows for wgmma."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        sn = pid_n * (BN // 32) + tl.arange(0, BN // 32)  # the tile rows of this block of outputs
        n_tiles, k_tiles = tl.cdiv(N, 32), K // 32
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        k_start = pid_k * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BK):
            kk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                        mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            codes = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :],
                            mask=(rn < N)[:, None] & (kk < K)[None, :], other=0)
            sk = k0 // 32 + tl.arange(0, BK // 32)
            s = tl.load(s_ptr + sn[:, None] * k_tiles + sk[None, :],
                        mask=(sn < n_tiles)[:, None] & (sk < k_tiles)[None, :], other=127)
            s = tl.broadcast_to(_e8m0_values(s, 0)[:, None, :, None], (BN // 32, 32, BK // 32, 32))
            w = _e4m3_values(codes, HW_FP8) * tl.reshape(s, (BN, BK))  # exact in bf16
            acc = _dot(w, tl.trans(x), acc, BF16) if SWAP else _dot(x, tl.trans(w), acc, BF16)
        out = out_ptr + pid_k.to(tl.int64) * split_stride
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = _round_bf16(acc, BF16)
        if SWAP:
            tl.store(out + rm.to(tl.int64)[None, :] * N + rn[:, None], acc, mask=(rm < M)[None, :] & (rn < N)[:, None])
        else:
            tl.store(out + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def _sum_parts_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
        """A split K's fp32 partial sums [SPLIT, M·N] added in split order, rounded to bf16 once: one launch."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.load(part_ptr + i, mask=i < MN, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * MN + i, mask=i < MN, other=0.0)
        tl.store(y_ptr + i, _round_bf16(acc, BF16), mask=i < MN)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, HW_FP8: tl.constexpr, BK: tl.constexpr):
        """One tile row (32 weight rows) x BK columns of the FP8 codes -> their bf16 values (exact)."""
        rn = tl.program_id(0) * 32 + tl.arange(0, 32)
        kk = tl.program_id(1) * BK + tl.arange(0, BK)
        m = (rn < N)[:, None] & (kk < K)[None, :]
        codes = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], mask=m, other=0)
        s = tl.load(s_ptr + tl.program_id(0) * (K // 32) + kk // 32, mask=kk < K, other=127)
        w = _e4m3_values(codes, HW_FP8) * _e8m0_values(s, 0)[None, :]
        tl.store(out_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], w.to(tl.bfloat16), mask=m)


def hw_fp8(device: torch.device) -> bool:
    """Whether the device converts e4m3 in hardware (sm_89+); True under the interpreter (numpy does it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def applies(x: torch.Tensor) -> bool:
    """CUDA, Triton present, bf16 activations (the fp32 debugging mode keeps the torch path)."""
    return triton is not None and x.is_cuda and x.dtype == torch.bfloat16


def dequantize(weight: torch.Tensor, scale: torch.Tensor, hw: bool | None = None) -> torch.Tensor:
    """float8_e4m3fn [N, K] with its 32x32 tiles' e8m0 scales -> bf16 [N, K], one launch (model/quant.py
    dequantize_fp8_tiles' values, exact in bf16, without its fp32 copy)."""
    N, K = weight.shape
    out = torch.empty(N, K, dtype=torch.bfloat16, device=weight.device)
    block = min(256, triton.next_power_of_2(K))
    _dequant_kernel[(triton.cdiv(N, TILE), triton.cdiv(K, block))](
        weight.view(torch.uint8), scale.view(torch.uint8), out, N, K,
        HW_FP8=hw_fp8(weight.device) if hw is None else hw, BK=block)
    return out


def config(M: int, N: int, K: int) -> tuple[int, int, int, int, bool, int]:
    """(BM, BN, BK, num_warps, swap, split) for an M x N x K product: shape-dependent only."""
    if M <= 16:  # decode: few rows, the weight bytes are the cost (tiles: bench_fp4.py --sweep on an H200)
        BM, BN, BK, warps, swap = 16, 64, 256, 4, False
    elif M <= 64:  # one block of rows transposed: each weight tile decoded once, not once per 16 rows; at 64
        # rows 213 -> 143 us over a slice layer's seven linears; 128 weight rows a program on 8 warps where
        # there are at least 2,048 (wq_b 35 -> 25 us, 25,600 x 4,096 81 -> 67, wo_b 38 -> 33), 64 on 4 below
        # (wq_a, wkv: 1-13% faster so) (H100, benchmarks/RESULTS.md)
        BM, BK, swap = 64, 128, True
        BN, warps = (128, 8) if N >= 2048 else (64, 4)
    else:
        BM, BN, BK, warps, swap = 128, 128, 64, 8, False
    return BM, BN, BK, warps, swap, _split(M, N, K, BM, BN, BK)


def _split(M: int, N: int, K: int, BM: int, BN: int, BK: int) -> int:
    """K split: enough programs for TARGET_PROGRAMS, at most MAX_SPLIT parts, each at least one K block."""
    return max(1, min(TARGET_PROGRAMS // (triton.cdiv(M, BM) * triton.cdiv(N, BN)), triton.cdiv(K, BK), MAX_SPLIT))


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, split: int | None = None,
             hw: bool | None = None, cfg: tuple | None = None) -> torch.Tensor:
    """x bf16 [..., K] (already FP8-quantised and back), weight float8_e4m3fn [N, K], scale float8_e8m0fnu
    [ceil(N/32), K/32] -> bf16 [..., N]. `split`, `hw` and `cfg` override the K split, the e4m3 decode and
    the (BM, BN, BK, num_warps, swap) tiles (tests, benchmarks)."""
    N, K = weight.shape
    if K % TILE or scale.shape != (triton.cdiv(N, TILE), K // TILE):
        raise ValueError(f"fp8_gemm: weight {tuple(weight.shape)} with scale {tuple(scale.shape)} is not "
                         f"{TILE}x{TILE} tiles")
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.size(0)
    if M >= DEQUANT_ROWS and split is None and cfg is None:  # a prefill chunk: the torch path's product, faster
        return torch.nn.functional.linear(rows, dequantize(weight, scale, hw)).view(*x.shape[:-1], N)
    BM, BN, BK, warps, swap, auto_split = config(M, N, K) if cfg is None else (*cfg, _split(M, N, K, *cfg[:3]))
    k_per_split = triton.cdiv(triton.cdiv(K, BK), split or auto_split) * BK
    split = triton.cdiv(K, k_per_split)
    out = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else torch.bfloat16, device=x.device)
    if M:
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), split)
        _fp8_gemm_kernel[grid](rows, weight.view(torch.uint8), scale.view(torch.uint8), out, M, N, K, rows.stride(0),
                               M * N, k_per_split, HW_FP8=hw_fp8(x.device) if hw is None else hw,
                               BF16=x.is_cuda, BM=BM, BN=BN, BK=BK, SWAP=swap, num_warps=warps, num_stages=3)
    return (out[0] if split == 1 else sum_parts(out)).view(*x.shape[:-1], N)


def sum_parts(parts: torch.Tensor) -> torch.Tensor:
    """A split K's fp32 partial sums [S, ...] (contiguous) -> bf16 [...]: added in part order, rounded once, in one
    launch (`_sum_parts_kernel`; torch's sum and cast take two)."""
    y = torch.empty(parts.shape[1:], dtype=torch.bfloat16, device=parts.device)
    n = y.numel()
    _sum_parts_kernel[(triton.cdiv(n, 1024),)](parts, y, n, SPLIT=parts.size(0), BF16=parts.is_cuda, BLOCK=1024)
    return y


def fp8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch path (model/released.py FP8Linear): the weight dequantised to bf16, then F.linear."""
    from model.quant import dequantize_fp8_tiles

    return torch.nn.functional.linear(x, dequantize_fp8_tiles(weight, scale).to(x.dtype))
