"""False positives of `mdi-trace check --against reference` (issue #16 item 7, ARCHITECTURE.md §6: "The
false-positive rate of each check is measured and kept at 0").

Records N clean runs over seeds and shapes, then checks each against the plain reference; every run is a
clean engine on an unchanged model, so every exit 1 is a false divergence. The shapes cycle through tiny KV
pools that preempt (and recompute), cancellations, chunk sizes 64 to 512, ZOS on and off, temperature 0 and
0.8, each run with its own seed. Each record and check is a fresh process, as a user runs them, with one
intra-op thread, `--jobs` of them at a time.

Usage: python benchmarks/bench_check_clean.py [--model micro] [--runs 100] [--jobs 2] [--device cpu|cuda]
Prints a rich table per value of each shape dimension, every run that exited 1 with the commands that reproduce it, and the
markdown row for benchmarks/RESULTS.md. Runs from the checkout (PYTHONPATH=.). Exit 1 if any run exited 1.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

# (name, record arguments): pools of 4-6 KV blocks preempt; 24 blocks rarely do
POOLS = (("pool 4 blocks", ["--num-kv-blocks", "4", "--max-num-seqs", "4"]),
         ("pool 6 blocks", ["--num-kv-blocks", "6"]),
         ("pool 24 blocks", ["--num-kv-blocks", "24"]))
CHUNKS = (64, 128, 256, 512)
ZOS = ("--zos", "--no-zos")
TEMPERATURES = ("0", "0.8")


@dataclass(slots=True)
class Run:
    seed: int
    dims: tuple[str, ...]    # its value of each dimension of the shape: pool, chunk, ZOS, temperature
    record: list[str]
    exit_code: int = -1
    verdict: str = ""
    seconds: float = 0.0


def runs(model: str, n: int, seed0: int) -> list[Run]:
    """n runs cycling through the shapes, each with its own seed; the model decides the prompt lengths."""
    lengths = (["--input-len", "32:300", "--output-len", "8:24"] if model != "micro"
               else ["--input-len", "16:300", "--output-len", "8:32"])
    out = []
    for i in range(n):  # every value of each dimension within a few runs, every combination within 48
        (pool, pool_args), zos = POOLS[i % 3], ZOS[i % 2]
        temperature, chunk, seed = TEMPERATURES[i // 2 % 2], CHUNKS[i // 4 % 4], seed0 + i
        record = ["--model", model, "--num-prompts", "8", *lengths, *pool_args, "--max-num-batched-tokens", str(chunk),
                  zos, "--temperature", temperature, "--cancel-rate", "0.15", "--seed", str(seed)]
        out.append(Run(seed, (pool, f"chunk {chunk}", zos.removeprefix("--"), f"T={temperature}"), record))
    return out


def mdi(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def one(run: Run, device: str, folder: Path) -> Run:
    trace = str(folder / f"seed{run.seed}.mdt")
    start = time.perf_counter()
    rec = mdi(["record", "-o", trace, "--device", device, *run.record])
    if rec.returncode != 0:
        sys.exit(f"bench_check_clean: record of seed {run.seed} exited {rec.returncode}: {rec.stderr.strip()[-400:]}")
    check = mdi(["check", trace, "--against", "reference", "--device", device])
    run.seconds, run.exit_code = time.perf_counter() - start, check.returncode
    lines = [line.strip() for line in check.stdout.splitlines() if line.strip()]
    run.verdict = next((line for line in lines if line.startswith("divergence:")), check.stderr.strip()[-300:])
    if run.exit_code == 0:
        os.unlink(trace)  # keep only what reproduces a false positive
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="micro", help="a preset name or a checkpoint folder (default micro)")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, each a process with one intra-op thread")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=1, help="the first run's seed; run i has seed + i")
    p.add_argument("--keep", default=None, help="folder for the traces of runs that exit 1 (default: a temporary one)")
    a = p.parse_args()
    console, todo = Console(), runs(a.model, a.runs, a.seed)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console, transient=True) as bar:
        folder = Path(a.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        task = bar.add_task(f"{a.runs} clean runs of {a.model}", total=a.runs)
        with ThreadPoolExecutor(a.jobs) as pool:
            done = []
            for run in pool.map(lambda r: one(r, a.device, folder), todo):
                done.append(run)
                bar.advance(task)
    wall = time.perf_counter() - start
    by_value: dict[str, list[Run]] = {}  # every value of every dimension, and the runs that had it
    for run in done:
        for value in run.dims:
            by_value.setdefault(value, []).append(run)
    table = Table(title=f"check --against reference on clean runs of {a.model} ({a.device})", title_justify="left")
    for col in ("with", "runs", "exit 1", "median s"):
        table.add_column(col, justify="left" if col == "with" else "right")
    for value, rs in by_value.items():
        table.add_row(value, f"{len(rs)}", f"{sum(r.exit_code == 1 for r in rs)}",
                      f"{sorted(r.seconds for r in rs)[len(rs) // 2]:.1f}")
    console.print(table)
    false = [r for r in done if r.exit_code != 0]
    for r in false:
        console.print(f"[red]seed {r.seed} ({', '.join(r.dims)}) exited {r.exit_code}[/]: {r.verdict}\n  reproduce: mdi-trace "
                      f"record -o run.mdt {' '.join(r.record)} && mdi-trace check run.mdt --against reference",
                      soft_wrap=True)
    console.print(f"{len(false)} of {len(done)} clean runs exit non-zero ({wall:.0f} s wall, {a.jobs} at a time)")
    shapes = len({r.dims for r in done})
    print(f"| {a.device} | {a.model}, bf16 | 8 requests a run over {shapes} shapes (pools of 4, 6 and 24 "
          f"blocks, chunks 64-512, ZOS on/off, T 0 and 0.8, cancel rate 0.15), seeds {a.seed}-{a.seed + a.runs - 1} "
          f"| {len(false)} of {len(done)} clean runs exit 1 | none (each run a fresh process) |")
    return 1 if false else 0


if __name__ == "__main__":
    sys.exit(main())
