"""The full-width slice on one GPU (issue #20 items 1 and 2): load time, weight memory, decode ms/step by
batch and context, prefill tokens/s; any preset or folder (`--model tiny-68m` gives the same rows for it).

One model load (timed: for v41-slice the weights are drawn and quantised on the GPU and hashed, model/slice.py),
then one engine with enough KV blocks for the largest batch x context. Decode: bench_decode.py's
`decode_run` (B requests of a C-token prompt prefilled, `--warmup` decode steps, which capture the CUDA
graph, then `--steps` timed decode steps at temperature 1, ZOS on), graphs and, at batch 1, eager beside
them. A (batch, context) whose prompts would need more than `--max-prefill-tokens` tokens of prefill is
skipped and said so (the masked FP4 MoE made the slice's prefill slow; since issue #20 item 3 the grouped
FP4 kernels run it, kernels/fp4_moe.py).
Prefill: bench_prefill.py's `prefill_run` (N prompts of L tokens to their first token), after one untimed run.
`max_seq_len` is raised on the loaded weights when a context needs it (no numeric effect, spec §8).

Usage: python benchmarks/bench_slice.py [--model v41-slice] [--batches 1,16] [--contexts 1024]
                                        [--prefill 1x4096] [--json OUT]
Prints a line per measurement and markdown rows for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from bench_decode import SpanTracer, decode_run, measure_ceilings
from bench_prefill import prefill_run
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="v41-slice")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="1024", help="prompt lengths of the decode runs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prefill", default="1x4096", help="NxL prefill shapes, comma separated ('' for none)")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-prefill-tokens", type=int, default=1 << 17)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    batches, contexts = [int(b) for b in a.batches.split(",")], [int(c) for c in a.contexts.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in a.prefill.split(",") if s]
    margin = a.warmup + a.steps + 8
    max_len = max(contexts + [length for _, length in shapes]) + margin
    ceilings = measure_ceilings()
    hw = torch.cuda.get_device_name()
    weights, digest, load_s = load(a.model, max_len)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.parameters())
    print(f"{a.model}: loaded in {load_s:.1f} s, digest {digest}, weights {weight_bytes / GB:.2f} GB, "
          f"allocated {torch.cuda.memory_allocated() / GB:.2f} GB; copy {ceilings['copy_GBps']:.0f} GB/s", flush=True)
    rows = max(batches + [n for n, _ in shapes])
    blocks = rows * cdiv(max_len, BLOCK_SIZE)
    tracer = SpanTracer()
    engine = LLMEngine(weights, SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=a.max_batched_tokens,
                                                num_kv_blocks=blocks, num_state_slots=rows),
                       tracer=tracer, checkpoint_digest=digest, model_source=a.model)
    llm = SimpleNamespace(engine=engine)
    results = []
    for context in contexts:
        for batch in batches:
            if batch * context > a.max_prefill_tokens:
                print(f"B={batch} context {context}: skipped ({batch * context:,} prompt tokens > "
                      f"--max-prefill-tokens {a.max_prefill_tokens:,})", flush=True)
                continue
            for variant in ("graphs", "eager") if batch == 1 else ("graphs",):
                engine.runner.use_cuda_graphs = variant == "graphs"
                start = time.perf_counter()
                r = decode_run(llm, batch, context, a.warmup, a.steps, True, seed=len(results))
                r.update(batch=batch, context=context, variant=variant, wall_s=time.perf_counter() - start,
                         peak_GB=torch.cuda.max_memory_allocated() / GB)
                results.append(r)
                print(f"B={batch:3d} context {context:6d} {variant:6s}: {r['ms_per_step']:9.2f} ms/step "
                      f"{r['tokens_per_s']:9.1f} tok/s  busy {r['busy']:.3f}  peak {r['peak_GB']:.1f} GB  "
                      f"(run {r['wall_s']:.0f} s with its prefill)", flush=True)
    engine.runner.use_cuda_graphs = True
    prefills = []
    for n, length in shapes:
        prefill_run(engine, 1, min(length, 512), seed=7)  # warm-up: allocator, library handles
        seconds, steps = prefill_run(engine, n, length, seed=8)
        prefills.append(dict(prompts=n, length=length, seconds=seconds, steps=steps, tokens_per_s=n * length / seconds))
        print(f"prefill {n}x{length}: {seconds:.2f} s in {steps} steps, {n * length / seconds:,.0f} tok/s", flush=True)
    engine.shutdown()
    print(f"\n| hardware | checkpoint | batch | context | variant | ms/step | tokens/s | device busy | peak GB |")
    for r in results:
        print(f"| {hw} | {a.model} | {r['batch']} | {r['context']} | {r['variant']} | {r['ms_per_step']:.2f} | "
              f"{r['tokens_per_s']:,.1f} | {r['busy']:.1%} | {r['peak_GB']:.1f} |")
    for r in prefills:
        print(f"| {hw} | {a.model} | prefill {r['prompts']}x{r['length']} | {r['seconds']:.2f} s | "
              f"{r['tokens_per_s']:,.0f} tok/s |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "model": a.model, "digest": digest, "load_s": load_s,
                       "weight_GB": weight_bytes / GB, "ceilings": ceilings, "decode": results,
                       "prefill": prefills, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
