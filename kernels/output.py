"""The attention output's first half (spec §2.9) in one Triton launch: the inverse RoPE of each head's last R dims
and the grouped low-rank wo_a, written as the [rows, G·r] input of wo_b.

model/attention.py `Attention.output` takes three launches and two copies for it on CUDA: kernels/rope.py's
inverse rotation in place, the copy of o into group-major order, the batched GEMM (einsum "bsgd,grd->bsgr"),
and the copy of its [G, rows, r] result back to [rows, G·r]. Here a program owns a tile of rows of one group:
it loads o where it lies, rotates the rope dims as it loads them (kernels/rope.py's operations: (a, b) ->
(a·c - b·d, a·d + b·c) with d = -sin, in fp32, rounded once to bf16, so the GEMM's input is the rotated o bit
for bit), multiplies by the group's wo_a in fp32 (tl.dot) and stores the bf16 result in place. The GEMM sums
its products in another order than cuBLAS: the result agrees within fp32 rounding before its bf16 rounding.
The attention's o is not changed (the torch path rotates it in place; the debugger taps it before, so both
forms show the same `sparse_attn`).
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/attention.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels import fit
    from kernels.fp8_gemm import _dot
    from kernels.rope import _rotate_loaded
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _rope_wo_a_kernel(o_ptr, freqs_ptr, w_ptr, out_ptr, M, RANK, HD: tl.constexpr, K: tl.constexpr,
                          D: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[m, g·RANK + n] = Σ_k rope⁻¹(o)[m, g·K + k] · w[g, n, k]: o [M, HD] (H heads of D), K = HD / G,
        # w [G, RANK, K], freqs [M, R/2, 2] (cos, sin) of each row's position, out [M, G·RANK]
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(2)
        live = rows < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kin = k < K
            dim = (g * K + k) % D  # within its head (a group may start inside one)
            rope = (dim >= D - R) & kin
            at = o_ptr + rows.to(tl.int64)[:, None] * HD + (g * K + k)[None, :]
            x = tl.load(at, mask=live[:, None] & kin[None, :], other=0.0).to(tl.float32)
            on = live[:, None] & rope[None, :]
            f_at = freqs_ptr + rows.to(tl.int64)[:, None] * R + 2 * tl.where(rope, (dim - (D - R)) // 2, 0)[None, :]
            # the inverse rotation conjugates: sign -1
            a = _rotate_loaded(x, at, (k % 2 == 0)[None, :], on, f_at, on, -1.0).to(tl.bfloat16)
            w = tl.load(w_ptr + g * RANK * K + n[None, :].to(tl.int64) * K + k[:, None],
                        mask=kin[:, None] & (n < RANK)[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = _dot(a, w, acc, BF16)  # compiled: a bf16 tensor-core dot; the interpreter: fp32 (exact products)
        out_at = out_ptr + rows.to(tl.int64)[:, None] * (tl.num_programs(2) * RANK) + (g * RANK + n)[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (n < RANK)[None, :])

    def smaller(cfg: dict) -> dict | None:
        """Where a device cannot hold a tile's shared memory (kernels/fit.py): half the rows a program, then half the
        K step, down to 16 (the same bits: each output's products are summed in K order whatever the tile). sm_120
        takes tiny-68m's prefill tile at 32 rows."""
        for key in ("BLOCK_M", "BLOCK_K"):
            if cfg[key] > 16:
                return dict(cfg, **{key: cfg[key] // 2})
        return None

    fit.register(_rope_wo_a_kernel, smaller)


# The widest group the launch serves. Narrow groups (tiny-68m: 256 wide, rank 64) are bound by launches, and one
# launch for three wins; at the released widths (groups of 4,096, rank 1,024) the kernel's small tiles took 466 us a
# decode step of 64 rows and 22.9 ms a prefill chunk of 8,192 on an H200, where the rotation plus cuBLAS's grouped
# GEMM take a few percent of that (benchmarks/RESULTS.md, issue #20 item 3): there the three launches stay.
MAX_GROUP_WIDTH = 512


def applies(o: torch.Tensor, wo_a: torch.Tensor, rope_dim: int) -> bool:
    """CUDA (or the interpreter), bf16 o [..., H, D] contiguous with H·D a multiple of the groups, bf16 wo_a
    [G, r, H·D/G], a group's width a multiple of 16 (the tile) and at most MAX_GROUP_WIDTH, and the rope dims
    even, within one head."""
    if triton is None or o.dtype != torch.bfloat16 or wo_a.dtype != torch.bfloat16 or not o.is_contiguous():
        return False
    G, _, K = wo_a.shape
    H, D = o.shape[-2:]
    return (H * D == G * K and K % 16 == 0 and K <= MAX_GROUP_WIDTH and rope_dim % 2 == 0 and 0 < rope_dim <= D
            and wo_a.is_contiguous())


def tiles(M: int, rank: int, K: int) -> tuple[int, int, int, int]:
    """(rows, outputs, K a step, warps) a program for M rows, by the shape only. A decode step's (M <= 64) walks
    a group's K in steps of 256 (tiny-68m's whole group) with 32 outputs a program: at tiny-68m's 64 rows (K 256,
    rank 64) 10.2 -> 3.1 us against steps of 64 and 64 outputs (four dependent steps, half the programs; H100,
    benchmarks/RESULTS.md). The same bits at any of them: an output's products are summed on the tensor cores
    in K order, step after step (tests/gpu)."""
    if M <= 64:
        return 16, min(32, triton.next_power_of_2(rank)), min(256, triton.next_power_of_2(K)), 4
    return 64, min(64, triton.next_power_of_2(rank)), min(64, triton.next_power_of_2(K)), 4


def rope_wo_a(o: torch.Tensor, freqs: torch.Tensor, wo_a: torch.Tensor, rope_dim: int,
              tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """o [..., H, D] bf16 (left as it is), freqs complex [..., R/2] (each row's position), wo_a [G, r, H·D/G]
    -> [..., G·r] bf16: wo_a of the inverse-rotated o, group by group (see the module docstring). `tile`
    overrides `tiles` (tests)."""
    lead, (H, D) = o.shape[:-2], o.shape[-2:]
    G, rank, K = wo_a.shape
    M = o.numel() // (H * D)
    f = torch.view_as_real(freqs).reshape(M, rope_dim)  # (cos, sin) pairs
    out = torch.empty(M, G * rank, dtype=o.dtype, device=o.device)
    if M:
        block_m, block_n, block_k, warps = tile or tiles(M, rank, K)
        fit.launch(_rope_wo_a_kernel, lambda c: (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(rank, c["BLOCK_N"]), G),
                   (o, f.contiguous(), wo_a, out, M, rank), dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                   num_warps=warps), HD=H * D, K=K, D=D, R=rope_dim, BF16=o.is_cuda)
    return out.view(*lead, G * rank)
