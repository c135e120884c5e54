"""The paged, batched model the engine runs (DeepInfer's deepinfer/worker/worker.py over DeepSeek's inference/model.py).

One forward over a batch of rows, each row a chunk [s, s+n) of one sequence at any position: a
prefill from 0, a later chunk of a chunked prefill, or a one-token decode. Two kinds of state:

- KV blocks of 128 token positions: per kv-source layer, compressed entries and index keys, 128/r
  entries per block, entry j of a sequence at (block_table[j // E], j % E). Written once when group j
  closes (spec §7.2).
- state slots: per sequence, the window rings of every layer ([W, D], position p at p % W), the
  ratio-2 compressor tails ([r, D] x 2, fp32) and the Engram history (last max_ngram-1 compressed ids).

Writes that a row must not make (padding tokens, tokens whose group did not close, ring positions
older than the last W) go to a trash block / trash slot at the end of each pool, so the forward has
no data-dependent shapes and no host synchronisation: the shapes come from `ForwardBatch`, a host-side
value. Quirk 7.4-1 of the spec: each layer scores against its own kv source's index keys (the
intended semantics), never against whichever keys another layer published last.

Mirrors DeepInfer's paged forward (deepinfer/worker/worker.py) over DeepSeek's inference/model.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import attention as attention_kernel, compressor as compressor_kernel, indexer as indexer_kernel, \
    paged as paged_kernel
from model.attention import attention_list, compressed_kv, select_entries, sparse_attn, stream, use_attention_kernel, \
    use_fused, use_kernels, window_index
from model import invariant  # batch-invariant mode (issue #11)
from model.config import BLOCK_SIZE
from model.engram import engram_history, hash_ids, start_history
from model.hc import identity_pre_mix
from model.transformer import Block, Transformer


@dataclass(slots=True)
class ForwardBatch:
    """The device inputs of one forward, built from a ScheduledBatch by the model runner.

    Rows are padded to the longest chunk S; `context_len` and `decode` are host values that fix the
    shapes (so a decode step of a given batch size and context bucket always has the same shapes)."""
    input_ids: torch.Tensor     # [B, S] int64, anything past num_tokens is padding
    start: torch.Tensor         # [B] int64: position of each row's first token
    num_tokens: torch.Tensor    # [B] int64: valid tokens of each row (>= 1)
    block_tables: torch.Tensor  # [B, nb] int64, padded with any value (padding entries are never visible)
    state_slots: torch.Tensor   # [B] int64
    context_len: int            # >= start + num_tokens of every row: sizes the entry streams
    decode: bool                # every row is one token at a position > 0 (the official decode order)
    per_token: tuple | None = None  # (positions, valid, end, rows) of _Step when the runner's launch made them


@dataclass(slots=True)
class _Step:
    """Per-forward values every layer reads (derived once from the ForwardBatch)."""
    batch: ForwardBatch
    positions: torch.Tensor  # [B, S]
    valid: torch.Tensor      # [B, S] bool
    end: torch.Tensor        # [B] start + num_tokens
    rows: torch.Tensor       # [B, 1] row index, for gathers


@dataclass(slots=True)
class Caches:
    """The paged state of the module docstring, each pool with one trash unit at its end."""
    ring: torch.Tensor     # [n_layers, slots + 1, W, D]: every layer's window ring
    entries: dict          # kv source -> (compressed KV [blocks + 1, 128/r, D], index keys [blocks + 1, 128/r, Di])
    tails: dict            # ratio-2 kv source -> (a, g) fp32 [slots + 1, r, D], g's empty members -inf
    history: torch.Tensor  # [slots + 1, max_ngram - 1] int64: the Engram history

    def tensors(self) -> list[torch.Tensor]:
        return [self.ring, self.history, *(t for pair in (*self.entries.values(), *self.tails.values()) for t in pair)]


def allocate_caches(a, num_blocks: int, num_slots: int, dtype: torch.dtype, device) -> Caches:
    """The paged state for `num_blocks` KV blocks and `num_slots` state slots, in `dtype` (bf16, or fp32 in
    the debugging mode) but for the fp32 tails and the int64 history. On the meta device it costs nothing:
    `cache_bytes` sizes the pool that way."""
    zeros = dict(dtype=dtype, device=device)
    ring = torch.zeros(a.n_layers, num_slots + 1, a.window_size, a.head_dim, **zeros)
    entries, tails = {}, {}
    for layer in a.kv_source_layers:
        r = a.compress_ratios[layer]
        entries[layer] = (torch.zeros(num_blocks + 1, BLOCK_SIZE // r, a.head_dim, **zeros),
                          torch.zeros(num_blocks + 1, BLOCK_SIZE // r, a.index_head_dim, **zeros))
        if r > 1:
            shape = (num_slots + 1, r, a.head_dim)
            tails[layer] = (torch.zeros(shape, dtype=torch.float32, device=device),
                            torch.full(shape, -torch.inf, dtype=torch.float32, device=device))
    history = torch.zeros(num_slots + 1, a.engram_max_ngram_size - 1, dtype=torch.long, device=device)
    return Caches(ring, entries, tails, history)


def cache_bytes(a, num_blocks: int, num_slots: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the paged state of `num_blocks` blocks and `num_slots` slots, trash units included: the
    tensors `allocate_caches` makes, sized on the meta device. Linear in both counts."""
    return sum(t.numel() * t.element_size() for t in allocate_caches(a, num_blocks, num_slots, dtype, "meta").tensors())


def bytes_per_block(a, dtype: torch.dtype = torch.bfloat16) -> int:
    """One KV block's bytes: per kv source layer, 128/r compressed entries and as many index keys."""
    return cache_bytes(a, 1, 0, dtype) - cache_bytes(a, 0, 0, dtype)


def bytes_per_slot(a, dtype: torch.dtype = torch.bfloat16) -> int:
    """One state slot's bytes: every layer's window ring, the ratio-2 compressor tails, the Engram history."""
    return cache_bytes(a, 0, 1, dtype) - cache_bytes(a, 0, 0, dtype)


class PagedModel:
    """The batched forward over paged state; the parameters are `weights` (shared with the reference)."""

    def __init__(self, weights: Transformer, num_blocks: int, num_slots: int, batch_invariant: bool = False):
        self.weights, self.args = weights, weights.args
        self.batch_invariant = batch_invariant  # every forward under model/invariant.py's mode
        a, dev = self.args, weights.head.weight.device
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.trash_block, self.trash_slot = num_blocks, num_slots  # write-only sinks for masked writes
        caches = allocate_caches(a, num_blocks, num_slots, weights.embed.weight.dtype, dev)
        self.ring, self.entries, self.tails, self.history = caches.ring, caches.entries, caches.tails, caches.history
        weights.warm(dev)

    @torch.inference_mode()
    @invariant.scoped
    def forward(self, batch: ForwardBatch, all_logits: bool = False, capture=None) -> torch.Tensor:
        """fp32 logits of each row's last token [B, vocab] (or of every token [B, S, vocab]).
        `capture(layer, name, tensor)` sees every module output, as in model/reference.py."""
        w, ids = self.weights, batch.input_ids
        B, S = ids.shape
        if batch.per_token is not None:  # kernels/paged.py unpack: the lines below, in the runner's launch
            step = _Step(batch, *batch.per_token)
        else:
            arange = torch.arange(S, device=ids.device)
            step = _Step(batch, batch.start[:, None] + arange, arange < batch.num_tokens[:, None],
                         batch.start + batch.num_tokens, torch.arange(B, device=ids.device)[:, None])
        row_ids = self.engram_rows(step)
        h = w.embed_tokens(ids)  # [B, S, hc, d]
        pre_mix = identity_pre_mix(h)
        shared: dict = {"capture": capture or (lambda *_: None)}
        for block in w.layers:
            if block.engram is not None:
                h = block.engram(h, row_ids[:, :, block.engram.layer_index])
                shared["capture"](block.layer, "engram", h)
            h, pre_mix = block(h, pre_mix, lambda x, b=block: self.attend(b, x, step, shared))
            shared["capture"](block.layer, "block", h)
        if all_logits:
            return w.logits(h, pre_mix)
        last = (batch.num_tokens - 1)[:, None]
        return w.logits(h[step.rows, last][:, 0], pre_mix[step.rows, last][:, 0])

    def engram_rows(self, step: _Step) -> torch.Tensor | None:
        """Row ids of this chunk (spec §4.2) from each slot's history; then the history moves on."""
        w, b = self.weights, step.batch
        if w.engram_layout is None:
            return None
        token_map = w.token_map(b.input_ids.device)
        comp = token_map[b.input_ids]
        fresh = start_history(self.args, token_map, b.input_ids.size(0))
        history = torch.where((b.start == 0)[:, None], fresh, self.history[b.state_slots])
        self.history[b.state_slots] = engram_history(history, comp, b.num_tokens)
        return hash_ids(w.layout(comp.device), comp, history)

    def attend(self, block: Block, x: torch.Tensor, step: _Step, shared: dict) -> torch.Tensor:
        """The attention sublayer (spec §7.3 steps 1-4) over x bf16 [B, S, d]."""
        args, attn, layer, b = self.args, block.attn, block.layer, step.batch
        S, r, W = x.size(1), attn.ratio, args.window_size
        cache = shared.setdefault("per_step", {})  # what every layer of this forward would compute alike
        if ("freqs", bool(r)) not in cache:
            cache["freqs", bool(r)] = self.weights.rope(r, x.device)[step.positions.clamp(max=args.max_seq_len - 1)]
        freqs = cache["freqs", bool(r)]
        # with the fused launches on, q's RoPE happens in sparse attention's load of q (the same bits), for heads
        # up to kernels/attention.py MAX_ROPE_AT_LOAD_WIDTH wide
        rope_at_load = use_fused(x) and use_attention_kernel(x, args.head_dim) and \
            attention_kernel.rope_at_load(args.head_dim)
        qr, q = attn.queries(x, None if rope_at_load else freqs)
        # window keys: positions < s from the slot's ring (index p % W), the rest from this chunk (W + p - s)
        if "window" not in cache:
            cache["window"], cache["ring_at"] = self.window_addresses(step)
        # a decode row's latent goes to its ring as it is made: its slot p % W holds position p - W, which
        # no query of the step reads (its own lists p - W + 1 .. p); a longer chunk writes after attention
        kv = attn.window_kv(x, freqs, (self.ring[layer], *cache["ring_at"]) if b.decode else None)
        capture = shared["capture"]
        capture(layer, "window_kv", kv)
        idx, ckv_pool = cache["window"], None
        if r:
            n_entries, kv_source = b.context_len // r, args.kv_source_of(layer)
            ckv_pool, key_pool = self.entries[kv_source]
            if args.is_kv_source(layer):
                self.compress(block, x, step, cache)
                # its index keys are final once it has written its own: CUDA reads them in place through the block
                # tables; the torch path streams them once for every index layer of this source
                cache["keys", kv_source] = ((key_pool, b.block_tables) if use_kernels(x) else
                                            (stream(key_pool, b.block_tables, n_entries), None))
            if args.is_index_source(layer):
                keys, tables = cache["keys", kv_source]
                topk = select_entries(args, block, x, qr, keys, step.positions, freqs, n_entries, shared, tables)
                capture(layer, "topk", topk)
                full_window = invariant.full_window(invariant.window_decode_order(b.decode))  # b.decode outside mode
                if use_kernels(x):  # the lines below in one launch (kernels/indexer.py), the same list
                    cache["list"] = indexer_kernel.attention_list(idx, topk, step.end, W + S, r, args.index_topk,
                                                                  full_window)
                else:
                    window_len = torch.full_like(step.end, W) if full_window else step.end.clamp(max=W)
                    compressed_len = (step.end // r).clamp(max=args.index_topk)
                    cache["list"] = attention_list(idx, window_len, torch.where(topk >= 0, topk + W + S, -1),
                                                   compressed_len)
            idx = cache["list"]
        o = self.sparse_attn(layer, attn, q, kv, ckv_pool, idx, b, freqs if rope_at_load else None)
        if not b.decode:  # each row's last min(n, W) latents to its ring at p % W (`window_addresses`), after
            self.ring[layer][cache["ring_at"]] = kv  # attention: its queries read the positions before s there
        capture(layer, "sparse_attn", o)
        out = attn.output(o, freqs)
        capture(layer, "attn_out", out)
        return out

    def sparse_attn(self, layer: int, attn, q: torch.Tensor, kv: torch.Tensor, ckv_pool: torch.Tensor | None,
                    idx: torch.Tensor, b: ForwardBatch, q_freqs: torch.Tensor | None = None) -> torch.Tensor:
        """Spec §2.8 over a row's KV sources, listed in that order by idx [B,S,L]: its slot's window ring
        (index p % W), this chunk's window latents kv [B,S,D] (W + p - s), its compressed entries (W + S + j).
        CUDA bf16: one kernel reading them where they lie; otherwise the torch path over their copy.
        `q_freqs`: q is without its RoPE, which the kernel applies as it loads q (the fused launches only)."""
        ring = self.ring[layer]  # [slots + 1, W, D]
        if use_attention_kernel(q):
            return attention_kernel.paged_sparse_attn(q, ring, b.state_slots, kv, ckv_pool, b.block_tables,
                                                      attn.attn_sink, idx, attn.softmax_scale, freqs=q_freqs)
        sources = [ring[b.state_slots], kv]
        if ckv_pool is not None:
            sources.append(stream(ckv_pool, b.block_tables, b.context_len // attn.ratio))
        return sparse_attn(q, torch.cat(sources, dim=1), attn.attn_sink, idx, attn.softmax_scale)

    def window_addresses(self, step: _Step) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The same for every layer of a forward (computed once, in attend's cache): each query's window list
        [B, S, W], positions < s from the slot's ring (index p % W) and the rest from this chunk (W + p - s),
        -1 for none; and where each position's latent goes in its ring: (state slot, or the trash slot for a
        position that is padding or not among the row's last W, p % W). With the fused launches on
        (model/attention.py FUSED_LAUNCHES, CUDA): one launch (kernels/paged.py)."""
        b, W = step.batch, self.args.window_size
        decode_order = invariant.window_decode_order(b.decode)
        if use_fused(step.positions) and W & (W - 1) == 0:
            return paged_kernel.window_addresses(b, W, decode_order, self.trash_slot)
        pos = window_index(step.positions, W, decode_order)
        start = b.start[:, None, None]
        window = torch.where(pos < 0, -1, torch.where(pos >= start, W + pos - start, pos % W))
        keep = step.valid & (step.positions >= step.end[:, None] - W)
        return window, (torch.where(keep, b.state_slots[:, None], self.trash_slot), step.positions % W)

    def compress(self, block: Block, x: torch.Tensor, step: _Step, cache: dict) -> None:
        """A kv source's new entries (spec §7.3a): pool every group that closes in this chunk, with its
        members before s taken from the slot's tail, then write index keys and compressed KV to blocks.
        The addresses depend on the ratio and the step alone: computed once a forward per ratio, in `cache`."""
        attn, layer, b = block.attn, block.layer, step.batch
        r = attn.ratio
        ckv_pool, key_pool = self.entries[layer]
        if ("compress", r) not in cache:
            cache["compress", r] = self.compress_addresses(r, step, ckv_pool.size(1), x.device)
        at = cache["compress", r]
        a, g = attn.compressor.project(x)  # [B, S, D]
        if g is None:
            latent = attn.compressor.pool(a, None)
        elif use_fused(x) and not invariant.enabled() and compressor_kernel.applies(a, g, self.tails[layer]):
            # a decode step's lines below (gathers, pool, norm, tail writes) in one launch, the same bits
            latent = compressor_kernel.pool_decode(a, g, self.tails[layer], b.state_slots, at, attn.compressor.norm)
        else:
            (tail_a, tail_g), members = self.tails[layer], at["members"]
            gather = lambda tail, t: torch.cat([tail[b.state_slots], t], 1)[step.rows[..., None], members]  # noqa: E731
            latent = attn.compressor.pool(gather(tail_a, a), gather(tail_g, g))
            # the members of a group still open at the end of the chunk wait in the tail
            tail_a[at["tail_slots"], at["tail_at"]], tail_g[at["tail_slots"], at["tail_at"]] = a, g
        # each entry to its block as it is made (a row's open groups to the trash block)
        attn.indexer.keys(latent, at["freqs"], (key_pool, at["blocks"], at["entry"]))
        compressed_kv(latent, at["freqs"], self.args.rope_head_dim, (ckv_pool, at["blocks"], at["entry"]))

    def compress_addresses(self, r: int, step: _Step, per_block: int, device) -> dict:
        """compress's addresses at ratio r: each position's group members in [slot's tail | chunk] (`members`),
        where the open group's members wait (`tail_slots`, `tail_at`), the RoPE of each position's entry
        (`freqs`), and where a closing position's entry goes (`blocks`, `entry`; others to the trash block)."""
        b, pos = step.batch, step.positions
        if use_fused(pos):  # CUDA: the lines below in one launch (kernels/paged.py), the same tensors
            return paged_kernel.compress_addresses(b, self.weights.rope(r, device), r, per_block, self.trash_block,
                                                   self.trash_slot)
        closes = step.valid & ((pos + 1) % r == 0)
        j = pos // r  # the entry a closing token completes; it sits at position j·r
        blocks = b.block_tables.gather(1, (j // per_block).clamp(max=b.block_tables.size(1) - 1))
        at = {"freqs": self.weights.rope(r, device)[(j * r).clamp(max=self.args.max_seq_len - 1)],
              "blocks": torch.where(closes, blocks, self.trash_block), "entry": j % per_block}
        if r > 1:  # groups of more than one member (ratio 1 pools nothing: no tail)
            member = pos[..., None] - r + 1 + torch.arange(r, device=device)  # [B, S, r] group positions
            start = b.start[:, None, None]
            keep = step.valid & (pos >= (step.end // r * r)[:, None])
            at.update(members=torch.where(member >= start, r + member - start, member.clamp_min(0) % r),
                      tail_slots=torch.where(keep, b.state_slots[:, None], self.trash_slot), tail_at=pos % r)
        return at
