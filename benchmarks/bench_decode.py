"""Decode throughput of the engine beside the plain reference model and a floor estimate (issue #7).

For each batch size: B requests of a P-token prompt are prefilled, then decoded; the timed window is
`--steps` decode steps after `--warmup` decode steps (graph captures and compilation stay outside it),
all rows at one context bucket. Variants, measured side by side on one loaded model:
  before  the eager forward as it was (MoE one expert at a time; HC, RMSNorm, quantisation sims and sparse
          attention in torch ops), no graphs; only the sampler is the current one
  eager   the current kernels, no CUDA graphs
  graphs  the current kernels, decode steps replayed from CUDA graphs (the default)
  unfused graphs with the fused launches off (model/attention.py FUSED_LAUNCHES: issue #20 item 5's "before")
each with ZOS on (and, for `graphs`, ZOS off too). Device busy: the union of the steps' device spans
(CUDA events) over the window's wall time.

Reference: model/reference.py recomputes the whole sequence for every token (no KV state), so its
decode rate is one token per forward of P tokens, batch 1.

Floor: max(bytes moved / measured copy bandwidth, kernels launched / measured launch rate). Bytes: the
weights a decode step reads (every expert: the grouped MoE reads them all) plus each row's window rings
and the compressed entries and index keys it gathers; kernels: counted in one eager step with the
profiler. Both ceilings are measured in the same run (a large device-to-device copy; an empty kernel
replayed from a CUDA graph, and launched eagerly).

Usage: python benchmarks/bench_decode.py [--batches 1,8,64,256] [--prompt-len 300] [--device cuda]
Prints a table and markdown rows for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

import torch

import model.attention as attention
import model.hc as hc
from engine import LLM, SamplingParams
from engine.tracer import NullTracer
from model.moe import Gate, MoE
from model.reference import ReferenceModel
from tracing.workload import random_requests


class SpanTracer(NullTracer):
    """Keeps each step's kind, row count and device span (the only hooks the benchmark needs)."""

    def __init__(self):
        self.kinds, self.spans = {}, {}

    def schedule(self, batch):
        self.kinds[batch.step] = (batch.batch_kind, len(batch.rows))

    def device_span(self, step, start_ns, end_ns):
        self.spans[step] = (start_ns, end_ns)


def busy_fraction(spans: list[tuple[int, int]], t0: int, t1: int) -> float:
    """Union of device spans inside [t0, t1] over t1 - t0."""
    busy, reach = 0, t0
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, t1)
        if e > s:
            busy, reach = busy + e - s, e
    return busy / (t1 - t0)


def trace_busy(path, batch: int, skip: int = 4) -> tuple[float, int]:
    """ZOS read off a recorded trace alone: over the steady-state decode steps (every row decoding, the
    first and last `skip` left out), the union of their device spans over the time from the first one's
    start to the last one's end. Returns (busy fraction, steps)."""
    from tracing.reader import open_trace
    from tracing.schema import BATCH_KINDS

    full, spans = [], {}
    with open_trace(path) as trace:
        for e in trace.events():
            if e.kind == "schedule" and BATCH_KINDS[e.batch_kind] == "decode" and len(e.rows) == batch:
                full.append(e.step)
            elif e.kind == "device_span":
                spans[e.step] = (e.start, e.end)
    steps = [s for s in full[skip:len(full) - skip] if s in spans]
    window = [spans[s] for s in steps]
    t0, t1 = window[0][0], max(e for _, e in window)
    return busy_fraction(window, t0, t1), len(steps)


def traced_runs(a, directory: str) -> list[dict]:
    """Record decode runs with the Recorder (graphs, ZOS on and off) and measure the device lane from
    the trace files (issue #7 item 2)."""
    import os

    from tracing import Recorder
    rows = []
    for batch in map(int, a.trace_batches.split(",")):
        for zos in (True, False):
            path = os.path.join(directory, f"decode-b{batch}-zos-{'on' if zos else 'off'}.mdt")
            llm = LLM(a.model, device="cuda", max_num_seqs=batch, max_num_batched_tokens=8192, enable_zos=zos,
                      tracer=Recorder(path, argv=[]))
            for request in random_requests(random.Random(batch), batch, (a.prompt_len, a.prompt_len),
                                           (a.steps, a.steps), llm.engine.vocab_size, temperature=1.0):
                llm.engine.add_request(*request)
            start = time.perf_counter()
            while llm.engine.has_unfinished():
                llm.engine.step()
            elapsed = time.perf_counter() - start
            llm.engine.shutdown()
            busy, steps = trace_busy(path, batch)
            rows.append(dict(batch=batch, zos=zos, busy=busy, steps=steps, seconds=elapsed, trace=path))
            print(f"trace B={batch:4d} zos={'on ' if zos else 'off'}: device busy {busy:.1%} over {steps} steady "
                  f"decode steps (from {os.path.basename(path)}, {os.path.getsize(path) / 1024:.0f} KiB)", flush=True)
            del llm
    return rows


def set_variant(llm: LLM, name: str) -> None:
    before = name == "before"
    MoE.grouped = hc.USE_KERNEL = attention.USE_KERNELS = Gate.fused = not before
    attention.FUSED_LAUNCHES = name != "unfused"
    llm.engine.runner.use_cuda_graphs = name in ("graphs", "unfused")
    llm.engine.runner.graphs.clear()  # a graph replays the kernels it captured: each variant captures its own


def decode_run(llm: LLM, batch: int, prompt_len: int, warmup: int, steps: int, zos: bool, seed: int,
               probe=None) -> dict:
    """Time `steps` decode steps of `batch` rows; returns ms/step, tokens/s and device busy (and `probe`'s
    values: `timed_decode`)."""
    engine, tracer = llm.engine, llm.engine.tracer
    engine.enable_zos = zos
    for request in random_requests(random.Random(seed), batch, (prompt_len, prompt_len),
                                   (warmup + steps + 4, warmup + steps + 4), engine.vocab_size, temperature=1.0):
        engine.add_request(*request)
    first = engine.scheduler.step
    while True:  # prefill, then the warm-up decode steps
        engine.step()
        decoded = [s for s in range(first, engine.scheduler.step) if tracer.kinds.get(s, ("",))[0] == "decode"]
        if len(decoded) >= warmup:
            break
    torch.cuda.synchronize()
    return timed_decode(engine, batch, steps, probe)


def timed_decode(engine, batch: int, steps: int, probe=None) -> dict:
    """Time `steps` steps of the engine in its steady state, each a decode step of all `batch` rows (under ZOS
    after one untimed step, so that one is in flight at the window's start), then run it dry; returns
    ms/step, tokens/s and the device's busy fraction from the SpanTracer's spans, and with `probe(engine)`
    (run after the timed steps, on the same rows) what it returns."""
    tracer = engine.tracer
    if engine.enable_zos:  # refill the pipeline: a step in flight at t0 as at every later step, else (after a
        engine.step()      # synchronize) the window's first call returns at once and N calls hold N - 1 steps
    start_step, t0 = engine.scheduler.step, time.perf_counter_ns()
    for _ in range(steps):
        engine.step()
    t1 = time.perf_counter_ns()  # the host's end of the window; the device may still run its last steps
    timed = range(start_step, start_step + steps)
    assert all(tracer.kinds[s] == ("decode", batch) for s in timed), "a timed step was not a full decode step"
    probed = probe(engine) if probe else {}
    while engine.has_unfinished():
        engine.step()
    # every step's span is known once all are processed; the device may work on a step from before
    # the window (under ZOS it is still in flight at t0), so every span is clipped to [t0, t1]
    spans = list(tracer.spans.values())
    ms = (t1 - t0) / 1e6 / steps
    return {"ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "busy": busy_fraction(spans, t0, t1), **probed}


def routed_experts(engine) -> dict:
    """A probe for `timed_decode`: one more decode step of the same rows, eager (hooks do not run in a CUDA
    graph's replay), counting the distinct routed experts each layer's gate picks for the step's rows: what the
    routed experts' bytes floor takes at their uniform-routing expectation (bench_slice.py `decode_floor`).
    -> {"experts_per_layer": the mean over layers, "experts_expected": E·(1 - (1 - k/E)^rows), "rows_per_expert":
    each layer's rows an expert gets, most first (the FP4 experts' tiles: kernels/fp4_moe.py plan), "ids": each
    layer's ids [rows, k] (benchmarks/bench_fp4.py --ids replays them)}."""
    runner, picked = engine.runner, []
    layers = runner.model.weights.layers
    hooks = [block.ffn.gate.register_forward_hook(lambda module, args, out: picked.append(out[1].tolist()))
             for block in layers]
    graphs, runner.use_cuda_graphs = runner.use_cuda_graphs, False
    try:
        step = engine.scheduler.step
        engine.step()
        rows = engine.tracer.kinds[step][1]
        if engine.in_flight is not None:  # ZOS: the step's forward ran at its execute, its result waits
            engine.process(engine.in_flight)
            engine.in_flight = None
    finally:
        runner.use_cuda_graphs = graphs
        for h in hooks:
            h.remove()
    a = runner.model.args
    E, k = a.n_routed_experts, a.n_activated_experts
    counts = [sorted(Counter(e for row in ids for e in row).values(), reverse=True) for ids in picked]
    return {"experts_per_layer": sum(map(len, counts)) / len(counts), "experts_expected": E * (1 - (1 - k / E) ** rows),
            "rows_per_expert": counts, "ids": picked}


def count_kernels(llm: LLM, batch: int, prompt_len: int, top: int = 0, fused: bool = True) -> int:
    """CUDA kernels of one eager decode step (current kernels; `fused` False: the fused launches off), counted
    by the profiler; with `top`, print the kernels that take the most device time."""
    from torch.profiler import ProfilerActivity, profile
    set_variant(llm, "eager")
    attention.FUSED_LAUNCHES = fused
    engine, tracer = llm.engine, llm.engine.tracer
    engine.enable_zos = False
    for i in range(batch):
        engine.add_request(list(range(3, 3 + prompt_len)), SamplingParams(temperature=1.0, seed=i, max_tokens=8,
                                                                          ignore_eos=True))
    while tracer.kinds.get(engine.scheduler.step - 1, ("",))[0] != "decode":
        engine.step()  # the prefill steps and one decode step (warm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    if top:
        total = sum(e.self_device_time_total for e in events)
        print(f"B={batch}: {sum(e.count for e in events)} kernels, {total / 1e3:.3f} ms of device time; top {top}:")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:110]}")
    return sum(e.count for e in events)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per second) and the cost of one small kernel, eager and in a graph."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        y.copy_(x)
    b.record()
    b.synchronize()
    bandwidth = 2 * x.numel() * 20 / (a.elapsed_time(b) / 1e3)
    del x, y
    t = torch.zeros(1, device="cuda")
    n = 2000
    for _ in range(10):
        t.add_(1)
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n):
        t.add_(1)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - s) / n * 1e6
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            for _ in range(n):
                t.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return {"copy_GBps": bandwidth / 1e9, "launch_us_eager": eager_us, "launch_us_graph": a.elapsed_time(b) * 1e3 / n}


def step_bytes(llm: LLM, batch: int, context: int) -> float:
    """Bytes a decode step must move at least: every weight except the embedding table and the Engram
    tables (only looked-up rows), the head read once; per row its window rings, the compressed entries
    and index keys of its kv sources (one pass), its looked-up embedding and Engram rows."""
    w = llm.engine.runner.model.weights
    a = w.args
    weights = sum(p.numel() * p.element_size() for n, p in w.named_parameters()
                  if not n.startswith("embed.") and ".engram.embed." not in n)
    ring = a.n_layers * a.window_size * a.head_dim * 2
    entries = sum(context // a.compress_ratios[s] * (a.head_dim + a.index_head_dim) * 2 for s in a.kv_source_layers)
    per_row = ring + entries + a.dim * 2 + len(a.engram_layer_ids) * a.n_hash_cols * a.engram_head_dim * 2
    return weights + batch * per_row


def reference_tokens_per_s(llm: LLM, prompt_len: int, repeats: int = 3) -> float:
    """The plain reference model: one token per forward over the whole sequence (batch 1)."""
    ref = ReferenceModel(llm.engine.runner.model.weights)
    tokens = list(range(3, 3 + prompt_len))
    ref.forward(tokens)
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(repeats):
        ref.forward(tokens)
    torch.cuda.synchronize()
    return repeats / (time.perf_counter() - s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-68m")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--before-steps", type=int, default=6)
    p.add_argument("--variants", default="before,eager,graphs")
    p.add_argument("--profile-top", type=int, default=0, help="print the N kernels with the most device time")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--traces", default=None, help="also record Recorder traces here and read ZOS off them")
    p.add_argument("--trace-batches", default="64,256")
    a = p.parse_args()
    if a.traces:
        traced = traced_runs(a, a.traces)
    ceilings = measure_ceilings()
    print(json.dumps(ceilings))
    results = []
    for batch in map(int, a.batches.split(",")):
        llm = LLM(a.model, device="cuda", max_num_seqs=batch, max_num_batched_tokens=8192,
                  tracer=SpanTracer())
        kernels = count_kernels(llm, batch, a.prompt_len, a.profile_top)
        unfused = count_kernels(llm, batch, a.prompt_len, fused=False) if "unfused" in a.variants else kernels
        context = a.prompt_len + a.warmup + a.steps
        floor_ms = max(step_bytes(llm, batch, context) / (ceilings["copy_GBps"] * 1e9) * 1e3,
                       kernels * ceilings["launch_us_graph"] / 1e3)  # the current kernels' floor
        ref = reference_tokens_per_s(llm, a.prompt_len) if batch == 1 else None
        for variant in a.variants.split(","):
            # each variant on an engine of its own: on one engine the variant run second took up to 2.6 ms more
            # host time a step at batch 256, whichever it was (H200, both orders)
            llm.engine.shutdown()
            del llm
            torch.cuda.empty_cache()
            llm = LLM(a.model, device="cuda", max_num_seqs=batch, max_num_batched_tokens=8192, tracer=SpanTracer())
            set_variant(llm, variant)
            for zos in ((True, False) if variant == "graphs" else (True,)):
                steps = a.before_steps if variant == "before" else a.steps
                r = decode_run(llm, batch, a.prompt_len, a.warmup, steps, zos, seed=len(results))
                r.update(batch=batch, variant=variant, zos=zos, kernels=unfused if variant == "unfused" else kernels,
                         floor_ms=floor_ms,
                         reference_tokens_per_s=ref, steps=steps)
                results.append(r)
                print(f"B={batch:4d} {variant:7s} zos={'on ' if zos else 'off'}: {r['ms_per_step']:8.3f} ms/step "
                      f"{r['tokens_per_s']:10,.0f} tok/s  busy {r['busy']:.3f}  floor {floor_ms:.3f} ms "
                      f"({r['ms_per_step'] / floor_ms:.1f}x)  kernels/step {r['kernels']}"
                      + (f"  reference {ref:.1f} tok/s" if ref else ""), flush=True)
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    hw = torch.cuda.get_device_name()
    print("\n| hardware | batch | variant | ZOS | kernels | ms/step | tokens/s | device busy | floor ms | x floor |")
    for r in results:
        print(f"| {hw} | {r['batch']} | {r['variant']} | {'on' if r['zos'] else 'off'} | {r['kernels']} | "
              f"{r['ms_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {r['busy']:.1%} | {r['floor_ms']:.3f} | "
              f"{r['ms_per_step'] / r['floor_ms']:.1f} |")
    if a.traces:
        print("\n| hardware | batch | ZOS | device busy (from the trace) | steady decode steps |")
        for r in traced:
            print(f"| {hw} | {r['batch']} | {'on' if r['zos'] else 'off'} | {r['busy']:.1%} | {r['steps']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ceilings": ceilings, "results": results, "hardware": hw, "args": vars(a),
                       "traced": traced if a.traces else None}, f, indent=1)


if __name__ == "__main__":
    main()
