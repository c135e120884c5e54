"""The full-width slice (issue #20 item 1): random weights in the released storage, made on the device.

`preset("v41-slice")` (model/config.py) has the released V4.1-Flash widths and one layer of each role. Its
routed experts alone are ~50 GB at FP4, so it is neither a bf16 checkpoint (~190 GB) nor a file that
travels: `build_slice` makes the weights where they will run, from a seed, one parameter at a time, as
`init_checkpoint` then `quantize_checkpoint` (model/released.py) would make them from the same draws:
- each parameter drawn and shaped by spec §8 (`init_parameter`, the draws of `init_weights`, in the model's
  `named_parameters` order), cast to its bf16/fp32 storage, then stored as the released files hold it
  (`released._stored`: FP8 e4m3 dense linears with one e8m0 scale per 32x32 tile, FP4 e2m1 experts with one
  e8m0 scale per 32 values, bf16 head and ratio-2 compressor, FP8 Engram table), its bf16 copy dropped;
- the model is the released loader's (`storage_model`, `released._parameters`), so it runs exactly as a
  released folder with these tensors would (tests/test_slice.py writes one and loads it to prove it).
The draws come from a `torch.Generator` on the device: on CUDA, Philox values, not the CPU's, and not
promised equal across GPU models. The digest says which weights ran: weights_digest's ALL (golden/README.md)
over the stored tensors in file order, hashed on the host in parallel threads.
`write_slice` writes the same tensors as a released folder (`mdi-trace checkpoint init --preset v41-slice`;
~57 GB at full width).
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import torch

from model.checkpoint import CheckpointError, init_parameter, parameter_specs, tensor_sha256
from model.config import ModelArgs
from model.released import EXPERT_LINEAR, Storage, _parameters, _stored, storage_model, write_released

SLICE_SEED = 0  # the seed of the preset's weights when it is named by `--model v41-slice`


@torch.no_grad()
def released_tensors(args: ModelArgs, seed: int, device: str | torch.device,
                     storage: Storage = Storage()) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor as the released files store it) on `device`, in the released file order.
    Only one routed expert's bf16 weight exists at a time; the other bf16 parameters (~7.5 GB at full
    width) are allocated up front, since an Engram table's draw writes its sibling scale."""
    gen = torch.Generator(device).manual_seed(seed)
    specs = parameter_specs(args)
    params = {n: torch.empty(shape, dtype=dtype, device=device) for n, shape, dtype in specs
              if not EXPERT_LINEAR.fullmatch(n.rpartition(".")[0])}
    for name, shape, dtype in specs:
        p = params[name] if name in params else torch.empty(shape, dtype=dtype, device=device)
        init_parameter(name, p, params, gen)
        yield from _stored(name, p, storage).items()
        params.pop(name, None)


def tensors_digest(named_tensors: Iterable[tuple[str, torch.Tensor]], threads: int | None = None) -> str:
    """weights_digest's ALL (model/checkpoint.py) of the tensors, each hashed in a worker thread
    (hashlib releases the GIL), so ~57 GB on the device hash in seconds, not minutes."""
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        hexes = list(pool.map(tensor_sha256, (t for _, t in named_tensors)))
    return hashlib.sha256("".join(hexes).encode("ascii")).hexdigest()


def build_slice(args: ModelArgs, seed: int = SLICE_SEED, device: str | torch.device = "cpu", shard=None):
    """The model of `args` in the released storage, its weights drawn on `device` from `seed`; returns
    (model, digest), as model/load.py `load_model` does. One process only."""
    if shard is not None and shard.world_size > 1:
        raise CheckpointError("the v41-slice preset is built in one process; write it with `mdi-trace "
                              "checkpoint init --preset v41-slice -o DIR` and pass --model DIR to run it under EP.")
    storage = Storage()
    stored = dict(released_tensors(args, seed, device, storage))
    digest = tensors_digest(stored.items())
    model = storage_model(args, storage)
    model.load_state_dict(_parameters(model, stored), assign=True)
    model.skipped_tensors = []
    return model.to(device), digest


def write_slice(args: ModelArgs, seed: int, out: str | Path, device: str | torch.device | None = None) -> str:
    """The same tensors as build_slice, written as a released folder that `--model DIR` loads (drawn on
    the GPU when there is one). Returns the digest load_released computes for the folder."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tensors = {n: t.cpu() for n, t in released_tensors(args, seed, device)}
    return write_released(Path(out), args, Storage(), tensors)
