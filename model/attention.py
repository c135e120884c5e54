"""Attention of DeepSeek-V4.1 (spec §2), mirroring DeepSeek's inference/model.py: the math both model forms share.

Mirrors `Attention`, `Compressor`, `Indexer`, `select_candidate_blocks` and the `sparse_attn` kernel of
DeepSeek's inference/model.py and kernel.py. The modules hold parameters and per-token projections
only; where the state comes from (a whole sequence in model/reference.py, paged blocks and state slots
in model/paged.py) is the caller's business. All functions take a batch dim B and a token dim S.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import attention as attention_kernel, indexer as indexer_kernel, latent as latent_kernel, \
    norm as norm_kernel, output as output_kernel, quant as quant_kernel, rope as rope_kernel
from model import invariant  # batch-invariant mode hooks (issue #11)
from model.config import ModelArgs, cdiv
from model import quant as model_quant
from model.rope import apply_rope

SPARSE_ATTN_BLOCK = 64  # the kernel's online softmax walks the index list in blocks of 64 (spec §2.8)
# CUDA: the Triton kernels of kernels/ (quantisation sims bit for bit; RMSNorm, RoPE and sparse attention
# within fp32 rounding). False keeps the torch ops everywhere (the benchmarks' "before"). CPU always uses torch.
USE_KERNELS = True
# CUDA, issue #20 item 5: the fused launches (kernels/hc.py handoff with the sublayers' norms, engram.py,
# latent.py, paged.py, the decode top-k of indexer.py, the gate of moe.py, output.py's inverse RoPE and wo_a).
# They move CUDA bits (the H200 example trace is recorded with them on); False gives the separate launches of
# before (bench_decode.py's "unfused", tests/gpu's comparisons).
FUSED_LAUNCHES = True


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and USE_KERNELS


def use_fused(x: torch.Tensor) -> bool:
    return use_kernels(x) and FUSED_LAUNCHES


def use_attention_kernel(q: torch.Tensor, head_dim: int | None = None) -> bool:
    """Sparse attention through kernels/attention.py: CUDA, bf16, a power-of-two head dim (q's last, or
    `head_dim` when q is the layer's input, before its queries exist)."""
    return USE_KERNELS and attention_kernel.applies(q, head_dim)


def rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Spec §2.2 in place on x (the last R dims of a tensor): model/rope.py on CPU, one launch on CUDA."""
    if use_kernels(x) and rope_kernel.applies(x, freqs):
        return rope_kernel.apply_rope(x, freqs, inverse)
    return apply_rope(x, freqs, inverse)


def norm_rope_quant(x: torch.Tensor, norm: "RMSNorm | None", freqs: torch.Tensor, rope_dim: int, quant: str,
                    block: int, store_at: tuple | None = None) -> torch.Tensor:
    """A new tensor: x normed (norm None: not), its last rope_dim values rotated (spec §2.2), then the FP8
    (quant "fp8") or FP4 (scale format "ue8m0" or "e4m3") sim per `block` values; x is left as it is.
    `store_at` (table, i, j): the result also goes to table[i, j] (a paged cache's rows; i, j index x's rows).
    With the fused launches on (FUSED_LAUNCHES, CUDA): one launch (kernels/latent.py), the store in its last
    step; else the ops in turn and an index_put."""
    if use_fused(x) and latent_kernel.applies(x, rope_dim, block, store_at):
        return latent_kernel.norm_rope_quant(x, norm, freqs, rope_dim, quant, block, store_at=store_at)
    x = x.clone() if norm is None else norm(x)
    rope(x[..., -rope_dim:], freqs)
    quantise = quant_kernel if use_kernels(x) else model_quant  # CUDA: the same bits in one launch
    x = quantise.act_quant_fp8(x, block) if quant == "fp8" else quantise.act_quant_fp4(x, block, quant)
    if store_at is not None:
        store_at[0][store_at[1:]] = x  # table[i, j] = x
    return x


class Linear(nn.Module):
    """y = x·Wᵀ without bias; `weight` [out, in] in its storage dtype (bf16 or fp32 here)."""

    def __init__(self, in_features: int, out_features: int, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(x, self.weight)  # F.linear, or fixed row tiles in the mode


class RMSNorm(nn.Module):
    """w ⊙ x·rsqrt(mean(x²)+eps), computed in fp32, returned in x's dtype (spec §6)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """`normed`: this norm of x as a fused kernel computed it (kernels/hc.py hc_handoff), returned as it is:
        the module is still called, so that its hooks see x and the result (tracing/divergence.py taps x)."""
        if normed is not None:
            return normed
        if use_kernels(x):
            return norm_kernel.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Compressor(nn.Module):
    """Pools `ratio` tokens into one pre-RoPE latent (spec §2.4); kv-source layers only."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.ratio = args.compress_ratios[layer]
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        # ratio 1 is a plain bf16 projection; ratio 2 pools in fp32 with fp32 weights
        self.wkv = Linear(args.dim, args.head_dim, torch.float32 if self.ratio > 1 else torch.bfloat16)
        if self.ratio > 1:
            self.wgate = Linear(args.dim, args.head_dim, torch.float32)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x bf16 [B,S,d] -> (a, g): fp32 [B,S,D] each for ratio > 1; (bf16 a, None) for ratio 1."""
        if self.ratio == 1:
            return self.wkv(x), None
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def pool(self, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """Group members -> normalised latent. a, g: [..., r, D] (fp32), or a bf16 [..., D] for ratio 1.
        Each channel takes a softmax over the r members (spec §2.4); returns bf16 [..., D]."""
        if g is None:
            return self.norm(a)
        pooled = invariant.reduce_sum(a * invariant.softmax(g, -2), -2)  # (a * g.softmax(-2)).sum(-2) outside the mode
        return self.norm(pooled.to(self.norm.weight.dtype))  # bf16, or fp32 in the fp32 debugging mode


class Indexer(nn.Module):
    """Scores compressed entries per query and keeps the top-k (spec §2.6-2.7); index sources only.
    A kv source's indexer also owns the index keys (`wk`, `k_norm`)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.rope_head_dim
        self.wq_b = Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
        self.weights_proj = Linear(args.dim, args.index_n_heads)
        self.owns_keys = args.is_kv_source(layer)
        if self.owns_keys:
            self.wk = Linear(args.head_dim, args.index_head_dim)
            self.k_norm = RMSNorm(args.index_head_dim, args.norm_eps)
        # one constant, formed in double precision and rounded once (spec §2.7)
        self.weight_scale = args.index_head_dim ** -0.5 * args.index_n_heads ** -0.5

    def keys(self, latent: torch.Tensor, freqs: torch.Tensor, store_at: tuple | None = None) -> torch.Tensor:
        """Index keys of new entries: latent bf16 [B,E,D] (pre-RoPE), freqs at positions j·r -> [B,E,Di];
        `store_at` as in `norm_rope_quant`."""
        return norm_rope_quant(self.wk(latent), self.k_norm, freqs, self.rope_dim, "ue8m0", 32, store_at)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor):
        """-> (q [B,S,Hi,Di] FP4-sim bf16, head weights [B,S,Hi] bf16)."""
        q = norm_rope_quant(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), None, freqs, self.rope_dim,
                            "ue8m0", 32)
        return q, self.weights_proj(x) * self.weight_scale


def stream(pool: torch.Tensor, block_tables: torch.Tensor, n_entries: int) -> torch.Tensor:
    """A row's first n_entries entries of a paged pool [blocks, per_block, D], gathered through its block table
    [B, nb]: [B, n, D] (model/paged.py's KV blocks)."""
    return pool[block_tables[:, :cdiv(n_entries, pool.size(1))]].flatten(1, 2)[:, :n_entries]


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                 block_tables: torch.Tensor | None = None, n_entries: int = 0) -> torch.Tensor:
    """score(p, j) = bf16(Σ_h bf16(relu(bf16(q_h·k_j))·w_h)) (spec §2.7), -inf where j >= V(p).

    q [B,S,Hi,Di], w [B,S,Hi], keys [B,E,Di] -> [B,S,E] bf16; visible: [B,S] entry counts V(p).
    With block_tables, keys is a paged pool and E = n_entries (`stream`).
    """
    if USE_KERNELS and indexer_kernel.applies_scores(q, keys):  # CUDA: the lines below in one launch, keys in place
        return indexer_kernel.index_scores(q, w, keys, visible, batch_invariant=invariant.enabled(),
                                           block_tables=block_tables, n_entries=n_entries)
    keys = keys if block_tables is None else stream(keys, block_tables, n_entries)
    d = invariant.index_scores_dot(q, keys)  # einsum bshd,btd->bsht
    # .sum(dim=2) outside the mode; in place: the same bits, 2-4x faster on a long CPU prefill
    score = invariant.reduce_sum(d.relu_().mul_(w.unsqueeze(-1)), 2)
    return score.masked_fill_(torch.arange(keys.size(1), device=keys.device) >= visible.unsqueeze(-1), -torch.inf)


def _top(scores: torch.Tensor, k: int, tie_rule: str = "lower-index", sorted: bool = True) -> torch.Tensor:
    """Indices of the k largest along the last dim, as a set (no promised order). "lower-index": equal scores
    go to the lower index, the project's rule (spec §7.4-2): a top-k over unique int64 keys, the fp32 score's
    order bits (negatives' magnitude flipped, -0.0 made +0.0) above 2^32 - 1 - index, in row slices of
    `_TOP_ELEMENTS`: a stable sort's first k in bounded memory (a [chunk, 1M] sort needs tens of GB).
    "torch": torch.topk's own choice, DeepSeek's; only for comparing with its outputs bit for bit."""
    if tie_rule == "torch":
        return scores.topk(k, dim=-1, sorted=sorted).indices
    flat = scores.reshape(-1, scores.size(-1))
    step, low = max(1, _TOP_ELEMENTS // flat.size(1)), 0xFFFFFFFF - torch.arange(flat.size(1), device=flat.device)
    bits = ((flat[i:i + step].float() + 0.0).view(torch.int32) for i in range(0, max(flat.size(0), 1), step))
    keys = (b.bitwise_xor_((b >> 31).bitwise_and_(0x7FFFFFFF)).long().mul_(1 << 32).add_(low) for b in bits)  # lazily
    return torch.cat([key.topk(k, dim=-1, sorted=False).indices for key in keys]).view(*scores.shape[:-1], k)


_TOP_ELEMENTS = 1 << 25  # scores keyed at once: 32M x ~20 bytes of temporaries


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int,
                            tie_rule: str = "lower-index") -> torch.Tensor:
    """Level 1 of the two-level top-k (spec §2.7): a bool mask [B,S,E] of the kept candidate blocks.

    Block score = max of its entries; the block holding the newest visible entry is forced in; only
    blocks scoring > -inf are kept. With V(p) = 0 no block is forced and the mask is empty.
    """
    width = scores.size(-1)
    blocks = F.pad(scores, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(-1)
    newest = torch.div(visible - 1, block, rounding_mode="floor").unsqueeze(-1)
    blocks = blocks.masked_fill(torch.arange(blocks.size(-1), device=scores.device) == newest, torch.inf)
    top = _top(blocks, min(n_blocks, blocks.size(-1)), tie_rule)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def topk_entries(scores: torch.Tensor, visible: torch.Tensor, k: int, tie_rule: str = "lower-index") -> torch.Tensor:
    """Top-k entry ids [B,S,k] int64 sorted ascending by position, -1 where j >= V(p) (spec §2.7).
    k = min(index_topk, entries); the -1 padding lands at the end of each list. With the fused
    launches on (FUSED_LAUNCHES, CUDA): one launch (kernels/indexer.py), the same list."""
    if tie_rule == "lower-index" and use_fused(scores) and indexer_kernel.applies_topk(scores):
        return indexer_kernel.topk_entries(scores, visible, k)
    idx = _top(scores, k, tie_rule, sorted=False).sort(dim=-1).values
    return torch.where(idx < visible.unsqueeze(-1), idx, -1)


class Attention(nn.Module):
    """Per-layer attention parameters (spec §2.1) and the per-token projections around `sparse_attn`."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.ratio = args.compress_ratios[layer]
        self.attn_sink = nn.Parameter(torch.empty(args.n_heads, dtype=torch.float32))
        self.wq_a = Linear(args.dim, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, args.n_heads * args.head_dim)
        self.wkv = Linear(args.dim, args.head_dim)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wo_a = Linear(args.n_heads * args.head_dim // args.o_groups, args.o_groups * args.o_lora_rank)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.dim)
        self.softmax_scale = args.head_dim ** -0.5
        self.compressor = Compressor(args, layer) if args.is_kv_source(layer) else None
        self.indexer = Indexer(args, layer) if args.is_index_source(layer) else None

    def queries(self, x: torch.Tensor, freqs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x bf16 [B,S,d] -> (qr [B,S,ql] shared with the indexer, q [B,S,H,D] with RoPE). freqs None: q without
        its RoPE (the paged model's sparse attention kernel rotates it as it loads it)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if freqs is not None:
            rope(q[..., -self.rope_dim:], freqs)
        return qr, q

    def window_kv(self, x: torch.Tensor, freqs: torch.Tensor, store_at: tuple | None = None) -> torch.Tensor:
        """The window latent [B,S,D]: kv_norm(x·wkvᵀ), RoPE, then FP8-sim over the whole vector; `store_at` as
        in `norm_rope_quant`."""
        return norm_rope_quant(self.wkv(x), self.kv_norm, freqs, self.rope_dim, "fp8", 32, store_at)

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, grouped low-rank wo_a (block-diagonal, spec §2.9), then wo_b. [B,S,H,D] -> [B,S,d].
        With the fused launches on (FUSED_LAUNCHES, CUDA, outside the batch-invariant mode): the first two in
        one launch (kernels/output.py), o left as it is; else o is rotated in place."""
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        if use_fused(o) and not invariant.enabled() and output_kernel.applies(o, wo_a, self.rope_dim):
            return self.wo_b(output_kernel.rope_wo_a(o, freqs, wo_a, self.rope_dim))
        rope(o[..., -self.rope_dim:], freqs, inverse=True)
        o = o.unflatten(-2, (self.n_groups, -1)).flatten(-2)  # [B,S,G,H·D/G]
        return self.wo_b(invariant.grouped_linear(o, wo_a).flatten(2))  # einsum bsgd,grd->bsgr


def compressed_kv(latent: torch.Tensor, freqs: torch.Tensor, rope_dim: int, store_at=None) -> torch.Tensor:
    """Compressed entries as stored (spec §2.6): RoPE at j·r on a copy of the latent, then FP4 (e4m3/16);
    `store_at` as in `norm_rope_quant`."""
    return norm_rope_quant(latent, None, freqs, rope_dim, "e4m3", 16, store_at)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention over gathered KV rows with a sink (spec §2.8), with the kernel's numerics.

    q [B,S,H,D] bf16, kv [B,N,D] bf16 (key = value), sink [H] fp32, idx [B,S,L] (-1 = skip).
    Online softmax over blocks of 64 indices; probabilities are rounded to bf16 against the running
    max before P·V while the denominator sums fp32 (in q's dtype: fp32 in the fp32 debugging mode).
    Returns [B,S,H,D] in q's dtype; a row with no index gives 0. On CUDA in bf16 one Triton launch
    (kernels/attention.py) with the same numerics up to fp32 rounding.
    """
    if use_attention_kernel(q):
        return attention_kernel.sparse_attn(q, kv, sink, idx, scale)
    idx = invariant.attention_blocks(idx)  # the mode: whole blocks of 64
    B, S, H, D = q.shape
    qf = q.float()
    acc = torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device)
    den = torch.zeros(B, S, H, dtype=torch.float32, device=q.device)
    run_max = torch.full((B, S, H), -1e30, dtype=torch.float32, device=q.device)  # the sink is not in the max
    rows = torch.arange(B, device=q.device).view(B, 1, 1)
    for t in range(0, idx.size(-1), SPARSE_ATTN_BLOCK):
        blk = idx[..., t:t + SPARSE_ATTN_BLOCK].long()
        valid = blk >= 0
        kv_blk = kv[rows, blk.clamp_min(0)].float() * valid.unsqueeze(-1)  # [B,S,k,D]
        s = invariant.attention_scores(qf, kv_blk)  # einsum bshd,bskd->bshk
        s = torch.where(valid.unsqueeze(2), s, -torch.inf) * scale  # an fp32 multiply, as the kernel's
        prev = run_max
        run_max = torch.maximum(prev, s.amax(-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        den = den * rescale + p.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + invariant.attention_values(p.to(q.dtype).float(), kv_blk)
    den = den + torch.exp(sink - run_max)
    return (acc / den.unsqueeze(-1)).to(q.dtype)


def window_index(positions: torch.Tensor, window: int, decode: bool) -> torch.Tensor:
    """Window positions each query attends to, [B,S,W] (-1 = none), in the official order (§2.3).

    Multi-token rows list max(0,p-W+1)+k, positions > p set to -1, so the padding is at the end. One-
    token decode rows list the whole ring from slot p%W+1: positions p-W+1+k, those < 0 set to -1, so
    the padding comes first.
    """
    p = positions.unsqueeze(-1)
    k = torch.arange(window, device=positions.device)
    if decode:
        pos = p - window + 1 + k
        return torch.where(pos >= 0, pos, -1)
    pos = (p - window + 1).clamp_min(0) + k
    return torch.where(pos <= p, pos, -1)


def attention_list(window: torch.Tensor, window_len: torch.Tensor, compressed: torch.Tensor,
                   compressed_len: torch.Tensor) -> torch.Tensor:
    """The index list of each query [B,S,W+K]: its row's first `window_len` window entries, then its
    first `compressed_len` compressed entries, then -1 padding.

    The lengths are the row's own, as the official code computes them for a chunk alone: window
    min(tokens so far, W) (W for a decode row), compressed min(K, tokens so far // r). So the list, and
    with it the kernel's block partition (spec §2.8), is the same whatever else shares the batch.
    window [B,S,W] and compressed [B,S,K] hold indices into the attention's KV rows, -1 = none."""
    W, K = window.size(-1), compressed.size(-1)
    j = torch.arange(W + K, device=window.device)
    wl, cl = window_len.view(-1, 1, 1), compressed_len.view(-1, 1, 1)
    shape = (*window.shape[:2], W + K)
    listed = window.gather(-1, j.clamp(max=W - 1).expand(shape))
    if K:
        from_compressed = compressed.gather(-1, (j - wl).clamp(0, K - 1).expand(shape))
        listed = torch.where(j < wl, listed, torch.where(j - wl < cl, from_compressed, -1))
    return torch.where(j < wl + (cl if K else 0), listed, -1)


def select_entries(args: ModelArgs, block, x, qr, keys, positions, freqs, n_entries: int, shared: dict,
                   block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """An index source's top-k compressed entries per query (spec §2.7, §7.3b): score against its kv
    source's index keys [B,E,Di] (or its paged pool, through block_tables: `index_scores`), candidate blocks at
    the candidate source, level-2 masking after it.
    `shared["candidates"]` carries the mask to later index sources of the same forward.
    Returns entry ids [B,S,min(K,E)] ascending, -1 padded at the end."""
    layer = block.layer
    if n_entries == 0:
        return torch.empty(*x.shape[:2], 0, dtype=torch.long, device=x.device)
    q, w = block.attn.indexer.queries(x, qr, freqs)
    visible = (positions + 1) // block.attn.ratio  # V(p): groups whose last token is <= p
    scores = index_scores(q, w, keys, visible, block_tables, n_entries)
    if layer == args.candidate_source_layer:
        shared["candidates"] = select_candidate_blocks(scores, visible, args.candidate_topk_blocks,
                                                       args.candidate_block_size, args.topk_tie_rule)
        shared["capture"](layer, "candidates", shared["candidates"])
    elif args.uses_candidates(layer):
        scores = scores.masked_fill_(~shared["candidates"], -torch.inf)
    shared["capture"](layer, "index_scores", scores)
    return topk_entries(scores, visible, min(args.index_topk, n_entries), args.topk_tie_rule)
