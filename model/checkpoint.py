"""Checkpoints: the seeded random init, weight digests, and the safetensors checkpoint folder.

Owns three things:
- `init_weights`: the statistics-based random init of spec §8, which follows tt-metal's `testing.py`
  (`init_weights`, the procedure that made the golden weights). It fills (name, tensor) pairs, so it works
  for `model.transformer.Transformer.named_parameters()` and for bare tensors built from a state-dict listing.
- `tensor_sha256` / `weights_digest`: the digests of golden/README.md.
- the checkpoint folder: `config.json` (ModelArgs, the official inference/config.json keys) and
  `model.safetensors` with the official names, shapes and dtypes (spec §10), as DeepSeek's convert.py
  leaves them; plus `default_checkpoint`, the tiny-68m seed-0 folder built once in a user cache.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import ConfigError, ModelArgs, cache_dir, preset
from model.quant import quantize_fp8_e8m0

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DIGEST_KEY = "weights_all_sha256"  # safetensors metadata key, as in the golden outputs file
# Tensors of official checkpoints this model does not run (DSpark, vision): skipped by name on load.
SKIPPED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")

# ---- random init (spec §8 "Random-init advice") ---------------------------------------------------
EMBED_STD = 0.12  # RMS of the released token embedding
# Norm weight means by owner module; matched as the owner's name or a dotted suffix of it; others 1.0.
NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5}
# Projection std as a multiple of fan_in^-0.5, by the last component of the owner's name; others 1.0.
PROJECTION_GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9,
                   "w1": 1.5, "w3": 1.5, "w2": 1.05}


class CheckpointError(ValueError):
    """A checkpoint folder the model cannot load. The message is one sentence for the user."""


def _norm_mean(owner: str) -> float:
    return next((m for key, m in NORM_MEAN.items() if owner == key or owner.endswith("." + key)), 1.0)


def _draw(owner: str, leaf: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """One parameter's fp32 values: a standard normal draw of its full shape, then shaped by its role.
    The rules are tried in this order, as in testing.py; the arithmetic order matters for the bits."""
    w = torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device)
    last = owner.rpartition(".")[2]
    if leaf == "weight" and "norm" in last:  # RMSNorm gains: mean * (1 + 10% noise)
        return _norm_mean(owner) * (1 + 0.1 * w)
    if leaf == "weight" and last == "embed":  # token embeddings (official ParallelEmbedding owners)
        return w * EMBED_STD
    if len(shape) >= 2:  # projections, head, hc_*_fn, Engram q/k weights: fan_in is the last dim
        return w * shape[-1] ** -0.5 * PROJECTION_GAIN.get(last, 1.0)
    return 0.5 * w  # attn_sink, hc_*_base, hc_*_scale, gate.bias


# torch.randn of 16 or more fp32 values takes a vectorised Box-Muller (polynomial log, sin and cos) under the AVX2
# and AVX-512 dispatch and a scalar one under any other (DEFAULT, ARM's): there init_weights draws other normals,
# and a preset built from its seed has other weights (tiny-68m seed 0: 734 of 865 tensors, ALL 015f565f...).
GOLDEN_DRAWS = ("AVX2", "AVX512")


def seed_draws_note() -> str:
    """Empty where torch draws the golden normals (GOLDEN_DRAWS); else a clause saying why a preset built here
    from its seed has other weights than one built on an AVX2 or AVX-512 CPU."""
    dispatch = torch.backends.cpu.get_cpu_capability()
    if dispatch in GOLDEN_DRAWS:
        return ""
    return (f"torch's CPU dispatch here is {dispatch}, where torch.randn draws other normals than under AVX2 and "
            "AVX-512, so a preset built here from its seed has other weights than one built on such a CPU")


@torch.no_grad()
def init_weights(named_params: Iterable[tuple[str, torch.Tensor]], seed: int = 0, device: str = "cpu") -> None:
    """Fill every tensor in place, in the given order (the model's `named_parameters` order), from one
    `torch.Generator` on `device` seeded with `seed`; spec §8. Each tensor draws fp32 standard normals of its
    own shape and is then cast to its storage dtype. An Engram table (float8_e4m3fn, owner `*.engram.embed`)
    is drawn raw and FP8-quantised with e8m0 scales per row group, written into its sibling `scale`; the
    e8m0 scale tensors themselves draw nothing. Tensors may live on any device; the draws are made on
    `device` (the CPU's draws are the golden ones; a CUDA generator draws other values, faster)."""
    params = dict(named_params)
    gen = torch.Generator(device).manual_seed(seed)
    for name, p in params.items():
        init_parameter(name, p, params, gen)


def init_parameter(name: str, p: torch.Tensor, params: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """One step of init_weights: fill `p` (named `name`; `params` holds its Engram sibling `scale`) with
    its next draws from `gen`."""
    owner, _, leaf = name.rpartition(".")
    if p.dtype == torch.float8_e8m0fnu:
        return  # written with its table below
    if p.dtype == torch.float8_e4m3fn:
        _init_engram_table(name, p, params, gen)
    elif p.dtype.is_floating_point and p.element_size() >= 2:
        p.copy_(_draw(owner, leaf, p.shape, gen))
    else:
        raise ValueError(f"init_weights cannot fill {name} of dtype {p.dtype}: only bf16/fp16/fp32 "
                         f"tensors and FP8 Engram tables are initialised (spec §8).")


def _init_engram_table(name: str, p: torch.Tensor, params: dict[str, torch.Tensor], gen: torch.Generator):
    """Spec §8: an Engram table is N(0,1) as drawn (no fan-in scaling), stored as FP8 e4m3 codes with one
    e8m0 scale per row group (spec §4.1); the scale goes to the sibling `<owner>.scale`."""
    owner = name.rpartition(".")[0]
    scale = params.get(owner + ".scale")
    if not owner.endswith("engram.embed") or scale is None:
        raise ValueError(f"init_weights cannot fill {name}: FP8 weights are initialised only for Engram "
                         f"tables with a sibling scale (spec §8); dense FP8 weights are out of scope.")
    codes, scales = quantize_fp8_e8m0(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device),
                                      block=p.shape[-1] // scale.shape[-1])
    p.copy_(codes)
    scale.copy_(scales)


# ---- digests (golden/README.md) -----------------------------------------------------------------
def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: contiguous, in its storage dtype, little-endian (float8 as uint8)."""
    assert sys.byteorder == "little", "digests are defined on little-endian bytes"
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple], str]:
    """-> ([(name, dtype, shape, sha256)], ALL), with dtype as torch names it without `torch.` and shape
    a list; ALL is the sha256 of the concatenated lowercase hex digests, in the given order."""
    rows = [(name, str(t.dtype).removeprefix("torch."), list(t.shape), tensor_sha256(t))
            for name, t in named_tensors]
    return rows, hashlib.sha256("".join(r[3] for r in rows).encode("ascii")).hexdigest()


# ---- the checkpoint folder ----------------------------------------------------------------------
def save_checkpoint(path: str | Path, args: ModelArgs,
                    named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Write `path/config.json` and `path/model.safetensors` (official names, shapes and dtypes, the ALL
    digest in the metadata as `weights_all_sha256`). Returns that digest."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors}
    _, digest = weights_digest(tensors.items())
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args.save(path / CONFIG_FILE)
    save_tensors(tensors, path / WEIGHTS_FILE, metadata={DIGEST_KEY: digest})
    return digest


def umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, leaving the file readable as any file the user writes (safetensors creates
    it 0600): 0666 less the umask, 0644 by default."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


class LoadedCheckpoint(NamedTuple):
    args: ModelArgs
    tensors: dict[str, torch.Tensor]  # in the order of `expected`
    skipped: list[str]  # DSpark (`mtp.*`) and vision tensors present in the file and not loaded
    digest: str  # ALL, recomputed over `tensors`


def load_checkpoint(path: str | Path, expected: dict[str, tuple]) -> LoadedCheckpoint:
    """Read a checkpoint folder and check it against `expected` (name -> (shape, dtype)): every expected
    tensor present with that shape and dtype, nothing else but skippable DSpark/vision tensors. Raises
    CheckpointError naming the first problem. The digest is recomputed and, when the file records one,
    checked against it."""
    path = Path(path)
    weights = path / WEIGHTS_FILE
    if not (path / CONFIG_FILE).is_file() or not weights.is_file():
        raise CheckpointError(f"no checkpoint at {path}: it needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                              f"point to a checkpoint folder or create one with save_checkpoint.")
    try:
        args = ModelArgs.load(path / CONFIG_FILE)
        with safe_open(str(weights), framework="pt") as f:
            names, recorded = set(f.keys()), (f.metadata() or {}).get(DIGEST_KEY)
            _check_names(weights, names, expected)
            tensors = {name: _read_tensor(f, weights, name, *expected[name]) for name in expected}
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {weights} ({e}); re-create the checkpoint.") from None
    _, digest = weights_digest(tensors.items())
    if recorded is not None and recorded != digest:
        raise CheckpointError(f"{weights} is corrupt: its weights digest {digest[:12]}… differs from the "
                              f"recorded {recorded[:12]}…; re-create the checkpoint.")
    skipped = sorted(n for n in names - expected.keys())
    return LoadedCheckpoint(args, tensors, skipped, digest)


def _check_names(weights: Path, names: set[str], expected: dict[str, tuple]) -> None:
    missing = [n for n in expected if n not in names]
    if missing:
        raise CheckpointError(f"{weights} lacks tensor {missing[0]} ({len(missing)} missing in all); "
                              f"use a checkpoint made for this model config.")
    extra = sorted(n for n in names - expected.keys() if not n.startswith(SKIPPED_PREFIXES))
    if extra:
        raise CheckpointError(f"{weights} has tensor {extra[0]} that this model does not have ({len(extra)} "
                              f"unexpected in all); use a checkpoint made for this model config.")


def _read_tensor(f, weights: Path, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    got = f.get_slice(name).get_shape()
    if list(got) != list(shape):
        raise CheckpointError(f"{weights} has tensor {name} of shape {list(got)}, expected {list(shape)}; "
                              f"use a checkpoint made for this model config.")
    t = f.get_tensor(name)
    if t.dtype != dtype:
        raise CheckpointError(f"{weights} has tensor {name} of dtype {str(t.dtype).removeprefix('torch.')}, "
                              f"expected {str(dtype).removeprefix('torch.')}; use a checkpoint made for this "
                              f"model config.")
    return t


# ---- the default checkpoint (a user cache) --------------------------------------------------------
def parameter_specs(args: ModelArgs) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, shape, dtype) of every parameter of `model.transformer.Transformer(args)`, in its
    `named_parameters` order, from a build on the meta device (no memory). Built under the bf16 default
    dtype, as DeepSeek's generate.py builds the official model."""
    from model.transformer import Transformer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(previous)
    return [(name, p.shape, p.dtype) for name, p in model.named_parameters()]


def default_checkpoint(name: str = "tiny-68m", seed: int = 0, specs=None) -> Path:
    """The folder `<cache>/checkpoints/<name>-seed<seed>/`, created on first use from the preset `name`
    and `init_weights(seed)`, then reused. `specs` ((name, shape, dtype) triples) defaults to the model's
    `parameter_specs`. Written to a temporary folder beside it and renamed, so a crash leaves no half
    checkpoint and concurrent first uses agree. Under a dispatch that draws other normals (`seed_draws_note`:
    also `ATEN_CPU_CAPABILITY=default` on an AVX2 CPU) the golden folder is used if it is there (drawn by an
    earlier process under AVX2 or AVX-512), else the weights drawn here go to a folder named for the dispatch
    (`-seed0-default`): the two sets of weights never share one cache entry."""
    path = cache_dir() / "checkpoints" / f"{name}-seed{seed}"
    if seed_draws_note() and not (path / WEIGHTS_FILE).is_file():
        path = path.with_name(f"{path.name}-{torch.backends.cpu.get_cpu_capability().lower().replace(' ', '-')}")
    if (path / WEIGHTS_FILE).is_file():
        return path
    args = preset(name)
    tensors = [(n, torch.empty(shape, dtype=dtype)) for n, shape, dtype in specs or parameter_specs(args)]
    init_weights(tensors, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700; the cache is the user's, 0755 by default
    try:
        save_checkpoint(tmp, args, tensors)
        os.rename(tmp, path)
    except OSError:
        if not (path / WEIGHTS_FILE).is_file():  # not just another process that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def init_checkpoint(preset_name: str, seed: int, out: str | Path) -> str:
    """`mdi-trace checkpoint init`: a fresh checkpoint folder from a preset and a seed; returns its digest.
    A preset of RELEASED_PRESETS is written in the released format instead (model/slice.py)."""
    from model.config import RELEASED_PRESETS
    if preset_name in RELEASED_PRESETS:
        from model.slice import write_slice
        return write_slice(preset(preset_name), seed, out)
    args = preset(preset_name)
    tensors = [(n, torch.empty(shape, dtype=dtype)) for n, shape, dtype in parameter_specs(args)]
    init_weights(tensors, seed)
    Path(out).mkdir(parents=True, exist_ok=True)
    return save_checkpoint(out, args, tensors)
