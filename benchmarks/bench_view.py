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

Memory (issue #17): each measurement runs in a fresh subprocess and reads its own peak RSS
(VmHWM in /proc/self/status, file pages of the mapped log included). "Index": the peak RSS of
building `TraceIndex` alone, its growth over the process before the scan, and the bytes of the numpy arrays the
index keeps, per event. "View": the peak RSS of the whole headless app run above (Textual, the index, the views'
lines). `--hostile` measures `mdi-trace verify` and the index on the issue's 12.6 MB log: three block_alloc
events naming 4M block ids each (a pool of 64 blocks). `--minimal N` also writes a log of N minimal events
(4-byte step_digest events, the smallest there is) and measures the index on it, the worst case per byte.
"Open": the peak RSS of what `mdi-trace view` does to open a log, without Textual: `RunModel.check_memory`, then
`RunModel.load` with this machine's budget (a big index spills to MDI_CACHE, tracing/spill.py), then what the views
ask on their first draw (the Events view's list of every event, the first step's detail, its owners, the
Overview, every request's line). `--open` measures it on the minimal log and on each `--events` log.

Usage: python benchmarks/bench_view.py [--events 1000000 10000000] [--dir /tmp] [--no-keys] [--hostile]
       [--minimal 50000000] [--open]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402

from tracing import Recorder  # noqa: E402
from tracing.schema import KIND, MAGIC, SCHEMA_VERSION, TRAILER_TAG  # noqa: E402

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
        rec.schedule(SimpleNamespace(step=step, batch_kind="decode", rows=rows, preempted=preempted))
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


def hostile(path: Path, n_ids: int = 1 << 22, events: int = 3, num_kv_blocks: int = 64) -> None:
    """The issue's legal-looking 12.6 MB log: a valid header, then `events` block_alloc events of request 0
    naming `n_ids` block ids each (0-127, one byte each; half of them outside the pool, all of them allocated
    again and again), and a footer."""
    rec = Recorder(path, argv=["bench_view.py", "--hostile"])
    rec.start({"engine": {"num_kv_blocks": num_kv_blocks, "num_state_slots": 4, "max_num_seqs": 4,
                          "block_size": 16}, "model": {}, "device": "synthetic"})
    ids = [b % 128 for b in range(n_ids)]
    for _ in range(events):
        rec.block_alloc(0, ids)
    rec.close()


def minimal(path: Path, n_events: int) -> None:
    """A clean log of one schedule event (step 0), then `n_events` step_digest events `[14, 0, ""]` (4 bytes
    each: the smallest event there is), and a footer: the most events a byte of log can hold."""
    pack = msgpack.Packer(use_bin_type=True).pack
    event = pack([KIND["step_digest"], 0, ""])
    with open(path, "wb") as f:
        f.write(pack({"magic": MAGIC, "schema_version": SCHEMA_VERSION, "t0_ns": 0, "engine": {},
                      "device": "synthetic"}))
        offset = f.tell()
        f.write(pack([KIND["schedule"], 0, 0, 1, [], []]))
        for done in range(0, n_events, 1 << 20):
            f.write(event * min(1 << 20, n_events - done))
        footer = f.tell()
        f.write(pack([KIND["footer"], {"schedule": 1, "step_digest": n_events}, 1, [[0, offset]], True]))
        f.write(bytes([TRAILER_TAG]) + footer.to_bytes(8, "big"))


def rss(field: str = "VmHWM") -> int:
    """This process's peak (VmHWM) or current (VmRSS) resident set size in bytes. Not ru_maxrss: Linux carries
    the parent's peak over a fork and exec into it, so a small child of a big parent reads the parent's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):  # not Linux: the peak since the process started (in KiB on Linux)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def child(what: str, path: str) -> dict:
    """One measurement, in this (fresh) process."""
    if what == "index":
        from tracing.index import TraceIndex
        from tracing.reader import TraceFile
        import numpy as np
        trace = TraceFile(path)
        before, t = rss("VmRSS"), time.perf_counter()
        index = TraceIndex(trace)
        seconds = time.perf_counter() - t
        if hasattr(index, "nbytes"):
            kept = index.nbytes
        else:  # the index before issue #17: its arrays are its attributes
            arrays = [v for v in vars(index).values() if isinstance(v, np.ndarray)]
            kept = sum(a.nbytes for a in arrays + [getattr(tab, f) for tab in (index.steps, index.resources)
                                                   for f in tab.__slots__])
        return {"events": len(index), "seconds": seconds, "before": before, "peak": rss(), "kept": int(kept)}
    if what == "verify":  # `mdi-trace verify PATH`, in this process, its output counted (not kept)
        import contextlib
        from tui.cli import main as cli

        class Count:
            lines, last, text = 0, "", ""

            def write(self, text: str) -> None:
                self.lines += text.count("\n")
                self.text = (self.text + text)[-500:]

            def flush(self) -> None:
                pass

        out, t = Count(), time.perf_counter()
        with contextlib.redirect_stdout(out):
            cli(["verify", path])
        last = out.text.rstrip("\n").rsplit("\n", 1)[-1]
        return {"seconds": time.perf_counter() - t, "lines": out.lines, "last": last, "peak": rss()}
    if what == "view":
        r = asyncio.run(measure(Path(path)))
        return {**r, "peak": rss()}
    if what == "open":   # the viewer's open without Textual: its data model, and the first draw of each view
        from tui.data import RunModel
        from tui.format import EventFilter
        t = time.perf_counter()
        run = RunModel(path)
        run.check_memory()
        run.load()
        m = run.models[0]
        loaded = time.perf_counter() - t
        shown = m.filtered(EventFilter())
        lines = [m.event_line(int(i)) for i in shown[:48]] + m.step_detail(0) + [m.request_line(k) for k in
                                                                                  range(len(m.seq_ids))]
        m.owners(0)
        m.overview()
        return {"events": len(m.index), "spilled": m.index.spilled, "loaded": loaded, "lines": len(lines),
                "shown": len(shown), "seconds": time.perf_counter() - t, "peak": rss()}
    raise SystemExit(f"unknown measurement {what}")


def in_child(what: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", what, str(path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if out.returncode:
        raise SystemExit(f"bench_view: the {what} measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def report_index(path: Path, label: str) -> dict:
    r = in_child("index", path)
    n = max(r["events"], 1)
    print(f"  index of {label}: {r['events']:,} events in {r['seconds']:.2f} s; peak RSS {mb(r['peak'])} "
          f"({mb(r['peak'] - r['before'])} over the {mb(r['before'])} before the scan, "
          f"{(r['peak'] - r['before']) / n:.0f} B/event); arrays kept {mb(r['kept'])}, {r['kept'] / n:.1f} B/event, "
          f"{r['kept'] / path.stat().st_size:.1f} B per byte of log")
    return r


async def measure(path: Path) -> dict:
    from textual import events
    from tui.app import TraceApp

    class TimedApp(TraceApp):
        """The app, with the time of its last screen update recorded."""
        last_display = 0.0

        def _display(self, screen, renderable) -> None:
            super()._display(screen, renderable)
            if renderable is not None:
                self.last_display = time.perf_counter()

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


def report_open(path: Path, label: str) -> dict:
    r = in_child("open", path)
    size = path.stat().st_size
    print(f"  open of {label} ({r['events']:,} events, {size:,} bytes = {size / 2**20:,.0f} MiB): peak RSS "
          f"{mb(r['peak'])}, {'spilled to disk' if r['spilled'] else 'in memory'}; loaded in {r['loaded']:.1f} s, "
          f"the views' first lines by {r['seconds']:.1f} s ({r['shown']:,} events listed)")
    return r


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, nargs="*", default=[1_000_000, 10_000_000])
    p.add_argument("--dir", default="/tmp", help="where the synthetic logs are written (kept for reuse)")
    p.add_argument("--no-keys", action="store_true", help="memory only: the index, not the app")
    p.add_argument("--hostile", action="store_true", help="verify and the index on the issue's hostile log")
    p.add_argument("--minimal", type=int, default=0, help="also index a log of this many 4-byte events")
    p.add_argument("--open", action="store_true", help="the viewer's open (its data model), not the index alone")
    a = p.parse_args()
    cpu = f"{platform.machine()}, {os.cpu_count()} cores"
    if a.hostile:
        path = Path(a.dir) / "bench-view-hostile.mdt"
        hostile(path)
        v = in_child("verify", path)
        print(f"hostile log ({path.stat().st_size / 1e6:.1f} MB): verify {v['seconds']:.1f} s, peak RSS "
              f"{mb(v['peak'])}, {v['lines']:,} lines printed, the last: {v['last']!r}")
        report_index(path, "the hostile log")
    if a.minimal:
        path = Path(a.dir) / f"bench-view-minimal-{a.minimal}.mdt"
        if not path.exists():
            minimal(path, a.minimal)
        print(f"minimal log ({path.stat().st_size / 1e6:,.0f} MB):")
        if a.open:
            report_open(path, "the minimal log")
        else:
            report_index(path, "the minimal log")
    for n in a.events:
        path = Path(a.dir) / f"bench-view-{n}.mdt"
        if not path.exists():
            t = time.perf_counter()
            synthesize(path, n)
            print(f"wrote {path} ({path.stat().st_size >> 20} MiB) in {time.perf_counter() - t:.1f} s")
        print(f"\n{n:,} events ({path.stat().st_size / 1e6:,.0f} MB), CPU {cpu}")
        if a.open:
            report_open(path, f"{n:,} events")
            continue
        ix = report_index(path, f"{n:,} events")
        if a.no_keys:
            continue
        r = in_child("view", path)
        print(f"  view: peak RSS {mb(r['peak'])}, {r['peak'] / ix['events']:.0f} B/event")
        allkeys = [v for vs in r["keys"].values() for v in vs]
        worst = max(r["keys"].items(), key=lambda kv: max(kv[1]))
        print(f"  first paint {1000 * r['first_paint']:.0f} ms, indexed {r['indexed']:.2f} s")
        for k, vs in r["keys"].items():
            print(f"  key {k:<24} median {1000 * statistics.median(vs):6.1f} ms  worst {1000 * max(vs):6.1f} ms")
        print(f"| view, {n:,} events ({path.stat().st_size >> 20} MiB) | {cpu} | first paint "
              f"{1000 * r['first_paint']:.0f} ms | indexed {r['indexed']:.1f} s | keys: median "
              f"{1000 * statistics.median(allkeys):.0f} ms, worst {1000 * max(worst[1]):.0f} ms ({worst[0]}) | "
              f"index {ix['seconds']:.1f} s, {ix['kept'] / ix['events']:.0f} B/event kept, peak RSS "
              f"{mb(ix['peak'])} | view peak RSS {mb(r['peak'])} |")


if __name__ == "__main__":
    main()
