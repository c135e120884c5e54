"""Workloads and the record harness: seeded random requests (or a prompts file), run on an engine under the
Recorder with cancellations at drawn output-token counts and a stop flag. `mdi-trace record` and `generate`
and the benchmarks draw their prompts here. No DeepInfer file: its benchmarks draw their own.

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


@dataclass(slots=True)
class WorkloadSpec:
    """What to draw: the options of `mdi-trace record`, with its defaults. `prompts` (from `read_prompts`)
    replaces the random prompts; a line without max_tokens draws it from `output_len`."""
    num_prompts: int = 16
    input_len: tuple[int, int] = (64, 512)    # prompt lengths, uniform in [MIN, MAX]
    output_len: tuple[int, int] = (16, 64)    # max_tokens, uniform in [MIN, MAX]
    temperature: float = 0.0
    cancel_rate: float = 0.1                  # each request cancelled with this probability
    seed: int = 0                             # of the prompts and the cancellations
    prompts: list[tuple[str | list[int], int | None]] | None = None

    @property
    def size(self) -> int:
        return len(self.prompts) if self.prompts is not None else self.num_prompts


@dataclass(slots=True)
class Workload:
    requests: list[Request]
    cancel_at: dict[int, int]  # request index -> cancel once it has this many output tokens (0: once scheduled)


@dataclass(slots=True)
class Outcome:
    stopped: bool   # the stop flag ended the run: the unfinished requests were cancelled
    seconds: float  # from the first request added to the last step


class Progress:
    """What the harness reports as it goes; the CLI's progress bar overrides these, the default is silent."""

    def drawn(self, n: int) -> None: ...                     # n more requests drawn and checked
    def running(self, total: int) -> None: ...               # drawing done; `total` requests are being added
    def stepped(self, finished: int, step: int) -> None: ...  # a step ended; `finished` requests finished in it


def read_prompts(path: str | Path) -> list[tuple[str | list[int], int | None]]:
    """(prompt, max_tokens or None) per line of a jsonl file; a bad line is one sentence with its number."""
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
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        max_tokens = obj.get("max_tokens") if isinstance(obj, dict) else None
        ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
        if not ((isinstance(prompt, str) and prompt) or ids_ok) or not (
                max_tokens is None or (isinstance(max_tokens, int) and max_tokens >= 1)):
            raise WorkloadError(f'{path} line {n} is not {{"prompt": text or token ids, "max_tokens": N '
                                f'(optional)}}.')
        prompts.append((prompt, max_tokens))
    if not prompts:
        raise WorkloadError(f"{path} has no prompts.")
    return prompts


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
        drawn = (Request(llm.tokenizer.encode(p) if isinstance(p, str) else p,
                         SamplingParams(temperature=spec.temperature, max_tokens=m or rng.randint(*spec.output_len)))
                 for p, m in spec.prompts)
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
    return Workload(requests, cancel_at)


def run(engine, workload: Workload, stop: Callable[[], bool] = lambda: False,
        progress: Progress | None = None) -> Outcome:
    """Adds this rank's requests (all of them in one process) and steps the engine to the end, cancelling
    request i once it has cancel_at[i] output tokens. `stop()` true ends the run at the end of the step under
    way and cancels the unfinished requests, so the trace stays consistent. Under EP x DP the ranks agree on
    both every step, so they stop together."""
    from model.parallel import any_rank

    progress = progress or Progress()
    progress.running(len(workload.requests))
    ids = {i: engine.add_request(*workload.requests[i]) for i in engine.shard.requests(len(workload.requests))}
    cancel_at = {ids[i]: k for i, k in workload.cancel_at.items() if i in ids}  # by seq_id, this rank's only
    start, steps = time.perf_counter(), 0
    if stop():  # between the requests and the run
        cancel_all(engine)
        return Outcome(True, time.perf_counter() - start)
    while engine.has_unfinished():
        if any_rank(stop(), engine.shard):
            cancel_all(engine)
            return Outcome(True, time.perf_counter() - start)
        finished = engine.step()
        steps += 1
        progress.stepped(len(finished), steps)
        for seq_id, k in list(cancel_at.items()):
            seq = engine.scheduler.seqs.get(seq_id)
            if seq is None or (seq.num_cached_tokens and seq.num_output_tokens >= k):
                del cancel_at[seq_id]
                if seq is not None:
                    engine.abort(seq_id)
    return Outcome(False, time.perf_counter() - start)


def cancel_all(engine) -> None:
    """Cancel every unfinished request, then one step applies the cancellations and processes the step in
    flight."""
    for seq_id in list(engine.scheduler.seqs):
        engine.abort(seq_id)
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
