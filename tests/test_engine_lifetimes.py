"""Promise 2 (resource lifetimes) and the decode-legality rule of ARCHITECTURE.md §2-§3, on random workloads.

Hypothesis draws an engine (ZOS on or off, a tiny KV block pool and few state slots, a token budget small
enough to chunk prefills) and 1-6 requests (some too large for the pool: add_request must refuse them) that
arrive at random steps and are cancelled at random steps or in a chosen state (waiting, partly prefilled,
running, preempted, finished). The engine runs on the `micro` preset with random weights until it is idle,
within a step cap (more steps is a livelock); a second property runs a thousand such workloads with a
StubRunner in place of the model. Every invariant is checked twice, after every step:

- from the MemoryTracer events alone (`Ledger`): the events are replayed per sequence, as `mdi-trace verify`
  would replay a recorded trace, so the proof needs nothing but the trace;
- from the live objects (`check_live`): the pools' owner tables, each Sequence, the queues, the step in
  flight, and the ledger's replay against all of them.

Preemption and finish release both kinds of state before their hook fires, so the sequence owns nothing at
that event. Cancellation fires `cancel` first: the ledger then requires that sequence's epoch bump, block
and slot frees and `finish("abort")` to follow with no other event between them, and checks at the finish.

Decode legality (`num_cached_tokens == get_len() - 1` when a decode row is scheduled) is checked from the
trace, not by wrapping `Scheduler._reserve`: the ledger re-derives both sides independently, the cached count
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
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from engine.llm_engine import LLMEngine
from engine.model_runner import StepHandle
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from engine.step import ScheduledRow
from engine.tracer import MemoryTracer
from model.checkpoint import init_weights
from model.config import BLOCK_SIZE, preset
from model.transformer import Transformer

EOS = SchedulerConfig().eos_token_id
REASONS = {"stop", "length", "abort"}


@functools.cache
def micro_weights() -> Transformer:
    weights = Transformer(preset("micro"))
    init_weights(weights.named_parameters(), seed=0)
    return weights


def blocks_for(num_positions: int) -> int:
    return -(-num_positions // BLOCK_SIZE)


# ---- the trace alone ---------------------------------------------------------------------------------
class Ledger:
    """Replays MemoryTracer events and asserts promise 2 and decode legality at each one.

    Per sequence it keeps what the trace says the engine holds: owned blocks (in block-table order) and
    slot, epoch, token ids, cached count, and the sampled rows whose result has not come back yet."""

    def __init__(self):
        self.block_owner: dict[int, int] = {}
        self.slot_owner: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}
        self.slot: dict[int, int | None] = {}
        self.epoch: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.params: dict[int, SamplingParams] = {}
        self.cached: dict[int, int] = {}
        self.pending: dict[tuple[int, int], ScheduledRow] = {}  # (step, seq_id) -> a row that samples
        self.finish: dict[int, str] = {}
        self.cancelled: set[int] = set()
        self.preempted_now: list[int] = []  # preemptions since the last schedule event
        self.next_step = 0
        self.closing: int | None = None     # a cancelled sequence whose release and finish must follow
        self.prev: tuple = ()
        self.num_events = 0

    def feed(self, events: list[tuple]) -> None:
        for e in events[self.num_events:]:
            name, *args = e
            if self.closing is not None and name not in ("epoch_bump", "block_free", "slot_free", "finish"):
                raise AssertionError(f"{name} between cancel of {self.closing} and its finish")
            if self.closing is not None:
                s = args[1] if name == "finish" else args[0]
                assert s == self.closing, f"{e}: another sequence's event inside a cancellation"
            getattr(self, "on_" + name, lambda *a: None)(*args)
            self.prev = e
        self.num_events = len(events)

    def inflight(self, s: int) -> int:
        """Sampled rows of the current epoch not yet processed: the reservations of ARCHITECTURE.md §1."""
        return sum(1 for (_, sid), r in self.pending.items() if sid == s and r.epoch == self.epoch[s])

    def live(self, s: int) -> None:
        assert s in self.epoch, f"sequence {s} was never added"
        assert s not in self.finish, f"sequence {s} acts after its finish ({self.finish[s]})"

    def owns_nothing(self, s: int, when: str) -> None:
        assert not self.blocks[s] and self.slot[s] is None, \
            f"sequence {s} still owns blocks {self.blocks[s]} / slot {self.slot[s]} at {when}"

    # one method per hook
    def on_request_added(self, s, prompt, params, seed):
        assert s not in self.epoch, f"request id {s} added twice"
        self.blocks[s], self.slot[s], self.epoch[s], self.cached[s] = [], None, 0, 0
        self.tokens[s], self.prompt_len[s], self.params[s] = list(prompt), len(prompt), params

    def on_block_alloc(self, s, ids):
        self.live(s)
        for b in ids:
            assert b not in self.block_owner, f"block {b} given to {s} but owned by {self.block_owner[b]}"
            self.block_owner[b] = s
        assert len(set(ids)) == len(ids)
        self.blocks[s] += ids

    def on_block_free(self, s, ids):
        self.live(s)
        assert list(ids) == self.blocks[s], f"{s} frees {ids} but owns {self.blocks[s]}"
        for b in ids:
            assert self.block_owner.pop(b) == s
        self.blocks[s] = []

    def on_slot_alloc(self, s, slot):
        self.live(s)
        assert slot not in self.slot_owner, f"slot {slot} given to {s} but owned by {self.slot_owner[slot]}"
        assert self.slot[s] is None, f"{s} gets slot {slot} but has slot {self.slot[s]}"
        self.slot_owner[slot], self.slot[s] = s, slot

    def on_slot_free(self, s, slot):
        self.live(s)
        assert self.slot[s] == slot and self.slot_owner.get(slot) == s, f"{s} frees slot {slot} it does not own"
        # together: a slot is released right after the same sequence's blocks (a slot never lives without one)
        assert self.prev[:2] == ("block_free", s), f"slot_free of {s} not paired with its block_free: {self.prev}"
        del self.slot_owner[slot]
        self.slot[s] = None

    def on_epoch_bump(self, s, epoch, reason):
        assert epoch == self.epoch[s] + 1, f"epoch of {s} goes {self.epoch[s]} -> {epoch}"
        expected = "preempt" if self.prev[:1] == ("preempt",) else "cancel"
        assert self.prev[0] in ("preempt", "cancel") and self.prev[2] == s and reason == expected, \
            f"epoch bump ({reason}) of {s} not right after its preempt or cancel: {self.prev}"
        self.epoch[s] = epoch

    def on_preempt(self, step, s):
        self.live(s)
        assert step == self.next_step, f"preempt at step {step} while scheduling step {self.next_step}"
        self.owns_nothing(s, "preempt")
        self.cached[s] = 0
        self.preempted_now.append(s)

    def on_cancel(self, step, s):
        self.live(s)
        self.cancelled.add(s)
        self.closing = s

    def on_finish(self, step, s, reason):
        self.live(s)
        self.owns_nothing(s, f"finish ({reason})")
        assert reason in REASONS, reason
        assert (reason == "abort") == (s in self.cancelled), f"{s}: finish {reason}, cancelled: {s in self.cancelled}"
        n_out, p = len(self.tokens[s]) - self.prompt_len[s], self.params[s]
        assert n_out <= p.max_tokens
        if reason == "length":
            assert n_out == p.max_tokens, f"{s}: length finish after {n_out} of {p.max_tokens} tokens"
        if reason == "stop":
            last = self.tokens[s][-1]
            assert n_out >= 1 and (last in p.stop_token_ids or (not p.ignore_eos and last == EOS))
        self.finish[s], self.closing = reason, None

    def on_schedule(self, batch):
        assert batch.step == self.next_step, f"step {batch.step} scheduled, expected {self.next_step}"
        assert sorted(batch.preempted) == sorted(self.preempted_now), (batch.preempted, self.preempted_now)
        assert batch.batch_kind in ("prefill", "decode") and (batch.rows or batch.preempted)
        assert batch.batch_kind == "decode" or not batch.preempted, "preemption happens in decode only"
        seen = set()
        for r in batch.rows:
            s = r.seq_id
            self.live(s)
            assert s not in seen and s not in batch.preempted, f"sequence {s} twice or preempted in step {batch.step}"
            seen.add(s)
            self.check_row(batch.batch_kind, r)
        self.next_step, self.preempted_now = self.next_step + 1, []

    def check_row(self, kind, r):
        s, inflight = r.seq_id, self.inflight(r.seq_id)
        known = len(self.tokens[s])                      # len(seq)
        get_len, out = known + inflight, known - self.prompt_len[s]
        end = r.start + r.num_tokens
        assert r.epoch == self.epoch[s], f"row of {s} carries epoch {r.epoch}, sequence is at {self.epoch[s]}"
        assert r.start == self.cached[s], f"row of {s} starts at {r.start}, {self.cached[s]} are cached"
        assert r.block_table == self.blocks[s] and len(r.block_table) == blocks_for(end), \
            f"row of {s} [{r.start}, {end}) uses blocks {r.block_table}, owns {self.blocks[s]}"
        assert r.state_slot is not None and r.state_slot == self.slot[s]
        assert r.num_tokens >= 1 and r.sample == (end == get_len)
        if kind == "decode":
            # decode legality: every earlier token is cached, the row computes the last one
            assert r.num_tokens == 1 and r.start == get_len - 1, \
                f"decode row of {s} at {r.start} with get_len {get_len}: not num_cached == get_len - 1"
            assert r.sample and inflight < self.params[s].max_tokens - out
            assert r.token_ids == ([None] if inflight else [self.tokens[s][-1]]), r.token_ids
        else:
            assert inflight == 0 and end <= known and r.token_ids == self.tokens[s][r.start:end]
        if r.sample:
            assert r.output_position == out + inflight, (r.output_position, out, inflight)
            self.pending[(self.next_step, s)] = r
        self.cached[s] = end

    def on_token(self, step, s, epoch, position, token, appended):
        r = self.pending.pop((step, s), None)
        assert r is not None, f"token for ({step}, {s}) that no sampled row reserved"
        assert epoch == r.epoch and position == r.start + r.num_tokens
        stale = s in self.finish or epoch != self.epoch[s]
        assert appended != stale, f"token of {s} at step {step}: appended={appended}, stale={stale}"
        if appended:
            assert position == len(self.tokens[s]), f"token of {s} at {position}, has {len(self.tokens[s])}"
            assert not any(st_ < step for (st_, sid), p in self.pending.items() if sid == s and p.epoch == epoch), \
                "results of one sequence are appended out of step order"
            assert 0 <= token < 1024
            self.tokens[s].append(token)

    def check_idle(self) -> None:
        assert not self.block_owner and not self.slot_owner, (self.block_owner, self.slot_owner)
        assert not self.pending, f"sampled rows never processed: {list(self.pending)}"
        assert set(self.finish) == set(self.epoch), f"requests without a finish: {set(self.epoch) - set(self.finish)}"


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
        assert ledger.blocks[s] == q.block_table and ledger.slot[s] == q.state_slot, f"trace and {s} disagree"
        assert ledger.epoch[s] == q.epoch and ledger.tokens[s] == q.token_ids
        assert 0 <= q.num_output_tokens <= q.params.max_tokens
        if q.is_finished:
            assert ledger.finish[s] == q.finish_reason and q.num_inflight == 0
            assert s not in sched.seqs and q not in sched.waiting and q not in sched.running
            continue
        assert sched.seqs[s] is q and (q in sched.waiting) != (q in sched.running)
        assert q.status == (SequenceStatus.RUNNING if q in sched.running else SequenceStatus.WAITING)
        assert ledger.cached[s] == q.num_cached_tokens and ledger.inflight(s) == q.num_inflight
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
    alone = sum(-(-(r.prompt_len + r.max_tokens) // cfg.max_num_batched_tokens) + r.max_tokens + 2 for r in reqs)
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
    (engine, tracer, ledger, sequences by request index); the engine is shut down."""
    tracer, ledger = MemoryTracer(), Ledger()
    engine = LLMEngine(micro_weights(), cfg, enable_zos=enable_zos, seed=seed, tracer=tracer)
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
            ledger.feed(tracer.events)
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
    # every request finished once, reported once by step(), and a cancel before the finish gave "abort"
    assert sorted(reported) == sorted(seqs), (reported, list(seqs))
    for s in cancelled_unfinished:
        assert seqs[s].finish_reason == "abort", f"{s} cancelled while unfinished, finished {seqs[s].finish_reason}"
    finishes = [e[2] for e in tracer.kinds("finish")]
    assert sorted(finishes) == sorted(seqs), f"finish events {finishes}"
    for e in tracer.kinds("preempt", "finish"):
        label(e[0] if e[0] == "preempt" else f"finish {e[3]}")
    return engine, tracer, ledger, {i: seqs[s] for i, s in ids.items()}


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
    _, tracer, _, seqs = run_workload(cfg, reqs, enable_zos)
    return tracer, {i: q.output_token_ids for i, q in seqs.items()}


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
    tracer, got = outputs(small, reqs, enable_zos)
    assert tracer.kinds("preempt"), "the small pool was meant to force a preemption"
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
    _, tracer, _, seqs = run_workload(cfg, reqs, enable_zos)
    assert seqs[0].finish_reason == ("length" if state == "finished" else "abort")
    assert bool(tracer.kinds("cancel")) == (state != "finished")


@pytest.mark.parametrize("enable_zos", [False, True])
def test_partly_prefilled_request_does_not_starve_a_running_one(enable_zos):
    """Two KV blocks. Request 0 (120 + 12 tokens) runs; request 1 (a 200-token prompt) is prefilled in
    32-token chunks behind it and holds one block. Request 0 needs a second block at position 128: the
    engine must still finish both (the pool admits each alone), neither livelock nor give up."""
    reqs = [Req(120, 12, 0.0, "none", 0, "never", 0), Req(200, 1, 0.0, "none", 0, "never", 0)]
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=2, num_state_slots=2)
    _, _, _, seqs = run_workload(cfg, reqs, enable_zos)
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
