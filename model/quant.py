"""Quantisation simulations (mirrors DeepSeek's inference/kernel.py): FP8 e4m3, FP4 e2m1, Engram FP8 storage.

Mirrors `act_quant` and `fp4_act_quant` of DeepSeek's inference/kernel.py (through tt-metal's torch port
kernel_cpu.py), in their "inplace" form: quantise, then dequantise back to the input dtype, so a caller sees
exactly the values the official kernels leave in their bf16 buffers.

Every function groups the last dim into contiguous blocks, works on any leading shape and on CPU and CUDA,
and uses only device-side ops (no host syncs). The operation order is the kernels' own: amax in fp32, the
scale from amax times the fp32 reciprocal of the format maximum (or amax divided by 6 for e4m3 scales),
x divided by the scale, clamped, then cast with round-to-nearest-even.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 value
# The kernels multiply by these reciprocals as fp32 constants. A Python float holding the fp32 value gives
# the same product as an fp32 multiply on both devices (the double product of two fp32 values is exact).
FP8_MAX_INV = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
FP4_MAX_INV = float(torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))
FP8_AMAX_MIN = 1e-4  # an all-zero group still gets a finite scale
FP4_E4M3_AMAX_MIN = 6 * 2**-9  # scale = 2^-9, the smallest e4m3 subnormal
FP4_UE8M0_AMAX_MIN = 6 * 2**-126  # scale = 2^-126, the smallest normal fp32


def pow2ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive normal fp32 v, read off the fp32 bits (spec §2.5): keep the exponent
    field, add one if any mantissa bit is set, clear the mantissa."""
    bits = v.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., N] -> fp32 [..., N/block, block]: the quantisation groups along the last dim."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, nearest-even with saturation (a plain cast would turn overflow into NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_quantize_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 groups [..., G, block] -> (e4m3 codes [..., G, block], fp32 power-of-two scales [..., G, 1]).
    The ue8m0 rule of spec §2.5a: s = pow2ceil(max(amax, 1e-4) * fp32(1/448))."""
    amax = g.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_MIN)
    scale = pow2ceil(amax * FP8_MAX_INV)
    return _to_e4m3(g / scale), scale


def act_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Spec §2.5a: FP8 e4m3 with one ue8m0 scale per `block` elements, quantised and dequantised.

    y = e4m3(clamp(x/s, ±448))·s with s = pow2ceil(max(amax, 1e-4)·fp32(1/448)); returned in x's dtype.
    Official use: `act_quant(kv, 32, "ue8m0", e8m0, inplace=True)` on the window KV after RoPE."""
    codes, scale = _fp8_quantize_groups(_groups(x, block))
    return (codes.float() * scale).flatten(-2).to(x.dtype)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> the nearest value of the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, sign kept
    (also on zero), ties to the even code (spec §2.5b).

    The grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and within each range an even multiple of
    the spacing is an even code, so torch.round's half-to-even on |v|/spacing gives exactly the ties of
    the FP4 cast: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Powers of two keep it exact."""
    mag = v.abs()
    spacing = torch.full_like(mag, 0.5).masked_fill_(mag >= 2, 1.0).masked_fill_(mag >= 4, 2.0)
    return torch.copysign(torch.round(mag / spacing) * spacing, v)


def fp4_scale(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """fp32 amax per group -> fp32 FP4 scale (spec §2.5b for "e4m3", §2.5c for "ue8m0")."""
    if scale_fmt == "e4m3":
        # s = e4m3(max(amax, 6*2^-9) / 6). A true division, by a device tensor: torch turns a division by
        # a Python scalar into a multiply by its reciprocal on CUDA, which can round differently.
        amax = amax.clamp_min(FP4_E4M3_AMAX_MIN)
        return _to_e4m3(amax / amax.new_full((), FP4_MAX)).float()
    if scale_fmt == "ue8m0":
        return pow2ceil(amax.clamp_min(FP4_UE8M0_AMAX_MIN) * FP4_MAX_INV)
    raise ValueError(f"unknown FP4 scale format {scale_fmt!r}; use 'e4m3' or 'ue8m0'")


def act_quant_fp4(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """Spec §2.5b/c: FP4 e2m1 with one scale per `block` elements, quantised and dequantised.

    y = e2m1(clamp(x/s, ±6))·s, returned in x's dtype. Official uses, both after RoPE:
    compressed KV `fp4_act_quant(kv, 16, scale_dtype=e4m3)` -> (x, 16, "e4m3");
    indexer q and k `fp4_act_quant(q, 32)` with e8m0 scales -> (x, 32, "ue8m0")."""
    g = _groups(x, block)  # [..., G, block]
    scale = fp4_scale(g.abs().amax(-1, keepdim=True), scale_fmt)  # [..., G, 1]
    # with an e4m3 scale, s may round below amax/6, so x/s can pass 6: the clamp saturates it
    y = e2m1_round((g / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return y.flatten(-2).to(x.dtype)


def quantize_fp8_e8m0(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §4.1/§8: FP8 storage of an Engram table: fp32 [rows, cols] -> (float8_e4m3fn [rows, cols],
    float8_e8m0fnu [rows, cols/block]), one scale per row group, by the ue8m0 rule of spec §2.5a."""
    codes, scale = _fp8_quantize_groups(_groups(w, block))
    return codes.flatten(-2), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp8_e8m0(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec §4.1: float8_e4m3fn [..., cols] with float8_e8m0fnu [..., cols/block] -> fp32 [..., cols],
    code times its group's scale (exact: a power-of-two scale)."""
    block = weight.shape[-1] // scale.shape[-1]
    values = weight.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)
    return values.flatten(-2)


# ---- weight storage of the released checkpoint (spec §5 "Storage", §9 convert.py) ----------------
# Dense linears: FP8 e4m3 codes with one e8m0 scale per 32x32 tile. Routed experts: FP4 e2m1 codes packed
# two per byte (the even element in the low nibble) with one e8m0 scale per 32 values along K. The scale
# rule is the ue8m0 one of spec §2.5a/c, so every tile's largest value fits the format.
WEIGHT_TILE = 32
FP4_WEIGHT_GROUP = 32
# e2m1 value of each 4-bit code: bit 3 is the sign, bits 0-2 index the grid (spec §2.5b)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32)


def quantize_fp8_tiles(w: torch.Tensor, tile: int = WEIGHT_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/tile), in/tile]): one scale per
    tile x tile block, s = pow2ceil(max(amax, 1e-4)·fp32(1/448)). A last partial row of tiles is padded
    with zeros, as the official `Linear` sizes its scale with a ceiling."""
    rows = w.shape[0]
    padded = torch.nn.functional.pad(w.float(), (0, 0, 0, -rows % tile))
    blocks = _groups(padded, tile).unflatten(0, (-1, tile)).transpose(1, 2)  # [R, C, tile(out), tile(in)]
    codes, scale = _fp8_quantize_groups(blocks.flatten(-2))  # [R, C, tile·tile], [R, C, 1]
    codes = codes.unflatten(-1, (tile, tile)).transpose(1, 2).flatten(0, 1).flatten(-2)  # back to [out+pad, in]
    return codes[:rows], scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp8_tiles(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [out, in] with its e8m0 tile scales -> fp32 [out, in] (exact: power-of-two scales)."""
    rows, cols = codes.shape
    tile = cols // scale.shape[1]
    s = scale.float().repeat_interleave(tile, dim=0)[:rows].repeat_interleave(tile, dim=1)
    return codes.float() * s


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Values on the e2m1 grid [..., K] -> uint8 [..., K/2], two codes a byte, the even element in the low
    nibble (what `torch.float4_e2m1fn_x2` and DeepSeek's convert.py use)."""
    grid = E2M1_TABLE[:8].to(values.device)
    codes = torch.searchsorted(grid, values.abs().float().contiguous()).to(torch.uint8)
    codes |= torch.signbit(values).to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (or any 1-byte view) [..., K/2] -> fp32 [..., K]: the inverse of pack_e2m1."""
    b = packed.view(torch.uint8)
    return torch.stack([_e2m1_value(b & 0x0F), _e2m1_value(b >> 4)], dim=-1).flatten(-2)


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> fp32 values, computed on the codes' device (no table copy, so a CUDA graph can
    capture it): exponent bits 1-2, mantissa bit 0 (0 and 0.5 when the exponent is 0), sign bit 3."""
    e, m = ((code >> 1) & 3).int(), (code & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.ldexp(1 + 0.5 * m, e - 1))
    return torch.where((code & 8) != 0, -mag, mag)


def quantize_fp4_e8m0(w: torch.Tensor, group: int = FP4_WEIGHT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (uint8 [out, in/2] packed e2m1 codes, float8_e8m0fnu [out, in/group]): one scale per
    `group` values along K, s = pow2ceil(max(amax, 6·2^-126)·fp32(1/6)) (the rule of spec §2.5c)."""
    g = _groups(w, group)  # [out, in/group, group]
    scale = fp4_scale(g.abs().amax(-1, keepdim=True), "ue8m0")
    values = e2m1_round((g / scale).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return pack_e2m1(values), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp4_e8m0(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [out, in/2] with e8m0 scales [out, in/group] -> fp32 [out, in] (exact)."""
    values = unpack_e2m1(packed)
    return values * scale.float().repeat_interleave(values.shape[-1] // scale.shape[-1], dim=-1)
