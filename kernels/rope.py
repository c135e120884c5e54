"""RoPE (spec §2.2) as one Triton kernel (mirrors DeepSeek's inference/model.py): rotate the last R dims in place.

Mirrors the rotary embedding of DeepSeek's inference/model.py (`apply_rotary_emb`); the torch path is
model/rope.py's `apply_rope` (upcast, a complex64 product, the copy back: 3-4 launches a call, ~47 calls
a forward of tiny-68m). Numerics: the same fp32 complex product (ac - bd, ad + bc) rounded once to x's
dtype; the compiler may fuse a multiply and an add where torch's kernel does not, so a value can differ by
an fp32 ulp before that rounding (a bf16 ulp where it sits at a rounding boundary).
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/rope.py is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _rotate_loaded(x, at, even, on, f_at, f_on, sign):
        """RoPE of values x (fp32) already loaded from pointers `at` inside a kernel that loads a head's whole
        row (kernels/attention.py's q, kernels/output.py's o): each value's pair partner is at at + 1 (even
        lanes) or at - 1 (odd lanes), its (cos, sin) at f_at, f_at + 1 (loaded where f_on); rotated where `on`,
        x elsewhere. _rope_kernel's operations: (a, b) -> (a·c - b·d, a·d + b·c), d = sin·sign, in fp32."""
        partner = tl.load(at + tl.where(even, 1, -1), mask=on, other=0.0).to(tl.float32)
        c = tl.load(f_at, mask=f_on, other=1.0)
        d = tl.load(f_at + 1, mask=f_on, other=0.0) * sign
        # even lanes: a = x, b = partner -> a·c - b·d; odd lanes: a = partner, b = x -> a·d + b·c
        return tl.where(on, tl.where(even, x * c - partner * d, partner * d + x * c), x)

    @triton.jit
    def _rope_kernel(x_ptr, freqs_ptr, n_rows, stride_row, heads, sign, HALF: tl.constexpr, ROWS: tl.constexpr):
        # [ROWS] rows of R = 2·HALF values of x, each loaded and stored whole (one contiguous vector a row), the
        # pairs (a, b) split off in registers; freqs' (cos, sin) pairs likewise
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        r = tl.arange(0, 2 * HALF)
        live = (rows < n_rows)[:, None]
        x_at = x_ptr + rows.to(tl.int64)[:, None] * stride_row + r[None, :]  # [ROWS, R]
        f_at = freqs_ptr + (rows // heads).to(tl.int64)[:, None] * (2 * HALF) + r[None, :]
        a, b = tl.split(tl.reshape(tl.load(x_at, mask=live).to(tl.float32), (ROWS, HALF, 2)))
        c, d = tl.split(tl.reshape(tl.load(f_at, mask=live), (ROWS, HALF, 2)))
        d = d * sign  # the inverse rotation conjugates
        y = tl.reshape(tl.join(a * c - b * d, a * d + b * c), (ROWS, 2 * HALF))
        tl.store(x_at, y.to(x_ptr.dtype.element_ty), mask=live)


def _row_stride(x: torch.Tensor) -> int | None:
    """The one stride between consecutive rows (last-dim vectors) of x in row-major order, or None."""
    dims = [(x.size(i), x.stride(i)) for i in range(x.dim() - 1) if x.size(i) > 1]
    if not dims:
        return x.size(-1)
    stride = expected = dims[-1][1]
    for size, step in reversed(dims):
        if step != expected:
            return None
        expected *= size
    return stride


def applies(x: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CUDA, evenly strided rows of a contiguous last dim, contiguous
    freqs whose rows each serve a whole number of x's rows (the head dim broadcast)."""
    R = x.size(-1)
    return (triton is not None and x.is_cuda and x.stride(-1) == 1 and freqs.is_contiguous() and R % 2 == 0
            and R & (R - 1) == 0 and freqs.numel() * 2 > 0 and (x.numel() // R) % (freqs.numel() * 2 // R) == 0
            and _row_stride(x) is not None)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """model/rope.py's apply_rope in one launch (where `applies`): x [..., S, R] or [..., S, H, R], freqs
    complex [..., S, R/2], broadcast over the head dim. Rotates x in place and returns it."""
    R = x.size(-1)
    f = torch.view_as_real(freqs)  # [..., R/2, 2] fp32: (cos, sin)
    rows = x.numel() // R
    heads = rows // (f.numel() // R)  # x rows per freqs row
    block = max(1, min(64, 4096 // R))  # 64 rows of the slice's 64 rope dims: 16 KB of fp32 a program
    _rope_kernel[(triton.cdiv(rows, block),)](x, f, rows, _row_stride(x), heads, -1.0 if inverse else 1.0,
                                              HALF=R // 2, ROWS=block)
    return x
