"""The grouped MoE over FP4 experts (spec §5; mirrors `Expert.forward` and `MoE.forward` of DeepSeek's inference/model.py
with the routed experts in `fp4_gemm`'s storage).

The routed experts stay as the released files store them: e2m1 codes two per byte (the even element in the
low nibble) [E, out, in/2] and one e8m0 scale per 32 values along K [E, out, in/32] (model/released.py
FP4Linear, stacked by `fp4_stacked` below as views, no copy kept). No bf16 copy of an expert exists:
each program decodes its expert's [BN, 32] tiles in registers, one scale group at a time.

What it replaces: the grouped bf16 path cannot take FP4 experts, so released models ran the masked path
(model/moe.py): every one of the E experts on every row, each FP4Linear dequantising its whole weight to
fp32 then bf16 in its own matmul, E x 3 times a layer whatever the batch (384 x 3 at full width: ~7 GB of
FP4 read, ~54 GB of fp32 and ~27 GB of bf16 written a layer a step; ~1.2 s a layer on an H200). Here only the
selected experts' weights are read, once per tile of rows that chose them (0.36 ms a layer at batch 1 in a
CUDA graph: benchmarks/RESULTS.md).

The pipeline, all on the device with no host synchronisation (a CUDA graph captures it):
1. `plan`: the N·k (row, slot) pairs sorted by expert (stable), cut into tiles of BM pairs of one expert;
   a fixed upper bound of tiles (cdiv(N·k, BM) + min(E, N·k)), the unused ones marked dead (-1). One launch at
   a decode step's pair counts (`_plan_kernel`), torch's ops (a stable sort) at a prefill chunk's.
2. `_gate_up_kernel`: per (block of inter, tile), gather the tile's rows of x (FP8-quantised, act_quant),
   w1 and w3 products (w1's and w3's rows interleaved in one tile: one accumulator), each rounded to bf16 as
   the GEMM output of spec §5 step 1, then the clamps, silu(g)·u and the routing weight in fp32
   (kernels/moe.py's operations), bf16 out, in sorted pair order [N·k, inter].
3. act_quant of that hidden (kernels/quant.py, per 32, as the official linear() before w2).
4. `_down_kernel`: per (block of dim, tile), the w2 product, bf16 out [N·k, dim].
The grid runs a tile's output blocks next to each other (the first grid axis), so its gathered rows of x are
read from HBM once and from L2 after; each tile's expert weights are read once.
5. `_combine_kernel`: each row adds its k outputs in fp32 in ascending expert id, the shared expert's
   output (FP8 dense, kernels/fp8_gemm.py) last, one rounding: the adds of the official loop.

FP4 decode, by bit patterns (the default): each byte becomes one 32-bit word holding its two codes as bf16
bit patterns (the magnitude bits at bf16 bits 6-8, the sign at bit 15: the e2m1 value times 2^-126 exactly,
code 1's 0.5 landing on the bf16 subnormal 2^-127), then one bf16 multiply by 2^(s-1) for the group's e8m0
byte s (exact: a power of two; finite up to s = 128, BIT_DECODE_MAX_SCALE, which moe_forward checks once).
About 6 instructions a byte (its shared-memory load, or its extract from a loaded word under KS=1, two
multiplies, two masks, the scale's multiply; the word's halves become the two bf16 values through a PTX register
split, valid on every architecture); the e4m3 decode (cfg B=0: the codes' bits onto e4m3 bits, a value times
2^-6, through kernels/fp8_gemm.py's e4m3 decode, then an fp32 multiply and a bf16 cast) took about 23, and the
kernel is bound by issuing them: 1.5x longer at 64 decode rows on an H200 (benchmarks/RESULTS.md). An
iteration's U scales a row are one word (U divides the groups of both GEMMs; it is halved until it does).
K is walked one scale group (32 values, 16 bytes a row) a dot, an iteration's U groups of codes one load. The
decoded weight is the dot's first operand, which a tensor-core dot takes from registers (wgmma on sm_90; Triton
picks the instruction for each architecture, nothing here is Hopper-only), and x's rows its second: the product
is computed transposed, [weight rows, pairs], and stored as [pairs, weight rows].

Numerics against the torch path (the official loop, FP4Linear dequantising to bf16 then F.linear): the
same exact products (e2m1 times a power of two, times an e4m3 activation, exact in fp32), summed in fp32 in
another order, then the same roundings and the same pointwise operations in the same order.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/moe.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.fp8_gemm import _dot, _e4m3_values, _round_bf16, _e8m0_values, hw_fp8
    from kernels.quant import _quantise
    from triton.language.extra import libdevice
except ImportError:
    triton = None

GROUP = 32  # values per e8m0 scale along K (model/quant.py FP4_WEIGHT_GROUP)
BIT_DECODE_MAX_SCALE = 128  # e8m0 byte: the bit decode's multiplier 2^(s-1) is a finite bf16 up to s = 128


if triton is not None:

    @triton.jit
    def _w_group(b, s, HW_FP8: tl.constexpr, BN: tl.constexpr, BF16: tl.constexpr, BITS: tl.constexpr,
                 SLOTS: tl.constexpr):
        """A scale group's codes b [BN, 16] int32 (K values 32·gi to 32·gi + 31 of BN rows: 16 packed bytes a
        row, `_code_groups`) as their values [BN, 32] in K order (SLOTS: in the dot's K slot order, `_slot_k`),
        exact (bf16 compiled, fp32 under the interpreter); s [BN] int32 the group's e8m0 scales."""
        if BITS:
            # A byte's two codes as two bf16 bit patterns in one word, low nibble (the even K value) in the low
            # half: the magnitude bits c&7 at bf16 bits 6-8 (exponent field e, mantissa m) make 2^(e-127)(1+m/2)
            # = |v|·2^-126 for e >= 1 and the subnormal m·2^-127 = |v|·2^-126 for e = 0; the sign at bit 15.
            pair = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & -0x7FFF8000)  # 0x80008000
            if BF16:  # the word's halves as two bf16 values: a register's two halves, no instruction (a join of
                # masked and shifted int16s cost two byte permutes a byte, 64 of an iteration's 472 instructions)
                lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
                v = tl.join(lo, hi)
                scale = ((s + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s-1): s <= 128
            else:  # the same patterns as fp32's high halves
                v = tl.join(pair << 16, pair & -65536).to(tl.float32, bitcast=True)
                scale = _e8m0_values(s, 126)
        else:  # e2m1 bits onto e4m3 bits (a value times 2^-6), the scale times 2^6
            codes = tl.join(b & 15, b >> 4)
            v = _e4m3_values(((codes & 8) << 4) | ((codes & 7) << 2), HW_FP8)
            scale = _e8m0_values(s, 6)
        if SLOTS:  # v [rows, byte 4c + 2h + p, nibble j] in the dot's K slots 16h + 8p + 2c + j (`_slot_k`)
            v = tl.reshape(tl.permute(tl.reshape(v, (BN, 4, 2, 2, 2)), (0, 2, 3, 1, 4)), (BN, 32))
        else:  # in K order: K value 2j is byte j's low nibble, 2j + 1 its high
            v = tl.reshape(v, (BN, 32))
        return v * scale[:, None]  # a power of two: exact

    @triton.jit
    def _slot_k(slot):
        """The K value (of a group's 32) in the dot's K slot `slot`: slot 16h + 8p + 2c + j holds 8c + 4h + 2p + j.
        The tensor-core dot's register operand gives thread c (of a row's 4) slots 2c, 2c+1, 2c+8, 2c+9 of each
        16: in K order those are bytes c, c+4, c+8, c+12 of a group, four single-byte shared-memory loads; in this
        order bytes 4c to 4c+3, one word (on sm_90 at BN 128 on 8 warps: one LDSM a group where K order takes 8
        LDS.U8). x's rows are read in the same order, so the dot's sum is over the same products."""
        return 8 * ((slot // 2) % 4) + 4 * (slot // 16) + 2 * ((slot // 8) % 2) + slot % 2

    @triton.jit
    def _code_groups(w_base, w_rows, w_live, g0, KP, BN: tl.constexpr, U: tl.constexpr):
        """The codes of rows w_rows [BN] (zero in rows not w_live) at scale groups g0 to g0 + U - 1 (U of 1, 2,
        4) as a tuple of U groups [BN, 16] int32: one load of a row's 16·U bytes, split in registers. A group
        a load used half of each 32-byte sector and twice the copies into shared memory (ncu: 8.2 of a
        sector's 32 bytes used); at U = 2 the slice's decode step took 0.95x the time, its prefill 0.94x
        (benchmarks/RESULTS.md)."""
        jj = g0 * 16 + tl.arange(0, 16 * U)
        b = tl.load(w_base + w_rows[:, None] * KP + jj[None, :], mask=w_live[:, None], other=0).to(tl.int32)
        if U == 1:
            groups = (b,)
        elif U == 2:
            groups = tl.split(tl.permute(tl.reshape(b, (BN, 2, 16)), (0, 2, 1)))
        else:
            even, odd = tl.split(tl.permute(tl.reshape(b, (BN, 2, 2, 16)), (0, 3, 1, 2)))  # groups (0, 2), (1, 3)
            groups = (tl.split(even)[0], tl.split(odd)[0], tl.split(even)[1], tl.split(odd)[1])
        return groups

    @triton.jit
    def _scales(s_base, w_rows, w_live, g0, G, U: tl.constexpr):
        """The e8m0 scales of rows w_rows [BN] at groups g0 to g0 + U - 1 as one word a row (group g0 + u in
        byte u), one load. U divides G and g0, so a word is aligned and inside its row."""
        word = tl.int32 if U == 4 else (tl.int16 if U == 2 else tl.uint8)
        at = (s_base + w_rows * G + g0).to(tl.pointer_type(word))
        return tl.load(at, mask=w_live, other=0)

    @triton.jit
    def _x_group_t(x_ptr, x_rows, live, gi, K, SLOTS: tl.constexpr):
        """Rows x_rows [BM] of x bf16 [., K] at scale group gi, transposed: [32, BM]; zero in rows not live."""
        kk = gi * 32 + (_slot_k(tl.arange(0, 32)) if SLOTS else tl.arange(0, 32))  # as `_w_group` orders K
        return tl.load(x_ptr + x_rows[None, :] * K + kk[:, None], mask=live[None, :], other=0.0)

    @triton.jit
    def _fp4_tile_dot(acc, x_ptr, x_rows, live, K, w_base, s_base, w_rows, w_live,
                      HW_FP8: tl.constexpr, BF16: tl.constexpr, BN: tl.constexpr, U: tl.constexpr,
                      BITS: tl.constexpr, SLOTS: tl.constexpr):
        """acc [BN, BM] += dequant(W[w_rows]) · x[x_rows, :K]ᵀ: the weight is the dot's first operand, decoded in
        registers (where a tensor-core dot can take it without a trip through shared memory), x's rows its second.
        K is walked one scale group (32 values) a dot, U groups an iteration; an iteration's codes are one load
        (`_code_groups`) and its scales one word a row (`_scales`). U divides G (routed_experts), so the loads
        take no mask along K."""
        KP, G = K // 2, K // 32
        for g0 in range(0, G, U):
            scales = _scales(s_base, w_rows, w_live, g0, G, U)
            codes = _code_groups(w_base, w_rows, w_live, g0, tl.multiple_of(KP, 16), BN, U)
            for du in tl.static_range(U):
                s = (scales.to(tl.int32) >> (8 * du)) & 255  # byte du: group g0 + du
                acc = _dot(_w_group(codes[du], s, HW_FP8, BN, BF16, BITS, SLOTS),
                           _x_group_t(x_ptr, x_rows, live, g0 + du, K, SLOTS), acc, BF16)
        return acc

    @triton.jit
    def _tile_rows(tile_ptr, t, BM: tl.constexpr):
        """(expert, sorted pair rows [BM], live mask) of tile t; expert -1 for a dead tile."""
        e = tl.load(tile_ptr + 3 * t)
        row0, row_end = tl.load(tile_ptr + 3 * t + 1), tl.load(tile_ptr + 3 * t + 2)
        r = row0 + tl.arange(0, BM)
        return e, r, r < row_end

    @triton.jit
    def _swiglu_hidden(g, u, weight, limit, BF16: tl.constexpr):
        """The hidden from w1's and w3's fp32 sums: each rounded to bf16 as the GEMM output of spec §5 step 1, the
        clamps, silu(g)·u and the routing weight in fp32 (kernels/moe.py's operations), rounded to bf16."""
        g = _round_bf16(g, BF16).to(tl.float32)
        u = _round_bf16(u, BF16).to(tl.float32)
        if limit > 0:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        hidden = tl.div_rn(g, 1.0 + tl.exp((-g).to(tl.float64)).to(tl.float32)) * u  # silu(g)·u (kernels/moe.py)
        return _round_bf16(weight * hidden, BF16)

    @triton.jit
    def _gate_up_kernel(x_ptr, pairs_ptr, tile_ptr, w_ptr, s_ptr, route_ptr, out_ptr, D, I, TOPK, limit,
                        HW_FP8: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        U: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr):
        """BN rows of w13 a program, w1's and w3's interleaved (row 2i: w1's row for output n_i, 2i+1: w3's), so
        one accumulator and one dot a group serve both: BN / 2 of inter's outputs, the hidden bf16 [P, I]."""
        pid_n, t = tl.program_id(0), tl.program_id(1)  # a tile's output blocks run side by side: x's rows stay in L2
        e, r, live = _tile_rows(tile_ptr, t, BM)
        if e >= 0:
            pair = tl.load(pairs_ptr + r, mask=live, other=0)
            token = (pair // TOPK).to(tl.int64)
            i2 = tl.arange(0, BN)
            n2 = pid_n * (BN // 2) + i2 // 2
            e64 = e.to(tl.int64)
            w_base = w_ptr + e64 * (2 * I) * (D // 2)  # w13 [E, 2I, D/2]: w1's rows, then w3's
            s_base = s_ptr + e64 * (2 * I) * (D // 32)
            acc = _fp4_tile_dot(tl.zeros((BN, BM), dtype=tl.float32), x_ptr, token, live, D, w_base, s_base,
                                tl.where(i2 % 2 == 0, n2, I + n2), n2 < I, HW_FP8, BF16, BN, U, BITS, SLOTS)
            g, u = tl.split(tl.permute(tl.reshape(acc, (BN // 2, 2, BM)), (0, 2, 1)))
            weight = tl.load(route_ptr + pair, mask=live, other=0.0)
            n = pid_n * (BN // 2) + tl.arange(0, BN // 2)
            tl.store(out_ptr + r.to(tl.int64)[None, :] * I + n[:, None],
                     _swiglu_hidden(g, u, weight[None, :], limit, BF16), mask=live[None, :] & (n < I)[:, None])

    @triton.jit
    def _down_kernel(h_ptr, tile_ptr, w_ptr, s_ptr, out_ptr, D, I, HW_FP8: tl.constexpr, BF16: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, U: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr):
        """The w2 product of BN outputs a program, bf16 [P, D]."""
        pid_n, t = tl.program_id(0), tl.program_id(1)  # a tile's output blocks run side by side: x's rows stay in L2
        e, r, live = _tile_rows(tile_ptr, t, BM)
        if e >= 0:
            n = pid_n * BN + tl.arange(0, BN)
            n_live = n < D
            e64 = e.to(tl.int64)
            w_base = w_ptr + e64 * D * (I // 2)  # w2 [E, D, I/2]
            s_base = s_ptr + e64 * D * (I // 32)
            acc = _fp4_tile_dot(tl.zeros((BN, BM), dtype=tl.float32), h_ptr, r.to(tl.int64), live, I,
                                w_base, s_base, n, n_live, HW_FP8, BF16, BN, U, BITS, SLOTS)
            tl.store(out_ptr + r.to(tl.int64)[None, :] * D + n[:, None], _round_bf16(acc, BF16),
                     mask=live[None, :] & n_live[:, None])

    @triton.jit
    def _plan_kernel(ids_ptr, pairs_ptr, tiles_ptr, slots_ptr, P, E, T, K: tl.constexpr, BM: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
        """`plan`'s values for BLOCK pairs and BLOCK tiles a program. Each program counts every pair by expert
        (a histogram, CHUNK pairs at a time: P is a decode step's few hundred to PLAN_PAIRS), so no program waits
        on another; a pair's sorted row is its expert's first row plus the pairs of its expert before it (the
        stable sort); its row's slot is the number of the row's ids below its own (the ids of a row are distinct
        experts); a tile's expert is the number of experts whose tiles end at or before it (torch.searchsorted,
        right)."""
        pid = tl.program_id(0)
        ex = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], tl.int32)
        for q0 in range(0, P, CHUNK):
            q = q0 + tl.arange(0, CHUNK)
            counts += tl.histogram(tl.load(ids_ptr + q, mask=q < P, other=BLOCK_E - 1).to(tl.int32), BLOCK_E)
        counts = tl.where(ex < E, counts, 0)  # bin BLOCK_E - 1 > E - 1 took the chunks' dead lanes
        ends = tl.cumsum(counts, 0)
        n_tiles = (counts + BM - 1) // BM
        tile_ends = tl.cumsum(n_tiles, 0)
        # this program's pairs
        p = pid * BLOCK + tl.arange(0, BLOCK)
        live = p < P
        e_p = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int32)
        rank = tl.zeros([BLOCK], tl.int32)
        for q0 in range(0, tl.minimum(pid * BLOCK + BLOCK, P), CHUNK):
            q = q0 + tl.arange(0, CHUNK)
            e_q = tl.load(ids_ptr + q, mask=q < P, other=-1).to(tl.int32)
            rank += tl.sum(((e_q[None, :] == e_p[:, None]) & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
        position = tl.gather(ends - counts, e_p, 0) + rank
        tl.store(pairs_ptr + position, p.to(tl.int64), mask=live)
        j = tl.arange(0, BLOCK_K)
        row_ids = tl.load(ids_ptr + (p // K)[:, None] * K + j[None, :], mask=live[:, None] & (j < K)[None, :],
                          other=BLOCK_E).to(tl.int32)
        below = tl.sum((row_ids < e_p[:, None]).to(tl.int32), axis=1)
        tl.store(slots_ptr + (p // K) * K + below, position.to(tl.int64), mask=live)
        # this program's tiles
        t = pid * BLOCK + tl.arange(0, BLOCK)
        e_t = tl.sum(((tile_ends[None, :] <= t[:, None]) & (ex < E)[None, :]).to(tl.int32), axis=1)
        ec = tl.minimum(e_t, E - 1)
        row0 = tl.gather(ends - counts, ec, 0) + (t - tl.gather(tile_ends - n_tiles, ec, 0)) * BM
        end = tl.minimum(row0 + BM, tl.gather(ends, ec, 0))
        at = tiles_ptr + 3 * t
        tl.store(at, tl.where(e_t < E, e_t, -1).to(tl.int64), mask=t < T)
        tl.store(at + 1, row0.to(tl.int64), mask=t < T)
        tl.store(at + 2, end.to(tl.int64), mask=t < T)

    @triton.jit
    def _swiglu_quant_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, limit, BF16: tl.constexpr,
                             BLOCK: tl.constexpr):
        """A row's BLOCK hidden values of the shared expert from w1's and w3's bf16 outputs, Expert.forward's
        lines: the clamps, silu(g) = g / (1 + expf(-g)) as torch's CUDA silu computes it (libdevice's expf, an
        IEEE division; `tl.exp` would be an ex2.approx), times u, rounded to bf16; then w2's act_quant (FP8 per
        32 values, kernels/quant.py's `_quantise`). Under the interpreter (no libdevice) the exponential is
        numpy's, through fp64."""
        r = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + r * stride_g + n, mask=n < I, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * stride_u + n, mask=n < I, other=0.0).to(tl.float32)
        if limit > 0:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        if BF16:
            e = libdevice.exp(-g)
        else:
            e = tl.exp((-g).to(tl.float64)).to(tl.float32)
        hidden = _round_bf16(tl.div_rn(g, 1.0 + e) * u, BF16).to(tl.float32)
        q = tl.reshape(_quantise(tl.reshape(hidden, (BLOCK // 32, 32)), 0), (BLOCK,))  # I is whole groups of 32
        tl.store(out_ptr + r * I + n, q.to(tl.bfloat16), mask=n < I)

    @triton.jit
    def _combine_kernel(out_ptr, slots_ptr, shared_ptr, y_ptr, D, TOPK: tl.constexpr, BF16: tl.constexpr,
                        BD: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        acc = tl.zeros((BD,), dtype=tl.float32)
        for j in tl.static_range(TOPK):  # the row's pairs in ascending expert id
            p = tl.load(slots_ptr + n * TOPK + j)
            acc += tl.load(out_ptr + p * D + d, mask=d < D, other=0.0).to(tl.float32)
        acc += tl.load(shared_ptr + n * D + d, mask=d < D, other=0.0).to(tl.float32)  # the shared expert last
        tl.store(y_ptr + n * D + d, _round_bf16(acc, BF16), mask=d < D)


def applies(x: torch.Tensor) -> bool:
    """CUDA, Triton present, bf16 activations."""
    return triton is not None and x.is_cuda and x.dtype == torch.bfloat16


# decode's tile: the best of 21 at 64 rows (H100): 4 warps, U = 4, K in slot order (benchmarks/bench_slice.py
# --decode-tile sets it)
DECODE_TILE = dict(BM=16, BN=128, U=4, KS=1, num_warps=4, num_stages=3)


def config(pairs: int, experts: int) -> dict:
    """Tile sizes by the shape only: BM pairs a tile (16, tl.dot's least, while an expert gets a few rows on average:
    decode), BN weight rows a program, U scale groups of K (32 values each) an iteration; warps and pipeline stages.
    Chosen by benchmarks/bench_fp4.py --sweep on an H200; no autotuning (a timing-dependent choice would change
    bits). (K split over programs, their fp32 sums added in order, was tried and removed: 64 rows took 1-44% longer
    with 2 to 8 parts on an H200, benchmarks/RESULTS.md.) B=0 decodes the codes through e4m3 instead of by bit
    patterns (`_w_group`; the same values, more instructions: moe_forward's path for scales past
    BIT_DECODE_MAX_SCALE). KS=1 walks a group's K in the dot's slot order (`_slot_k`): a thread's code bytes one
    word, not four bytes (4 LDSM an iteration for 32 LDS.U8 on sm_90): decode's default, 6-10% faster there on an
    H100; prefill's tiles were slower with it (benchmarks/RESULTS.md). U = 2 at prefill since an iteration's codes are
    one load (`_code_groups`); at decode U = 4 took 52 registers and 1.2x longer on 8 warps (H200), but on 4 warps
    (one warpgroup, 128 weight rows) 0.96x U = 2's time on 8, and the slice's decode step 0.96x (H100)."""
    if pairs <= 4 * experts:  # decode
        return dict(DECODE_TILE)
    if pairs < 128 * experts:  # fewer than 128 pairs an expert on average: the best of 11 at 2,048 rows
        return dict(BM=64, BN=128, U=2, num_warps=4, num_stages=3)
    return dict(BM=128, BN=64, U=2, num_warps=4, num_stages=3)  # the best of 11 at 8,192 rows


# Up to this many (row, slot) pairs `plan` is one launch (`_plan_kernel`, a decode step's), beyond it torch's ops:
# each of the launch's programs counts every pair.
PLAN_PAIRS = 4096


def plan(ids: torch.Tensor, n_experts: int, BM: int, one_launch: bool | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, k] -> (pairs [N·k]: pair indices n·k + slot sorted by expert; tiles int64 [T, 3]: (expert or -1,
    first sorted row, end row) for T = cdiv(N·k, BM) + min(E, N·k); slots [N, k]: each row's sorted rows in
    ascending expert id). Device ops only, fixed shapes: up to PLAN_PAIRS pairs on CUDA one launch
    (`_plan_kernel`; `one_launch` overrides the choice), else ~30 torch ops (a stable sort among them); the same
    values. A row's ids are distinct experts (the gate's top-k)."""
    N, k = ids.shape
    P, E = N * k, n_experts
    if one_launch if one_launch is not None else (ids.is_cuda and P <= PLAN_PAIRS):
        T = triton.cdiv(P, BM) + min(E, P)
        dev = ids.device
        pairs, tiles = torch.empty(P, dtype=torch.int64, device=dev), torch.empty(T, 3, dtype=torch.int64, device=dev)
        slots = torch.empty(N, k, dtype=torch.int64, device=dev)
        if P:
            block = 64
            _plan_kernel[(triton.cdiv(max(P, T), block),)](
                ids.contiguous(), pairs, tiles, slots, P, E, T, K=k, BM=BM, BLOCK=block,
                BLOCK_E=triton.next_power_of_2(E + 1), BLOCK_K=triton.next_power_of_2(k), CHUNK=128, num_warps=4)
        return pairs, tiles, slots
    flat = ids.reshape(-1)
    pairs = torch.sort(flat, stable=True).indices
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    n_tiles = (counts + BM - 1) // BM
    tile_ends = n_tiles.cumsum(0)
    t = torch.arange(triton.cdiv(P, BM) + min(E, P), device=ids.device)
    e = torch.searchsorted(tile_ends, t, right=True)
    ec = e.clamp(max=E - 1)
    row0 = ends[ec] - counts[ec] + (t - (tile_ends[ec] - n_tiles[ec])) * BM
    tiles = torch.stack([torch.where(e < E, e, -1), row0, torch.minimum(row0 + BM, ends[ec])], dim=1)
    position = torch.empty_like(pairs).scatter_(0, pairs, torch.arange(P, device=ids.device))
    slots = position.view(N, k).gather(1, ids.argsort(dim=-1))
    return pairs, tiles.contiguous(), slots.contiguous()


def routed_experts(xq: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                   w2: torch.Tensor, s2: torch.Tensor, limit: float, hw: bool | None = None, cfg: dict | None = None):
    """Every (row, slot) pair's expert output, bf16 [N·k, dim] in sorted pair order, and `slots` [N, k] (plan).
    xq bf16 [N, dim] (act_quant'd); weights fp32 [N, k]; ids [N, k]; w13 uint8 [E, 2·inter, dim/2] (each
    expert's w1 rows then its w3 rows), s13 e8m0 [E, 2·inter, dim/32]; w2 uint8 [E, dim, inter/2], s2 e8m0
    [E, dim, inter/32]. `hw` and `cfg` override the e4m3 decode and the tile configuration (tests, benchmarks)."""
    from kernels.quant import act_quant_fp8

    N, k = ids.shape
    E, I2, _ = w13.shape
    D, I = xq.size(1), I2 // 2
    if D % GROUP or I % GROUP:
        raise ValueError(f"fp4 MoE: dim {D} and inter {I} must be multiples of the scale group {GROUP}")
    cfg = dict(config(N * k, E), **(cfg or {}))
    BM, BN, U, B = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("U"), cfg.pop("B", 1)
    if U not in (1, 2, 4):
        raise ValueError(f"fp4 MoE: U={U} scale groups an iteration; it must be 1, 2 or 4 (their codes are one load)")
    ks = cfg.pop("KS", 0)
    pairs, tiles, slots = plan(ids, E, BM)
    if tiles.size(0) > 65535:  # the grid's second axis
        raise ValueError(f"fp4 MoE: {N} rows x {k} make {tiles.size(0)} tiles of {BM}, more than a launch takes "
                         "(65,535); prefill in smaller chunks (max_num_batched_tokens)")
    while (D // GROUP) % U or (I // GROUP) % U:  # an iteration's scales are one aligned word a row
        U //= 2
    hw = hw_fp8(xq.device) if hw is None else hw
    P, dev = N * k, xq.device
    hidden = torch.empty(P, I, dtype=torch.bfloat16, device=dev)
    _gate_up_kernel[(triton.cdiv(I, BN // 2), tiles.size(0))](  # BN rows of w13: BN / 2 outputs
        xq.contiguous(), pairs, tiles, w13.view(torch.uint8), s13.view(torch.uint8), weights.contiguous().view(-1),
        hidden, D, I, k, float(limit), HW_FP8=hw, BF16=xq.is_cuda, BM=BM, BN=BN, U=U, BITS=B, SLOTS=ks, **cfg)
    hidden = act_quant_fp8(hidden, GROUP)  # the official linear() before w2
    out = torch.empty(P, D, dtype=torch.bfloat16, device=dev)
    _down_kernel[(triton.cdiv(D, BN), tiles.size(0))](
        hidden, tiles, w2.view(torch.uint8), s2.view(torch.uint8), out, D, I, HW_FP8=hw, BF16=xq.is_cuda, BM=BM,
        BN=BN, U=U, BITS=B, SLOTS=ks, **cfg)
    return out, slots


def combine(out: torch.Tensor, slots: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """[N, dim] bf16: each row's routed outputs (out [N·k, dim] at slots [N, k]) added in fp32 in ascending
    expert id, then shared [N, dim], rounded once (spec §5 "Output")."""
    N, k = slots.shape
    D = out.size(1)
    y = torch.empty(N, D, dtype=shared.dtype, device=out.device)
    if N:
        block = min(1024, triton.next_power_of_2(D))
        _combine_kernel[(N, triton.cdiv(D, block))](out, slots, shared.contiguous(), y, D, TOPK=k,
                                                    BF16=out.is_cuda, BD=block)
    return y


def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, s13, w2, s2, limit: float,
        shared: torch.Tensor, hw: bool | None = None, cfg: dict | None = None,
        xq: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of model/moe.py MoE.forward plus the shared expert's output `shared` [N, dim]:
    x bf16 [N, dim] -> y bf16 [N, dim]. `xq`: x's act_quant per GROUP, if the caller has it."""
    from kernels.quant import act_quant_fp8

    if not x.size(0):
        return torch.empty_like(x)
    xq = act_quant_fp8(x, GROUP) if xq is None else xq
    out, slots = routed_experts(xq, weights, ids, w13, s13, w2, s2, limit, hw, cfg)
    return combine(out, slots, shared)


def moe_reference(x, weights, ids, w13, s13, w2, s2, limit: float, shared: torch.Tensor) -> torch.Tensor:
    """The torch path: the official per-expert loop, each FP4 weight dequantised to bf16 (model/released.py
    FP4Linear, model/moe.py Expert), the routed outputs added in ascending expert id, the shared one last."""
    import torch.nn.functional as F

    from model.quant import act_quant_fp8, dequantize_fp4_e8m0

    I = w13.size(1) // 2
    s13, s2 = s13.view(torch.float8_e8m0fnu), s2.view(torch.float8_e8m0fnu)  # bytes or e8m0: their values
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        xq = act_quant_fp8(x[rows], GROUP)
        w = dequantize_fp4_e8m0(w13[e], s13[e]).to(x.dtype)
        g, u = F.linear(xq, w[:I]).float(), F.linear(xq, w[I:]).float()
        if limit > 0:
            u, g = u.clamp(-limit, limit), g.clamp(max=limit)
        hidden = (weights[rows, slot, None] * (F.silu(g) * u)).to(x.dtype)
        y[rows] += F.linear(act_quant_fp8(hidden, GROUP), dequantize_fp4_e8m0(w2[e], s2[e]).to(x.dtype))
    return (y + shared).to(x.dtype)


# ---- model/moe.py's MoE over FP4 experts (the released storage): its grouped CUDA path ----------------------
def fp4_experts(ffn) -> bool:
    """Whether `ffn` (a model.moe.MoE) has routed experts in FP4 (model/released.py FP4Linear)."""
    first = ffn.experts[ffn.local_experts[0]] if len(ffn.local_experts) else None
    return first is not None and first.w1.weight.dtype == torch.float4_e2m1fn_x2


@torch.no_grad()
def fp4_stacked(ffn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' FP4 codes and e8m0 scales stacked for kernels/fp4_moe.py, as bytes:
    w13 [E, 2·inter, d/2] (each expert's w1 rows, then its w3 rows), s13 [E, 2·inter, d/32],
    w2 [E, d, inter/2], s2 [E, d, inter/32]. Made once, one expert at a time, and each expert's
    parameters then become views into them (their names, shapes and dtypes unchanged), so the experts'
    memory is not doubled and an in-place change of a weight is seen by both. Remade when a parameter
    is replaced by another tensor (its data pointer changes). Whether every scale is within the bit decode's
    range (`BIT_DECODE_MAX_SCALE`) is found once, here, and kept beside them for `moe_forward`."""
    def params():
        return [p for e in ffn.experts for lin in (e.w1, e.w3, e.w2) for p in (lin.weight, lin.scale)]

    key = tuple(p.data_ptr() for p in params())
    if ffn._stacked is not None and ffn._stacked[0] == key:
        return ffn._stacked[1:5]
    e0, E = ffn.experts[0], len(ffn.experts)
    inter = e0.w1.weight.size(0)
    like = lambda p, *shape: torch.empty(E, *shape, dtype=torch.uint8, device=p.device)
    w13 = like(e0.w1.weight, 2 * inter, e0.w1.weight.size(1))
    s13 = like(e0.w1.scale, 2 * inter, e0.w1.scale.size(1))
    w2, s2 = like(e0.w2.weight, *e0.w2.weight.shape), like(e0.w2.scale, *e0.w2.scale.shape)
    for i, e in enumerate(ffn.experts):
        for lin, codes, scales in ((e.w1, w13[i, :inter], s13[i, :inter]), (e.w3, w13[i, inter:], s13[i, inter:]),
                                   (e.w2, w2[i], s2[i])):
            codes.copy_(lin.weight.view(torch.uint8))
            scales.copy_(lin.scale.view(torch.uint8))
            lin.weight.data = codes.view(lin.weight.dtype)  # the old storage is freed here
            lin.scale.data = scales.view(lin.scale.dtype)
    in_range = bool(torch.maximum(s13.max(), s2.max()) <= BIT_DECODE_MAX_SCALE)  # one sync, once
    ffn._stacked = (tuple(p.data_ptr() for p in params()), w13, s13, w2, s2, in_range)
    return ffn._stacked[1:5]


def moe_forward(ffn, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Routed + shared output [N, d] in x's dtype, for x bf16 [N, d]: the FP4 experts through
    kernels/fp4_moe.py (only the selected experts' weights read, decoded in registers), the shared
    expert (FP8) through its FP8 products (`shared_expert`), the sum in the official order rounded once.
    x is quantised once for both: the routed experts' act_quant and the shared expert's FP8Linears' take the
    same groups of 32 (GROUP, model/quant.py WEIGHT_TILE)."""
    from kernels.quant import act_quant_fp8

    stacked = fp4_stacked(ffn)
    cfg = None if ffn._stacked[5] else dict(B=0)  # a scale above 2^1: the codes decoded through e4m3
    xq = act_quant_fp8(x, GROUP)
    return moe(x, weights, ids, *stacked, ffn.shared_experts.limit, shared_expert(ffn.shared_experts, x, xq),
               cfg=cfg, xq=xq)


def shared_expert(expert, x: torch.Tensor, xq: torch.Tensor | None = None) -> torch.Tensor:
    """model/moe.py Expert.forward of the shared expert (no routing weight) for x bf16 [N, d] on CUDA, its
    FP8Linears' path (kernels/fp8_gemm.py) in fewer launches and the same bits: x quantised once for w1 and w3
    (each FP8Linear quantised it again; `xq`, its act_quant per 32, if the caller has it), the clamped SwiGLU and
    w2's act_quant in one launch (`_swiglu_quant_kernel`, where the torch lines took seven and the act_quant
    one). Other storage: Expert.forward."""
    from kernels.fp8_gemm import fp8_gemm
    from kernels.quant import act_quant_fp8
    from model.quant import WEIGHT_TILE

    if any(lin.weight.dtype != torch.float8_e4m3fn for lin in (expert.w1, expert.w2, expert.w3)) or not x.size(0):
        return expert(x)
    xq = act_quant_fp8(x, WEIGHT_TILE) if xq is None else xq
    g, u = fp8_gemm(xq, expert.w1.weight, expert.w1.scale), fp8_gemm(xq, expert.w3.weight, expert.w3.scale)
    return fp8_gemm(swiglu_quant(g, u, expert.limit), expert.w2.weight, expert.w2.scale)


def swiglu_quant(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """w1's and w3's bf16 outputs [N, I] (I whole groups of 32) -> the shared expert's hidden after w2's
    act_quant, bf16 [N, I], in one launch (`_swiglu_quant_kernel`)."""
    N, I = g.shape
    hidden = torch.empty(N, I, dtype=torch.bfloat16, device=g.device)
    block = min(256, triton.next_power_of_2(I))
    if N:
        _swiglu_quant_kernel[(N, triton.cdiv(I, block))](g, u, hidden, I, g.stride(0), u.stride(0), float(limit),
                                                          BF16=g.is_cuda, BLOCK=block)
    return hidden
