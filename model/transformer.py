"""The parameters of DeepSeek-V4.1 (mirrors the module tree of DeepSeek's inference/model.py): `Transformer`, `Block`.

Mirrors the module tree of DeepSeek's inference/model.py, so `state_dict()` has exactly the names,
shapes, dtypes and order of the official checkpoint (tests/data/tiny-68m.state_dict.tsv). Forward
passes live elsewhere: model/reference.py (one sequence, plain) and model/paged.py (the engine's
batched, paged form). Both call the same modules, so a module compares with identical inputs.
"""
from __future__ import annotations

import torch
from torch import nn

from model import invariant  # batch-invariant mode hooks (issue #11)
from model.attention import Attention, RMSNorm
from model.config import ConfigError, ModelArgs
from model.engram import Engram, EngramLayout, compressed_token_map
from model.hc import handoff, hc_post, hc_pre
from model.moe import MoE
from model.parallel import Shard
from model.rope import rope_table


class Block(nn.Module):
    """One layer: attention and MoE sublayers between hyper-connection collapse and expand (spec §3),
    with an Engram block before it on `engram_layer_ids` (spec §4). `shard`: this rank's part of the
    routed experts and Engram rows under EP (model/parallel.py); everything else is replicated."""

    def __init__(self, args: ModelArgs, layer: int, shard: Shard = Shard()):
        super().__init__()
        self.layer, self.args = layer, args
        mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        f32 = dict(dtype=torch.float32)
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, width, **f32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, width, **f32))
        self.hc_attn_base = nn.Parameter(torch.empty(mix, **f32))
        self.hc_ffn_base = nn.Parameter(torch.empty(mix, **f32))
        self.hc_attn_scale = nn.Parameter(torch.empty(3, **f32))
        self.hc_ffn_scale = nn.Parameter(torch.empty(3, **f32))
        self.attn = Attention(args, layer)
        self.ffn = MoE(args, shard)
        self.engram = Engram(args, layer, shard) if layer in args.engram_layer_ids else None
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def handoff(self, y: torch.Tensor | None, h: torch.Tensor, post, comb, which: str, pre: torch.Tensor):
        """Into the attn or ffn sublayer (model/hc.py handoff): the stream after y's expand (y None: h), that
        sublayer's (pre, post, comb) from it, and its input: the stream collapsed with `pre`, then its norm."""
        a = self.args
        h, mixes, _, x = handoff(y, h, post, comb, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_scale"),
                                 getattr(self, f"hc_{which}_base"), a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps,
                                 a.norm_eps, pre, getattr(self, f"{which}_norm"))
        return h, mixes, x

    def forward(self, h: torch.Tensor, pre_mix: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1 block order with the delayed pre-mix (spec §3): attention input collapsed with the
        previous block's f_pre, the FFN input with this block's a_pre. `attend(x) -> y` runs the
        attention sublayer on x bf16 [B,S,d]; the caller supplies it with its own KV state."""
        h, (a_pre, a_post, a_comb), x = self.handoff(None, h, None, None, "attn", pre_mix)
        h, (f_pre, f_post, f_comb), x = self.handoff(attend(x), h, a_post, a_comb, "ffn", a_pre)
        h = hc_post(self.ffn(x), h, f_post, f_comb)
        return h, f_pre


class Transformer(nn.Module):
    """embed -> hc copies -> blocks -> collapse -> norm -> head (fp32 logits). Parameters only, plus
    the embedding and head steps both forward passes share."""

    def __init__(self, args: ModelArgs, shard: Shard = Shard()):
        super().__init__()
        self.args, self.shard = args.check(), shard
        with torch.device("cpu"):  # host tables, even when the parameters are built on the meta device
            self.engram_layout = EngramLayout.from_args(args)
        self.embed = nn.Embedding(args.vocab_size, args.dim, dtype=torch.bfloat16, _weight=torch.empty(
            args.vocab_size, args.dim, dtype=torch.bfloat16))
        self.layers = nn.ModuleList(Block(args, i, shard) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Module()
        self.head.weight = nn.Parameter(torch.empty(args.vocab_size, args.dim, dtype=torch.float32))
        self._rope: dict[tuple, torch.Tensor] = {}
        self._token_map: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, EngramLayout] = {}
        self.tokenizer = None  # set by a checkpoint that brings tokenizer.json (engram_token_map "tokenizer")

    def warm(self, device) -> None:
        """Build the per-device tables (RoPE, Engram token map and layout) now, so that no forward
        copies them to the device on first use (a host sync, and no good inside a CUDA graph)."""
        for ratio in (0, 1):
            self.rope(ratio, device)
        if self.engram_layout is not None:
            self.token_map(device), self.layout(device)

    def layout(self, device) -> EngramLayout:
        """The Engram hash layout on `device`, copied once (a copy per forward would sync on CUDA)."""
        key = str(device)
        if key not in self._layouts:
            self._layouts[key] = self.engram_layout.to(device)
        return self._layouts[key]

    def token_map(self, device) -> torch.Tensor:
        """Token id -> Engram's compressed id, int64 [vocab] (spec §4.2 step 1), cached per device."""
        key = str(device)
        if key not in self._token_map:
            self._token_map[key] = compressed_token_map(self.args, self.tokenizer).to(device)
        return self._token_map[key]

    def to_fp32(self) -> "Transformer":
        """The fp32 debugging mode (ARCHITECTURE.md §6): every bf16 parameter becomes fp32 (the same
        values), so activations stay fp32 where the official code rounds to bf16; the FP8/FP4
        quantisation simulations and the FP8 Engram tables still apply. Not the official numerics."""
        for p in self.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
        return self

    def set_max_seq_len(self, n: int) -> "Transformer":
        """Cover positions 0..n-1 (the engine's max_model_len): a runtime field that sizes the RoPE tables and
        has no numeric effect, V4.1's YaRN not depending on it (spec §1.1, §8); the tables are rebuilt at the
        new length on first use."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"max_model_len must be a whole number of at least 1, not {n!r}.")
        if n != self.args.max_seq_len:
            self.args.max_seq_len = n
            self._rope.clear()
        return self

    def rope(self, ratio: int, device) -> torch.Tensor:
        """The RoPE table of layers with this compress ratio (spec §2.2), cached per device."""
        key = (bool(ratio), str(device))
        if key not in self._rope:
            self._rope[key] = rope_table(self.args, ratio, device)
        return self._rope[key]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [..] -> the stream [.., hc, d] bf16: the embedding repeated into every copy."""
        e = self.embed(tokens)
        return e.unsqueeze(-2).expand(*e.shape[:-1], self.args.hc_mult, e.size(-1)).contiguous()

    def logits(self, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Final collapse with the last f_pre, norm, and the fp32 head. [..., hc, d] -> [..., vocab] fp32."""
        return invariant.head(self.norm(hc_pre(h, pre_mix)), self.head.weight)  # F.linear(x.float(), W) in fp32
