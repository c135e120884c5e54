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


def test_the_slices_decode_floor_counts_each_part_once():
    """decode_floor on the slice's released storage (meta tensors: shapes only), at 64 rows and 32k: the
    routed experts a step touches (64 x 6 picks of 384, uniform), the dense weights and the head, and per row
    the index keys of the three index sources, the top-k entries of the five compressed layers, the rings."""
    from bench_slice import decode_floor
    from model.config import preset
    from model.released import Storage, storage_model

    a = preset("v41-slice")
    with torch.device("meta"):
        model = storage_model(a, Storage())
    floor = decode_floor(model, 64, 32768)
    routed = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".ffn.experts." in n) / 1e9
    assert abs(floor["routed"] / routed - (1 - (1 - 6 / 384) ** 64)) < 1e-12  # 243.8 of 384 experts a layer
    assert abs(floor["head"] - 129280 * 5120 * 4 / 1e9) < 1e-9  # the fp32 head, read once
    assert abs(floor["index_keys"] - 64 * (16384 + 32768 + 32768) * 128 * 2 / 1e9) < 1e-9  # ratios 2, 1, 1
    assert abs(floor["entries"] - 64 * 5 * 512 * 512 * 2 / 1e9) < 1e-9
    assert abs(floor["window"] - 64 * 7 * 128 * 512 * 2 / 1e9) < 1e-9
    assert abs(floor["total"] - sum(v for k, v in floor.items() if k != "total")) < 1e-9
    assert 37 < floor["total"] < 39
