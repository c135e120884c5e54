"""The plain reference model: the project's ground truth (ARCHITECTURE.md §1, spec §7.3).

One sequence, recomputed from position 0 over its whole token list: no paging, no batching, no
state kept between calls, exactly the single-shot prefill of DeepSeek's inference/model.py
(`Transformer.forward(tokens, start_pos=0)`). Each step cites the spec section it implements; the
modules themselves (model/attention.py, hc.py, moe.py, engram.py) are shared with model/paged.py.

`capture`, when given, receives (layer, module name, tensor) for every module output, so a
divergence can be localised module by module (mdi-trace check --against reference).
"""
from __future__ import annotations

from typing import Callable

import torch

from model.attention import attention_list, compressed_kv, select_entries, sparse_attn, window_index
from model.engram import hash_ids, start_history
from model.hc import identity_pre_mix
from model.transformer import Block, Transformer

Capture = Callable[[int, str, torch.Tensor], None]


class ReferenceModel:
    def __init__(self, weights: Transformer):
        self.weights, self.args = weights, weights.args

    @torch.inference_mode()
    def forward(self, tokens: list[int] | torch.Tensor, capture: Capture | None = None) -> torch.Tensor:
        """fp32 logits [S, vocab] at every position of `tokens` (spec §7.3 with s = 0, n = S)."""
        h, pre_mix, row_ids, shared = self.start(tokens, capture)
        for block in self.weights.layers:
            h, pre_mix = self.layer(block, h, pre_mix, row_ids, shared)
        return self.weights.logits(h, pre_mix)[0]

    def start(self, tokens, capture: Capture | None = None):
        """The inputs of layer 0: (stream [1,S,hc,d], pre_mix, Engram row ids, shared). `shared` holds
        what sources hand to later layers in one forward (spec §7.1 shared_attn) and the capture hook."""
        w, device = self.weights, self.weights.head.weight.device
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=device)[None]  # [1, S]
        row_ids = None
        if w.engram_layout is not None:  # §4.2: n-gram row ids, the history padded at the start
            token_map = w.token_map(device)
            history = start_history(self.args, token_map, 1)
            row_ids = hash_ids(w.layout(device), token_map[tokens], history)
        h = w.embed_tokens(tokens)  # [1, S, hc, d]
        return h, identity_pre_mix(h), row_ids, {"capture": capture or (lambda *_: None)}

    @torch.inference_mode()
    def layer(self, block: Block, h, pre_mix, row_ids, shared: dict):
        """One layer: Engram before its block (spec §4.1), then the block (spec §3). -> (h, pre_mix)"""
        capture = shared["capture"]
        if block.engram is not None:
            h = block.engram(h, row_ids[:, :, block.engram.layer_index])
            capture(block.layer, "engram", h)
        h, pre_mix = block(h, pre_mix, lambda x: self.attend(block, x, shared))
        capture(block.layer, "block", h)
        return h, pre_mix

    def attend(self, block: Block, x: torch.Tensor, shared: dict) -> torch.Tensor:
        """The attention sublayer of one block over the whole sequence x bf16 [1, S, d] (spec §2)."""
        args, attn, layer, capture = self.args, block.attn, block.layer, shared["capture"]
        S, r = x.size(1), attn.ratio
        positions = torch.arange(S, device=x.device)[None]
        freqs = self.weights.rope(r, x.device)[None, :S]
        qr, q = attn.queries(x, freqs)
        kv = attn.window_kv(x, freqs)  # §2.1, §2.3: the window keys are this sequence's own rows
        idx = window_index(positions, args.window_size, decode=False)
        window_len = torch.tensor([min(S, args.window_size)], device=x.device)
        capture(layer, "window_kv", kv)
        if r:
            n_entries = S // r
            if args.is_kv_source(layer):
                shared[layer] = self.compress(block, x, n_entries)
                capture(layer, "compressed_kv", shared[layer][0])
                capture(layer, "index_keys", shared[layer][1])
            ckv, keys = shared[args.kv_source_of(layer)]
            if args.is_index_source(layer):
                shared["topk"] = select_entries(args, block, x, qr, keys, positions, freqs, n_entries, shared)
                capture(layer, "topk", shared["topk"])
            topk = shared["topk"]
            compressed_len = torch.tensor([min(args.index_topk, n_entries)], device=x.device)
            idx = attention_list(idx, window_len, torch.where(topk >= 0, topk + S, -1), compressed_len)
            kv = torch.cat([kv, ckv], dim=1)
        o = sparse_attn(q, kv, attn.attn_sink, idx, attn.softmax_scale)  # §2.8
        capture(layer, "sparse_attn", o)
        out = attn.output(o, freqs)  # §2.9
        capture(layer, "attn_out", out)
        return out

    def compress(self, block: Block, x: torch.Tensor, n_entries: int):
        """A kv source's compressed entries and index keys for the whole sequence (spec §2.4, §2.6)."""
        attn, r = block.attn, block.attn.ratio
        a, g = attn.compressor.project(x)
        if g is None:
            latent = attn.compressor.pool(a, None)  # ratio 1: one latent per token
        else:  # complete groups only; a trailing partial group produces nothing
            group = lambda t: t[:, :n_entries * r].unflatten(1, (n_entries, r))  # noqa: E731 [1,E,r,D]
            latent = attn.compressor.pool(group(a), group(g))
        freqs = self.weights.rope(r, x.device)[None, :n_entries * r:r]  # entry j sits at position j·r
        keys = attn.indexer.keys(latent, freqs)  # from the pre-RoPE latent, before it is rotated
        return compressed_kv(latent, freqs, self.args.rope_head_dim), keys
