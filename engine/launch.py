"""The launcher: one command started as N ranks of an EP x DP run (ARCHITECTURE.md §8), as torchrun does.

Mirrors what torchrun (torch.distributed.run) does for one node, and what DeepInfer's multi-GPU launch does
for V4.1-Flash on 4 x B200: every rank gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), so a command written for torchrun runs under it unchanged, and `model.parallel.setup`
joins them. The ranks meet through a file store in a fresh temporary folder (MDI_INIT_METHOD) rather than a
TCP port, so concurrent runs on one machine can never collide.

    code = launch([sys.executable, "-m", "tui.cli", "record", ...], nproc=2)

Every rank's stdout is passed through (by convention only rank 0 prints); stderr is kept per rank and
only the first failing rank's is shown, so an error is said once. When a rank fails, the others are
stopped: they would wait for it in their next collective.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def launch(command: list[str], nproc: int, timeout_s: float | None = None) -> int:
    """Run `command` as ranks 0..nproc-1 and wait for all. Returns 0, or the first failing rank's exit code
    (124 when `timeout_s` passes first: every rank is stopped)."""
    with tempfile.TemporaryDirectory(prefix="mdi-launch-") as tmp:
        base = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "MDI_INIT_METHOD": f"file://{Path(tmp) / 'store'}"}
        errs = [open(Path(tmp) / f"rank{r}.err", "w+") for r in range(nproc)]
        procs: list[subprocess.Popen] = []

        def forward(signum, frame):  # SIGTERM or SIGHUP to the launcher: every rank gets it and stops cleanly
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)
        # Ctrl-C reaches the ranks (one process group); they stop together
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, forward)
        try:
            for r in range(nproc):
                procs.append(subprocess.Popen(command, stderr=errs[r],
                                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}))
            failed = _wait(procs, None if timeout_s is None else time.monotonic() + timeout_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        shown = failed if failed is not None and failed >= 0 else 0
        errs[shown].seek(0)
        sys.stderr.write(errs[shown].read())
        for f in errs:
            f.close()
        if failed == -1:
            sys.stderr.write(f"mdi-trace: the {nproc} ranks did not finish within {timeout_s:g} s and were stopped.\n")
            return 124
        return 0 if failed is None else procs[failed].returncode


def _wait(procs: list[subprocess.Popen], deadline: float | None) -> int | None:
    """Wait for every rank; on the first failure (or the deadline: -1) stop the others. Returns the
    failing rank, -1, or None."""
    while True:
        codes = [p.poll() for p in procs]
        # a rank stopped by a signal it handled (128 + signum) is not a failure to stop the others for:
        # they got the same signal and are finishing their step
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0) and not 128 < c < 160), None)
        if failed is None and deadline is not None and time.monotonic() > deadline:
            failed = -1
        if failed is not None:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            return failed
        if all(c is not None for c in codes):  # every rank is done: 0, or the first stopped rank
            return next((r for r, c in enumerate(codes) if c != 0), None)
        time.sleep(0.05)
