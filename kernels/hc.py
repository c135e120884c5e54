"""Hyper-connections on CUDA (spec §3; mirrors `hc_split_sinkhorn` of DeepSeek's inference/kernel.py).

The mixes (pre, post and the Sinkhorn-normalised comb of every token) in one Triton kernel, and the collapse
(hc_pre) and expand (hc_post) in one each, replacing model/hc.py's torch ops on CUDA. Between two sublayers
`hc_handoff` does the expand, the next sublayer's mixes, its collapse and the collapse's RMSNorm in one launch
(model/hc.py `handoff`): a block's hyper-connections are 3 launches where the separate kernels take 8. The norm
modules are still called, with the result, so the debugger's taps on their inputs see what they would
(tracing/divergence.py). At a wide stream (V4.1's 20,480) tokens share each block of fn, their mixes on the
tensor cores: a prefill chunk's 64 a program, a decode step's 16 a program a part of the sums at a time, then a
token a program adds its parts (`handoff_config`).

Mirrors the `hc_split_sinkhorn` kernel of DeepSeek's inference/kernel.py. The torch path (model/hc.py) is
about 90 small ops per call (20 Sinkhorn rounds of sums and divisions on [N, 4, 4]), 24 calls per forward
of tiny-68m: at decode sizes that is launch overhead, not arithmetic. The kernel keeps a block of tokens'
4x4 matrices in registers for all rounds.

Numerics: the same operations in the same order as the torch path, in fp32, with IEEE division (div_rn)
and exp through fp64; sums over 4 values may associate differently and the compiler may fuse a multiply
and an add, so results agree with the torch path to a few fp32 ulps, not bit for bit (a wide stream's mixes
on the tensor cores, whose fp32 accumulation truncates: within fp32 rounding of the 20,480-term sums).
The CPU path stays the torch one (its bits are pinned by tests/test_golden.py); tests/test_kernels.py and
tests/gpu compare.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/hc.py's torch path is the only path.
    import triton
    import triton.language as tl

    from kernels.attention import _mm
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _exp(x):
        """fp32 exp through fp64, rounded once: closer to torch's expf than the fast fp32 exp."""
        return tl.exp(x.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _sigmoid(x):
        return tl.div_rn(1.0, 1.0 + _exp(-x))

    @triton.jit
    def _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rows, live, iters, hc_eps,
                        HC: tl.constexpr):
        """pre, post [rows, HC] and comb [rows, HC, HC] of the tokens `rows` (masked by `live`) from their mixes
        [., (2 + HC) * HC] fp32 (already times the rsqrt statistic)."""
        M: tl.constexpr = (2 + HC) * HC
        h = tl.arange(0, HC)
        s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)

        vec = rows[:, None] * M + h[None, :]  # [BLOCK, HC]
        pre = _sigmoid(tl.load(mixes_ptr + vec, mask=live[:, None]) * s0 + tl.load(base_ptr + h)[None, :]) + hc_eps
        post = 2.0 * _sigmoid(tl.load(mixes_ptr + vec + HC, mask=live[:, None]) * s1
                              + tl.load(base_ptr + HC + h)[None, :])
        out = rows[:, None] * HC + h[None, :]
        tl.store(pre_ptr + out, pre, mask=live[:, None])
        tl.store(post_ptr + out, post, mask=live[:, None])

        jk = h[:, None] * HC + h[None, :]  # [HC, HC]: comb[j, k]
        mask3 = live[:, None, None]
        comb = (tl.load(mixes_ptr + rows[:, None, None] * M + 2 * HC + jk[None], mask=mask3, other=0.0) * s2
                + tl.load(base_ptr + 2 * HC + jk)[None])  # [BLOCK, HC, HC]
        comb = _exp(comb - tl.max(comb, axis=2)[:, :, None])
        comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None]) + hc_eps  # row softmax, + eps
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)  # columns
        for _ in range(iters - 1):
            comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + jk[None], comb, mask=mask3)

    @triton.jit
    def _hc_split_sinkhorn_kernel(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, N, iters,
                                  hc_eps, HC: tl.constexpr, BLOCK: tl.constexpr):
        # mixes [N, (2 + HC) * HC] fp32 (already times the rsqrt statistic); pre, post [N, HC]; comb [N, HC, HC]
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rows, rows < N, iters, hc_eps,
                        HC)

    @triton.jit
    def _stream_mixes(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, row, D, M, k_lo, k_hi,
                      EXPAND: tl.constexpr, HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """A token's stream over its flat [HC * D] positions k_lo to k_hi: EXPAND, post·y + combᵀ·h, stored to
        stream_ptr (else h as it is); -> (its mixes' sums fn·x over those positions [BLOCK_M], the squares of x
        [BLOCK_K], to be summed)."""
        K = HC * D
        m = tl.arange(0, BLOCK_M)
        j = tl.arange(0, HC)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            f = k0 + tl.arange(0, BLOCK_K)  # flat [HC * D] index: copy c, position d
            live = f < k_hi
            if EXPAND:
                c, d = f // D, f % D
                y = tl.load(y_ptr + row * D + d, mask=live, other=0.0).to(tl.float32)
                post = tl.load(post_ptr + row * HC + c, mask=live, other=0.0)
                h = tl.load(h_ptr + row * K + j[:, None] * D + d[None, :], mask=live[None, :],
                            other=0.0).to(tl.float32)  # [HC (j), BLOCK_K]
                comb = tl.load(comb_ptr + row * HC * HC + j[:, None] * HC + c[None, :], mask=live[None, :],
                               other=0.0)  # comb[j, c]
                stream = (post * y + tl.sum(comb * h, axis=0)).to(stream_ptr.dtype.element_ty)
                tl.store(stream_ptr + row * K + f, stream, mask=live)
                x = stream.to(tl.float32)
            else:
                x = tl.load(h_ptr + row * K + f, mask=live, other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + m[:, None] * K + f[None, :], mask=(m < M)[:, None] & live[None, :], other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)  # fp32 products and sums, as torch's fp32 F.linear
            squares += x * x
        return acc, squares

    @triton.jit
    def _hc_handoff_part_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, parts_ptr, D, M, part_k,
                                PARTS: tl.constexpr, EXPAND: tl.constexpr, HC: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_K: tl.constexpr):
        # Program (token, part): `_stream_mixes` over the part's part_k positions; its sums and the sum of its
        # squares go to parts [tokens, PARTS, BLOCK_M + 1] for `_hc_handoff_kernel` to add in part order.
        row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
        k_lo = part * part_k
        acc, squares = _stream_mixes(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, row, D, M, k_lo,
                                     tl.minimum(k_lo + part_k, HC * D), EXPAND, HC, BLOCK_M, BLOCK_K)
        at = parts_ptr + (row * PARTS + part) * (BLOCK_M + 1)
        tl.store(at + tl.arange(0, BLOCK_M), acc)
        tl.store(at + BLOCK_M, tl.sum(squares, axis=0))

    @triton.jit
    def _hc_handoff_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, scale_ptr, base_ptr, cpre_ptr,
                           mixes_ptr, pre_ptr, next_post_ptr, next_comb_ptr, x_ptr, norm_w_ptr, normed_ptr, parts_ptr,
                           D, M, iters, hc_eps, mix_eps, norm_eps, EXPAND: tl.constexpr, NORM: tl.constexpr,
                           HC: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        # One token, the hyper-connections between two sublayers (see `hc_handoff`): EXPAND, the stream
        # [HC, D] = post·y + combᵀ·h, stored to stream_ptr (else the stream is h as it is); its mixes as
        # _hc_mixes_kernel (with PARTS, from the sums `_hc_handoff_part_kernel` left, added in part order), then
        # _split_sinkhorn; then its collapse with cpre, as _hc_pre_kernel; NORM, that collapse's RMSNorm as
        # kernels/norm.py's _rms_norm_kernel computes it from the rounded collapse.
        row = tl.program_id(0).to(tl.int64)
        K = HC * D
        m = tl.arange(0, BLOCK_M)
        j = tl.arange(0, HC)
        if PARTS:
            at = parts_ptr + row * PARTS * (BLOCK_M + 1)
            acc = tl.load(at + m)
            total = tl.load(at + BLOCK_M)
            for part in tl.static_range(1, PARTS):
                acc += tl.load(at + part * (BLOCK_M + 1) + m)
                total += tl.load(at + part * (BLOCK_M + 1) + BLOCK_M)
        else:
            acc, squares = _stream_mixes(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, row, D, M, 0, K,
                                         EXPAND, HC, BLOCK_M, BLOCK_K)
            total = tl.sum(squares, axis=0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, K.to(tl.float32)) + mix_eps))
        tl.store(mixes_ptr + row * M + m, acc * rstd, mask=m < M)
        tl.debug_barrier()  # the mixes and the stream, written by every thread, are read by others below
        one = row + tl.arange(0, 1)
        _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, next_post_ptr, next_comb_ptr, one, one >= 0,
                        iters, hc_eps, HC)
        d = tl.arange(0, BLOCK_D)
        src = stream_ptr if EXPAND else h_ptr
        h = tl.load(src + row * K + j[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0).to(tl.float32)
        cpre = tl.load(cpre_ptr + row * HC + j)
        x = tl.sum(cpre[:, None] * h, axis=0).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * D + d, x, mask=d < D)
        if NORM:
            xf = x.to(tl.float32)  # 0 past D
            mean = tl.div_rn(tl.sum(xf * xf, axis=0), D.to(tl.float32))
            w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            normed = w * (xf * tl.div_rn(1.0, tl.sqrt_rn(mean + norm_eps)))
            tl.store(normed_ptr + row * D + d, normed.to(normed_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _stream_mixes_rows(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, rows, live, D, M, k_lo, k_hi,
                           EXPAND: tl.constexpr, HC: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, BF16: tl.constexpr):
        """`_stream_mixes` for T tokens `rows` at once over the flat positions k_lo to k_hi (whole blocks of
        BLOCK_K, each in one copy: D % BLOCK_K == 0), the mixes on the tensor cores (`_hc_handoff_rows_kernel`)
        -> (the mixes' sums [T, BLOCK_M], the squares [T, BLOCK_K], to be summed)."""
        K = HC * D
        m = tl.arange(0, BLOCK_M)
        acc = tl.zeros([T, BLOCK_M], dtype=tl.float32)
        squares = tl.zeros([T, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            f = k0 + tl.arange(0, BLOCK_K)  # flat [HC * D] index: copy k0 // D, positions d
            if EXPAND:  # the copy c of the stream: post_c·y + Σ_j comb[j, c]·h_j, the copies added in order
                c, d = k0 // D, k0 % D + tl.arange(0, BLOCK_K)
                y = tl.load(y_ptr + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                post = tl.load(post_ptr + rows * HC + c, mask=live, other=0.0)  # [T]
                mixed = tl.zeros([T, BLOCK_K], dtype=tl.float32)
                for jj in tl.static_range(HC):
                    comb = tl.load(comb_ptr + rows * HC * HC + jj * HC + c, mask=live, other=0.0)  # [T]
                    h = tl.load(h_ptr + rows[:, None] * K + jj * D + d[None, :], mask=live[:, None], other=0.0)
                    mixed += comb[:, None] * h.to(tl.float32)
                stream = (post[:, None] * y + mixed).to(stream_ptr.dtype.element_ty)
                tl.store(stream_ptr + rows[:, None] * K + f[None, :], stream, mask=live[:, None])
            else:
                stream = tl.load(h_ptr + rows[:, None] * K + f[None, :], mask=live[:, None], other=0.0)
            w = tl.load(fn_ptr + m[:, None] * K + f[None, :], mask=(m < M)[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            hi = w.to(tl.bfloat16)
            rest = w - hi.to(tl.float32)  # exact
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc += (_mm(stream, tl.trans(lo), BF16) + _mm(stream, tl.trans(mid), BF16)) + _mm(stream, tl.trans(hi),
                                                                                                BF16)
            x = stream.to(tl.float32)
            squares += x * x
        return acc, squares

    @triton.jit
    def _hc_handoff_rows_part_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, parts_ptr, N, D, M,
                                     part_k, PARTS: tl.constexpr, EXPAND: tl.constexpr, HC: tl.constexpr,
                                     T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                     BF16: tl.constexpr):
        # Program (T tokens, part): `_stream_mixes_rows` over the part's part_k positions, each block of fn read
        # once for the T tokens; the sums as `_hc_handoff_part_kernel` leaves them, for `_hc_handoff_kernel`.
        rows = (tl.program_id(0) * T + tl.arange(0, T)).to(tl.int64)
        live = rows < N
        part = tl.program_id(1)
        k_lo = part * part_k
        acc, squares = _stream_mixes_rows(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, rows, live, D, M,
                                          k_lo, tl.minimum(k_lo + part_k, HC * D), EXPAND, HC, T, BLOCK_M, BLOCK_K,
                                          BF16)
        at = parts_ptr + (rows * PARTS + part) * (BLOCK_M + 1)
        tl.store(at[:, None] + tl.arange(0, BLOCK_M)[None, :], acc, mask=live[:, None])
        tl.store(at + BLOCK_M, tl.sum(squares, axis=1), mask=live)

    @triton.jit
    def _hc_handoff_rows_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, scale_ptr, base_ptr, cpre_ptr,
                                mixes_ptr, pre_ptr, next_post_ptr, next_comb_ptr, x_ptr, norm_w_ptr, normed_ptr, N, D,
                                M, iters, hc_eps, mix_eps, norm_eps, EXPAND: tl.constexpr, NORM: tl.constexpr,
                                HC: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_D: tl.constexpr, BF16: tl.constexpr):
        # `_hc_handoff_kernel`'s operations for T tokens a program (a prefill chunk's), the mixes on the tensor
        # cores: the stream is bf16, so each of its values is exact in a bf16 operand, and fn (fp32) is split
        # into three bf16 parts, hi + mid + lo, fn to within 2^-24 of itself; each part's products are exact in
        # fp32 and summed in fp32, so the mixes are fp32 sums of the same products in another order (within fp32
        # rounding of the FMA chain, not bit for bit). A block of BLOCK_K stream values lies in one copy c
        # (D % BLOCK_K == 0). Every sum is a token's own: a token's values do not depend on the tokens beside it.
        rows = (tl.program_id(0) * T + tl.arange(0, T)).to(tl.int64)
        live = rows < N
        K = HC * D
        m = tl.arange(0, BLOCK_M)
        acc, squares = _stream_mixes_rows(y_ptr, h_ptr, post_ptr, comb_ptr, stream_ptr, fn_ptr, rows, live, D, M, 0, K,
                                          EXPAND, HC, T, BLOCK_M, BLOCK_K, BF16)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(squares, axis=1), K.to(tl.float32)) + mix_eps))
        tl.store(mixes_ptr + rows[:, None] * M + m[None, :], acc * rstd[:, None], mask=live[:, None] & (m < M)[None, :])
        tl.debug_barrier()  # the mixes and the stream, written by every thread, are read by others below
        _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, next_post_ptr, next_comb_ptr, rows, live, iters,
                        hc_eps, HC)
        src = stream_ptr if EXPAND else h_ptr
        sq = tl.zeros([T], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # the collapse Σ_j pre_j·h_j, the copies added in order
            d = d0 + tl.arange(0, BLOCK_D)
            at = live[:, None] & (d < D)[None, :]
            x = tl.zeros([T, BLOCK_D], dtype=tl.float32)
            for jj in tl.static_range(HC):
                cpre = tl.load(cpre_ptr + rows * HC + jj, mask=live, other=0.0)  # [T]
                h = tl.load(src + rows[:, None] * K + jj * D + d[None, :], mask=at, other=0.0)
                x += cpre[:, None] * h.to(tl.float32)
            x = x.to(x_ptr.dtype.element_ty)  # [T, BLOCK_D]
            tl.store(x_ptr + rows[:, None] * D + d[None, :], x, mask=at)
            xf = x.to(tl.float32)  # 0 past D
            sq += tl.sum(xf * xf, axis=1)
        if NORM:
            tl.debug_barrier()  # x, written by every thread, is read back by others
            inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, D.to(tl.float32)) + norm_eps))
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                at = live[:, None] & (d < D)[None, :]
                xf = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=at, other=0.0).to(tl.float32)
                w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
                normed = w[None, :] * (xf * inv[:, None])
                tl.store(normed_ptr + rows[:, None] * D + d[None, :], normed.to(normed_ptr.dtype.element_ty), mask=at)

    @triton.jit
    def _hc_mixes_kernel(h_ptr, fn_ptr, out_ptr, K, M, norm_eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # one token: mixes [M] = (x · fnᵀ) · rsqrt(mean(x²) + eps) for x = h [K] in fp32, fn [M, K] fp32
        row = tl.program_id(0).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(h_ptr + row * K + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
            w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)  # fp32 products and sums, as torch's fp32 F.linear
            squares += x * x
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(squares, axis=0), K.to(tl.float32)) + norm_eps))
        tl.store(out_ptr + row * M + m, acc * rstd, mask=m < M)

    @triton.jit
    def _hc_pre_kernel(h_ptr, pre_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one token: h [HC, D], pre [HC]; BLOCK_D = D rounded up to 2^n
        j, d = tl.arange(0, HC), tl.arange(0, BLOCK_D)
        h = tl.load(h_ptr + row * HC * D + j[:, None] * D + d[None, :], mask=d[None, :] < D).to(tl.float32)
        pre = tl.load(pre_ptr + row * HC + j)
        tl.store(out_ptr + row * D + d, tl.sum(pre[:, None] * h, axis=0).to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _hc_post_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one token: y [D], h [HC, D], post [HC], comb [HC, HC]
        j, d = tl.arange(0, HC), tl.arange(0, BLOCK_D)  # BLOCK_D = D rounded up to 2^n (5120 at V4.1's width)
        y = tl.load(y_ptr + row * D + d, mask=d < D).to(tl.float32)
        h = tl.load(h_ptr + row * HC * D + j[:, None] * D + d[None, :], mask=d[None, :] < D).to(tl.float32)  # [HC (j), D]
        post = tl.load(post_ptr + row * HC + j)  # [HC (k)]
        comb = tl.load(comb_ptr + row * HC * HC + j[:, None] * HC + j[None, :])  # [HC (j), HC (k)]
        mixed = tl.sum(comb[:, :, None] * h[:, None, :], axis=0)  # [HC (k), D]: Σ_j comb[j, k]·h_j
        out = post[:, None] * y[None, :] + mixed
        tl.store(out_ptr + row * HC * D + j[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=d[None, :] < D)


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The mixes before the split, fp32 [..., M]: F.linear(x, fn) · rsqrt(mean(x²) + eps) for x the stream
    h [..., hc, d] flattened to fp32, in one launch instead of six (model/hc.py's first two lines)."""
    K, M = h.size(-2) * h.size(-1), fn.size(0)
    x = h.contiguous().view(-1, K)
    out = torch.empty(x.size(0), M, dtype=torch.float32, device=h.device)
    if x.size(0):  # a program per token: a decode step's few rows still spread over the chip; each reads all of
        # fn (2 MB at V4.1's width) from L2: wide tiles and 8 warps keep more of its loads in flight. On the H200 at
        # the slice's width: 0.205 -> 0.067 ms at 64 rows (decode), 2.1 -> 3.6 ms at 8,192 (prefill, 2% of its step)
        _hc_mixes_kernel[(x.size(0),)](x, fn.contiguous(), out, K, M, norm_eps,
                                       BLOCK_M=triton.next_power_of_2(M), BLOCK_K=512, num_warps=8)
    return out.view(*h.shape[:-2], M)


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      hc_eps: float, block: int = 8):
    """(pre [..., hc], post [..., hc], comb [..., hc, hc]) fp32 from mixes [..., (2+hc)·hc] fp32 (the HC
    linear times its rsqrt statistic), scale [3], base [(2+hc)·hc]: model/hc.py's `hc_mixes` after its
    GEMM, in one launch. hc must be a power of two (4 in V4.1). Never syncs the host. A program's 40 rounds
    are a serial chain, so a few rows a program spread the rows of a decode step over the chip."""
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.size(-1)).contiguous()
    n = flat.size(0)
    pre = torch.empty(n, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=mixes.device)
    if n:
        _hc_split_sinkhorn_kernel[(triton.cdiv(n, block),)](flat, scale.contiguous(), base.contiguous(), pre, post,
                                                            comb, n, iters, hc_eps, HC=hc, BLOCK=block)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


PART_K = 2048  # the positions of a wide stream a part of a token's mixes sums, a token a program (`handoff_config`)
ROWS_PART_K = 256  # ... and 16 tokens a program (a decode step's form outside the batch-invariant mode)
WIDE_STREAM = 8192  # the stream's width (hc·d) from which a handoff takes T tokens a program
# ... and the tokens a launch from which it takes 64 a program, in one launch: at the slice's width on an H200 a
# token a program takes 0.33 ms at 512 tokens and 5.0 at 8,192, 64 a program 1.2-1.4 ms at either
# (benchmarks/bench_handoff.py)
CHUNK_ROWS = 4096


def handoff_config(h: torch.Tensor, batch_invariant: bool = False) -> dict:
    """How a handoff launch of the streams h [..., hc, d] is laid out. A token a program (the form of tiny-68m,
    whose H200 trace's bits are this form's, and of the batch-invariant mode, where a token's bits must not depend
    on how many share its launch), except at a bf16 stream at least WIDE_STREAM wide outside that mode, where
    a token a program reads all of fn (2 MB at V4.1's 20,480) from L2 for one token: there tokens share each
    block of fn, the mixes on the tensor cores. A chunk of at least CHUNK_ROWS tokens takes 64 a program in one
    launch (`_hc_handoff_rows_kernel`: 1.36 ms at 8,192 tokens on an H200, 5.0 a token a program); fewer (a
    decode step) 16 a program, each program one part of ROWS_PART_K positions of their mixes' sums
    (`_hc_handoff_rows_part_kernel`), then a token a program adds its parts in order and goes on
    (`_hc_handoff_kernel`): both launches 20 us at 64 tokens on an H100, where a token a program in parts of
    2,048 took 50 (benchmarks/RESULTS.md). A token a program at a wide stream (fp32, the batch-invariant mode) sums its
    mixes in parts of PART_K, a program each. Every part is fixed by the width alone, so a token's bits do not
    depend on the tokens beside it in any form."""
    hc, d = h.shape[-2:]
    n = h.numel() // (hc * d)
    wide = hc * d >= WIDE_STREAM
    if wide and h.dtype == torch.bfloat16 and d % 64 == 0 and not batch_invariant:
        if n >= CHUNK_ROWS:
            return dict(T=64, BLOCK_K=64, BLOCK_D=64, num_warps=8)
        return dict(T=16, PART_K=ROWS_PART_K, BLOCK_K=64, num_warps=4)
    return dict(T=1, PART_K=PART_K) if wide else dict(T=1)


def hc_handoff(y: torch.Tensor | None, h: torch.Tensor, post: torch.Tensor | None, comb: torch.Tensor | None,
               fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre: torch.Tensor, iters: int,
               hc_eps: float, mix_eps: float, norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
               batch_invariant: bool = False, cfg: dict | None = None):
    """The hyper-connections between two sublayers in one launch (model/hc.py `handoff`), a program per token, or
    per 64 for a prefill chunk of a wide stream; two launches where the parts of the mixes' sums come first (a
    wide stream's decode, 16 tokens or one a part program: `handoff_config`): the expand of the sublayer before
    (the stream = hc_post(y, h, post, comb); with y None the stream is h, as at a block's start), the mixes of the
    sublayer after from that stream (`hc_mixes`, then `hc_split_sinkhorn`; mix_eps the statistic's eps), and that
    sublayer's input before its norm, the stream collapsed with `pre` (`hc_pre`). -> (stream [..., hc, d], (pre,
    post, comb) of the next sublayer, x [..., d]): the launches of hc_post, hc_mixes, hc_split_sinkhorn and hc_pre
    in one. The same operations as the separate kernels; the sums over the copies may associate otherwise (another
    tile shape), so the agreement with them and with the torch path is within fp32 rounding before each bf16
    rounding. With `norm_weight`, also that sublayer's RMSNorm of x (kernels/norm.py's operations on the rounded x,
    its sum of squares over another tile: within an fp32 ulp of it before the rounding): a fourth value, normed x.
    `handoff_config` lays the launch out (`batch_invariant`: a token's bits independent of the others'); `cfg`
    overrides it (tests, benchmarks)."""
    hc, d = h.shape[-2:]
    M, lead = fn.size(0), h.shape[:-2]
    h2 = h.contiguous().view(-1, hc, d)
    n = h2.size(0)
    expand = y is not None
    stream = torch.empty_like(h2) if expand else h2
    mixes = torch.empty(n, M, dtype=torch.float32, device=h.device)
    next_pre = torch.empty(n, hc, dtype=torch.float32, device=h.device)
    next_post, next_comb = torch.empty_like(next_pre), torch.empty(n, hc, hc, dtype=torch.float32, device=h.device)
    x = torch.empty(n, d, dtype=h.dtype, device=h.device)
    normed = torch.empty_like(x) if norm_weight is not None else x
    cfg = cfg or handoff_config(h, batch_invariant)
    if n:
        args = (y.contiguous(), post.contiguous(), comb.contiguous()) if expand else (h2, mixes, mixes)
        common = (args[0], h2, args[1], args[2], stream, fn.contiguous(), scale.contiguous(), base.contiguous(),
                  pre.contiguous(), mixes, next_pre, next_post, next_comb, x,
                  norm_weight if norm_weight is not None else x, normed)
        flags = dict(EXPAND=expand, NORM=norm_weight is not None, HC=hc, BLOCK_M=triton.next_power_of_2(M))
        part_k = cfg.get("PART_K", 0)  # the positions a part of a token's mixes sums (0: one launch, no parts)
        if cfg["T"] > 1:  # T tokens a program, the mixes on the tensor cores
            assert d % cfg["BLOCK_K"] == 0 == part_k % cfg["BLOCK_K"] and h.dtype == torch.bfloat16, \
                "T tokens a program: bf16, whole blocks"
        if cfg["T"] > 1 and not part_k:  # a prefill chunk's form: one launch
            _hc_handoff_rows_kernel[(triton.cdiv(n, cfg["T"]),)](*common, n, d, M, iters, hc_eps, mix_eps, norm_eps,
                                                                 **flags, **cfg, BF16=h.is_cuda)
        else:
            parts = triton.cdiv(hc * d, part_k) if part_k else 0
            sums = torch.empty(n, parts, flags["BLOCK_M"] + 1, dtype=torch.float32, device=h.device) if parts else mixes
            if parts and cfg["T"] > 1:
                _hc_handoff_rows_part_kernel[(triton.cdiv(n, cfg["T"]), parts)](
                    args[0], h2, args[1], args[2], stream, fn.contiguous(), sums, n, d, M, part_k, PARTS=parts,
                    EXPAND=expand, HC=hc, T=cfg["T"], BLOCK_M=flags["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
                    BF16=h.is_cuda, num_warps=cfg["num_warps"])
            elif parts:
                _hc_handoff_part_kernel[(n, parts)](args[0], h2, args[1], args[2], stream, fn.contiguous(), sums, d, M,
                                                   part_k, PARTS=parts, EXPAND=expand, HC=hc,
                                                   BLOCK_M=flags["BLOCK_M"], BLOCK_K=512, num_warps=8)
            _hc_handoff_kernel[(n,)](*common, sums, d, M, iters, hc_eps, mix_eps, norm_eps, **flags, PARTS=parts,
                                     BLOCK_K=512, BLOCK_D=triton.next_power_of_2(d), num_warps=8)
    out = (stream.view(*lead, hc, d), (next_pre.view(*lead, hc), next_post.view(*lead, hc),
                                       next_comb.view(*lead, hc, hc)), x.view(*lead, d))
    return out + (normed.view(*lead, d),) if norm_weight is not None else out


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """model/hc.py's collapse in one launch: Σ_j pre_j·h_j in fp32, rounded to h's dtype. [..., hc, d] -> [..., d]."""
    hc, d = h.shape[-2:]
    h2, pre2 = h.contiguous(), pre.contiguous()
    out = torch.empty(h.shape[:-2] + (d,), dtype=h.dtype, device=h.device)
    if out.numel():
        _hc_pre_kernel[(out.numel() // d,)](h2, pre2, out, D=d, HC=hc, BLOCK_D=triton.next_power_of_2(d))
    return out


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """model/hc.py's expand in one launch: copy k = post_k·y + Σ_j comb[j,k]·h_j in fp32, rounded once."""
    hc, d = h.shape[-2:]
    out = torch.empty(h.shape, dtype=y.dtype, device=y.device)
    if out.numel():
        _hc_post_kernel[(out.numel() // (hc * d),)](y.contiguous(), h.contiguous(), post.contiguous(),
                                                    comb.contiguous(), out, D=d, HC=hc,
                                                    BLOCK_D=triton.next_power_of_2(d))
    return out
