"""EP x DP (ARCHITECTURE.md §8; DeepSeek's inference/model.py rank split): the sharded layers' helpers, this rank.

Mirrors the expert-parallel, data-parallel layout DeepInfer serves V4.1-Flash with on several GPUs, and the
`world_size`/`rank` split of DeepSeek's inference/model.py (`MoE`'s `experts_start_idx`, the row split of
`ParallelEngramEmbedding`). Each rank runs its own scheduler and batch (DP); attention and dense parts are
replicated; the routed experts are split evenly across ranks and the Engram tables by rows (EP). A sharded
layer all-gathers the rows of every rank (each padded to the largest batch), applies its shard, and
reduce-scatters the results back to the rank that owns each row.

The sums are exact: every (row, routing slot) of the MoE and every (row, column) of an Engram lookup has
exactly one rank that computes it, the other ranks contribute zeros, and the routed outputs of a row are then
added in ascending expert id on its own rank, the order of the single-process MoE (spec §5). So on CPU, where
a bf16 row's GEMM bits do not depend on the other rows, EP changes no bit (tests/test_parallel.py). fp32 GEMM
bits do depend on the row count, so in the fp32 debugging mode EP agrees within ARCHITECTURE.md §6 instead.

In one process (`Shard()`, world size 1) every helper is a no-op and the layers take their original path.
Two process groups: `group` for the collectives inside a forward (NCCL on GPUs, gloo on CPU; on CPU they run
on the device worker thread), `host_group` (gloo) for the agreements between steps on the engine's thread.
Every rank must call the same collectives in the same order: an idle rank runs `idle_forward`.

Not yet for CUDA graphs: each sharded layer call exchanges the ranks' row counts and reads them on the host
(`row_counts`), so the engine turns decode graphs off when world_size > 1. The step's counts are known on
the host before the forward; passing them in with the batch would remove the read (issue #9).
"""
from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.config import ConfigError, cdiv

TIMEOUT = datetime.timedelta(minutes=10)  # a rank that stops answering fails its peers' collectives, not hangs them


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place in an EP x DP run: rank `rank` of `world_size`, and its process groups."""
    rank: int = 0
    world_size: int = 1
    group: object = None       # collectives inside a forward (None: the default group)
    host_group: object = None  # host-side agreements between steps (gloo)

    def experts(self, n: int) -> range:
        """This rank's routed experts: an even split of n (ConfigError when it is not even)."""
        if n % self.world_size:
            raise ConfigError(f"{self.world_size} ranks cannot split the {n} routed experts evenly; use a number "
                              f"of ranks that divides {n}.")
        per = n // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    def rows(self, n: int) -> range:
        """This rank's rows of an n-row table: ceil(n / world_size) each, the last rank the rest."""
        per = cdiv(n, self.world_size)
        return range(min(self.rank * per, n), min((self.rank + 1) * per, n))

    def requests(self, n: int) -> range:
        """Which of n requests (in submission order) this rank serves: round-robin by index. The engine
        gives request i the id i, so request ids on rank r are r, r + world_size, ..."""
        return range(self.rank, n, self.world_size)


_SETUP: Shard | None = None  # one process group per process, as torch.distributed has


def setup(device: str = "cpu") -> Shard:
    """The Shard of this process, from a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, and
    MASTER_ADDR/MASTER_PORT, or MDI_INIT_METHOD such as file:///tmp/x/store as `mdi-trace record --nproc`
    sets). Without WORLD_SIZE > 1: one process, `Shard()`. Initialises torch.distributed once: NCCL for CUDA
    (one GPU per LOCAL_RANK), gloo for CPU, plus a gloo group for the host."""
    global _SETUP
    if _SETUP is not None:
        return _SETUP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _SETUP = Shard()
        return _SETUP
    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world, timeout=TIMEOUT,
                            init_method=os.environ.get("MDI_INIT_METHOD", "env://"))
    _SETUP = Shard(rank, world, dist.group.WORLD, dist.new_group(backend="gloo", timeout=TIMEOUT))
    return _SETUP


# ---- host-side agreement between steps -------------------------------------------------------------------
def any_rank(flag: bool, shard: Shard) -> bool:
    """True on every rank when `flag` is true on any rank (an all-reduce MAX on the host group)."""
    if shard.world_size == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, dist.ReduceOp.MAX, group=shard.host_group)
    return bool(t.item())


def from_rank0(obj, shard: Shard):
    """Rank 0's `obj` on every rank (a run id, an output path)."""
    if shard.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=shard.host_group)
    return box[0]


def gather_objects(obj, shard: Shard) -> list:
    """Every rank's `obj`, by rank."""
    if shard.world_size == 1:
        return [obj]
    out = [None] * shard.world_size
    dist.all_gather_object(out, obj, group=shard.host_group)
    return out


def run_id(shard: Shard) -> str:
    """One id shared by every rank trace of a run (tracing/ranks.py checks that a set belongs together)."""
    return from_rank0(uuid.uuid4().hex[:16], shard)


def barrier(shard: Shard) -> None:
    if shard.world_size > 1:
        dist.barrier(group=shard.host_group)


# ---- the collectives of a forward ------------------------------------------------------------------------
def row_counts(n: int, shard: Shard) -> list[int]:
    """Every rank's number of rows in this layer call (its B·S tokens; 0 on an idle rank)."""
    if shard.world_size == 1:
        return [n]
    counts = [torch.zeros(1, dtype=torch.long, device=_device(shard)) for _ in range(shard.world_size)]
    dist.all_gather(counts, torch.tensor([n], device=_device(shard)), group=shard.group)
    return [int(c) for c in counts]  # a host read: a sync on CUDA, and no CUDA graph around it (see below)


def all_gather_rows(x: torch.Tensor, counts: list[int], shard: Shard) -> torch.Tensor:
    """x [counts[rank], ...] -> [sum(counts), ...]: every rank's rows, rank 0's first. Each rank's rows are
    padded to the largest count for the collective and the padding dropped after it."""
    if shard.world_size == 1:
        return x
    most = max(counts)
    padded = x.new_zeros(most, *x.shape[1:])
    padded[:x.size(0)] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=shard.group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def reduce_scatter_rows(y: torch.Tensor, counts: list[int], shard: Shard) -> torch.Tensor:
    """y [sum(counts), ...], this rank's partial results for every rank's rows -> [counts[rank], ...]: the
    sum over ranks of the rows this rank owns (the inverse layout of `all_gather_rows`)."""
    if shard.world_size == 1:
        return y
    most, parts = max(counts), []
    for part in y.split(counts):
        padded = y.new_zeros(most, *y.shape[1:])
        padded[:part.size(0)] = part
        parts.append(padded)
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=shard.group)
    return out[:counts[shard.rank]]


def _device(shard: Shard) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(shard.group) == "nccl" \
        else torch.device("cpu")


# ---- the sharded layers ----------------------------------------------------------------------------------
def moe_forward(moe, x: torch.Tensor) -> torch.Tensor:
    """model.moe.MoE over this rank's rows x [..., d] with its local experts (spec §5, EP x DP).

    The gate is replicated and runs on the local rows. The rows, weights and expert ids of every rank are
    all-gathered; each local expert runs on the rows that chose it; the outputs go back per routing slot
    ([rows, k, d], zeros where another rank's expert owns the slot), so the reduce-scatter only moves values.
    Each row then adds its k outputs in ascending expert id, fp32, the shared expert last, as one process."""
    shard, shape, x = moe.shard, x.shape, x.reshape(-1, x.size(-1))
    weights, ids = moe.gate(x)  # [N, k] each
    counts = row_counts(x.size(0), shard)
    xs, ws, es = (all_gather_rows(t, counts, shard) for t in (x, weights, ids))
    slots = xs.new_zeros(*es.shape, xs.size(-1))  # [N_all, k, d]
    for e in moe.local_experts:
        chosen = es == e  # [N_all, k]
        if xs.is_cuda:  # fixed shapes, as model/moe.py: the expert on every row, its slot kept
            w = (ws * chosen).sum(-1, keepdim=True)
            slots = torch.where(chosen[..., None], moe.experts[e](xs, w)[:, None], slots)
        elif chosen.any():
            rows, slot = torch.where(chosen)
            slots[rows, slot] = moe.experts[e](xs[rows], ws[rows, slot, None])
    slots = reduce_scatter_rows(slots, counts, shard)  # [N, k, d]: this rank's rows, every slot filled
    order = ids.argsort(-1)  # the single-process MoE adds the routed outputs in ascending expert id
    y = torch.zeros_like(x, dtype=torch.float32)
    for j in range(order.size(1)):
        y += slots.gather(1, order[:, j, None, None].expand(-1, 1, x.size(-1)))[:, 0]
    y += moe.shared_experts(x)
    return y.to(x.dtype).view(shape)


def engram_lookup(embed, row_ids: torch.Tensor) -> torch.Tensor:
    """model.engram.EngramEmbedding over a row split of its table: row_ids [..., cols] -> [..., cols,
    head_dim] bf16. The ids of every rank are all-gathered; each rank looks up the ones in its rows (zeros
    for the rest); the reduce-scatter brings each rank its own lookups."""
    shard, shape = embed.shard, row_ids.shape
    ids = row_ids.reshape(-1, shape[-1])
    counts = row_counts(ids.size(0), shard)
    local = all_gather_rows(ids, counts, shard) - embed.first_row
    mine = (local >= 0) & (local < embed.weight.size(0))
    values = embed.lookup(torch.where(mine, local, 0)) if embed.weight.size(0) else \
        torch.zeros(*local.shape, embed.weight.size(1), dtype=torch.bfloat16, device=ids.device)
    values = torch.where(mine[..., None], values, 0.0)
    return reduce_scatter_rows(values, counts, shard).view(*shape, embed.weight.size(1))


@torch.inference_mode()
def idle_forward(weights) -> None:
    """The collectives of one forward with zero rows, for a rank with nothing scheduled in a step: every
    sharded layer in model order, so the ranks that do have rows meet the same collectives."""
    dev, dtype, a = weights.head.weight.device, weights.embed.weight.dtype, weights.args
    for block in weights.layers:
        if block.engram is not None:
            block.engram.embed(torch.zeros(0, a.n_hash_cols, dtype=torch.long, device=dev))
        block.ffn(torch.zeros(0, a.dim, dtype=dtype, device=dev))


def shard_state_dict(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full checkpoint's tensors cut to `model`'s shard: only its local experts' (its state_dict has no
    others) and its rows of each Engram table (modules with a `first_row`)."""
    out = {}
    for name, p in model.state_dict().items():
        t = tensors[name]
        if t.shape != p.shape:
            first = model.get_submodule(name.rpartition(".")[0]).first_row
            t = t[first:first + p.size(0)]
        out[name] = t
    return out
