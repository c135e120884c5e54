"""A bounded load test of `mdi-trace serve` on loopback (issue #19 item 5): a fixed count of streamed completion
requests from the `openai` client, `--concurrency` at a time, against a server recording a trace (`-o`) and one
recording none, alternating (`--rounds` of each, a fresh server per run), side by side in one invocation.
Reports output tokens/s, requests/s and TTFT (first streamed token, client side) p50/p90/p99, and the
tracing overhead as the ratio of the two throughputs.

Usage: python benchmarks/bench_serve.py [--model micro] [--requests 64] [--concurrency 16] [--prompt-len 64]
       [--max-tokens 32] [--rounds 2] [--device cpu]
Prints a rich table and the markdown rows for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def start(a, trace: Path | None) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "tui.cli", "serve", "--model", a.model, "--device", a.device, "--port", "0",
            "--max-num-seqs", str(a.concurrency), *(["-o", str(trace)] if trace else [])]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r} {proc.stderr.read()!r}")
    return proc, line.split(" on ", 1)[1].split(" ", 1)[0]


async def load(a, url: str) -> dict:
    """Every request once, `concurrency` at a time; per request: TTFT and output tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    gate = asyncio.Semaphore(a.concurrency)
    ttft, tokens = [], 0

    async def one(client, prompt):
        nonlocal tokens
        async with gate:
            t0 = time.perf_counter()
            first = None
            stream = await client.completions.create(model=a.model, prompt=prompt, max_tokens=a.max_tokens,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}, temperature=1.0)
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - t0
                if chunk.usage:
                    tokens += chunk.usage.completion_tokens
            ttft.append(first)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        await one(client, prompts[0])  # warm-up: the first step's allocations
        ttft.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "ttft": sorted(ttft)}


def run(a, traced: bool, tmp: Path, n: int) -> dict:
    trace = tmp / f"served-{n}.mdt" if traced else None
    proc, url = start(a, trace)
    try:
        result = asyncio.run(load(a, url))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    result["trace_bytes"] = trace.stat().st_size if trace else 0
    return result


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    runs = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(a.rounds):
            for traced in (True, False) if n % 2 == 0 else (False, True):
                runs[traced].append(run(a, traced, Path(tmp), n))
    table = Table(title=f"serve {a.model} on {a.device}: {a.requests} requests, {a.concurrency} at a time, "
                        f"{a.prompt_len} prompt + {a.max_tokens} output tokens, streamed")
    for col in ("trace", "output tok/s", "requests/s", "TTFT p50 ms", "p90", "p99", "trace bytes"):
        table.add_column(col, justify="right")
    rate = {}
    rows = []
    for traced in (True, False):
        rs = runs[traced]
        rate[traced] = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        ttft = sorted(t for r in rs for t in r["ttft"])
        cells = ("-o" if traced else "none", f"{rate[traced]:,.0f}",
                 f"{statistics.median(a.requests / r['seconds'] for r in rs):.2f}",
                 *(f"{pct(ttft, q) * 1e3:,.0f}" for q in (0.5, 0.9, 0.99)),
                 f"{statistics.median(r['trace_bytes'] for r in rs):,.0f}")
        table.add_row(*cells)
        rows.append(cells)
    console = Console()
    console.print(table)
    console.print(f"traced / untraced throughput: {rate[True] / rate[False]:.3f} "
                  f"(median of {a.rounds} alternating runs each)")
    cpu = platform.processor() or platform.machine()
    print(f"\nmarkdown ({cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}):")
    for cells in rows:
        print("| " + " | ".join((a.model, a.device, str(a.requests), str(a.concurrency),
                                 f"{a.prompt_len}+{a.max_tokens}", *cells)) + " |")


if __name__ == "__main__":
    main()
