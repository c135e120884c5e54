"""Promise 2 (resource lifetimes) and the decode-legality rule of ARCHITECTURE.md §2-§3, on random workloads.

Hypothesis draws an engine (ZOS on or off, a tiny KV block pool and few state slots, a token budget small
enough to chunk prefills) and 1-6 requests (some too large for the pool: add_request must refuse them) that
arrive at random steps and are cancelled at random steps or in a chosen state (waiting, partly prefilled,
running, preempted, finished). The engine runs on the `micro` preset with random weights until it is idle,
within a step cap (more steps is a livelock); a second property runs a thousand such workloads with a
StubRunner in place of the model. Every invariant is checked twice, after every step:

- from the trace alone (`Ledger`): the engine records through tracing's Recorder, and the log, read back as
  it grows, is fed to `mdi-trace verify`'s own checker (tracing/verify.py `Verifier`), so the proof needs
  nothing but the trace and is the one users run (its rules are listed there); the whole log is verified
  again at the end, footer included;
- from the live objects (`check_live`): the pools' owner tables, each Sequence, the queues, the step in
  flight, and the checker's per-request state against all of them.

Preemption and finish release both kinds of state before their hook fires, so the sequence owns nothing at
that event. Cancellation fires `cancel` first: the checker then requires that sequence's epoch bump, block
and slot frees and `finish("abort")` to follow with no other event between them, and checks at the finish.

Decode legality (`num_cached_tokens == get_len() - 1` when a decode row is scheduled) is checked from the
trace, not by wrapping `Scheduler._reserve`: the checker re-derives both sides independently, the cached count
from the rows scheduled since the sequence's last preemption, and `get_len()` from the prompt, the appended
tokens and the sampled rows of the current epoch whose result is not processed yet. A wrapper around
`_reserve` would compare the scheduler's counters with themselves (and `_schedule_decode` already asserts
that much); the replay catches a wrong counter too, and it runs on any recorded trace. The live check adds the
same rule between steps: a running sequence always has `num_cached_tokens == get_len() - 1`.

The deterministic tests force a preemption with a tiny pool and compare the tokens with a large-pool run
(greedy, and seeded: promise 3 through recomputation), cancel one request in each state, and pin the
smallest workload where a partly prefilled request's blocks stall a running one.

Longer local runs: MDI_LIFETIME_EXAMPLES=20 multiplies the number of examples.
"""
from __future__ import annotations

import functools
import os
import random
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from engine.llm_engine import LLMEngine
from engine.model_runner import StepHandle
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from model.checkpoint import init_weights
from model.config import BLOCK_SIZE, cdiv, preset
from model.transformer import Transformer
from tracing import Recorder
from tracing.reader import TraceFile
from tracing.schema import FINISH_REASONS
from tracing.verify import Verifier



@functools.cache
def micro_weights() -> Transformer:
    weights = Transformer(preset("micro"))
    init_weights(weights.named_parameters(), seed=0)
    return weights


def blocks_for(num_positions: int) -> int:
    return cdiv(num_positions, BLOCK_SIZE)


# ---- the trace alone ---------------------------------------------------------------------------------
class Ledger:
    """The run's trace, checked by `mdi-trace verify`'s own checker (tracing/verify.py `Verifier`) as it grows.

    The engine records through a real Recorder into a temporary log; `feed()` flushes what the engine emitted
    since (the Recorder writes at each step's end; `step_end` is its flush), reads the new events back through
    the reader and feeds them to the Verifier, and fails on its first finding. The Verifier's per-request
    state (`reqs`: blocks, slot, epoch, tokens, cached count, reservations in flight, finish) is what the trace
    says the engine holds; `check_live` compares it with the live objects."""

    def __init__(self, path: Path):
        self.path, self.recorder = path, Recorder(path)
        self.verifier: Verifier | None = None
        self.offset: int | None = None        # where the events not fed yet start
        self.records: list = []               # every event fed, as the reader's records

    def feed(self) -> None:
        self.recorder.step_end(None)          # flush the events emitted since the last step
        if not self.path.exists():
            return
        with TraceFile(self.path) as trace:
            if self.verifier is None:
                self.verifier = Verifier(trace.header)
            for e in trace.events(self.offset):
                self.verifier.feed(e)
                self.records.append(e)
                self.check(f"at the {e.kind} event at byte {e.offset}")
            self.offset = trace.cut.offset   # no footer until the engine shuts down: read up to the last event

    def check(self, where: str) -> None:
        findings = self.verifier.findings if self.verifier is not None else []
        assert not findings, f"verify {where}: " + "; ".join(map(str, findings))

    def request(self, s: int):
        """What the trace says the engine holds for request `s`."""
        return self.verifier.reqs[s]

    def inflight(self, s: int) -> int:
        """Reservations of the current epoch not yet answered: num_inflight (ARCHITECTURE.md §1)."""
        return self.request(s).inflight(self.verifier.step)

    def kinds(self, *names: str) -> list:
        return [e for e in self.records if e.kind in names]

    def check_idle(self) -> None:
        """An idle engine holds nothing: every request finished, every reservation answered, all free."""
        self.verifier.drained()
        self.check("with the engine idle")

    def close(self) -> None:
        """The engine has shut down (the Recorder wrote the footer): the end-of-log checks over the whole file."""
        with TraceFile(self.path) as trace:
            assert trace.clean
            for e in trace.events(self.offset):
                self.verifier.feed(e)
                self.records.append(e)
            self.verifier.end(trace)
        self.check("at the end of the log")


# ---- the live objects ----------------------------------------------------------------------------------
def check_pool(pool, n: int, owned: dict[int, list[int]]) -> None:
    free = list(pool.free_ids)
    assert len(set(free)) == len(free) and all(0 <= i < n for i in free), f"free list {free}"
    expected = [None] * n
    for s, ids in owned.items():
        for i in ids:
            assert expected[i] is None, f"id {i} held by {expected[i]} and {s}"
            expected[i] = s
    assert pool.owner == expected, f"owner table {pool.owner}, sequences hold {expected}"
    assert sorted(free) == [i for i in range(n) if expected[i] is None]


def check_live(engine: LLMEngine, seqs: dict[int, Sequence], ledger: Ledger) -> None:
    sched, cfg = engine.scheduler, engine.config
    check_pool(sched.blocks.pool, cfg.num_kv_blocks, {s: q.block_table for s, q in seqs.items()})
    check_pool(sched.states.pool, cfg.num_state_slots,
               {s: [q.state_slot] for s, q in seqs.items() if q.state_slot is not None})
    flight = engine.in_flight.batch.rows if engine.in_flight is not None else []
    for s, q in seqs.items():
        held = ledger.request(s)
        assert held.blocks == q.block_table and held.slot == q.state_slot, f"trace and {s} disagree"
        assert held.epoch == q.epoch and held.tokens == q.token_ids
        assert 0 <= q.num_output_tokens <= q.params.max_tokens
        if q.is_finished:
            assert held.finish == q.finish_reason and q.num_inflight == 0
            assert s not in sched.seqs and q not in sched.waiting and q not in sched.running
            continue
        assert sched.seqs[s] is q and (q in sched.waiting) != (q in sched.running)
        assert q.status == (SequenceStatus.RUNNING if q in sched.running else SequenceStatus.WAITING)
        assert held.cached == q.num_cached_tokens and ledger.inflight(s) == q.num_inflight
        assert q.num_inflight == sum(1 for r in flight if r.seq_id == s and r.sample and r.epoch == q.epoch)
        assert len(q.block_table) == blocks_for(q.num_cached_tokens)
        assert (q.state_slot is not None) == (q.num_cached_tokens > 0)
        if q.status == SequenceStatus.RUNNING:
            assert q.num_cached_tokens == q.get_len() - 1, "a running sequence is always ready to decode"
        else:
            assert q.num_inflight == 0 and q.num_cached_tokens < len(q)
    assert len(sched.waiting) + len(sched.running) == len(sched.seqs)


def check_idle(engine: LLMEngine, ledger: Ledger) -> None:
    sched, cfg = engine.scheduler, engine.config
    assert sched.blocks.num_free == cfg.num_kv_blocks and sched.states.num_free == cfg.num_state_slots
    assert not sched.seqs and engine.in_flight is None
    ledger.check_idle()


# ---- a workload ----------------------------------------------------------------------------------------
@dataclass
class Req:
    prompt_len: int
    max_tokens: int
    temperature: float
    stop: str       # "none" (ignore_eos), "eos" (the default eos only), "half", "quarter" (of the vocab)
    arrival: int    # step before which it is added
    cancel: str     # "never", "step" (at cancel_step), or when first in a state: see state_of
    cancel_step: int

    def params(self) -> SamplingParams:
        stops = {"half": tuple(range(0, 1024, 2)), "quarter": tuple(range(3, 1024, 4))}.get(self.stop, ())
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens,
                              ignore_eos=self.stop != "eos", stop_token_ids=stops)


def state_of(q: Sequence) -> str:
    if q.is_finished:
        return "finished"
    if q.status == SequenceStatus.RUNNING:
        return "running"
    return "prefilling" if q.num_cached_tokens > 0 else ("preempted" if q.epoch else "waiting")


def step_cap(cfg: SchedulerConfig, reqs: list[Req]) -> int:
    """Generous: the steps of every request run alone (prompt and outputs in budget-sized chunks, then one
    decode step per output), three times over. A scheduler that reclaims partly prefilled requests stayed
    under 1x on 2,000 workloads; more is a livelock."""
    alone = sum(cdiv(r.prompt_len + r.max_tokens, cfg.max_num_batched_tokens) + r.max_tokens + 2 for r in reqs)
    return 10 + max(r.arrival for r in reqs) + 3 * alone


class StubRunner:
    """A device without a model: each sampled row gets a token from a seeded RNG, returned through the
    same StepHandle. Everything else (LLMEngine's ZOS loop, the Scheduler, the pools) is the real code, so
    the property runs a thousand workloads in seconds. Tokens are not the model's: use it for lifetimes,
    never for token equality."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def execute(self, batch) -> StepHandle:
        done = Future()
        done.set_result((torch.tensor([self.rng.randrange(1024) for _ in batch.rows]), 0, 0))
        return StepHandle(batch, done)

    def shutdown(self) -> None:
        pass


def run_workload(cfg: SchedulerConfig, reqs: list[Req], enable_zos: bool, seed: int = 0, stub: bool = False,
                 label=lambda _: None):
    """Runs the workload to idle on the `micro` model (or a StubRunner), checking every invariant after
    every step; `label` names what happened (hypothesis.event, for --hypothesis-show-statistics). Returns
    (engine, ledger, sequences by request index); the engine is shut down and its trace verified whole."""
    with tempfile.TemporaryDirectory() as folder:
        return _run_workload(cfg, reqs, enable_zos, seed, stub, label, Ledger(Path(folder) / "run.mdt"))


def _run_workload(cfg, reqs, enable_zos, seed, stub, label, ledger):
    engine = LLMEngine(micro_weights(), cfg, enable_zos=enable_zos, seed=seed, tracer=ledger.recorder)
    if stub:
        engine.runner.shutdown()
        engine.runner = StubRunner(seed)
    seqs: dict[int, Sequence] = {}
    ids: dict[int, int] = {}              # request index -> seq id
    cancelled_unfinished: set[int] = set()
    fired: set[int] = set()               # request indices whose cancellation was issued
    reported: list[int] = []
    try:
        for step in range(step_cap(cfg, reqs) + 1):
            for i, r in enumerate(reqs):
                if r.arrival == step:
                    prompt = [(7 * i + 13 * k) % 1022 + 2 for k in range(r.prompt_len)]
                    if blocks_for(r.prompt_len + r.max_tokens) > cfg.num_kv_blocks:
                        with pytest.raises(ValueError):
                            engine.add_request(prompt, r.params())
                        continue
                    ids[i] = engine.add_request(prompt, r.params())
                    seqs[ids[i]] = engine.scheduler.seqs[ids[i]]
            for i, r in enumerate(reqs):
                if i in ids and i not in fired and r.cancel != "never":
                    q = seqs[ids[i]]
                    if (r.cancel == "step" and r.cancel_step == step) or r.cancel == state_of(q):
                        label(f"cancel a {state_of(q)} request")
                        engine.abort(ids[i])
                        if not q.is_finished:
                            cancelled_unfinished.add(ids[i])
                        fired.add(i)
            ledger.feed()
            check_live(engine, seqs, ledger)
            if not engine.has_unfinished():
                check_idle(engine, ledger)
                if all(r.arrival <= step for r in reqs):
                    break
                continue
            reported += [q.seq_id for q in engine.step()]
        else:
            raise AssertionError(f"not idle after {step_cap(cfg, reqs)} steps: livelock "
                                 f"(waiting {[(q.seq_id, q.num_cached_tokens) for q in engine.scheduler.waiting]}, "
                                 f"running {[(q.seq_id, q.num_cached_tokens) for q in engine.scheduler.running]})")
    finally:
        engine.shutdown()
    ledger.close()
    # every request finished once, reported once by step(), and a cancel before the finish gave "abort"
    assert sorted(reported) == sorted(seqs), (reported, list(seqs))
    for s in cancelled_unfinished:
        assert seqs[s].finish_reason == "abort", f"{s} cancelled while unfinished, finished {seqs[s].finish_reason}"
    finishes = [e.seq_id for e in ledger.kinds("finish")]
    assert sorted(finishes) == sorted(seqs), f"finish events {finishes}"
    for e in ledger.kinds("preempt", "finish"):
        label(e.kind if e.kind == "preempt" else f"finish {FINISH_REASONS[e.reason]}")
    return engine, ledger, {i: seqs[s] for i, s in ids.items()}


# ---- the property ---------------------------------------------------------------------------------------
temperatures = st.sampled_from([0.0, 1.0])
stops = st.sampled_from(["none", "none", "none", "eos", "half", "quarter"])
cancels = st.sampled_from(["never"] * 4 + ["step", "waiting", "prefilling", "running", "preempted", "finished"])
any_req = st.builds(Req, st.integers(1, 300), st.integers(1, 8), temperatures, stops, st.integers(0, 6), cancels,
                    st.integers(0, 20))
# a prompt just below a block boundary with a long output: its decode needs a new block, where preemption happens
crossing_req = st.builds(Req, st.one_of(st.integers(100, 127), st.integers(230, 255)), st.integers(10, 16),
                         temperatures, st.just("none"), st.integers(0, 2), cancels, st.integers(0, 20))
reqs_st = st.one_of(any_req, crossing_req)
configs = st.builds(SchedulerConfig, max_num_seqs=st.integers(2, 4), max_num_batched_tokens=st.integers(16, 300),
                    num_kv_blocks=st.integers(2, 4), num_state_slots=st.integers(1, 3))


workloads = dict(cfg=configs, reqs=st.lists(reqs_st, min_size=1, max_size=6), enable_zos=st.booleans(),
                 seed=st.integers(0, 2**31))
EXAMPLES = int(os.environ.get("MDI_LIFETIME_EXAMPLES", 1))  # a multiplier, for longer local runs


# About 1.5 s a workload on the model (2 CPU cores): no shrink phase, since shrinking a livelock there takes
# minutes; the stub test below finds and shrinks the same scheduler bugs in seconds.
@settings(max_examples=12 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.reuse, Phase.generate])
@given(**workloads)
def test_resource_lifetimes_and_decode_legality(cfg, reqs, enable_zos, seed):
    """Promise 2 on random workloads, on the micro model: one owner per KV block and state slot, frees by
    the owner only, preemption/finish/cancellation release both together, all free when idle; epochs only
    grow and no stale token is appended; decode rows are legal; one finish per request, within max_tokens;
    no livelock."""
    run_workload(cfg, reqs, enable_zos, seed, label=event)


@settings(max_examples=1000 * EXAMPLES, deadline=None, phases=[Phase.reuse, Phase.generate, Phase.shrink])
@given(**workloads)
def test_resource_lifetimes_and_decode_legality_many_workloads(cfg, reqs, enable_zos, seed):
    """The same property over a thousand workloads, with a StubRunner in place of the model."""
    run_workload(cfg, reqs, enable_zos, seed, stub=True, label=event)


# ---- deterministic cases --------------------------------------------------------------------------------
def outputs(cfg: SchedulerConfig, reqs: list[Req], enable_zos: bool):
    _, ledger, seqs = run_workload(cfg, reqs, enable_zos)
    return ledger, {i: q.output_token_ids for i, q in seqs.items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("enable_zos", [False, True])
def test_preemption_recompute_gives_same_tokens(enable_zos, temperature):
    """Three 120-token prompts decoding 12 tokens each need 2 blocks apiece; 4 blocks force preemption
    at position 128. The preempted requests recompute prompt and outputs and must produce the same
    tokens as with a pool where nothing is preempted: greedy, and seeded (promise 3: a token depends
    on the sequence seed and output position only)."""
    reqs = [Req(120, 12, temperature, "none", 0, "never", 0) for _ in range(3)]
    small = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=4, num_state_slots=4)
    large = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=16, num_state_slots=4)
    ledger, got = outputs(small, reqs, enable_zos)
    assert ledger.kinds("preempt"), "the small pool was meant to force a preemption"
    _, want = outputs(large, reqs, enable_zos)
    assert got == want
    assert all(len(t) == 12 for t in got.values())


@pytest.mark.parametrize("enable_zos", [False, True])
@pytest.mark.parametrize("state", ["waiting", "prefilling", "running", "finished"])
def test_cancel_in_each_state_releases_everything(state, enable_zos):
    """Cancel one request when it is waiting, partly prefilled (a 200-token prompt in 64-token chunks),
    running, or already finished; a second request runs beside it. All invariants hold and the
    cancelled request finishes with "abort" unless it had finished already."""
    reqs = [Req(200, 4, 0.0, "none", 0, state, 0), Req(30, 4, 0.0, "none", 0, "never", 0)]
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=4, num_state_slots=2)
    _, ledger, seqs = run_workload(cfg, reqs, enable_zos)
    assert seqs[0].finish_reason == ("length" if state == "finished" else "abort")
    assert bool(ledger.kinds("cancel")) == (state != "finished")


@pytest.mark.parametrize("enable_zos", [False, True])
def test_partly_prefilled_request_does_not_starve_a_running_one(enable_zos):
    """Two KV blocks. Request 0 (120 + 12 tokens) runs; request 1 (a 200-token prompt) is prefilled in
    32-token chunks behind it and holds one block. Request 0 needs a second block at position 128: the
    engine must still finish both (the pool admits each alone), neither livelock nor give up."""
    reqs = [Req(120, 12, 0.0, "none", 0, "never", 0), Req(200, 1, 0.0, "none", 0, "never", 0)]
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=2, num_state_slots=2)
    _, _, seqs = run_workload(cfg, reqs, enable_zos)
    assert [seqs[i].finish_reason for i in (0, 1)] == ["length", "length"]


@pytest.mark.parametrize("max_num_seqs", [1, 2, 4, 5])
def test_a_prefill_step_admits_max_num_seqs_prompts(max_num_seqs):
    """Six 20-token prompts, a budget for all of them: the first step prefills exactly max_num_seqs of them,
    each counted once against max_num_seqs (a prompt whose last chunk ran is in `running` and among the
    step's rows: counting it in both admitted only about half). The next step decodes those and admits none."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, num_kv_blocks=16, num_state_slots=8)
    sched = Scheduler(cfg)
    for i in range(6):
        sched.add(Sequence(i, list(range(3, 23)), SamplingParams(max_tokens=4), seed=i))
    first = sched.schedule()
    assert first.batch_kind == "prefill" and [r.seq_id for r in first.rows] == list(range(max_num_seqs))
    assert all(r.sample for r in first.rows)
    second = sched.schedule()  # ZOS: scheduled before the first step's tokens are processed
    assert second.batch_kind == "decode" and [r.seq_id for r in second.rows] == list(range(max_num_seqs))


def test_a_partly_prefilled_prompt_counts_against_max_num_seqs():
    """max_num_seqs 2, a budget of 100 tokens: a 20-token prompt, then a 300-token prompt whose first chunk
    takes the rest of the budget. Both are rows (the partly prefilled one stays waiting and counts once). The
    next step gives it its next 100-token chunk and admits nobody else: two sequences in all."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, num_kv_blocks=16, num_state_slots=4)
    sched = Scheduler(cfg)
    for i, n in enumerate([20, 300, 20]):
        sched.add(Sequence(i, list(range(3, 3 + n)), SamplingParams(max_tokens=4), seed=i))
    first = sched.schedule()
    assert [(r.seq_id, r.num_tokens, r.sample) for r in first.rows] == [(0, 20, True), (1, 80, False)]
    assert [q.seq_id for q in sched.running] == [0] and [q.seq_id for q in sched.waiting] == [1, 2]
    second = sched.schedule()
    assert second.batch_kind == "prefill" and [(r.seq_id, r.num_tokens) for r in second.rows] == [(1, 100)]
