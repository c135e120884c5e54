"""The indexer's scores and index list (spec §2.7) as Triton kernels (DeepSeek's inference/model.py `Indexer`).

Between its projections and its top-k, and the index list after it: where a decode step of tiny-68m launched
~25 small torch ops per index layer (issue #7's profile).

- `index_scores`: score(p, j) = bf16(Σ_h bf16(relu(bf16(q_h·k_j)) · w_h)), -inf where j >= V(p). One
  program takes a block of queries of one row against a block of entries, all heads: q_h·k_j on the tensor
  cores (fp32 accumulation, one bf16 rounding, as the einsum's output), relu, the head weight (rounded to
  bf16, as torch's bf16 product), the head sum in fp32 in head order, one rounding, the mask. Replaces the
  einsum, relu, product, head sum, arange, comparison and fill of model/attention.py's `index_scores`.
  The dot products and the head sum may associate otherwise than cuBLAS and torch's reduction, so scores
  agree within a bf16 ulp, not bit for bit; each row's arithmetic is its own (fixed blocks, head order),
  so the kernel is batch-invariant as it stands (model/invariant.py). A prefill chunk of CHUNK_ROWS queries
  or more, outside that mode, takes 64 queries by 128 entries a program and bf16 dots (`scores_config`: 2.4
  -> 0.9 ms at the slice's 8,192 x 4,096 x 64 heads on an H200; the same products, another MMA order, so
  other bits in ~0.002% of the scores). Under 16 queries a row (decode), a
  program takes one query and puts its heads, 16 at a time, on the rows of the same dot, then adds them in
  head order: the same bits (tests/gpu), without the 15 empty query rows of a decode step's block; from
  ROW_BLOCKS_FROM entries a row a program takes four blocks of entries in a loop, the next block's keys loading
  while one is scored (`row_config`: 2.0-2.1 -> 2.5-2.6 TB/s of keys at the slice's 64 x 32k, the same bits).
  Given the block tables, both forms read the kv source's keys where they lie in its paged pool (as sparse
  attention reads its entries), not a streamed copy of them, and only a query's visible entries (j < V(p)).
- `topk_entries`: model/attention.py's `topk_entries` under the "lower-index" tie rule, a program per query:
  each score's int32 order key (the fp32 bits with negatives' magnitude flipped, -0.0 made +0.0, as `_top`;
  of bf16 scores only the top 16 bits, which carry all of the order), the k-th largest key by bisection over
  the keys' range (16 counting passes for bf16, 32 for fp32) on the row held in registers (up to
  RESIDENT_ENTRIES; a longer row is read again each pass), then the entries above it and the lowest-index ones
  equal to it, written in ascending index order by a running count, -1 from V(p) on: the same list as the keyed
  top-k, sort and mask of the torch path (a set is a set), in one launch instead of about a dozen (two past
  TOPK_PARTS_FROM entries: each part's top k, then the candidates'), 2-10x faster
  than the torch path at the prefill shapes measured and 3-5x faster than the bisection over memory before it at
  decode's (benchmarks/RESULTS.md), so every CUDA step takes it (`applies_topk`); the choice moves no bits.
- `attention_list`: model/attention.py's `attention_list` (with the shift of the top-k entries to their
  places after the window and this chunk, and the lengths from each row's end) in one launch of integer
  work: the same list, exactly.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/attention.py's torch path is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_S, BLOCK_E = 16, 64
# decode's row kernel: BE entries a block, NB blocks a program from ROW_BLOCKS_FROM entries (`row_config`)
ROW_TILE = dict(BE=BLOCK_E, NB=4, num_warps=2, num_stages=2)
ROW_BLOCKS_FROM = 4096
CHUNK_ROWS = 4096  # from this many queries a row, a prefill chunk's form (`scores_config`; kernels/hc.py's bound)

if triton is not None:

    @triton.jit
    def _keys(k_ptr, tables_ptr, b, e, live, sk_b, sk_e, st_b, D: tl.constexpr, PER_BLOCK: tl.constexpr):
        """Entries e of row b's index keys, [D, BE] bf16, 0 from `live` on (never read): keys[b, e], or with
        PER_BLOCK (a paged pool, `index_scores`'s block_tables) pool[tables[b, e // PER_BLOCK], e % PER_BLOCK]."""
        if PER_BLOCK:
            block = tl.load(tables_ptr + b * st_b + e // PER_BLOCK, mask=e < live, other=0).to(tl.int64)
            rows = block * sk_b + (e % PER_BLOCK).to(tl.int64) * sk_e
        else:
            rows = b * sk_b + e.to(tl.int64) * sk_e
        return tl.load(k_ptr + rows[None, :] + tl.arange(0, D)[:, None], mask=(e < live)[None, :], other=0.0)

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, tables_ptr, vis_ptr, out_ptr, S, E, H,
                             sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_e, st_b, so_b, so_s,
                             D: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr, BF16: tl.constexpr,
                             PER_BLOCK: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        s = tl.program_id(0) * BS + tl.arange(0, BS)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        d = tl.arange(0, D)
        visible = tl.load(vis_ptr + b * S + s, mask=s < S, other=0)
        keys = _keys(k_ptr, tables_ptr, b, e, tl.minimum(tl.max(visible), E), sk_b, sk_e, st_b, D, PER_BLOCK)
        acc = tl.zeros((BS, BE), dtype=tl.float32)
        for h in range(0, H):
            q = tl.load(q_ptr + b * sq_b + s.to(tl.int64)[:, None] * sq_s + h * sq_h + d[None, :],
                        mask=(s < S)[:, None], other=0.0)  # [BS, D] bf16
            # bf16 values are exact in tf32: the same products as a bf16 MMA, fp32 accumulation (and a dot that
            # Triton's interpreter runs: it has no bf16 matmul); a prefill chunk's form (BF16) takes the bf16 MMA,
            # at twice tf32's rate
            if BF16:
                dot = tl.dot(q, keys.to(tl.bfloat16)).to(tl.bfloat16).to(tl.float32)
            else:
                dot = tl.dot(q.to(tl.float32), keys.to(tl.float32), input_precision="tf32").to(tl.bfloat16).to(tl.float32)
            w = tl.load(w_ptr + b * sw_b + s.to(tl.int64) * sw_s + h, mask=s < S, other=0.0).to(tl.float32)
            acc += (tl.maximum(dot, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)
        score = tl.where(e[None, :] < visible[:, None], acc, -float("inf")).to(tl.bfloat16)
        tl.store(out_ptr + b * so_b + s.to(tl.int64)[:, None] * so_s + e[None, :], score,
                 mask=(s < S)[:, None] & (e < E)[None, :])

    @triton.jit
    def _add_rows_in_order(acc, term, BE: tl.constexpr):
        """acc [BE] + each of term's 16 rows [16, BE] in turn, in row order: the sums of adding them one at a
        time. The rows are taken apart by splits (each entry's 16 values in one thread), not by 16 masked
        reductions across the threads that hold them (2.6x the instructions of the dot)."""
        t = tl.reshape(tl.trans(term), (BE, 2, 2, 2, 2))  # [e, a, b, c, d]: row 8a + 4b + 2c + d
        d0, d1 = tl.split(t)
        c00, c10 = tl.split(d0)  # c00: c = 0, d = 0; c10: c = 1, d = 0 ([e, a, b])
        c01, c11 = tl.split(d1)
        b000, b100 = tl.split(c00)  # b000: b = 0, c = 0, d = 0 ([e, a]) ...
        b010, b110 = tl.split(c10)
        b001, b101 = tl.split(c01)
        b011, b111 = tl.split(c11)
        r0, r8 = tl.split(b000)  # row 8a + 4b + 2c + d for a = 0, 1
        r4, r12 = tl.split(b100)
        r2, r10 = tl.split(b010)
        r6, r14 = tl.split(b110)
        r1, r9 = tl.split(b001)
        r5, r13 = tl.split(b101)
        r3, r11 = tl.split(b011)
        r7, r15 = tl.split(b111)
        acc = acc + r0 + r1 + r2 + r3 + r4 + r5 + r6 + r7  # left to right: one row at a time
        return acc + r8 + r9 + r10 + r11 + r12 + r13 + r14 + r15

    @triton.jit
    def _index_scores_row_kernel(q_ptr, w_ptr, k_ptr, tables_ptr, vis_ptr, out_ptr, S, E,
                                 sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_e, st_b, so_b, so_s, H: tl.constexpr,
                                 D: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr, NB: tl.constexpr,
                                 PER_BLOCK: tl.constexpr):
        tl.static_assert(BH == 16, "_add_rows_in_order takes 16 heads at a time")
        # one query against NB blocks of BE entries, a block's keys loaded while the one before is scored (the
        # launch's pipeline stages); its heads BH at a time on the rows of the same [BH, D] x [D, BE] dot as
        # _index_scores_kernel's (an MMA row's sums are its own), each head then added in head order
        b, s = tl.program_id(2).to(tl.int64), tl.program_id(0).to(tl.int64)
        d, hb = tl.arange(0, D), tl.arange(0, BH)
        visible = tl.load(vis_ptr + b * S + s)
        for i in range(NB):
            e = (tl.program_id(1) * NB + i) * BE + tl.arange(0, BE)
            keys = _keys(k_ptr, tables_ptr, b, e, tl.minimum(visible, E), sk_b, sk_e, st_b, D, PER_BLOCK)
            acc = tl.zeros((BE,), dtype=tl.float32)
            for h0 in tl.static_range(0, H, BH):
                h = h0 + hb
                q = tl.load(q_ptr + b * sq_b + s * sq_s + h[:, None] * sq_h + d[None, :], mask=(h < H)[:, None],
                            other=0.0)
                dot = tl.dot(q.to(tl.float32), keys.to(tl.float32), input_precision="tf32")
                w = tl.load(w_ptr + b * sw_b + s * sw_s + h, mask=h < H, other=0.0).to(tl.float32)
                term = (tl.maximum(dot.to(tl.bfloat16).to(tl.float32), 0.0) * w[:, None]).to(tl.bfloat16)
                acc = _add_rows_in_order(acc, term.to(tl.float32), BE)  # [BH, BE] in head order
            score = tl.where(e < visible, acc, -float("inf")).to(tl.bfloat16)
            tl.store(out_ptr + b * so_b + s * so_s + e, score, mask=e < E)

    @triton.jit
    def _attention_list_kernel(window_ptr, topk_ptr, end_ptr, out_ptr, S, W, K, offset, ratio, max_compressed,
                               FULL_WINDOW: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # b * S + s
        b = row // S
        end = tl.load(end_ptr + b)
        wl = W if FULL_WINDOW else tl.minimum(end, W)
        cl = tl.minimum(end // ratio, max_compressed)  # with K = 0 no entry loads: -1 past the window
        j = tl.arange(0, BLOCK)
        window = tl.load(window_ptr + row * W + j, mask=j < tl.minimum(wl, W), other=-1)
        c = tl.load(topk_ptr + row * K + (j - wl), mask=(j >= wl) & (j - wl < K), other=-1)
        c = tl.where(c >= 0, c + offset, -1)
        listed = tl.where(j < wl, window, tl.where(j - wl < cl, c, -1))
        tl.store(out_ptr + row * (W + K) + j, listed, mask=j < W + K)

    @triton.jit
    def _order_keys(scores_ptr, e, live, BITS: tl.constexpr, KEYS: tl.constexpr = False):
        """int32 keys in the order of the fp32 values (of bf16 or fp32 scores); the key of -inf where not live.
        BITS 16 (bf16 scores): the top 16 bits alone, as the low 16 are all 0 or all 1 (the same order, one key a
        value), so the search below takes 16 passes instead of 32. KEYS: scores_ptr holds such keys already
        (a row's candidates, `_topk_part_kernel`)."""
        if KEYS:
            return tl.load(scores_ptr + e, mask=live, other=-(1 << (BITS - 1)))
        x = tl.load(scores_ptr + e, mask=live, other=float("-inf")).to(tl.float32) + 0.0  # -0.0 -> +0.0
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        if BITS == 16:
            key = key >> 16
        return key

    @triton.jit
    def _count_at_least(row, E, t, BLOCK: tl.constexpr, BITS: tl.constexpr, KEYS: tl.constexpr):
        """How many entries of a row too long to hold have a key >= t: one pass over it, BLOCK at a time."""
        count = tl.zeros([], tl.int32)
        for e0 in range(0, E, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            count += tl.sum(((e < E) & (_order_keys(row, e, e < E, BITS, KEYS) >= t)).to(tl.int32), axis=0)
        return count

    @triton.jit
    def _kth_key(keys, live, k, BITS: tl.constexpr, row, E, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                 KEYS: tl.constexpr):
        """The k-th largest key of a row (the largest t with count(key >= t) >= k, by bisection over the keys'
        range) and how many keys are above it. RESIDENT: the row held in registers, keys [BLOCK] where `live`;
        else each count reads the row's E entries again from `row` (`_count_at_least`; keys, live unused)."""
        lo = tl.full([], -(1 << (BITS - 1)), tl.int64)
        hi = tl.full([], (1 << (BITS - 1)) - 1, tl.int64)
        for _ in tl.static_range(BITS):
            mid = lo + (hi - lo + 1) // 2
            if RESIDENT:
                count = tl.sum((live & (keys >= mid.to(tl.int32))).to(tl.int32), axis=0)
            else:
                count = _count_at_least(row, E, mid.to(tl.int32), BLOCK, BITS, KEYS)
            lo, hi = tl.where(count >= k, mid, lo), tl.where(count >= k, hi, mid - 1)
        kth = lo.to(tl.int32)
        if RESIDENT:
            return kth, tl.sum((live & (keys > kth)).to(tl.int32), axis=0)
        return kth, _count_at_least(row, E, lo + 1, BLOCK, BITS, KEYS)  # int64: no wrap past the top key

    @triton.jit
    def _kept(key, live, kth, ties, seen_equal):
        """Which of a block of keys the top k keeps: those above the k-th key, and of those equal to it the
        lowest-index `ties` (`seen_equal` of them in earlier blocks) -> (keep int32 [BLOCK], equal int32 [BLOCK])."""
        equal = (live & (key == kth)).to(tl.int32)
        rank = seen_equal + tl.cumsum(equal, axis=0) - equal  # equal entries before this one
        return ((live & (key > kth)) | ((equal != 0) & (rank < ties))).to(tl.int32), equal

    @triton.jit
    def _topk_part_kernel(scores_ptr, keys_ptr, ids_ptr, E, k, S, so_b, so_s, PART: tl.constexpr,
                          BITS: tl.constexpr):
        """Program (query, part): of entries [part·PART, part·PART + PART) of the query's row, the top k (all of
        them in a shorter last part) by the same keys and the lower-index rule, in ascending index: their keys and
        entry ids to [queries, parts, k] (int32), the slots past the part's entries the lowest key, id -1."""
        q, part = tl.program_id(0), tl.program_id(1)
        b, s = q // S, q % S
        e = part * PART + tl.arange(0, PART)
        live = e < E
        keys = _order_keys(scores_ptr + b.to(tl.int64) * so_b + s * so_s, e, live, BITS)
        kk = tl.minimum(k, E - part * PART)  # the entries this part keeps
        kth, above = _kth_key(keys, live, kk, BITS, scores_ptr, E, PART, True, False)
        keep, _ = _kept(keys, live, kth, kk - above, 0)
        at = tl.cumsum(keep, axis=0) - keep
        base = (q.to(tl.int64) * tl.num_programs(1) + part) * k
        tl.store(keys_ptr + base + at, keys, mask=(keep != 0) & (at < k))
        tl.store(ids_ptr + base + at, e, mask=(keep != 0) & (at < k))
        pad = tl.arange(0, PART)
        tl.store(keys_ptr + base + pad, tl.full([PART], -(1 << (BITS - 1)), tl.int32), mask=(pad >= kk) & (pad < k))
        tl.store(ids_ptr + base + pad, tl.full([PART], -1, tl.int32), mask=(pad >= kk) & (pad < k))

    @triton.jit
    def _topk_entries_kernel(scores_ptr, vis_ptr, out_ptr, E, k, S, so_b, so_s, ids_ptr, BLOCK: tl.constexpr,
                             BITS: tl.constexpr, RESIDENT: tl.constexpr, CANDIDATES: tl.constexpr):
        """Program (query): its top k of a row of E scores [B, S, E] (strides so_b, so_s), or with CANDIDATES of
        its E candidates' keys [queries, E] (`_topk_part_kernel`'s, in ascending entry id) and their ids_ptr."""
        q = tl.program_id(0)  # one query (row b, position s)
        b, s = q // S, q % S
        row = scores_ptr + b.to(tl.int64) * so_b + s * so_s
        if CANDIDATES:
            row = scores_ptr + q.to(tl.int64) * E
        offs = tl.arange(0, BLOCK)
        if RESIDENT:  # the row fits in the program's registers (BLOCK >= E): one read of it
            keys = _order_keys(row, offs, offs < E, BITS, CANDIDATES)
            kth, above = _kth_key(keys, offs < E, k, BITS, row, E, BLOCK, True, CANDIDATES)
        else:  # each pass reads the row again
            kth, above = _kth_key(offs, offs < E, k, BITS, row, E, BLOCK, False, CANDIDATES)
        ties = k - above  # the lowest-index `ties` entries equal to the k-th go in
        visible = tl.load(vis_ptr + q).to(tl.int64)
        written, seen_equal = tl.zeros([], tl.int32), tl.zeros([], tl.int32)
        for e0 in range(0, E, BLOCK):  # once when RESIDENT
            e = e0 + offs
            live = e < E
            if RESIDENT:
                key = keys
            else:
                key = _order_keys(row, e, live, BITS, CANDIDATES)
            keep, equal = _kept(key, live, kth, ties, seen_equal)
            at = written + tl.cumsum(keep, axis=0) - keep
            entry = e.to(tl.int64)
            if CANDIDATES:
                entry = tl.load(ids_ptr + q.to(tl.int64) * E + e, mask=live, other=-1).to(tl.int64)
            tl.store(out_ptr + q.to(tl.int64) * k + at, tl.where(entry < visible, entry, -1),
                     mask=(keep != 0) & (at < k))  # never past the row, whatever the keys
            written += tl.sum(keep, axis=0)
            seen_equal += tl.sum(equal, axis=0)

RESIDENT_ENTRIES = 32768  # the longest row a top-k program holds in registers (a warp per 1,024 of its entries)


def applies_topk(scores: torch.Tensor) -> bool:
    """CUDA, at any number of queries: the kernel beats the keyed top-k and sort at decode and prefill alike."""
    return triton is not None and scores.is_cuda


# A row longer than TOPK_PARTS_FROM entries takes its top-k in two launches: each part of TOPK_PART entries its own
# program's top k (a row in registers on 4 warps), then the top k of the parts' candidates, a program a query. The
# slice's ratio-1 decode rows (32,768 entries and the steps since) were read again for each of 16 passes: 64 x
# 32,788 took 0.126 ms, in parts of 4,096 0.060; 64 x 131,072 0.359 -> 0.133 (H100, bench_topk.py). A row held
# whole gains little (64 x 16,384: 0.025 -> 0.020) and a prefill chunk's loses (4,096 x 16,384: 0.737 -> 0.781).
# The list is the one launch's, exactly: a set is a set, and each part keeps its top k by the same order.
TOPK_PART = 4096
TOPK_PARTS_FROM = 32768


def topk_parts(E: int, k: int, part: int | None = None) -> int:
    """How many parts of TOPK_PART (`part` overrides it; 0: none) a row of E entries takes its top k in."""
    part = (TOPK_PART if E > TOPK_PARTS_FROM else 0) if part is None else part
    return triton.cdiv(E, part) if part and k <= part and E > part else 0


def topk_config(E: int, dtype: torch.dtype, block: int | None = None, num_warps: int | None = None) -> dict:
    """How `_topk_entries_kernel` takes a row of E scores: whole in registers up to RESIDENT_ENTRIES (BLOCK its
    power of two, a warp per 1,024 entries, at least 4), else 4,096 at a time over 16 warps (the best of 4 to 32
    on an H200 at 64 rows of 32k and 128k entries); `block` forces passes of that many (tests)."""
    BLOCK = triton.next_power_of_2(E) if block is None else min(block, triton.next_power_of_2(E))
    resident = BLOCK >= E and BLOCK <= RESIDENT_ENTRIES
    if not resident and block is None:
        BLOCK = 4096
    warps = num_warps or (max(4, min(32, BLOCK // 1024)) if resident else 16)
    return dict(BLOCK=BLOCK, BITS=16 if dtype == torch.bfloat16 else 32, RESIDENT=resident, num_warps=warps)


def topk_entries(scores: torch.Tensor, visible: torch.Tensor, k: int, block: int | None = None,
                 num_warps: int | None = None, part: int | None = None) -> torch.Tensor:
    """scores [B,S,E] (bf16 or fp32, -inf where masked), visible [B,S] -> the top-k entry ids [B,S,k] int64 in
    ascending order, -1 where j >= V(p), equal scores going to the lower index: model/attention.py
    `topk_entries` with the "lower-index" rule, the same list. 0 < k <= E; `block`, `num_warps`, `part` (a power
    of two, `topk_parts`): tests, tuning."""
    B, S, E = scores.shape
    out = torch.empty(B, S, k, dtype=torch.long, device=scores.device)
    if not B * S:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    parts, bits = topk_parts(E, k, part), 16 if scores.dtype == torch.bfloat16 else 32
    ids = out
    if parts:  # each part's top k, then the top k of the parts' candidates (their keys, in ascending id)
        keys = torch.empty(B * S, parts * k, dtype=torch.int32, device=scores.device)
        ids = torch.empty(B * S, parts * k, dtype=torch.int32, device=scores.device)
        _topk_part_kernel[(B * S, parts)](scores, keys, ids, E, k, S, scores.stride(0), scores.stride(1),
                                          PART=part or TOPK_PART, BITS=bits, num_warps=4)
        scores, E = keys, parts * k
    cfg = topk_config(E, scores.dtype, block, num_warps)
    _topk_entries_kernel[(B * S,)](scores, visible.contiguous(), out, E, k, S, scores.stride(0), scores.stride(1), ids,
                                   **dict(cfg, BITS=bits), CANDIDATES=bool(parts))
    return out


def scores_config(S: int, device: torch.device, batch_invariant: bool = False) -> dict:
    """How `_index_scores_kernel` is laid out for S queries a row: BLOCK_S queries by BLOCK_E entries a program,
    tf32 dots (the form of tiny-68m, whose H200 trace's bits are this form's, of decode's row kernel and of the
    batch-invariant mode, where a query's bits must not depend on how many share its launch), except for a prefill
    chunk of at least CHUNK_ROWS queries on CUDA outside that mode: 64 queries by 128 entries a program, bf16 dots
    (the same exact products, fp32 sums in the MMA's order; benchmarks/RESULTS.md)."""
    if S >= CHUNK_ROWS and device.type == "cuda" and not batch_invariant:
        return dict(BS=64, BE=128, BF16=True, num_warps=4)
    return dict(BS=BLOCK_S, BE=BLOCK_E, BF16=False)


def row_config(E: int) -> dict:
    """How `_index_scores_row_kernel` (decode: fewer than BLOCK_S queries a row) is laid out for E entries a row: a
    program scores NB blocks of BE entries in a loop whose next block's keys load while one is scored (ROW_TILE: 4
    blocks of 64, 2 warps, 2 stages), or one block below ROW_BLOCKS_FROM entries, where a row's programs are few
    already (tiny-68m). Each entry's arithmetic is the same in every layout: the same bits. At 64 rows, 32 heads of
    128 on an H100, 2.0-2.1 TB/s of keys for one block a program, 2.5-2.6 for 4 or 8 (benchmarks/RESULTS.md)."""
    return dict(ROW_TILE, NB=ROW_TILE["NB"] if E >= ROW_BLOCKS_FROM else 1)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                 batch_invariant: bool = False, cfg: dict | None = None, block_tables: torch.Tensor | None = None,
                 n_entries: int = 0) -> torch.Tensor:
    """q bf16 [B,S,H,D] (D a power of two, >= 16), w bf16 [B,S,H], keys bf16 [B,E,D] (any strides with a unit
    last one), visible int [B,S] -> scores bf16 [B,S,E] (model/attention.py `index_scores`). With block_tables
    [B, nb], keys is a kv source's paged pool [blocks, per_block, D], read in place: entry j of row b at
    (block_tables[b, j // per_block], j % per_block), E = n_entries (no copy of the keys, model/paged.py `stream`).
    Only entries below a query's V(p) are read. `cfg` overrides the form's layout, `scores_config`'s or at decode
    `row_config`'s (benchmarks, tests)."""
    B, S, H, D = q.shape
    E = keys.size(1) if block_tables is None else n_entries
    out = torch.empty(B, S, E, dtype=q.dtype, device=q.device)
    if out.numel():
        q = q if q.stride(-1) == 1 else q.contiguous()
        w = w if w.stride(-1) == 1 else w.contiguous()
        keys = keys if keys.stride(-1) == 1 else keys.contiguous()
        vis = visible.to(torch.int32).contiguous()
        # without block tables the kernel never reads tables_ptr (PER_BLOCK 0): keys stand in for it
        tables, per_block = (keys, 0) if block_tables is None else (block_tables.contiguous(), keys.size(1))
        strides = (q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), keys.stride(0), keys.stride(1),
                   tables.stride(0), out.stride(0), out.stride(1))
        if S < BLOCK_S:  # decode: a program per query, its heads on the dot's rows (the same scores, 16x less work)
            rc = dict(cfg or row_config(E))
            BE, NB = rc.pop("BE"), rc.pop("NB")
            _index_scores_row_kernel[(S, triton.cdiv(E, BE * NB), B)](q, w, keys, tables, vis, out, S, E, *strides,
                                                                      H=H, D=D, BH=BLOCK_S, BE=BE, NB=NB,
                                                                      PER_BLOCK=per_block, **rc)
        else:
            cfg = dict(cfg or scores_config(S, q.device, batch_invariant))
            BS, BE = cfg.pop("BS"), cfg.pop("BE")
            _index_scores_kernel[(triton.cdiv(S, BS), triton.cdiv(E, BE), B)](
                q, w, keys, tables, vis, out, S, E, H, *strides, D=D, BS=BS, BE=BE, PER_BLOCK=per_block, **cfg)
    return out


def applies_scores(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """CUDA, bf16, a power-of-two head dim of at least 16 (tl.dot's smallest)."""
    D = q.size(-1)
    return (triton is not None and q.is_cuda and q.dtype == keys.dtype == torch.bfloat16
            and D >= 16 and D & (D - 1) == 0)


def attention_list(window: torch.Tensor, topk: torch.Tensor, end: torch.Tensor, offset: int, ratio: int,
                   max_compressed: int, full_window: bool) -> torch.Tensor:
    """window int64 [B,S,W] (the cached window indices), topk int64 [B,S,K] (-1 padded), end [B] (each row's
    start + num_tokens) -> the index list int64 [B,S,W+K], as model/attention.py's
    attention_list(window, window_len, where(topk >= 0, topk + offset, -1), compressed_len) with
    window_len = W if full_window else min(end, W) and compressed_len = min(end // ratio, max_compressed)."""
    B, S, W = window.shape
    K = topk.size(-1)
    out = torch.empty(B, S, W + K, dtype=torch.long, device=window.device)
    if out.numel():
        _attention_list_kernel[(B * S,)](window.contiguous(), topk.contiguous(), end.contiguous(), out, S, W, K,
                                         offset, ratio, max_compressed, FULL_WINDOW=full_window,
                                         BLOCK=triton.next_power_of_2(W + K))
    return out
