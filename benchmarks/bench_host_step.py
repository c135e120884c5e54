"""The host's work per decode step, without a model: the real Scheduler, ModelRunner.prepare and Recorder.

On the H200 a batch-256 decode step takes ~4.3 ms of device time, so under ZOS the host's step (schedule,
prepare, process, and with tracing the hooks, the tables digest and the writer) must stay under that for the
device lane to stay busy (RESULTS.md, issue #7). This runs the engine's step loop (LLMEngine.step/process,
ZOS on) over `batch` sequences in steady decode, with a stand-in device that returns fixed tokens at once,
and times each phase per step with the NullTracer and with the Recorder (writing to a temporary file).
Phases: schedule (Scheduler.schedule, its tracing hooks included), prepare (ModelRunner.prepare, the CPU path:
no graph padding, no pinned copies), process (Scheduler.process, hooks included), digest (the tables digest and
its event, only when tracing) and flush (the Recorder packing and writing the step's events at step_end).
Usage: python benchmarks/bench_host_step.py [--batch 64 256] [--steps 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time

import torch

from engine.llm_engine import freeze_heap
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.tracer import NullTracer
from tracing.recorder import Recorder
from tracing.workload import random_requests

PHASES = ("schedule", "prepare", "process", "digest", "flush")


def make_runner(config: SchedulerConfig) -> ModelRunner:
    """A ModelRunner without a model: enough for `prepare` (the CPU path, no graph padding)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.graphs = torch.device("cpu"), {}
    runner.trash_block, runner.trash_slot = config.num_kv_blocks, config.num_state_slots
    return runner


def run(batch: int, steps: int, tracer, seed: int = 0) -> dict[str, list[float]]:
    """Per-step times (µs) of each phase over `steps` steady decode steps after the prefill (ZOS: step N is
    scheduled and prepared, then step N-1 processed; both decode)."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=1 << 20, num_kv_blocks=batch * 16,
                             num_state_slots=batch)
    scheduler, runner = Scheduler(config, tracer), make_runner(config)
    tracer.start({"engine": {}, "model": {}})
    freeze_heap()  # as LLMEngine.__init__ does
    # prompts of 64-512 tokens (block boundaries fall on different steps) over a vocabulary of 1000
    for i, request in enumerate(random_requests(rng, batch, (64, 512), (1 << 20, 1 << 20), 1000, temperature=1.0)):
        scheduler.add(Sequence(i, *request, seed=i))
    tokens = [rng.randrange(3, 1000) for _ in range(batch)]
    times = {p: [] for p in PHASES}
    in_flight = None
    while len(times["flush"]) < steps:  # the prefill steps (up to log2(batch) + 1) and the first decode are the warm-up
        t0 = time.perf_counter_ns()
        b = scheduler.schedule()
        t1 = time.perf_counter_ns()
        runner.prepare(b)
        t2 = time.perf_counter_ns()
        tracer.cpu_span(b.step, "schedule", t0, t1)
        tracer.cpu_span(b.step, "execute", t1, t2)
        done, in_flight = in_flight, b
        t3 = t4 = t5 = t2
        if done is not None:  # LLMEngine.process with a device that has finished
            t3 = time.perf_counter_ns()
            tracer.device_span(done.step, t1, t2)
            scheduler.process(done, [t if r.sample else None for r, t in zip(done.rows, tokens)])
            t4 = time.perf_counter_ns()
            if tracer.enabled:
                tracer.step_digest(done.step, scheduler.digest())
            t5 = time.perf_counter_ns()
            tracer.cpu_span(done.step, "process", t3, t5)
        tracer.step_end(b.step)
        t6 = time.perf_counter_ns()
        if b.batch_kind == "decode" and done is not None and done.batch_kind == "decode":
            for phase, (a, z) in zip(PHASES, [(t0, t1), (t1, t2), (t3, t4), (t4, t5), (t5, t6)]):
                times[phase].append((z - a) / 1e3)
    tracer.close()
    return times


def medians(batch: int, steps: int, repeats: int, traced: bool) -> dict[str, float]:
    """Median per-step µs of each phase and of their total, over all steps of `repeats` runs."""
    times = {p: [] for p in PHASES + ("total",)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            got = run(batch, steps, Recorder(os.path.join(tmp, f"{r}.mdt")) if traced else NullTracer())
            for p in PHASES:
                times[p] += got[p]
            times["total"] += [sum(v) for v in zip(*(got[p] for p in PHASES))]
    return {**{p: statistics.median(v) for p, v in times.items()}, "mean": statistics.mean(times["total"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"CPU {os.cpu_count()} cores ({platform.machine()}), {args.steps} decode steps x {args.repeats} runs, "
          f"median µs per step")
    print("| batch | tracer | " + " | ".join(PHASES) + " | total (ms) | mean total (ms) |")
    print("|---" * (len(PHASES) + 4) + "|")
    for batch in args.batch:
        for traced in (False, True):
            m = medians(batch, args.steps, args.repeats, traced)
            cells = " | ".join(f"{m[p]:.0f}" for p in PHASES)
            tracer = "Recorder" if traced else "null"
            print(f"| {batch} | {tracer} | {cells} | {m['total'] / 1e3:.3f} | {m['mean'] / 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
