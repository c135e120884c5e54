"""Hyper-connections (mHC, spec §3; mirrors DeepSeek's inference/model.py): the residual stream as `hc_mult` copies.

Mirrors `Block.hc_mixes/hc_pre/hc_post` of DeepSeek's inference/model.py and the `hc_split_sinkhorn`
kernel. The stream is bf16; the coefficients stay fp32 and are never rounded.
"""
from __future__ import annotations

import torch

from kernels import hc as hc_kernel
from model import invariant  # batch-invariant mode hooks (issue #11)
from model.attention import use_fused

USE_KERNEL = True  # CUDA: kernels/hc.py's mixes, collapse, expand (and handoff); False keeps the torch ops


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             hc: int, iters: int, hc_eps: float, norm_eps: float):
    """(pre [..,hc], post [..,hc], comb [..,hc,hc]) from the stream h [..., hc, d] (spec §3 Mixes, Split).

    One rsqrt statistic per token over all hc·d values; comb is made doubly stochastic by Sinkhorn:
    a row softmax (+eps), a column normalisation, then iters-1 rounds of rows then columns.
    """
    if h.is_cuda and USE_KERNEL:  # two Triton launches instead of ~95 ops (kernels/hc.py)
        return hc_kernel.hc_split_sinkhorn(hc_kernel.hc_mixes(h, fn, norm_eps), scale, base, hc, iters, hc_eps)
    x = h.flatten(-2).to(torch.promote_types(fn.dtype, torch.float32))  # fp32 (fp64 with an fp64 fn: tests)
    mixes = invariant.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre = invariant.pointwise(torch.sigmoid, mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps  # torch.sigmoid(..)
    post = 2 * invariant.pointwise(torch.sigmoid, mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))  # [.., j, k]
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse: Σ_j pre_j·h_j in fp32, rounded to bf16. [..., hc, d] x [..., hc] -> [..., d]."""
    if h.is_cuda and USE_KERNEL:
        return hc_kernel.hc_pre(h, pre)
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: copy k = post_k·y + Σ_j comb[j,k]·h_j in fp32, rounded once. y [..., d], h [..., hc, d]."""
    if y.is_cuda and USE_KERNEL:
        return hc_kernel.hc_post(y, h, post, comb)
    out = post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * h.unsqueeze(-2)).sum(-3)
    return out.to(y.dtype)


def handoff(y: torch.Tensor | None, h: torch.Tensor, post: torch.Tensor | None, comb: torch.Tensor | None,
            fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, hc_eps: float,
            norm_eps: float, pre: torch.Tensor, norm=None):
    """From one sublayer to the next (spec §3): the expand of y into the stream (y None: the stream is h, as at
    a block's start), the next sublayer's mixes from that stream, and its input before the norm, hc_pre(stream,
    pre). -> (stream, (pre, post, comb) of the next sublayer, that input, and with `norm` (the sublayer's
    RMSNorm) that input normed, else None). With the fused launches on (model/attention.py FUSED_LAUNCHES,
    CUDA): one launch (kernels/hc.py hc_handoff), the norm in it; `norm` is still called, on the input with the
    kernel's result (RMSNorm's `normed`), so that hooks on it see what they would."""
    if USE_KERNEL and use_fused(h):
        h, mixes, x, *normed = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, iters, hc_eps, norm_eps,
                                                    *((norm.weight, norm.eps) if norm is not None else (None, 0.0)),
                                                    batch_invariant=invariant.enabled())
        return h, mixes, x, None if norm is None else norm(x, normed=normed[0])
    h = hc_post(y, h, post, comb) if y is not None else h
    x = hc_pre(h, pre)
    return h, hc_mixes(h, fn, scale, base, hc, iters, hc_eps, norm_eps), x, None if norm is None else norm(x)


def identity_pre_mix(h: torch.Tensor) -> torch.Tensor:
    """The first block's attention collapse: one-hot on copy 0 (spec §3, make_identity_pre_mix)."""
    pre = torch.zeros(h.shape[:-1], dtype=torch.float32, device=h.device)
    pre[..., 0] = 1.0
    return pre
