"""Prefill throughput of the engine beside the plain reference model and a floor estimate (issue #7).

For each (prompts, prompt length): the engine prefills N prompts of L tokens (chunked at
`--max-batched-tokens` query tokens a step, each prompt's last chunk sampling one token); tokens/s =
N·L over the wall time from the first step to the last first token. One untimed run of each shape goes
first (compilation, allocator, library handles). The reference model (model/reference.py) prefills
one prompt of L tokens at a time.

Floor: the largest of (a) matrix FLOPs over the measured bf16 GEMM rate: 2 x every weight except the
embedding and Engram tables (the grouped MoE computes all experts on every token) per token, plus the
indexer's scores (2·Hi·Di per visible entry at each index source layer); (b) bytes over the measured copy
bandwidth: the weights once a step, and each token's window latent, compressed entry and index key
written once; (c) kernels launched (counted by the profiler) times the measured eager launch cost.

tiny-68m's max_seq_len is 1024; prompts of up to 8k tokens need a longer RoPE table, which has no
numeric effect (spec §8), so the benchmark raises max_seq_len on the loaded weights.

Usage: python benchmarks/bench_prefill.py [--prompts 1,2,4,8] [--lengths 1024,2048,4096,8192]
                                         [--extra 64x512] [--max-batched-tokens 16384]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench_decode import measure_ceilings
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from model.config import BLOCK_SIZE, cdiv
from model.load import load_model
from model.reference import ReferenceModel
from tracing.workload import random_requests


def matmul_tflops() -> float:
    """bf16 8192^3 GEMM on random data, mean of 10 after 3 warm-ups."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    e.synchronize()
    return 2 * 8192**3 * 10 / (s.elapsed_time(e) / 1e3) / 1e12


def build(model: str, n: int, length: int, budget: int):
    weights, digest = load_model(model, "cuda")
    weights.args.max_seq_len = max(weights.args.max_seq_len, length + 8)
    weights._rope.clear()  # rebuilt at the new length by the runner's warm()
    blocks = n * cdiv(length + 8, BLOCK_SIZE)
    return LLMEngine(weights, SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                                              num_state_slots=n), checkpoint_digest=digest)


def prefill_run(engine: LLMEngine, n: int, length: int, seed: int) -> tuple[float, int]:
    """(seconds, steps) to prefill n prompts of `length` tokens and sample each one's first token."""
    ids = [engine.add_request(*r) for r in random_requests(random.Random(seed), n, (length, length), (1, 1),
                                                           engine.vocab_size, temperature=1.0)]
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    assert len(ids) == n
    return time.perf_counter() - start, steps


def count_kernels(engine: LLMEngine, n: int, length: int) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_run(engine, n, length, seed=99)
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def floor_s(engine: LLMEngine, n: int, length: int, steps: int, kernels: int, ceilings: dict, tflops: float) -> float:
    w = engine.runner.model.weights
    a = w.args
    dense = [p for name, p in w.named_parameters() if not name.startswith("embed.") and ".engram.embed." not in name]
    flops_token = 2 * sum(p.numel() for p in dense if p.dim() >= 2)
    index = sum(2 * a.index_n_heads * a.index_head_dim * (length / a.compress_ratios[s]) / 2
                for s in a.index_source_layers)  # V(p) grows linearly: length/(2r) entries on average
    flops = n * length * (flops_token + index)
    bytes_ = steps * sum(p.numel() * p.element_size() for p in dense) + n * length * (
        a.n_layers * a.head_dim * 2 + sum((a.head_dim + a.index_head_dim) * 2 / a.compress_ratios[s]
                                          for s in a.kv_source_layers))
    return max(flops / (tflops * 1e12), bytes_ / (ceilings["copy_GBps"] * 1e9),
               kernels * ceilings["launch_us_eager"] / 1e6)


def reference_tokens_per_s(engine: LLMEngine, length: int) -> float:
    ref = ReferenceModel(engine.runner.model.weights)
    tokens = list(range(3, 3 + length))
    ref.forward(tokens)
    torch.cuda.synchronize()
    s = time.perf_counter()
    ref.forward(tokens)
    torch.cuda.synchronize()
    return length / (time.perf_counter() - s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-68m")
    p.add_argument("--prompts", default="1,2,4,8")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--extra", default="64x512", help="more NxL shapes, comma separated")
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ceilings = measure_ceilings()
    tflops = matmul_tflops()
    print(json.dumps({**ceilings, "bf16_tflops": tflops}))
    shapes = [(n, length) for length in map(int, a.lengths.split(",")) for n in map(int, a.prompts.split(","))]
    shapes += [tuple(map(int, s.split("x"))) for s in a.extra.split(",") if s]
    results, refs = [], {}
    for n, length in shapes:
        engine = build(a.model, n, length, a.max_batched_tokens)
        prefill_run(engine, n, length, seed=1)  # warm-up of this shape
        seconds, steps = prefill_run(engine, n, length, seed=2)
        kernels = count_kernels(engine, n, length)
        if length not in refs:
            refs[length] = reference_tokens_per_s(engine, length)
        floor = floor_s(engine, n, length, steps, kernels, ceilings, tflops)
        r = dict(prompts=n, length=length, seconds=seconds, steps=steps, tokens_per_s=n * length / seconds,
                 kernels=kernels, floor_s=floor, reference_tokens_per_s=refs[length])
        results.append(r)
        print(f"{n:3d} x {length:5d}: {r['tokens_per_s']:12,.0f} tok/s  {seconds * 1e3:9.1f} ms in {steps} steps  "
              f"floor {floor * 1e3:8.2f} ms ({seconds / floor:5.1f}x)  kernels {kernels}  "
              f"reference {refs[length]:10,.0f} tok/s", flush=True)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    hw = torch.cuda.get_device_name()
    print("\n| hardware | prompts x tokens | tokens/s | reference tokens/s | floor ms | x floor | steps |")
    for r in results:
        print(f"| {hw} | {r['prompts']} x {r['length']} | {r['tokens_per_s']:,.0f} | {r['reference_tokens_per_s']:,.0f} | "
              f"{r['floor_s'] * 1e3:.2f} | {r['seconds'] / r['floor_s']:.1f} | {r['steps']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ceilings": ceilings, "bf16_tflops": tflops, "results": results, "hardware": hw,
                       "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
