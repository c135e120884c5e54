"""Scheduler replay (`tracing.replay`, `mdi-trace check --scheduler`) re-makes every recorded scheduling decision
from the recorded inputs alone, with no model (ARCHITECTURE.md §6).

Real traces are recorded with the engine on the `micro` preset, ZOS on and off: a tiny KV pool that preempts,
and a run driven step by step that cancels a request while partly prefilled, once preempted, and while
running. Each replays with every batch and digest matching. Then one recorded input or decision is edited
(a row's block table, a dropped cancellation, a sampled token, a digest) and the replay must stop at the first
mismatch, at the right step, request and field. The log editing helpers are tests/test_verify.py's.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_verify import field, find, prompt, read_log, record_preemption, row_field, set_field, write_log

from tracing import Recorder
from tracing.reader import open_trace
from tracing.replay import replay_scheduler
from tracing.schema import KIND, ROW_FIELDS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "traces" / "examples" / "micro-preempt-cancel.mdt"


def record_cancellations(checkpoint: Path, path: Path, enable_zos: bool) -> Path:
    """Four 120-token prompts and a 200-token one (64-token chunks) on 5 KV blocks; cancels request 4 while
    partly prefilled, the first request preempted once it waits again, and request 1 at step 14."""
    from engine import LLM, SamplingParams
    engine = LLM(str(checkpoint), tracer=Recorder(path), num_kv_blocks=5, max_num_batched_tokens=64,
                 enable_zos=enable_zos).engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(prompt(i, 120), greedy) for i in range(4)]
    ids.append(engine.add_request(prompt(4, 200), SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)))
    seqs = {i: engine.scheduler.seqs[i] for i in ids}
    cancelled: list[int] = []
    for k in range(300):
        if not engine.has_unfinished():
            break
        for i, s in seqs.items():
            preempted_waiting = s.epoch == 1 and s.status.value == "waiting" and not any(j not in (1, 4)
                                                                                        for j in cancelled)
            if i not in cancelled and not s.is_finished and (
                    (i == 4 and s.num_cached_tokens > 0) or (i == 1 and k == 14) or preempted_waiting):
                engine.abort(i)
                cancelled.append(i)
        engine.step()
    print("cancelled", cancelled)
    engine.shutdown()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["zos", "no-zos"])
def preempted(request, checkpoint, tmp_path_factory) -> Path:
    return record_preemption(checkpoint, tmp_path_factory.mktemp("logs") / "preempted.mdt", request.param)


@pytest.fixture(scope="module", params=[True, False], ids=["zos", "no-zos"])
def cancelled(request, checkpoint, tmp_path_factory) -> Path:
    return record_cancellations(checkpoint, tmp_path_factory.mktemp("logs") / "cancelled.mdt", request.param)


def replay_edited(src: Path, dst: Path, edit):
    """Rewrite `src`'s events with `edit(events)` (in place) into `dst` and replay it; the edit's return value
    is passed back with the result."""
    header, events = read_log(src)
    expected = edit(events)
    result = replay_scheduler(open_trace(write_log(dst, header, events)))
    print(result.mismatch)  # shown by pytest -rP, or when the test fails
    return result, expected


def count(events: list[list], name: str) -> int:
    return sum(1 for e in events if e[0] == KIND[name])


# ---- recorded runs replay exactly ------------------------------------------------------------------
def assert_replays_clean(path: Path) -> None:
    trace = open_trace(path)
    result = replay_scheduler(trace)
    assert result.mismatch is None, str(result.mismatch)
    schedules = [e for e in open_trace(path).events() if e.kind == "schedule"]
    assert result.steps == len(schedules) == trace.footer.num_steps
    assert result.rows == sum(len(e.rows) for e in schedules)
    assert result.digests == sum(1 for e in open_trace(path).events() if e.kind == "step_digest") > 0


def test_a_preempting_run_replays_every_step(preempted):
    _, events = read_log(preempted)
    assert count(events, "preempt") > 0
    assert_replays_clean(preempted)


def test_a_run_with_cancellations_replays_every_step(cancelled):
    _, events = read_log(cancelled)
    assert count(events, "cancel") == 3 and count(events, "preempt") > 0
    assert_replays_clean(cancelled)
    assert replay_scheduler(open_trace(cancelled)).cancellations == 3


def test_the_example_trace_replays_clean():
    assert_replays_clean(EXAMPLE)


# ---- an edited log stops at the first mismatch ----------------------------------------------------------
def test_an_edited_block_table_is_the_first_mismatch(preempted, tmp_path):
    def edit(events):
        i = find(events, "schedule", step=5)
        row = field(events[i], "rows")[-1]
        row[ROW_FIELDS.index("block_table")] = list(row_field(row, "block_table")) + [99]
        return 5, row_field(row, "seq_id"), row_field(row, "block_table")
    result, (step, seq_id, table) = replay_edited(preempted, tmp_path / "edited.mdt", edit)
    m = result.mismatch
    assert (m.step, m.seq_id, m.field, m.expected) == (step, seq_id, "block_table", table)
    assert m.got == table[:-1] and result.steps == 5


def test_a_dropped_cancellation_is_found_at_its_step(cancelled, tmp_path):
    def edit(events):
        i = find(events, "cancel", seq_id=1)
        step = field(events[i], "step")
        del events[i]
        return step
    result, step = replay_edited(cancelled, tmp_path / "edited.mdt", edit)
    m = result.mismatch
    assert (m.step, m.seq_id, m.field) == (step, 1, "rows (requests)") and result.steps == step, str(m)


def test_a_changed_token_is_found_where_it_is_next_an_input(preempted, tmp_path):
    """A sampled token comes back as an input: in the next decode row (ZOS off; under ZOS that input is in flight,
    None) or in the recomputation after a preemption. The first such row shows the edit."""
    def fed_at(events, i):
        """The first schedule event after events[i] (a token) with a row that feeds that token as an input."""
        s, position = field(events[i], "seq_id"), field(events[i], "position")
        return next((e for e in events[i:] if e[0] == KIND["schedule"] for r in field(e, "rows")
                     if row_field(r, "seq_id") == s and 0 <= position - row_field(r, "start") < len(row_field(r, "token_ids"))
                     and row_field(r, "token_ids")[position - row_field(r, "start")] is not None), None)

    def edit(events):
        i = next(i for i, e in enumerate(events) if e[0] == KIND["token"] and field(e, "appended")
                 and fed_at(events, i) is not None)
        set_field(events[i], "token_id", field(events[i], "token_id") + 1)
        return field(fed_at(events, i), "step"), field(events[i], "seq_id")
    result, (step, seq_id) = replay_edited(preempted, tmp_path / "edited.mdt", edit)
    m = result.mismatch
    assert (m.step, m.seq_id, m.field) == (step, seq_id, "token_ids")
    assert m.got != m.expected  # the replay was fed the edited token


def test_a_wrong_digest_is_found_at_its_step(cancelled, tmp_path):
    def edit(events):
        i = [i for i, e in enumerate(events) if e[0] == KIND["step_digest"]][7]
        set_field(events[i], "digest", "0" * 16)
        return field(events[i], "step")
    result, step = replay_edited(cancelled, tmp_path / "edited.mdt", edit)
    assert (result.mismatch.step, result.mismatch.field, result.mismatch.expected) == (step, "digest", "0" * 16)
    assert result.digests == 7


# ---- the command -----------------------------------------------------------------------------------------
def mdi(*args):
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_check_scheduler_exits_0_with_a_summary_when_every_step_matches():
    run = mdi("check", str(EXAMPLE), "--scheduler")
    assert run.returncode == 0, run.stderr
    assert "176 (24 prefill, 152 decode)" in run.stdout and "every step matches" in run.stdout


def test_check_scheduler_exits_1_and_names_the_first_mismatch(preempted, tmp_path):
    header, events = read_log(preempted)
    i = find(events, "schedule", step=3)
    row = field(events[i], "rows")[0]
    slot = row_field(row, "state_slot") + 7
    row[ROW_FIELDS.index("state_slot")] = slot
    edited = write_log(tmp_path / "edited.mdt", header, events)
    run = mdi("check", str(edited), "--scheduler")
    assert run.returncode == 1, run.stderr
    assert f"mismatch: step 3, request {row_field(row, 'seq_id')}: state_slot expected {slot}, got {slot - 7}" \
        in run.stdout


@pytest.mark.parametrize("args", [["check", "missing.mdt", "--scheduler"], ["check", "README.md", "--scheduler"],
                                  ["check", str(EXAMPLE), "--model", "/nonexistent"],
                                  ["check", str(EXAMPLE), "--device", "tpu"]])
def test_check_bad_input_is_one_sentence_and_exit_2(args):
    run = mdi(*args)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("mdi-trace: ")
    assert "Traceback" not in run.stderr


def test_replay_imports_no_torch_and_the_command_loads_no_model():
    code = ("import sys; from tracing.reader import open_trace; from tracing.replay import replay_scheduler; "
            f"assert replay_scheduler(open_trace({str(EXAMPLE)!r})).mismatch is None; "
            "bad = {'torch', 'engine.llm', 'model.transformer'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    code = ("import sys; from tui.cli import main; assert main(['check', %r, '--scheduler']) == 0; "
            "bad = {'torch', 'engine.llm', 'engine.model_runner', 'model.transformer'} & set(sys.modules); "
            "assert not bad, bad"
            % str(EXAMPLE))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def with_scheduler_version(src: Path, dst: Path, version, edit=None) -> Path:
    """`src` rewritten with its header's scheduler_version set to `version` (None: removed), events edited."""
    import msgpack

    header, events = read_log(src)
    h = msgpack.unpackb(header, raw=False, strict_map_key=False)
    h["engine"].pop("scheduler_version", None)
    if version is not None:
        h["engine"]["scheduler_version"] = version
    if edit:
        edit(events)
    return write_log(dst, msgpack.packb(h, use_bin_type=True), events)


def test_a_recording_names_its_scheduling_rules_and_replays_without_a_note(preempted):
    from engine.scheduler import SCHEDULER_VERSION

    trace = open_trace(preempted)
    assert trace.header["engine"]["scheduler_version"] == SCHEDULER_VERSION
    result = replay_scheduler(trace)
    assert result.mismatch is None and result.note is None


def test_a_trace_of_other_scheduling_rules_is_replayed_with_a_note(preempted, tmp_path, capsys):
    """A header of scheduler version 1 (the rules before the prefill admission fix): `check --scheduler` says
    so in one sentence before its table; a header without the field says it only at a mismatch."""
    from tui.cli import main

    old = with_scheduler_version(preempted, tmp_path / "v1.mdt", 1)
    assert main(["check", "--scheduler", str(old)]) == 0  # these decisions did not change
    out = capsys.readouterr().out
    assert "recorded by scheduler version 1 and is replayed by version 2" in " ".join(out.split())
    unversioned = with_scheduler_version(preempted, tmp_path / "none.mdt", None)
    assert replay_scheduler(open_trace(unversioned)).note is None

    def edit(events):
        i = find(events, "schedule", step=5)
        row = field(events[i], "rows")[-1]
        row[ROW_FIELDS.index("block_table")] = list(row_field(row, "block_table")) + [99]
    broken = with_scheduler_version(preempted, tmp_path / "none-broken.mdt", None, edit)
    result = replay_scheduler(open_trace(broken))
    assert result.mismatch is not None and "no scheduler_version" in result.note
