"""Scaling with context (issue #20 item 2): prefill tokens/s and decode ms/step against the context length.

For each context C and batch B: B requests of C random prompt tokens are prefilled (chunked at
`--max-batched-tokens` a step; the time from the first prefill step to the last prompt's first token is the
prefill rate, B*C tokens over it), then `--warmup` decode steps, then `--steps` timed decode steps of all B rows
at context ~C (CUDA graphs, ZOS on). The engine is built per context with `max_model_len` = C + the decode
steps, so RoPE tables and the KV pool fit (`num_kv_blocks` = B x ceil(max_model_len / 128)). Each decode step
also says how many compressed entries each row's indexer scores: C / r in a layer of compress ratio r (the
model's `compress_ratios`, spec §2): that grows linearly with C, while what attention reads stays fixed (the
window, the index top-k entries, the candidate blocks), so a decode step's cost is flat in C until the indexer's
scoring dominates it.

Usage: python benchmarks/bench_context.py [--model tiny-68m] [--contexts 4096,32768,131072] [--batches 1,16,64]
       [--device cuda] [--json out.json]
Prints a table and markdown rows for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from bench_decode import SpanTracer
from engine import LLM
from model.config import BLOCK_SIZE, cdiv
from tracing.workload import random_requests


def run(a, context: int, batch: int) -> dict:
    tracer = SpanTracer()
    max_model_len = context + a.warmup + a.steps + 8
    llm = LLM(a.model, device=a.device, max_num_seqs=batch, max_num_batched_tokens=a.max_batched_tokens,
              max_model_len=max_model_len, num_kv_blocks=batch * cdiv(max_model_len, BLOCK_SIZE), tracer=tracer)
    engine, args = llm.engine, llm.engine.runner.model.args
    for request in random_requests(random.Random(context + batch), batch, (context, context),
                                   (a.warmup + a.steps + 4, a.warmup + a.steps + 4), engine.vocab_size, 1.0):
        engine.add_request(*request)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in engine.scheduler.seqs.values()):
        engine.step()
    sync()
    prefill_s = time.perf_counter() - t0
    first = engine.scheduler.step
    for _ in range(a.warmup):
        engine.step()
    sync()
    start = engine.scheduler.step
    t1 = time.perf_counter_ns()
    for _ in range(a.steps):
        engine.step()
    sync()
    t2 = time.perf_counter_ns()
    timed = range(start, start + a.steps)
    full = all(tracer.kinds.get(s) == ("decode", batch) for s in timed)
    while engine.has_unfinished():
        engine.step()
    engine.shutdown()
    ratios = sorted({r for r in args.compress_ratios if r})
    row = dict(model=a.model, context=context, batch=batch, prefill_tokens_per_s=batch * context / prefill_s,
               prefill_s=prefill_s, prefill_steps=first, decode_ms=(t2 - t1) / a.steps / 1e6,
               decode_tokens_per_s=batch * a.steps / ((t2 - t1) / 1e9), full_decode_steps=full,
               scored={r: context // r for r in ratios}, peak_gb=(torch.cuda.max_memory_allocated() / 1e9
                                                                  if a.device == "cuda" else None))
    del llm, engine
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-68m")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--skip", default="", help="CxB pairs to leave out, comma separated (e.g. 1048576x64)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    rows = []
    for context in map(int, a.contexts.split(",")):
        for batch in map(int, a.batches.split(",")):
            if f"{context}x{batch}" in skip:
                continue
            row = run(a, context, batch)
            rows.append(row)
            print(f"{a.model} C={context:>8,} B={batch:>3}: prefill {row['prefill_tokens_per_s']:>10,.0f} tok/s "
                  f"({row['prefill_s']:.1f} s, {row['prefill_steps']} steps); decode {row['decode_ms']:8.2f} ms/step "
                  f"({row['decode_tokens_per_s']:,.0f} tok/s){'' if row['full_decode_steps'] else ' (NOT all full)'}; "
                  f"scored per row {row['scored']}; peak {row['peak_gb'] or 0:.1f} GB", flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print("\n| model | context | batch | prefill tok/s | decode ms/step | decode tok/s | entries scored per row | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['context']:,} | {r['batch']} | {r['prefill_tokens_per_s']:,.0f} | "
              f"{r['decode_ms']:.2f} | {r['decode_tokens_per_s']:,.0f} | "
              f"{', '.join(f'{n:,} (ratio {k})' for k, n in r['scored'].items())} | {r['peak_gb'] or 0:.1f} |")


if __name__ == "__main__":
    main()
