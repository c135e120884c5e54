"""`verify`: prove promise 2 and the step contract (ARCHITECTURE.md §2-§3) from a recorded log alone.

No DeepInfer file does this; the engine's own tests (tests/test_engine_lifetimes.py) run their random
workloads through this checker too, step by step (`Verifier`). Imports no torch: of engine/ only
engine/step.py's `tables_digest` (the digest of the resource tables the engine writes, so that the two cannot
drift apart) and of model/ only config.py's `cdiv`; neither module imports torch.

    from tracing.reader import open_trace
    from tracing.verify import verify
    for finding in verify(open_trace("run.mdt")):
        print(finding)        # step 12, request 3: block 7 allocated while owned by request 1

The events are replayed in order, rebuilding per request what the engine held: prompt and appended tokens,
epoch, KV blocks (in block-table order), state slot, positions computed since the last preemption, and the
reservations whose token has not come back; and the scheduler's waiting queue. Each event is checked against
that state:

1. a KV block or state slot has one owner at a time, and only its owner frees it;
2. preemption, finish and cancellation release blocks and slot together: after a `preempt` or `finish` the
   request owns nothing, frees happen only inside one of them, a slot is freed right after its request's
   blocks, and a `cancel` is followed by exactly its epoch bump, block and slot frees and `finish(abort)` (the
   order of `Scheduler.abort`);
3. an epoch only grows, by 1, right after the `preempt` or `cancel` that gives its reason (the epoch reason is
   named as the event before it: `preempt` or `cancel`);
4. a token (appended or not) answers a reservation, at the position its row ends; a token appended
   (`appended=True`) carries the request's current epoch, belongs to a live request, lands at position == its
   current length (so results come back in step order) and is in the model's vocabulary (the header's
   `model.vocab_size`, when it has one); a token of the current epoch is never discarded;
5. rows are legal: a decode row starts at get_len() - 1 (tokens + reservations in flight of the current epoch,
   minus 1) with that many positions computed, and its input token is None exactly when a token is in flight;
   a prefill chunk continues where the last one stopped and feeds the request's own tokens; every row carries
   the current epoch, the owned block table and slot, and samples exactly when it reaches get_len(); and every
   row, sampled or not, carries its request's seed and temperature (from `request_added`) and output_position
   get_len() - prompt length, the output tokens appended or in flight (`Scheduler._reserve`), below the
   request's max_tokens when the row samples; a row has at least one token and its block table exactly the
   blocks its positions need (ceil(end / block_size)); a step has rows or preemptions, and only a decode step
   preempts;
6. a clean log (with a footer) ends with every resource free, every request finished, every reservation
   answered, and a footer that counts the events it follows;
7. each `step_digest` equals the digest of the rebuilt tables (`LLMEngine.digest`);
8. a finish is legal: `abort` exactly after a cancellation, `length` with max_tokens output tokens appended,
   `stop` with at least one, the last a stop token (or EOS, the header's `engine.eos_token_id`, unless the
   request ignores it), and never more than max_tokens;
9. prefill admits FCFS: a prefill step's rows are the first requests of the waiting queue, in its order, and
   a decode step's rows are running requests. The queue is rebuilt as `Scheduler` keeps it: `request_added`
   appends; a prompt stays in it, at its place, while partly prefilled (also when preempted in place) and
   leaves it with its last chunk; a running request preempted goes to its head; a finish removes it;
10. time runs forward: the host's readings (every event's `t`, and a CPU span's end, read just before the span
   is written) never decrease in log order; a span ends at or after it starts; the CPU spans (one host
   thread, one phase at a time) and the device spans (one device, steps in FIFO order) each follow one
   another without overlap, the device's in step order. A CPU span is written after later events (the
   schedule span after the step's schedule events), so its start is compared only with earlier spans. A
   request arrives (`arrival`) at or before it is added, and a cancellation names a known cause.

A log cut short is checked up to its last complete event; the result then holds one note (a Finding with
`violation=False`) that says so, and no end-of-run findings: `mdi-trace verify` exits 0 unless a finding is
a violation.

Memory is bounded by the log, not by what it claims (issue #17): the result (`Findings`, a list) keeps the first
MAX_FINDINGS violations and counts every one in `total`; a block_alloc naming ids outside the header's pool
(`engine.num_kv_blocks`) is one finding for the event, not one per id; who owns each block or slot is a list
indexed by id, sized by the pool (a dict of the held ones when the header names no pool, or a huge one); a
request's block table grows past the pool only by legal allocations; and the lists a message shows are cut
to their first SHOWN entries.

`verify` reads a log; `Verifier` is the same checker fed one record at a time (`feed`), for a run still
going: its `reqs` hold what the log says the engine holds per request, and `drained()` checks what an idle
engine must hold (nothing).

A run of several ranks (tracing/ranks.py) is checked by `verify_run`: every rank's log as above (each rank
runs its own scheduler, so each proves its own promises), plus what ties the ranks together: request ids
partitioned by rank (rank r of N holds ids r mod N, so no request is on two ranks) and one configuration
(`SHARED_HEADER`) on every rank.

Where a finding's step comes from: the event's own `step` field, else (allocations, frees, epoch bumps) the
step the scheduler is at, which is also what the engine writes in `preempt`, `cancel` and `finish`. Under ZOS
that is one or two steps after the step whose result is being processed (`token` and `step_digest` carry the
processed step). A damaged file raises the reader's TraceError.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.step import tables_digest
from model.config import cdiv
from tracing.reader import TraceFile
from tracing.schema import BATCH_KINDS, CANCEL_CAUSES, EPOCH_REASONS, FINISH_REASONS, PHASES, Event, Row

SHARED_HEADER = ("checkpoint_digest", "model", "model_source", "dtype", "engine", "seed", "torch", "intra_op_threads")
RELEASE_EVENTS = ("epoch_bump", "block_free", "slot_free", "finish")  # what may follow a cancel (Scheduler.abort)
NO_TIME = float("-inf")                                              # before the first clock reading
MAX_FINDINGS = 100        # violations kept (in log order); the rest are counted in Findings.total
SHOWN = 32                # entries of a list (block ids, steps, requests) that a message shows
LIST_POOL = 1 << 20       # pools up to this size get an owner list indexed by id; larger ones a dict
FREE = None               # the owner of a block or slot that nobody holds (a seq_id is an int, never None)


@dataclass(slots=True)
class Finding:
    step: int | None          # None: found at the end of the log
    seq_id: int | None        # the request, None for a step-wide finding
    offset: int | None        # byte offset of the event that shows it
    message: str
    violation: bool = True    # False for a note that is not a broken promise (the log was cut short)
    rank: int | None = None   # the rank's log it was found in, in a run of several ranks

    def __str__(self) -> str:
        where = "end of log" if self.step is None else f"step {self.step}"
        if self.rank is not None:
            where = f"rank {self.rank}, {where}"
        if self.seq_id is not None:
            where += f", request {self.seq_id}"
        return f"{where}: {self.message}"


class Findings(list):
    """The findings of a log or a run, in order: the first `limit` violations and every note (`violation=False`,
    a few at most); `total` counts every violation found, kept or not, so `total - kept` were left out."""

    def __init__(self, findings=(), limit: int = MAX_FINDINGS):
        super().__init__()
        self.limit, self.total, self.kept = limit, 0, 0
        for f in findings:
            self.add(f)

    @property
    def full(self) -> bool:
        """Whether a further violation is only counted."""
        return self.kept >= self.limit

    def add(self, f: Finding) -> Finding | None:
        """Keep `f` (a note always, a violation while there is room) and count it; returns it if kept."""
        if f.violation:
            self.total += 1
            if self.kept >= self.limit:
                return None
            self.kept += 1
        self.append(f)
        return f

    def merge(self, other: Findings, rank: int | None = None) -> None:
        """Add `other`'s findings (with their rank set) and count the violations it left out."""
        for f in other:
            if rank is not None:
                f.rank = rank
            self.add(f)
        self.total += other.total - other.kept


class _Pool:
    """Who holds each KV block (or state slot): `owner[i]`, FREE for nobody. A list indexed by id when the
    header's pool size is known and at most LIST_POOL (ids outside the pool are never held: `inside`), else a
    dict of the held ones, which returns FREE for the others."""

    def __init__(self, size):
        self.size = size if type(size) is int and size >= 0 else None
        self.owner = [FREE] * self.size if self.size is not None and self.size <= LIST_POOL else _Held()

    def inside(self, i) -> bool:
        """Whether `i` is an id of the pool (any id when its size is unknown); TypeError for a non-number."""
        return self.size is None or 0 <= i < self.size

    def get(self, i):
        return self.owner[i] if self.inside(i) else FREE

    def release(self, i) -> None:
        if type(self.owner) is list:
            self.owner[i] = FREE
        else:
            self.owner.pop(i, None)

    def held(self) -> list[tuple]:
        """(id, owner) of every held id, by id."""
        if type(self.owner) is list:
            return [(i, s) for i, s in enumerate(self.owner) if s is not FREE]
        try:
            return sorted(self.owner.items())
        except TypeError:  # ids of several types (a damaged log): in allocation order
            return list(self.owner.items())


class _Held(dict):
    def __missing__(self, key):
        return FREE


def _short(values, shown: int = SHOWN, total: int | None = None) -> str:
    """A list as Python prints it, cut to its first `shown` entries with the count (`total`, default its
    length) when longer: `[1, 2, ...] (4,194,304 in all)`."""
    values = list(values)
    total = len(values) if total is None else total
    if total <= shown and len(values) == total:
        return str(values)
    return f"{str(values[:shown])[:-1]}, ...] ({total:,} in all)"


@dataclass(slots=True)
class _Request:
    """What the log says the engine holds for one request."""
    tokens: list[int]                 # prompt and appended tokens: len(seq.token_ids)
    prompt_len: int
    seed: int
    temperature: float
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    epoch: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0                   # positions computed since the last preemption: num_cached_tokens
    reserved: dict[int, int] = field(default_factory=dict)  # step -> epoch of a reservation not answered yet
    ends: dict[int, int] = field(default_factory=dict)      # step -> where its sampled row ends, not answered yet
    finish: str | None = None

    def inflight(self, before_step: int) -> int:
        """Reservations of the current epoch made before `before_step`: num_inflight when it is scheduled."""
        return sum(1 for step, epoch in self.reserved.items() if epoch == self.epoch and step < before_step)

    def get_len(self, before_step: int) -> int:
        return len(self.tokens) + self.inflight(before_step)


def verify(trace: TraceFile) -> Findings:
    """The findings in the log, in event order (ARCHITECTURE.md §2 promise 2, §3 the step contract): the first
    MAX_FINDINGS violations kept, every one counted in `.total`."""
    v = Verifier(trace.header)
    for event in trace.events():
        v.feed(event)
    v.end(trace)
    return v.findings


def verify_run(run) -> Findings:
    """The findings of a `tracing.ranks.Run` (of its `selected` ranks): each rank's log in rank order
    (findings carry their rank when there are several), then each rank's header fields of SHARED_HEADER
    that differ from rank 0's. The first MAX_FINDINGS violations of the run are kept, all counted in `.total`."""
    if run.world_size == 1:
        return verify(run.traces[0])
    findings = Findings()
    for rank in run.selected:
        trace = run.traces[rank]
        findings.merge(verify(trace), rank)
        for key in SHARED_HEADER:
            if trace.header.get(key) != run.header.get(key):
                findings.add(Finding(None, None, None, f"its header's {key} differs from rank 0's", rank=rank))
    return findings


def _seq_field(event: Event) -> int | None:
    return event.seq_id if "seq_id" in event.names else None


class Verifier:
    """The checker, one record at a time: `feed(record)` for each event in log order, then `end(trace)` for a
    whole log (or `drained()` where the engine is idle). `findings` collects what it found so far."""

    def __init__(self, header: dict):
        engine = header.get("engine") or {}
        self.num_blocks, self.num_slots = engine.get("num_kv_blocks"), engine.get("num_state_slots")
        self.rank, self.world_size = header.get("rank") or 0, header.get("world_size") or 1
        self.reqs: dict[int, _Request] = {}
        self.block_owner, self.slot_owner = _Pool(self.num_blocks), _Pool(self.num_slots)
        self.num_blocks, self.num_slots = self.block_owner.size, self.slot_owner.size  # None unless a sane int
        block_size, model = engine.get("block_size"), header.get("model") or {}
        self.block_size = block_size if type(block_size) is int and block_size >= 1 else None
        vocab = model.get("vocab_size") if isinstance(model, dict) else None
        self.vocab_size = vocab if type(vocab) is int and vocab >= 1 else None
        self.eos = engine.get("eos_token_id")
        self.step = 0                          # the step being scheduled: schedule events so far
        self.preempted: list[int] = []         # preemptions since the last schedule event
        self.reservations: dict[int, tuple[int, int]] = {}  # this step's: seq_id -> (epoch, output_position)
        self.cancelling: int | None = None     # a cancelled request whose release and finish must follow
        self.freeing: int | None = None        # a request whose frees must end in its preempt or finish
        self.prev: Event | None = None
        self.event: Event | None = None
        self.counts: Counter[str] = Counter()
        self.step_offsets: list[list[int]] = []
        self.waiting: list[int] = []           # the scheduler's waiting queue, head first
        self.host_time = NO_TIME               # the host's last clock reading: an event's t or a CPU span's end
        self.cpu_end = NO_TIME                 # where the last CPU span ends
        self.device_last = (-1, NO_TIME)       # the last device span's step and end
        self.findings = Findings()

    def fail(self, seq_id: int | None, message: str) -> Finding | None:
        """Report a violation at the current event; returns the Finding if it is kept."""
        if self.findings.full:
            self.findings.total += 1
            return None
        e = self.event  # None at the end of the log
        step = None if e is None else e.step if "step" in e.names else self.step
        return self.findings.add(Finding(step, seq_id, None if e is None else e.offset, message))

    def counted(self) -> bool:
        """True (and the violation counted) when findings are full: a loop over ids skips the message."""
        if self.findings.full:
            self.findings.total += 1
            return True
        return False

    def feed(self, event: Event) -> None:
        self.event = event
        self.counts[event.kind] += 1
        try:
            self._check_order(event.kind, _seq_field(event))
            if "t" in event.names:
                self._host_clock(event.t, f"a {event.kind} event written at t={event.t}")
            handler = getattr(self, "on_" + event.kind, None)
            if handler is not None:
                handler(event)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            self.fail(None, f"a malformed {event.kind} event ({type(e).__name__}: {str(e)[:200]})")
        self.prev = event

    # ---- order: what must follow a preemption, a cancellation, a free ------------------------------
    def _check_order(self, kind: str, s: int | None) -> None:
        """`kind` (of request `s`) comes next: does it break a sequence that must not be interrupted?"""
        p = self.prev
        if p is not None and p.kind in EPOCH_REASONS and not (kind == "epoch_bump" and s == p.seq_id):
            self.fail(p.seq_id, f"{p.kind} without an epoch bump right after it")
        if self.cancelling is not None and not (kind in RELEASE_EVENTS and s == self.cancelling):
            self.fail(self.cancelling, f"a {kind} event between its cancellation and its finish")
            self.cancelling = None
        if self.freeing is not None and not (kind in ("block_free", "slot_free", "preempt", "finish")
                                             and s == self.freeing):
            self.fail(self.freeing, "blocks or slot freed outside a preemption, finish or cancellation")
            self.freeing = None

    def live(self, s: int) -> _Request | None:
        req = self.reqs.get(s)
        if req is None:
            self.fail(s, f"a {self.event.kind} event for a request that was never added")
        elif req.finish is not None:
            self.fail(s, f"a {self.event.kind} event after the request finished ({req.finish})")
            return None
        return req

    # ---- requests and resources -----------------------------------------------------------------------
    def on_request_added(self, e) -> None:
        s, prompt_token_ids = e.seq_id, e.prompt_token_ids
        if s in self.reqs:
            self.fail(s, "request added twice")
        if e.arrival > e.t:
            self.fail(s, f"request added at {e.t} ns before it arrived at {e.arrival} ns")
        if s % self.world_size != self.rank:
            self.fail(s, f"request {s} added on rank {self.rank} of {self.world_size}, whose request ids are "
                         f"{self.rank} mod {self.world_size}")
        self.reqs[s] = _Request(list(prompt_token_ids), len(prompt_token_ids), e.seed, e.temperature, e.max_tokens,
                                e.ignore_eos, list(e.stop_token_ids))
        self.waiting.append(s)

    # A resource given to a second owner stays with the first in `block_owner`/`slot_owner` and enters the
    # second's table too (as in the log): one finding, not one per later row. An id outside the pool is one
    # finding for the event; it enters the request's table (so that its rows and its free agree) but no owner
    # list. A table grows past the pool's size only by free blocks, so ids allocated again and again (each one
    # counted) cost no memory.
    def on_block_alloc(self, e) -> None:
        s, block_ids = e.seq_id, e.block_ids
        req = self.live(s)
        table = None if req is None else req.blocks
        pool = self.block_owner
        n, owner = pool.size, pool.owner
        outside, shown, note = 0, [], None
        for b in block_ids:
            if n is not None and not 0 <= b < n:
                if not outside:
                    note = self.fail(s, f"block {b} allocated, outside the pool of {n}")
                outside += 1
                if len(shown) < SHOWN:
                    shown.append(b)
                if table is not None and len(table) < n:
                    table.append(b)
                continue
            holder = owner[b]
            if holder is FREE:
                owner[b] = s
                if table is not None:
                    table.append(b)
                continue
            if not self.counted():
                self.fail(s, f"block {b} allocated while owned by request {holder}")
            if table is not None and (n is None or len(table) < n):
                table.append(b)
        if outside > 1 and note is not None:
            note.message = f"blocks {_short(shown, total=outside)} allocated, outside the pool of {n}"

    def on_slot_alloc(self, e) -> None:
        s, slot = e.seq_id, e.state_slot
        req = self.live(s)
        pool = self.slot_owner
        if not pool.inside(slot):
            self.fail(s, f"slot {slot} allocated, outside the pool of {pool.size}")
        elif pool.owner[slot] is not FREE:
            self.fail(s, f"slot {slot} allocated while owned by request {pool.owner[slot]}")
        else:
            pool.owner[slot] = s
        if req is not None:
            if req.slot is not None:
                self.fail(s, f"slot {slot} allocated while the request holds slot {req.slot}")
            req.slot = slot

    def on_block_free(self, e) -> None:
        s, block_ids = e.seq_id, e.block_ids
        req = self.live(s)
        known = self.reqs.get(s)             # a finished request too: its (emptied) table is checked
        held = Counter(known.blocks) if known is not None else Counter()  # the table, as a multiset
        gone: Counter = Counter()
        for b in block_ids:
            mine = held[b] > 0
            self._give_back(self.block_owner, "block", b, s, mine)
            if req is not None and mine:
                held[b] -= 1
                gone[b] += 1
        if gone:  # each id freed leaves the table once, its first occurrence (list.remove)
            kept = []
            for b in req.blocks:
                if gone[b] > 0:
                    gone[b] -= 1
                else:
                    kept.append(b)
            req.blocks = kept
        self.freeing = s

    def on_slot_free(self, e) -> None:
        s, slot = e.seq_id, e.state_slot
        p = self.prev
        if p is None or p.kind != "block_free" or p.seq_id != s:
            self.fail(s, f"slot {slot} freed, not right after the request's blocks (blocks and slot are "
                         f"released together)")
        req = self.live(s)
        known = self.reqs.get(s)
        self._give_back(self.slot_owner, "slot", slot, s, known is not None and known.slot == slot)
        if req is not None and req.slot == slot:
            req.slot = None
        self.freeing = s

    def _give_back(self, pool: _Pool, what: str, i, s, mine: bool) -> None:
        """Free `i` from request `s`; `mine`: whether it is in the request's own table (or its slot)."""
        holder = pool.get(i)
        if holder is not FREE and holder == s:
            pool.release(i)
        elif mine and not pool.inside(i):  # outside the pool: reported when it was allocated
            return
        elif holder is FREE or s not in self.reqs or not mine:
            if not self.counted():
                by = "no request" if holder is FREE else f"request {holder}"
                self.fail(s, f"{what} {i} freed while owned by {by}")

    def owns_nothing(self, s: int, req: _Request, when: str) -> None:
        """After a preemption or finish. What it still holds is reported once, then taken as released."""
        held = ([f"blocks {_short(req.blocks)}"] if req.blocks else []) + \
            ([f"slot {req.slot}"] if req.slot is not None else [])
        if held:
            self.fail(s, f"still owns {' and '.join(held)} at its {when}")
            for b in req.blocks:
                if self.block_owner.get(b) == s:
                    self.block_owner.release(b)
            if req.slot is not None and self.slot_owner.get(req.slot) == s:
                self.slot_owner.release(req.slot)
            req.blocks, req.slot = [], None

    # ---- preemption, cancellation, finish, epochs --------------------------------------------------
    def on_preempt(self, e) -> None:
        step, s = e.step, e.seq_id
        req = self.live(s)
        if step != self.step:
            self.fail(s, f"preempted at step {step} while step {self.step} is being scheduled")
        if req is not None:
            self.owns_nothing(s, req, "preemption")
            req.cached = 0
            if s not in self.waiting:  # a running request is requeued at the head; a partly prefilled
                self.waiting.insert(0, s)  # prompt keeps its place
        self.preempted.append(s)
        self.freeing = None

    def on_cancel(self, e) -> None:
        if not 0 <= e.cause < len(CANCEL_CAUSES):
            self.fail(e.seq_id, f"cancellation with an unknown cause {e.cause!r}")
        if self.live(e.seq_id) is not None:
            self.cancelling = e.seq_id

    def on_epoch_bump(self, e) -> None:
        s, epoch, reason = e.seq_id, e.epoch, e.reason
        req, p = self.live(s), self.prev
        if not 0 <= reason < len(EPOCH_REASONS):
            self.fail(s, f"epoch bump with an unknown reason {reason!r}")
        elif p is None or p.kind not in EPOCH_REASONS or p.seq_id != s:
            self.fail(s, f"epoch bump ({EPOCH_REASONS[reason]}) with no preemption or cancellation before it")
        elif EPOCH_REASONS[reason] != p.kind:
            self.fail(s, f"epoch bump with reason {EPOCH_REASONS[reason]} right after a {p.kind}")
        if req is not None:
            if epoch != req.epoch + 1:
                self.fail(s, f"epoch goes from {req.epoch} to {epoch}; it only grows, by 1")
            req.epoch = epoch

    def on_finish(self, e) -> None:
        s, reason = e.seq_id, e.reason
        req = self.live(s)
        name = FINISH_REASONS[reason] if 0 <= reason < len(FINISH_REASONS) else f"unknown reason {reason!r}"
        if (name == "abort") != (self.cancelling == s):
            self.fail(s, f"finish ({name}) " + ("after a cancellation" if self.cancelling == s else
                                                "without a cancellation before it"))
        elif req is not None and (problem := self._finish_problem(req, name)) is not None:
            self.fail(s, problem)
        if req is not None:
            self.owns_nothing(s, req, f"finish ({name})")
            req.finish = name
        if s in self.waiting:  # cancelled while waiting
            self.waiting.remove(s)
        self.cancelling = None if self.cancelling == s else self.cancelling
        self.freeing = None

    def _finish_problem(self, req: _Request, name: str) -> str | None:
        """Why a finish of this reason is wrong for what the request holds (`Scheduler.process`), or None."""
        out = len(req.tokens) - req.prompt_len
        if out > req.max_tokens:
            return f"finish ({name}) with {out} output tokens, more than max_tokens {req.max_tokens}"
        if name == "length" and out != req.max_tokens:
            return f"finish (length) with {out} of max_tokens {req.max_tokens} output tokens"
        if name == "stop":
            last = req.tokens[-1] if out else None
            stops = last is not None and (last in req.stop_token_ids or (not req.ignore_eos and last == self.eos))
            if not stops:
                return f"finish (stop) whose last output token {last} is no stop token"
        return None

    # ---- scheduling: reservations and rows -----------------------------------------------------------
    def on_reservation(self, e) -> None:
        step, s, epoch, output_position = e.step, e.seq_id, e.epoch, e.output_position
        req = self.live(s)
        if step != self.step:
            self.fail(s, f"a reservation for step {step} while step {self.step} is being scheduled")
        if req is not None:
            if epoch != req.epoch:
                self.fail(s, f"a reservation at epoch {epoch}, the request is at epoch {req.epoch}")
            req.reserved[step] = epoch
        self.reservations[s] = (epoch, output_position)

    def on_schedule(self, e) -> None:
        step, rows, preempted = e.step, e.rows, e.preempted
        self.step_offsets.append([step, e.offset])
        if step != self.step:
            self.fail(None, f"step {step} scheduled where step {self.step} comes next")
        if sorted(preempted) != sorted(self.preempted):
            self.fail(None, f"the batch lists preempted requests {_short(sorted(preempted))}, the events "
                            f"preempted {_short(sorted(self.preempted))}")
        kind = BATCH_KINDS[e.batch_kind]
        if not rows and not preempted:
            self.fail(None, f"a {kind} step with no rows and no preemption")
        if preempted and kind != "decode":
            self.fail(None, f"a {kind} step that preempts {_short(sorted(preempted))}: only decode preempts")
        self.check_admission(kind, rows)
        seen: set[int] = set()
        for row in rows:
            if row.seq_id in seen or row.seq_id in preempted:
                self.fail(row.seq_id, "the request is in the batch twice, or both preempted and scheduled")
            seen.add(row.seq_id)
            self.check_row(kind, row)
        for s in self.reservations.keys() - seen:  # a row dropped because its request was preempted later
            if s not in preempted:                  # in the same step: the reservation is void
                self.fail(s, "a reservation without a sampled row")
            if s in self.reqs:
                self.reqs[s].reserved.pop(self.step, None)
        self.step, self.preempted, self.reservations = self.step + 1, [], {}

    def check_admission(self, kind: str, rows: list[Row]) -> None:
        """FCFS (`Scheduler._schedule_prefill`): a prefill step feeds the head of the waiting queue in its
        order, stopping at the first prompt that does not fit; a decode step feeds running requests only (one
        fed while waiting is reported, then taken as running)."""
        if kind == "decode":
            waiting = set(self.waiting)
            for s in [r.seq_id for r in rows if r.seq_id in waiting]:
                self.fail(s, f"a decode row for a request in the waiting queue {self._queue()}")
                self.waiting.remove(s)
            return
        for i, r in enumerate(rows):  # (a request in the batch twice is reported by on_schedule)
            place = self.waiting.index(r.seq_id) if r.seq_id in self.waiting else None
            if place is None or place > i:
                self.fail(r.seq_id, f"a prefill row for a request that is not waiting (the queue is {self._queue()})"
                          if place is None else f"a prefill row out of FCFS order: request {self.waiting[i]} is "
                                                f"ahead of it in the waiting queue {self._queue()}")
                return

    def _queue(self, shown: int = 8) -> str:
        return str(self.waiting[:shown])[:-1] + (", ...]" if len(self.waiting) > shown else "]")

    def check_row(self, kind: str, r: Row) -> None:
        """One finding per row at most; the rebuilt state then follows the row (its computed positions), and
        a prompt whose last chunk it is leaves the waiting queue for running."""
        req = self.live(r.seq_id)
        if req is None:
            return
        inflight = req.inflight(self.step)
        problem = self._row_problem(kind, req, r, inflight)
        if problem is not None:
            self.fail(r.seq_id, problem)
        req.cached = r.start + len(r.token_ids) if kind == "prefill" or problem is None else \
            len(req.tokens) + inflight
        if r.sample:
            req.ends[self.step] = r.start + len(r.token_ids)
        if kind == "prefill" and req.cached >= len(req.tokens) and r.seq_id in self.waiting:
            self.waiting.remove(r.seq_id)

    def _row_problem(self, kind: str, req: _Request, r: Row, inflight: int) -> str | None:
        """What is wrong with a row, the first thing found, or None (`Scheduler._reserve` makes rows)."""
        get_len, end = len(req.tokens) + inflight, r.start + len(r.token_ids)
        output_position = get_len - req.prompt_len  # the output tokens appended or in flight
        if not r.token_ids:
            return f"a {kind} row with no tokens"
        if r.epoch != req.epoch:
            return f"a {kind} row at epoch {r.epoch}, the request is at epoch {req.epoch}"
        if list(r.block_table) != req.blocks or r.state_slot != req.slot:
            return (f"a {kind} row uses blocks {_short(r.block_table)} and slot {r.state_slot}, the request "
                    f"owns blocks {_short(req.blocks)} and slot {req.slot}")
        check = self._decode_problem if kind == "decode" else self._prefill_problem
        problem = check(req, r, inflight)
        if problem is not None:
            return problem
        if r.sample != (end == get_len):
            return f"a {kind} row ending at {end} with sample={r.sample}, get_len() is {get_len}"
        if (r.seed, r.temperature) != (req.seed, req.temperature):
            return (f"a {kind} row with seed {r.seed} and temperature {r.temperature}, the request's are "
                    f"{req.seed} and {req.temperature}")
        if r.output_position != output_position:
            return (f"a {kind} row at output position {r.output_position}, the request has {output_position} "
                    f"output tokens ({len(req.tokens) - req.prompt_len} appended, {inflight} in flight)")
        if self.block_size is not None and len(r.block_table) != cdiv(end, self.block_size):
            return (f"a {kind} row ending at {end} with {len(r.block_table)} blocks, its positions need "
                    f"{cdiv(end, self.block_size)} of {self.block_size}")
        if r.sample and output_position >= req.max_tokens:
            return f"a {kind} row samples output token {output_position}, max_tokens is {req.max_tokens}"
        if r.sample and self.reservations.get(r.seq_id) != (req.epoch, output_position):
            return (f"a sampled row whose reservation {self.reservations.get(r.seq_id)} is not (epoch "
                    f"{req.epoch}, output position {output_position})")
        return None

    @staticmethod
    def _decode_problem(req: _Request, r: Row, inflight: int) -> str | None:
        """Decode is legal only when num_cached_tokens == get_len() - 1 (ARCHITECTURE.md §3)."""
        last = len(req.tokens) + inflight - 1
        if len(r.token_ids) != 1 or r.start != last:
            return (f"a decode row at position {r.start} with {len(r.token_ids)} tokens, legal only at "
                    f"get_len() - 1 = {last} ({len(req.tokens)} tokens, {inflight} in flight)")
        if req.cached != last:
            return f"a decode row at position {r.start} with {req.cached} positions computed"
        if r.token_ids[0] != (None if inflight else req.tokens[-1]):
            want = "None (a token is in flight)" if inflight else f"{req.tokens[-1]}, the last token"
            return f"a decode row whose input token is {r.token_ids[0]}, expected {want}"
        return None

    @staticmethod
    def _prefill_problem(req: _Request, r: Row, inflight: int) -> str | None:
        """A chunk continues where the last one stopped and feeds the request's own tokens, none in flight."""
        end = r.start + len(r.token_ids)
        if r.start != req.cached:
            return f"a prefill chunk starts at position {r.start}, {req.cached} are computed"
        if inflight or end > len(req.tokens) or list(r.token_ids) != req.tokens[r.start:end]:
            return f"a prefill chunk [{r.start}, {end}) does not feed the request's own tokens"
        return None

    # ---- processing: tokens and digests --------------------------------------------------------------
    def on_token(self, e) -> None:
        step, s, epoch, position, token_id, appended = e.step, e.seq_id, e.epoch, e.position, e.token_id, e.appended
        req = self.reqs.get(s)
        if req is None:
            self.fail(s, "a token for a request that was never added")
            return
        reserved, end = req.reserved.pop(step, None), req.ends.pop(step, None)
        if reserved is None:
            self.fail(s, f"a token for step {step} that no reservation asked for")
        elif reserved != epoch:
            self.fail(s, f"a token at epoch {epoch} answering a reservation at epoch {reserved}")
        elif end is not None and position != end:
            self.fail(s, f"a token at position {position}, its row of step {step} ends at {end}")
        if not appended:
            if req.finish is None and epoch == req.epoch:
                self.fail(s, f"a token of the current epoch {epoch} discarded")
        elif req.finish is not None:
            self.fail(s, f"a token appended after the request finished ({req.finish})")
        elif position != len(req.tokens):
            self.fail(s, f"a token appended at position {position}, the request has {len(req.tokens)} tokens")
        elif self.vocab_size is not None and not 0 <= token_id < self.vocab_size:
            self.fail(s, f"a token {token_id} appended, outside the vocabulary of {self.vocab_size}")
        else:  # what the engine holds now, stale or not
            if epoch != req.epoch:
                self.fail(s, f"a stale token appended: epoch {epoch}, the request is at epoch {req.epoch}")
            req.tokens.append(token_id)

    def on_step_digest(self, e) -> None:
        step, digest = e.step, e.digest
        for s, req in self.reqs.items():
            req.ends.pop(step, None)
            if req.reserved.pop(step, None) is not None:
                self.fail(s, f"step {step} processed without a token for this request's reservation")
        rebuilt = tables_digest((s, r.epoch, r.slot, r.blocks) for s, r in self.reqs.items() if r.finish is None)
        if digest != rebuilt:
            self.fail(None, f"step digest {digest} recorded, the tables rebuilt from the events give {rebuilt}")

    # ---- times: the host's clock, the CPU lane and the device lane -------------------------------------
    def _host_clock(self, t: int, what: str) -> None:
        """One host thread writes the log, reading its clock just before each event: the readings never
        decrease in log order."""
        if t < self.host_time:
            self.fail(_seq_field(self.event), f"{what}, before t={self.host_time} read earlier: time runs backwards")
        self.host_time = max(self.host_time, t)

    def _span(self, lane: str, start: int, end: int, after: int) -> None:
        """A span ends at or after it starts, and at or after the lane's previous span ends (`after`)."""
        if end < start:
            self.fail(None, f"a {lane} span ends at {end}, before it starts at {start}")
        elif start < after:
            self.fail(None, f"a {lane} span starts at {start}, before the lane's previous span ends at {after}")

    def on_cpu_span(self, e) -> None:
        """The engine thread runs one phase at a time and writes each span when it ends (llm_engine.step)."""
        phase, start, end = e.phase, e.start, e.end
        self._span(f"CPU {PHASES[phase]}", start, end, self.cpu_end)
        self._host_clock(end, f"a CPU {PHASES[phase]} span written ending at {end}")
        self.cpu_end = max(self.cpu_end, end)

    def on_device_span(self, e) -> None:
        """One device (the CPU worker thread or one CUDA stream) runs the steps in FIFO order, and their
        results are processed in that order."""
        step, start, end = e.step, e.start, e.end
        last_step, last_end = self.device_last
        if step <= last_step:
            self.fail(None, f"a device span of step {step} after one of step {last_step}: the device runs each step "
                            f"once, in step order")
        self._span("device", start, end, last_end)
        self.device_last = (max(step, last_step), max(end, last_end))

    # ---- the end ----------------------------------------------------------------------------------------
    def end(self, trace: TraceFile) -> None:
        self.event = None
        if trace.cut is not None:
            self.findings.add(Finding(None, None, trace.cut.offset, f"{trace.cut}; verified up to there, "
                                         "without the end-of-run checks", violation=False))
            return
        self._check_order("footer", None)
        self.drained()
        self._check_footer(trace.footer)

    def drained(self) -> None:
        """What a clean end requires, and an idle engine holds: every request finished, every reservation
        answered by a token, every KV block and state slot free (a violation for each that is not)."""
        for s, req in sorted(self.reqs.items()):
            if req.finish is None:
                self.fail(s, "the request never finished")
            if req.reserved:
                self.fail(s, f"reservations of steps {_short(sorted(req.reserved))} never answered by a token")
        held: dict[int, list] = {}   # owner -> [names shown, how many]
        for pool, what in ((self.block_owner, "block"), (self.slot_owner, "slot")):
            for i, s in pool.held():
                names = held.setdefault(s, [[], 0])
                names[1] += 1
                if len(names[0]) < SHOWN:
                    names[0].append(f"{what} {i}")
        for s, (names, count) in sorted(held.items()):
            more = f", ... ({count:,} in all)" if count > len(names) else ""
            self.fail(s, f"{', '.join(names)}{more} never freed")

    def _check_footer(self, footer) -> None:
        counts, num_steps, step_offsets = footer.counts, footer.num_steps, footer.step_offsets
        if counts != dict(self.counts) or num_steps != len(self.step_offsets) or step_offsets != self.step_offsets:
            diff = {k: (counts.get(k, 0), self.counts[k]) for k in set(counts) | set(self.counts)
                    if counts.get(k, 0) != self.counts[k]}
            self.fail(None, f"the footer does not index the events before it (counts in footer, in log: {diff}; "
                            f"{num_steps} steps in footer, {len(self.step_offsets)} in log)")
