"""engine/host.py: a CPU run's large tensors come from the heap and stay mapped once freed (glibc's mallinfo2
says where each byte lives)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# A step's large tensor, 64 MB (past glibc's largest mmap threshold, 32 MB): the bytes in mmapped chunks that
# it adds while alive, and what the heap grew by and still holds once it is freed.
PROBE = """
import ctypes, torch
from engine.host import tune_cpu_allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                "fordblks keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
tuned = tune_cpu_allocator()
before = libc.mallinfo2()
t = torch.empty(1 << 24).fill_(1.0)
mapped = libc.mallinfo2().hblkhd - before.hblkhd
del t
print(tuned, mapped, libc.mallinfo2().arena - before.arena)
"""
TENSOR = 1 << 26


def probe(env_extra: dict) -> tuple[bool, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    tuned, mapped, grown = out.stdout.split()
    return tuned == "True", int(mapped), int(grown)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_a_large_tensor_comes_from_the_heap_and_stays_there_once_freed():
    tuned, mapped, grown = probe({})
    assert tuned and mapped == 0 and grown > TENSOR // 2, (mapped, grown)  # not its own mmap; kept for the next step
    untouched, mapped, grown = probe({"MALLOC_ARENA_MAX": "8"})  # the user's own glibc settings: left alone
    assert not untouched and mapped >= TENSOR and grown < TENSOR // 2, (mapped, grown)  # glibc's: mmap, munmap
