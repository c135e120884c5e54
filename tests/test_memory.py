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


# ---- a log too big for the memory there is ---------------------------------------------------------------
def test_a_log_too_big_for_the_memory_available_is_refused_in_one_sentence(decode_200k, tmp_path):
    """With a footer, before the scan (nothing indexed, no progress); without one (a log cut short, or still
    being written), as soon as the scan has seen more events than the budget plans for. Either way one sentence
    naming the log, its events and the memory; a budget that fits indexes it all."""
    from tracing.index import BYTES_PER_EVENT, TooBig
    path, n = decode_200k
    seen = []
    with pytest.raises(TooBig) as refused:
        TraceIndex(TraceFile(path), seen.append, budget=n * BYTES_PER_EVENT // 2)
    message = str(refused.value)
    assert not seen and f"it holds {n:,} events" in message and str(path) in message
    assert "\n" not in message and message.endswith(").")

    cut = tmp_path / "cut.mdt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 4])
    with pytest.raises(TooBig, match=r"it holds at least [\d,]+ events"):
        TraceIndex(TraceFile(cut), seen.append, budget=n * BYTES_PER_EVENT // 4)
    assert seen, "refused after the scan had begun"
    assert len(TraceIndex(TraceFile(path), budget=n * BYTES_PER_EVENT + (1 << 20))) == n


def test_view_says_a_log_is_too_big_before_it_starts(decode_200k, monkeypatch, capsys):
    """`mdi-trace view` on a log whose footer counts more events than this machine's available memory can
    index: exit 2 and one sentence, before Textual (or the terminal check) is reached."""
    import tui.data
    from tui.cli import main
    path, n = decode_200k
    monkeypatch.setattr(tui.data, "available_memory", lambda: tui.data.MEMORY_MARGIN + 10 * n)
    assert main(["view", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mdi-trace:") and "too big to index" in err and len(err.splitlines()) == 1


def test_available_memory_reads_the_machine_and_its_cgroup():
    from tui.data import available_memory
    free = available_memory()
    if Path("/proc/meminfo").exists():
        assert free is not None and 0 < free < 1 << 50
