"""Model configuration (mirrors `ModelArgs` of DeepSeek's inference/model.py), the layer roles, the presets, and
the project's cache folder (`cache_dir`, torch-free: the trace viewer spills a big index there).

Mirrors `ModelArgs` in DeepSeek's inference/model.py (spec §1.1); the field names are the keys of the
official `inference/config.json`, so a config file reads in both codebases. Vision and DSpark fields are
out of scope (ARCHITECTURE.md §1) and absent. `check()` enforces the implicit constraints of spec §1.3,
which the official code assumes silently.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path


BLOCK_SIZE = 128  # token positions per KV block (ARCHITECTURE.md §4): the engine's block tables, the model's pages


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0 (blocks to cover a positions, tiles to cover a rows, ...)."""
    return -(-a // b)


class ConfigError(ValueError):
    """A config that the model cannot run. The message is one sentence for the user."""


@dataclass(slots=True)
class ModelArgs:
    # runtime limits (spec §1.1): they size RoPE tables and buffers, and have no numeric effect
    max_batch_size: int = 4
    max_seq_len: int = 1024
    temperature: float = 0.0
    dtype: str = "bf16"  # storage of the dense weights; only "bf16" is computed here (spec §5 storage)
    expert_dtype: str | None = None
    vocab_size: int = 129280
    dim: int = 128
    moe_inter_dim: int = 256
    n_layers: int = 12
    n_mtp_layers: int = 0  # DSpark is out of scope: its `mtp.*` tensors are skipped by name
    n_heads: int = 4
    # MoE (spec §5)
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention (spec §2)
    q_lora_rank: int = 96
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 2
    o_lora_rank: int = 64
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1)
    kv_source_layers: tuple[int, ...] = (2, 4, 6)
    index_source_layers: tuple[int, ...] = (2, 4, 6, 8, 10)
    # RoPE (spec §2.2): ratio-0 layers use rope_theta without YaRN, the others compress_rope_theta with it
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer (spec §2.7)
    index_n_heads: int = 8
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = 6
    candidate_topk_blocks: int = 16
    candidate_block_size: int = 8
    # hyper-connections (spec §3)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram (spec §4)
    engram_layer_ids: tuple[int, ...] = (1, 4)
    engram_num_embeddings: tuple[int, ...] = (192176, 192440)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 32000
    engram_n_heads: int = 2
    engram_head_dim: int = 32
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 64640
    # project field: how token ids map to Engram's compressed ids (spec §8). "half" is the stub t -> t//2
    # of the tiny checkpoints; "tokenizer" builds the map of spec §4.2 from a checkpoint's tokenizer.json.
    engram_token_map: str = "half"
    # project field: how exact score ties at the top-k boundary are broken (spec §7.4-2). "lower-index" is
    # the project's deterministic rule; "torch" reproduces DeepSeek's code on the same torch build, to
    # compare with its outputs bit for bit (tests/test_golden.py).
    topk_tie_rule: str = "lower-index"

    # ---- layer roles (spec §1.3) ---------------------------------------------------------------
    def is_kv_source(self, layer: int) -> bool:
        return layer < self.n_layers and layer in self.kv_source_layers

    def is_index_source(self, layer: int) -> bool:
        return layer < self.n_layers and layer in self.index_source_layers

    def kv_source_of(self, layer: int) -> int:
        """The largest kv source <= layer: whose compressed KV and index keys this layer reads."""
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The largest index source <= layer: whose top-k list this layer attends with."""
        return max(s for s in self.index_source_layers if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer < layer

    @property
    def n_hash_cols(self) -> int:
        """Engram row ids per token: one per (n-gram size 2..max, head), spec §4.1."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def check(self) -> "ModelArgs":
        """Raise ConfigError naming the first violated constraint of spec §1.3 (or a width the
        quantisation sims of spec §2.5 cannot group)."""
        r, n = self.compress_ratios, self.n_layers
        problems = [
            (lambda: len(r) == n, f"compress_ratios has {len(r)} entries but n_layers is {n}"),
            (lambda: all(x in (0, 1, 2) for x in r), f"compress_ratios {list(r)} may hold only 0, 1 and 2 (V4.1)"),
            (lambda: all(0 <= s < n and r[s] > 0 for s in self.kv_source_layers + self.index_source_layers),
             "every kv and index source layer must exist and have compress ratio > 0"),
            (lambda: set(self.kv_source_layers) <= set(self.index_source_layers),
             "every kv source layer must also be an index source layer (index keys are written by its indexer)"),
            (lambda: self.candidate_source_layer < 0 or self.candidate_source_layer in self.index_source_layers,
             "the candidate source layer must be an index source layer"),
            (lambda: not any(r) or r.index(next(x for x in r if x)) in self.kv_source_layers,
             "the first compressed layer must be a kv source layer"),
            (lambda: all(r[i] == 0 or (any(s <= i for s in self.kv_source_layers)
                               and r[self.kv_source_of(i)] == r[i] and r[self.index_source_of(i)] == r[i])
                 for i in range(n)),
             "every compressed layer must share its compress ratio with its kv and index sources"),
            (lambda: self.candidate_source_layer < 0 or
             (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 >= self.index_topk,
             "(candidate_topk_blocks - 1) * candidate_block_size + 1 must be >= index_topk (spec §2.7)"),
            (lambda: self.head_dim % 32 == 0 and self.index_head_dim % 32 == 0 and self.engram_head_dim % 32 == 0,
             "head_dim, index_head_dim and engram_head_dim must be multiples of 32 (quantisation groups)"),
            (lambda: 0 < self.rope_head_dim < min(self.head_dim, self.index_head_dim) and self.rope_head_dim % 2 == 0,
             "rope_head_dim must be even and smaller than head_dim and index_head_dim"),
            (lambda: (self.n_heads * self.head_dim) % self.o_groups == 0 and self.n_heads % self.o_groups == 0,
             "n_heads must be a multiple of o_groups"),
            (lambda: self.n_shared_experts == 1, "n_shared_experts must be 1 (spec §5)"),
            (lambda: self.score_func == "sqrtsoftplus", "score_func must be sqrtsoftplus (V4.1)"),
            (lambda: self.dtype == "bf16" and self.expert_dtype is None,
             "only dtype bf16 with expert_dtype null is computed by this model"),
            (lambda: self.n_mtp_layers == 0, "DSpark (n_mtp_layers > 0) is out of scope; set n_mtp_layers to 0"),
            (lambda: len(self.engram_num_embeddings) == len(self.engram_layer_ids)
             and all(0 <= i < n for i in self.engram_layer_ids),
             "engram_num_embeddings needs one entry per engram layer id, each id a layer"),
            (lambda: self.engram_token_map in ("half", "tokenizer"), "engram_token_map must be 'half' or 'tokenizer'"),
            (lambda: self.topk_tie_rule in ("lower-index", "torch"), "topk_tie_rule must be 'lower-index' or 'torch'"),
            (lambda: self.engram_token_map != "half" or self.engram_compressed_vocab_size == self.vocab_size // 2,
             "with engram_token_map 'half' engram_compressed_vocab_size must be vocab_size // 2"),
        ]
        for ok, message in problems:  # in order, each evaluated only once the ones before it hold
            if not ok():
                raise ConfigError(f"invalid model config: {message}.")
        return self

    # ---- JSON (the official config.json keys) ----------------------------------------------------
    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"invalid model config: unknown field(s) {', '.join(unknown)}.")
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**kw).check()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelArgs":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read model config {path}: {e}.") from None
        if not isinstance(d, dict):
            raise ConfigError(f"model config {path} is not a JSON object.")
        return cls.from_dict(d)


def _tiny() -> ModelArgs:
    """Spec §8: every mechanism of V4.1 active at 68,297,760 parameters, with the real vocab."""
    return ModelArgs()


def _micro() -> ModelArgs:
    """The tiny model's layer roles at toy widths and a 1024-token vocab, so CPU tests take seconds.
    Top-k binds after 16 entries and candidates after 32; the window of 32 wraps after 32 tokens."""
    return ModelArgs(
        vocab_size=1024, dim=64, moe_inter_dim=64, n_heads=2, n_routed_experts=8, q_lora_rank=32,
        head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=32,
        index_n_heads=4, index_head_dim=32, index_topk=16, candidate_topk_blocks=4, candidate_block_size=8,
        engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=512,
        engram_num_embeddings=(), max_seq_len=2048,
    )


def _stress() -> ModelArgs:
    """`micro` with a 16-position window, so rings wrap many times within short prompts."""
    args = _micro()
    args.window_size = 16
    return args


def _v41_slice() -> ModelArgs:
    """The released V4.1-Flash widths of spec §1.1 with one layer of each role of spec §1.3; built in the
    released storage (FP8 dense with e8m0 tile scales, FP4 experts) from seed 0 on the device, in memory
    (model/slice.py). Its layers and the real model's layers of the same role:
      0 window only (real 0); 1 window only with Engram before it (real 1); 2 ratio-2 KV and index source
      (real 2); 3 ratio-2 consumer (real 3); 4 ratio-1 KV, index and candidate source (real 20); 5 ratio-1
      consumer (real 21); 6 ratio-1 re-index layer masked by layer 4's candidate blocks (real 24).
    Departures from the released config: the Engram table is shortened about 100x (engram_vocab_size
    160,000, not 16,000,000: 3.84M rows, not 384M), one Engram layer, not two; its token map is the stub
    t -> t//2 of spec §8 (no tokenizer), so engram_compressed_vocab_size is 64,640, not 99,092; DSpark off."""
    return ModelArgs(
        max_batch_size=64, max_seq_len=131072, dim=5120, moe_inter_dim=2304, n_layers=7, n_heads=64,
        n_routed_experts=384, n_activated_experts=6, q_lora_rank=1280, head_dim=512, rope_head_dim=64,
        o_groups=8, o_lora_rank=1024, compress_ratios=(0, 0, 2, 2, 1, 1, 1), kv_source_layers=(2, 4),
        index_source_layers=(2, 4, 6), candidate_source_layer=4, candidate_topk_blocks=2048,
        index_n_heads=32, index_head_dim=128, index_topk=512, engram_layer_ids=(1,), engram_num_embeddings=(),
        engram_vocab_size=160000, engram_n_heads=8, engram_head_dim=256,
    )


PRESETS = {"tiny-68m": _tiny, "micro": _micro, "stress": _stress, "v41-slice": _v41_slice}
# Presets whose weights are made in the released storage from seed 0 on the device at each load
# (model/slice.py), never as a bf16 checkpoint folder: at these widths one would take ~190 GB.
RELEASED_PRESETS = ("v41-slice",)


def preset(name: str) -> ModelArgs:
    """A fresh ModelArgs for a named preset, with the Engram table sizes computed (spec §4.2)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}.")
    args = PRESETS[name]()
    if not args.engram_num_embeddings:
        args.engram_num_embeddings = tuple(sum(p) for p in engram_primes(args))
    return args.check()


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    return all(n % f and n % (f + 2) for f in range(5, int(n**0.5) + 1, 6))


def engram_primes(args: ModelArgs) -> tuple[tuple[int, ...], ...]:
    """[Engram layer][hash column]: the bucket size of that column (spec §4.2 step 3); a layer's table has
    their sum of rows. Every (layer, n-gram size, head) in turn takes the smallest unused prime >=
    engram_vocab_size; each draw takes the smallest one left, so the draws are the consecutive primes from there."""
    n_cols, candidate, drawn = args.n_hash_cols, args.engram_vocab_size, []
    while len(drawn) < n_cols * len(args.engram_layer_ids):
        if _is_prime(candidate):
            drawn.append(candidate)
        candidate += 1
    return tuple(tuple(drawn[i:i + n_cols]) for i in range(0, len(drawn), n_cols))


def cache_dir() -> Path:
    """The project's cache (checkpoints, a big log's spilled index): $MDI_CACHE, else
    $XDG_CACHE_HOME/mini-deepinfer, else ~/.cache/mini-deepinfer."""
    if os.environ.get("MDI_CACHE"):
        return Path(os.environ["MDI_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mini-deepinfer"
