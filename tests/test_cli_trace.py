"""`mdi-trace record`, `info` and `export` as a user runs them: a small recorded run, its summary, its
Perfetto JSON, a cut-short copy, and bad input as one sentence with exit 2."""
import json
import subprocess
import sys
from collections import Counter

import pytest

from tracing.reader import open_trace
from tracing.summary import summarize
from tui.cli import main


def mdi(*args):
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A micro run with a KV pool of 4 blocks (preemption) and cancellations, ZOS on."""
    tmp = tmp_path_factory.mktemp("rec")
    assert mdi("checkpoint", "init", "--preset", "micro", "-o", str(tmp / "ckpt")).returncode == 0
    trace = tmp / "run.mdt"
    run = mdi("record", "-o", str(trace), "--model", str(tmp / "ckpt"), "--num-prompts", "8", "--input-len",
              "100:250", "--output-len", "20:40", "--num-kv-blocks", "5", "--max-num-seqs", "4",
              "--cancel-rate", "0.5", "--seed", "1")
    assert run.returncode == 0, run.stderr
    return tmp, trace, run


def test_record_prints_a_summary_and_how_to_view_it(recorded):
    _, trace, run = recorded
    assert "requests" in run.stdout and "tokens/s" in run.stdout and "trace size" in run.stdout
    assert f"mdi-trace info {trace}" in run.stdout and f"mdi-trace verify {trace}" in run.stdout
    t = open_trace(trace)
    s = summarize(t)
    assert t.clean and t.cut is None  # shutdown wrote the footer
    assert s.requests == 8 and s.preemptions > 0 and s.cancellations > 0
    assert s.finish_reasons["abort"] == s.cancellations and sum(s.finish_reasons.values()) == 8
    assert t.header["argv"][:2] == ["mdi-trace", "record"] and t.header["engine"]["num_kv_blocks"] == 5


def test_info_shows_header_and_summary(recorded, capsys):
    _, trace, _ = recorded
    assert main(["info", str(trace)]) == 0
    out = capsys.readouterr().out
    for word in ("device", "checkpoint digest", "num_kv_blocks 5", "preemptions", "cancellations", "stale tokens",
                 "finish reasons", "device busy", "complete (footer present)"):
        assert word in out, word


def test_info_on_a_cut_short_copy_says_it_was_cut(recorded, capsys):
    tmp, trace, _ = recorded
    data = trace.read_bytes()
    cut = tmp / "cut.mdt"
    cut.write_bytes(data[:len(data) * 2 // 3])
    assert main(["info", str(cut)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the log was cut short" in out


def test_export_perfetto_is_valid_chrome_trace_json(recorded, capsys):
    tmp, trace, _ = recorded
    out = tmp / "run.json"
    assert main(["export", str(trace), "--format", "perfetto", "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    phases = Counter(e["ph"] for e in events)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"schedule", "execute", "process", "device"}
    assert any(e["ph"] == "M" and e["args"]["name"] == "engine" for e in events)
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    steps = summarize(open_trace(trace)).num_steps
    tid = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_track = Counter(e["tid"] for e in slices)
    assert by_track[tid["schedule"]] == by_track[tid["execute"]] == steps
    assert by_track[tid["device"]] == by_track[tid["process"]] > 0
    assert {e["name"].split()[0] for e in slices} == {"schedule", "execute", "process", "device"}
    # every flow starts inside an execute slice and ends inside the same step's device slice
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys() and all(e["bp"] == "e" for e in ends.values())
    span = {(e["tid"], int(e["name"].split()[1])): e for e in slices}
    for step, s in starts.items():
        ex, dev = span[(tid["execute"], step)], span[(tid["device"], step)]
        assert ex["ts"] <= s["ts"] <= ex["ts"] + ex["dur"]
        assert dev["ts"] <= ends[step]["ts"] <= dev["ts"] + dev["dur"]
    counters = {name: [e["args"]["free"] for e in events if e["ph"] == "C" and e["name"] == name]
                for name in ("free KV blocks", "free state slots")}
    assert counters["free KV blocks"][0] == 5 and min(counters["free KV blocks"]) >= 0
    assert counters["free KV blocks"][-1] == 5 and counters["free state slots"][-1] == 4  # all given back
    instants = Counter(e["name"].split()[0] for e in events if e["ph"] == "i")
    assert instants["preempt"] > 0 and instants["cancel"] > 0


def test_record_from_a_jsonl_file(recorded):
    tmp, _, _ = recorded
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7, 8], "max_tokens": 3}\n\n{"prompt": [9, 10]}\n')
    run = mdi("record", "-o", str(tmp / "j.mdt"), "--model", str(tmp / "ckpt"), "--prompts", str(prompts),
              "--output-len", "2:2", "--cancel-rate", "0")
    assert run.returncode == 0, run.stderr
    s = summarize(open_trace(tmp / "j.mdt"))
    assert s.requests == 2 and s.prompt_tokens == 6 and s.output_tokens <= 5


def arrivals_of(path):
    """(arrival, added) per request of a log, in ns since the first arrival."""
    added = [e for e in open_trace(path).events() if e.kind == "request_added"]
    return [(e.arrival - added[0].arrival, e.t - added[0].arrival) for e in added]


def test_record_with_poisson_arrivals_replays_the_drawn_offsets_and_checks_clean(recorded, capsys):
    from tests.test_workload import llm_like
    from tracing.workload import WorkloadSpec, draw
    tmp, _, _ = recorded
    out = tmp / "poisson.mdt"
    run = mdi("record", "-o", str(out), "--model", str(tmp / "ckpt"), "--num-prompts", "4", "--input-len", "10:30",
              "--output-len", "2:4", "--arrivals", "poisson:40", "--seed", "2")
    assert run.returncode == 0, run.stderr
    header = open_trace(out).header
    drawn = draw(WorkloadSpec(num_prompts=4, input_len=(10, 30), output_len=(2, 4), seed=2, arrivals="poisson:40"),
                 llm_like(header["model"]["vocab_size"], header["model"]["max_seq_len"])).arrivals
    got = arrivals_of(out)
    assert [a for a, _ in got] == [round(x * 1e9) - round(drawn[0] * 1e9) for x in drawn]   # to the ns
    assert all(t >= a for a, t in got)   # each added once it had arrived
    assert main(["verify", str(out)]) == 0 and main(["check", str(out), "--scheduler"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_record_replays_a_prompts_file_s_arrivals_in_arrival_order(recorded):
    tmp, _, _ = recorded
    prompts = tmp / "served.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7], "max_tokens": 2, "arrival": 0.15}\n'
                       '{"prompt": [9], "max_tokens": 2, "temperature": 0.7, "seed": 4, "arrival": 0.05}\n')
    out = tmp / "served.mdt"
    run = mdi("record", "-o", str(out), "--model", str(tmp / "ckpt"), "--prompts", str(prompts), "--cancel-rate", "0")
    assert run.returncode == 0, run.stderr
    added = [e for e in open_trace(out).events() if e.kind == "request_added"]
    assert [(e.prompt_token_ids, e.temperature) for e in added] == [([9], 0.7), ([5, 6, 7], 0.0)]
    assert added[0].seed == 4
    assert [a for a, _ in arrivals_of(out)] == [0, 100_000_000]


@pytest.mark.parametrize("args", [
    ["info", "/no/such/trace.mdt"],
    ["info", "{tmp}/p.txt"],
    ["export", "{tmp}/p.txt", "-o", "{tmp}/x.json"],
    ["export", "{trace}", "--format", "pprof"],
    ["record", "--input-len", "5:2"],
    ["record", "--output-len", "a:b"],
    ["record", "--cancel-rate", "2"],
    ["record", "--num-prompts", "0"],
    ["record", "--prompts", "/no/such/prompts.jsonl"],
    ["record", "--prompts", "{tmp}/p.txt"],
    ["record", "--arrivals", "poisson:0"],
    ["record", "--arrivals", "uniform:5"],
    ["record", "--virtual-clock", "-1"],
    ["record", "--virtual-clock", "5"],
])
def test_bad_input_is_one_sentence_and_exit_2(recorded, args, capsys):
    tmp, trace, _ = recorded
    (tmp / "p.txt").write_text("not json\n")
    args = [a.format(tmp=tmp, trace=trace) for a in args]
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own exit, after its one-line message
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (args, err)
    assert err.startswith("mdi-trace: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
