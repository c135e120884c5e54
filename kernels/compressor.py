"""A decode row's compressor step at ratio 2 in one launch (spec §2.4; DeepSeek's inference/model.py `Compressor`
at decode): the group's two members from the slot's tail and this token, the softmax pool over them, RMSNorm,
and this token's projections into the tail when its group stays open.

model/paged.py `compress` does it as about a dozen launches a layer: the tail gathered per state slot, a cat,
a gather of the members, softmax, product, sum, a cast, the norm, and two index_put into the tails. Each is
a few microseconds of latency at decode, where the rows are few (issue #20 item 5).

Numerics: the torch path's bit for bit (tests/gpu compares them). With two members, torch's softmax and sum
leave nothing to order: its max is exact, its sum of two exponentials and its sum of two products start from
+0 and add two values, which commute (so a sum that is zero is +0, as here); the exponential is libdevice's
expf (torch's std::exp), the division correctly rounded, and the products are rounded before the add, as
torch's separate multiply rounds them. The cast rounds to nearest even and the norm is
kernels/norm.py's code on the same [ROWS, D] tile of whole rows. Ratio 2 only: more members would be summed
in an order torch's reductions choose by shape.
"""
import os

import torch

try:  # Triton ships Linux wheels only; elsewhere model/paged.py's torch path is the only path.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kernels.latent import rows_a_program
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _member(here, tail_ptr, slot, m, live, cols, D: tl.constexpr):
        """Member m of each row's group from [tail (2 rows of D) | this token's `here`]: fp32 [ROWS, D]."""
        in_tail = (m < 2)[:, None] & live[:, None]
        from_tail = tl.load(tail_ptr + (slot * 2 + m)[:, None] * D + cols[None, :], mask=in_tail, other=0.0)
        return tl.where(in_tail, from_tail, here)

    @triton.jit
    def _pool2_decode_kernel(a_ptr, g_ptr, tail_a_ptr, tail_g_ptr, slots_ptr, members_ptr, tail_slots_ptr,
                             tail_at_ptr, w_ptr, out_ptr, n_rows, eps, D: tl.constexpr, ROWS: tl.constexpr,
                             COMPILED: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] decode rows, one token each
        live = rows < n_rows
        cols = tl.arange(0, D)
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        a_here = tl.load(a_ptr + offs, mask=live[:, None], other=0.0)  # this token's projections
        g_here = tl.load(g_ptr + offs, mask=live[:, None], other=0.0)
        slot = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)
        m0 = tl.load(members_ptr + rows * 2, mask=live, other=2).to(tl.int64)
        m1 = tl.load(members_ptr + rows * 2 + 1, mask=live, other=2).to(tl.int64)
        a0 = _member(a_here, tail_a_ptr, slot, m0, live, cols, D)
        a1 = _member(a_here, tail_a_ptr, slot, m1, live, cols, D)
        g0 = _member(g_here, tail_g_ptr, slot, m0, live, cols, D)
        g1 = _member(g_here, tail_g_ptr, slot, m1, live, cols, D)
        # softmax over the two members per channel, then the weighted sum (model/attention.py Compressor.pool);
        # compiled, libdevice's expf (tl.exp is an ex2.approx) and products that ptxas may not fuse into the add
        top = tl.maximum(g0, g1)
        if COMPILED:
            e0, e1 = libdevice.exp(g0 - top), libdevice.exp(g1 - top)
        else:  # Triton's interpreter (CPU tests) has no libdevice: numpy's exp, and no fused multiply-add
            e0, e1 = tl.exp(g0 - top), tl.exp(g1 - top)
        total = e0 + e1
        s0, s1 = tl.div_rn(e0, total), tl.div_rn(e1, total)
        if COMPILED:
            pooled = libdevice.mul_rn(a0, s0) + libdevice.mul_rn(a1, s1)
        else:
            pooled = a0 * s0 + a1 * s1
        pooled = tl.where(pooled == 0.0, 0.0, pooled)  # torch's sum starts from +0: never -0
        # kernels/norm.py on the bf16 pooled rows
        x = pooled.to(out_ptr.dtype.element_ty).to(tl.float32)
        mean = tl.div_rn(tl.sum(x * x, axis=1), tl.full([], D, tl.float32))
        y = x * tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
        w = tl.load(w_ptr + cols).to(tl.float32)
        tl.store(out_ptr + offs, (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.debug_barrier()  # every member read before this token's projections go into the tail
        tail = (tl.load(tail_slots_ptr + rows, mask=live, other=0).to(tl.int64) * 2 +
                tl.load(tail_at_ptr + rows, mask=live, other=0).to(tl.int64))[:, None] * D + cols[None, :]
        tl.store(tail_a_ptr + tail, a_here, mask=live[:, None])
        tl.store(tail_g_ptr + tail, g_here, mask=live[:, None])


def applies(a: torch.Tensor, g: torch.Tensor | None, tails: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """CUDA one-token rows ([B, 1, D]: a decode step's) at ratio 2: fp32 projections and tails
    ([slots + 1, 2, D], contiguous), a power-of-two D of at least 16."""
    D = a.size(-1)
    return (triton is not None and g is not None and a.is_cuda and a.dim() == 3 and a.size(1) == 1 and D >= 16
            and D & (D - 1) == 0 and a.dtype == g.dtype == torch.float32
            and all(t.dtype == torch.float32 and t.shape[1:] == (2, D) and t.is_contiguous() for t in tails))


def pool_decode(a: torch.Tensor, g: torch.Tensor, tails: tuple[torch.Tensor, torch.Tensor], state_slots: torch.Tensor,
                at: dict, norm) -> torch.Tensor:
    """The pooled, normed latent [B, 1, D] (in the norm's dtype) of one-token rows' projections a, g fp32
    [B, 1, D]. `at`: model/paged.py `compress_addresses` at ratio 2: "members" [B, 1, 2] index [the slot's
    tail | this token]; this token's a and g go to tails[i][at["tail_slots"], at["tail_at"]] (the trash slot
    for a group that closed). `norm`: the compressor's RMSNorm module."""
    tail_a, tail_g = tails
    B, _, D = a.shape
    out = torch.empty(B, 1, D, dtype=norm.weight.dtype, device=a.device)
    rows = rows_a_program(B, D)
    if B:
        _pool2_decode_kernel[(triton.cdiv(B, rows),)](
            a.contiguous(), g.contiguous(), tail_a, tail_g, state_slots.contiguous(), at["members"].contiguous(),
            at["tail_slots"].contiguous(), at["tail_at"].contiguous(), norm.weight, out, B, norm.eps, D=D,
            ROWS=rows, COMPILED=os.environ.get("TRITON_INTERPRET") != "1")
    return out
