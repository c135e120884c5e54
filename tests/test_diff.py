"""`mdi-trace diff A B`: the first step where two traces' decisions or tokens differ, both sides shown."""
import subprocess
import sys
from pathlib import Path

from test_verify import field, find, read_log, record_preemption, set_field, write_log

from tracing.diff import diff_traces
from tracing.reader import open_trace

ROOT = Path(__file__).resolve().parent.parent


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tui.cli", "diff", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT)


def test_zos_on_and_off_sample_the_same_tokens_but_decide_differently(checkpoint, tmp_path):
    on = record_preemption(checkpoint, tmp_path / "on.mdt", enable_zos=True)
    off = record_preemption(checkpoint, tmp_path / "off.mdt", enable_zos=False)
    r = diff_traces(open_trace(on), open_trace(off))
    assert [f.what.split(" at ")[0] for f in r.findings] == ["decisions differ"]
    assert any("enable_zos" in str(n) or "engine" in n for n in r.header_notes)
    assert diff_traces(open_trace(on), open_trace(off), tokens_only=True).findings == []
    assert cli(on, off, "--tokens").returncode == 0
    run = cli(on, off)
    assert run.returncode == 1 and "decisions differ at step" in run.stdout


def test_a_changed_token_is_shown_from_both_sides(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30, appended=True)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = write_log(tmp_path / "edited.mdt", header, events)
    r = diff_traces(open_trace(src), open_trace(edited))
    (f,) = r.findings
    assert f.what == f"tokens differ: request {field(events[i], 'seq_id')}, position {field(events[i], 'position')}"
    assert f.a == f"token {field(events[i], 'token_id') - 1} (step {field(events[i], 'step')})"
    assert f.b == f"token {field(events[i], 'token_id')} (step {field(events[i], 'step')})"
    assert cli(src, src).returncode == 0


def test_a_changed_block_table_is_the_first_decision_to_differ(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "schedule", 40)
    rows = field(events[i], "rows")
    rows[0][5] += 1  # the state slot of the first row
    r = diff_traces(open_trace(src), open_trace(write_log(tmp_path / "edited.mdt", header, events)))
    assert r.findings[0].what == f"decisions differ at step {field(events[i], 'step')}, row 0"


def test_unreadable_input_is_one_sentence(tmp_path):
    bad = tmp_path / "bad.mdt"
    bad.write_bytes(b"not a trace")
    run = cli(bad, bad)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


def test_a_log_cut_short_is_compared_on_what_both_hold(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    cut = write_log(tmp_path / "cut.mdt", header, events[:len(events) // 2], footer=False)
    r = diff_traces(open_trace(src), open_trace(cut))
    assert r.findings == [] and any("compared up to step" in n for n in r.header_notes)
    i = find(events, "token", 0, appended=True)  # an early token changed in the cut log: still found
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = write_log(tmp_path / "cut2.mdt", header, events[:len(events) // 2], footer=False)
    (f,) = diff_traces(open_trace(src), open_trace(edited)).findings
    assert f.what.startswith("tokens differ")
