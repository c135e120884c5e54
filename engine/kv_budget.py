"""The KV pool's default size, from a memory budget (as vLLM's gpu_memory_utilization sizes its KV cache).

The paged state (model/paged.py) is KV blocks, each of 128 positions (per kv source layer 128/r compressed
entries and as many index keys), and state slots (per running request: every layer's window ring, the
ratio-2 compressor tails, the Engram history). Its bytes come from the tensors PagedModel allocates
(`model.paged.cache_bytes`, sized on the meta device), trash block and trash slot included:

    budget  = kv_cache_memory bytes, if given; else on CUDA gpu_memory_utilization x the device memory free
              once the weights are loaded; on CPU min(4 GiB, half the available RAM) (vLLM's CPU default
              KV space is 4 GiB)
    blocks  = (budget - bytes of the state slots) // bytes per block,
              at most max_num_seqs x cdiv(max_model_len, 128) (every running request at full length)

A budget that holds fewer blocks than one request of max_model_len needs is refused in one sentence.
Importing this module loads neither torch nor the model (the command line reads its defaults).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from model.config import BLOCK_SIZE, cdiv

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
CPU_KV_CACHE_MEMORY = 4 << 30         # the CPU budget, at most half the available RAM (vLLM's CPU KV space)
# positions, twice DeepSeek-V4's 1M context: a prompt this long still fits the trace reader's bounds on one
# object (tracing/reader.py LIMITS: 16 MiB, 4M array entries); more is refused before any table is built
MAX_MODEL_LEN = 1 << 21


def available_ram() -> int | None:
    """Bytes of RAM available to a new allocation (Linux: MemAvailable), else free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


@dataclass(slots=True)
class KVPool:
    num_kv_blocks: int
    budget: int            # bytes the paged state may take
    budget_source: str     # where the budget came from, in words
    bytes_per_block: int
    state_bytes: int       # the state slots' bytes (and the trash units'), taken off the budget first


def memory_budget(device, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                  kv_cache_memory: int | None = None) -> tuple[int, str]:
    """(bytes, where they came from) for the paged state on `device` (a torch.device): call it once the
    weights are loaded."""
    if kv_cache_memory is not None:
        return kv_cache_memory, f"kv_cache_memory {kv_cache_memory:,} bytes"
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()  # what the load left cached counts as free
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * gpu_memory_utilization), \
            f"gpu_memory_utilization {gpu_memory_utilization} of {free:,} free bytes"
    ram = available_ram()
    if ram is None:
        return CPU_KV_CACHE_MEMORY, f"the CPU default of {CPU_KV_CACHE_MEMORY:,} bytes"
    return min(CPU_KV_CACHE_MEMORY, ram // 2), f"the CPU default, min(4 GiB, half of {ram:,} available bytes)"


def size_pool(args, dtype, budget: int, budget_source: str, num_state_slots: int, max_num_seqs: int,
              max_model_len: int) -> KVPool:
    """The number of KV blocks `budget` bytes hold beside `num_state_slots` slots, capped at every one of
    `max_num_seqs` requests at max_model_len; ValueError in one sentence below one max_model_len request."""
    from model.paged import bytes_per_block, cache_bytes

    per_block = bytes_per_block(args, dtype)
    state = cache_bytes(args, 0, num_state_slots, dtype)
    per_seq = cdiv(max_model_len, BLOCK_SIZE)
    fit = max(budget - state, 0) // per_block
    if fit < per_seq:
        raise ValueError(f"the KV budget ({budget_source}) holds {fit:,} KV blocks of {per_block:,} bytes beside "
                         f"{num_state_slots} state slots ({state:,} bytes), fewer than the {per_seq:,} one request "
                         f"of max_model_len {max_model_len:,} needs; lower max_model_len, or raise kv_cache_memory (gpu_memory_utilization on CUDA).")
    return KVPool(min(fit, max_num_seqs * per_seq), budget, budget_source, per_block, state)
