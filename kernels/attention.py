"""Sparse attention with a sink (spec §2.8) as one Triton kernel (mirrors `sparse_attn` of DeepSeek's kernel.py).

The gather of each query's KV rows, the scores, the online softmax and P·V, with the numerics of
model/attention.py's `sparse_attn`.

Mirrors the `sparse_attn` kernel of DeepSeek's inference/kernel.py. The torch path materialises every
query's gathered rows ([B, S, 64, D] fp32 per block of the index list) and runs ~75 small ops per
layer; this kernel reads each listed row once, where it lies (the paged model's window ring, this
chunk's latents or the compressed entries in their KV blocks, through the block table: no gathered or
concatenated copy), and keeps the running max, denominator and accumulator in registers. One program
per query token and block of heads (`config`: at least 16 rows for the tensor cores); a block of heads
shares each gathered block of rows. At D = 512 all 64 heads in one block on 8 warps (not 4) hold the
[heads, D] fp32 accumulator without spilling; a decode step outside the batch-invariant mode takes 32
(`DECODE_WIDE`), and a GPU that cannot hold a tile's shared memory half its heads (kernels/fit.py; sm_100).

Numerics, as the torch path: blocks of 64 indices in list order; scores from bf16 q and bf16 rows with
fp32 accumulation, masked to -inf where the index is -1, then times the scale in fp32; the running max
starts at -1e30 and leaves the sink out; probabilities exp(s - max) summed in fp32 for the denominator and
rounded to bf16 for P·V (fp32 accumulation); the sink joins the denominator last. Dot products and exp
may round differently from torch's (accumulation order, the exp implementation), so results agree
within fp32 rounding before the final bf16 rounding, not bit for bit. bf16 only: the fp32 debugging mode
keeps the torch path.
"""
import torch

from model import invariant

try:  # Triton ships Linux wheels only; elsewhere model/attention.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels import fit
    from kernels.rope import _rotate_loaded
except ImportError:
    triton = None

BLOCK_K = 64  # indices per online-softmax block (model/attention.py SPARSE_ATTN_BLOCK, spec §2.8)
# q's RoPE at the kernel's load of q only up to this head width: at 512 (the slice) the rotated q stays in
# registers beside the [64, 512] fp32 accumulator and the kernel spills (520 bytes a thread compiled for sm_90,
# against 144 with q rotated before: RESULTS.md); there the RoPE kernel rotates q first, the same bits
MAX_ROPE_AT_LOAD_WIDTH = 256
# A decode step's queries at wide heads (the slice's 512), outside the batch-invariant mode (whose decode rows
# must have its chunks' bits): 32 heads a program on 8 warps, twice the programs of one block of all heads, each
# gathering its query's rows again (from L2): 0.079 -> 0.055 ms at 64 rows (bench_attention.py --sweep, H100), 67 ->
# 60 us a launch in the slice's step. Other bits than a chunk's in a few values (another MMA shape). None: a chunk's.
DECODE_WIDE = dict(BLOCK_H=32, num_warps=8, num_stages=2, PREFETCH=False)


if triton is not None:

    @triton.jit
    def _mm(a, b, BF16: tl.constexpr):
        """a·b of bf16 tiles in fp32: the tensor-core dot compiled; under the CPU interpreter, whose bf16 dot is
        not faithful, in fp32 from the same bf16 values (exact products, fp32 sums)."""
        if BF16:
            return tl.dot(a, b)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _gather_rows(kv_ptr, t, idx_row, k, d, L, b64, skv_b, skv_n, W, ring_row, sr_row, NB, tables_ptr, st_b,
                     PER_BLOCK: tl.constexpr, pool_delta, sp_blk, sp_row, HAS_RING: tl.constexpr,
                     HAS_POOL: tl.constexpr):
        """The rows of index block [t, t + BLOCK) of a query's list, [BLOCK, D] bf16 (0 where the index is -1 or
        past L), and which are valid. The KV row of index j of batch row b lies in one of three sources (see
        `paged_sparse_attn`): j < W: the ring of b's state slot; W <= j < W + NB: kv[b, j - W]; beyond:
        compressed entry e = j - W - NB in the paged pool, at (tables[b, e // PER_BLOCK], e % PER_BLOCK). The ring
        and the pool are addressed from kv_ptr by their element distance (ring_delta, pool_delta), so each block
        of indices is one gathered load."""
        j = tl.load(idx_row + t + k, mask=t + k < L, other=-1).to(tl.int64)  # [BLOCK]
        valid = j >= 0
        offset = b64 * skv_b + (j - W) * skv_n  # [BLOCK] elements from kv_ptr
        if HAS_RING:
            offset = tl.where(j < W, ring_row + j * sr_row, offset)
        if HAS_POOL:
            e = j - W - NB
            in_pool = valid & (e >= 0)
            block = tl.load(tables_ptr + b64 * st_b + e // PER_BLOCK, mask=in_pool, other=0).to(tl.int64)
            offset = tl.where(in_pool, pool_delta + block * sp_blk + (e % PER_BLOCK) * sp_row, offset)
        return valid, tl.load(kv_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)

    @triton.jit
    def _sparse_attn_kernel(q_ptr, sink_ptr, idx_ptr, out_ptr, scale, S, H, L,
                            sq_b, sq_s, sq_h, si_b, si_s, so_b, so_s, so_h,
                            kv_ptr, NB, skv_b, skv_n,
                            ring_delta, slots_ptr, W, sr_slot, sr_row,
                            pool_delta, tables_ptr, st_b, PER_BLOCK: tl.constexpr, sp_blk, sp_row, freqs_ptr,
                            D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
                            HAS_RING: tl.constexpr, HAS_POOL: tl.constexpr, ROPE: tl.constexpr,
                            BF16: tl.constexpr, PREFETCH: tl.constexpr):
        pid = tl.program_id(0)  # one query token: row b, position s; program_id(1): its block of heads
        b, s = pid // S, pid % S
        b64 = b.to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        k = tl.arange(0, BLOCK)
        q_at = q_ptr + b64 * sq_b + s * sq_s + h[:, None] * sq_h + d[None, :]
        q = tl.load(q_at, mask=h[:, None] < H, other=0.0)  # [BLOCK_H, D] bf16
        if ROPE:  # q's RoPE on its last ROPE dims as it loads (kernels/rope.py's operations, the same bf16 q)
            rope = (d >= D - ROPE)[None, :]
            f_at = freqs_ptr + pid.to(tl.int64) * ROPE + 2 * tl.where(rope, (d[None, :] - (D - ROPE)) // 2, 0)
            q = _rotate_loaded(q.to(tl.float32), q_at, (d % 2 == 0)[None, :], (h[:, None] < H) & rope, f_at, rope,
                               1.0).to(tl.bfloat16)
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
        den = tl.zeros([BLOCK_H], dtype=tl.float32)
        run_max = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # the sink is not in the max
        idx_row = idx_ptr + b64 * si_b + s * si_s
        ring_row = ring_delta + tl.load(slots_ptr + b).to(tl.int64) * sr_slot if HAS_RING else 0
        args = (idx_row, k, d, L, b64, skv_b, skv_n, W, ring_row, sr_row, NB, tables_ptr, st_b, PER_BLOCK,
                pool_delta, sp_blk, sp_row, HAS_RING, HAS_POOL)
        if PREFETCH:
            valid_next, rows_next = _gather_rows(kv_ptr, 0, *args)
        for t in range(0, L, BLOCK):
            if PREFETCH:  # this block's rows were loaded an iteration ahead; the next block's load now
                valid, rows = valid_next, rows_next
                valid_next, rows_next = _gather_rows(kv_ptr, t + BLOCK, *args)
            else:
                valid, rows = _gather_rows(kv_ptr, t, *args)
            scores = _mm(q, tl.trans(rows), BF16)  # [BLOCK_H, BLOCK] fp32
            scores = tl.where(valid[None, :], scores, float("-inf")) * scale
            prev = run_max
            run_max = tl.maximum(prev, tl.max(scores, axis=1))
            rescale = tl.exp(prev - run_max)
            p = tl.exp(scores - run_max[:, None])
            den = den * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + _mm(p.to(tl.bfloat16), rows, BF16)
        sink = tl.load(sink_ptr + h, mask=h < H, other=0.0)
        den = den + tl.exp(sink - run_max)
        out = acc / den[:, None]
        tl.store(out_ptr + b64 * so_b + s * so_s + h[:, None] * so_h + d[None, :],
                 out.to(tl.bfloat16), mask=h[:, None] < H)

    def smaller(cfg: dict) -> dict | None:
        """Where a device cannot hold a configuration's shared memory (kernels/fit.py): half the heads a program,
        down to 16 (the tensor cores' least rows). sm_100 takes the slice's chunks 32 heads a program."""
        return dict(cfg, BLOCK_H=cfg["BLOCK_H"] // 2) if cfg["BLOCK_H"] > 16 else None

    fit.register(_sparse_attn_kernel, smaller)


def applies(q: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the kernel serves these queries: bf16 on CUDA, a head dim (q's last, or `head_dim` for a tensor
    of the same device and dtype as the queries will be) that is a power of two >= 16."""
    D = head_dim or q.size(-1)
    return triton is not None and q.is_cuda and q.dtype == torch.bfloat16 and D >= 16 and D & (D - 1) == 0


def rope_at_load(head_dim: int) -> bool:
    """Whether q's RoPE may happen in the kernel's load of q (the fused launches) at this head width."""
    return head_dim <= MAX_ROPE_AT_LOAD_WIDTH


def config(H: int, D: int, decode: bool = False) -> dict:
    """Heads a program (BLOCK_H), warps and pipeline stages, by the heads, the head width and `decode` (one query
    a row, outside the batch-invariant mode), never the batch (a row's bits do not depend on what it is batched
    with). Blocks of fewer heads (16, 32) change a few values (another MMA shape sums the dot in another order;
    within the torch path's tolerance): a chunk keeps one block of all heads, and the bits of the earlier 4-warp
    form (tests/gpu). Chosen by benchmarks/bench_attention.py --sweep (RESULTS.md)."""
    if D >= 256 and decode and DECODE_WIDE is not None:
        return dict(DECODE_WIDE)
    if D >= 256:  # the slice (64 x 512): 0.116 -> 0.065 ms decode (64 rows), 6.39 -> 2.81 ms prefill (8,192 queries)
        return dict(BLOCK_H=64, num_warps=8, num_stages=2, PREFETCH=False)
    return dict(BLOCK_H=max(16, min(64, triton.next_power_of_2(H))), num_warps=4, num_stages=3, PREFETCH=True)


def paged_sparse_attn(q: torch.Tensor, ring: torch.Tensor | None, slots: torch.Tensor, kv: torch.Tensor,
                      pool: torch.Tensor | None, tables: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                      scale: float, cfg: dict | None = None, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse attention over model/paged.py's sources in place, with no gathered copy: index j < W is a
    window position in `ring` [slots, W, D] at row slots[b]; the next S indices are this chunk's window
    latents kv [B, S, D]; the rest are compressed entries of `pool` [blocks, per_block, D] through the
    block tables [B, nb]. ring/pool None: no such source. q [B,S,H,D] bf16, idx [B,S,L] -> [B,S,H,D] bf16.
    `cfg` overrides `config` (tests, benchmarks). `freqs` complex [B,S,R/2]: q comes without its RoPE and the
    kernel rotates its last R dims as it loads them (kernels/rope.py's operations: the same q, bit for bit)."""
    B, S, H, D = q.shape
    assert q.dtype == kv.dtype == torch.bfloat16 and q.stride(-1) == kv.stride(-1) == 1
    assert all(t is None or (t.dtype == kv.dtype and t.stride(-1) == 1) for t in (ring, pool))
    idx = idx.contiguous()
    out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    W = ring.size(1) if ring is not None else 0
    element = kv.element_size()  # ring and pool addressed from kv by their distance in elements
    delta = lambda t: (t.data_ptr() - kv.data_ptr()) // element  # noqa: E731
    ring_args = (delta(ring), slots, W, ring.stride(0), ring.stride(1)) if ring is not None else (0, slots, 0, 0, 0)
    pool_args = ((delta(pool), tables, tables.stride(0), pool.size(1), pool.stride(0), pool.stride(1))
                 if pool is not None else (0, tables, 0, 1, 0, 0))
    cfg = dict(config(H, D, decode=S == 1 and not invariant.enabled()), **(cfg or {}))
    f = torch.view_as_real(freqs).reshape(B * S, -1).contiguous() if freqs is not None else None  # (cos, sin)
    if B * S:  # the configuration, or a smaller one where the device cannot hold its shared memory (kernels/fit.py)
        fit.launch(_sparse_attn_kernel, lambda c: (B * S, triton.cdiv(H, c["BLOCK_H"])),
                   (q, sink.contiguous(), idx, out, scale, S, H, idx.size(-1), q.stride(0), q.stride(1), q.stride(2),
                    idx.stride(0), idx.stride(1), out.stride(0), out.stride(1), out.stride(2), kv, kv.size(1),
                    kv.stride(0), kv.stride(1), *ring_args, *pool_args, f if freqs is not None else q),
                   cfg, D=D, BLOCK=BLOCK_K, HAS_RING=ring is not None, HAS_POOL=pool is not None,
                   ROPE=0 if freqs is None else f.size(-1), BF16=q.is_cuda)
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                cfg: dict | None = None) -> torch.Tensor:
    """model/attention.py's `sparse_attn` in one launch: q [B,S,H,D] bf16, kv [B,N,D] bf16, sink [H] fp32,
    idx [B,S,L] int (-1 = skip) -> [B,S,H,D] bf16. Never syncs the host."""
    return paged_sparse_attn(q, None, idx, kv, None, idx, sink, idx, scale, cfg)
