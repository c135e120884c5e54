"""The paged model's per-step addresses (model/paged.py), each set in one launch: the step's inputs unpacked
(`unpack`, engine/model_runner.py), a kv source's `compress_addresses`, and the window's
(`window_addresses`: each query's window list in [ring | chunk] and where each row's latents go in its ring).

Which positions of a step close a compressed group, the KV block and entry each closing group's entry goes to
(the trash block for the others), the RoPE factors at each group's position j·r, where each position's group
members lie in [the slot's tail | the chunk], and where the open group's members wait: about 22 small
integer ops a ratio a forward in torch (45 launches a decode step of tiny-68m, ratios 1 and 2). Here one
program takes BLOCK positions of one row. Integer arithmetic and a copy of the RoPE table's values: the
same tensors as the torch path, exactly.
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere model/paged.py's torch path is the only path.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _compress_addresses_kernel(start_ptr, num_ptr, tables_ptr, slots_ptr, rope_ptr,
                                   blocks_ptr, entry_ptr, freqs_ptr, members_ptr, tail_slots_ptr, tail_at_ptr,
                                   S, nb, st_b, per_block, trash_block, trash_slot, max_pos,
                                   R: tl.constexpr, RATIO: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = s < S
        start, n = tl.load(start_ptr + b), tl.load(num_ptr + b)
        pos = start + s  # [BLOCK] int64
        valid = s < n
        at = b * S + s
        closes = valid & ((pos + 1) % RATIO == 0)
        j = pos // RATIO  # the entry a closing token completes; it sits at position j·r
        block = tl.load(tables_ptr + b * st_b + tl.minimum(j // per_block, nb - 1), mask=live, other=0)
        tl.store(blocks_ptr + at, tl.where(closes, block, trash_block), mask=live)
        tl.store(entry_ptr + at, j % per_block, mask=live)
        f = tl.arange(0, R)  # R fp32 values: the R/2 complex factors of position min(j·r, max_pos)
        row = tl.minimum(j * RATIO, max_pos)
        tl.store(freqs_ptr + at[:, None] * R + f[None, :], tl.load(rope_ptr + row[:, None] * R + f[None, :],
                                                                     mask=live[:, None]), mask=live[:, None])
        if RATIO > 1:
            end = start + n
            m = tl.arange(0, RP)  # RP: RATIO rounded up to a power of two
            member = pos[:, None] - RATIO + 1 + m[None, :]  # [BLOCK, RP] group positions
            where = tl.where(member >= start, RATIO + member - start, tl.maximum(member, 0) % RATIO)
            tl.store(members_ptr + at[:, None] * RATIO + m[None, :], where,
                     mask=live[:, None] & (m < RATIO)[None, :])
            keep = valid & (pos >= end // RATIO * RATIO)
            tl.store(tail_slots_ptr + at, tl.where(keep, tl.load(slots_ptr + b), trash_slot), mask=live)
            tl.store(tail_at_ptr + at, pos % RATIO, mask=live)

    @triton.jit
    def _window_kernel(start_ptr, num_ptr, slots_ptr, window_ptr, ring_slots_ptr, ring_at_ptr, S, trash_slot,
                       W: tl.constexpr, DECODE: tl.constexpr):
        q = tl.program_id(0)  # one position s of row b
        b, s = (q // S).to(tl.int64), q % S
        start, n = tl.load(start_ptr + b), tl.load(num_ptr + b)
        p = start + s
        k = tl.arange(0, W)
        if DECODE:  # the whole ring from slot p % W + 1: the -1 padding first
            pos = p - W + 1 + k
            pos = tl.where(pos >= 0, pos, -1)
        else:  # max(0, p - W + 1) + k, the positions after p -1: the padding last
            pos = tl.maximum(p - W + 1, 0) + k
            pos = tl.where(pos <= p, pos, -1)
        at = tl.where(pos < 0, -1, tl.where(pos >= start, W + pos - start, pos % W))
        tl.store(window_ptr + q.to(tl.int64) * W + k, at)
        keep = (s < n) & (p >= start + n - W)
        tl.store(ring_slots_ptr + q, tl.where(keep, tl.load(slots_ptr + b), trash_slot))
        tl.store(ring_at_ptr + q, p % W)


    @triton.jit
    def _step_inputs_kernel(ints_ptr, next_ptr, cols_ptr, ids_ptr, tables_ptr, pos_ptr, valid_ptr, end_ptr,
                            rows_ptr, B, S, nb, row_len, NCOL: tl.constexpr, NCOLP: tl.constexpr,
                            BLOCK: tl.constexpr):
        # One batch row b of engine/step.py's packed layout [COLUMNS | S ids | nb table entries]: the columns
        # (remap, start, num_tokens, state_slot, ...) to cols [NCOL, B], the ids with the in-flight first one
        # from next_tokens[state_slot] where remap, the block table, and the per-token positions and validity.
        b = tl.program_id(0).to(tl.int64)
        base = ints_ptr + b * row_len
        c = tl.arange(0, NCOLP)
        tl.store(cols_ptr + c * B + b, tl.load(base + c, mask=c < NCOL), mask=c < NCOL)
        remap, start, n, slot = tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)
        first = tl.where(remap != 0, tl.load(next_ptr + slot), tl.load(base + NCOL))
        for s0 in range(0, S, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            live = s < S
            tl.store(ids_ptr + b * S + s, tl.where(s == 0, first, tl.load(base + NCOL + s, mask=live)), mask=live)
            tl.store(pos_ptr + b * S + s, start + s, mask=live)
            tl.store(valid_ptr + b * S + s, s < n, mask=live)
        for t0 in range(0, nb, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            tl.store(tables_ptr + b * nb + t, tl.load(base + NCOL + S + t, mask=t < nb), mask=t < nb)
        tl.store(end_ptr + b, start + n)
        tl.store(rows_ptr + b, b)


def unpack(ints: torch.Tensor, S: int, next_tokens: torch.Tensor, context_len: int, decode: bool) -> tuple:
    """engine/model_runner.py's `_unpack` of a step's packed inputs (engine/step.py's layout) in one launch, with
    model/paged.py's per-token values: ints [B, NCOL + S + nb] int64 -> (ForwardBatch with the in-flight first
    ids taken from next_tokens[state_slot] and `per_token` = (positions start + s, valid s < num_tokens,
    end start + num_tokens, row index [B, 1]), sampled, seeds, output positions): the tensors of the torch
    lines, exactly (integer copies and arithmetic)."""
    from engine.step import NCOL
    from model.paged import ForwardBatch

    B, nb = ints.size(0), ints.size(1) - NCOL - S
    dev = ints.device
    cols = torch.empty(NCOL, B, dtype=torch.long, device=dev)
    ids, positions = (torch.empty(B, S, dtype=torch.long, device=dev) for _ in range(2))
    tables = torch.empty(B, nb, dtype=torch.long, device=dev)
    valid = torch.empty(B, S, dtype=torch.bool, device=dev)
    end, rows = torch.empty(B, dtype=torch.long, device=dev), torch.empty(B, 1, dtype=torch.long, device=dev)
    if B:
        ints = ints.contiguous()
        _step_inputs_kernel[(B,)](ints, next_tokens, cols, ids, tables, positions, valid, end, rows, B, S, nb,
                                  ints.size(1), NCOL=NCOL, NCOLP=triton.next_power_of_2(NCOL),
                                  BLOCK=min(1024, triton.next_power_of_2(max(S, nb, 1))))
    _, start, num_tokens, slots, sampled, seeds, output_positions = cols
    batch = ForwardBatch(ids, start, num_tokens, tables, slots, context_len, decode, (positions, valid, end, rows))
    return batch, sampled, seeds, output_positions


def window_addresses(batch, W: int, decode_order: bool, trash_slot: int) -> tuple[torch.Tensor, tuple]:
    """model/paged.py's window list of each query [B, S, W] (window_index in the decode or prefill order, each
    position mapped to the ring (p % W) or this chunk (W + p - s), -1 for none) and its ring addresses
    (state slot or trash slot, p % W) of each position [B, S], for the rows of `batch` (a ForwardBatch:
    start, num_tokens, state_slots; S from input_ids). W a power of two."""
    start, num_tokens, state_slots, S = batch.start, batch.num_tokens, batch.state_slots, batch.input_ids.size(1)
    B = start.size(0)
    dev = start.device
    window = torch.empty(B, S, W, dtype=torch.long, device=dev)
    ring_slots, ring_at = (torch.empty(B, S, dtype=torch.long, device=dev) for _ in range(2))
    if B * S:
        _window_kernel[(B * S,)](start.contiguous(), num_tokens.contiguous(), state_slots.contiguous(), window,
                                 ring_slots, ring_at, S, trash_slot, W=W, DECODE=decode_order)
    return window, (ring_slots, ring_at)


def compress_addresses(batch, rope: torch.Tensor, ratio: int, per_block: int, trash_block: int,
                       trash_slot: int) -> dict:
    """model/paged.py `compress_addresses` for the rows of `batch` (a ForwardBatch: start, num_tokens,
    block_tables, state_slots; S positions from input_ids): "blocks", "entry" int64 [B, S], "freqs" complex64
    [B, S, R/2] from the RoPE table `rope` [max_seq_len, R/2]; at ratio > 1 also "members" int64
    [B, S, ratio], "tail_slots" and "tail_at" int64 [B, S]."""
    start, num_tokens, state_slots = batch.start, batch.num_tokens, batch.state_slots
    block_tables = batch.block_tables
    S, B = batch.input_ids.size(1), start.size(0)
    dev = start.device
    half = rope.size(-1)
    out = dict(blocks=torch.empty(B, S, dtype=torch.long, device=dev),
               entry=torch.empty(B, S, dtype=torch.long, device=dev),
               freqs=torch.empty(B, S, half, dtype=rope.dtype, device=dev))
    if ratio > 1:
        out.update(members=torch.empty(B, S, ratio, dtype=torch.long, device=dev),
                   tail_slots=torch.empty(B, S, dtype=torch.long, device=dev),
                   tail_at=torch.empty(B, S, dtype=torch.long, device=dev))
        extra = (out["members"], out["tail_slots"], out["tail_at"])
    else:
        extra = (out["blocks"],) * 3  # not written at ratio 1
    if B * S:
        block = min(128, triton.next_power_of_2(S))
        tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        _compress_addresses_kernel[(triton.cdiv(S, block), B)](
            start.contiguous(), num_tokens.contiguous(), tables, state_slots.contiguous(),
            torch.view_as_real(rope), out["blocks"], out["entry"], torch.view_as_real(out["freqs"]), *extra,
            S, tables.size(1), tables.stride(0), per_block, trash_block, trash_slot, rope.size(0) - 1,
            R=2 * half, RATIO=ratio, RP=triton.next_power_of_2(ratio), BLOCK=block)
    return out
