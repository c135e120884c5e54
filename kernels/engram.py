"""Engram on CUDA (spec §4; mirrors `NgramHashState`, `ParallelEngramEmbedding` and `Engram.forward` of DeepSeek's
inference/engram.py and model.py): the n-gram hashes, the table lookup and the gate, one launch each.

The torch paths (model/engram.py) are about 70 small launches a forward of tiny-68m: the hashes' stack,
products, XORs and moduli (~30, once a forward), and per Engram layer the lookup's two gathers and its
dequantisation (~6) and the gate's casts, norms, dot, signed square root and sigmoid (~17). At decode sizes
that is launch overhead, not arithmetic.

Numerics:
- `hash_ids`: int64 products, XORs and moduli, exact: the same ids as the torch path (the products fit in
  int64 by the multipliers' bound, spec §4.2 step 2, and are non-negative, so C's % is Python's).
- `lookup`: each FP8 code times its e8m0 scale, exact in fp32 and in bf16 (a power-of-two scale): the
  same bits as model/quant.py's dequantisation.
- `gate`: the operations of model/engram.py `Engram.gate` in fp32 in the same order (the q·k weight product,
  the two RMS statistics over dim, the dot, the clamp, the signed square root, the sigmoid, h + gate·value,
  one rounding); the sums over dim associate otherwise and rsqrt is computed as a correctly rounded 1/sqrt,
  so the result agrees with the torch path within fp32 rounding before its bf16 rounding, not bit for bit.
  Past WIDE_D (the released 5,120) the gate runs in two passes over dim (`_engram_gate_wide_kernel`), its sums
  kept per lane and reduced at the end: another association, the same tolerance; up to it (tiny-68m) the
  one-pass kernel's bits are unchanged.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/engram.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.fp8_gemm import _e4m3_values, _e8m0_values, _round_bf16, hw_fp8
    from kernels.hc import _sigmoid
except ImportError:
    triton = None

GROUP = 32  # table values per e8m0 scale (model/engram.py SCALE_GROUP)


if triton is not None:

    @triton.jit
    def _engram_hash_kernel(comp_ptr, hist_ptr, mult_ptr, mod_ptr, off_ptr, out_ptr, n_tokens, S,
                            KB: tl.constexpr, LAYERS: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
        # BLOCK tokens of comp [B, S]; history [B, KB] (KB = max_ngram - 1, most recent last); out [B, S, LAYERS,
        # KB * HEADS]: column (i - 1) * HEADS + head hashes the (i + 1)-gram ending at the token.
        tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = tok < n_tokens
        b, s = (tok // S).to(tl.int64), tok % S
        COLS: tl.constexpr = KB * HEADS
        for layer in tl.static_range(LAYERS):
            rolling = tl.zeros([BLOCK], dtype=tl.int64)
            for i in tl.static_range(KB + 1):  # t_i: the compressed id i positions back, from the history before s
                back = s - i
                t = tl.where(back >= 0, tl.load(comp_ptr + b * S + back, mask=live & (back >= 0), other=0),
                             tl.load(hist_ptr + b * KB + KB + back, mask=live & (back < 0), other=0)).to(tl.int64)
                rolling = rolling ^ (t * tl.load(mult_ptr + layer * (KB + 1) + i))
                if i > 0:
                    for head in tl.static_range(HEADS):
                        col = (i - 1) * HEADS + head
                        row = rolling % tl.load(mod_ptr + layer * COLS + col) + tl.load(off_ptr + layer * COLS + col)
                        tl.store(out_ptr + (tok.to(tl.int64) * LAYERS + layer) * COLS + col, row, mask=live)

    @triton.jit
    def _engram_lookup_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, n_ids, HD: tl.constexpr, HW_FP8: tl.constexpr,
                              COMPILED: tl.constexpr, BLOCK: tl.constexpr):
        # BLOCK looked-up rows: table codes [rows, HD] e4m3, scales [rows, HD / 32] e8m0 -> out [n_ids, HD] bf16
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = r < n_ids
        row = tl.load(ids_ptr + r, mask=live, other=0).to(tl.int64)
        d = tl.arange(0, HD)
        codes = tl.load(w_ptr + row[:, None] * HD + d[None, :], mask=live[:, None], other=0)
        scales = tl.load(s_ptr + row[:, None] * (HD // 32) + (d // 32)[None, :], mask=live[:, None], other=127)
        values = _e4m3_values(codes, HW_FP8) * _e8m0_values(scales, 0)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * HD + d[None, :], _round_bf16(values, COMPILED),
                 mask=live[:, None])

    @triton.jit
    def _engram_gate_kernel(x_ptr, kv_ptr, q_ptr, k_ptr, out_ptr, D, eps, scale, clamp, HC: tl.constexpr,
                            BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
        # one token: x [HC, D] bf16, kv [(HC + 1) * D] bf16 (HC keys, then the value), q and k weights [HC, D] bf16
        row = tl.program_id(0).to(tl.int64)
        j, d = tl.arange(0, HC), tl.arange(0, BLOCK_D)
        at = j[:, None] * D + d[None, :]  # [HC, BLOCK_D]
        m = d[None, :] < D
        h = tl.load(x_ptr + row * HC * D + at, mask=m, other=0.0).to(tl.float32)
        key = tl.load(kv_ptr + row * (HC + 1) * D + at, mask=m, other=0.0).to(tl.float32)
        value = tl.load(kv_ptr + row * (HC + 1) * D + HC * D + d, mask=d < D, other=0.0).to(tl.float32)
        weight = (tl.load(q_ptr + at, mask=m, other=0.0).to(tl.float32)
                  * tl.load(k_ptr + at, mask=m, other=0.0).to(tl.float32))
        n = D.to(tl.float32)
        rstd = (tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(h * h, axis=1), n) + eps))
                * tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(key * key, axis=1), n) + eps)))  # [HC]
        dot = tl.sum(h * weight * key, axis=1) * rstd * scale
        root = tl.sqrt_rn(tl.maximum(tl.abs(dot), clamp))
        signed = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign: -0.0 gives -root
        gate = _sigmoid(signed)  # kernels/hc.py's: the exponential through fp64
        out = h + gate[:, None] * value[None, :]
        tl.store(out_ptr + row * HC * D + at, _round_bf16(out, COMPILED), mask=m)

    @triton.jit
    def _engram_gate_wide_kernel(x_ptr, kv_ptr, q_ptr, k_ptr, out_ptr, D, eps, scale, clamp, HC: tl.constexpr,
                                 BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
        # `_engram_gate_kernel` for a wide dim (past WIDE_D): the three sums over dim built BLOCK_D values at a
        # time (per-lane fp32 partial sums, reduced once at the end), then a second pass for h + gate·value
        row = tl.program_id(0).to(tl.int64)
        j, d0 = tl.arange(0, HC), tl.arange(0, BLOCK_D)
        hh = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
        kk = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
        hwk = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            d = start + d0
            at = j[:, None] * D + d[None, :]
            m = d[None, :] < D
            h = tl.load(x_ptr + row * HC * D + at, mask=m, other=0.0).to(tl.float32)
            key = tl.load(kv_ptr + row * (HC + 1) * D + at, mask=m, other=0.0).to(tl.float32)
            weight = (tl.load(q_ptr + at, mask=m, other=0.0).to(tl.float32)
                      * tl.load(k_ptr + at, mask=m, other=0.0).to(tl.float32))
            hh += h * h
            kk += key * key
            hwk += h * weight * key
        n = D.to(tl.float32)
        rstd = (tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(hh, axis=1), n) + eps))
                * tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(kk, axis=1), n) + eps)))  # [HC]
        dot = tl.sum(hwk, axis=1) * rstd * scale
        root = tl.sqrt_rn(tl.maximum(tl.abs(dot), clamp))
        signed = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)
        gate = _sigmoid(signed)
        for start in range(0, D, BLOCK_D):
            d = start + d0
            at = j[:, None] * D + d[None, :]
            m = d[None, :] < D
            h = tl.load(x_ptr + row * HC * D + at, mask=m, other=0.0).to(tl.float32)
            value = tl.load(kv_ptr + row * (HC + 1) * D + HC * D + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * HC * D + at, _round_bf16(h + gate[:, None] * value[None, :], COMPILED), mask=m)


WIDE_D = 2048  # past this dim a token's rows no longer fit one program's registers: the wide kernel's two passes


def applies(x: torch.Tensor, module=None) -> bool:
    """CUDA and Triton; for an Engram `module`, bf16 x and a power-of-two table row of at least 32."""
    if module is not None:
        width = module.embed.weight.size(1)
        return applies(x) and x.dtype == torch.bfloat16 and width & (width - 1) == 0 and width >= GROUP
    return triton is not None and x.is_cuda


def engram(module, x: torch.Tensor, row_ids: torch.Tensor, clamp: float) -> torch.Tensor:
    """model/engram.py `Engram.forward`: the lookup (`lookup`; under EP the module's own exchange of rows),
    wkv, then the gate and its mix (`gate`)."""
    embed = module.embed
    rows = embed(row_ids) if embed.shard.world_size > 1 else lookup(row_ids, embed.weight, embed.scale)
    kv = module.wkv(rows.flatten(-2))
    return gate(x, kv, module.q_weight, module.k_weight, module.eps, clamp)


def hash_ids(layout, comp_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """model/engram.py `hash_ids` in one launch: comp_ids [B, S], history [B, max_ngram - 1] -> row ids
    [B, S, n_engram_layers, n_hash_cols] int64 (`layout`: its EngramLayout on the device)."""
    multipliers, moduli, offsets, heads = layout.multipliers, layout.moduli, layout.offsets, layout.n_heads
    B, S = comp_ids.shape
    layers, cols = moduli.shape
    out = torch.empty(B, S, layers, cols, dtype=torch.int64, device=comp_ids.device)
    if B * S:
        block = 64
        _engram_hash_kernel[(triton.cdiv(B * S, block),)](
            comp_ids.contiguous(), history.contiguous(), multipliers.contiguous(), moduli.contiguous(),
            offsets.contiguous(), out, B * S, S, KB=history.size(1), LAYERS=layers, HEADS=heads, BLOCK=block)
    return out


def lookup(row_ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows of the FP8 table with their e8m0 scales (model/engram.py `EngramEmbedding.lookup`), dequantised to
    bf16: row_ids [...] -> [..., head_dim], in one launch."""
    hd = weight.size(1)  # a power of two >= 32 (`applies`)
    ids = row_ids.contiguous().view(-1)
    out = torch.empty(ids.numel(), hd, dtype=torch.bfloat16, device=row_ids.device)
    if ids.numel():
        block = 16
        _engram_lookup_kernel[(triton.cdiv(ids.numel(), block),)](
            ids, weight.view(torch.uint8), scale.view(torch.uint8), out, ids.numel(), HD=hd,
            HW_FP8=hw_fp8(row_ids.device), COMPILED=row_ids.is_cuda, BLOCK=block)
    return out.view(*row_ids.shape, hd)


def gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
         clamp: float) -> torch.Tensor:
    """model/engram.py `Engram.forward` after wkv, in one launch: x [..., hc, d] bf16, kv [..., (hc + 1)·d]
    (the keys, then the value) -> x + gate·value [..., hc, d] bf16."""
    hc, d = x.shape[-2:]
    out = torch.empty_like(x)
    n = x.numel() // (hc * d)
    if n and d > WIDE_D:
        _engram_gate_wide_kernel[(n,)](x.contiguous(), kv.contiguous(), q_weight.contiguous(), k_weight.contiguous(),
                                       out, d, eps, d ** -0.5, clamp, HC=hc, BLOCK_D=512, COMPILED=x.is_cuda,
                                       num_warps=4)
    elif n:
        _engram_gate_kernel[(n,)](x.contiguous(), kv.contiguous(), q_weight.contiguous(), k_weight.contiguous(), out,
                                  d, eps, d ** -0.5, clamp, HC=hc, BLOCK_D=triton.next_power_of_2(d),
                                  COMPILED=x.is_cuda, num_warps=4 if d <= 1024 else 8)
    return out
