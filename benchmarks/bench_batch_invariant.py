"""Batch-invariant mode (issue #11, model/invariant.py) against the default mode, side by side in one process.

Prefill tokens/s (a batch of prompts in one step each, no decode) and decode tokens/s (a batch of requests
decoding together, after a warm-up) through the engine, alternating the two modes so that drift hits both
alike. On CPU: one intra-op thread (what the mode requires there), each forward timed on the worker. On
CUDA: each step's device span (the engine's CUDA events, as a trace records them), decode steps replayed
from CUDA graphs in both modes. Usage:
    python benchmarks/bench_batch_invariant.py [--model micro|tiny-68m|FOLDER] [--batch 8] [--prompt-len 256]
                                               [--device cpu|cuda]
Prints a rich table and the markdown row for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from engine import LLM
from engine.tracer import MemoryTracer
from tracing.workload import random_requests


def tokens_per_s(model: str, invariant: bool, batch: int, prompt_len: int, tokens: int,
                 device: str = "cpu") -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one engine run."""
    tracer = MemoryTracer()
    llm = LLM(model, device=device, batch_invariant=invariant, enable_zos=True, cpu_threads=1, max_num_seqs=batch,
              max_num_batched_tokens=batch * prompt_len, tracer=tracer if device == "cuda" else None)
    for request in random_requests(random.Random(0), batch, (prompt_len, prompt_len), (tokens, tokens),
                                   llm.engine.vocab_size, temperature=1.0):
        llm.engine.add_request(*request)
    runner, forward, spans = llm.engine.runner, llm.engine.runner.model.forward, []

    def timed(batch_, *args, **kwargs):  # device time of each forward, on the worker thread
        start = time.perf_counter()
        out = forward(batch_, *args, **kwargs)
        spans.append((batch_.decode, time.perf_counter() - start))
        return out

    if device == "cpu":
        runner.model.forward = timed
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.shutdown()
    if device == "cuda":  # the device span of each step, from the engine's CUDA events
        kind = {b.step: b.batch_kind for _, b in tracer.kinds("schedule")}  # ("schedule", ScheduledBatch)
        spans = [(kind[step] == "decode", (end - start) / 1e9) for _, step, start, end in tracer.kinds("device_span")]
    prefill = [t for decode, t in spans if not decode]
    decode = [t for decode, t in spans if decode][2:]  # the first two decode steps are warm-up
    return batch * prompt_len / sum(prefill), batch * len(decode) / sum(decode)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args()
    where = (f"CPU ({platform.processor() or platform.machine()}), 1 intra-op thread" if a.device == "cpu"
             else f"{torch.cuda.get_device_name()}, device spans, decode from CUDA graphs")
    results = {False: [], True: []}
    for _ in range(a.repeats):
        for invariant in (False, True):
            results[invariant].append(tokens_per_s(a.model, invariant, a.batch, a.prompt_len, a.tokens, a.device))
    med = {k: [statistics.median(r[i] for r in v) for i in (0, 1)] for k, v in results.items()}
    table = Table(title=f"{a.model}, batch {a.batch}, prompt {a.prompt_len}, {where}, median of {a.repeats}")
    for col in ("", "default", "batch-invariant", "invariant / default"):
        table.add_column(col)
    for i, name in enumerate(("prefill tok/s", "decode tok/s")):
        table.add_row(name, f"{med[False][i]:.0f}", f"{med[True][i]:.0f}", f"{med[True][i] / med[False][i]:.2f}")
    Console().print(table)
    print(f"| batch-invariant mode ({where}) | {a.model} | {a.batch} | prompt {a.prompt_len}, {a.tokens} out | bf16 | "
          f"prefill {med[False][0]:.0f} -> {med[True][0]:.0f} tok/s ({med[True][0] / med[False][0]:.2f}x), "
          f"decode {med[False][1]:.0f} -> {med[True][1]:.0f} tok/s ({med[True][1] / med[False][1]:.2f}x) |")


if __name__ == "__main__":
    main()
