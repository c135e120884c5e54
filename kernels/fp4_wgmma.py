"""The FP4 experts' decode tile on sm_90 with asynchronous warpgroup MMAs (Gluon): kernels/fp4_moe.py's
`_gate_up_kernel` and `_down_kernel` at decode's tile (BM 16 pairs, BN 128 weight rows, U 4 scale groups an
iteration, one warpgroup), written with explicit layouts so that a dot's MMA runs while the next dot decodes.
Off by default: `fp4_moe.routed_experts(..., cfg=dict(G=1))` runs it (benchmarks/bench_fp4.py --tiles times it
against the Triton tile); it becomes decode's tile on sm_90 only if it is faster there.

Why: Triton issues a `tl.dot` whose first operand is in registers synchronously (its pipeliner makes a dot
asynchronous only when a register operand is defined outside the loop), so on sm_90 each of the Triton tile's 16
wgmmas an iteration is followed by a wait for it (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) before the next group's decode
may overwrite its registers: a warpgroup never decodes under its own MMA (benchmarks/RESULTS.md). Here a dot's
`warpgroup_mma(is_async=True)` is waited on only after the next dot's MMA is issued (`warpgroup_mma_wait` with
OUTSTANDING = 1), its decoded weight kept alive until then.

Where the operands travel:
- the codes come from global memory straight into the registers of the MMA's first operand (`_A`, the wgmma
  operand layout: lane c of a row's quad holds K slots 2c, 2c + 1, 2c + 8, 2c + 9 of each 16): no code byte
  passes through shared memory. A thread's word (4 bytes) of a row is exactly its 8 slots of a dot of 32, so a
  dot's codes are words [BN, 4] in `_CODES`, the operand's layout with a row's 32 slots folded into 4 words;
- a byte becomes its two codes as bf16 bit patterns (fp4_moe `_w_group`'s arithmetic), scaled by 2^(s - 1) with
  one `mul.rn.bf16x2` for both (exact: a power of two);
- x's rows go through registers into one of two shared-memory buffers an iteration (one CTA barrier), where the
  MMA reads them as its second operand in the same K slots;
- the next iteration's codes, scales and x are loaded into registers while this one's decode and MMAs run.

Which K values a dot takes (LANES): with LANES = 0, dot d takes scale group g0 + d whole, lane c its word c (bytes
4c to 4c + 3): the Triton tile's K slots (KS=1, fp4_moe `_slot_k`), so the outputs are its bits, but a row's word
of each group is its own 4-byte load (16 a thread an iteration). With LANES = 1 (the tile's default), lane c takes
group g0 + c, a row's 16 bytes of it one load, and dot d its word d: the same exact products summed in another
order (within the Triton tile's tolerance of the official loop; deterministic), 561 SASS instructions an iteration
where LANES = 0 takes 648 (sm_90, off the GPU). tests/gpu/test_fp4_gpu.py holds both to it.

wgmma is sm_90's instruction: `applies` is true only there; elsewhere (sm_100 included) and under the CPU
interpreter, which has no Gluon, fp4_moe's Triton tile runs.
"""
import torch

try:  # Gluon ships with Triton (triton.experimental); without it, fp4_moe's Triton tile is the only one.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:
    gluon = None

BM, BN, U = 16, 128, 4  # pairs a tile, weight rows a program, scale groups an iteration (fp4_moe config's decode)
DEFAULTS = dict(OUTSTANDING=1, LANES=1, num_warps=4)  # the kernels' settings; `gate_up`'s opts override them

if gluon is not None:
    _BM, _BN, _U = gl.constexpr(BM), gl.constexpr(BN), gl.constexpr(U)
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the CTA barrier: `barrier` from Triton 3.7
    _ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
    _A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_ACC, k_width=2))  # the decoded group [_BN, 32]
    # A group's codes as words [_BN rows, 4]: _A's layout with a row's 32 K slots folded into 4 words, word c (the
    # row's bytes 4c to 4c + 3) on lane c of the row's quad; rows 8 and 64 apart in a thread's registers.
    _CODES = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [64, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[_BN, 4]))
    # LANES: an iteration's codes as words [_BN rows, 4 groups, 4 words]: group g0 + c on lane c of the row's quad,
    # its 4 words (16 bytes, one load) in registers; word d is dot d's first operand
    _CODES3 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [64, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[_BN, 4, 4]))
    _ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, _CODES3)))  # a program's weight rows [_BN]
    # LANES: an iteration's x rows as int32 words [U dots, BM rows, 4 groups, 4 words]: a group's 4 words one load
    _X4 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 8, 4, 1],
                                        warps_per_cta=[4, 1, 1, 1], order=[3, 2, 1, 0]))
    # LANES: x's iteration [U, BM, 32] bf16 as stored into shared memory (`_x_lanes`)
    _X_STORE = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 8, 4],
                                             warps_per_cta=[4, 1, 1], order=[2, 1, 0]))
    # LANES = 0: an iteration's x rows as int32 words (two bf16 K values each) [U groups, BM rows, 16 words]
    _X = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 2], threads_per_warp=[1, 4, 8],
                                       warps_per_cta=[1, 4, 1], order=[2, 1, 0]))
    # x's two iteration buffers [2U, BM, 32]: stored an iteration at a time through a rank-3 layout, read a group at a
    # time by the MMA through the same bytes' rank-2 layout (groups outermost, each [BM, 32] swizzled alike)
    _X_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([2 * _U, _BM, 32], gl.bfloat16))
    _X_MMA = gl.constexpr(gl.NVMMASharedLayout.get_default_for([_BM, 32], gl.bfloat16))
    # the epilogues: down's output [_BN outputs, BM pairs], 4 outputs of a pair a thread; gate_up's w1 and w3 rows
    # (2i, 2i + 1) in one thread's registers, to split
    _OUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[32, 1], warps_per_cta=[1, 4],
                                         order=[0, 1]))
    _GU = gl.constexpr(gl.BlockedLayout(size_per_thread=[2, 1], threads_per_warp=[32, 1], warps_per_cta=[2, 2],
                                        order=[0, 1]))

    @gluon.jit
    def _halves(word):
        """An int32 word's two bf16 halves (low, high): a register's two halves, no instruction."""
        return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [word],
                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)

    @gluon.jit
    def _byte(words, scale2, q: gl.constexpr):
        """Byte q of each word as its two codes' bf16 values (fp4_moe `_w_group`'s bit patterns) times the group's
        2^(s - 1), one `mul.rn.bf16x2` for both (a power of two: exact), as one word: the low nibble's value in the
        low half."""
        b = (words >> (8 * q)) & 255
        pair = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & -0x7FFF8000)
        return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [pair, scale2], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _codes(code_at, g, code_live):
        """The codes of scale groups g to g + _U - 1 (_U = 4) as words [_BN, 4] each (`_CODES`)."""
        return (gl.load(code_at + 4 * g, mask=code_live, other=0),
                gl.load(code_at + 4 * (g + 1), mask=code_live, other=0),
                gl.load(code_at + 4 * (g + 2), mask=code_live, other=0),
                gl.load(code_at + 4 * (g + 3), mask=code_live, other=0))

    @gluon.jit
    def _decode(words, scale2):
        """A dot's codes, words [_BN, 4] int32 (`_CODES`), as bf16 values [_BN, 32] in the dot's K slot order in the
        MMA's operand layout: byte q = 2h + p of word c holds slots 16h + 8p + 2c + j (nibble j). scale2 [_BN, 1]
        (LANES = 0: a dot's words are one group's) or [_BN, 4] (LANES: word c is group g0 + c's): each word's
        2^(s - 1) as two bf16 in a word."""
        ph = gl.join(gl.join(_byte(words, scale2, 0), _byte(words, scale2, 1)),
                     gl.join(_byte(words, scale2, 2), _byte(words, scale2, 3)))  # [_BN, c, p, h]
        lo, hi = _halves(ph)
        v = gl.permute(gl.join(lo, hi), (0, 3, 2, 1, 4))  # [_BN, h, p, c, j]
        return gl.convert_layout(gl.reshape(v, [_BN, 32]), _A)  # the same registers: no data moves

    @gluon.jit
    def _x_groups(x_words, x_rows, live, g, K):
        """Rows x_rows [BM] of x (int32 words, two bf16 each) at scale groups g to g + U - 1 in the dot's slot order,
        bf16 [U, BM, 32]: a group's slot pair 8h + 4p + c holds its K values 8c + 4h + 2p and + 1 (fp4_moe
        `_slot_k`); zero in rows not live."""
        u = gl.arange(0, _U, layout=gl.SliceLayout(1, gl.SliceLayout(2, _X)))
        sp = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _X)))
        kp = (g + u)[:, None, None] * 16 + (4 * (sp % 4) + 2 * (sp // 8) + (sp // 4) % 2)[None, None, :]
        rows = gl.convert_layout(x_rows, gl.SliceLayout(0, gl.SliceLayout(2, _X)))
        ok = gl.convert_layout(live, gl.SliceLayout(0, gl.SliceLayout(2, _X)))
        w = gl.load(x_words + rows[None, :, None] * (K // 2) + kp, mask=ok[None, :, None], other=0)
        lo, hi = _halves(w)
        return gl.reshape(gl.join(lo, hi), [_U, _BM, 32])

    @gluon.jit
    def _lane_words(code_at3, g, code_live3):
        """LANES: an iteration's codes (groups g to g + 3, one a lane) as the 4 dots' words [_BN, 4] (`_CODES`)."""
        w = gl.load(code_at3 + 4 * g, mask=code_live3, other=0)
        even, odd = gl.split(gl.reshape(w, [_BN, 4, 2, 2]))  # words (0, 2), (1, 3)
        w0, w2 = gl.split(even)
        w1, w3 = gl.split(odd)
        return (gl.convert_layout(w0, _CODES), gl.convert_layout(w1, _CODES), gl.convert_layout(w2, _CODES),
                gl.convert_layout(w3, _CODES))

    @gluon.jit
    def _x_lanes(x_words, x_rows, live, g, K):
        """LANES: rows x_rows [BM] of x at groups g to g + 3 in the lanes' slot order, bf16 [U, BM, 32]: dot d's slot
        pair 8h + 4p + c holds word 4d + 2h + p of group g + c (its K values 32(g + c) + 8d + 4h + 2p and + 1)."""
        d = gl.arange(0, _U, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _X4))))
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _X4))))
        m = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _X4))))
        rows = gl.convert_layout(x_rows, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _X4))))
        ok = gl.convert_layout(live, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _X4))))
        at = (rows[None, :, None, None] * (K // 2) + 16 * (g + c[None, None, :, None]) + 4 * d[:, None, None, None]
              + m[None, None, None, :])
        w = gl.load(x_words + at, mask=ok[None, :, None, None], other=0)
        w = gl.reshape(gl.permute(w, (0, 1, 3, 2)), [_U, _BM, 16])  # slot pair 4m + c
        lo, hi = _halves(w)
        # stored from a plain layout: from the load's, Triton stores with stmatrix and ptxas then serializes the
        # MMAs (C7515, "non wgmma instructions defining accumulator registers")
        return gl.convert_layout(gl.reshape(gl.join(lo, hi), [_U, _BM, 32]), _X_STORE)

    @gluon.jit
    def _tile_k_loop(x_words, x_rows, live, K, w_words, s_base, w_rows, w_live, OUTSTANDING: gl.constexpr,
                     LANES: gl.constexpr):
        """acc [_BN, _BM] fp32 (`_ACC`) = dequant(W[w_rows]) · x[x_rows, :K]ᵀ, K walked _U scale groups an iteration.
        x_rows, live [BM] in any layout; w_rows, w_live [_BN] in `_ROWS`. OUTSTANDING: the MMAs left running when
        one is issued (1; 0 waits for each at once, as the Triton tile does). LANES: an iteration's dot d takes
        word d of group g0 + c from lane c (one 16-byte load a row's group); else dot d takes group g0 + d whole,
        word c from lane c (the Triton tile's K order, its bits)."""
        G = K // 32
        c3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CODES3)))
        w3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CODES3)))
        if LANES:  # group c's word w of a row: word 4c + w of the iteration's 16
            code_at = w_words + (w_rows * (K // 8))[:, None, None] + (4 * c3)[None, :, None] + w3[None, None, :]
            code_live = w_live[:, None, None] & (c3 < 4)[None, :, None] & (w3 < 4)[None, None, :]
        else:  # group g's word c: word 4g + c
            code_at = gl.convert_layout(w_words + (w_rows * (K // 8))[:, None] + c3[None, :], _CODES)
            code_live = gl.convert_layout(w_live[:, None] & (c3 < 4)[None, :], _CODES)
        scale_at = (s_base + w_rows * G).to(gl.pointer_type(gl.int32), bitcast=True)  # _U scales a row: one word
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * _U, _BM, 32], _X_SMEM)  # two iterations' x
        x_mma = x_smem._reinterpret(gl.bfloat16, [2 * _U, _BM, 32], _X_MMA)
        acc = gl.zeros([_BN, _BM], gl.float32, _ACC)
        a_prev = gl.zeros([_BN, 32], gl.bfloat16, _A)
        # the first iteration's operands in registers
        if LANES:
            codes = _lane_words(code_at, 0, code_live)
            xs = _x_lanes(x_words, x_rows, live, 0, K)
        else:
            codes = _codes(code_at, 0, code_live)
            xs = _x_groups(x_words, x_rows, live, 0, K)
        scales = gl.load(scale_at, mask=w_live, other=0)
        for it in range(0, G // _U):
            buf = (it % 2) * _U
            if buf == 0:  # a slice's start must be a constant
                x_smem.slice(0, _U).store(xs)
            else:
                x_smem.slice(_U, _U).store(xs)
            fence_async_shared()
            _barrier()
            g1 = gl.minimum(it + 1, G // _U - 1) * _U  # the next iteration's (the last one's again at the end)
            if LANES:
                nxt = _lane_words(code_at, g1, code_live)
                xs = _x_lanes(x_words, x_rows, live, g1, K)
                s = (scales[:, None] >> (8 * c3)[None, :]) & 255  # lane c's group: g0 + c
                half = (s + 126) << 7  # 2^(s - 1) as bf16 bits: s <= 128 (fp4_moe BIT_DECODE_MAX_SCALE)
                lane_scale = gl.convert_layout(half | (half << 16), _CODES)
            else:
                nxt = _codes(code_at, g1, code_live)
                xs = _x_groups(x_words, x_rows, live, g1, K)
            scales_n = gl.load(scale_at + g1 // _U, mask=w_live, other=0)
            for du in gl.static_range(_U):
                if LANES:
                    scale2 = lane_scale
                else:
                    s = (scales >> (8 * du)) & 255
                    half = (s + 126) << 7
                    scale2 = gl.convert_layout((half | (half << 16))[:, None], _CODES)
                a = _decode(codes[du], scale2)
                acc = warpgroup_mma(a, x_mma.index(buf + du).permute((1, 0)), acc, is_async=True)
                acc, a_prev = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc, a_prev))
                a_prev = a
            codes, scales = nxt, scales_n
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
        return acc

    @gluon.jit
    def _tile_rows(tile_ptr):
        """This program's block of outputs and tile (grid: a tile's blocks side by side, fp4_moe's), the tile's
        expert (-1: dead), its first and end sorted pair rows, and its BM rows with their live mask (x's layout)."""
        pid_n, t = gl.program_id(0), gl.program_id(1)
        e = gl.load(tile_ptr + 3 * t)
        row0, row_end = gl.load(tile_ptr + 3 * t + 1), gl.load(tile_ptr + 3 * t + 2)
        r = row0 + gl.arange(0, _BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, _X)))
        return pid_n, e, row0, row_end, r, r < row_end

    @gluon.jit
    def _gate_up_kernel(x_words, pairs_ptr, tile_ptr, w_words, s_ptr, route_ptr, out_ptr, D, I, TOPK, limit,
                        OUTSTANDING: gl.constexpr, LANES: gl.constexpr):
        """fp4_moe `_gate_up_kernel` at decode's tile: _BN interleaved rows of w13 (2i: w1's row for output i,
        2i + 1: w3's), the hidden bf16 [P, I] for _BN / 2 outputs."""
        pid_n, e, row0, row_end, r, live = _tile_rows(tile_ptr)
        if e >= 0:
            token = (gl.load(pairs_ptr + r, mask=live, other=0) // TOPK).to(gl.int64)
            i2 = gl.arange(0, _BN, layout=_ROWS)
            n2 = pid_n * (_BN // 2) + i2 // 2
            e64 = e.to(gl.int64)
            acc = _tile_k_loop(x_words, token, live, D, w_words + e64 * (2 * I) * (D // 8),
                               s_ptr + e64 * (2 * I) * (D // 32), gl.where(i2 % 2 == 0, n2, I + n2), n2 < I,
                               OUTSTANDING, LANES)
            acc = gl.convert_layout(acc, _GU)
            g, u = gl.split(gl.permute(gl.reshape(acc, [_BN // 2, 2, _BM]), (0, 2, 1)))
            cols: gl.constexpr = gl.SliceLayout(0, g.type.layout)
            rows: gl.constexpr = gl.SliceLayout(1, g.type.layout)
            rr = row0 + gl.arange(0, _BM, layout=cols)
            live_r = rr < row_end
            pair = gl.load(pairs_ptr + rr, mask=live_r, other=0)
            weight = gl.load(route_ptr + pair, mask=live_r, other=0.0)
            g = g.to(gl.bfloat16).to(gl.float32)  # each sum rounded as the GEMM output (fp4_moe _swiglu_hidden)
            u = u.to(gl.bfloat16).to(gl.float32)
            if limit > 0:
                u = gl.minimum(gl.maximum(u, -limit), limit)
                g = gl.minimum(g, limit)
            hidden = gl.div_rn(g, 1.0 + gl.exp((-g).to(gl.float64)).to(gl.float32)) * u
            n = pid_n * (_BN // 2) + gl.arange(0, _BN // 2, layout=rows)
            gl.store(out_ptr + rr.to(gl.int64)[None, :] * I + n[:, None], (weight[None, :] * hidden).to(gl.bfloat16),
                     mask=live_r[None, :] & (n < I)[:, None])

    @gluon.jit
    def _down_kernel(x_words, tile_ptr, w_words, s_ptr, out_ptr, D, I, OUTSTANDING: gl.constexpr,
                     LANES: gl.constexpr):
        """fp4_moe `_down_kernel` at decode's tile: the w2 product of _BN outputs, bf16 [P, D]."""
        pid_n, e, row0, row_end, r, live = _tile_rows(tile_ptr)
        if e >= 0:
            n = pid_n * _BN + gl.arange(0, _BN, layout=_ROWS)
            e64 = e.to(gl.int64)
            acc = _tile_k_loop(x_words, r.to(gl.int64), live, I, w_words + e64 * D * (I // 8),
                               s_ptr + e64 * D * (I // 32), n, n < D, OUTSTANDING, LANES)
            acc = gl.convert_layout(acc, _OUT)
            rr = row0 + gl.arange(0, _BM, layout=gl.SliceLayout(0, _OUT))
            no = pid_n * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, _OUT))
            gl.store(out_ptr + rr.to(gl.int64)[None, :] * D + no[:, None], acc.to(gl.bfloat16),
                     mask=(rr < row_end)[None, :] & (no < D)[:, None])


def fits(cfg: dict) -> bool:
    """The tile configuration is the one written here: fp4_moe config's decode tier (BM 16, BN 128, U 4 after
    routed_experts' halving, the bit decode, K in slot order, 4 warps)."""
    got = cfg["BM"], cfg["BN"], cfg["U"], cfg.get("B", 1), cfg.get("KS", 0), cfg.get("num_warps")
    return got == (BM, BN, U, 1, 1, 4)


def applies(device: torch.device) -> bool:
    """Gluon present and an sm_90 device (wgmma is sm_90's: sm_100 runs fp4_moe's Triton tile)."""
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def gate_up(xq, pairs, tiles, w13, s13, weights, D: int, I: int, k: int, limit: float, **opts) -> torch.Tensor:
    """The hidden bf16 [P, I] of fp4_moe's gate_up at decode's tile (fp4_moe.routed_experts' arguments). opts
    (tests, benchmarks): OUTSTANDING, LANES (`DEFAULTS`) and launch options such as maxnreg."""
    hidden = torch.empty(pairs.numel(), I, dtype=torch.bfloat16, device=xq.device)
    _gate_up_kernel[(triton.cdiv(I, BN // 2), tiles.size(0))](
        xq.contiguous().view(torch.int32), pairs, tiles, w13.view(torch.uint8).view(torch.int32), s13.view(torch.uint8),
        weights.contiguous().view(-1), hidden, D, I, k, float(limit), **dict(DEFAULTS, **opts))
    return hidden


def down(hidden, tiles, w2, s2, D: int, I: int, **opts) -> torch.Tensor:
    """The w2 products bf16 [P, D] of fp4_moe's down at decode's tile (opts: `gate_up`'s)."""
    out = torch.empty(hidden.size(0), D, dtype=torch.bfloat16, device=hidden.device)
    _down_kernel[(triton.cdiv(D, BN), tiles.size(0))](
        hidden.view(torch.int32), tiles, w2.view(torch.uint8).view(torch.int32), s2.view(torch.uint8), out, D, I,
        **dict(DEFAULTS, **opts))
    return out
