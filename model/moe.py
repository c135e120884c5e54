"""Mixture of experts (spec §5; mirrors DeepSeek's inference/model.py): sqrt-softplus gate, clamped SwiGLU experts.

Mirrors `Gate`, `Expert` and `MoE` of DeepSeek's inference/model.py. Dispatch paths:
- CPU: each expert runs on its own rows (the official loop); the bits the CPU tests pin.
- CUDA, grouped (the default): every expert and the shared one run on every row in two batched GEMMs
  over stacked copies of their weights (one [E+1, 2·inter, d] w1|w3, one [E+1, d, inter] w2), and each
  row keeps its own k outputs. The per-row arithmetic is the official one (routing weight on the fp32
  hidden, fp32 sum in ascending expert id, the shared expert last, one rounding), so only the GEMM
  kernels' accumulation order can differ from the CPU. Fixed shapes, no host synchronisation: a CUDA
  graph captures it. At tiny-68m's size computing all 16 experts densely costs less than sorting rows.
  Between the GEMMs, one Triton launch does the SwiGLU and the routing weight (kernels/moe.py).
- CUDA, grouped, FP4 experts (the released storage, model/released.py): rows sorted by expert and each
  selected expert's FP4 weights decoded in registers by kernels/fp4_moe.py (no bf16 copy of any expert);
  the shared expert through its FP8Linears. The batch-invariant mode keeps the masked path for FP4 experts
  (the kernel's row tiles depend on the batch).
- CUDA, masked (`MoE.grouped = False`, kept for the benchmarks' "before"): the same, one expert at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fp4_moe
from kernels import moe as moe_kernel
from model import invariant  # batch-invariant mode hooks (issue #11)
from model.attention import Linear, use_fused
from model.config import ModelArgs
from model.parallel import Shard, moe_forward


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place write counter, for cache keys; inference tensors (created under
    torch.inference_mode, e.g. a shard's weights) have none and are never written in place."""
    return -1 if t.is_inference() else t._version


class Gate(nn.Module):
    fused = True  # CUDA: Triton launches (kernels/moe.py `gate`, or `route` after the softplus); False: torch ops

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.topk, self.temp, self.route_scale = args.n_activated_experts, args.gate_temp, args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32))
        self._weight_fp32: tuple | None = None

    def weight_fp32(self) -> torch.Tensor:
        """The gate weight upcast once (the official gate runs in fp32), redone when the weight changes."""
        key = (self.weight.data_ptr(), _version(self.weight), self.weight.dtype)
        if self._weight_fp32 is None or self._weight_fp32[0] != key:
            self._weight_fp32 = (key, self.weight.float())
        return self._weight_fp32[1]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,d] -> (weights fp32 [N,k], expert ids [N,k] in descending biased score). With the fused launches
        on (model/attention.py FUSED_LAUNCHES, CUDA): the lines below in one launch (kernels/moe.py `gate`;
        two beyond 128 experts), the logits by FMA chains whatever the tile, so batch-invariant, except outside
        the batch-invariant mode a prefill chunk's and beyond 128 experts every step's, on the tensor cores
        (kernels/moe.py use_tensor_cores)."""
        if self.fused and use_fused(x):
            return moe_kernel.gate(x, self.weight, self.bias, self.temp, self.topk, self.norm_topk_prob,
                                   self.route_scale, batch_invariant=invariant.enabled())
        logits = invariant.linear(x.float(), self.weight_fp32())  # F.linear outside the mode
        softplus = invariant.pointwise(F.softplus, logits if self.temp == 1 else logits / self.temp)  # x/1 skipped
        if softplus.is_cuda and self.fused:
            return moe_kernel.route(softplus, self.bias, self.topk, self.norm_topk_prob, self.route_scale)
        scores = softplus.sqrt()
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
        hidden = invariant.pointwise(F.silu, g) * u  # F.silu(g) outside the mode
        if weight is not None:
            hidden = weight * hidden
        return self.w2(hidden.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard = Shard()):
        super().__init__()
        self.gate = Gate(args)
        # EP (model/parallel.py): this rank's experts only; the others stay None, as in the official MoE
        self.shard, self.local_experts = shard, shard.experts(args.n_routed_experts)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                     if e in self.local_experts else None for e in range(args.n_routed_experts))
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
        self._stacked: tuple | None = None  # (key, w13, w2): see stacked_weights

    grouped = True       # CUDA dispatch: batched GEMMs over stacked weights (False: one expert at a time)
    fused_activation = True  # CUDA, grouped: the SwiGLU and routing weight in one Triton launch, the combine in another
    GROUPED_ROWS = 8192  # rows per grouped pass: bounds the [rows, E+1, 2·inter] fp32 temporaries in prefill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [..., d]. Routed outputs are added in ascending expert id, the shared expert last,
        in fp32, rounded once (spec §5)."""
        if self.shard.world_size > 1:  # EP x DP: every rank's rows through this rank's experts
            return moe_forward(self, x)
        shape, x = x.shape, x.reshape(-1, x.size(-1))
        weights, ids = self.gate(x)
        if x.is_cuda and self.grouped and fp4_moe.fp4_experts(self):
            if fp4_moe.applies(x) and not invariant.enabled():
                return fp4_moe.moe_forward(self, x, weights, ids).view(shape)
        elif x.is_cuda and self.grouped:
            return self.grouped_forward(x, weights, ids).to(x.dtype).view(shape)
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

    # ---- grouped CUDA path ------------------------------------------------------------------------------
    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked copies of the routed experts' weights with the shared expert last (index E):
        w13 [(E+1)·2·inter, d] (each expert's w1 rows, then its w3 rows) and w2 [E+1, d, inter].
        Not parameters (the checkpoint's tree is unchanged); rebuilt when a weight tensor changes."""
        experts = [*self.experts, self.shared_experts]
        params = [p for e in experts for p in (e.w1.weight, e.w3.weight, e.w2.weight)]
        key = tuple((p.data_ptr(), _version(p)) for p in params)  # host-side: no device access
        if self._stacked is None or self._stacked[0] != key:
            w13 = torch.cat([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            self._stacked = (key, w13, torch.stack([e.w2.weight for e in experts]))
        return self._stacked[1], self._stacked[2]

    def grouped_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed + shared output [N, d], fp32 (x's dtype from the fused CUDA path, which rounds once in its
        combine), for x bf16 [N, d], weights fp32 [N, k], ids [N, k];
        rows in passes of GROUPED_ROWS (a split that depends on shapes only). In the batch-invariant mode
        both GEMMs are kernels/gemm.py's, whose rows never see each other; in the mode's torch path every
        pass has exactly invariant.MOE_ROW_TILE rows instead (the last zero-padded, its padding routed to
        expert 0 with weight 0 and cut off), so both GEMMs have one shape whatever the batch."""
        if invariant.enabled() and x.size(0) and not invariant.kernel_gemm(x, self.stacked_weights()[0]):
            N, tile = x.size(0), invariant.MOE_ROW_TILE
            x, weights, ids = (invariant.padded_rows(t, tile) for t in (x, weights, ids))
            return torch.cat([self._grouped_pass(*(t[i:i + tile] for t in (x, weights, ids)))
                              for i in range(0, x.size(0), tile)])[:N]
        if x.size(0) > self.GROUPED_ROWS:
            return torch.cat([self.grouped_forward(*(t[i:i + self.GROUPED_ROWS] for t in (x, weights, ids)))
                              for i in range(0, x.size(0), self.GROUPED_ROWS)])
        return self._grouped_pass(x, weights, ids)

    def _grouped_pass(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One grouped pass over every row of x (grouped_forward's contract)."""
        N, E, limit = x.size(0), len(self.experts), self.shared_experts.limit
        w13, w2 = self.stacked_weights()
        gu = invariant.linear(x, w13).unflatten(-1, (E + 1, 2, -1))  # [N, E+1, 2, inter]: bf16, as w1(x), w3(x)
        if x.is_cuda and self.fused_activation:  # the lines below in one launch (kernels/moe.py)
            hidden = moe_kernel.swiglu_route(gu, ids, weights, limit)  # [E+1, N, inter]
        else:
            g, u = gu[:, :, 0].float(), gu[:, :, 1].float()
            if limit > 0:
                u, g = u.clamp(-limit, limit), g.clamp(max=limit)
            route = torch.zeros(N, E + 1, dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
            route[:, E] = 1.0  # the shared expert is unweighted; x * 1.0 is exact
            hidden = (route.unsqueeze(-1) * (F.silu(g) * u)).to(x.dtype).transpose(0, 1)  # [E+1, N, inter]
        out = invariant.bmm_nt(hidden, w2)  # [E+1, N, d] bf16: each expert's w2 (torch.bmm outside the mode)
        if x.is_cuda and self.fused_activation:  # the lines below and forward's cast in one launch, the same adds
            return moe_kernel.combine(out, ids, x.dtype)  # (kernels/moe.py): x's dtype, rounded once as .to(x.dtype)
        picked = out[ids.sort(dim=-1).values, torch.arange(N, device=x.device)[:, None]]  # [N, k, d]
        y = torch.zeros(N, x.size(1), dtype=torch.float32, device=x.device)
        for j in range(ids.size(1)):  # ascending expert id, as the official loop adds them
            y += picked[:, j]
        return y + out[E]  # the shared expert last
