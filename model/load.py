"""Loading a model: a preset name, a project checkpoint folder, or a released (Hugging Face) folder.

Mirrors the loading half of DeepSeek's inference/generate.py (build the model, load the safetensors). Above
both formats: model/checkpoint.py (the project's folder: init, save, load) and model/released.py (the
released format, which builds on checkpoint.py's readers) never import this module or each other backwards.
"""
from __future__ import annotations

from pathlib import Path

import torch

from model import released
from model.checkpoint import CONFIG_FILE, CheckpointError, default_checkpoint, load_checkpoint, parameter_specs
from model.config import PRESETS, RELEASED_PRESETS, ConfigError, ModelArgs, preset
from model.parallel import Shard, shard_state_dict
from model.transformer import Transformer


def load_model(model: str = "tiny-68m", device: str = "cpu", shard=None, max_seq_len: int | None = None):
    """A `Transformer` with its weights, from a preset name (the embedded default checkpoint, created on
    first use) or a checkpoint folder. Returns (model, digest). Raises CheckpointError in one sentence.
    A folder with model.safetensors.index.json is read in the released format (model/released.py).
    `shard` (model/parallel.py, default one process) keeps only this rank's experts and Engram rows; the
    whole checkpoint is read and its digest checked first. `max_seq_len` (the engine's max_model_len)
    replaces the checkpoint's: the positions the RoPE tables cover, with no numeric effect (spec §8), so the
    digest, of the weights alone, is the same; a trace's header `model` carries the value used."""
    weights, digest = _load_model(model, device, shard)
    if max_seq_len is not None:
        weights.set_max_seq_len(max_seq_len)
    return weights, digest


def _load_model(model: str, device: str, shard):
    if model in RELEASED_PRESETS and not Path(model).is_dir():  # made on `device` from seed 0 (model/slice.py)
        from model.slice import build_slice
        return build_slice(preset(model), device=device, shard=shard)
    path = default_checkpoint(model) if model in PRESETS and not Path(model).is_dir() else Path(model)
    if released.is_released(path):  # a Hugging Face folder: sharded, FP8/FP4 storage (model/released.py)
        loaded = released.load_released(path, device, shard)
        return loaded.model, loaded.digest
    try:
        args = ModelArgs.load(path / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(f"no usable checkpoint at {path}: {e}") from None
    expected = {n: (tuple(shape), dtype) for n, shape, dtype in parameter_specs(args)}
    loaded = load_checkpoint(path, expected)
    with torch.device("meta"):
        transformer = Transformer(loaded.args, shard or Shard())
    transformer.load_state_dict(shard_state_dict(transformer, loaded.tensors), assign=True)
    if loaded.args.engram_token_map == "tokenizer":  # spec §4.2: the Engram token map reads tokenizer.json
        transformer.tokenizer = released.read_tokenizer(path)
    return transformer.to(device), loaded.digest
