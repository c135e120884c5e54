"""Test set-up: Triton runs through its interpreter when there is no CUDA (CI, laptops).

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
On a CUDA machine it is left alone and the kernels run compiled.
"""
import os
import sys
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = Path(__file__).resolve().parent / "data"

from engine.host import tune_cpu_allocator  # noqa: E402  (after ROOT is on the path)

tune_cpu_allocator()  # as `mdi-trace` sets it: the in-process runs' large tensors stay mapped between steps


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A `micro` checkpoint (seed 0) in a temporary folder, shared by the tracing tests."""
    from model.checkpoint import init_checkpoint

    folder = tmp_path_factory.mktemp("micro")
    init_checkpoint("micro", 0, folder)
    return folder


class Peak:
    """What `traced_peak()` measured: `bytes`, the peak of Python's allocations (tracemalloc) in its block."""
    bytes = 0


@contextmanager
def _traced_peak():
    peak = Peak()
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


@pytest.fixture
def traced_peak():
    """`with traced_peak() as peak: ...`, then `peak.bytes`: what the block allocated at most."""
    return _traced_peak
