"""Launches that fit the GPU they run on: a tile configuration whose shared memory the device cannot hold gives way
to the kernel's next smaller one.

A kernel's configuration is chosen on the GPUs it was measured on (H100/H200), but another architecture may
compile the same tiles into more shared memory than it has: Triton 3.7's sm_100 (B200) build of sparse
attention's 64-head block at the slice's 512-wide heads takes 263,200 bytes where a block may have 232,448
(sm_90's build of it takes 197,120). Triton raises OutOfResources when it loads such a kernel, before anything
runs (also while a CUDA graph is captured), so `launch` catches it and asks the kernel's module for the next smaller
configuration (`SMALLER`, registered with `register`). Every launch starts from the configuration asked for (Triton
keeps the refusal, so a retry costs a raise, not a compile): what a launch runs depends on its own arguments and
the device alone, never on which launch came first. The smaller tiles may add a kernel's sums in another order, so
their bits are that device's, as every GPU's bits are its own.

benchmarks/portable.py compiles recorded kernels for other GPUs by the same rule, so its table says which
configuration each target gets.
"""
from __future__ import annotations

from typing import Callable

try:  # Triton ships Linux wheels only; without it no kernel launches
    from triton.runtime.errors import OutOfResources
except ImportError:
    OutOfResources = None

SMALLER: dict = {}  # jitted kernel -> (configuration -> the next smaller one to try, or None)


def register(kernel, smaller: Callable[[dict], dict | None]) -> None:
    """Name `smaller` as the kernel's next configuration where the device cannot hold one."""
    SMALLER[kernel] = smaller


def launch(kernel, grid: Callable[[dict], tuple], args: tuple, cfg: dict, **fixed) -> dict:
    """kernel[grid(cfg)](*args, **fixed, **cfg), or with the first of SMALLER's configurations that the device can
    hold; -> the configuration that ran. Raises the last OutOfResources if none fits."""
    while True:
        try:
            kernel[grid(cfg)](*args, **fixed, **cfg)
            return cfg
        except OutOfResources:
            smaller = SMALLER.get(kernel, lambda _: None)(cfg)
            if smaller is None:
                raise
            cfg = smaller
