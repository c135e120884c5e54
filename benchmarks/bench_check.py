"""How long checking a trace takes next to recording it (issue #6 item 6): `mdi-trace record`, then
`mdi-trace check` (re-execution) and `mdi-trace check --against reference` on the trace it wrote, one after
the other on one machine, each as the user runs it (a fresh process that loads the checkpoint from the cache).

Usage: python benchmarks/bench_check.py [--device cpu|cuda] [--model tiny-68m] [--repeat 1] [-- RECORD ARGS...]
Prints a rich table (with each check's verdict: a check that finds something is timed all the same and its
report printed) and the markdown rows for benchmarks/RESULTS.md. Runs from the checkout (PYTHONPATH=.).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def timed(args: list[str]) -> tuple[float, str]:
    """Wall seconds of `python -m tui.cli ARGS` and its last output line; a failure stops the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if run.returncode not in (0, 1):  # 1 is a check's finding: timed all the same, and its verdict shown
        sys.exit(f"bench_check: `mdi-trace {' '.join(args)}` exited {run.returncode}: {run.stderr.strip()[-500:]}")
    lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
    verdict = next((line for line in lines if line.startswith(("divergence:", "mismatch:"))), lines[-1] if lines else "")
    if run.returncode == 1:
        print(run.stdout)
    return elapsed, verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="tiny-68m")
    p.add_argument("--repeat", type=int, default=1, help="record-and-check rounds (each row is the median)")
    p.add_argument("record_args", nargs="*", help="more `mdi-trace record` arguments (after --)")
    a = p.parse_args()
    commands = {"record": [], "check": [], "check --against reference": ["--against", "reference"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            trace = str(Path(tmp) / f"run{i}.mdt")
            t, notes["record"] = timed(["record", "--model", a.model, "--device", a.device, "-o", trace, *a.record_args])
            times["record"].append(t)
            for name, extra in list(commands.items())[1:]:
                t, notes[name] = timed(["check", trace, "--device", a.device, *extra])
                times[name].append(t)
    median = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    table = Table(title=f"record vs check, {a.model} on {a.device}, {a.repeat} round(s)")
    for col in ("command", "wall s", "ratio to record", "last line"):
        table.add_column(col)
    for name, t in median.items():
        table.add_row(f"mdi-trace {name}", f"{t:.1f}", f"{t / median['record']:.2f}", notes[name][:60])
    Console().print(table)
    for name, t in median.items():
        print(f"| `mdi-trace {name}` | {t:.1f} s | {t / median['record']:.2f} |")


if __name__ == "__main__":
    main()
