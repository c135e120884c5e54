"""Mixture of experts (spec §5): the sqrt-softplus gate and clamped SwiGLU experts.

Mirrors `Gate`, `Expert` and `MoE` of DeepSeek's inference/model.py. Two dispatch paths give the same
bits: on CPU each expert runs on its own rows (the official loop), on CUDA every expert runs on every
row with the unselected rows masked out, so the forward has fixed shapes and no host synchronisation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import Linear
from model.config import ModelArgs


class Gate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.topk, self.temp, self.route_scale = args.n_activated_experts, args.gate_temp, args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,d] -> (weights fp32 [N,k], expert ids [N,k] in descending biased score)."""
        scores = F.softplus(F.linear(x.float(), self.weight.float()) / self.temp).sqrt()
        ids = (scores + self.bias).topk(self.topk, dim=-1).indices  # the bias only steers selection
        w = scores.gather(1, ids)
        if self.norm_topk_prob and self.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.route_scale, ids


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter_dim), Linear(inter_dim, dim), Linear(dim, inter_dim)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU with clamps; the routing weight scales the hidden before w2 (spec §5). bf16 out."""
        g, u = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            u, g = u.clamp(-self.limit, self.limit), g.clamp(max=self.limit)
        hidden = F.silu(g) * u
        if weight is not None:
            hidden = weight * hidden
        return self.w2(hidden.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                     for _ in range(args.n_routed_experts))
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [..., d]. Routed outputs are added in ascending expert id, the shared expert last,
        in fp32, rounded once (spec §5)."""
        shape, x = x.shape, x.reshape(-1, x.size(-1))
        weights, ids = self.gate(x)
        y = torch.zeros_like(x, dtype=torch.float32)
        if x.is_cuda:  # fixed shapes: every expert on every row, unselected rows add exactly 0
            for e, expert in enumerate(self.experts):
                w = (weights * (ids == e)).sum(-1, keepdim=True)
                y += torch.where(w > 0, expert(x, w).float(), 0.0)
        else:
            for e in torch.unique(ids).tolist():
                rows, slot = torch.where(ids == e)
                y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)
