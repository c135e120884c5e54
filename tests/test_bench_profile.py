"""benchmarks/bench_slice.py's profile tables that run without a GPU: the kernels' launch shapes read from a
Chrome trace (issue #20 item 5: which small kernels are latency-bound); its decode and prefill floors; and
estimate_b200.py's scaling of the routed experts (issue #20 items 3 and 4)."""
import re
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


def compressor_bf16(model) -> int:
    """Bytes the fp32 ratio-2 compressor weights hold beyond their stored bf16 ones."""
    return sum(2 * t.numel() for n, t in model.named_parameters()
               if ".attn.compressor.w" in n and t.dtype == torch.float32)


def test_the_slices_decode_floor_counts_each_part_once():
    """decode_floor on the slice's released storage (meta tensors: shapes only), at 64 rows and 32k: the
    routed experts a step touches (64 x 6 picks of 384, uniform), the dense weights and the head at their stored
    bytes (the head and the ratio-2 compressor bf16, wo_a FP8 with its scales), and per row, in the caches'
    deployed formats, the index keys of the three index sources, the top-k entries of the five compressed
    layers, the rings."""
    from bench_slice import decode_floor
    from model.config import preset
    from model.released import Storage, storage_model

    a = preset("v41-slice")
    with torch.device("meta"):
        model = storage_model(a, Storage())
    floor = decode_floor(model, 64, 32768)
    routed = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".ffn.experts." in n) / 1e9
    assert abs(floor["routed"] / routed - (1 - (1 - 6 / 384) ** 64)) < 1e-12  # 243.8 of 384 experts a layer
    assert abs(floor["head"] - 129280 * 5120 * 2 / 1e9) < 1e-9  # the head at its stored bf16 bytes, read once
    wo_a = sum(t.numel() for n, t in model.named_parameters() if n.endswith("attn.wo_a.weight"))
    assert wo_a == 7 * 8192 * 4096
    dense = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
                if not n.startswith(("embed.", "head.")) and ".engram.embed." not in n and ".ffn.experts." not in n)
    assert abs(floor["dense"] - (dense - wo_a * (2 - 1 - 1 / 1024) - compressor_bf16(model)) / 1e9) < 1e-9
    # the caches' entries in their deployed formats (spec §2.5): an index key 68 bytes, a compressed entry 288, a
    # window entry 528; ratios 2, 1, 1 for the three index sources
    assert abs(floor["index_keys"] - 64 * (16384 + 32768 + 32768) * 68 / 1e9) < 1e-9
    assert abs(floor["entries"] - 64 * 5 * 512 * 288 / 1e9) < 1e-9
    assert abs(floor["window"] - 64 * 7 * 128 * 528 / 1e9) < 1e-9
    assert abs(floor["total"] - sum(v for k, v in floor.items() if k != "total")) < 1e-9
    assert 35 < floor["total"] < 36


def test_the_slices_prefill_floor_counts_each_part_once():
    """prefill_floor on the slice's released storage: 2 FLOPs a weight value a token (FP4 bytes hold two), the
    routed experts at 6 of 384, sparse attention over the window and min(top-k, p / ratio) entries, the index
    scores over p / ratio entries of each index source's kv source, all averaged over a prompt's positions."""
    from bench_slice import prefill_floor
    from model.config import preset
    from model.released import Storage, storage_model

    a = preset("v41-slice")
    with torch.device("meta"):
        model = storage_model(a, Storage())
    floor = prefill_floor(model, 8192)
    assert abs(floor["routed"] - 7 * 6 * 3 * 2 * 5120 * 2304 / 1e9) < 1e-9  # w1, w3, w2 of 6 experts, 7 layers
    wq_a = 2 * 1280 * 5120 / 1e9
    assert floor["dense"] > 7 * (wq_a + 2 * 32768 * 1280 / 1e9)  # at least every layer's wq_a and wq_b
    mean_topk = lambda r: sum(min(512, p // r) for p in range(8192)) / 8192
    want = 7 * 4 * 512 * 64 * 128 + 4 * 512 * 64 * (2 * mean_topk(2) + 3 * mean_topk(1))  # ratios 0, 0, 2, 2, 1, 1, 1
    assert abs(floor["attention"] - want / 1e9) < 1e-9
    mean_seen = lambda r: sum(p // r for p in range(8192)) / 8192
    assert abs(floor["index"] - 2 * 32 * 128 * (mean_seen(2) + 2 * mean_seen(1)) / 1e9) < 1e-9  # sources 2, 4, 6
    assert abs(floor["total"] - sum(v for k, v in floor.items() if k != "total")) < 1e-9
    assert 6 < floor["total"] < 6.5


def test_the_b200_estimate_scales_the_experts_by_what_the_profiled_step_read(tmp_path, monkeypatch, capsys):
    """estimate_b200.py: the routed experts' time scales by the experts a GPU reads under EP over the experts the
    profiled slice step read: the profile's count when it has one (the random slice routes 64 rows to ~30 of 384
    a layer), else the uniform expectation (242.9 at 64 x 6 picks), said so in the output."""
    import json

    import estimate_b200
    from model.released import Storage, memory_plan

    layers = [dict(layer=i, ratio=r, engram_ms=0.0, attention_ms=0.3, rest_ms=1.0, total_ms=1.3)
              for i, r in enumerate((0, 0, 2, 2, 1, 1, 1))]
    decode = dict(device_ms=12.0, graph_ms_per_step=12.0, layers=layers,
                  top=[dict(name="_gate_up_kernel", ms=3.5), dict(name="_down_kernel", ms=1.75)])
    runs = {}
    for name, count in (("uniform", None), ("counted", 29.0)):
        d = dict(decode, **({} if count is None else {"experts_per_layer": count}))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"hardware": "NVIDIA H200", "weight_GB": 57.15,
                                    "profile": dict(batch=64, context=4096, decode=d)}))
        monkeypatch.setattr(sys, "argv", ["estimate_b200.py", str(path), "--context", "4096"])
        estimate_b200.main()
        runs[name] = capsys.readouterr().out
    # memory: the weights as they lie once loaded (the head fp32, wo_a bf16: model/released.py memory_plan), 12.5 GB
    # replicated a GPU, not the 9.8 the files store
    replicated = float(re.search(r"\| replicated \([^)]*\) \| ([\d.]+) \|", runs["counted"]).group(1))
    assert replicated == round(memory_plan(estimate_b200.released_args(4096), Storage(), 4)["replicated"] / 1e9, 1)
    assert replicated > 12
    assert "against 242.9 of 384 in the profiled slice step (the uniform expectation" in runs["uniform"]
    assert "against 29.0 of 384 in the profiled slice step (counted; 3.250x)" in runs["counted"]
    step = lambda text: float(re.search(r"\*\*([\d.]+) ms\*\*", text).group(1))
    assert step(runs["counted"]) > 2 * step(runs["uniform"])
    # the same experts scaled by SMs instead of bandwidth: their share of the step grows by (8.0/4.8)/(148/132)
    issue = lambda text: re.search(r"the routed experts ([\d.]+) ms of a \*\*([\d.]+) ms\*\* step", text).groups()
    experts, total = map(float, issue(runs["counted"]))
    assert abs(experts - 40 * 0.75 * 3.250 * 132 / 148) < 0.05  # 40 layers x (5.25 ms / 7) x the count's scale
    assert abs(total - (step(runs["counted"]) + experts * (1 - 148 / 132 * 4.8 / 8.0))) < 0.1


def test_the_b200_estimate_scales_by_the_profiled_gpus_bandwidth_and_refuses_an_unknown_one(tmp_path, monkeypatch,
                                                                                             capsys):
    """The profile's hardware name picks the bandwidth the B200's is set against: the same kernel times from an
    H100 (3.35 TB/s) stand for a B200 step 3.35/4.8 of what they would from an H200 (4.8 TB/s), the exchange
    aside; a GPU it does not know is one sentence asking for --profiled-bw and --profiled-sms."""
    import json

    import estimate_b200

    layers = [dict(layer=i, ratio=r, engram_ms=0.0, attention_ms=0.3, rest_ms=1.0, total_ms=1.3)
              for i, r in enumerate((0, 0, 2, 2, 1, 1, 1))]
    decode = dict(device_ms=12.0, graph_ms_per_step=12.0, layers=layers, experts_per_layer=29.0,
                  top=[dict(name="_gate_up_kernel", ms=3.5), dict(name="_down_kernel", ms=1.75)])
    steps = {}
    for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"hardware": gpu, "weight_GB": 57.15,
                                    "profile": dict(batch=64, context=4096, decode=decode)}))
        monkeypatch.setattr(sys, "argv", ["estimate_b200.py", str(path), "--context", "4096"])
        try:
            estimate_b200.main()
        except SystemExit as e:
            steps[gpu] = str(e.code)
            continue
        out = capsys.readouterr().out
        steps[gpu] = float(re.search(r"\*\*([\d.]+) ms\*\*", out).group(1))
        assert f"Profiled on {gpu.removeprefix('NVIDIA ')}" in out
    exchange = 40 * (2 * 0.02 + 3 * 64 * 5120 * 6 / 900e9 * 1e3) + 2 * 2 * 0.02  # the EP exchange, not scaled
    assert abs((steps["NVIDIA H100 80GB HBM3"] - exchange) / (steps["NVIDIA H200"] - exchange) - 3.35 / 4.8) < 0.01
    assert "A100-SXM4-80GB" in steps["NVIDIA A100-SXM4-80GB"] and "--profiled-bw" in steps["NVIDIA A100-SXM4-80GB"]
