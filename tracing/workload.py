"""Workloads and the record harness: seeded random requests (or a prompts file), run on an engine under the
Recorder with cancellations at drawn output-token counts and a stop flag. `mdi-trace record` and `generate`
and the benchmarks draw their prompts here. No DeepInfer file: its benchmarks draw their own.

Arrivals (issue #19): by default every request arrives at time 0 and is added before the first step. With
`arrivals="poisson:RATE"` the gaps between arrivals are exponential (RATE requests/s; the first at 0), drawn
from the same seeded generator after the prompts and the cancellations, so a seed draws the same requests
with or without arrivals. A prompts file may give each line its `arrival` (seconds since the start, what
`mdi-trace serve --prompts-out` writes). `run` adds each request once its arrival has passed, between two
steps, with `arrival_ns` = the run's start + its arrival, and sleeps while nothing runs and the next has not
arrived. What a re-record reproduces: the requests and their arrival offsets, always; which step each
request joins only under `virtual_clock_ms` (a clock that advances that much per step, not the wall clock):
then every batch, token and digest is the same, while the trace's arrival times are still real (when the
harness added the request), so its queue times are the engine's own.

    spec = WorkloadSpec(num_prompts=16, input_len=(64, 512), output_len=(16, 64), cancel_rate=0.1, seed=6)
    llm = recorded_llm("run.mdt", argv=[], model="micro", num_kv_blocks=16, seed=6)  # tracer=Recorder("run.mdt")
    outcome = record(llm, spec)   # draws, runs, shuts the engine down (the footer): Outcome(stopped, seconds)

It lives in tracing/, not engine/, because the harness records with tracing's Recorder (engine/ never
imports tracing/); the drawing beside it needs only engine/'s SamplingParams and the engine's public
`vocab_size` and `max_model_len`, and no engine code draws workloads, so it stays off the engine's reading path.
"""
from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from engine.sequence import SamplingParams

FIRST_TOKEN_ID = 3  # random prompts avoid ids 0-2, the tokenizer's specials (engine/tokenizer.py)


class WorkloadError(ValueError):
    """A prompts file that cannot be read, or a request that cannot run: one sentence."""


class Request(NamedTuple):
    prompt_token_ids: list[int]
    params: SamplingParams


class PromptLine(NamedTuple):
    """One line of a prompts file; None where the line does not say (the options' values apply)."""
    prompt: str | list[int]
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: tuple[int, ...] | None = None
    arrival: float | None = None          # seconds since the run's start


def parse_arrivals(text: str) -> float:
    """The rate of `poisson:RATE` (requests per second, > 0); WorkloadError in one sentence otherwise."""
    kind, _, rate = text.partition(":")
    try:
        value = float(rate)
    except ValueError:
        value = -1.0
    if kind != "poisson" or not 0 < value < float("inf"):
        raise WorkloadError(f"--arrivals {text!r} is not poisson:RATE with RATE requests per second above 0 "
                            f"(e.g. poisson:20).")
    return value


@dataclass(slots=True)
class WorkloadSpec:
    """What to draw: the options of `mdi-trace record`, with its defaults. `prompts` (from `read_prompts`)
    replaces the random prompts; a line without max_tokens draws it from `output_len`."""
    num_prompts: int = 16
    input_len: tuple[int, int] = (64, 512)    # prompt lengths, uniform in [MIN, MAX]
    output_len: tuple[int, int] = (16, 64)    # max_tokens, uniform in [MIN, MAX]
    temperature: float = 0.0
    cancel_rate: float = 0.1                  # each request cancelled with this probability
    seed: int = 0                             # of the prompts, the cancellations and the arrivals
    prompts: list[PromptLine] | None = None
    arrivals: str | None = None               # "poisson:RATE"; None: every request at time 0 (or the file's)
    virtual_clock_ms: float | None = None     # a clock of this many ms per step instead of the wall clock

    @property
    def size(self) -> int:
        return len(self.prompts) if self.prompts is not None else self.num_prompts


@dataclass(slots=True)
class Workload:
    requests: list[Request]
    cancel_at: dict[int, int]  # request index -> cancel once it has this many output tokens (0: once scheduled)
    arrivals: list[float] | None = None   # per request, seconds since the run's start, ascending; None: all at 0
    virtual_clock_ms: float | None = None  # see WorkloadSpec


@dataclass(slots=True)
class Outcome:
    stopped: bool   # the stop flag ended the run: the unfinished requests were cancelled
    seconds: float  # from the first request added to the last step


class Progress:
    """What the harness reports as it goes; the CLI's progress bar overrides these, the default is silent."""

    def drawn(self, n: int) -> None: ...                     # n more requests drawn and checked
    def running(self, total: int) -> None: ...               # drawing done; `total` requests are being added
    def stepped(self, finished: int, step: int) -> None: ...  # a step ended; `finished` requests finished in it


PROMPT_LINE = ('{"prompt": text or token ids, and optionally "max_tokens": N >= 1, "temperature": T >= 0, '
               '"seed": N >= 0 or null, "ignore_eos": true or false, "stop_token_ids": [ids], "arrival": seconds >= 0}')


def read_prompts(path: str | Path) -> list[PromptLine]:
    """The lines of a jsonl prompts file, in arrival order: a file whose lines give an `arrival` may list them in
    any order (serve writes a line as it accepts the request, so two that arrive together can be written out of
    order) and is sorted by it, stably; either every line gives one or none does. A bad line is one sentence
    with its number."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}.") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        parsed = _prompt_line(obj) if isinstance(obj, dict) else None
        if parsed is None:
            raise WorkloadError(f"{path} line {n} is not {PROMPT_LINE}.")
        if prompts and (parsed.arrival is None) != (prompts[-1][1].arrival is None):
            raise WorkloadError(f"{path} line {n} {'lacks' if parsed.arrival is None else 'gives'} an arrival and "
                                f"line {prompts[-1][0]} {'gives' if parsed.arrival is None else 'lacks'} one; give "
                                f"every line an arrival, or none.")
        prompts.append((n, parsed))
    if not prompts:
        raise WorkloadError(f"{path} has no prompts.")
    return sorted((p for _, p in prompts), key=lambda p: p.arrival or 0.0)


def _prompt_line(obj: dict) -> PromptLine | None:
    """A line's fields, checked; None if one is missing or of the wrong type or range."""
    is_int = lambda v: type(v) is int  # noqa: E731  (not a bool)
    is_num = lambda v: type(v) in (int, float) and v == v and abs(v) != float("inf")  # noqa: E731
    ids = lambda v: isinstance(v, list) and all(is_int(t) and t >= 0 for t in v)  # noqa: E731
    prompt = obj.get("prompt")
    checks = {"max_tokens": lambda v: is_int(v) and v >= 1, "temperature": lambda v: is_num(v) and v >= 0,
              "seed": lambda v: is_int(v) and 0 <= v < 1 << 63, "ignore_eos": lambda v: type(v) is bool,
              "stop_token_ids": ids, "arrival": lambda v: is_num(v) and v >= 0}
    if not ((isinstance(prompt, str) and prompt) or (ids(prompt) and prompt)):
        return None
    if any(obj.get(k) is not None and not ok(obj[k]) for k, ok in checks.items()):
        return None
    stop = obj.get("stop_token_ids")
    return PromptLine(prompt, obj.get("max_tokens"), obj.get("temperature"), obj.get("seed"), obj.get("ignore_eos"),
                      None if stop is None else tuple(stop), obj.get("arrival"))


def random_requests(rng: random.Random, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, temperature: float, max_model_len: int | None = None) -> Iterator[Request]:
    """Random prompts, drawn one at a time: per request its length, its ids, then its max_tokens (this order is
    what a seed reproduces). A length of max_model_len or more is refused before its ids are drawn."""
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        if max_model_len is not None and n >= max_model_len:
            raise WorkloadError(f"--input-len {input_len[0]}:{input_len[1]} drew a prompt of {n:,} tokens; "
                                f"max_model_len is {max_model_len:,} (--max-model-len).")
        ids = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]
        yield Request(ids, SamplingParams(temperature=temperature, max_tokens=rng.randint(*output_len),
                                          ignore_eos=True))


def draw(spec: WorkloadSpec, llm, progress: Progress | None = None) -> Workload:
    """The seeded workload for `llm` (an engine.LLM): its requests, each checked as it is drawn (WorkloadError
    at the first that cannot run), then the cancellations, from the same seeded generator."""
    engine, progress, rng = llm.engine, progress or Progress(), random.Random(spec.seed)
    if spec.prompts is not None:
        drawn = (Request(llm.tokenizer.encode(p.prompt) if isinstance(p.prompt, str) else p.prompt,
                         _line_params(p, spec, rng)) for p in spec.prompts)
    else:
        drawn = random_requests(rng, spec.num_prompts, spec.input_len, spec.output_len, engine.vocab_size,
                                spec.temperature, engine.max_model_len)
    requests = []
    for request in drawn:
        try:
            engine.check_request(*request)
        except ValueError as e:
            raise WorkloadError(str(e)) from None
        requests.append(request)
        progress.drawn(1)
    cancel_at = {i: rng.randrange(r.params.max_tokens) for i, r in enumerate(requests)
                 if rng.random() < spec.cancel_rate}
    return Workload(requests, cancel_at, _arrivals(spec, rng, len(requests)), spec.virtual_clock_ms)


def _line_params(p: PromptLine, spec: WorkloadSpec, rng: random.Random) -> SamplingParams:
    """A prompts file line's sampling parameters: its own, else the options' (max_tokens drawn)."""
    return SamplingParams(temperature=spec.temperature if p.temperature is None else p.temperature, seed=p.seed,
                          max_tokens=p.max_tokens or rng.randint(*spec.output_len),
                          ignore_eos=bool(p.ignore_eos), stop_token_ids=p.stop_token_ids or ())


def _arrivals(spec: WorkloadSpec, rng: random.Random, n: int) -> list[float] | None:
    """Arrival offsets in seconds: the prompts file's, or Poisson's (the first at 0, then exponential gaps drawn
    last, so that a seed draws the same prompts and cancellations with or without them), or None (all at 0)."""
    given = spec.prompts is not None and spec.prompts and spec.prompts[0].arrival is not None
    if spec.arrivals is not None and given:
        raise WorkloadError("the prompts file gives every request its arrival; drop --arrivals, or the file's "
                            "arrivals.")
    if given:
        return [float(p.arrival) for p in spec.prompts]
    if spec.arrivals is None:
        return None
    rate, out = parse_arrivals(spec.arrivals), [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.expovariate(rate))
    return out[:n]


def run(engine, workload: Workload, stop: Callable[[], bool] = lambda: False,
        progress: Progress | None = None) -> Outcome:
    """Adds this rank's requests (all of them in one process) and steps the engine to the end, cancelling
    request i once it has cancel_at[i] output tokens. With arrivals, request i is added at the first step's
    start after its arrival (`arrival_ns` = the run's start + it), and the run sleeps while no rank has work and
    some request has not arrived. `stop()` true ends the run at the end of the step under way and cancels the
    unfinished requests (those not arrived are never added), so the trace stays consistent. Under EP x DP the
    ranks agree on stopping, stepping and waiting every time round (collectives, in the same order on every
    rank), so they stop together and none waits for a collective another never makes."""
    from model.parallel import any_rank

    progress = progress or Progress()
    progress.running(len(workload.requests))
    mine = list(engine.shard.requests(len(workload.requests)))
    clock = _Clock(workload.virtual_clock_ms)
    arrivals = workload.arrivals or [0.0] * len(workload.requests)
    pending = deque((round(arrivals[i] * 1e9), i) for i in mine)   # (arrival ns since the start, index)
    ids, cancel_at = {}, {}   # cancel_at by seq_id, this rank's only

    def add_arrived() -> None:
        now = clock.now_ns()
        while pending and pending[0][0] <= now:
            at, i = pending.popleft()
            ids[i] = engine.add_request(*workload.requests[i], arrival_ns=clock.arrival_ns(at))
            if i in workload.cancel_at:
                cancel_at[ids[i]] = workload.cancel_at[i]

    steps = 0
    add_arrived()
    if stop():  # between the requests and the run
        cancel_all(engine)
        return Outcome(True, clock.seconds())
    while True:
        if any_rank(stop(), engine.shard):
            cancel_all(engine)
            return Outcome(True, clock.seconds())
        add_arrived()
        if not engine.has_unfinished():
            if not any_rank(bool(pending), engine.shard):
                break
            clock.wait_until(pending[0][0] if pending else None)   # nothing runs: until the next arrival
            continue
        finished = engine.step()
        clock.stepped()
        steps += 1
        progress.stepped(len(finished), steps)
        for seq_id, k in list(cancel_at.items()):
            seq = engine.scheduler.seqs.get(seq_id)
            if seq is None or (seq.num_cached_tokens and seq.num_output_tokens >= k):
                del cancel_at[seq_id]
                if seq is not None:
                    engine.abort(seq_id)
    return Outcome(False, clock.seconds())


class _Clock:
    """The run's clock for arrivals: the wall clock (perf_counter_ns) from the run's start, or a virtual one that
    advances `ms_per_step` per engine step and jumps to the next arrival when nothing runs."""

    IDLE_NS = 5_000_000   # under EP x DP, a rank with no arrival left waits this long between two agreements

    def __init__(self, ms_per_step: float | None):
        self.start = time.perf_counter_ns()
        self.virtual = None if ms_per_step is None else 0
        self.per_step = None if ms_per_step is None else round(ms_per_step * 1e6)

    def now_ns(self) -> int:
        return time.perf_counter_ns() - self.start if self.virtual is None else self.virtual

    def arrival_ns(self, at: int) -> int:
        """The perf_counter_ns a request arriving at `at` ns since the start is added with: then, on the wall
        clock; now, on the virtual one (its offset is in virtual time, which the trace's real times cannot hold)."""
        return self.start + at if self.virtual is None else time.perf_counter_ns()

    def stepped(self) -> None:
        if self.virtual is not None:
            self.virtual += self.per_step

    def wait_until(self, at: int | None) -> None:
        if self.virtual is not None:
            self.virtual = max(self.virtual, at if at is not None else self.virtual)
            return
        left = (at - self.now_ns()) if at is not None else self.IDLE_NS
        if left > 0:
            time.sleep(left / 1e9)

    def seconds(self) -> float:
        return (time.perf_counter_ns() - self.start) / 1e9


def cancel_all(engine) -> None:
    """Cancel every unfinished request (cause "shutdown": the run was stopped), then one step applies the
    cancellations and processes the step in flight."""
    for seq_id in list(engine.scheduler.seqs):
        engine.abort(seq_id, "shutdown")
    engine.step()


def recorded_llm(path: str | Path, argv: list[str], exclusive: bool = True, **options):
    """An engine.LLM(**options) whose tracer is a Recorder writing `path` (`exclusive`: never replacing a file).
    One that cannot start leaves no file; its ValueError is a WorkloadError."""
    from engine import LLM
    from tracing.recorder import Recorder

    recorder = Recorder(path, argv=argv, exclusive=exclusive)  # creates no file yet
    try:
        return LLM(tracer=recorder, **options)
    except BaseException as e:
        recorder.discard()
        if isinstance(e, ValueError):
            raise WorkloadError(str(e)) from None
        raise


def record(llm, spec: WorkloadSpec, stop: Callable[[], bool] = lambda: False,
           progress: Progress | None = None) -> Outcome:
    """Draw `spec` and run it on `llm` (from `recorded_llm`), then shut the engine down, which writes the
    footer. Every rank draws every request and adds its own. A request that cannot run (WorkloadError)
    discards the trace: nothing is kept. An exception while drawing (a signal) leaves a trace of no step."""
    try:
        return run(llm.engine, draw(spec, llm, progress), stop, progress)
    except ValueError:
        llm.engine.tracer.discard()
        raise
    finally:
        llm.engine.shutdown()  # writes the footer (nothing, once discarded)
