"""FP8 and FP4 quantisation (spec §2.5) as Triton kernels (mirrors DeepSeek's inference/kernel.py act_quant).

Mirrors `act_quant` and `fp4_act_quant` of DeepSeek's inference/kernel.py ("inplace": quantise, then
dequantise back to the input dtype). model/quant.py spends ~25 small ops a call (amax, the power-of-two
scale from the fp32 bits, the division, the clamp, the format's rounding, the product, the casts); a
decode step of tiny-68m makes 23 calls. Here each group of `block` values is one row of a tile.

Exactness: every step is exact or correctly rounded in fp32, in the same order as model/quant.py: the
amax, the scale (fp32 product with the fp32 reciprocal, then pow2ceil on the bits; or an IEEE division
by 6 rounded to e4m3), an IEEE division by the scale, the clamp, the rounding to the e4m3 or e2m1 grid
(half to even, computed with integer parts so no compiler rewrite can change it), the product with the
scale and the final cast. So the kernel and model/quant.py agree bit for bit, on CPU through Triton's
interpreter and compiled on CUDA (tests/test_kernels.py, tests/gpu/test_kernels_gpu.py).
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/quant.py is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FMT_FP8, FMT_FP4_UE8M0, FMT_FP4_E4M3 = 0, 1, 2
_FORMATS = {"ue8m0": FMT_FP4_UE8M0, "e4m3": FMT_FP4_E4M3}


if triton is not None:

    @triton.jit
    def _pow2ceil(v):
        """2^ceil(log2 v) of positive normal fp32 v, from its bits (model/quant.py pow2ceil)."""
        bits = v.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        return (exponent << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_half_even(t):
        """Nearest integer of t >= 0 (below 2^31), ties to even, from its integer and fractional parts."""
        whole = t.to(tl.int32)  # truncation = floor for t >= 0
        frac = t - whole.to(tl.float32)  # exact
        up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
        return (whole + up.to(tl.int32)).to(tl.float32)

    @triton.jit
    def _e4m3_magnitude(a):
        """|v| rounded to float8_e4m3fn, for 0 <= a <= 448: quantum 2^(e-3) in the binade 2^e, 2^-9 below 2^-6."""
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)  # subnormals share the quantum of the lowest binade
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(a / quantum) * quantum  # a / quantum is exact: a power of two

    @triton.jit
    def _e2m1_magnitude(a):
        """|v| rounded to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, for 0 <= a <= 6 (model/quant.py e2m1_round)."""
        spacing = tl.where(a >= 4.0, 2.0, tl.where(a >= 2.0, 1.0, 0.5))
        return _round_half_even(a / spacing) * spacing

    @triton.jit
    def _with_sign_of(mag, v):
        """copysign(mag, v), the sign bit copied (also for -0.0), as torch.copysign."""
        sign = v.to(tl.int32, bitcast=True) & -2147483648
        return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantise(x, FMT: tl.constexpr):
        """fp32 groups x [G, block] -> their quantised values in fp32 (format FMT), each row one group."""
        amax = tl.max(tl.abs(x), axis=1)[:, None]  # [G, 1]
        if FMT == 0:  # FP8 e4m3, ue8m0 scale: s = pow2ceil(max(amax, 1e-4) * fp32(1/448))
            scale = _pow2ceil(tl.maximum(amax, 1e-4) * 0.0022321429569274187)
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            y = _with_sign_of(_e4m3_magnitude(tl.abs(v)), v) * scale
        else:
            if FMT == 1:  # FP4 with a ue8m0 scale: s = pow2ceil(max(amax, 6·2^-126) * fp32(1/6))
                scale = _pow2ceil(tl.maximum(amax, 7.052966104933725e-38) * 0.1666666716337204)
            else:  # FP4 with an e4m3 scale: s = e4m3(max(amax, 6·2^-9) / 6)
                scale = _e4m3_magnitude(tl.minimum(tl.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0))
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -6.0), 6.0)
            y = _with_sign_of(_e2m1_magnitude(tl.abs(v)), v) * scale
        return y

    @triton.jit
    def _quant_kernel(x_ptr, out_ptr, n_groups, FMT: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
        g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] group ids
        offs = g.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]
        live = (g < n_groups)[:, None]
        x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _quantise(x, FMT).to(out_ptr.dtype.element_ty), mask=live)


def _launch(x: torch.Tensor, block: int, fmt: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    x = x.contiguous()
    out = torch.empty_like(x)
    n_groups = x.numel() // block
    groups = max(1, min(64, 2048 // block))
    if n_groups:
        _quant_kernel[(triton.cdiv(n_groups, groups),)](x, out, n_groups, FMT=fmt, BLOCK=block, GROUPS=groups)
    return out


def act_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """model/quant.py's act_quant_fp8 (spec §2.5a) in one launch, the same bits; x's dtype in and out."""
    return _launch(x, block, FMT_FP8)


def act_quant_fp4(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """model/quant.py's act_quant_fp4 (spec §2.5b/c) in one launch, the same bits; x's dtype in and out."""
    if scale_fmt not in _FORMATS:
        raise ValueError(f"unknown FP4 scale format {scale_fmt!r}; use 'e4m3' or 'ue8m0'")
    return _launch(x, block, _FORMATS[scale_fmt])
