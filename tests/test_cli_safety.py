"""The command line never destroys a file, stops cleanly on any stop signal, and explains itself (issue #17):
record refuses an existing trace unless --force and removes only what it created, SIGTERM and SIGHUP end
a record as Ctrl-C does, every option has help and a default, flags that would be ignored are refused,
export takes a run's name, and what the project writes is readable by others (0644 files, 0755 folders)."""
import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracing.reader import open_trace
from tui.cli import _parser, _Stop, Interrupted, main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "traces" / "examples"


def run_main(args, capsys):
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own exit, after its message
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return code, out


@pytest.fixture
def existing(tmp_path):
    """A good trace at y.mdt, as a user's earlier recording."""
    path = tmp_path / "y.mdt"
    shutil.copy(EXAMPLES / "micro-preempt-cancel.mdt", path)
    return path


def test_a_failed_or_refused_record_leaves_an_existing_trace_as_it_was(existing, checkpoint, capsys, tmp_path):
    before = existing.read_bytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 99999999]}\n')
    for args in (["--model", "nosuchmodel"], ["--model", checkpoint, "--device", "cuda"], ["--temperature", "-1"],
                 ["--model", checkpoint],  # no --force: refused before anything loads
                 ["--model", checkpoint, "--prompts", prompts, "--force"]):  # refused after the model loads
        code, out = run_main(["record", "-o", existing, *args], capsys)
        assert code == 2, (args, out.err)
        assert out.err.startswith("mdi-trace: ") and len(out.err.strip().splitlines()) == 1, out.err
        assert existing.read_bytes() == before, args
    assert "exists; give another -o, or --force" in run_main(["record", "-o", existing, "--model", checkpoint],
                                                             capsys)[1].err
    assert "99999999 is not in the model's vocabulary" in run_main(
        ["record", "-o", tmp_path / "new.mdt", "--model", checkpoint, "--prompts", prompts], capsys)[1].err
    assert not (tmp_path / "new.mdt").exists()  # a refused record creates nothing


def test_record_force_replaces_the_trace(existing, checkpoint, capsys):
    code, _ = run_main(["record", "-o", existing, "--model", checkpoint, "--num-prompts", "2", "--input-len", "8:8",
                        "--output-len", "2:2", "--force"], capsys)
    assert code == 0
    with open_trace(existing) as t:
        assert t.clean and t.header["argv"][-1] == "--force"


def test_a_stop_signal_before_the_run_raises_and_during_it_asks_the_run_to_stop():
    for signum in _Stop.SIGNALS:
        with _Stop() as stop:
            with pytest.raises(Interrupted) as e:
                os.kill(os.getpid(), signum)
                time.sleep(1)  # the handler runs at the next bytecode boundary
            assert e.value.code == 128 + signum
        with _Stop() as stop:
            stop.running = True
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
            assert stop.signum == signum and stop.code == 128 + signum
        assert signal.getsignal(signum) is not stop._received  # handlers put back


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_sigterm_during_a_record_cancels_the_requests_and_writes_the_footer(tmp_path, checkpoint, signum):
    trace = tmp_path / "t.mdt"
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "record", "-o", str(trace), "--model", str(checkpoint),
                             "--num-prompts", "64", "--output-len", "200:300", "--cancel-rate", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not (trace.exists() and trace.stat().st_size > 4096) and time.monotonic() < deadline:
        time.sleep(0.05)  # a few steps are in the log
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "interrupted (SIGTERM); the unfinished requests were cancelled" in err and "Traceback" not in err
    with open_trace(trace) as t:
        assert t.clean  # the footer is written
    assert main(["verify", str(trace)]) == 0


def test_every_option_has_help_and_says_its_default():
    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)
    for p in parsers(_parser()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest == "help":
                continue
            assert action.help, (p.prog, action.dest)
            shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
            if shown:
                assert "default" in p._get_formatter()._get_help_string(action), (p.prog, action.dest)


def test_version_and_a_bare_call(capsys):
    code, out = run_main(["--version"], capsys)
    assert code == 0 and out.out.startswith("mdi-trace ") and "schema version 3, reads versions 1, 2 and 3" in " ".join(out.out.split())
    code, out = run_main([], capsys)
    assert code == 2 and out.out.startswith("usage: mdi-trace") and "record" in out.out and "check" in out.out


@pytest.mark.parametrize("args, word", [
    (["check", "--scheduler", "--step", "3"], "--step"),
    (["check", "--scheduler", "--until", "3"], "--until"),
    (["check", "--scheduler", "--against", "reference"], "--against"),
    (["check", "--against", "reference", "--step", "2"], "--step N"),
    (["check", "--model", "nosuchmodel"], "neither a preset nor a folder; give a preset (tiny-68m, micro"),
    (["export", "{out}"], "exists; give another -o, or --force"),
    (["export", "{trace}", "-o", "/no/such/folder/x.json"], "/no/such/folder/x.json: no such file or directory."),
])
def test_flags_that_would_be_ignored_and_bad_paths_are_one_sentence(args, word, capsys, tmp_path, existing):
    (tmp_path / "out.json").write_text("{}")
    args = [a.format(out=tmp_path / "out.json", trace=existing) for a in args]
    if args[0] == "check":
        args.append(str(existing))
    if args[:2] == ["export", str(tmp_path / "out.json")]:
        args = ["export", str(existing), "-o", str(tmp_path / "out.json")]
    code, out = run_main(args, capsys)
    assert code == 2 and word in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "Errno" not in out.err
    assert (tmp_path / "out.json").read_text() == "{}"  # never overwritten without --force


def test_export_takes_a_run_name_and_writes_a_process_per_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["export", EXAMPLES / "micro-2rank.mdt"], capsys)
    assert code == 0 and "of 2 ranks" in out.out
    doc = json.loads((tmp_path / "micro-2rank.perfetto.json").read_text())  # in the current folder
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {1: "rank 0", 2: "rank 1"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {1, 2}
    flows = [e["id"] for e in doc["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == len(set(flows))  # one id per (step, rank)
    code, _ = run_main(["export", EXAMPLES / "micro-2rank.rank1.mdt", "-o", "one.json"], capsys)
    doc = json.loads((tmp_path / "one.json").read_text())
    assert code == 0 and {e["pid"] for e in doc["traceEvents"]} == {2}  # the rank named, alone


def test_checkpoints_and_the_cache_are_readable_by_others(tmp_path, monkeypatch, capsys):
    from model.checkpoint import default_checkpoint, umask

    monkeypatch.setenv("MDI_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        folder = default_checkpoint("micro")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o644}
    assert umask() == old
    code, out = run_main(["checkpoint", "init", "--preset", "micro", "-o", folder], capsys)
    assert code == 2 and "already holds a checkpoint" in out.err  # not replaced without --force


def test_a_malformed_tokenizer_json_is_one_sentence(tmp_path, checkpoint, capsys):
    folder = tmp_path / "ck"
    shutil.copytree(checkpoint, folder)
    (folder / "tokenizer.json").write_text("{bad")
    code, out = run_main(["generate", "--model", folder, "--num-prompts", "1", "--max-tokens", "1"], capsys)
    assert code == 2 and out.err.startswith(f"mdi-trace: cannot read {folder / 'tokenizer.json'}: ")
    assert len(out.err.strip().splitlines()) == 1
