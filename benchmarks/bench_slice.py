"""The full-width slice on one GPU (issue #20 items 1 and 2): load time, weight memory, decode ms/step by
batch and context, prefill tokens/s; any preset or folder (`--model tiny-68m` gives the same rows for it).

One model load (timed: for v41-slice the weights are drawn and quantised on the GPU and hashed, model/slice.py),
then one engine with enough KV blocks for the largest batch x context. Decode: bench_decode.py's
`decode_run` (B requests of a C-token prompt prefilled, `--warmup` decode steps, which capture the CUDA
graph, then `--steps` timed decode steps at temperature 1, ZOS on), graphs and, at batch 1, eager beside
them. A (batch, context) whose prompts would need more than `--max-prefill-tokens` tokens of prefill is
skipped and said so (the masked FP4 MoE made the slice's prefill slow; since issue #20 item 3 the grouped
FP4 kernels run it, kernels/fp4_moe.py). With `--rows clones` the B rows are one prompt of C tokens prefilled
(its rate printed: the prefill tokens/s at C) and B - 1 clones of it (benchmarks/clone.py: each its own blocks
and slot, copied), so 64 rows at 128k cost one prefill of 128k; graphs only, nothing skipped, and the profile
too is over clones. `--rows prefilled,clones` runs both, side by side where the prefilled rows fit. Every
decode run also counts the routed experts each layer's gate picked in one more (eager) step of its rows, beside
the uniform-routing expectation the bytes floor takes, and the FP4 experts' tiles its rows an expert make
(bench_decode.py `routed_experts`; `--json` keeps each layer's ids for bench_fp4.py --decode-rows --ids).
`--decode-tile` and `--head-fp32` run the step with another FP4 decode tile or the head's fp32 form, for side by
side runs.
Prefill: bench_prefill.py's `prefill_run` (N prompts of L tokens to their first token), after one untimed run,
against its FLOP floor (`prefill_floor`: the matrix FLOPs a token costs) at the bf16 GEMM rate measured in the
same run (bench_prefill.py `matmul_tflops`; the kernels multiply FP8 and FP4 values decoded to bf16).
Profile (`--profile BxC`, issue #20 items 3 and 4): one eager decode step of B rows at context C and one
prefill step of `--max-batched-tokens` tokens of one prompt from position 0, under torch.profiler: each layer's
device time (its Engram block, attention and the rest: the hyper-connections and MoE), the kernels with the
most device time, with their share of the step, the launches by the module that made them (issue #20 item 5),
and the kernels' launch shapes (programs a launch, threads, registers, estimated occupancy: kineto's record of
each kernel in the profile's Chrome trace); then the decode step's bytes floor (`decode_floor`) and the graph
step against it. The prefill step's `--max-batched-tokens` must fit the model's length (at tiny-68m, --contexts
1100 with --max-batched-tokens 1024).
`max_seq_len` is raised on the loaded weights when a context needs it (no numeric effect, spec §8).

Usage: python benchmarks/bench_slice.py [--model v41-slice] [--batches 1,16] [--contexts 1024]
                                        [--prefill 1x4096] [--profile 64x4096] [--rows prefilled,clones] [--json OUT]
                                        [--decode-tile BM,BN,U,WARPS] [--head-fp32]
Prints a line per measurement and markdown rows for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from types import SimpleNamespace

import torch

from bench_decode import SpanTracer, decode_run, measure_ceilings, routed_experts
from bench_prefill import matmul_tflops, prefill_run
from clone import clone_prefilled, cloned_decode_run
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from model.config import BLOCK_SIZE, cdiv
from model.load import load_model

GB = 1e9


def load(model: str, max_len: int) -> tuple[object, str, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    weights, digest = load_model(model, "cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if weights.args.max_seq_len < max_len:
        weights.args.max_seq_len = max_len
        weights._rope.clear()  # rebuilt at the new length by the runner's warm-up
    return weights, digest, seconds


def decode_floor(weights, batch: int, context: int) -> dict:
    """The bytes a decode step of `batch` rows at `context` must read at least (issue #20 item 3), by part, in
    GB: every weight but the embedding and Engram tables and the routed experts (`dense`, `head`); the routed
    experts the step's batch x k picks touch, expected under uniform routing (E·(1 - (1 - k/E)^batch) of a
    layer's E: 243.8 of 384 at 64 x 6); per row: every layer's window ring (`window`), the index keys each index
    source scores (all entries of its kv source: `index_keys`), the compressed entries sparse attention reads
    (min(top-k, entries) a layer that has them: `entries`), its embedding and Engram rows (`rows`). Each read
    once, nothing written: what the kernels move beyond it is above it. Everything counts at the bytes its values
    need, where memory holds it wider: a weight as the released checkpoint stores it (the head and ratio-2
    compressor bf16, fp32 in memory; wo_a FP8 with a scale a 32x32 tile, bf16 in memory), a cache entry in its
    deployed format (spec §2.5: a window entry FP8 with a ue8m0 scale a 32, a compressed entry FP4 with an e4m3
    scale a 16, an index key FP4 with a ue8m0 scale a 32: 528, 288 and 68 bytes; model/paged.py holds their bf16
    values)."""
    from model.released import BF16_IN_FILE, DENSE_AT_LOAD

    a = weights.args
    parts = dict(dense=0.0, head=0.0, routed=0.0)
    for name, t in [*weights.named_parameters(), *weights.named_buffers()]:
        size, module = t.numel() * t.element_size(), name.rpartition(".")[0]
        if name.startswith("embed.") or ".engram.embed." in name:
            continue
        if t.dtype == torch.float32 and BF16_IN_FILE.fullmatch(module):
            size = t.numel() * 2
        elif DENSE_AT_LOAD.fullmatch(module) and t.dtype == torch.bfloat16:
            size = t.numel() * (1 + 1 / 1024)
        parts["routed" if ".ffn.experts." in name else "head" if name.startswith("head.") else "dense"] += size
    E, k = a.n_routed_experts, a.n_activated_experts
    parts["routed"] *= 1 - (1 - k / E) ** batch
    elt = weights.embed.weight.element_size()  # the embedding's dtype
    ratio = a.compress_ratios
    window = a.n_layers * a.window_size * a.head_dim * (1 + 1 / 32)
    index_keys = sum(context // ratio[a.kv_source_of(s)] * a.index_head_dim * (1 / 2 + 1 / 32)
                     for s in range(a.n_layers) if a.is_index_source(s))
    entries = sum(min(a.index_topk, context // r) * a.head_dim * (1 / 2 + 1 / 16) for r in ratio if r)
    rows = a.dim * elt + sum(a.n_hash_cols * t.size(1) * t.element_size()  # each Engram layer's table (and scales)
                             for n, t in weights.named_parameters() if ".engram.embed." in n and t.dim() == 2)
    parts.update(window=batch * window, index_keys=batch * index_keys, entries=batch * entries, rows=batch * rows)
    parts = {name: b / GB for name, b in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def prefill_floor(weights, length: int) -> dict:
    """The matrix FLOPs a token of a prompt of `length` tokens costs in prefill, on average over its positions
    (issue #20 item 3), by part, in GFLOP: 2 x every weight a token multiplies (`dense`: all but the embedding,
    Engram tables, head and routed experts; `routed`: k of E experts), sparse attention's QK and PV over the
    window and the compressed entries it selects (min(top-k, p / ratio) at position p: `attention`), each index
    source's scores over the entries of its kv source (p / ratio: `index`). The head runs on a prompt's last
    token only (left out). Over a peak rate this is the step's FLOP floor."""
    a = weights.args
    parts = dict(dense=0.0, routed=0.0)
    for name, t in weights.named_parameters():
        if t.dim() < 2 or name.startswith(("embed.", "head.")) or ".engram.embed." in name or name.endswith(".scale"):
            continue  # the scales multiply tiles, not values
        numel = t.numel() * (2 if t.dtype == torch.float4_e2m1fn_x2 else 1)  # two FP4 values a byte
        parts["routed" if ".ffn.experts." in name else "dense"] += 2 * numel
    parts["routed"] *= a.n_activated_experts / a.n_routed_experts
    positions = torch.arange(length, dtype=torch.float64)
    seen = lambda r: (positions / r).floor().clamp(min=0)  # compressed entries visible at each position
    per_head = 4 * a.head_dim * a.n_heads  # QK and PV of one key row for all heads
    parts["attention"] = sum(per_head * (min(a.window_size, length) + (seen(r).clamp(max=a.index_topk).mean().item()
                                                                       if r else 0)) for r in a.compress_ratios)
    parts["index"] = sum(2 * a.index_n_heads * a.index_head_dim * seen(a.compress_ratios[a.kv_source_of(s)]).mean().item()
                         for s in range(a.n_layers) if a.is_index_source(s))
    parts = {name: f / 1e9 for name, f in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def profiled(engine: LLMEngine, top: int) -> dict:
    """One engine step under torch.profiler: device ms by layer part and the `top` kernels by device time.
    Ranges: "layer L" around each block, "layer L engram" around its Engram block, "layer L attention" around
    its attention sublayer; a kernel counts in the innermost range its launch was in, so a layer's "rest" is
    what it launched outside the other two (hyper-connections, norms, MoE). Every submodule gets a range too
    ("module layers.*.attn.indexer", its layer index starred): the launches by module (issue #20 item 5)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = engine.runner.model
    hooks, attend = [], model.attend

    def ranged(name, module):
        def enter(*_):
            module._ranges = getattr(module, "_ranges", []) + [record_function(name)]
            module._ranges[-1].__enter__()

        def leave(*_):
            module._ranges.pop().__exit__(None, None, None)
        hooks.extend([module.register_forward_pre_hook(enter), module.register_forward_hook(leave)])

    for block in model.weights.layers:
        ranged(f"layer {block.layer}", block)
        if block.engram is not None:
            ranged(f"layer {block.layer} engram", block.engram)
    for qualname, module in model.weights.named_modules():
        if not isinstance(module, torch.nn.ModuleList):
            ranged("module " + (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", qualname) or type(module).__name__), module)

    def attend_ranged(block, *args):
        with record_function(f"layer {block.layer} attention"):
            return attend(block, *args)
    model.attend = attend_ranged
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
    finally:
        del model.attend
        for h in hooks:
            h.remove()
        for module in model.weights.modules():
            module.__dict__.pop("_ranges", None)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith(("layer ", "module "))]  # the ranges' own device spans are not kernels
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    # each kernel to the innermost range open when its launch call (the runtime or driver API event with the same
    # correlation id) ran; Triton's driver launches are linked to no torch op, so time on the CPU is the link
    raw = prof.profiler.kineto_results.events()
    ranges = sorted((e.start_ns(), e.end_ns(), e.name()) for e in raw
                    if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith(("layer ", "module ")))
    spans = [r for r in ranges if r[2].startswith("layer ")]
    modules = [r for r in ranges if r[2].startswith("module ")]
    launched = {e.correlation_id(): e.start_ns() for e in raw if e.device_type() == torch.autograd.DeviceType.CPU
                and not e.is_user_annotation() and e.name().startswith("cu")}
    parts, sources = {}, {}
    for e in raw:
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.is_user_annotation():
            continue
        t, ms = launched.get(e.correlation_id()), e.duration_ns() / 1e6
        key = "untraced" if t is None else next((n for a, b, n in reversed(spans) if a <= t <= b), "outside")
        parts[key] = parts.get(key, 0.0) + ms
        source = "(no launch call traced)" if t is None else next(
            (n[len("module "):] for a, b, n in reversed(modules) if a <= t <= b), "(outside the model's modules)")
        c = sources.setdefault(source, [0, 0.0, {}])
        c[0], c[1] = c[0] + 1, c[1] + ms
        c[2][e.name()] = c[2].get(e.name(), 0) + 1
    layers = []
    for block in model.weights.layers:
        name = f"layer {block.layer}"
        engram, att, rest = (parts.get(f"{name} engram", 0.0), parts.get(f"{name} attention", 0.0),
                             parts.get(name, 0.0))
        layers.append(dict(layer=block.layer, ratio=block.attn.ratio, engram_ms=engram, attention_ms=att,
                           rest_ms=rest, total_ms=engram + att + rest))
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)
    every = [dict(name=e.key, count=e.count, ms=e.self_device_time_total / 1e3,
                  share=e.self_device_time_total / 1e3 / total) for e in ranked]
    return dict(device_ms=total, kernels=sum(e.count for e in kernels), layers=layers, top=every[:top], every=every,
                outside_ms=parts.get("outside", 0.0), untraced_ms=parts.get("untraced", 0.0),
                sources=[dict(source=k, launches=n, ms=ms, kernels=sorted(by.items(), key=lambda kv: -kv[1]))
                         for k, (n, ms, by) in sorted(sources.items(), key=lambda kv: -kv[1][0])],
                shapes=launch_shapes(chrome_events(prof)))


def chrome_events(prof) -> list[dict]:
    """The profile's Chrome trace events (the export kineto writes: a kernel's grid, block, registers and
    CUPTI's occupancy estimate are in its args); [] where the export cannot be read back."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                return json.load(f).get("traceEvents", [])
        except (OSError, ValueError, AttributeError) as e:
            print(f"(no launch shapes: the profile's Chrome trace did not read back: {e})")
            return []


def launch_shapes(events: list[dict]) -> list[dict]:
    """Per kernel, from Chrome trace kernel events: launches, device ms, µs a launch, the programs of a launch
    (its grid's size) and threads of a program, registers a thread and the mean estimated occupancy, the most
    device time first. A kernel of fewer programs than the device has SMs (132 on the H200) runs one short
    wave: its time is latency, not bandwidth or FLOPs."""
    import math

    by = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        args = ev.get("args") or {}
        k = by.setdefault(ev.get("name", "?"), dict(launches=0, ms=0.0, programs=set(), threads=set(),
                                                     registers=set(), occupancy=[]))
        k["launches"] += 1
        k["ms"] += float(ev.get("dur", 0)) / 1e3
        for key, field in (("grid", "programs"), ("block", "threads")):
            if isinstance(args.get(key), list) and args[key]:
                k[field].add(math.prod(args[key]))
        if "registers per thread" in args:
            k["registers"].add(args["registers per thread"])
        if isinstance(args.get("est. achieved occupancy %"), (int, float)):
            k["occupancy"].append(args["est. achieved occupancy %"])
    rows = [dict(name=name, launches=k["launches"], ms=k["ms"], us=1e3 * k["ms"] / k["launches"],
                 programs=sorted(k["programs"]), threads=sorted(k["threads"]), registers=sorted(k["registers"]),
                 occupancy=sum(k["occupancy"]) / len(k["occupancy"]) if k["occupancy"] else None)
            for name, k in by.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def spread(values: list) -> str:
    """[4, 64] -> "4-64", [64] -> "64", [] -> "-"."""
    return "-" if not values else str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def short(kernel: str) -> str:
    """A kernel's name without its template arguments: `void at::native::index_elementwise_kernel<...>` ->
    index_elementwise_kernel; cuBLAS's by their first word."""
    name = re.sub(r"<.*$|\(.*$", "", kernel.removeprefix("void ")).split("::")[-1]
    return name[:40]


def print_profile(title: str, r: dict) -> None:
    print(f"\n{title}: {r['kernels']} kernels, {r['device_ms']:.3f} ms of device time ({r['outside_ms']:.3f} ms "
          f"launched outside the layers, {r['untraced_ms']:.3f} ms not traced to a launch)")
    print("| layer | ratio | Engram ms | attention ms | rest ms (HC, norms, MoE) | layer ms | share |")
    for x in r["layers"]:
        print(f"| {x['layer']} | {x['ratio']} | {x['engram_ms']:.3f} | {x['attention_ms']:.3f} | {x['rest_ms']:.3f} | "
              f"{x['total_ms']:.3f} | {x['total_ms'] / max(r['device_ms'], 1e-9):.1%} |")
    print("| kernel | launches | ms | share |")
    for k in r["top"]:
        print(f"| {k['name'][:90]} | {k['count']} | {k['ms']:.3f} | {k['share']:.1%} |")
    counted = sum(x["launches"] for x in r["sources"])
    print(f"| launched in (innermost module) | launches ({counted} of {r['kernels']}) | ms | kernels |")
    for x in r["sources"]:
        names = ", ".join(f"{short(k)} {n}" for k, n in x["kernels"][:6])
        print(f"| {x['source'][:60]} | {x['launches']} | {x['ms']:.3f} | {names} |")
    if r.get("shapes"):
        print("| kernel | launches | ms | µs a launch | programs a launch | threads a program | registers | "
              "est. occupancy |")
        for k in r["shapes"][:15]:
            occupancy = "-" if k["occupancy"] is None else f"{k['occupancy']:.0f}%"
            print(f"| {short(k['name'])} | {k['launches']} | {k['ms']:.3f} | {k['us']:.1f} | {spread(k['programs'])} | "
                  f"{spread(k['threads'])} | {spread(k['registers'])} | {occupancy} |")


def profile_run(engine: LLMEngine, batch: int, context: int, top: int, timed: int, clones: bool = False) -> dict:
    """Profile one eager decode step of `batch` rows at `context`, count the routed experts of one more
    (bench_decode.py `routed_experts`), then time `timed` decode steps of the same rows with CUDA graphs and ZOS
    on (after 2 steps of capture), then profile one full prefill step from 0. `clones`:
    the rows are one prompt prefilled and batch - 1 clones of it (benchmarks/clone.py)."""
    from engine.sequence import SamplingParams

    engine.runner.use_cuda_graphs, zos, engine.enable_zos = False, engine.enable_zos, False
    ids = [engine.add_request([3 + (i * 7 + j) % 1000 for j in range(context)],
                              SamplingParams(temperature=1.0, seed=i, max_tokens=5 + 3 + timed, ignore_eos=True))
           for i in range(1 if clones else batch)]
    if clones:
        source = ids[0]
        while engine.scheduler.seqs[source].num_output_tokens == 0:
            engine.step()
        clone_prefilled(engine, source, list(range(1, batch)))
    while engine.tracer.kinds.get(engine.scheduler.step - 1) != ("decode", batch):
        engine.step()  # every prompt's prefill, then the first decode step of all rows
    engine.step()  # one more decode step of all rows (warm)
    decode = profiled(engine, top)
    assert engine.tracer.kinds[engine.scheduler.step - 1] == ("decode", batch), "the profiled step was not a decode"
    decode.update(routed_experts(engine))  # the experts the same rows route to, one more eager step
    engine.runner.use_cuda_graphs, engine.enable_zos = True, zos
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    if zos:
        engine.step()  # one in flight at the start, as in bench_decode.timed_decode
    start = time.perf_counter()
    for _ in range(timed):
        engine.step()
    torch.cuda.synchronize()
    decode["graph_ms_per_step"] = (time.perf_counter() - start) / timed * 1e3
    while engine.has_unfinished():
        engine.step()
    engine.runner.use_cuda_graphs, engine.enable_zos = False, False
    tokens = engine.scheduler.config.max_num_batched_tokens
    engine.add_request([3 + j % 1000 for j in range(tokens)], SamplingParams(temperature=1.0, max_tokens=1))
    prefill = profiled(engine, top)
    assert engine.tracer.kinds[engine.scheduler.step - 1] == ("prefill", 1), "the profiled step was not a prefill"
    while engine.has_unfinished():
        engine.step()
    engine.runner.use_cuda_graphs, engine.enable_zos = True, zos
    return dict(batch=batch, context=context, decode=decode, prefill_tokens=tokens, prefill=prefill)


def experts(r: dict) -> str:
    """A decode run's routed experts a layer (bench_decode.py `routed_experts`) against the uniform expectation."""
    counts = r.get("rows_per_expert", [])
    tiles = {bm: sum(-(-c // bm) for layer in counts for c in layer) / max(1, len(counts)) for bm in (16, 32)}
    return (f"{r['experts_per_layer']:.1f} experts a layer, {r['experts_expected']:.1f} expected; FP4 tiles a layer "
            f"at 16 rows {tiles[16]:.1f}, at 32 {tiles[32]:.1f}; most rows an expert "
            f"{max((layer[0] for layer in counts if layer), default=0)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="v41-slice")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="1024", help="prompt lengths of the decode runs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill", default="1x4096", help="NxL prefill shapes, comma separated ('' for none)")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-prefill-tokens", type=int, default=1 << 17)
    p.add_argument("--profile", default="", help="BxC: profile a decode step of B rows at context C, and a prefill step")
    p.add_argument("--profile-top", type=int, default=25, help="kernels listed in each profile")
    p.add_argument("--rows", default="prefilled",
                   help="how decode rows get their context: prefilled, clones (benchmarks/clone.py) or both "
                        "(comma separated)")
    p.add_argument("--json", default=None)
    p.add_argument("--decode-tile", default=None, metavar="BM,BN,U,WARPS",
                   help="the FP4 experts' decode tile (kernels/fp4_moe.py DECODE_TILE) for this run")
    p.add_argument("--head-fp32", action="store_true",
                   help="the head kernel reads the fp32 weight even where its values are bf16 (kernels/head.py "
                        "USE_BF16_COPY off: the form before the bf16 copy, for a side-by-side run)")
    a = p.parse_args()
    if a.head_fp32:
        from kernels import head as head_kernel
        head_kernel.USE_BF16_COPY = False
    if a.decode_tile:
        from bench_fp4 import tile_spec
        from kernels import fp4_moe
        try:
            fp4_moe.DECODE_TILE.update(tile_spec(a.decode_tile))
        except ValueError:
            p.error(f"--decode-tile takes four integers BM,BN,U,WARPS, not {a.decode_tile!r}")
    rows_modes = set(a.rows.split(","))
    if not rows_modes or rows_modes - {"prefilled", "clones"}:
        p.error(f"--rows takes prefilled, clones or both, not {a.rows!r}")
    profile_shape = tuple(map(int, a.profile.split("x"))) if a.profile else None
    batches, contexts = [int(b) for b in a.batches.split(",")], [int(c) for c in a.contexts.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in a.prefill.split(",") if s]
    margin = a.warmup + a.steps + 8
    max_len = max(contexts + [length for _, length in shapes] + [profile_shape[1] if profile_shape else 0]) + margin
    ceilings = measure_ceilings()
    hw = torch.cuda.get_device_name()
    weights, digest, load_s = load(a.model, max_len)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.parameters())
    print(f"{a.model}: loaded in {load_s:.1f} s, digest {digest}, weights {weight_bytes / GB:.2f} GB, "
          f"allocated {torch.cuda.memory_allocated() / GB:.2f} GB; copy {ceilings['copy_GBps']:.0f} GB/s", flush=True)
    rows = max(batches + [n for n, _ in shapes] + [profile_shape[0] if profile_shape else 0])
    blocks = rows * cdiv(max_len, BLOCK_SIZE)
    tracer = SpanTracer()
    engine = LLMEngine(weights, SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=a.max_batched_tokens,
                                                num_kv_blocks=blocks, num_state_slots=rows),
                       tracer=tracer, checkpoint_digest=digest, model_source=a.model)
    llm = SimpleNamespace(engine=engine)
    results = []
    for context in contexts:
        for batch in batches:
            if "clones" in rows_modes and not (batch == 1 and "prefilled" in rows_modes):  # 1 row: no clone
                engine.runner.use_cuda_graphs, start = True, time.perf_counter()
                r = cloned_decode_run(engine, batch, context, a.warmup, a.steps, seed=len(results) + 1,
                                      probe=routed_experts)
                r.update(batch=batch, context=context, variant="graphs, clones", wall_s=time.perf_counter() - start,
                         peak_GB=torch.cuda.max_memory_allocated() / GB)
                results.append(r)
                print(f"B={batch:3d} context {context:6d} clones: {r['ms_per_step']:9.2f} ms/step "
                      f"{r['tokens_per_s']:9.1f} tok/s  busy {r['busy']:.3f}  peak {r['peak_GB']:.1f} GB  (one prompt "
                      f"prefilled at {r['prefill_tokens_per_s']:,.0f} tok/s; run {r['wall_s']:.0f} s; {experts(r)})",
                      flush=True)
            if "prefilled" not in rows_modes:
                continue
            if batch * context > a.max_prefill_tokens:
                print(f"B={batch} context {context}: prefilled rows skipped ({batch * context:,} prompt tokens > "
                      f"--max-prefill-tokens {a.max_prefill_tokens:,})", flush=True)
                continue
            for variant in ("graphs", "eager") if batch == 1 else ("graphs",):
                engine.runner.use_cuda_graphs = variant == "graphs"
                start = time.perf_counter()
                r = decode_run(llm, batch, context, a.warmup, a.steps, True, seed=len(results), probe=routed_experts)
                r.update(batch=batch, context=context, variant=variant, wall_s=time.perf_counter() - start,
                         peak_GB=torch.cuda.max_memory_allocated() / GB)
                results.append(r)
                print(f"B={batch:3d} context {context:6d} {variant:6s}: {r['ms_per_step']:9.2f} ms/step "
                      f"{r['tokens_per_s']:9.1f} tok/s  busy {r['busy']:.3f}  peak {r['peak_GB']:.1f} GB  "
                      f"(run {r['wall_s']:.0f} s with its prefill; {experts(r)})", flush=True)
    engine.runner.use_cuda_graphs = True
    prefills = []
    bf16_tflops = matmul_tflops() if shapes else None
    for n, length in shapes:
        # warm-up: allocator, library handles, and every kernel form the timed steps take (a prefill chunk's forms
        # start at 1,024 and 4,096 tokens: kernels/fp8_gemm.py DEQUANT_ROWS, kernels/hc.py CHUNK_ROWS), compiled here
        prefill_run(engine, 1, min(length, a.max_batched_tokens), seed=7)
        seconds, steps = prefill_run(engine, n, length, seed=8)
        floor = prefill_floor(weights, length)
        achieved = n * length * floor["total"] * 1e9 / seconds / 1e12
        prefills.append(dict(prompts=n, length=length, seconds=seconds, steps=steps, tokens_per_s=n * length / seconds,
                             floor_GFLOP_per_token=floor, TFLOPs=achieved))
        print(f"prefill {n}x{length}: {seconds:.2f} s in {steps} steps, {n * length / seconds:,.0f} tok/s; "
              f"{floor['total']:.2f} GFLOP a token (" + ", ".join(f"{k} {v:.3f}" for k, v in floor.items() if k != "total")
              + f"): {achieved:.0f} TFLOP/s, {bf16_tflops / achieved:.2f}x the floor at the bf16 GEMM rate "
              f"({bf16_tflops:.0f} TFLOP/s, cuBLAS 8192^3 measured now)", flush=True)
    profile = profile_run(engine, *profile_shape, a.profile_top, a.steps, clones=a.rows == "clones") \
        if profile_shape else None
    if profile:
        floor = decode_floor(weights, profile["batch"], profile["context"])
        floor_ms = floor["total"] * GB / (ceilings["copy_GBps"] * 1e9) * 1e3
        profile["decode"]["floor_GB"], profile["decode"]["floor_ms"] = floor, floor_ms
        print_profile(f"decode step, batch {profile['batch']}, context {profile['context']} (CUDA graphs: "
                      f"{profile['decode']['graph_ms_per_step']:.2f} ms/step)", profile["decode"])
        print(f"bytes floor of that decode step: {floor['total']:.2f} GB (" + ", ".join(
            f"{name} {gb:.3f}" for name, gb in floor.items() if name != "total") + f"), {floor_ms:.2f} ms at the "
              f"copy rate: the graph step is {profile['decode']['graph_ms_per_step'] / floor_ms:.2f}x it")
        print_profile(f"prefill step of {profile['prefill_tokens']} tokens from position 0", profile["prefill"])
    engine.shutdown()
    print("\n| hardware | checkpoint | batch | context | variant | ms/step | tokens/s | device busy | peak GB | "
          "experts a layer (expected) |")
    for r in results:
        print(f"| {hw} | {a.model} | {r['batch']} | {r['context']} | {r['variant']} | {r['ms_per_step']:.2f} | "
              f"{r['tokens_per_s']:,.1f} | {r['busy']:.1%} | {r['peak_GB']:.1f} | {r['experts_per_layer']:.1f} "
              f"({r['experts_expected']:.1f}) |")
    for r in prefills:
        print(f"| {hw} | {a.model} | prefill {r['prompts']}x{r['length']} | {r['seconds']:.2f} s | "
              f"{r['tokens_per_s']:,.0f} tok/s | {r['TFLOPs']:.0f} TFLOP/s | {bf16_tflops / r['TFLOPs']:.2f}x floor |")
    for r in results:
        if "prefill_s" in r:  # a clone run's one prompt
            print(f"| {hw} | {a.model} | prefill 1x{r['context']} (the clones' source) | {r['prefill_s']:.2f} s | "
                  f"{r['prefill_tokens_per_s']:,.0f} tok/s |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "model": a.model, "digest": digest, "load_s": load_s,
                       "weight_GB": weight_bytes / GB, "ceilings": ceilings, "decode": results,
                       "prefill": prefills, "profile": profile, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
