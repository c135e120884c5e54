"""Engram (spec §4), mirroring DeepSeek's inference/engram.py and inference/model.py: hash layout, hashing, module.

Mirrors DeepSeek's inference/engram.py (`EngramLayout`, `NgramHashState`, `build_compressed_token_map`)
and the `ParallelEngramEmbedding` and `Engram` classes of inference/model.py, with parameters under the
official names. One difference in shape, none in value: the official `NgramHashState` keeps every compressed
id of a sequence in a [batch, max_seq_len] cache; here the caller passes the last `max_ngram_size - 1`
compressed ids before the chunk (`history`, a state-slot field), so prefill, chunked prefill and decode are
one function. Image spans (DEAD tokens) are out of scope and not handled.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import engram as engram_kernel
from model import invariant  # batch-invariant mode hooks (issue #11)
from model.attention import use_fused
from model.config import ConfigError, ModelArgs, engram_primes
from model.parallel import Shard, engram_lookup
from model.quant import dequantize_fp8_e8m0

SCALE_GROUP = 32  # one e8m0 scale per 32 values of a table row (spec §4.1)
GATE_CLAMP = 1e-6  # |dot| is clamped here before the signed square root (spec §4.3 step 4)


@dataclass(frozen=True, slots=True)
class EngramLayout:
    """The hash constants of every Engram layer (spec §4.2 steps 2-3). Column c of a layer's row ids is
    n-gram size 2 + c // n_heads, head c % n_heads. Tensors are int64; move them once with `to(device)`."""

    layer_ids: tuple[int, ...]  # model layer ids, e.g. (1, 4)
    max_ngram_size: int
    n_heads: int
    primes: tuple[tuple[int, ...], ...]  # [engram layer][column]: the bucket size of that column
    multipliers: torch.Tensor  # [n_engram_layers, max_ngram_size], odd
    moduli: torch.Tensor  # [n_engram_layers, n_hash_cols]: `primes` as a tensor
    offsets: torch.Tensor  # [n_engram_layers, n_hash_cols]: first table row of each column's range

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Table rows per Engram layer: the sum of its primes (192176, 192440 for tiny-68m)."""
        return tuple(sum(p) for p in self.primes)

    @classmethod
    def from_args(cls, args: ModelArgs) -> "EngramLayout | None":
        if not args.engram_layer_ids:
            return None
        primes = engram_primes(args)  # step 3
        # Step 2: per-layer odd multipliers, bounded so that compressed id * multiplier fits in int64.
        bound = max(1, (np.iinfo(np.int64).max // args.engram_compressed_vocab_size) // 2)
        draws = [np.random.default_rng(10007 * layer).integers(0, bound, size=args.engram_max_ngram_size,
                                                                dtype=np.int64) for layer in args.engram_layer_ids]
        moduli = torch.tensor(primes, dtype=torch.int64)
        layout = cls(layer_ids=tuple(args.engram_layer_ids), max_ngram_size=args.engram_max_ngram_size,
                     n_heads=args.engram_n_heads, primes=primes,
                     multipliers=torch.from_numpy(np.stack(draws) * 2 + 1),
                     moduli=moduli, offsets=moduli.cumsum(-1) - moduli)
        if args.engram_num_embeddings and tuple(args.engram_num_embeddings) != layout.num_embeddings:
            raise ConfigError(f"invalid model config: engram_num_embeddings {list(args.engram_num_embeddings)} "
                              f"differ from the prime layout's {list(layout.num_embeddings)} (spec §4.2).")
        return layout

    def to(self, device: torch.device | str) -> "EngramLayout":
        return dataclasses.replace(self, multipliers=self.multipliers.to(device), moduli=self.moduli.to(device),
                                   offsets=self.offsets.to(device))


def compressed_token_map(args: ModelArgs, tokenizer=None) -> torch.Tensor:
    """Token id -> compressed id, int64 [vocab_size] on the CPU (spec §4.2 step 1).

    "half" is the stub map t -> t // 2 of the tiny checkpoints (spec §8). "tokenizer" needs a
    `tokenizers.Tokenizer` (the checkpoint's tokenizer.json) and the `tokenizers` package."""
    if args.engram_token_map == "half":
        return torch.arange(args.vocab_size, dtype=torch.int64) // 2
    if tokenizer is None:
        raise ConfigError("engram_token_map 'tokenizer' needs the checkpoint's tokenizer.json; pass its Tokenizer.")
    try:
        from tokenizers import Regex, normalizers
    except ImportError:
        raise ConfigError("engram_token_map 'tokenizer' needs the tokenizers package: pip install tokenizers.") from None
    keep = "\ue000"  # a private-use stand-in, so that a token that is exactly " " survives Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " ")])
    key_ids: dict[str, int] = {}  # keys numbered in order of first appearance, scanning ids upwards
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    compressed = []
    for token in range(n_tokens):
        text = tokenizer.decode([token], skip_special_tokens=False)
        key = tokenizer.id_to_token(token) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        compressed.append(key_ids.setdefault(key, len(key_ids)))
    if len(key_ids) != args.engram_compressed_vocab_size:
        raise ConfigError(f"the tokenizer gives {len(key_ids)} compressed Engram ids but "
                          f"engram_compressed_vocab_size is {args.engram_compressed_vocab_size}.")
    # ids past the tokenizer (model vocab padding) never occur in text; they get the pad's compressed id
    token_map = torch.full((args.vocab_size,), compressed[args.engram_pad_id], dtype=torch.int64)
    known = torch.tensor(compressed[:args.vocab_size], dtype=torch.int64)
    token_map[:len(known)] = known
    return token_map


def start_history(args: ModelArgs, token_map: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The history of a sequence at position 0: the pad token's compressed id, [batch_size, max_ngram - 1]."""
    return token_map[args.engram_pad_id].expand(batch_size, args.engram_max_ngram_size - 1).clone()


def hash_ids(layout: EngramLayout, comp_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Row ids [B, S, n_engram_layers, n_hash_cols] of a chunk (spec §4.2 steps 4-5).

    comp_ids [B, S]: compressed ids of the chunk's tokens. history [B, max_ngram - 1]: compressed ids of
    the positions just before the chunk, most recent last, the pad's where the sequence has none.
    With the fused launches on (model/attention.py FUSED_LAUNCHES, CUDA): one launch, the same ids."""
    if use_fused(comp_ids) and engram_kernel.applies(comp_ids):
        return engram_kernel.hash_ids(layout, comp_ids, history)
    k, seq_len = layout.max_ngram_size - 1, comp_ids.shape[1]
    window = torch.cat([history, comp_ids], dim=1).long()  # [B, k + S]: positions s-k .. s+S-1
    back = torch.stack([window[:, k - s:k - s + seq_len] for s in range(k + 1)], dim=-1)  # [B, S, k+1]: t_0..t_k
    products = back.unsqueeze(2) * layout.multipliers  # [B, S, n_engram_layers, k+1]
    rolling, columns = products[..., 0], []
    for i in range(1, k + 1):  # after XOR-ing t_i in, `rolling` hashes the (i+1)-gram
        rolling = torch.bitwise_xor(rolling, products[..., i])
        moduli = layout.moduli[:, (i - 1) * layout.n_heads:i * layout.n_heads]  # [n_engram_layers, n_heads]
        columns.append(rolling.unsqueeze(-1) % moduli)
    return torch.cat(columns, dim=-1) + layout.offsets


def engram_history(history: torch.Tensor, comp_ids: torch.Tensor, num_tokens: torch.Tensor | None = None):
    """The history after a chunk: the last max_ngram - 1 compressed ids of history + comp_ids [B, S].
    num_tokens [B] (optional) counts the valid leading ids of each row of a padded chunk."""
    k = history.shape[1]
    window = torch.cat([history, comp_ids.to(history.dtype)], dim=1)  # [B, k + S]
    if num_tokens is None:
        return window[:, window.shape[1] - k:]
    return window.gather(1, num_tokens.unsqueeze(1) + torch.arange(k, device=window.device))


class EngramEmbedding(nn.Module):
    """`embed`: the FP8 e4m3 table, one e8m0 scale per 32 values of a row; looked-up rows are
    dequantised to bf16 (official `ParallelEngramEmbedding`). Under EP a rank holds the rows
    `shard.rows(rows)` of the table, from `first_row` on (model/parallel.py)."""

    def __init__(self, rows: int, head_dim: int, shard: Shard = Shard()):
        super().__init__()
        local = shard.rows(rows)
        self.shard, self.first_row = shard, local.start
        self.weight = nn.Parameter(torch.empty(len(local), head_dim, dtype=torch.float8_e4m3fn))
        self.scale = nn.Parameter(torch.empty(len(local), head_dim // SCALE_GROUP, dtype=torch.float8_e8m0fnu))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size > 1:  # the rows of every rank through this rank's part of the table
            return engram_lookup(self, row_ids)
        return self.lookup(row_ids)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table this module holds, [...] -> [..., head_dim] bf16."""
        values = dequantize_fp8_e8m0(F.embedding(row_ids, self.weight), F.embedding(row_ids, self.scale))
        return values.to(torch.bfloat16)  # [..., head_dim]


class _Linear(nn.Linear):
    """A bias-free bf16 linear whose weight stays torch.empty until the checkpoint fills it."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(x, self.weight)  # F.linear, or fixed row tiles in the batch-invariant mode


class Engram(nn.Module):
    """The Engram block before layer `layer_id` (spec §4.3): adds a gated n-gram value to each hc copy."""

    def __init__(self, args: ModelArgs, layer_id: int, shard: Shard = Shard()):
        super().__init__()
        self.layer_index = args.engram_layer_ids.index(layer_id)  # which of hash_ids' layers to read
        self.dim, self.hc_mult, self.eps = args.dim, args.hc_mult, args.norm_eps
        self.q_weight = nn.Parameter(torch.empty(args.hc_mult, args.dim, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.empty(args.hc_mult, args.dim, dtype=torch.bfloat16))
        self.embed = EngramEmbedding(args.engram_num_embeddings[self.layer_index], args.engram_head_dim, shard)
        self.wkv = _Linear(args.n_hash_cols * args.engram_head_dim, args.dim * (args.hc_mult + 1), bias=False,
                           dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """x [..., hc, dim] bf16, row_ids [..., n_hash_cols] -> [..., hc, dim] bf16."""
        if use_fused(x) and engram_kernel.applies(x, self):  # CUDA: the lookup and the gate a launch each
            return engram_kernel.engram(self, x, row_ids, GATE_CLAMP)
        rows = self.embed(row_ids).to(self.q_weight.dtype).flatten(-2)  # bf16 rows are exact in fp32
        kv = self.wkv(rows)  # [..., (hc+1)·dim]; a released checkpoint swaps in its FP8 linear here
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        h = x.float()
        gate = self.gate(h, key.float().unflatten(-1, (self.hc_mult, self.dim)))  # [..., hc]
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)

    def gate(self, h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """fp32 h, key [..., hc, dim] -> [..., hc]: sigmoid of the signed sqrt of the dot of each copy
        with its key, each RMS-normalised over dim alone (not jointly over the copies), eps = norm_eps."""
        weight = self.q_weight.float() * self.k_weight.float()  # [hc, dim]; only the product is ever used
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.dim**-0.5
        return invariant.pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
