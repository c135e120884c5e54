"""Rotary embeddings with YaRN (spec §2.2), as DeepSeek's inference/model.py builds and applies them.

The table is built in fp32 and applied in complex64 on the last `rope_head_dim` dims, adjacent
(even, odd) pairs taken as complex numbers; each rotation rounds once back to the input dtype.
"""
from __future__ import annotations

import math

import torch

from model.config import ModelArgs


def rope_table(args: ModelArgs, compress_ratio: int, device=None) -> torch.Tensor:
    """complex64 [max_seq_len, R/2]: exp(i·p·θ_k) for every position p (spec §2.2).

    Ratio-0 layers use `rope_theta` without YaRN; layers with ratio > 0 use `compress_rope_theta`
    with YaRN, for q, window KV, compressed latents and index q/k alike.
    """
    dim = args.rope_head_dim
    base = args.compress_rope_theta if compress_ratio else args.rope_theta
    original = args.original_seq_len if compress_ratio else 0
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original > 0:
        def corrected_dim(rotations: float) -> float:  # the pair completing `rotations` turns in `original`
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(args.beta_fast)), 0)
        high = min(math.ceil(corrected_dim(args.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp  # this form (not one in `ramp`) gives the official bits
        freqs = freqs / args.rope_factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(args.max_seq_len), freqs)  # fp32: one product per (p, k)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last R dims of `x` in place and return it.

    x: [..., S, R] or [..., S, H, R] (a view into a larger tensor is fine); freqs: complex [..., S, R/2],
    broadcast over the head dim when x has one. `inverse` conjugates (used on the attention output).
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [..., R/2] complex64
    if inverse:
        freqs = freqs.conj()
    if xc.dim() == freqs.dim() + 1:  # x has a head dim
        freqs = freqs.unsqueeze(-2)
    x.copy_(torch.view_as_real(xc * freqs).flatten(-2))
    return x
