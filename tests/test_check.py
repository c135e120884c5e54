"""`mdi-trace check TRACE`: re-execute a recorded run's batches on the model and compare every sampled token
(ARCHITECTURE.md §6, "Replay"). On the machine and torch that recorded it the comparison is exact."""
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from test_verify import field, find, read_log, record_cancellation, record_preemption, set_field, write_log

from tracing.execute import check_tokens
from tracing.reader import TraceError, open_trace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "traces" / "examples"
EXAMPLE = EXAMPLES / "micro-preempt-cancel.mdt"


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


def seeded_weights_unavailable(preset_name: str) -> bool:
    """Whether this process cannot have a preset's seed-0 weights: its dispatch draws other normals
    (model/checkpoint.py seed_draws_note) and no earlier process under AVX2 or AVX-512 left them in the cache.
    There `check` of a trace recorded with them refuses in one sentence naming the dispatch. The cache's own
    rule decides (`default_checkpoint`, which `check` calls too): the golden folder or one named for the dispatch."""
    from model.checkpoint import default_checkpoint
    return default_checkpoint(preset_name, 0).name != f"{preset_name}-seed0"


@pytest.mark.parametrize("name,until", [("micro-preempt-cancel.mdt", 60), ("micro-2rank.mdt", None),
                                        ("h200-tiny68m-zos.mdt", 6)])
def test_every_example_trace_checks_clean_here(name, until):
    """On whatever CPU runs the tests (the recording's platform or another: issue #16 item 6), each committed
    trace re-executes with exit 0, near ties and platform differences named; the H200 one (another platform
    here, by its device) up to step 6, its prefills and first decode steps, and the micro one up to step 60
    (70 s on another platform), to keep CI short. Where the recorded weights cannot be drawn here (a dispatch
    other than AVX2 and AVX-512 with no golden weights in the cache), the refusal names why."""
    trace = str(EXAMPLES / name)
    for extra in ([], ["--scheduler"]):
        run = subprocess.run([sys.executable, "-m", "tui.cli", "check", trace, *extra,
                              *(["--until", str(until)] if until is not None and not extra else [])],
                             capture_output=True, text=True, cwd=ROOT)
        if not extra and seeded_weights_unavailable("tiny-68m" if name.startswith("h200") else "micro"):
            assert run.returncode == 2 and "torch's CPU dispatch here is" in run.stderr, run.stderr
            continue
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr
        if not extra and "another platform" not in run.stdout:  # the recording's platform: exact
            assert "sampled tokens identical" in run.stdout, run.stdout[-2000:]


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


OTHER_CAPABILITY = "AVX512" if torch.backends.cpu.get_cpu_capability() != "AVX512" else "AVX2"


def on_another_platform(header: bytes, **fields) -> bytes:
    """The header as if recorded on another platform: `fields` replace the recorded platform's."""
    h = msgpack.unpackb(header, raw=False)
    h["platform"] = {**h["platform"], **fields}
    return msgpack.packb(h, use_bin_type=True)


def test_the_header_records_the_platform(checkpoint, tmp_path):
    import torch

    from engine.platform import cpu_isa
    p = open_trace(record_preemption(checkpoint, tmp_path / "run.mdt")).header["platform"]
    assert p["device_type"] == "cpu" and p["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert p["cpu_isa"] == cpu_isa() and p["cpu_model"] and p["torch"] == torch.__version__
    assert p["intra_op_threads"] == 1 and isinstance(p["isa_overrides"], dict)


def test_check_names_each_platform_field_that_differs(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    assert check_tokens(open_trace(src)).platform_note == ""  # recorded here: the same platform, exact
    edited = write_log(tmp_path / "avx2.mdt", on_another_platform(header, cpu_capability=OTHER_CAPABILITY,
                                                                  isa_overrides={"MKL_CBWR": "AVX"}), events)
    note = check_tokens(open_trace(edited)).platform_note
    assert f"cpu_capability '{OTHER_CAPABILITY}' there" in note and "isa_overrides" in note, note
    assert "cpu_model" not in note, note
    h = msgpack.unpackb(header, raw=False)
    del h["platform"]
    old = write_log(tmp_path / "old.mdt", msgpack.packb(h, use_bin_type=True), events)
    assert "records no platform" in check_tokens(open_trace(old)).platform_note


def test_on_another_platform_a_flip_beyond_a_near_tie_is_judged_by_the_reference(checkpoint, tmp_path):
    src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    i = find(events, "token", 30)
    set_field(events[i], "token_id", field(events[i], "token_id") + 1)
    edited = write_log(tmp_path / "edited.mdt", on_another_platform(header, device_type="cuda", gpu_name="NVIDIA B200"),
                       events)
    r = check_tokens(open_trace(edited))
    assert not r.same_platform and "B200" in r.platform_note
    # the edited token is the re-executed one plus 1: a near tie if its logit is within 2 x 0.05 of the winner's,
    # else a platform difference, since this platform's engine agrees with the reference on that request
    assert r.mismatch is None, r.mismatch
    tie = (r.near_ties + r.platform_differences)[0]
    assert (tie.step, tie.seq_id) == (field(events[i], "step"), field(events[i], "seq_id"))
    assert (tie in r.near_ties) == (tie.margin <= 0.1)
    assert r.platform_differences == [] or r.against.divergence is None


def test_after_a_near_tie_the_request_is_compared_with_the_recorded_tokens_fed(checkpoint, tmp_path, monkeypatch):
    """Another platform: the recording's sampler took the runner-up at output 5 of every request (as a
    platform whose bits tip a near tie does), and its later tokens follow from that token. Re-executed here,
    output 5 differs at a near tie and every later token is still compared, and identical, because the
    recorded token is fed as the next input, not the one re-executed here."""
    import engine.model_runner
    import tracing.execute

    sample = engine.model_runner.sample

    def runner_up_at_5(logits, temperatures, seeds, positions):
        tokens = sample(logits, temperatures, seeds, positions)
        return torch.where(positions == 5, logits.topk(2, dim=-1).indices[:, 1], tokens)
    with monkeypatch.context() as m:
        m.setattr(engine.model_runner, "sample", runner_up_at_5)
        src = record_preemption(checkpoint, tmp_path / "run.mdt")
    header, events = read_log(src)
    edited = write_log(tmp_path / "elsewhere.mdt", on_another_platform(header, cpu_capability=OTHER_CAPABILITY), events)
    margin = tracing.execute.margin  # a near tie by construction: the runner-up of a greedy row
    monkeypatch.setattr(tracing.execute, "margin",
                        lambda logits, row, a, b: 0.0 if row.output_position == 5 else margin(logits, row, a, b))
    r = check_tokens(open_trace(edited))
    tokens = [e for e in open_trace(edited).events() if e.kind == "token"]
    after = [e for e in tokens if any(e.seq_id == t.seq_id and e.step > t.step for t in r.near_ties)]
    assert r.mismatch is None and r.platform_differences == [], r.platform_differences[:1]
    assert {t.seq_id for t in r.near_ties} == {0, 1, 2} and len(r.near_ties) >= 3
    assert r.after_ties == len(after) > 10 and r.tokens == len(tokens)


def test_on_another_platform_a_fault_of_this_platform_is_still_a_mismatch(checkpoint, tmp_path, monkeypatch):
    """A clean run checked elsewhere by a broken engine: its tokens differ beyond a near tie, and the
    reference disagrees with the broken engine, so it is a mismatch, not a platform difference."""
    from test_planted_faults import record, ring_off_by_one
    src = record(checkpoint, tmp_path / "run.mdt").path
    header, events = read_log(src)
    edited = write_log(tmp_path / "elsewhere.mdt", on_another_platform(header, cpu_model="another CPU"), events)
    ring_off_by_one(monkeypatch)
    r = check_tokens(open_trace(edited))
    assert r.mismatch is not None and "diverges" in r.mismatch.note, r


def test_against_reference_on_the_example_trace_finds_no_divergence():
    from tracing.divergence import check_against_reference
    if seeded_weights_unavailable("micro"):
        with pytest.raises(TraceError, match="torch's CPU dispatch here is"):
            check_against_reference(open_trace(EXAMPLE), until=40)
        return
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
