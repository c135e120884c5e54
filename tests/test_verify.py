"""`tracing.verify` proves promise 2 and the step contract from a recorded log alone (ARCHITECTURE.md §2-§5).

Real traces are recorded with the engine on the `micro` preset: a tiny KV pool that forces a preemption (ZOS on
and off), and a run that cancels a request in each state (partly prefilled, preempted and waiting, running,
finished), and a run that requeues a preempted request ahead of a partly prefilled one. Each verifies with no
finding, as does every committed example trace. Then the logs are edited (msgpack decoded, events changed, the
stream re-encoded with a fresh footer and trailer, or without them) to plant one violation each, and the verifier
must report it first, at the right step and request. A log cut short is verified up to the cut and says so, and
`mdi-trace verify` exits 0 on it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from tracing import Recorder
from tracing.reader import open_trace
from tracing.schema import BATCH_KINDS, EVENTS, FINISH_REASONS, KIND, PHASES, ROW_FIELDS, TRAILER_TAG
from tracing.ranks import open_run
from tracing.verify import Finding, verify, verify_run

ROOT = Path(__file__).resolve().parent.parent


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * k) % 1022 + 2 for k in range(n)]


def make_llm(checkpoint: Path, path: Path, enable_zos: bool = True):
    from engine import LLM
    return LLM(str(checkpoint), tracer=Recorder(path), num_kv_blocks=4, max_num_batched_tokens=64,
               enable_zos=enable_zos)


def record_preemption(checkpoint: Path, path: Path, enable_zos: bool = True) -> Path:
    """Three 120-token prompts decoding 12 tokens need 2 blocks each at position 128; 4 blocks preempt one."""
    from engine import SamplingParams
    llm = make_llm(checkpoint, path, enable_zos)
    llm.generate([prompt(i, 120) for i in range(3)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 progress=False)
    llm.engine.shutdown()
    return path


def record_cancellation(checkpoint: Path, path: Path) -> Path:
    """The preemption workload plus a 200-token prompt (prefilled in 64-token chunks); cancels request 3 while
    partly prefilled, request 0 once preempted and waiting, request 1 while running, request 2 once finished."""
    from engine import SamplingParams
    engine = make_llm(checkpoint, path).engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(prompt(i, 120), greedy) for i in range(3)]
    ids.append(engine.add_request(prompt(3, 200), SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)))
    seqs = {i: engine.scheduler.seqs[i] for i in ids}
    cancelled: set[int] = set()

    def cancel(i: int) -> None:
        engine.abort(i)
        cancelled.add(i)

    for k in range(200):
        if not engine.has_unfinished():
            break
        if 3 not in cancelled and seqs[3].num_cached_tokens > 0:
            cancel(3)
        if 0 not in cancelled and seqs[0].epoch == 1:
            cancel(0)
        if 1 not in cancelled and k == 16:
            cancel(1)
        engine.step()
    cancel(2)
    engine.shutdown()
    assert [seqs[i].finish_reason for i in ids] == ["abort", "abort", "length", "abort"]
    assert seqs[0].epoch == 2 and seqs[3].num_cached_tokens > 0
    return path


def record_requeue(checkpoint: Path, path: Path, enable_zos: bool = False) -> Path:
    """The preemption workload plus a 200-token prompt (temperature 1) added at step 6: it is partly prefilled,
    at the head of the waiting queue, when decode needs its block (preempted in place, it keeps its place); then
    request 0 is preempted too and requeued at the head, ahead of it."""
    from engine import SamplingParams
    engine = make_llm(checkpoint, path, enable_zos).engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(prompt(i, 120), greedy)
    for k in range(200):
        if k == 6:
            engine.add_request(prompt(3, 200), SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
        if not engine.has_unfinished():
            break
        engine.step()
    engine.shutdown()
    return path


@pytest.fixture(scope="module")
def preempted(checkpoint, tmp_path_factory) -> Path:
    return record_preemption(checkpoint, tmp_path_factory.mktemp("logs") / "preempted.mdt")


@pytest.fixture(scope="module")
def cancelled(checkpoint, tmp_path_factory) -> Path:
    return record_cancellation(checkpoint, tmp_path_factory.mktemp("logs") / "cancelled.mdt")


@pytest.fixture(scope="module")
def requeued(checkpoint, tmp_path_factory) -> Path:
    return record_requeue(checkpoint, tmp_path_factory.mktemp("logs") / "requeued.mdt")


# ---- editing a log -----------------------------------------------------------------------------------
def read_log(path: Path) -> tuple[bytes, list[list]]:
    """The header's bytes and the events as [kind code, *fields] lists, without footer and trailer."""
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    unpacker.unpack()
    header = data[:unpacker.tell()]
    events = []
    for obj in unpacker:
        if not isinstance(obj, list) or obj[0] == KIND["footer"]:
            break
        events.append(obj)
    return header, events


def write_log(path: Path, header: bytes, events: list[list], footer: bool = True) -> Path:
    """Re-encode a log as the Recorder does: events, then (if `footer`) a footer that indexes them and the
    9-byte trailer that points at it."""
    packer = msgpack.Packer(use_bin_type=True)
    out, counts, step_offsets = bytearray(header), {}, []
    for e in events:
        name = EVENTS[e[0]][0]
        counts[name] = counts.get(name, 0) + 1
        if name == "schedule":
            step_offsets.append([field(e, "step"), len(out)])
        out += packer.pack(e)
    if footer:
        footer_offset = len(out)
        out += packer.pack([KIND["footer"], counts, len(step_offsets), step_offsets, True])
        out += bytes([TRAILER_TAG]) + footer_offset.to_bytes(8, "big")
    path.write_bytes(bytes(out))
    return path


def plant(src: Path, dst: Path, edit, footer: bool = True) -> list[Finding]:
    """Rewrite `src`'s events with `edit(events)` (in place) into `dst`, and verify it."""
    header, events = read_log(src)
    edit(events)
    findings = verify(open_trace(write_log(dst, header, events, footer)))
    print(*findings, sep="\n")  # shown by pytest -rP, or when the test fails
    return findings


def field(e: list, name: str):
    return e[1 + EVENTS[e[0]][1].index(name)]


def set_field(e: list, name: str, value) -> None:
    e[1 + EVENTS[e[0]][1].index(name)] = value


def row_field(row: list, name: str):
    return row[ROW_FIELDS.index(name)]


def find(events: list[list], event: str, start: int = 0, **match) -> int:
    """Index of the first `event` event from `start` whose fields equal `match`."""
    return next(i for i in range(start, len(events)) if events[i][0] == KIND[event]
                and all(field(events[i], k) == v for k, v in match.items()))


def schedule_rows(events: list[list], i: int) -> list[int]:
    """The requests of the schedule event at i, in row order."""
    return [row_field(r, "seq_id") for r in field(events[i], "rows")]


def find_row(events: list[list], kind: str, start: int = 0, **match) -> tuple[int, int]:
    """(event index, row index) of the first row of a `kind` step from `start` whose fields equal `match`."""
    return next((i, j) for i in range(start, len(events)) if events[i][0] == KIND["schedule"]
                and BATCH_KINDS[field(events[i], "batch_kind")] == kind
                for j, r in enumerate(field(events[i], "rows")) if all(row_field(r, k) == v for k, v in match.items()))


def step_of(events: list[list], i: int) -> int:
    """The step a finding at event i names: the event's own step, else the step being scheduled."""
    if "step" in EVENTS[events[i][0]][1]:
        return field(events[i], "step")
    return sum(1 for e in events[:i] if e[0] == KIND["schedule"])


def seq_of(e: list) -> int | None:
    """The request a finding at event e names: the event's own seq_id, else None."""
    return field(e, "seq_id") if "seq_id" in EVENTS[e[0]][1] else None


def first(findings: list[Finding]) -> Finding:
    assert findings, "the planted violation was not found"
    assert all(f.violation for f in findings), [str(f) for f in findings]
    return findings[0]


# ---- clean logs ------------------------------------------------------------------------------------------
def test_finding_reads_as_step_request_message():
    assert str(Finding(12, 3, 100, "block 7 allocated while owned by request 1")) == \
        "step 12, request 3: block 7 allocated while owned by request 1"
    assert str(Finding(None, 2, None, "slot 1 never freed")) == "end of log, request 2: slot 1 never freed"
    assert str(Finding(5, None, 0, "step digest differs")) == "step 5: step digest differs"


def test_a_preempting_run_verifies_clean(preempted, checkpoint, tmp_path):
    header, events = read_log(preempted)
    assert any(e[0] == KIND["preempt"] for e in events), "the tiny pool was meant to force a preemption"
    assert verify(open_trace(preempted)) == []
    zos_off = record_preemption(checkpoint, tmp_path / "zos_off.mdt", enable_zos=False)
    assert verify(open_trace(zos_off)) == []


def test_a_run_with_cancellations_in_every_state_verifies_clean(cancelled):
    _, events = read_log(cancelled)
    assert sum(e[0] == KIND["cancel"] for e in events) == 3  # the finished request's cancel is a no-op
    assert verify(open_trace(cancelled)) == []


def test_a_run_that_requeues_a_preempted_request_at_the_head_verifies_clean(requeued, checkpoint, tmp_path):
    """FCFS with preemption, chunked prefill and a seeded request, ZOS off and on: request 3 (partly prefilled)
    is preempted in place, then request 0 to the head of the waiting queue, and 0's recomputation is admitted
    first."""
    zos_on = record_requeue(checkpoint, tmp_path / "zos_on.mdt", enable_zos=True)
    for path in (requeued, zos_on):
        _, events = read_log(path)
        p = next(i for i, e in enumerate(events) if e[0] == KIND["schedule"] and field(e, "preempted"))
        assert field(events[p], "preempted") == [3, 0]
        assert schedule_rows(events, find(events, "schedule", p + 1, batch_kind=0))[0] == 0
        assert verify(open_trace(path)) == []


@pytest.mark.parametrize("name", sorted({p.name.split(".rank")[0].removesuffix(".mdt") + ".mdt"
                                         for p in (ROOT / "traces" / "examples").glob("*.mdt")}))
def test_the_committed_example_traces_verify_clean(name):
    """The example traces (recorded on CPU and on an H200, one with 14 preemptions, one of two ranks)."""
    assert [str(f) for f in verify_run(open_run(str(ROOT / "traces" / "examples" / name)))] == []


def test_a_run_of_two_ranks_keeps_100_findings_and_counts_them_all(tmp_path):
    """verify_run over two ranks whose logs each hold 150 violations (tokens of a request never added): 100
    kept over the run, in rank order, 300 counted (`Findings.total`, what `mdi-trace verify` reports)."""
    src = ROOT / "traces" / "examples" / "micro-2rank"
    for rank in (0, 1):
        header, events = read_log(Path(f"{src}.rank{rank}.mdt"))
        events[:0] = [[KIND["token"], 0, 0, 10**6 + rank, 0, k, 5, True] for k in range(150)]
        write_log(tmp_path / f"bad.rank{rank}.mdt", header, events)
    findings = verify_run(open_run(str(tmp_path / "bad.mdt")))   # the OUT: every rank
    assert isinstance(findings, list) and len(findings) == 100 and findings.total == 300
    assert all(f.rank == 0 and f.message == "a token for a request that was never added" for f in findings)


def test_rewriting_a_log_unchanged_gives_the_same_bytes(preempted, tmp_path):
    """The editing helper re-creates footer and trailer exactly as the Recorder wrote them."""
    header, events = read_log(preempted)
    assert write_log(tmp_path / "same.mdt", header, events).read_bytes() == preempted.read_bytes()


# ---- planted violations ----------------------------------------------------------------------------------
def test_a_block_with_two_owners_is_found(preempted, tmp_path):
    """Promise 2: the first allocation made while another request owns a block is redirected to that block."""
    header, events = read_log(preempted)
    owner: dict[int, int] = {}
    for i, e in enumerate(events):
        if e[0] == KIND["block_alloc"]:
            s = field(e, "seq_id")
            taken = [b for b, o in owner.items() if o != s]
            if taken:
                break
            owner.update({b: s for b in field(e, "block_ids")})
        elif e[0] == KIND["block_free"]:
            for b in field(e, "block_ids"):
                del owner[b]
    f = first(plant(preempted, tmp_path / "two.mdt", lambda ev: set_field(ev[i], "block_ids", [taken[0]])))
    assert (f.step, f.seq_id, f.offset is not None) == (step_of(events, i), s, True)
    assert f.message == f"block {taken[0]} allocated while owned by request {owner[taken[0]]}"


def test_blocks_freed_without_the_slot_are_found(preempted, tmp_path):
    """Preemption frees blocks and slot together: drop the slot_free and the preempt still owns the slot."""
    _, events = read_log(preempted)
    p = find(events, "preempt")
    s = field(events[p], "seq_id")
    assert events[p - 1][0] == KIND["slot_free"] and field(events[p - 1], "seq_id") == s
    slot = field(events[p - 1], "state_slot")
    f = first(plant(preempted, tmp_path / "noslot.mdt", lambda ev: ev.pop(p - 1)))
    assert (f.step, f.seq_id) == (field(events[p], "step"), s)
    assert f.message == f"still owns slot {slot} at its preemption"


def test_a_cancellation_without_its_epoch_bump_is_found(cancelled, tmp_path):
    """Cancellation: cancel, epoch bump, block and slot frees, finish(abort), nothing between."""
    _, events = read_log(cancelled)
    c = find(events, "cancel", seq_id=1)

    def bump_missing(ev):
        assert ev[c + 1][0] == KIND["epoch_bump"]
        ev.pop(c + 1)

    f = first(plant(cancelled, tmp_path / "nobump.mdt", bump_missing))
    assert (f.step, f.seq_id, f.message) == (field(events[c], "step"), 1, "cancel without an epoch bump right after it")


@pytest.mark.parametrize("how", ["flip appended", "old epoch"])
def test_a_stale_token_appended_is_found(preempted, tmp_path, how):
    """No stale-epoch token is appended: flip a discarded token to appended, or give an appended token of a
    preempted request its old epoch."""
    _, events = read_log(preempted)
    if how == "flip appended":
        i = find(events, "token", appended=False)
        edit = lambda ev: set_field(ev[i], "appended", True)  # noqa: E731
    else:
        i = find(events, "token", epoch=1, appended=True)
        edit = lambda ev: set_field(ev[i], "epoch", 0)  # noqa: E731
    s = field(events[i], "seq_id")
    findings = plant(preempted, tmp_path / "stale.mdt", edit)
    assert (first(findings).step, first(findings).seq_id) == (field(events[i], "step"), s)
    assert any(f.message.startswith("a stale token appended: epoch 0, the request is at epoch 1") for f in findings)


def test_an_epoch_going_down_is_found(cancelled, tmp_path):
    """Request 0 was preempted (epoch 1), then cancelled: its abort bump claims epoch 0."""
    _, events = read_log(cancelled)
    i = find(events, "epoch_bump", seq_id=0, epoch=2)
    f = first(plant(cancelled, tmp_path / "down.mdt", lambda ev: set_field(ev[i], "epoch", 0)))
    assert (f.step, f.seq_id) == (step_of(events, i), 0)
    assert f.message == "epoch goes from 1 to 0; it only grows, by 1"


@pytest.mark.parametrize("how", ["start + 1", "input token"])
def test_an_illegal_decode_row_is_found(preempted, tmp_path, how):
    """Decode only at start == get_len() - 1, with input None exactly when a token is in flight."""
    _, events = read_log(preempted)
    i = find(events, "schedule", batch_kind=1)
    rows = field(events[i], "rows")
    j = next(j for j, r in enumerate(rows) if row_field(r, "token_ids") == ([None] if how == "input token" else
                                                                          row_field(r, "token_ids")))

    def edit(ev):
        row = field(ev[i], "rows")[j]
        if how == "start + 1":
            row[ROW_FIELDS.index("start")] += 1
        else:
            row[ROW_FIELDS.index("token_ids")] = [5]

    f = first(plant(preempted, tmp_path / "decode.mdt", edit))
    assert (f.step, f.seq_id) == (field(events[i], "step"), row_field(rows[j], "seq_id"))
    assert f.message.startswith("a decode row at position" if how == "start + 1" else
                                "a decode row whose input token is 5, expected None")


@pytest.mark.parametrize("how", ["seed", "temperature", "recomputed output position", "in-flight output position"])
def test_a_row_with_the_wrong_sampling_key_is_found(preempted, tmp_path, how):
    """Promise 3 keys the sampler by the request's seed and the output position: every row carries the request's
    seed and temperature, and output_position = the output tokens appended plus those in flight, also in a
    prefill chunk that does not sample (the recomputation after a preemption continues the count)."""
    _, events = read_log(preempted)
    if how == "recomputed output position":  # the recomputation's first chunk: 8 tokens appended, none in flight
        p = find(events, "preempt")
        i, j = find_row(events, "prefill", p, seq_id=field(events[p], "seq_id"))
    else:
        i, j = find_row(events, "decode", token_ids=[None])  # its input token is in flight
    row = field(events[i], "rows")[j]
    s, n, kind = row_field(row, "seq_id"), row_field(row, "output_position"), BATCH_KINDS[field(events[i], "batch_kind")]
    key, value, message = {
        "seed": ("seed", 12345, f"a {kind} row with seed 12345 and temperature"),
        "temperature": ("temperature", 0.5, f"a {kind} row with seed {row_field(row, 'seed')} and temperature 0.5"),
        "recomputed output position": ("output_position", 0, f"a prefill row at output position 0, the request has "
                                                             f"{n} output tokens ({n} appended, 0 in flight)"),
        "in-flight output position": ("output_position", n - 1, f"a decode row at output position {n - 1}, the "
                                                                f"request has {n} output tokens ({n - 1} appended, "
                                                                f"1 in flight)")}[how]

    def edit(ev):
        field(ev[i], "rows")[j][ROW_FIELDS.index(key)] = value

    findings = plant(preempted, tmp_path / "key.mdt", edit)
    f = first(findings)
    assert len(findings) == 1 and (f.step, f.seq_id) == (field(events[i], "step"), s)
    assert f.message.startswith(message), f.message


@pytest.mark.parametrize("how", ["rows swapped", "preempted request behind", "decode row for a waiting request"])
def test_an_admission_out_of_fcfs_order_is_found(preempted, requeued, tmp_path, how):
    """Prefill admits the head of the waiting queue in its order, and a request preempted while running is
    requeued at the head: swap the two rows of a prefill step (two prompts in arrival order, or request 0's
    recomputation and request 3 behind it), or feed a waiting prompt's last chunk as a decode row."""
    log = requeued if how == "preempted request behind" else preempted
    _, events = read_log(log)
    if how == "decode row for a waiting request":  # the recomputation's last chunk: one row, the prompt's end
        i, _ = find_row(events, "prefill", find(events, "preempt"), sample=True)
        rows = schedule_rows(events, i)
        edit = lambda ev: set_field(ev[i], "batch_kind", BATCH_KINDS.index("decode"))  # noqa: E731
        message = f"a decode row for a request in the waiting queue [{rows[0]}]"
    else:  # a prefill step of two rows: requests 0 and 1 in arrival order, or 0 (requeued at the head) and 3
        rows = [0, 1] if how == "rows swapped" else [0, 3]
        i = next(i for i, e in enumerate(events) if e[0] == KIND["schedule"] and schedule_rows(events, i) == rows)
        edit = lambda ev: field(ev[i], "rows").reverse()  # noqa: E731
        message = f"a prefill row out of FCFS order: request 0 is ahead of it in the waiting queue [0, {rows[1]}"
    f = first(plant(log, tmp_path / "fcfs.mdt", edit))
    assert (f.step, f.seq_id) == (field(events[i], "step"), rows[-1])
    assert f.message.startswith(message), f.message


@pytest.mark.parametrize("how", ["event t", "span reversed", "CPU spans overlap", "device spans overlap",
                                 "device step order"])
def test_time_running_backwards_is_found(preempted, tmp_path, how):
    """The host writes events in the order it reads its clock: each `t`, and each CPU span's end, at or after the
    last one; a span ends after it starts; CPU phases and device steps each run one at a time, without overlap,
    the device's in step order."""
    _, events = read_log(preempted)
    start, end = (lambda i: field(events[i], "start")), (lambda i: field(events[i], "end"))

    def overlap(i: int, lane: str) -> tuple[dict, str]:  # start where the lane's previous span starts
        before = max(k for k in range(i) if events[k][0] == events[i][0])
        return {"start": start(before)}, (f"a {lane} span starts at {start(before)}, before the lane's previous "
                                          f"span ends at {end(before)}")

    second_device_span = find(events, "device_span", find(events, "device_span") + 1)
    if how == "event t":
        i = find(events, "preempt")
        changes, message = {"t": 0}, "a preempt event written at t=0, before t="
    elif how == "span reversed":  # an execute span: its start is the host's last reading before its end
        i = find(events, "cpu_span", phase=PHASES.index("execute"))
        changes = {"start": end(i), "end": start(i)}
        message = f"a CPU execute span ends at {start(i)}, before it starts at {end(i)}"
    elif how == "CPU spans overlap":
        i = find(events, "cpu_span", phase=PHASES.index("process"))
        changes, message = overlap(i, "CPU process")
    elif how == "device spans overlap":
        i = second_device_span
        changes, message = overlap(i, "device")
    else:  # the second step's device span claims the first's step
        i = second_device_span
        changes, message = {"step": 0}, "a device span of step 0 after one of step 0: the device runs each step once"

    def edit(ev):
        for name, value in changes.items():
            set_field(ev[i], name, value)

    findings = plant(preempted, tmp_path / "time.mdt", edit)
    f = first(findings)
    assert len(findings) == 1 and (f.step, f.seq_id) == (changes.get("step", step_of(events, i)), seq_of(events[i]))
    assert f.message.startswith(message), f.message


def test_a_resource_never_freed_at_the_end_is_found(preempted, tmp_path):
    """A clean log ends with everything free and every request finished: drop the last request's frees and
    finish (and the digest computed after them)."""
    _, events = read_log(preempted)
    last = max(i for i, e in enumerate(events) if e[0] == KIND["finish"])
    s = field(events[last], "seq_id")
    blocks, slot = field(events[last - 2], "block_ids"), field(events[last - 1], "state_slot")
    digest = find(events, "step_digest", last)

    def edit(ev):
        del ev[digest]
        del ev[last - 2:last + 1]

    findings = plant(preempted, tmp_path / "leak.mdt", edit)
    assert [str(f) for f in findings] == [
        f"end of log, request {s}: the request never finished",
        f"end of log, request {s}: {', '.join(f'block {b}' for b in sorted(blocks))}, slot {slot} never freed"]


def test_a_wrong_step_digest_is_found(cancelled, tmp_path):
    _, events = read_log(cancelled)
    i = find(events, "step_digest", step=10)
    findings = plant(cancelled, tmp_path / "digest.mdt", lambda ev: set_field(ev[i], "digest", "0" * 16))
    assert len(findings) == 1 and (findings[0].step, findings[0].seq_id) == (10, None)
    assert findings[0].message.startswith("step digest 0000000000000000 recorded")


# ---- logs cut short --------------------------------------------------------------------------------------
def test_a_cut_log_verifies_what_it_holds_and_says_it_was_cut(preempted, tmp_path):
    """Cut mid-event (a crash), or just without footer and trailer (a run still going): no violation, no
    end-of-run findings although requests still hold blocks, one note that says where the log stops."""
    data = preempted.read_bytes()
    cut = tmp_path / "cut.mdt"
    cut.write_bytes(data[:len(data) * 3 // 5])
    unfooted = tmp_path / "unfooted.mdt"
    header, events = read_log(preempted)
    write_log(unfooted, header, events[:find(events, "preempt") + 1], footer=False)
    for path in (cut, unfooted):
        trace = open_trace(path)
        findings = verify(trace)
        assert len(findings) == 1 and not findings[0].violation, [str(f) for f in findings]
        assert "cut short" in str(findings[0]) and findings[0].offset == trace.cut.offset


def test_a_violation_before_the_cut_is_still_found(preempted, tmp_path):
    _, events = read_log(preempted)
    p = find(events, "preempt")

    def drop_slot_free_and_cut(ev):
        del ev[p + 5:]
        del ev[p - 1]

    findings = plant(preempted, tmp_path / "cut.mdt", drop_slot_free_and_cut, footer=False)
    assert [f.violation for f in findings] == [True, False]
    assert findings[0].message.startswith("still owns slot")


def test_verify_exits_0_on_a_cut_log_and_1_on_a_violation_before_the_cut(preempted, tmp_path, capsys):
    """A log cut short is a note, not a finding: `mdi-trace verify` says so and exits 0, unless what the log
    holds breaks a rule."""
    from tui.cli import main
    header, events = read_log(preempted)
    p = find(events, "preempt")
    cut = write_log(tmp_path / "cut.mdt", header, events[:p + 5], footer=False)
    assert main(["verify", str(cut)]) == 0
    assert "cut short" in capsys.readouterr().out
    broken = write_log(tmp_path / "broken.mdt", header, events[:p - 1] + events[p:p + 5], footer=False)
    assert main(["verify", str(broken)]) == 1
    assert "still owns slot" in capsys.readouterr().out


def test_verify_imports_neither_torch_nor_the_model():
    code = "import sys, tracing.verify; bad = {'torch', 'engine.llm', 'model.transformer'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ---- the rules the engine's lifetime tests need (tests/test_engine_lifetimes.py runs its engines through verify) --
def _a_length_finish(ev):
    """(index of a finish(length) event, index of its request's request_added)."""
    i = next(i for i, e in enumerate(ev) if e[0] == KIND["finish"] and FINISH_REASONS[field(e, "reason")] == "length")
    return i, find(ev, "request_added", seq_id=field(ev[i], "seq_id"))


def _swap_a_slot_free(ev):
    i = next(i for i, e in enumerate(ev) if e[0] == KIND["slot_free"])
    ev[i - 1], ev[i] = ev[i], ev[i - 1]


def _more_max_tokens(ev):
    a = _a_length_finish(ev)[1]
    set_field(ev[a], "max_tokens", field(ev[a], "max_tokens") + 1)


def _fewer_max_tokens(ev):
    a = _a_length_finish(ev)[1]
    set_field(ev[a], "max_tokens", field(ev[a], "max_tokens") - 1)


def _stop_without_a_stop_token(ev):
    set_field(ev[_a_length_finish(ev)[0]], "reason", FINISH_REASONS.index("stop"))


def _an_empty_row(ev):
    i, j = find_row(ev, "prefill")
    field(ev[i], "rows")[j][ROW_FIELDS.index("token_ids")] = []


def _an_empty_step(ev):
    i = find(ev, "schedule", batch_kind=BATCH_KINDS.index("decode"), preempted=[])
    set_field(ev[i], "rows", [])


def _a_prefill_step_preempts(ev):
    i = next(i for i, e in enumerate(ev) if e[0] == KIND["schedule"] and field(e, "preempted"))
    set_field(ev[i], "batch_kind", BATCH_KINDS.index("prefill"))


def _a_token_off_its_row(ev):
    i = find(ev, "token")
    set_field(ev[i], "position", field(ev[i], "position") + 1)


def _a_token_outside_the_vocabulary(ev, vocab):
    i = find(ev, "token", appended=True)
    set_field(ev[i], "token_id", vocab)


@pytest.mark.parametrize("edit, message", [
    (_swap_a_slot_free, "slot {} freed, not right after the request's blocks"),
    (_more_max_tokens, "finish (length) with"),
    (_fewer_max_tokens, "a decode row samples output token"),
    (_stop_without_a_stop_token, "finish (stop) whose last output token"),
    (_an_empty_row, "a prefill row with no tokens"),
    (_an_empty_step, "a decode step with no rows and no preemption"),
    (_a_prefill_step_preempts, "a prefill step that preempts"),
    (_a_token_off_its_row, "a token at position"),
    ("vocab", "a token {} appended, outside the vocabulary of"),
    ("block_size", "a prefill row ending at"),
], ids=lambda v: getattr(v, "__name__", v) if not isinstance(v, str) or " " not in v else "")
def test_each_rule_of_the_engine_lifetime_tests_is_verify_s(preempted, tmp_path, edit, message):
    """The rules tests/test_engine_lifetimes.py once kept in a ledger of its own, now verify's, each broken once
    in a recorded log: a slot freed apart from its blocks, a finish that does not fit the request (length short
    of max_tokens, a stop without a stop token), a row past max_tokens or with no tokens, an empty step, a
    prefill step that preempts, a token away from its row's end or outside the vocabulary, a block table longer
    or shorter than its positions need (the header's block size changed)."""
    header, events = read_log(preempted)
    head = msgpack.unpackb(header, raw=False)
    if edit == "vocab":
        vocab = head["model"]["vocab_size"]
        edit, message = (lambda ev: _a_token_outside_the_vocabulary(ev, vocab)), message.format(vocab)
    elif edit == "block_size":
        head["engine"]["block_size"] //= 2
        header, edit = msgpack.packb(head, use_bin_type=True), (lambda ev: None)
    elif "{}" in message:
        message = message.format(field(events[next(i for i, e in enumerate(events) if e[0] == KIND["slot_free"])],
                                       "state_slot"))
    edit(events)
    findings = verify(open_trace(write_log(tmp_path / "edited.mdt", header, events)))
    print(*findings, sep="\n")
    assert first(findings).message.startswith(message), first(findings).message
