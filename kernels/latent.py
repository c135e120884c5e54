"""A latent row's RMSNorm, RoPE and quantisation sim in one launch (spec §2.1-2.7; DeepSeek's inference/model.py
applies them in turn to the window KV, the index keys and queries and the compressed entries).

model/attention.py makes four such chains a layer, each two or three launches of kernels/norm.py, rope.py and
quant.py with a bf16 tensor written and read back between them:
- the window latent: kv_norm, RoPE, FP8 sim per 32 (`Attention.window_kv`);
- the index keys: k_norm, RoPE, FP4 sim per 32 with ue8m0 scales (`Indexer.keys`);
- the index queries: RoPE, FP4 sim per 32 with ue8m0 scales (`Indexer.queries`);
- the compressed entries: RoPE on a copy, FP4 sim per 16 with e4m3 scales (`compressed_kv`).
Here a program takes ROWS rows through the three steps (`rows_a_program`): each step writes its rounded result
to the output and the next reads it back after a barrier, so each step is the separate kernel's own code on
tiles of whole rows (kernels/norm.py's [ROWS, D] rows, kernels/rope.py's pairs, kernels/quant.py's groups).
With `store_at` the last step also writes each row to its place in a paged table (model/paged.py: a decode
row's window ring, a kv source's compressed entries and index keys), in place of an index_put launch after it.

Numerics: those of the three kernels in turn (the norm within fp32 rounding of the torch path, RoPE within
an fp32 ulp, the quantisation exact from its input), each result rounded to the row's dtype as the torch
path rounds it; tests/gpu compares with the separate kernels and tests/test_kernels.py with the torch path.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/attention.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.quant import _FORMATS, FMT_FP8, _quantise
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _latent_kernel(x_ptr, w_ptr, f_ptr, out_ptr, t_ptr, i_ptr, j_ptr, t_stride_i, t_stride_j, n_rows, heads, eps,
                       D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr,
                       ROWS: tl.constexpr, STORE: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] rows of D values; freqs row: row // heads
        live = rows < n_rows
        cols = tl.arange(0, D)
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        if NORM:  # kernels/norm.py
            mean = tl.div_rn(tl.sum(x * x, axis=1), tl.full([], D, tl.float32))
            y = x * tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
            x = tl.load(w_ptr + cols).to(tl.float32)[None, :] * y
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.debug_barrier()
        # kernels/rope.py on the last R values of each row, in place in the output
        k = tl.arange(0, R // 2)
        x_at = out_ptr + rows.to(tl.int64)[:, None] * D + (D - R) + 2 * k[None, :]
        f_at = f_ptr + (rows // heads).to(tl.int64)[:, None] * R + 2 * k[None, :]
        a = tl.load(x_at, mask=live[:, None]).to(tl.float32)
        b = tl.load(x_at + 1, mask=live[:, None]).to(tl.float32)
        c = tl.load(f_at, mask=live[:, None])
        d = tl.load(f_at + 1, mask=live[:, None])
        tl.store(x_at, (a * c - b * d).to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(x_at + 1, (a * d + b * c).to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.debug_barrier()
        # kernels/quant.py on the rows' groups of QB values
        G: tl.constexpr = ROWS * D // QB
        g = tl.program_id(0) * G + tl.arange(0, G)
        goffs = g.to(tl.int64)[:, None] * QB + tl.arange(0, QB)[None, :]
        glive = g < n_rows * (D // QB)
        y = _quantise(tl.load(out_ptr + goffs, mask=glive[:, None], other=0.0).to(tl.float32), FMT)
        tl.debug_barrier()  # every group read before any is overwritten
        tl.store(out_ptr + goffs, y.to(out_ptr.dtype.element_ty), mask=glive[:, None])
        if STORE:  # the same values to row (i, j) of the table too: table[i, j] = out
            i = tl.load(i_ptr + g // (D // QB), mask=glive, other=0).to(tl.int64)
            j = tl.load(j_ptr + g // (D // QB), mask=glive, other=0).to(tl.int64)
            toffs = (i * t_stride_i + j * t_stride_j + (g % (D // QB)) * QB)[:, None] + tl.arange(0, QB)[None, :]
            tl.store(t_ptr + toffs, y.to(t_ptr.dtype.element_ty), mask=glive[:, None])


def applies(x: torch.Tensor, rope_dim: int, block: int, store_at: tuple | None = None) -> bool:
    """CUDA; a power-of-two row of at least 32 with a contiguous last dim; R and the quantisation block
    powers of two that divide it. `store_at` (None, or `stores_to`'s table, i, j) as `norm_rope_quant` takes it."""
    D = x.size(-1)
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (triton is not None and x.is_cuda and x.stride(-1) == 1 and pow2(D) and D >= 32 and pow2(rope_dim)
            and rope_dim <= D and pow2(block) and D % block == 0 and (store_at is None or stores_to(*store_at, x)))


def rows_a_program(n: int, D: int) -> int:
    """Rows of D a program takes, of n: kernels/norm.py's (up to 64, 4,096 values) for the largest launches,
    fewer below 256 x that, so a launch has one program per 256 rows or more: each program's three steps
    are round trips through memory one after another, and at tiny-68m's 64 decode rows 32 rows a program made
    2 programs of 6.6 us (the window latent), 1 row 64 programs of 2.2 us; the index queries (512 rows of 64)
    7.3 -> 1.9 us at 2 rows (H100, benchmarks/RESULTS.md). A row's values do not depend on the rows beside it:
    the same bits at any count (tests/gpu)."""
    return max(1, min(64, 4096 // D, 1 << max(0, (n // 256).bit_length() - 1)))


def stores_to(table: torch.Tensor, i: torch.Tensor, j: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `norm_rope_quant` can write x's rows [..., D] to table[i, j] as well ([A, B, D], x's dtype, on x's
    device, last dim contiguous; i and j one index a row, no head dim)."""
    return (table.dim() == 3 and table.size(-1) == x.size(-1) and table.stride(-1) == 1 and table.dtype == x.dtype
            and table.device == x.device and i.shape == j.shape == x.shape[:-1])


def norm_rope_quant(x: torch.Tensor, norm, freqs: torch.Tensor, rope_dim: int, quant: str,
                    block: int, rows: int | None = None, store_at: tuple | None = None) -> torch.Tensor:
    """A new tensor: x [..., D] (rows of D; with a head dim [..., S, H, D] the freqs broadcast over it),
    RMS-normalised by `norm` (an RMSNorm: its weight and eps; None: not), its last `rope_dim` values rotated
    by freqs (complex [..., S, R/2]), then quantised: quant "fp8" (e4m3, ue8m0 scales), "ue8m0" or "e4m3"
    (FP4 with that scale format) per `block` values. x's dtype out. `rows` overrides `rows_a_program` (tests).
    `store_at` (table, i, j) (`stores_to`): the launch also writes table[i, j] = the result, as index_put would
    (which of several rows sent to one (i, j) lands there is not fixed: the callers send only trash rows so)."""
    D = x.size(-1)
    weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    x2 = x.contiguous().view(-1, D)
    f = torch.view_as_real(freqs if freqs.is_contiguous() else freqs.contiguous())
    n = x2.size(0)
    heads = n // max(f.numel() // rope_dim, 1)
    fmt = FMT_FP8 if quant == "fp8" else _FORMATS[quant]
    out = torch.empty_like(x2)
    rows = rows or rows_a_program(n, D)
    if store_at is not None:
        table, i, j = store_at
        assert stores_to(table, i, j, x), "store_at: a [A, B, D] table of x's dtype and an (i, j) a row"
        i, j = i.contiguous(), j.contiguous()
        table_at = (table, i, j, table.stride(0), table.stride(1))
    else:
        table_at = (out, out, out, 0, 0)  # not read (STORE off)
    if n:
        _latent_kernel[(triton.cdiv(n, rows),)](x2, weight if weight is not None else x2, f, out, *table_at, n, heads,
                                               eps, D=D, R=rope_dim, NORM=weight is not None, FMT=fmt, QB=block,
                                               ROWS=rows, STORE=store_at is not None)
    return out.view(x.shape)
