"""Memory bounded by the log's size, not by what it claims (issue #17): the index keeps at most 64 bytes per
event and peaks near that while it builds; `verify` keeps the first MAX_FINDINGS violations and counts the rest;
a block_alloc naming millions of ids, a pool or footer that claims a huge size, or one event as large as the
reader admits costs memory in proportion to the bytes there are. Cheap: synthetic logs written directly, no model.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from tracing import Recorder
from tracing.index import TraceIndex
from tracing.reader import TraceError, TraceFile
from tracing.schema import KIND, MAGIC, SCHEMA_VERSION, TRAILER_TAG
from tracing.verify import MAX_FINDINGS, Finding, Findings, verify

ROOT = Path(__file__).resolve().parent.parent
PARAMS = SimpleNamespace(temperature=1.0, max_tokens=1 << 30, ignore_eos=True, stop_token_ids=[])


def decode_log(path: Path, n_events: int, batch: int = 16, sampled: int | None = None) -> int:
    """A log of about `n_events` events, as the viewer benchmark writes them: steps of `batch` rows (schedule, a
    reservation and a token per sampled row, three CPU spans, a device span, a digest), a request preempted and
    replaced every 50 steps. All rows sample (decode), or the first `sampled` (the rest stand for prompt chunks:
    more rows per event). Returns the number of events."""
    sampled = batch if sampled is None else sampled
    rec = Recorder(path, argv=["test_memory"])
    rec.start({"engine": {"max_num_seqs": batch, "num_kv_blocks": 2 * batch, "num_state_slots": batch},
               "model": {}, "device": "synthetic"})
    seqs, nxt, step = list(range(batch)), batch, 0
    for s in seqs:
        rec.request_added(s, list(range(64)), PARAMS, s)
        rec.slot_alloc(s, s)
        rec.block_alloc(s, [2 * s, 2 * s + 1])
    while sum(rec.counts.values()) < n_events:
        preempted = []
        if step % 50 == 49:
            k = (step // 50) % batch
            old = seqs[k]
            rec.preempt(step, old)
            rec.epoch_bump(old, 1, "preempt")
            rec.block_free(old, [2 * k, 2 * k + 1])
            rec.slot_free(old, k)
            rec.finish(step, old, "length")
            seqs[k], preempted = nxt, [old]
            rec.request_added(nxt, list(range(64)), PARAMS, nxt)
            rec.slot_alloc(nxt, k)
            rec.block_alloc(nxt, [2 * k, 2 * k + 1])
            nxt += 1
        rows = [SimpleNamespace(seq_id=s, epoch=0, start=64 + step, token_ids=[None], block_table=[2 * k, 2 * k + 1],
                                state_slot=k, sample=k < sampled, seed=s, temperature=1.0, output_position=step)
                for k, s in enumerate(seqs)]
        rec.schedule(SimpleNamespace(step=step, batch_kind="decode", rows=rows, preempted=preempted))
        for s in seqs[:sampled]:
            rec.reservation(step, s, 0, step)
        base = rec.t0 + 400_000 * step
        rec.cpu_span(step, "schedule", base, base + 20_000)
        rec.cpu_span(step, "execute", base + 20_000, base + 60_000)
        rec.device_span(step, base + 65_000, base + 400_000)
        for s in seqs[:sampled]:
            rec.token(step, s, 0, 65 + step, 1000 + s, True)
        rec.step_digest(step, "0123456789abcdef")
        rec.cpu_span(step, "process", base + 400_000, base + 430_000)
        rec.step_end(step)
        step += 1
    n = sum(rec.counts.values())
    rec.close()
    return n


def kept_bytes(obj, depth: int = 2) -> int:
    """Bytes of the numpy arrays an object keeps: its attributes, and theirs (tables, lookups), but not the
    TraceFile (the mapped log)."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if depth == 0 or isinstance(obj, (TraceFile, int, float, str, type(None))):
        return 0
    names = list(getattr(obj, "__dict__", {})) + [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    return sum(kept_bytes(getattr(obj, n, None), depth - 1) for n in set(names))


@pytest.fixture(scope="module")
def decode_200k(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("memory") / "decode.mdt"
    return path, decode_log(path, 200_000)


# ---- the index ------------------------------------------------------------------------------------------
def test_the_index_keeps_at_most_64_bytes_per_event(decode_200k, tmp_path):
    """On the viewer benchmark's decode log (the old index kept 61 bytes per event), and on one with more batch
    rows than events (16 rows a step, 4 of them sampled: the old index kept 24 bytes per row, 82 per event)."""
    chunked = tmp_path / "chunked.mdt"
    logs = [decode_200k, (chunked, decode_log(chunked, 60_000, sampled=4))]
    for path, n in logs:
        index = TraceIndex(TraceFile(path))
        assert len(index) == n
        per_event = kept_bytes(index) / n
        assert per_event <= 64, f"the index of {path.name} keeps {per_event:.1f} bytes per event"
        if hasattr(index, "nbytes"):
            assert index.nbytes == kept_bytes(index)


PEAK = """
import sys
from tracing.index import TraceIndex
from tracing.reader import TraceFile
def status(field):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(field + ":"))
trace = TraceFile(sys.argv[1])
before = status("VmRSS")
index = TraceIndex(trace)
print(len(index), status("VmHWM") - before)
"""


def peak_of_index(path: Path) -> tuple[int, int]:
    """(events, bytes the peak RSS grew by) of building the index of `path` in a fresh process (VmHWM: the
    mapped log's pages included)."""
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n, grown = map(int, out.stdout.split()[-2:])
    return n, grown


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_the_index_build_peaks_near_what_it_keeps(decode_200k):
    """The peak of the build stays under 64 bytes per event plus a few MB (one chunk's decoded events, the pages
    of the log not yet handed back, the allocator's slack): no Python list of every event's ints (the old build
    peaked at ~290 bytes per event)."""
    path, n = decode_200k
    events, grown = peak_of_index(path)
    assert events == n
    assert grown <= 64 * n + (12 << 20), f"the build grew the process by {grown / n:.0f} bytes per event"


def test_a_scan_in_small_chunks_gives_the_same_index(tmp_path, monkeypatch):
    """Chunk boundaries (of the scan, of a block event's ids, of the lookups' blocks) change nothing."""
    import tracing.index as ix
    path = tmp_path / "decode.mdt"
    decode_log(path, 6000)
    whole = TraceIndex(TraceFile(path))
    monkeypatch.setattr(ix, "CHUNK_EVENTS", 7, raising=False)
    monkeypatch.setattr(ix, "CHUNK_BYTES", 100, raising=False)
    monkeypatch.setattr(ix, "BIG_LIST", 3, raising=False)
    if hasattr(ix, "_Groups"):
        monkeypatch.setattr(ix._Groups, "BLOCK", 5)
    small = TraceIndex(TraceFile(path))
    for name in ("offset", "kind", "step", "seq_id", "t", "step_offsets", "_row_seq"):
        assert np.array_equal(getattr(whole, name), getattr(small, name)), name
    for table in ("steps", "resources"):
        for name in type(getattr(whole, table)).__slots__:
            a, b = getattr(getattr(whole, table), name), getattr(getattr(small, table), name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (table, name)
    for s in (-1, 0, 7, 48, 49, 10**6):
        assert np.array_equal(whole.events_of_step(s), small.events_of_step(s))
    for q in (0, 3, 16, 17, 10**6):
        assert np.array_equal(whole.events_of_request(q), small.events_of_request(q))


def test_a_footer_that_claims_a_huge_count_allocates_nothing_for_it(tmp_path, traced_peak):
    """A clean log's footer counts may size the columns, but only as many as its bytes can hold."""
    pack = msgpack.Packer(use_bin_type=True).pack
    out = bytearray(pack({"magic": MAGIC, "schema_version": SCHEMA_VERSION, "t0_ns": 0}))
    out += pack([KIND["step_digest"], 0, "0123456789abcdef"])
    footer = len(out)
    out += pack([KIND["footer"], {"step_digest": 10**15}, 0, [], True])
    out += bytes([TRAILER_TAG]) + footer.to_bytes(8, "big")
    (tmp_path / "claim.mdt").write_bytes(bytes(out))
    with traced_peak() as traced:
        with pytest.raises(TraceError, match="footer"):
            TraceIndex(TraceFile(tmp_path / "claim.mdt"))
    peak = traced.bytes
    assert peak < 16 << 20


# ---- verify ---------------------------------------------------------------------------------------------
def log_with(path: Path, events, num_kv_blocks=64) -> Path:
    """A clean log (header, the events as (hook, args) calls on a Recorder, footer)."""
    rec = Recorder(path, argv=["test_memory"])
    rec.start({"engine": {"num_kv_blocks": num_kv_blocks, "num_state_slots": 4, "max_num_seqs": 4},
               "model": {}, "device": "synthetic"})
    for hook, *args in events:
        getattr(rec, hook)(*args)
    rec.close()
    return path


def test_verify_keeps_the_first_100_violations_and_counts_them_all(tmp_path):
    path = log_with(tmp_path / "tokens.mdt", [("token", k, 7, 0, k, 1, True) for k in range(300)])
    findings = verify(TraceFile(path))
    assert isinstance(findings, list) and MAX_FINDINGS == 100
    assert len(findings) == 100 and findings.total == 300
    assert all(f.violation and f.message == "a token for a request that was never added" for f in findings)
    offsets = [e.offset for e in TraceFile(path).events()][:100]
    assert [f.offset for f in findings] == offsets   # the first ones, in log order


def test_findings_of_several_logs_keep_100_in_all():
    """verify_run merges the ranks' findings: 100 kept over the run, every violation and note counted."""
    def of(rank: int, n: int) -> Findings:
        return Findings(Finding(k, None, k, f"violation {k}") for k in range(n))
    run = Findings()
    run.merge(of(0, 80), rank=0)
    run.merge(of(1, 150), rank=1)       # itself keeps 100 and counts 150
    run.add(Finding(None, None, None, "a note", violation=False))
    assert run.total == 230 and sum(f.violation for f in run) == 100 and len(run) == 101
    assert [f.rank for f in run[:81]] == [0] * 80 + [1]


def test_verify_of_block_allocs_naming_half_a_million_ids_stays_small(tmp_path, traced_peak):
    """The issue's hostile log, smaller: block_alloc events naming 2**18 one-byte ids each (0-127, a pool of 64),
    for a request that exists. Ids outside the pool are one finding per event; the ids allocated again and again
    are counted, not kept; the request's table and the owner list stay the pool's size."""
    ids = [b % 128 for b in range(1 << 18)]
    path = log_with(tmp_path / "hostile.mdt", [("request_added", 0, [1, 2, 3], PARAMS, 0),
                                               ("block_alloc", 0, ids), ("block_alloc", 0, ids)])
    trace = TraceFile(path)
    with traced_peak() as traced:
        findings = verify(trace)
    peak = traced.bytes
    assert peak < 32 << 20, f"verify peaked at {peak >> 20} MiB"
    # each event: 2**17 ids outside the pool, one finding; 2**17 inside, the first 64 taken, the rest allocated
    # again; at the end the request never finished and holds 64 blocks
    assert len(findings) == 100 and findings.total == 2 + (1 << 18) - 64 + 2
    outside = [f for f in findings if "outside the pool of 64" in f.message]
    assert len(outside) == 1 and "(131,072 in all)" in outside[0].message   # the second event's is counted
    assert len(str(findings[-1])) < 500


def test_a_pool_that_claims_a_huge_size_allocates_nothing_for_it(tmp_path, traced_peak):
    for blocks in (1 << 40, (1 << 20) + 1):
        path = log_with(tmp_path / "pool.mdt", [("request_added", 0, [1, 2, 3], PARAMS, 0),
                                                ("block_alloc", 0, [5, 1 << 41])], num_kv_blocks=blocks)
        with traced_peak() as traced:
            findings = verify(TraceFile(path))
        peak = traced.bytes
        assert peak < 4 << 20, f"verify of a pool of {blocks} peaked at {peak >> 20} MiB"
        assert any("outside the pool" in f.message for f in findings)


def test_freeing_many_blocks_is_linear(tmp_path):
    """A request freeing 2**16 blocks (in reverse order) is checked in one pass, not one list search per id."""
    n = 1 << 16
    path = log_with(tmp_path / "free.mdt", [("request_added", 0, [1, 2, 3], PARAMS, 0),
                                            ("block_alloc", 0, list(range(n))),
                                            ("block_free", 0, list(range(n))[::-1])], num_kv_blocks=n)
    start = time.perf_counter()
    findings = verify(TraceFile(path))
    assert time.perf_counter() - start < 5
    assert not any("freed while" in f.message for f in findings)


# ---- one event as large as the reader admits ---------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_an_event_of_4m_block_ids_costs_its_own_size(tmp_path):
    """One block_alloc of 2**22 ids (the longest array the reader admits): the index keeps 17 bytes per id (its
    resource rows) and peaks at a few times that, in a fresh process (its peak RSS, VmHWM)."""
    path = log_with(tmp_path / "big.mdt", [("block_alloc", 0, [b % 256 for b in range(1 << 22)])])
    events, grown = peak_of_index(path)
    assert events == 1
    assert grown < 300 << 20, f"the index of one 4M-id event grew the process by {grown >> 20} MiB"


# ---- a log too big for the memory there is: spilled to disk, or refused ---------------------------------
def spill_here(monkeypatch, tmp_path, ram_limit: int = 0) -> Path:
    """Make every index given a budget spill (above `ram_limit` planned bytes) to a cache of its own, sorting
    small ranges and reading small blocks, so a small log goes through every branch of tracing/spill.py. Returns
    the spill folder."""
    import tracing.index as ix
    import tracing.spill as sp
    monkeypatch.setenv("MDI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ix, "RAM_LIMIT", ram_limit)
    monkeypatch.setattr(sp, "GROUP_KEYS", 1000)    # ranges of at most 1000 positions (a step's 33 events fit)
    monkeypatch.setattr(sp, "BLOCK", 777)
    return tmp_path / "cache" / "index"


def cache_mappings(folder: Path) -> list[str]:
    """The process's mappings and descriptors of files in `folder` (nameless ones still show its path)."""
    fds = Path("/proc/self/fd")
    links = [str(p.readlink()) for p in fds.iterdir() if p.is_symlink()] if fds.exists() else []
    maps = Path("/proc/self/maps").read_text().splitlines() if Path("/proc/self/maps").exists() else []
    return [line for line in maps + links if str(folder) in line]


def same_index(a: TraceIndex, b: TraceIndex) -> None:
    for name in ("offset", "kind", "step", "seq_id", "t", "appended", "step_offsets", "_row_seq", "_sched_event"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for table in ("steps", "resources"):
        for name in type(getattr(a, table)).__slots__:
            x, y = getattr(getattr(a, table), name), getattr(getattr(b, table), name)
            assert x.dtype == y.dtype and np.array_equal(x, y), (table, name)
    for group in ("_by_step", "_by_seq", "_rows_by_seq"):
        for name in ("order", "values", "starts"):
            x, y = getattr(getattr(a, group), name), getattr(getattr(b, group), name)
            assert x.dtype == y.dtype and np.array_equal(x, y), (group, name)
    for s in (-1, 0, 7, 48, 49, 10**6):
        assert np.array_equal(a.events_of_step(s), b.events_of_step(s))
        assert np.array_equal(a.events_of_step(s, "token"), b.events_of_step(s, "token"))
    for q in (0, 3, 16, 17, 10**6):
        assert np.array_equal(a.events_of_request(q), b.events_of_request(q))
    for kind in ("schedule", "preempt", "finish"):
        assert np.array_equal(a.events_of_kind(kind), b.events_of_kind(kind))
        assert [a.next_of_kind(kind, k, f) for k in (-1, 0, 999, len(a)) for f in (True, False)] == \
            [b.next_of_kind(kind, k, f) for k in (-1, 0, 999, len(a)) for f in (True, False)]
    assert a.summary == b.summary and np.array_equal(a.request_ids(), b.request_ids())


def test_a_log_over_the_memory_budget_is_spilled_to_disk_and_answers_the_same(decode_200k, tmp_path, monkeypatch):
    """The index's columns, resource rows, batch rows and lookups go to nameless files in MDI_CACHE/index,
    mapped: the same answers as in memory, the viewer's model over it too; nothing of it in memory but the step
    table, and nothing left on disk or mapped once it is closed."""
    from tracing.index import BYTES_PER_EVENT
    from tui.data import TraceModel
    from tui.format import EventFilter
    path, n = decode_200k
    small = tmp_path / "small.mdt"
    decode_log(small, 6000)
    whole, model = TraceIndex(TraceFile(small)), TraceModel(small)
    model.load()
    folder = spill_here(monkeypatch, tmp_path)
    spilled, spilled_model = TraceIndex(TraceFile(small), budget=1 << 40), TraceModel(small)
    spilled_model.load(budget=1 << 40)
    assert spilled.spilled and not whole.spilled and spilled_model.index.spilled
    assert spilled.memory < spilled.nbytes // 10 and spilled.nbytes == whole.nbytes == kept_bytes(whole)
    assert cache_mappings(folder) and list(folder.iterdir()) == []    # in use, and no file has a name
    same_index(whole, spilled)
    for f in (EventFilter(), EventFilter(kinds=("token", "preempt")), EventFilter(seq_id=3), EventFilter(steps=(5, 9))):
        assert np.array_equal(model.filtered(f), spilled_model.filtered(f))
    for r in (0, 49, len(model.steps) - 1):
        assert model.step_detail(r) == spilled_model.step_detail(r)
        assert all(np.array_equal(x, y) for x, y in zip(model.owners(r), spilled_model.owners(r)))
    for name in ("seq_ids", "request_tokens", "request_stale", "request_preemptions", "blocks_in_use", "slots_in_use"):
        assert np.array_equal(getattr(model, name), getattr(spilled_model, name)), name
    assert model.prompt_len == spilled_model.prompt_len and model.overview() == spilled_model.overview()
    spilled.close()
    del spilled, spilled_model, f
    import gc
    gc.collect()
    assert cache_mappings(folder) == [] and list(folder.iterdir()) == []

    # the 200k log with a budget under what it needs in memory (it was refused): spilled, and complete
    import tracing.spill as sp
    monkeypatch.setattr(sp, "GROUP_KEYS", 1 << 23)
    monkeypatch.setattr(sp, "BLOCK", 1 << 20)
    big = TraceIndex(TraceFile(path), budget=(n * BYTES_PER_EVENT) // 2 + (512 << 20))
    assert big.spilled and len(big) == n   # and its footer's counts and step index agreed with the scan


def test_a_log_without_a_footer_spills_once_its_scan_passes_the_limit(decode_200k, tmp_path, monkeypatch):
    """A log cut short (or being written) is scanned into memory until its index is planned over RAM_LIMIT, then
    into files: the same index as the one in memory."""
    path, n = decode_200k
    cut = tmp_path / "cut.mdt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 8])
    whole = TraceIndex(TraceFile(cut))
    spill_here(monkeypatch, tmp_path, ram_limit=400_000)    # about the first 6000 events stay in memory
    spilled = TraceIndex(TraceFile(cut), budget=1 << 40)
    assert spilled.spilled and spilled.cut == whole.cut
    same_index(whole, spilled)


def test_a_log_too_big_for_memory_and_disk_is_refused_in_one_sentence(decode_200k, tmp_path, monkeypatch):
    """Refused only when neither the memory nor the disk can hold its index: with a footer, before the scan
    (nothing indexed, no progress); without one (a log cut short, or still being written), as soon as the scan has
    seen more events than the budget plans for. Either way one sentence naming the log, its events, the memory
    and the disk; a budget that fits indexes it all."""
    import tracing.index as ix
    from tracing.index import BYTES_PER_EVENT, TooBig
    path, n = decode_200k
    spill_here(monkeypatch, tmp_path, ram_limit=1 << 30)
    monkeypatch.setattr(ix, "disk_free", lambda: 10 << 20)
    seen = []
    with pytest.raises(TooBig) as refused:
        TraceIndex(TraceFile(path), seen.append, budget=n * BYTES_PER_EVENT // 2)
    message = str(refused.value)
    assert not seen and f"it holds {n:,} events" in message and str(path) in message
    assert "0.0 GiB of disk is free" in message and str(tmp_path / "cache") in message
    assert "\n" not in message and message.endswith(").")

    cut = tmp_path / "cut.mdt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 4])
    with pytest.raises(TooBig, match=r"it holds at least [\d,]+ events"):
        TraceIndex(TraceFile(cut), seen.append, budget=n * BYTES_PER_EVENT // 4)
    assert seen, "refused after the scan had begun"
    assert len(TraceIndex(TraceFile(path), budget=n * BYTES_PER_EVENT + (1 << 20))) == n


def test_an_unwritable_or_full_cache_is_one_sentence(decode_200k, tmp_path, monkeypatch):
    """MDI_CACHE naming a file, or the disk filling up mid-scan: a SpillError (a TraceError) in one sentence,
    and no file of the spill left open or mapped."""
    import errno
    import tracing.spill as sp
    path, _ = decode_200k
    folder = spill_here(monkeypatch, tmp_path)
    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(sp.SpillError, match=r"could not be written to .*index \(.*\): free some disk space"):
        TraceIndex(TraceFile(path), budget=1 << 40)
    (tmp_path / "cache").unlink()
    writes = []

    def write(fd, data):
        writes.append(len(data))
        if len(writes) > 50:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    real = sp.os.write
    monkeypatch.setattr(sp.os, "write", write)
    with pytest.raises(TraceError) as full:
        TraceIndex(TraceFile(path), budget=1 << 40)
    assert isinstance(full.value, sp.SpillError) and "No space left on device" in str(full.value)
    assert "\n" not in str(full.value)
    import gc
    gc.collect()
    assert cache_mappings(folder) == []


OPEN = """
import sys
import tracing.index
from tui.data import TraceModel
def status(field):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(field + ":"))
import tracing.spill
tracing.index.RAM_LIMIT = int(sys.argv[2])
tracing.spill.BLOCK = tracing.spill.GROUP_KEYS = 1 << 16   # the working set: blocks and ranges of 64k positions
model = TraceModel(sys.argv[1])
before = status("VmRSS")
model.load(budget=1 << 40)
print(len(model.index), int(model.index.spilled), status("VmHWM") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_spilled_index_of_minimal_events_keeps_the_viewer_small(tmp_path):
    """1M 4-byte events (the most a byte of log holds): in memory the viewer's model grows the process by ~47 MB
    (47 bytes per event at its peak); spilled, by its working set (blocks of 64k positions here), in a fresh
    process (VmHWM)."""
    path = tmp_path / "minimal.mdt"
    n = 1_000_000
    pack = msgpack.Packer(use_bin_type=True).pack
    with open(path, "wb") as f:
        f.write(pack({"magic": MAGIC, "schema_version": SCHEMA_VERSION, "t0_ns": 0, "engine": {}}))
        offset = f.tell()
        f.write(pack([KIND["schedule"], 0, 0, 1, [], []]) + pack([KIND["step_digest"], 0, ""]) * n)
        footer = f.tell()
        f.write(pack([KIND["footer"], {"schedule": 1, "step_digest": n}, 1, [[0, offset]], True]))
        f.write(bytes([TRAILER_TAG]) + footer.to_bytes(8, "big"))
    out = subprocess.run([sys.executable, "-c", OPEN, str(path), "0"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**__import__("os").environ, "MDI_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-2000:]
    events, spilled, grown = map(int, out.stdout.split()[-3:])
    assert events == n + 1 and spilled
    assert grown < 16 << 20, f"the spilled index of {n:,} events grew the process by {grown >> 20} MiB"


def test_view_says_a_log_is_too_big_before_it_starts(decode_200k, tmp_path, monkeypatch, capsys):
    """`mdi-trace view` on a log whose footer counts more events than this machine's available memory and its
    disk can index: exit 2 and one sentence, before Textual (or the terminal check) is reached. With the disk
    free, the same log passes the check (its index will spill) and goes on to the terminal check."""
    import tracing.index as ix
    import tui.data
    from tui.cli import main
    path, n = decode_200k
    spill_here(monkeypatch, tmp_path, ram_limit=1 << 30)
    monkeypatch.setattr(ix, "SPILL_MEMORY", 1 << 20)     # what a spilled index keeps in memory fits: ~3 MB
    monkeypatch.setattr(tui.data, "available_memory", lambda: tui.data.MEMORY_MARGIN + 20 * n)
    monkeypatch.setattr(ix, "disk_free", lambda: 1 << 20)
    assert main(["view", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mdi-trace:") and "too big to index" in err and len(err.splitlines()) == 1
    monkeypatch.setattr(ix, "disk_free", lambda: 1 << 40)
    assert main(["view", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a terminal" in err, err


def test_available_memory_reads_the_machine_and_its_cgroup():
    from tui.data import available_memory
    free = available_memory()
    if Path("/proc/meminfo").exists():
        assert free is not None and 0 < free < 1 << 50
