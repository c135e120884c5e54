"""tracing/latency.py and where it shows: a hand-written log whose every phase is known, its numbers checked
against hand-computed values in the scan, the index path, `mdi-trace info`, the Requests view's lifeline and
list, and the Perfetto export's request slices."""
import json
import re

import msgpack
import pytest

from tracing.export import chrome_trace
from tracing.index import TraceIndex
from tracing.latency import request_latency, scan_latency
from tracing.reader import TraceFile
from tracing.schema import CANCEL_CAUSES, EVENTS, FINISH_REASONS, KIND, MAGIC, SCHEMA_VERSION

STOP, LENGTH, ABORT = (FINISH_REASONS.index(r) for r in ("stop", "length", "abort"))


def row(seq_id, start, n, sample=True):
    return [seq_id, 0, start, list(range(n)), [seq_id], seq_id, sample, 7, 0.0, 0]


def event(kind, **fields):
    names = EVENTS[KIND[kind]][1]
    assert set(fields) == set(names), kind
    return [KIND[kind], *(fields[n] for n in names)]


def added(t, seq, arrival):
    return event("request_added", t=t, seq_id=seq, prompt_token_ids=[5, 6, 7], temperature=0.0, seed=1,
                 max_tokens=3, ignore_eos=True, stop_token_ids=[], arrival=arrival)


def token(t, step, seq, appended=True):
    return event("token", t=t, step=step, seq_id=seq, epoch=0, position=3, token_id=9, appended=appended)


def schedule(t, step, kind, *rows):
    return event("schedule", t=t, step=step, batch_kind=kind, rows=list(rows), preempted=[])


# Request 0: arrives at 1 µs, scheduled at 2, first token at 5, preempted at 9, scheduled again at 12, last token
# at 14, finishes (length) at 15. Request 1: arrives at 3, scheduled at 6, its one token stale, cancelled by
# its client (disconnect) at 9. Request 2: arrives at 4, scheduled at 12, tokens at 14, 16 and 20, stops at 20.
EVENTS_NS = [
    added(1_500, 0, 1_000),
    schedule(2_000, 0, 0, row(0, 0, 3)),
    added(3_000, 1, 3_000),
    added(4_000, 2, 4_000),
    token(5_000, 0, 0),
    schedule(6_000, 1, 1, row(0, 3, 1), row(1, 0, 3)),
    token(8_000, 1, 0),
    token(8_000, 1, 1, appended=False),
    event("cancel", t=9_000, step=2, seq_id=1, cause=CANCEL_CAUSES.index("disconnect")),
    event("preempt", t=9_000, step=2, seq_id=0),
    event("finish", t=9_500, step=2, seq_id=1, reason=ABORT),
    schedule(12_000, 3, 0, row(0, 0, 5), row(2, 0, 3)),
    token(14_000, 3, 0),
    token(14_000, 3, 2),
    event("finish", t=15_000, step=3, seq_id=0, reason=LENGTH),
    schedule(15_500, 4, 1, row(2, 3, 1)),
    token(16_000, 4, 2),
    schedule(18_000, 5, 1, row(2, 4, 1)),
    token(20_000, 5, 2),
    event("finish", t=20_000, step=5, seq_id=2, reason=STOP),
]


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "hand.mdt"
    header = {"magic": MAGIC, "schema_version": SCHEMA_VERSION, "time": "2026-01-02T03:04:05+00:00", "argv": [],
              "t0_ns": 0, "engine": {"num_kv_blocks": 8, "num_state_slots": 4}}
    path.write_bytes(b"".join(msgpack.packb(o, use_bin_type=True) for o in [header, *EVENTS_NS]))
    return path


def test_each_request_s_phases_and_latency_are_the_hand_computed_ones(log):
    lat = scan_latency(TraceFile(log))
    r0, r1, r2 = (lat.requests[s] for s in (0, 1, 2))
    assert r0.phases() == [("queued", 1_000, 2_000), ("prefill", 2_000, 5_000), ("decode", 5_000, 15_000),
                           ("preempted", 9_000, 12_000)]
    assert (r0.ttft_ns, r0.tpot_ns, r0.queued_ns, r0.preempted_ns, r0.outcome) == (4_000, 4_500, 1_000, 3_000,
                                                                                  "length")
    assert (r1.ttft_ns, r1.tpot_ns, r1.queued_ns, r1.tokens, r1.outcome) == (None, None, 3_000, 0,
                                                                           "cancelled: disconnect")
    assert r1.phases() == [("queued", 3_000, 6_000), ("prefill", 6_000, 9_500)]
    assert (r2.ttft_ns, r2.tpot_ns, r2.queued_ns, r2.preempted_ns, r2.outcome) == (10_000, 3_000, 8_000, 0, "stop")
    ttft, tpot, queued, preempted = (lat.stats(m) for m in ("ttft", "tpot", "queued", "preempted"))
    assert (ttft.count, ttft.mean, ttft.p50, ttft.p90, ttft.p99) == (2, 7_000, 7_000, 9_400, 9_940)
    assert (tpot.count, tpot.p50, tpot.max) == (2, 3_750, 4_500)
    assert (queued.count, queued.mean, queued.p50) == (3, 4_000, 3_000)
    assert (preempted.count, preempted.p50) == (1, 3_000)
    assert lat.outcomes_text() == "stop 1, length 1, cancelled 1 (disconnect 1)"
    index = TraceIndex(TraceFile(log))   # the viewer's path: the index's columns, three events decoded each
    assert all(request_latency(index, s) == lat.requests[s] for s in (0, 1, 2))


def test_info_prints_the_latency_table(log, capsys):
    from tui.cli import main
    assert main(["info", str(log)]) == 0
    out = capsys.readouterr().out
    ttft = next(line for line in out.splitlines() if "TTFT" in line and "│" in line)
    assert [c.strip() for c in ttft.split("│")[1:8]] == ["TTFT", "2", "7 µs", "7 µs", "9.4 µs", "9.94 µs", "10 µs"]
    assert "ends: stop 1, length 1, cancelled 1 (disconnect 1)" in out
    assert "arrivals: 3 requests from 1 µs (≈ 2026-01-02 03:04:05 UTC) to 4 µs after t0" in out


def test_the_lifeline_shows_each_phase_and_the_list_the_ttft(log):
    from tui.data import TraceModel
    m = TraceModel(log)
    m.load()
    head, evs = m.lifeline(0)
    assert head[0].startswith("request 0: arrived at 1 µs (≈ 03:04:05 UTC), added 500 ns later")
    assert head[1] == "  queued 1 µs, prefill 3 µs, decode 10 µs, preempted 3 µs (1×); TTFT 4 µs, TPOT 4.5 µs; length"
    lines = {int(i): m.lifeline_line(0, int(i)) for i in evs}
    marked = [m.group(1) for m in map(re.compile(r"\[([a-z][^\]]*)\]").search, lines.values()) if m]
    assert marked == ["queued: 1 µs", "first token, TTFT 4 µs; prefill: 3 µs", "preempted: 3 µs", "decode: 10 µs"]
    head1, evs1 = m.lifeline(1)
    assert head1[1] == "  queued 3 µs, prefill 3.5 µs; cancelled: disconnect"
    assert any("[cancelled: disconnect] cause disconnect" in m.lifeline_line(1, int(i)) for i in evs1)
    assert [m.request_line(k).split()[4:6] for k in range(3)] == [["4", "µs"], ["-", "abort"], ["10", "µs"]]


def test_the_perfetto_export_has_each_request_s_phases_as_nested_slices(log, tmp_path):
    events = chrome_trace(TraceFile(log))["traceEvents"]
    json.dumps(events)
    mine = [e for e in events if e.get("cat") == "request"]
    stack, slices = {}, []
    for e in mine:   # b/e in order, properly nested per request
        s = stack.setdefault(e["id"], [])
        if e["ph"] == "b":
            s.append(e)
        else:
            b = s.pop()
            assert b["name"] == e["name"] and b["ts"] <= e["ts"]
            slices.append((e["id"], e["name"], b["ts"], e["ts"], len(s)))
    assert all(not s for s in stack.values())
    assert sorted(x for x in slices if x[0] == 0) == [
        (0, "decode", 5.0, 15.0, 1), (0, "preempted", 9.0, 12.0, 2), (0, "prefill", 2.0, 5.0, 1),
        (0, "queued", 1.0, 2.0, 1), (0, "request 0", 1.0, 15.0, 0)]
    outer = next(e for e in mine if e["name"] == "request 1" and e["ph"] == "b")
    assert outer["args"]["end"] == "cancelled: disconnect" and outer["args"]["queued_ms"] == 0.003
    assert {e["ph"] for e in events} >= {"M", "i", "b", "e"}   # the existing tracks are still there
