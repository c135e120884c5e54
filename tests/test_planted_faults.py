"""The checks catch planted faults (issue #6 item 5, ARCHITECTURE.md §6).

A run is recorded with a deliberately broken model or engine. Re-executed by the fixed code (`check`), it
mismatches at or after the step where the fault first shows; the broken engine checked against the reference
(`check --against reference`) diverges exactly at that step, and the broken module is named. An engine fault
in the bookkeeping is caught by `verify` at its step and by scheduler replay. The step is computed from the recorded batches alone (which rows read what the fault
corrupted), independently of the checker. Unbroken runs of the same workload pass every check.

Workload: `micro` (window 32, ratio-2 compressors on layers 2-5, Engram on layers 1 and 4), three 120-token
prompts prefilled in chunks of 37 tokens (chunk boundaries inside compressor groups), 4 KV blocks so that one
request is preempted and, with 3 state slots, a slot changes owner; 12 greedy tokens each, ZOS on.
"""
from __future__ import annotations

import pytest
import torch

from tracing import Recorder
from tracing.divergence import check_against_reference
from tracing.execute import check_tokens
from tracing.reader import open_trace
from tracing.replay import replay_scheduler
from tracing.verify import verify
from tracing.schema import BATCH_KINDS

WINDOW = 32  # micro's window_size


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * k) % 1022 + 2 for k in range(n)]


def record(checkpoint, path, device: str = "cpu"):
    from engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), tracer=Recorder(path), num_kv_blocks=4, num_state_slots=3, max_num_batched_tokens=37,
              device=device)
    llm.generate([prompt(i, 120) for i in range(3)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 progress=False)
    llm.engine.shutdown()
    return open_trace(path)


def batches(trace):
    return [e for e in trace.events() if e.kind == "schedule"]


# ---- the faults --------------------------------------------------------------------------------------------

def ring_off_by_one(monkeypatch):
    """Window ring: after the first wrap, position p is written to (p + 1) % W instead of p % W (the ring
    addresses every write takes: a prefill chunk's after attention, a decode row's in its latent's launch)."""
    from model.paged import PagedModel

    original = PagedModel.window_addresses

    def window_addresses(self, step):
        window, (slots, _) = original(self, step)
        p = step.positions
        return window, (slots, torch.where(p >= WINDOW, p + 1, p) % WINDOW)
    monkeypatch.setattr(PagedModel, "window_addresses", window_addresses)


def ring_first_step(trace):
    """The first step with a row that reads a ring position >= W (positions before its start, within W)."""
    return min(e.step for e in batches(trace) for r in e.rows if r.start > WINDOW)


def tail_lost(monkeypatch):
    """Compressor: the open group's members are not kept in the tail when a prefill chunk ends inside it."""
    from model.paged import PagedModel

    original = PagedModel.compress

    def compress(self, block, x, step, cache):
        saved = {k: (a.clone(), g.clone()) for k, (a, g) in self.tails.items()}
        original(self, block, x, step, cache)
        if not step.batch.decode:
            self.tails = saved
    monkeypatch.setattr(PagedModel, "compress", compress)


def tail_first_step(trace):
    """The first row that starts inside a ratio-2 group opened by the previous (prefill) chunk of its request."""
    last_kind = {}
    for e in batches(trace):
        for r in e.rows:
            key = (r.seq_id, r.epoch)
            if r.start % 2 == 1 and last_kind.get(key) == "prefill":
                return e.step
            last_kind[key] = BATCH_KINDS[e.batch_kind]
    raise AssertionError("no chunk boundary inside a group")


def engram_not_reset(monkeypatch):
    """Engram: a request starting at position 0 takes the history its state slot was left with (except on the
    slot's first use), instead of the pad's."""
    from model.engram import engram_history, hash_ids, start_history
    from model.paged import PagedModel

    def engram_rows(self, step):
        w, b = self.weights, step.batch
        token_map = w.token_map(b.input_ids.device)
        comp = token_map[b.input_ids]
        if not hasattr(self, "used"):  # per slot: has it had an owner? (device-side: CUDA graphs capture this)
            self.used = torch.zeros(self.history.size(0), dtype=torch.bool, device=self.history.device)
        first = (b.start == 0) & ~self.used[b.state_slots]
        self.used.index_fill_(0, b.state_slots, True)
        history = torch.where(first[:, None], start_history(self.args, token_map, len(first)),
                              self.history[b.state_slots])
        self.history[b.state_slots] = engram_history(history, comp, b.num_tokens)
        return hash_ids(w.layout(comp.device), comp, history)
    monkeypatch.setattr(PagedModel, "engram_rows", engram_rows)


def engram_first_step(trace):
    """The first row at position 0 on a state slot that an earlier row used."""
    used = set()
    for e in batches(trace):
        for r in e.rows:
            if r.start == 0 and r.state_slot in used:
                return e.step
        used |= {r.state_slot for r in e.rows}
    raise AssertionError("no state slot changed owner")


FAULTS = {"window ring one position off after a wrap": (ring_off_by_one, ring_first_step, {"window"}),
          "compressor tail lost at a chunk boundary": (tail_lost, tail_first_step, {"compressor", "index keys"}),
          "Engram history not reset for a new owner": (engram_not_reset, engram_first_step, {"Engram"})}


@pytest.fixture(scope="module")
def unbroken(checkpoint, tmp_path_factory):
    return record(checkpoint, tmp_path_factory.mktemp("unbroken") / "run.mdt")


def test_an_unbroken_run_passes_every_check(unbroken):
    assert verify(unbroken) == []
    assert replay_scheduler(unbroken).mismatch is None
    assert check_tokens(unbroken).mismatch is None
    r = check_against_reference(unbroken)
    assert r.divergence is None and r.rows > 20 and r.tokens > 20


def test_a_choice_flipped_in_pass_1_alone_is_shape_noise(unbroken, monkeypatch):
    """A discrete choice that differs by a clear gap in pass 1, where the teacher-forced pass makes the
    reference's choice and names no module, is shape noise (issue #16: a decode shape's candidate blocks
    against the prefill shape's), reported as such, not a divergence."""
    import tracing.compare

    explain, flipped = tracing.compare.explain, []

    def flip_once(ref, ref_row, got, got_row):
        if not flipped and ref_row == 130:  # one position of pass 1, a decode row past the window
            flipped.append(ref_row)
            return f"row {ref_row}: candidate blocks of layer 6 differ ([0] vs [13]) with a clear gap 0.0915"
        return explain(ref, ref_row, got, got_row)
    monkeypatch.setattr(tracing.compare, "explain", flip_once)
    r = check_against_reference(unbroken)
    assert flipped and r.divergence is None, r.divergence
    assert r.noise >= 1 and any("clear gap 0.0915" in note for _, _, note in r.noise_notes), r.noise_notes


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_model_fault_is_found_at_its_step_and_module(checkpoint, tmp_path, monkeypatch, fault):
    plant, first_step, modules = FAULTS[fault]
    with monkeypatch.context() as m:
        plant(m)
        trace = record(checkpoint, tmp_path / "broken.mdt")
    step = first_step(trace)
    assert verify(trace) == []  # the fault is in the numbers: the scheduler and the resources are sound

    mismatch = check_tokens(trace).mismatch  # recorded with the fault, re-executed after the fix
    assert mismatch is not None and mismatch.step >= step

    with monkeypatch.context() as m:  # the broken engine against the reference
        plant(m)
        d = check_against_reference(trace).divergence
    assert d is not None and d.step == step, (d, step)
    assert d.module is not None and d.module.module in modules, d.module


def stale_first_step(trace):
    """The first token appended for a row whose request was preempted after the row was scheduled."""
    epoch_at_schedule, bumped = {}, set()
    for e in trace.events():
        if e.kind == "schedule":
            epoch_at_schedule.update({(e.step, r.seq_id): r.epoch for r in e.rows})
        elif e.kind == "epoch_bump":
            bumped |= {(step, s) for (step, s) in epoch_at_schedule if s == e.seq_id}
        elif e.kind == "token" and e.appended and (e.step, e.seq_id) in bumped:
            return e.step
    raise AssertionError("no token of a preempted epoch")


def test_a_stale_epoch_token_appended_is_found_at_its_step(checkpoint, tmp_path, monkeypatch):
    """Engine fault: a token sampled for an epoch that was preempted since is appended instead of discarded."""
    from engine.scheduler import Scheduler

    original = Scheduler.process

    def process(self, batch, tokens):
        for row in batch.rows:  # forget the row's epoch: the stale check then passes
            seq = self.seqs.get(row.seq_id)
            row.epoch = seq.epoch if seq is not None else row.epoch
        return original(self, batch, tokens)

    with monkeypatch.context() as m:
        m.setattr(Scheduler, "process", process)
        with pytest.raises(AssertionError, match="every earlier token cached"):  # the engine trips later on
            record(checkpoint, tmp_path / "broken.mdt")
    trace = open_trace(tmp_path / "broken.mdt")  # cut short by the crash, flushed up to its last step
    step = stale_first_step(trace)
    findings = verify(trace)
    assert findings and findings[0].step == step, (findings[:1], step)
    mismatch = replay_scheduler(trace).mismatch
    assert mismatch is not None and mismatch.step >= step
