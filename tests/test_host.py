"""engine/host.py: a CPU run's large tensors stay mapped between steps (glibc's mmap off for them)."""
import subprocess
import sys

import pytest

from conftest import ROOT

# Allocate, fill and free a 256 MB tensor twice; print whether the settings hold and the page faults of the second
PROBE = """
import resource, torch
from engine.host import tune_cpu_allocator
tuned = tune_cpu_allocator()
torch.empty(1 << 26).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(1 << 26).fill_(1.0)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(env_extra: dict) -> tuple[bool, int]:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_a_freed_large_tensor_is_reused_without_faulting_its_pages_in_again():
    tuned, faults = probe({})
    assert tuned
    assert faults < 1000, faults  # 256 MB in 4 KiB pages is 65,536 faults when it is mapped afresh
    untouched, faults = probe({"MALLOC_ARENA_MAX": "8"})  # the user's own glibc settings: left alone
    assert not untouched
    assert faults > 30_000, faults  # glibc's default: a fresh mmap past 32 MB
