"""benchmarks/bench_slice.py's profile tables that run without a GPU: the kernels' launch shapes read from a
Chrome trace (issue #20 item 5: which small kernels are latency-bound)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_slice import chrome_events, launch_shapes, spread  # noqa: E402


def kernel(name, dur, grid=None, block=None, registers=None, occupancy=None):
    args = {k: v for k, v in (("grid", grid), ("block", block), ("registers per thread", registers),
                              ("est. achieved occupancy %", occupancy)) if v is not None}
    return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": args}


def test_launch_shapes_aggregate_each_kernel_and_skip_what_is_not_a_kernel():
    events = [kernel("_latent_kernel", 7.0, [64, 1, 1], [128, 1, 1], 40, 6),
              kernel("_latent_kernel", 5.0, [4, 16, 1], [128, 1, 1], 40, 10),
              kernel("_sparse_attn_kernel", 19.0, [64, 1, 1], [256, 1, 1], 168, 12),
              kernel("Memcpy-less kernel", 1.0),  # no args: counted, no shape
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 100.0},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 50.0}]
    rows = launch_shapes(events)
    assert [r["name"] for r in rows] == ["_sparse_attn_kernel", "_latent_kernel", "Memcpy-less kernel"]
    latent = rows[1]
    assert latent["launches"] == 2 and abs(latent["ms"] - 0.012) < 1e-12 and abs(latent["us"] - 6.0) < 1e-9
    assert latent["programs"] == [64] and latent["threads"] == [128] and latent["registers"] == [40]
    assert latent["occupancy"] == 8
    assert rows[2]["programs"] == [] and rows[2]["occupancy"] is None
    assert spread(latent["programs"]) == "64" and spread([4, 64]) == "4-64" and spread([]) == "-"


def test_chrome_events_read_a_real_profile_back():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    events = chrome_events(prof)
    assert any(ev.get("cat") == "cpu_op" for ev in events)
    assert launch_shapes(events) == []  # no device kernels on a CPU profile
