"""`mdi-trace check TRACE`: re-execute a recorded run's batches on the model and compare every sampled token
(ARCHITECTURE.md §6, "Replay"). On the machine and torch that recorded it the comparison is exact."""
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from test_verify import field, find, read_log, record_cancellation, record_preemption, set_field, write_log

from tracing.execute import check_tokens
from tracing.reader import TraceError, open_trace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "traces" / "examples" / "micro-preempt-cancel.mdt"


@pytest.mark.parametrize("zos", [True, False])
def test_a_preempting_run_re_executes_to_identical_tokens(checkpoint, tmp_path, zos):
    trace = record_preemption(checkpoint, tmp_path / "run.mdt", enable_zos=zos)
    result = check_tokens(open_trace(trace))
    assert result.mismatch is None and result.same_platform
    assert result.tokens >= 36 and result.steps > 10


def test_cancellations_and_stale_tokens_re_execute_too(checkpoint, tmp_path):
    trace = record_cancellation(checkpoint, tmp_path / "run.mdt")
    stale = [e for e in open_trace(trace).events() if e.kind == "token" and not e.appended]
    result = check_tokens(open_trace(trace))
    assert stale and result.mismatch is None


def test_a_changed_token_is_reported_at_its_step_and_request(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    result = check_tokens(open_trace(write_log(tmp_path / "edited.mdt", header, events)))
    m = result.mismatch
    assert (m.step, m.seq_id, m.expected) == (field(events[i], "step"), field(events[i], "seq_id"),
                                            field(events[i], "token_id"))


def test_other_weights_are_refused_in_one_sentence(checkpoint, tmp_path):
    from model.checkpoint import init_checkpoint
    trace = record_preemption(checkpoint, tmp_path / "run.mdt")
    init_checkpoint("micro", 1, tmp_path / "other")
    with pytest.raises(TraceError, match="not the recorded ones"):
        check_tokens(open_trace(trace), model=str(tmp_path / "other"))


def test_until_stops_early(checkpoint, tmp_path):
    trace = record_preemption(checkpoint, tmp_path / "run.mdt")
    assert check_tokens(open_trace(trace), until=5).steps == 6


def test_the_command_on_the_example_trace(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tui.cli", "check", str(EXAMPLE)], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "sampled tokens identical" in run.stdout


def test_a_mismatch_reports_the_logit_margin(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    m = check_tokens(open_trace(write_log(tmp_path / "edited.mdt", header, events))).mismatch
    assert m.margin > 0 and "logit margin" in str(m)  # greedy: the re-executed token's logit lead


def test_step_checks_one_step_after_re_executing_its_past(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = open_trace(write_log(tmp_path / "edited.mdt", header, events))
    step = field(events[i], "step")
    assert check_tokens(edited, step=step).mismatch.step == step
    assert check_tokens(open_trace(write_log(tmp_path / "e2.mdt", header, events)), step=step - 1).mismatch is None
    with pytest.raises(TraceError, match="no step 9999"):
        check_tokens(edited, step=9999)


def test_on_another_platform_a_flip_within_the_tolerance_is_a_near_tie(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    h = msgpack.unpackb(header, raw=False)
    h["device"] = "a B200"  # as if recorded elsewhere
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = write_log(tmp_path / "edited.mdt", msgpack.packb(h, use_bin_type=True), events)
    r = check_tokens(open_trace(edited))
    assert not r.same_platform and "B200" in r.platform_note
    # the edited token is the re-executed one plus 1: a near tie only if its logit is within 0.05 of the winner
    if r.mismatch is None:
        assert r.near_ties and r.near_ties[0].margin <= 0.05
    else:
        assert r.mismatch.margin > 0.05


def test_against_reference_on_the_example_trace_finds_no_divergence():
    from tracing.divergence import check_against_reference
    r = check_against_reference(open_trace(EXAMPLE), until=40)
    assert r.divergence is None and r.rows > 1000 and r.tokens > 100
    assert r.max_diff <= r.tolerance


def test_the_commands_exit_codes(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = write_log(tmp_path / "edited.mdt", header, events)
    cli = lambda *a: subprocess.run([sys.executable, "-m", "tui.cli", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=ROOT)
    run = cli("check", str(edited), "--against", "reference", "--model", str(checkpoint))
    assert run.returncode == 1 and "divergence: step" in run.stdout, run.stdout + run.stderr
    run = cli("check", str(src), "--step", "3", "--model", str(checkpoint))
    assert run.returncode == 0 and "step 3 re-executed" in run.stdout, run.stderr
    run = cli("check", str(src), "--step", "3", "--until", "4")
    assert run.returncode == 2 and "not allowed with" in run.stderr


def test_check_compares_the_step_digests_too(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "step_digest", 20)
    set_field(events[i], "digest", "0" * 16)
    edited = write_log(tmp_path / "edited.mdt", header, events)
    run = subprocess.run([sys.executable, "-m", "tui.cli", "check", str(edited), "--model", str(checkpoint)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and f"step {field(events[i], 'step')}" in run.stdout, run.stdout


def test_a_stored_code_one_step_away_is_rounding_not_a_divergence():
    """Module outputs stored as FP4/FP8 codes (window, compressed entries, index keys) may differ by one code
    where a value sat on a rounding boundary; anything further is a divergence."""
    import torch

    from model.quant import act_quant_fp4, act_quant_fp8
    from tracing.divergence import _one_code_apart
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    for fmt, quant, block, scale in (("fp4", act_quant_fp4, 32, "ue8m0"), ("fp4", act_quant_fp4, 16, "e4m3"),
                                     ("fp8", act_quant_fp8, 32, "")):
        q = (lambda t: quant(t, block, scale)) if fmt == "fp4" else (lambda t: quant(t, block))  # noqa: E731
        ref, nudged = q(x), q(x * (1 + 2 ** -5))  # some values cross a boundary, none by two codes
        assert not torch.equal(ref, nudged) and _one_code_apart(nudged, ref, fmt, block, scale)
        assert not _one_code_apart(q(x.roll(1, -1)), ref, fmt, block, scale)  # other values: many codes away
