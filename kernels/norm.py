"""RMSNorm (spec §6) as one Triton kernel (mirrors DeepSeek's inference/model.py): w ⊙ x·rsqrt(mean(x²) + eps).

Mirrors the RMSNorm of DeepSeek's inference/model.py; the torch path is model/attention.py's `RMSNorm`
(7 ops a call, about 60 calls a forward of tiny-68m). Numerics: fp32 throughout as the torch path, with a
correctly rounded square root and division; the sum of squares associates differently from torch's
reduction, so the result agrees within an fp32 ulp or two before the final rounding, not bit for bit.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere the torch path is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, N, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK)
        mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK]
        mean = tl.div_rn(tl.sum(x * x, axis=1), N.to(tl.float32))
        y = x * tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (bf16 or fp32), weight [N] -> x's shape and dtype, normalised over the last dim."""
    x2 = x.contiguous().view(-1, x.size(-1))
    out = torch.empty_like(x2)
    block = triton.next_power_of_2(x2.size(1))
    rows = max(1, min(64, 4096 // block))
    if x2.size(0):
        _rms_norm_kernel[(triton.cdiv(x2.size(0), rows),)](x2, weight, out, x2.size(0), x2.size(1), eps,
                                                           BLOCK=block, ROWS=rows)
    return out.view(x.shape)
