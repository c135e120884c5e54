"""`mdi-trace view` speed: first paint and key-to-redraw on synthetic logs (issue #5 targets: first paint
under 1 s at 1M events, every key under 50 ms).

The logs are written directly with tracing/recorder.py's Recorder, no model: decode steps of `--batch`
rows (schedule, a reservation and a token per row, schedule/execute/process spans, a device span, a
digest), a request arriving, a preemption and block churn every few steps, so every view has data.

The app runs headless (`App.run_test`) at 160x48. "First paint": from creating the app (the log opened,
its header and footer read) to its first screen. "Indexed": to the index being ready (the scan runs in a
worker after the first paint). "Key": from posting the key to the last screen update it caused (the app's
`_display` calls are timed; Textual's own frame pacing included). Each key is pressed 3 times; the median
and the worst are reported.

Usage: python benchmarks/bench_view.py [--events 1000000 10000000] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual import events  # noqa: E402

from tracing import Recorder  # noqa: E402
from tui.app import TraceApp  # noqa: E402

# (view key, keys pressed in that view): every view, the shared step, zoom, pan, lists, search
SCRIPT = [("1", []), ("2", ["full_stop", "plus", "minus", "right", "i"]),
          ("3", ["down", "pagedown", "full_stop", "end"]), ("4", ["down", "tab", "down"]),
          ("5", ["comma"]), ("6", ["down", "pagedown", "end", "left_square_bracket"])]
CHARS = {"full_stop": ".", "comma": ",", "plus": "+", "minus": "-", "left_square_bracket": "["}
SETTLE_S = 0.25   # wall time after a key during which its redraws are counted


def synthesize(path: Path, n_events: int, batch: int = 16) -> None:
    """A log of about `n_events` events: decode steps with some churn (arrivals, preemptions, frees)."""
    rec = Recorder(path, argv=["bench_view.py"])
    rec.start({"engine": {"max_num_seqs": batch, "num_kv_blocks": 4 * batch, "num_state_slots": batch,
                          "block_size": 128, "enable_zos": True}, "model": {}, "device": "synthetic"})
    params = SimpleNamespace(temperature=1.0, max_tokens=1 << 30, ignore_eos=True, stop_token_ids=[])
    seqs = list(range(batch))   # slot i holds request seqs[i]
    epochs = [0] * batch
    for s in seqs:
        rec.request_added(s, list(range(64)), params, s)
        rec.slot_alloc(s, s)
        rec.block_alloc(s, [2 * s, 2 * s + 1])
    t, step, nxt = rec.t0, 0, batch
    while sum(rec.counts.values()) < n_events:
        preempted = []
        if step % 50 == 49:   # request in slot k is preempted and replaced by a new one
            k = (step // 50) % batch
            old = seqs[k]
            rec.preempt(step, old)
            rec.epoch_bump(old, epochs[k] + 1, "preempt")
            rec.block_free(old, [2 * k, 2 * k + 1])
            rec.slot_free(old, k)
            rec.finish(step, old, "length")
            seqs[k], epochs[k], preempted = nxt, 0, [old]
            rec.request_added(nxt, list(range(64)), params, nxt)
            rec.slot_alloc(nxt, k)
            rec.block_alloc(nxt, [2 * k, 2 * k + 1])
            nxt += 1
        rows = [SimpleNamespace(seq_id=s, epoch=0, start=64 + step, token_ids=[None], block_table=[2 * k, 2 * k + 1],
                                state_slot=k, sample=True, seed=s, temperature=1.0, output_position=step)
                for k, s in enumerate(seqs)]
        rec.schedule(SimpleNamespace(step=step, kind="decode", rows=rows, preempted=preempted))
        for s in seqs:
            rec.reservation(step, s, 0, step)
        rec.cpu_span(step, "schedule", t, t + 20_000)
        rec.cpu_span(step, "execute", t + 20_000, t + 60_000)
        gap = 150_000 if step % 97 == 0 else 5_000      # the device waits now and then
        rec.device_span(step, t + 60_000 + gap, t + 400_000)
        for s in seqs:
            rec.token(step, s, 0, 65 + step, 1000 + s, True)
        rec.step_digest(step, "0123456789abcdef")
        rec.cpu_span(step, "process", t + 400_000, t + 430_000)
        rec.step_end(step)
        t, step = t + 400_000, step + 1
    rec.close()


class TimedApp(TraceApp):
    """The app, with the time of its last screen update recorded."""
    last_display = 0.0

    def _display(self, screen, renderable) -> None:
        super()._display(screen, renderable)
        if renderable is not None:
            self.last_display = time.perf_counter()


async def measure(path: Path) -> dict:
    app = TimedApp(str(path))
    keys: dict[str, list[float]] = {}
    async with app.run_test(size=(160, 48)) as pilot:
        while app.loaded_at is None and app.error is None:
            await asyncio.sleep(0.01)
        if app.error:
            raise SystemExit(f"bench_view: {app.error}")
        await pilot.pause()
        for view, presses in SCRIPT:
            for key in [view, *presses] * 1 + presses * 2:
                t0 = time.perf_counter()
                app.last_display = t0
                event = events.Key(key, key if len(key) == 1 else CHARS.get(key))
                event.set_sender(app)
                app._driver.send_message(event)   # as a terminal's key arrives
                await asyncio.sleep(SETTLE_S)
                keys.setdefault(f"{view}:{key}", []).append(app.last_display - t0)
    return {"first_paint": app.first_paint, "indexed": app.loaded_at, "keys": keys}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--dir", default="/tmp", help="where the synthetic logs are written (kept for reuse)")
    a = p.parse_args()
    cpu = f"{platform.machine()}, {os.cpu_count()} cores"
    for n in a.events:
        path = Path(a.dir) / f"bench-view-{n}.mdt"
        if not path.exists():
            t = time.perf_counter()
            synthesize(path, n)
            print(f"wrote {path} ({path.stat().st_size >> 20} MiB) in {time.perf_counter() - t:.1f} s")
        r = asyncio.run(measure(path))
        allkeys = [v for vs in r["keys"].values() for v in vs]
        worst = max(r["keys"].items(), key=lambda kv: max(kv[1]))
        print(f"\n{n:,} events ({path.stat().st_size >> 20} MiB), CPU {cpu}")
        print(f"  first paint {1000 * r['first_paint']:.0f} ms, indexed {r['indexed']:.2f} s")
        for k, vs in r["keys"].items():
            print(f"  key {k:<24} median {1000 * statistics.median(vs):6.1f} ms  worst {1000 * max(vs):6.1f} ms")
        print(f"| view, {n:,} events ({path.stat().st_size >> 20} MiB) | {cpu} | first paint "
              f"{1000 * r['first_paint']:.0f} ms | indexed {r['indexed']:.1f} s | keys: median "
              f"{1000 * statistics.median(allkeys):.0f} ms, worst {1000 * max(worst[1]):.0f} ms ({worst[0]}) |")


if __name__ == "__main__":
    main()
