"""Batch-invariant mode (issue #11): a request's logits are bitwise the same whatever else shares its
batch, however its prompt is chunked, with ZOS on or off, and after preemption and recomputation.
The counterpart of vLLM's VLLM_BATCH_INVARIANT mode and SGLang's deterministic inference, both after
Thinking Machines' batch-invariant kernels (fixed tiles, fixed split sizes); DeepInfer has none.

Spec §10 ("Determinism", "Noise floor"): the same computation gives the same bits, but a different batch
or chunk shape changes them, and the discrete choices (indexer top-k, candidate blocks, expert routing)
amplify the change. What makes a row's bits depend on its neighbours, as measured on CPU (torch 2.13,
AVX-512, one intra-op thread) by tests/test_batch_invariant.py:

1. 2-D GEMMs pick their blocking by the shape, the row count M included: an fp32 `F.linear` (the head
   §6, the ratio-2 compressor §2.4, the gate §5, the hc mixes §3) gives a row other bits in another
   batch. Every `Linear` and the experts' (whose M depends on the routing) share the path.
2. torch's CPU pointwise kernels run the body of a contiguous loop in SIMD and its last numel % (2·lanes)
   elements in scalar code; sigmoid, silu and softplus differ between the two in the last ulp, so a
   value's bits depend on where the batch's end falls (hc mixes §3, Engram gate §4.3, gate and SwiGLU
   §5). In bf16 the next rounding hid it in every scenario tried; the fp32 debugging mode shows it.
3. Decode rows list the window in the official decode order (§2.3: the -1 padding first), prefill rows
   in the chunk order (padding last). Where the list spans more than one block of 64 (tiny-68m's
   128 + 64 entries) and a position is below the window size, the entries fall into other blocks and
   the online softmax (§2.8) rescales at other points.
Already invariant there, and checked by the tests rather than assumed: exp, sqrt, rsqrt, the row
reductions (norms, softmax over the r members, sums over hc, amax), and the batched einsums (index
scores §2.7 with M = chunk x heads and N = entries, the sparse attention's two products §2.8, the grouped
wo_a §2.9). The mode still gives those fixed shapes: nothing in torch promises that a batched kernel's
order ignores M, N or the batch count (CUDA's does not), and it costs little on CPU.

The mode's answers, one function per kind of site, each a no-op that calls the default op when the
mode is off (so the default bits do not move):
- `linear`, `bmm`, `index_scores_dot`, `grouped_linear`, `attention_scores`, `attention_values`: every
  GEMM call has one fixed shape per site. Rows go in tiles of exactly `row_tile(w)` rows (the last one
  zero-padded, in a fresh aligned buffer), batched products in tiles of BATCH_TILE matrices, and a
  context-sized N (entries) in tiles of COL_TILE, so the kernel, and its reduction order, are the same
  for a row wherever it sits (Thinking Machines' fixed tiles, in torch calls rather than a kernel).
- `pointwise(fn, x)`: fn over a contiguous copy padded to a multiple of POINTWISE_ALIGN, so every value
  takes the SIMD body.
- `attention_blocks`: the sparse-attention index list is padded with -1 to whole blocks of 64 (extra
  all-masked blocks change nothing: rescale exp(0) = 1, p = 0), so every P·V product has K = 64 whatever
  the batch's context length makes the list's width (W + min(index_topk, entries)).
- `window_decode_order(decode)`: decode rows use the prefill window order. This gives up bit parity with
  the official code's decode steps (its decode order) for parity between prefill and decode.
- `bmm_nt`: the grouped MoE's per-expert w2 product (CUDA only), through kernels/gemm.py in the mode.
- `reduce_sum`, `softmax`: a sum or softmax over a dim that is not the innermost (the index scores'
  head sum §2.7, the compressor's pooling §2.4) in a fixed order: torch's CUDA reductions split such a dim
  across threads by the number of outputs.
- `full_window`: every row's index list gives the window all W places, so a chunk that ends before W
  lists the compressed entries where a longer chunk does (found on tiny-68m, W = 128, chunks of 20 and 37).

On CPU the mode assumes one intra-op thread (the engine's default). On CUDA (measured on an H200,
tests/gpu/test_batch_invariant_gpu.py) every GEMM of the mode, the grouped MoE's included, goes through
kernels/gemm.py: one Triton configuration for every shape, so a row's bits never depend on the row count
(cuBLAS changes kernels with it: an fp32 row alone and among 3,000 rows differ). The Triton RMSNorm, hc,
RoPE, quantisation and sparse-attention kernels already give each row a reduction order fixed by its own
sizes. Decode graphs need nothing more: a padded graph batch is just more rows. `USE_KERNEL = False`
keeps torch's ops in the fixed tiles on CUDA too (the grouped MoE then in passes of MOE_ROW_TILE rows).

The switch is per thread and scoped: `PagedModel.forward` runs under `mode(model.batch_invariant)` (the
decorator `scoped`), so a model built without the mode is never affected, even beside one built with it.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F

ROW_TILE = 32         # rows per GEMM call (tiles of a fresh buffer stay 64-byte aligned: 8·K·4 bytes, K even)
SMALL_ROW_TILE = 8    # rows per GEMM call for a weight of more than BIG_WEIGHT elements (row_tile)
BIG_WEIGHT = 1 << 20
BATCH_TILE = 16       # matrices per batched GEMM call
COL_TILE = 128        # entries per index-score GEMM call (N grows with the context)
MOE_ROW_TILE = 64     # rows per grouped MoE pass on CUDA (model/moe.py grouped_forward)
POINTWISE_ALIGN = 64  # elements: a multiple of two AVX-512 fp32 vectors
ATTN_BLOCK = 64       # the sparse attention's block (model/attention.py SPARSE_ATTN_BLOCK, spec §2.8)

USE_KERNEL = True     # CUDA: every GEMM of the mode through kernels/gemm.py (one launch, any row count);
                      # False (and CPU): the torch ops in the fixed tiles above

_state = threading.local()  # per thread: the CPU device's worker and the main thread never share the switch


def enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def mode(on: bool = True):
    """Run the enclosed forward (on this thread) in the batch-invariant mode, or explicitly out of it."""
    previous, _state.on = enabled(), on
    try:
        yield
    finally:
        _state.on = previous


def scoped(forward):
    """Decorator for PagedModel.forward: the forward runs in the mode its model was built with."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        with mode(getattr(self, "batch_invariant", False)):
            return forward(self, *args, **kwargs)
    return wrapper


def _padded(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """A fresh contiguous (hence aligned) copy of t, zero-padded along dim to a multiple of `multiple`."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, -t.size(dim) % multiple]
    return F.pad(t, pad).contiguous()  # F.pad allocates a fresh tensor, even with zero padding


def padded_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """t [N, ...] zero-padded along its rows to a multiple of `multiple` (a fresh contiguous copy)."""
    return _padded(t, 0, multiple)


def row_tile(w: torch.Tensor) -> int:
    """Rows per GEMM call for the weight w [N, K]: a function of w's shape alone, never of the batch.
    A weight of more than BIG_WEIGHT elements (the head: vocab x dim) costs enough per row that the
    padding of a small decode batch, not the dispatch, dominates, so it takes SMALL_ROW_TILE rows."""
    return SMALL_ROW_TILE if w.numel() > BIG_WEIGHT else ROW_TILE


def kernel_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the mode's GEMMs of a and b go through kernels/gemm.py (CUDA) rather than torch tiles."""
    from kernels import gemm

    return USE_KERNEL and gemm.applies(a, b)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) [..., K] x [N, K] -> [..., N]; in the mode kernels/gemm.py on CUDA, else row tiles of
    exactly row_tile(w) rows."""
    if not enabled():
        return F.linear(x, w)
    if kernel_gemm(x, w):
        from kernels import gemm

        return gemm.linear(x, w)
    rows = x.reshape(-1, x.size(-1))
    if rows.size(0) == 0:
        return F.linear(x, w)
    tile = row_tile(w)
    padded = _padded(rows, 0, tile)
    if padded.size(0) == tile:  # one call (most decode steps)
        out = F.linear(padded, w)
    else:
        out = torch.cat([F.linear(padded[i:i + tile], w) for i in range(0, padded.size(0), tile)])
    return out[:rows.size(0)].view(*x.shape[:-1], w.size(0))


def bmm(a: torch.Tensor, b: torch.Tensor, rows: int, cols: int, b_rows: bool = False) -> torch.Tensor:
    """a [n, M, K] @ b [n, K, N] -> [n, M, N], every torch.bmm call of shape [BATCH_TILE, rows, K] @
    [BATCH_TILE, K, cols] (zero padding cut off afterwards). b_rows: b is given as [n, N, K] (its rows
    are the N outputs, as a weight is), multiplied transposed. Mode only: the sites call it when enabled."""
    n, M, N = a.size(0), a.size(1), b.size(1 if b_rows else 2)
    out = a.new_empty(n, M, N)
    for i in range(0, n, BATCH_TILE):
        for m in range(0, M, rows):
            at = _tile(a[i:i + BATCH_TILE, m:m + rows], (BATCH_TILE, rows, a.size(2)))
            for c in range(0, N, cols):
                if b_rows:
                    bt = _tile(b[i:i + BATCH_TILE, c:c + cols], (BATCH_TILE, cols, b.size(2))).transpose(1, 2)
                else:
                    bt = _tile(b[i:i + BATCH_TILE, :, c:c + cols], (BATCH_TILE, b.size(1), cols))
                part = out[i:i + BATCH_TILE, m:m + rows, c:c + cols]
                part.copy_(torch.bmm(at, bt)[:part.size(0), :part.size(1), :part.size(2)])
    return out


def _tile(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """t as a contiguous tile of exactly `shape`: a view when it is one already, else a zero-padded copy."""
    if tuple(t.shape) == shape:
        return t.contiguous()
    out = t.new_zeros(shape)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def index_scores_dot(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """einsum("bshd,btd->bsht") of spec §2.7: q [B,S,H,D], keys [B,E,D] -> [B,S,H,E] in q's dtype."""
    if not enabled():
        return torch.einsum("bshd,btd->bsht", q, keys)
    B, S, H, D = q.shape
    if keys.size(1) == 0 or B * S == 0:
        return torch.einsum("bshd,btd->bsht", q, keys)
    if kernel_gemm(q, keys):
        from kernels import gemm

        return gemm.gemm_nt(q.reshape(B, S * H, D), keys).view(B, S, H, keys.size(1))
    d = bmm(q.reshape(B, S * H, D), keys, ROW_TILE, COL_TILE, b_rows=True)  # [B, S·H, E]
    return d.view(B, S, H, keys.size(1))


def head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 head's product (spec §6) of x, the final norm's output: linear(x.float(), w), except on CUDA
    outside the mode at a wide head, where kernels/head.py splits the fp32 weight over bf16 tensor-core dots
    (within fp32 rounding of it, not its bits: tiny-68m's head and the mode keep F.linear's)."""
    from kernels import head as head_kernel
    from model.attention import use_kernels

    if use_kernels(x) and head_kernel.applies(x, w, enabled()):
        return head_kernel.head(x, w)
    return linear(x.float(), w)


def bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, M, K] @ b [n, N, K]ᵀ -> [n, M, N] (the grouped MoE's w2, model/moe.py): torch.bmm outside the
    mode and in its torch path (whose callers pass a fixed M), kernels/gemm.py on CUDA in the mode."""
    if enabled() and kernel_gemm(a, b):
        from kernels import gemm

        return gemm.gemm_nt(a, b)
    return torch.bmm(a, b.transpose(1, 2))


def grouped_linear(o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    """einsum("bsgd,grd->bsgr") of spec §2.9: o [B,S,G,d'], wo_a [G,r,d'] -> [B,S,G,r]."""
    if not enabled():
        return torch.einsum("bsgd,grd->bsgr", o, wo_a)
    return torch.stack([linear(o[:, :, g], wo_a[g]) for g in range(wo_a.size(0))], dim=2)


def attention_scores(qf: torch.Tensor, kv_blk: torch.Tensor) -> torch.Tensor:
    """einsum("bshd,bskd->bshk") of one block of spec §2.8: qf [B,S,H,D], kv_blk [B,S,k,D] -> [B,S,H,k]."""
    if not enabled():
        return torch.einsum("bshd,bskd->bshk", qf, kv_blk)
    B, S, H, D = qf.shape
    s = bmm(qf.reshape(B * S, H, D), kv_blk.reshape(B * S, -1, D), H, ATTN_BLOCK, b_rows=True)
    return s.view(B, S, H, -1)


def attention_values(p: torch.Tensor, kv_blk: torch.Tensor) -> torch.Tensor:
    """einsum("bshk,bskd->bshd") of one block of spec §2.8: p [B,S,H,k], kv_blk [B,S,k,D] -> [B,S,H,D]."""
    if not enabled():
        return torch.einsum("bshk,bskd->bshd", p, kv_blk)
    B, S, H, k = p.shape
    D = kv_blk.size(-1)
    return bmm(p.reshape(B * S, H, k), kv_blk.reshape(B * S, k, D), H, D).view(B, S, H, D)


def attention_blocks(idx: torch.Tensor) -> torch.Tensor:
    """The index list [B,S,L]; in the mode -1-padded to whole blocks of ATTN_BLOCK (spec §2.8)."""
    if not enabled():
        return idx
    return F.pad(idx, (0, -idx.size(-1) % ATTN_BLOCK), value=-1)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn; in the mode over a contiguous copy padded to POINTWISE_ALIGN."""
    if not enabled():
        return fn(x)
    flat = _padded(x.reshape(-1), 0, POINTWISE_ALIGN)
    return fn(flat)[:x.numel()].view(x.shape)


def reduce_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim); in the mode one fp32 add per member, in order, rounded once to x's dtype. torch's CUDA
    reduction over a dim that is not the innermost splits it across threads by the number of outputs, so
    a row's sum would depend on the batch (the index scores' head sum, the compressor's pooling)."""
    if not enabled():
        return x.sum(dim)
    acc = x.select(dim, 0).float()
    for i in range(1, x.size(dim)):
        acc = acc + x.select(dim, i)
    return acc.to(x.dtype)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.softmax(dim); in the mode over a contiguous copy with dim innermost (torch's row softmax gives each
    row one warp or block whatever the number of rows; over an outer dim it splits by the shape)."""
    if not enabled() or dim in (-1, x.dim() - 1):
        return x.softmax(dim)
    return x.movedim(dim, -1).contiguous().softmax(-1).movedim(-1, dim)


def full_window(decode_order: bool) -> bool:
    """Whether a row's index list gives the window all W places (its -1 padding among them) before the
    compressed entries: decode rows in the official order, and every row in the mode. Otherwise a prefill
    row gives it min(end, W) places, so a chunk ending before W (37 of tiny-68m's 128) would start the
    compressed entries at another place in the list, and the online softmax (§2.8) would block them
    otherwise than the same position computed in a longer chunk."""
    return decode_order or enabled()


def window_decode_order(decode: bool) -> bool:
    """Whether decode rows take the official decode window order (§2.3): not in the mode."""
    return decode and not enabled()
