"""The released checkpoint format of DeepSeek-V4.1: read it, run it in its storage formats, write it.

A Hugging Face `deepseek-ai/DeepSeek-V4.1-Flash` folder, as far as public code shows it (spec §9):
- `config.json`: the model under `text_config`, keys renamed as spec §1.2 lists; and
  `inference/config.json`: the flat `ModelArgs` keys of spec §1.1. Either is enough; with both, they must
  agree on every key they share.
- `model.safetensors.index.json` (`weight_map`: tensor name -> shard file) and the shards.
- Tensors under the official names. DeepSeek's convert.py also renames `model.`, `self_attn`, `mlp`,
  `weight_scale_inv` and `e_score_correction_bias` (spec §9); so does `official_name`.
- Storage (spec §5 "Storage", §2.5, §4.1): the dense linears FP8 e4m3 with one e8m0 `scale` per 32x32
  tile; the routed experts FP4 e2m1 packed two per byte, even element in the low nibble, stored as I8, with
  one e8m0 `scale` per 32 values along K; the Engram tables FP8 with one e8m0 scale per 32 values of a row;
  `head` and the ratio-2 compressor weights bf16, upcast at load to the fp32 the model computes in
  (spec §2.4, §6); `wo_a` FP8, dequantised to bf16 at load as convert.py does (the grouped einsum of
  spec §2.9 reads it dense). DSpark (`mtp.*`) and vision tensors are out of scope: skipped and listed.

The weights stay in their storage format: `FP8Linear` and `FP4Linear` (subclasses of the model's `Linear`,
swapped into the module tree, so every name stays the official one) dequantise inside each matmul, after
quantising the activation to FP8 with one ue8m0 scale per 32 values, as the official `linear()` does before
its `fp8_gemm` / `fp4_gemm`. On CUDA an FP8Linear runs kernels/fp8_gemm.py (the codes decoded in registers)
and the routed FP4 experts run model/moe.py's grouped kernel (kernels/fp4_moe.py); the torch paths here
serve CPU and the batch-invariant mode. The real model dequantised would need about 1.5 TB.

`quantize_checkpoint` writes this format from a project checkpoint (`mdi-trace checkpoint quantize`).
Mirrors DeepSeek's inference/convert.py (names, I8 experts, wo_a) and `Linear`/`linear()` of
inference/model.py. What could not be checked against the real files is listed in README.md.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kernels import fp8_gemm
from kernels import quant as quant_kernel
from model import invariant  # batch-invariant mode hooks (issue #11)
from model.attention import Linear
from model.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint, parameter_specs, save_tensors
from model.config import ConfigError, ModelArgs, cdiv
from model.quant import (FP4_WEIGHT_GROUP, WEIGHT_TILE, act_quant_fp8, dequantize_fp4_e8m0, dequantize_fp8_tiles,
                         quantize_fp4_e8m0, quantize_fp8_tiles)

INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG = "config.json"
INFERENCE_CONFIG = "inference/config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHARD_BYTES = 4 << 30  # the writer's shard size

# ---- names (spec §9) -------------------------------------------------------------------------------
RENAMES = (("self_attn", "attn"), ("mlp", "ffn"), ("weight_scale_inv", "scale"), ("e_score_correction_bias", "bias"))
# DSpark stages, the vision tower and its projector, image delimiters, and the MoE gate's image-token bias
OUT_OF_SCOPE = re.compile(r"(mtp|vision|aligner)\..*|image_(start|end|newline)|.*\.bias_vl")
# Which linears the official `Linear` stores in `dtype` (default_dtype) and which in `expert_dtype`
FP8_LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                        r"|engram\.wkv)")
EXPERT_LINEAR = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]")
DENSE_AT_LOAD = re.compile(r"layers\.\d+\.attn\.wo_a")  # stored FP8, run as bf16 (convert.py dequantises it)
BF16_IN_FILE = re.compile(r"head|layers\.\d+\.attn\.compressor\.(wkv|wgate)")  # fp32 parameters stored bf16

ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
            torch.float8_e8m0fnu: "F8_E8M0", torch.float4_e2m1fn_x2: "I8", torch.int8: "I8"}


def official_name(name: str) -> str:
    """A checkpoint tensor's name as the official model names it (convert.py's renames, spec §9)."""
    name = name.removeprefix("model.")
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


# ---- storage-format linears (spec §5 "Storage", §2.5a) ----------------------------------------------
class FP8Linear(Linear):
    """`weight` float8_e4m3fn [out, in] and `scale` float8_e8m0fnu [ceil(out/32), in/32], one per tile.
    y = x_q·dequant(W)ᵀ with x_q the FP8-quantised activation; out in x's dtype (official `fp8_gemm`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, torch.float8_e4m3fn)
        self.scale = torch.nn.Parameter(torch.empty(cdiv(out_features, WEIGHT_TILE), in_features // WEIGHT_TILE,
                                                    dtype=torch.float8_e8m0fnu))

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8_tiles(self.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp8_gemm.applies(x) and type(self) is FP8Linear and not invariant.enabled():
            # CUDA: one act_quant launch, then the block-scaled GEMM reading the FP8 codes (kernels/fp8_gemm.py)
            return fp8_gemm.fp8_gemm(quant_kernel.act_quant_fp8(x, WEIGHT_TILE), self.weight, self.scale)
        # the torch path (CPU, the batch-invariant mode, fp32 activations; FP4Linear, whose experts' CUDA path
        # is model/moe.py's grouped kernel): the dequantised weight lives for this matmul only, exact in bf16
        return invariant.linear(act_quant_fp8(x, WEIGHT_TILE), self.dense_weight().to(x.dtype))  # F.linear, or tiles


class FP4Linear(FP8Linear):
    """`weight` float4_e2m1fn_x2 [out, in/2] (two codes a byte, even element low) and `scale`
    float8_e8m0fnu [out, in/32]; FP8 activations as in FP8Linear (official `fp4_gemm`)."""

    def __init__(self, in_features: int, out_features: int):
        Linear.__init__(self, in_features // 2, out_features, torch.float4_e2m1fn_x2)
        self.scale = torch.nn.Parameter(torch.empty(out_features, in_features // FP4_WEIGHT_GROUP,
                                                    dtype=torch.float8_e8m0fnu))

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp4_e8m0(self.weight, self.scale)


@dataclass(frozen=True, slots=True)
class Storage:
    """How a checkpoint stores its linears: `dtype` the dense ones ("fp8" or "bf16"), `expert_dtype` the
    routed experts ("fp4", or None: as `dtype`). The official `ModelArgs` fields of the same names."""

    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"

    def __post_init__(self):
        if self.dtype not in ("fp8", "bf16") or self.expert_dtype not in ("fp4", None):
            raise ConfigError(f"invalid model config: dtype {self.dtype!r} with expert_dtype {self.expert_dtype!r} "
                              f"is not a storage this loader reads (dtype fp8 or bf16, expert_dtype fp4 or null).")

    def of(self, module: str) -> str:
        """"fp8", "fp4" or "bf16" for the linear at this module path; "bf16" also for anything else."""
        if EXPERT_LINEAR.fullmatch(module):
            return self.expert_dtype or self.dtype
        return self.dtype if FP8_LINEAR.fullmatch(module) else "bf16"


def storage_model(args: ModelArgs, storage: Storage, shard=None):
    """The `Transformer` on the meta device (this rank's part under EP, model/parallel.py), its quantised
    linears swapped for FP8Linear / FP4Linear."""
    from model.parallel import Shard
    from model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args, shard or Shard())
        for path, module in list(model.named_modules()):
            kind = storage.of(path)
            if kind != "bf16" and not DENSE_AT_LOAD.fullmatch(path):
                out_features, in_features = module.weight.shape
                model.set_submodule(path, (FP4Linear if kind == "fp4" else FP8Linear)(in_features, out_features))
    model.storage = storage
    return model


def file_layout(model, storage: Storage) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every tensor the released files hold for `model` (from `storage_model`): name -> (shape, the
    safetensors dtypes accepted), in the model's parameter order."""
    layout = {}
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if DENSE_AT_LOAD.fullmatch(module) and storage.of(module) == "fp8":
            out_features, in_features = p.shape
            layout[name] = (tuple(p.shape), ("F8_E4M3",))
            layout[f"{module}.scale"] = ((cdiv(out_features, WEIGHT_TILE), in_features // WEIGHT_TILE), ("F8_E8M0",))
        elif p.dtype == torch.float32:
            layout[name] = (tuple(p.shape), ("BF16", "F32") if BF16_IN_FILE.fullmatch(module) else ("F32", "BF16"))
        else:
            layout[name] = (tuple(p.shape), (ST_DTYPE[p.dtype],))
    return layout


def memory_plan(args: ModelArgs, storage: Storage, world_size: int = 1) -> dict[str, int]:
    """Bytes of the weights in memory once loaded (storage formats kept, wo_a bf16, head fp32), by part,
    from a meta build: the whole model, and one process of an EP run over `world_size` GPUs (ARCHITECTURE.md
    §8: routed experts and Engram rows split, the rest replicated); and the model dequantised to bf16."""
    parts = {"routed experts": 0, "Engram tables": 0, "replicated": 0, "dequantised bf16": 0}
    for name, p in storage_model(args, storage).named_parameters():
        module = name.rpartition(".")[0]
        part = "routed experts" if EXPERT_LINEAR.fullmatch(module) else \
            "Engram tables" if module.endswith(".engram.embed") else "replicated"
        parts[part] += p.numel() * p.element_size()
        values = p.numel() * (2 if p.dtype == torch.float4_e2m1fn_x2 else 1)
        parts["dequantised bf16"] += 0 if name.endswith(".scale") else 2 * values
    parts["total"] = parts["routed experts"] + parts["Engram tables"] + parts["replicated"]
    parts["per GPU"] = cdiv(parts["routed experts"], world_size) + cdiv(parts["Engram tables"], world_size) \
        + parts["replicated"]
    return parts


# ---- config (spec §1.1, §1.2) ------------------------------------------------------------------------
HF_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "qk_rope_head_dim": "rope_head_dim", "moe_intermediate_size": "moe_inter_dim",
           "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
           "routed_scaling_factor": "route_scale", "rms_norm_eps": "norm_eps", "sliding_window": "window_size",
           "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
           "candidate_source_layer_id": "candidate_source_layer", "engram_pad_token_id": "engram_pad_id",
           "num_nextn_predict_layers": "n_mtp_layers", "dspark_num_experts_per_tok": "dspark_n_activated_experts"}
ROPE_SCALING_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
                     "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
PROJECT_FIELDS = ("engram_token_map", "topk_tie_rule")  # ModelArgs fields the official ModelArgs lacks
# official ModelArgs fields of what is out of scope: read, and dropped
OUT_OF_SCOPE_FIELD = re.compile(r"(dspark|vision)_.*|image_token_id|n_mtp_layers")


def official_fields() -> set[str]:
    return {f.name for f in fields(ModelArgs)} - set(PROJECT_FIELDS)


def from_hf_config(config: dict) -> dict:
    """A Hugging Face config.json -> the official `ModelArgs` keys it gives (spec §1.2). Keys with no
    `ModelArgs` counterpart (max_position_embeddings, topk_method, token ids...) are not needed here."""
    text = config.get("text_config", config)
    known = official_fields() | {"dtype", "expert_dtype"}
    out = {HF_KEYS.get(k, k): v for k, v in text.items() if HF_KEYS.get(k, k) in known or OUT_OF_SCOPE_FIELD.fullmatch(
        HF_KEYS.get(k, k))}
    out |= {ROPE_SCALING_KEYS[k]: v for k, v in (text.get("rope_scaling") or {}).items() if k in ROPE_SCALING_KEYS}
    if text.get("num_key_value_heads", 1) != 1 or text.get("tie_word_embeddings", False):
        raise ConfigError("invalid model config: DeepSeek-V4.1 has num_key_value_heads 1 and untied embeddings.")
    quant = config.get("quantization_config")
    if "dtype" not in out:
        out["dtype"] = "fp8" if quant and quant.get("quant_method") == "fp8" else "bf16"
    if quant and list(quant.get("weight_block_size", [WEIGHT_TILE] * 2)) != [WEIGHT_TILE] * 2:
        raise ConfigError(f"invalid model config: weight_block_size {quant['weight_block_size']} is not the "
                          f"{WEIGHT_TILE}x{WEIGHT_TILE} tile of V4.1 (spec §5).")
    out.setdefault("expert_dtype", "fp4" if out["dtype"] == "fp8" else None)
    return out


def to_hf_config(official: dict, storage: Storage) -> dict:
    """The official keys -> a Hugging Face config.json in the released layout (the inverse of from_hf_config)."""
    names = {v: k for k, v in HF_KEYS.items()}
    text = {"model_type": "deepseek_v41_text", "num_key_value_heads": 1, "tie_word_embeddings": False,
            "expert_dtype": storage.expert_dtype}
    rope = {v: k for k, v in ROPE_SCALING_KEYS.items()}
    text |= {names.get(k, k): v for k, v in official.items() if k not in rope and k not in ("dtype", "expert_dtype")}
    text["rope_scaling"] = {rope[k]: official[k] for k in rope}
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}
    if storage.dtype == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "activation_scheme": "dynamic", "weight_block_size": [WEIGHT_TILE] * 2}
    return config


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}.") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not a JSON object.")
    return d


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


def read_config(path: Path) -> dict:
    """The official `ModelArgs` keys of a released folder: inference/config.json, else config.json (a
    Hugging Face one with `text_config`, or a flat one); with both, every shared key must agree."""
    flat = _read_json(path / INFERENCE_CONFIG) if (path / INFERENCE_CONFIG).is_file() else None
    hf = _read_json(path / HF_CONFIG) if (path / HF_CONFIG).is_file() else None
    if flat is None and hf is None:
        raise CheckpointError(f"no checkpoint config in {path}: it needs {HF_CONFIG} or {INFERENCE_CONFIG}.")
    try:
        mapped = from_hf_config(hf) if hf is not None else None
    except ConfigError as e:
        raise CheckpointError(f"{path / HF_CONFIG}: {e}") from None
    if flat is None:
        return mapped
    for key in sorted(set(flat) & set(mapped or {})):
        if not _same(flat[key], mapped[key]):
            raise CheckpointError(f"{path / HF_CONFIG} gives {key} = {mapped[key]} but {path / INFERENCE_CONFIG} "
                                  f"gives {flat[key]}; the two configs must describe the same model.")
    return flat


def model_args(official: dict, has_tokenizer: bool) -> tuple[ModelArgs, Storage]:
    """Official keys -> (the ModelArgs of the model this project computes, the storage of its weights).
    DSpark and vision fields are dropped (with the DSpark stages' compress ratios); the Engram token map
    is built from the tokenizer when the checkpoint brings one (spec §4.2), else the stub map of §8."""
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in official.items() if not OUT_OF_SCOPE_FIELD.fullmatch(k)}
    storage = Storage(d.pop("dtype", "fp8"), d.pop("expert_dtype", "fp4"))
    if "compress_ratios" in d and "n_layers" in d:
        d["compress_ratios"] = d["compress_ratios"][:d["n_layers"]]
    d.setdefault("engram_token_map", "tokenizer" if has_tokenizer else "half")
    if d["engram_token_map"] == "half" and d.get("engram_layer_ids", (1,)) and \
            d.get("engram_compressed_vocab_size") != d.get("vocab_size", 129280) // 2:
        raise ConfigError(f"the Engram token map needs the checkpoint's tokenizer.json (engram_compressed_vocab_size "
                          f"{d.get('engram_compressed_vocab_size')}, spec §4.2); copy it into the checkpoint folder.")
    return ModelArgs.from_dict(d), storage


def checkpoint_args(path: str | Path) -> ModelArgs:
    """The ModelArgs of a checkpoint folder, released or project format (ConfigError in one sentence)."""
    path = Path(path)
    if not is_released(path):
        return ModelArgs.load(path / "config.json")
    try:
        return model_args(read_config(path), (path / "tokenizer.json").is_file())[0]
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def official_config(args: ModelArgs, storage: Storage) -> dict:
    """The inference/config.json of `args` stored as `storage`: the official keys only."""
    d = {k: v for k, v in args.to_dict().items() if k not in PROJECT_FIELDS}
    return d | {"dtype": storage.dtype, "expert_dtype": storage.expert_dtype, "n_mtp_layers": 0}


# ---- tokenizer (spec §4.2) ---------------------------------------------------------------------------
def read_tokenizer(path: Path):
    """The checkpoint's tokenizer.json as a `tokenizers.Tokenizer` (what the Engram token map reads)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError(f"{path / 'tokenizer.json'} needs the tokenizers package: pip install tokenizers.") from None
    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the tokenizers package raises its own exception type
        raise CheckpointError(f"cannot read {path / 'tokenizer.json'}: {e}.") from None


# ---- loading -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Released:
    model: object  # Transformer with its weights, in their storage formats
    digest: str  # of the index and every shard's header (names, dtypes, shapes, offsets)
    skipped: list[str]  # out-of-scope tensors in the files, by their names there


def is_released(path: Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def load_released(path: str | Path, device: str = "cpu", shard=None) -> Released:
    """Load a released folder onto `device` (only this rank's experts and Engram rows under EP); raises
    CheckpointError, one sentence naming the first problem. Every tensor's name, dtype and shape is
    checked, from the shard headers; only the ones this process holds are read."""
    path = Path(path)
    has_tokenizer = (path / "tokenizer.json").is_file()
    try:
        args, storage = model_args(read_config(path), has_tokenizer)
        model = storage_model(args, storage, shard)
    except ConfigError as e:
        raise CheckpointError(f"no usable checkpoint at {path}: {e}") from None
    full = model if model.shard.world_size == 1 else storage_model(args, storage)
    layout = file_layout(full, storage)
    shards, skipped = _index(path, layout)
    wanted = {n for n, _ in model.named_parameters()} | {f"{n.rpartition('.')[0]}.scale" for n in layout
                                                         if DENSE_AT_LOAD.fullmatch(n.rpartition(".")[0])}
    stored = {}
    for shard_file, names in shards.items():
        stored |= _read_shard(path / shard_file, names, layout, wanted, model, device)
    model.load_state_dict(_parameters(model, stored), assign=True)
    if has_tokenizer:
        model.tokenizer = read_tokenizer(path)
    if args.engram_layer_ids:
        try:
            model.token_map("cpu")  # build the map now: a tokenizer that does not fit fails here, not mid-run
        except ConfigError as e:
            raise CheckpointError(f"{path / 'tokenizer.json'} does not fit this model: {e}") from None
    model.skipped_tensors = skipped
    return Released(model.to(device), _digest(path, shards), skipped)


def _index(path: Path, layout: dict) -> tuple[dict[str, dict[str, str]], list[str]]:
    """({shard file: {official name: name in the file}} covering `layout` exactly, the out-of-scope names)."""
    raw = _read_json(path / INDEX_FILE).get("weight_map")
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise CheckpointError(f"{path / INDEX_FILE} has no weight_map of tensor names to shard files.")
    skipped = sorted(n for n in raw if OUT_OF_SCOPE.fullmatch(official_name(n)))
    shards, seen = {}, {}
    for name, shard in raw.items():
        official = official_name(name)
        if OUT_OF_SCOPE.fullmatch(official):
            continue
        if official not in layout:
            raise CheckpointError(f"{path / INDEX_FILE} has tensor {name} that this model does not have; use a "
                                  f"checkpoint made for this model config.")
        if official in seen:
            raise CheckpointError(f"{path / INDEX_FILE} names tensor {official} twice, as {seen[official]} and {name}.")
        if "/" in shard or not (path / shard).is_file():
            raise CheckpointError(f"{path / INDEX_FILE} places tensor {name} in {shard}, which is not a file in {path}.")
        seen[official] = name
        shards.setdefault(shard, {})[official] = name
    missing = [n for n in layout if n not in seen]
    if missing:
        raise CheckpointError(f"{path / INDEX_FILE} lacks tensor {missing[0]} ({len(missing)} missing in all); use "
                              f"a checkpoint made for this model config.")
    return dict(sorted(shards.items())), skipped


def _read_shard(shard: Path, names: dict[str, str], layout: dict, wanted: set, model, device) -> dict:
    """{official name: tensor as stored} of the `wanted` ones among `names` ({official: name in the file}),
    each checked against `layout` for shape and dtype first; an Engram table only this rank's rows."""
    out = {}
    try:
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            present = set(f.keys())
            for official, name in names.items():
                if name not in present:
                    raise CheckpointError(f"{shard} lacks tensor {name}, which {INDEX_FILE} places there; download "
                                          f"the shard again.")
                (shape, dtypes), got = layout[official], f.get_slice(name)
                if tuple(got.get_shape()) != shape or got.get_dtype() not in dtypes:
                    raise CheckpointError(f"{shard} has tensor {name} as {got.get_dtype()} {got.get_shape()}, "
                                          f"expected {' or '.join(dtypes)} {list(shape)}; use a checkpoint made "
                                          f"for this model config.")
                if official in wanted:
                    first = getattr(model.get_submodule(official.rpartition(".")[0]), "first_row", None)
                    rows = model.get_parameter(official).shape[0] if first is not None else None
                    out[official] = got[first:first + rows] if first is not None else f.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {shard} ({e}); download it again.") from None
    return out


def _parameters(model, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of `model` from the stored tensors: FP4 bytes viewed as float4_e2m1fn_x2, bf16 upcast
    where the model holds fp32, wo_a dequantised to bf16 (convert.py)."""
    state = {}
    for name, p in model.named_parameters():
        t, module = stored[name], name.rpartition(".")[0]
        if f"{module}.scale" in stored and not hasattr(model.get_submodule(module), "scale"):
            t = dequantize_fp8_tiles(t, stored[f"{module}.scale"]).to(p.dtype)
        elif p.dtype == torch.float4_e2m1fn_x2:
            t = t.view(p.dtype)
        state[name] = t.to(p.dtype)
    return state


def _digest(path: Path, shards: dict) -> str:
    """sha256 of the index file and of every shard's header (tensor names, dtypes, shapes and offsets).
    It names the files, not every byte: hashing the real model's ~500 GB at each load would take minutes."""
    h = hashlib.sha256((path / INDEX_FILE).read_bytes())
    for shard in shards:
        with open(path / shard, "rb") as f:
            size = f.read(8)
            h.update(size + f.read(struct.unpack("<Q", size)[0]))
    return h.hexdigest()


# ---- writing (`mdi-trace checkpoint quantize`) -------------------------------------------------------
def quantize_checkpoint(source: str | Path, out: str | Path, shard_bytes: int = SHARD_BYTES,
                        storage: Storage = Storage()) -> str:
    """Write a project checkpoint (bf16) in the released format: FP8 dense linears (32x32 tiles), FP4
    routed experts, the rest as released, in shards of about `shard_bytes` with model.safetensors.index.json,
    config.json and inference/config.json, and the tokenizer files of the source. Returns the new digest."""
    source, out = Path(source), Path(out)
    if is_released(source):
        raise CheckpointError(f"{source} is already in the released format; quantize a checkpoint made by "
                              f"`mdi-trace checkpoint init`.")
    try:
        args = ModelArgs.load(source / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(f"no usable checkpoint at {source}: {e}") from None
    has_tokenizer = (source / "tokenizer.json").is_file()
    if has_tokenizer != (args.engram_token_map == "tokenizer") and args.engram_layer_ids:
        raise CheckpointError(f"{source} has engram_token_map {args.engram_token_map!r} "
                              f"{'but brings' if has_tokenizer else 'and no'} tokenizer.json; the released format "
                              f"builds the Engram token map from tokenizer.json exactly when it is present.")
    loaded = load_checkpoint(source, {n: (tuple(s), d) for n, s, d in parameter_specs(args)})
    layout = file_layout(storage_model(args, storage), storage)
    tensors = {}
    for name, t in loaded.tensors.items():
        tensors |= _stored(name, t, storage)
    assert list(tensors) == list(layout), "the writer and the loader disagree on the released layout"
    digest = write_released(out, args, storage, tensors, shard_bytes)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return digest


def write_released(out: Path, args: ModelArgs, storage: Storage, tensors: dict[str, torch.Tensor],
                   shard_bytes: int = SHARD_BYTES) -> str:
    """Write the released files of `tensors` (official names, as stored, in file_layout order): the
    shards with model.safetensors.index.json, config.json and inference/config.json. Returns the digest
    load_released computes."""
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, tensors, shard_bytes)
    (out / "inference").mkdir(exist_ok=True)
    official = official_config(args, storage)
    (out / INFERENCE_CONFIG).write_text(json.dumps(official, indent=2) + "\n")
    (out / HF_CONFIG).write_text(json.dumps(to_hf_config(official, storage), indent=2) + "\n")
    return _digest(out, sorted(set(json.loads((out / INDEX_FILE).read_text())["weight_map"].values())))


def _stored(name: str, t: torch.Tensor, storage: Storage) -> dict[str, torch.Tensor]:
    """One parameter as the released files hold it: {name: tensor} plus its `scale` when quantised."""
    module, leaf = name.rpartition(".")[::2]
    kind = storage.of(module)
    if leaf == "weight" and kind == "fp8":
        codes, scale = quantize_fp8_tiles(t)
        return {name: codes, f"{module}.scale": scale}
    if leaf == "weight" and kind == "fp4":
        packed, scale = quantize_fp4_e8m0(t)
        return {name: packed.view(torch.int8), f"{module}.scale": scale}
    if t.dtype == torch.float32 and BF16_IN_FILE.fullmatch(module):
        return {name: t.bfloat16()}
    return {name: t}


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """Tensors in order, a new shard once one would pass `shard_bytes`; Hugging Face's file names."""
    groups, size = [[]], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_tensors({n: tensors[n].contiguous() for n in names}, out / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
                                  + "\n")
