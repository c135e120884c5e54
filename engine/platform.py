"""The platform a run's bits depend on (ARCHITECTURE.md §6), as the trace header records it.

No DeepInfer file does this. Two runs of the same computation agree bit for bit only on the same platform:
the same device (and, on CUDA, the same GPU and compute capability), the same torch and triton builds, the
same intra-op thread count, and on CPU the same instruction-set paths. torch picks its own CPU kernels by
`get_cpu_capability()`, oneDNN and MKL pick theirs by the CPU's features, capped by environment variables
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`): so the CPU model, its widest
vector ISA and any such cap are part of the platform. `differences(recorded, here)` names the fields that
differ, for `check` to say in one line why bits may differ. Imports torch only where it reads the platform
(`describe` and `differences` serve `info` and the viewer, which load no torch).
"""
from __future__ import annotations

import os
import platform as _platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Environment variables that lower the instruction set torch, oneDNN or MKL use (an imitation of a smaller CPU).
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                 "MKL_CBWR")
# The widest vector ISA of an x86 CPU, from its /proc/cpuinfo flags (widest first). AMX counts: oneDNN takes
# other bf16 paths with its tiles (an AMX Xeon does not give an AVX-512 EPYC's bits, tests/data/golden-digests.json).
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_X86_ISA = (("avx512-amx", _AVX512 + ("amx_tile", "amx_bf16")), ("avx512", _AVX512), ("avx2", ("avx2", "fma")),
            ("sse4.2", ("sse4_2",)))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or _platform.processor() or _platform.machine()


def cpu_isa() -> str:
    """The CPU's widest vector instruction set, whatever torch dispatches to: avx512-amx, avx512, avx2, ..., or the
    machine's architecture where the flags are not known (arm64 and others)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return next((name for name, need in _X86_ISA if flags.issuperset(need)), _platform.machine())


# oneDNN's ISA names, narrowest first (its ONEDNN_MAX_CPU_ISA values), and the widest each cpu_isa allows.
_ONEDNN = ("sse41", "avx", "avx2", "avx2_vnni", "avx512_core", "avx512_core_vnni", "avx512_core_bf16",
           "avx512_core_fp16", "avx512_core_amx")
_ONEDNN_OF = {"avx512-amx": "avx512_core_amx", "avx512": "avx512_core", "avx2": "avx2", "sse4.2": "sse41"}


def onednn_isa(isa: str) -> str:
    """The instruction set oneDNN may use: the CPU's widest, or lower where ONEDNN_MAX_CPU_ISA caps it
    (oneDNN does not tell; this follows its documented names)."""
    widest = _ONEDNN_OF.get(isa, isa)
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").lower()
    if not cap or cap == "all":
        return widest
    if cap in _ONEDNN and widest in _ONEDNN:
        return min(cap, widest, key=_ONEDNN.index)
    return f"{widest} capped at {cap}"


def cpu_platform() -> dict:
    """The CPU fields of a platform."""
    import torch

    isa = cpu_isa()
    return {"cpu_model": cpu_model(), "cpu_isa": isa, "onednn_isa": onednn_isa(isa),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_overrides": {k: os.environ[k] for k in ISA_OVERRIDES if k in os.environ}}


def platform_of(device: torch.device) -> dict:
    """Everything that decides the bits of a run on `device` (a torch.device; ARCHITECTURE.md §6)."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    fields = {"device_type": device.type, **cpu_platform(), "torch": torch.__version__, "triton": triton_version,
              "intra_op_threads": torch.get_num_threads()}
    if device.type == "cuda":
        fields |= {"gpu_name": torch.cuda.get_device_name(device),
                   "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                   "cuda": torch.version.cuda}
    return fields


def differences(recorded: dict | None, here: dict, where: tuple[str, str] = ("there", "here")) -> list[str]:
    """'field A there, B here' for every platform field that differs ('the trace records no platform' for a
    header without one); empty when both are the same platform."""
    if not isinstance(recorded, dict):
        return ["the trace records no platform (it predates the field), so its CPU's instruction set is unknown"]
    return [f"{k} {recorded.get(k)!r} {where[0]}, {here.get(k)!r} {where[1]}"
            for k in sorted(set(recorded) | set(here)) if recorded.get(k) != here.get(k)]


def describe(p: dict | None) -> str:
    """One line for `info`: the GPU or the CPU, its instruction-set paths, versions and threads."""
    if not isinstance(p, dict):
        return "not recorded (the trace predates the field)"
    where = (f"{p.get('gpu_name')} (sm {p.get('gpu_capability')}, CUDA {p.get('cuda')}) beside "
             if p.get("device_type") == "cuda" else "")
    caps = ", ".join(f"{k}={v}" for k, v in (p.get("isa_overrides") or {}).items())
    return (f"{where}{p.get('cpu_model')} ({p.get('cpu_isa')}, torch dispatch {p.get('cpu_capability')}, oneDNN "
            f"{p.get('onednn_isa')}"
            f"{', ' + caps if caps else ''}), torch {p.get('torch')}, triton {p.get('triton')}, "
            f"{p.get('intra_op_threads')} intra-op thread{'' if p.get('intra_op_threads') == 1 else 's'}")
