"""The `mdi-trace` command line (ARCHITECTURE.md §1: tui/ is the face of the project).

Exit codes: 0 success, 1 a finding, 2 bad usage or unreadable input. Every error a user can meet is
one sentence on stderr, never a traceback. Subcommands: `checkpoint init|quantize`, `generate` (random
prompts through the engine, a smoke run), `record` (a run under the Recorder, `--nproc N` for EP x DP), `serve`
(an OpenAI-compatible server, tui/serve.py),
and of a trace: `info`, `export`, `verify`, `view` (tui/app.py), `check` and `diff` (tui/check.py).
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path

from engine.kv_budget import DEFAULT_GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN
from tui.format import plural

MAX_PROMPTS = 100_000  # record draws every request before the run starts


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already or has none worth saying
    (None, an off switch); a MIN:MAX range reads as it is typed."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if "(default" in text or default is None or default is False or default is argparse.SUPPRESS \
                or not action.option_strings:
            return text
        if default is True:
            default = "on"
        elif isinstance(default, tuple):
            default = ":".join(map(str, default))
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse's usage block and message, as one sentence
        self.exit(2, f"mdi-trace: {message}; see `{self.prog} --help`.\n")


def _temperature(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        t = -1.0
    if not 0.0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a temperature of 0 or more (0 is greedy), not {text!r}")
    return t


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, two whole numbers, not {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, not {text!r}")
    return lo, hi


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability between 0 and 1, not {text!r}")
    return p


def _whole(text: str, low: int, high: int, expected: str) -> int:
    """`text` as a whole number in [low, high), else the one sentence argparse prints: "expected EXPECTED"."""
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if not low <= n < high:
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
    return n


def _step(text: str) -> int:
    return _whole(text, 0, 1 << 63, "a step number (0 or more)")


def _check(a) -> int:
    from tui.check import check

    if not a.scheduler:
        _check_model(a.model)
        _check_device(a.device)
    return _each_rank(a, check)


def _each_rank(a, command) -> int:
    """`command(a)` on each rank's log when a.trace names a run of several ranks (tracing/ranks.py: OUT for
    every rank, NAME.rankR.mdt for rank R alone), each under a "rank R" line; the worst exit code. A
    single-process log: `command(a)` as it is."""
    from tracing.ranks import open_run

    with open_run(a.trace) as run:
        paths, ranks = [t.path for t in run.traces], run.selected
    if len(paths) == 1:
        return command(a)
    codes = []
    for rank in ranks:
        print(f"rank {rank} of {len(paths)}: {paths[rank]}", flush=True)
        codes.append(command(argparse.Namespace(**{**vars(a), "trace": str(paths[rank])})))
    return max(codes)


def _diff(a) -> int:
    from tui.check import diff
    return diff(a)


def _positive(text: str) -> int:
    return _whole(text, 1, 1 << 63, "a whole number of at least 1")


def _num_prompts(text: str) -> int:
    n = _positive(text)
    if n > MAX_PROMPTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_PROMPTS:,} prompts (every one is drawn before "
                                         f"the run starts), not {text}")
    return n


def _arrivals(text: str) -> str:
    from tracing.workload import WorkloadError, parse_arrivals
    try:
        parse_arrivals(text)
    except WorkloadError as e:
        raise argparse.ArgumentTypeError(f"expected poisson:RATE, RATE requests per second above 0 (e.g. "
                                         f"poisson:20), not {text!r}") from e
    return text


def _milliseconds(text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = 0.0
    if not 0 < ms < float("inf"):
        raise argparse.ArgumentTypeError(f"expected milliseconds above 0, not {text!r}")
    return ms


def _seed(text: str) -> int:
    return _whole(text, 0, 1 << 63, "a seed between 0 and 2**63 - 1")


def _model_option(parser, default: str | None = "tiny-68m", help: str | None = None) -> None:
    from model.config import PRESETS
    parser.add_argument("--model", default=default, metavar="MODEL",
                        help=help or f"a preset ({', '.join(PRESETS)}) or a checkpoint folder")


def _device_option(parser, help: str = "where the model runs") -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help=help)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _max_model_len(text: str) -> int:
    return _whole(text, 1, MAX_MODEL_LEN + 1, f"a number of positions between 1 and {MAX_MODEL_LEN:,}")


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction above 0 and at most 1, not {text!r}")
    return f


def _bytes(text: str) -> int:
    """BYTES: a number and an optional unit, binary (K, KiB, M, MiB, G, GiB, T, TiB) or decimal (KB, MB, GB, TB)."""
    number = text.strip().rstrip("KMGTBikmgtb")
    unit = text.strip()[len(number):].lower()
    try:
        n = int(float(number) * _UNITS[unit]) if number and unit in _UNITS else 0
    except (ValueError, OverflowError):
        n = 0
    if not 1 <= n < 1 << 63:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 4GiB, 512MiB or 1000000000, not {text!r}")
    return n


def add_engine_options(parser, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                       num_kv_blocks: int | None = None) -> None:
    """The engine's options (engine.LLM's keywords) on `parser`, for record, generate and serve; `engine_kwargs`
    turns the parsed options into LLM keywords. The defaults are LLM's but where given: `num_kv_blocks` a fixed
    pool (record's small one), else the pool is sized from the memory budget (engine/kv_budget.py)."""
    parser.set_defaults(fixed_num_kv_blocks=num_kv_blocks)
    parser.add_argument("--max-model-len", type=_max_model_len, default=None, metavar="N",
                        help="the longest request, prompt plus max_tokens; it sizes the RoPE tables and the KV "
                             "pool's default and may exceed the checkpoint's (default: the checkpoint's "
                             "max_seq_len)")
    parser.add_argument("--zos", action=argparse.BooleanOptionalAction, default=True,
                        help="zero-overhead scheduling: schedule step N while the device runs N-1")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="logits bitwise independent of batching and chunking (model/invariant.py)")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=max_num_batched_tokens, metavar="N",
                        help="tokens a step may schedule, over all its rows")
    parser.add_argument("--max-num-seqs", type=_positive, default=max_num_seqs, metavar="N",
                        help="requests running at once")
    budget = ("from the memory budget, at most --max-num-seqs requests of --max-model-len")
    parser.add_argument("--num-kv-blocks", type=_positive, default=None, metavar="N",
                        help="KV pool in 128-token blocks (default: " + (
                            f"{num_kv_blocks}, small enough that some preemption happens; {budget} when "
                            f"--kv-cache-memory or --gpu-memory-utilization is given)" if num_kv_blocks
                            else f"{budget})"))
    parser.add_argument("--num-state-slots", type=_positive, default=None, metavar="N",
                        help="state slots (windows, compressor tails, Engram history), one per running request "
                             "(default: --max-num-seqs)")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                        help=f"on cuda, the share of the GPU memory free once the weights are loaded that the KV "
                             f"pool and state slots may take (default: {DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--kv-cache-memory", type=_bytes, default=None, metavar="BYTES",
                        help="a fixed budget for the KV pool and state slots, e.g. 4GiB; without it the budget "
                             "is min(4 GiB, half the available RAM) on cpu, --gpu-memory-utilization on cuda")


def engine_kwargs(a) -> dict:
    """engine.LLM's keywords from options added by `add_engine_options` (the model, device, seed and tracer
    are the command's); a combination in which one option would have no effect is one sentence (exit 2)."""
    device = getattr(a, "device", "cpu")
    if a.gpu_memory_utilization is not None and device != "cuda":
        raise SystemExit("mdi-trace: --gpu-memory-utilization sizes the KV pool on cuda; on cpu give "
                         "--kv-cache-memory BYTES.")
    budget = [f for f, on in (("--kv-cache-memory", a.kv_cache_memory is not None),
                              ("--gpu-memory-utilization", a.gpu_memory_utilization is not None)) if on]
    if a.num_kv_blocks is not None and budget:
        raise SystemExit(f"mdi-trace: --num-kv-blocks fixes the KV pool, so {budget[0]} has no effect; drop one "
                         f"of the two.")
    if len(budget) == 2:
        raise SystemExit("mdi-trace: --kv-cache-memory fixes the KV budget, so --gpu-memory-utilization has no "
                         "effect; drop one of the two.")
    blocks = a.num_kv_blocks if a.num_kv_blocks is not None or budget else getattr(a, "fixed_num_kv_blocks", None)
    kw = dict(max_model_len=a.max_model_len, enable_zos=a.zos, batch_invariant=a.batch_invariant,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, num_kv_blocks=blocks,
              num_state_slots=a.num_state_slots, kv_cache_memory=a.kv_cache_memory)
    if a.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    return kw


def _record_parser(sub) -> None:
    rec = sub.add_parser("record", help="run the engine on random prompts (or a jsonl file) and record a trace")
    rec.add_argument("-o", "--output", metavar="TRACE", help="trace file (default: traces/run-YYYYmmdd-HHMMSS.mdt)")
    rec.add_argument("--force", action="store_true", help="replace an existing trace file (otherwise refused)")
    _model_option(rec)
    _device_option(rec)
    rec.add_argument("--num-prompts", type=_num_prompts, default=16, metavar="N",
                     help=f"random requests to run, at most {MAX_PROMPTS:,}")
    rec.add_argument("--input-len", type=_range, default=(64, 512), metavar="MIN:MAX",
                     help="prompt lengths, uniform in [MIN, MAX]")
    rec.add_argument("--output-len", type=_range, default=(16, 64), metavar="MIN:MAX",
                     help="max_tokens, uniform in [MIN, MAX]")
    rec.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one {"prompt": text or token ids, "max_tokens": N} per line instead of random prompts; '
                          'optional per line: "temperature", "seed", "ignore_eos", "stop_token_ids", "arrival" '
                          '(seconds), as `serve --prompts-out` writes them')
    rec.add_argument("--arrivals", type=_arrivals, metavar="poisson:RATE",
                     help="requests arrive as a Poisson process of RATE per second (seeded; the first at 0), each "
                          "added once it has arrived (without it every request arrives at 0)")
    rec.add_argument("--virtual-clock", type=_milliseconds, metavar="MS",
                     help="arrivals read a clock that advances MS per step, not the wall clock: each request "
                          "joins the same step on every re-record")
    rec.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                     help="sampling temperature (0: greedy)")
    rec.add_argument("--seed", type=_seed, default=0, metavar="N",
                     help="seed of the prompts, the cancellations and the sampler")
    add_engine_options(rec, max_num_batched_tokens=512, max_num_seqs=8, num_kv_blocks=24)
    rec.add_argument("--cancel-rate", type=_probability, default=0.1, metavar="P",
                     help="cancel each request with probability P, after a random number of its output tokens")
    rec.add_argument("--nproc", type=_positive, default=1, metavar="N",
                     help="ranks of an EP x DP run (gloo on CPU, NCCL with one GPU each): requests round-robin, "
                          "one trace per rank beside the output, NAME.rankR.mdt")


TRACE_HELP = "a log, one rank's log, or the OUT of `record --nproc N` (every rank)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from tracing.schema import READ_VERSIONS_TEXT, SCHEMA_VERSION
    try:
        v = version("mini-deepinfer")
    except PackageNotFoundError:  # run from a checkout that was never installed
        v = "unknown"
    return (f"mdi-trace {v} (mini-DeepInfer; writes trace schema version {SCHEMA_VERSION}, reads versions "
            f"{READ_VERSIONS_TEXT})")


def _parser() -> argparse.ArgumentParser:
    from model.config import PRESETS

    p = _Parser(prog="mdi-trace", description="mini-DeepInfer's debugger: record the engine's decisions into a "
                "trace, then view, verify, check and compare traces. `mdi-trace COMMAND --help` for a command.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ck = sub.add_parser("checkpoint", help="create a random-weight checkpoint, or one in the released format")
    ck = ck.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = ck.add_parser("init", help="write a random-weight checkpoint from a preset and a seed")
    init.add_argument("--preset", default="tiny-68m", choices=list(PRESETS), help="the model's shape")
    init.add_argument("--seed", type=_seed, default=0, metavar="N", help="seed of the random weights")
    init.add_argument("-o", "--output", required=True, metavar="FOLDER", help="output folder")
    init.add_argument("--force", action="store_true", help="replace a checkpoint already in the folder")
    quant = ck.add_parser("quantize", help="write a checkpoint in the released format (FP8 dense, FP4 experts, "
                                           "sharded with model.safetensors.index.json)")
    quant.add_argument("--from", dest="source", required=True, metavar="FOLDER",
                       help="a checkpoint folder made by `checkpoint init`")
    quant.add_argument("-o", "--output", required=True, metavar="FOLDER", help="output folder")
    quant.add_argument("--force", action="store_true", help="replace a checkpoint already in the folder")
    gen = sub.add_parser("generate", help="run random prompts through the engine (a smoke run, no trace)")
    _model_option(gen)
    _device_option(gen)
    gen.add_argument("--num-prompts", type=_num_prompts, default=4, metavar="N", help="random requests to run")
    gen.add_argument("--prompt-len", type=_positive, default=200, metavar="N", help="tokens per prompt")
    gen.add_argument("--max-tokens", type=_positive, default=16, metavar="N", help="output tokens per request")
    gen.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--seed", type=_seed, default=0, metavar="N", help="seed of the random prompts")
    add_engine_options(gen)
    _record_parser(sub)
    __import__("tui.serve").serve.add_parser(sub)
    info = sub.add_parser("info", help="a trace's header and summary, and whether it was cut short")
    info.add_argument("trace", help=TRACE_HELP)
    view = sub.add_parser("view", help="the trace viewer: timeline, steps, requests, resources, events (a TUI)")
    view.add_argument("trace", help=TRACE_HELP)
    view.add_argument("--follow", action="store_true", help="tail a log that is still being written")
    view.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                      help="run `mdi-trace verify` in the background and show its findings "
                           "(default: logs under 32 MiB)")
    exp = sub.add_parser("export", help="convert a trace to Chrome trace JSON for Perfetto (a process per rank)")
    exp.add_argument("trace", help=TRACE_HELP)
    exp.add_argument("--format", default="perfetto", choices=["perfetto"], help="the output format")
    exp.add_argument("-o", "--output", metavar="FILE",
                     help="output file (default: NAME.perfetto.json in the current folder, NAME the trace's)")
    exp.add_argument("--force", action="store_true", help="replace an existing output file")
    ver = sub.add_parser("verify", help="check a trace against the engine's invariants (exit 1 on a finding)")
    ver.add_argument("trace", help=TRACE_HELP)
    chk = sub.add_parser("check", help="replay a trace and compare it with the recording (exit 1 on a mismatch)")
    chk.add_argument("trace", help=TRACE_HELP)
    chk.add_argument("--scheduler", action="store_true",
                     help="replay the scheduler alone, with no model: the recorded arrivals, cancellations and "
                          "sampled tokens in, every batch and resource digest compared")
    chk.add_argument("--against", choices=["reference"],
                     help="compare every row's logits and token with the plain reference model and localise the "
                          "first divergence to a step, layer and module")
    when = chk.add_mutually_exclusive_group()
    when.add_argument("--until", type=_step, metavar="N",
                      help="re-execute the steps up to and including step N (default: every step)")
    when.add_argument("--step", type=_step, metavar="N",
                      help="check step N alone, after re-executing the steps it depends on")
    _device_option(chk, "where the model re-executes")
    _model_option(chk, None, "the recorded checkpoint: a preset or a checkpoint folder (default: the trace's "
                             "model_source)")
    dif = sub.add_parser("diff", help="the first step where two traces' decisions or tokens differ (exit 1 if any)")
    dif.add_argument("a", metavar="A", help="a log (one rank's)")
    dif.add_argument("b", metavar="B", help="another log")
    dif.add_argument("--tokens", action="store_true",
                     help="compare the sampled tokens only (runs that decide differently, e.g. ZOS on vs off)")
    return p


def _checkpoint(a) -> int:
    out = Path(a.output)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"mdi-trace: {out} is a file; give -o a folder.")
    held = sorted(p.name for p in out.glob("*") if p.suffix in (".json", ".safetensors")) if out.is_dir() else []
    if held and not a.force:
        raise SystemExit(f"mdi-trace: {out} already holds a checkpoint ({', '.join(held[:3])}); give another -o, or "
                         f"--force to replace it.")
    return {"init": _checkpoint_init, "quantize": _checkpoint_quantize}[a.action](a)


def _checkpoint_quantize(a) -> int:
    from model.released import quantize_checkpoint

    if Path(a.source).resolve() == Path(a.output).resolve():
        raise SystemExit("mdi-trace: --from and -o name the same folder; write the released format elsewhere.")
    digest = quantize_checkpoint(a.source, a.output)
    print(f"wrote {a.output}: {a.source} in the released format (FP8 e4m3 32x32 tiles, FP4 e2m1 experts), "
          f"digest {digest}")
    return 0


def _checkpoint_init(a) -> int:
    from model.checkpoint import init_checkpoint

    digest = init_checkpoint(a.preset, a.seed, a.output)
    print(f"wrote {a.output}: preset {a.preset}, seed {a.seed}, weights digest {digest}")
    return 0


def _check_model(model: str | None) -> None:
    """--model names a preset or a folder; anything else is one sentence listing the presets."""
    from model.config import PRESETS

    if model is None or model in PRESETS or Path(model).is_dir():
        return
    what = "a file, not a checkpoint folder" if Path(model).exists() else "neither a preset nor a folder"
    raise SystemExit(f"mdi-trace: --model {model} is {what}; give a preset ({', '.join(PRESETS)}) or a "
                     f"checkpoint folder (`mdi-trace checkpoint init -o FOLDER` makes one).")


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("mdi-trace: --device cuda needs a CUDA GPU and none is visible; use --device cpu.")


def _generate(a) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine import LLM
    from tracing.workload import random_requests

    _check_model(a.model)
    _check_device(a.device)
    try:
        llm = LLM(a.model, device=a.device, **engine_kwargs(a))
    except ValueError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    requests = list(random_requests(random.Random(a.seed), a.num_prompts, (a.prompt_len, a.prompt_len),
                                    (a.max_tokens, a.max_tokens), llm.engine.vocab_size, a.temperature))
    start = time.perf_counter()
    try:
        outs = llm.generate([r.prompt_token_ids for r in requests], [r.params for r in requests])
    except ValueError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    table = Table(title=f"{a.model} on {a.device}, weights {llm.digest[:12]}")
    for col in ("request", "prompt tokens", "output tokens", "finish"):
        table.add_column(col)
    for o in outs:
        table.add_row(str(o.seq_id), str(len(o.prompt_token_ids)), " ".join(map(str, o.token_ids)), o.finish_reason)
    console = Console()
    console.print(table)
    total = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    console.print(f"{plural(len(outs), 'request')}, {total:,} tokens in {elapsed:.2f} s "
                  f"({total / elapsed:,.0f} tokens/s), ZOS {'on' if a.zos else 'off'}, temperature {a.temperature}, "
                  f"max_model_len {llm.max_model_len:,}, {llm.engine.config.num_kv_blocks:,} KV blocks")
    return 0


# ---- record --------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) before a record's run started; `code` is the exit code."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


class _Stop:
    """How `record` meets SIGINT (Ctrl-C), SIGTERM and SIGHUP, all alike: before the run starts the first
    one raises `Interrupted` (nothing to keep yet); once `running`, it asks the run to stop at the end of the
    step under way, so the unfinished requests are cancelled and the footer written."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self):
        self.signum: int | None = None
        self.running = False
        self.previous: dict = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._received)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _received(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and not self.running:
            raise Interrupted(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def code(self) -> int:
        return 128 + self.signum


def _bar(console, disable: bool = False):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True, disable=disable or not console.is_terminal)


class _BarProgress:
    """tracing.workload's Progress on the Rich bar: a task while the requests are drawn, then one while they
    run; from the run's start a stop signal ends it at a step's end (`_Stop.running`)."""

    def __init__(self, bar, total: int, stop: _Stop):
        self.bar, self.stop, self.task = bar, stop, bar.add_task("drawing requests", total=total)

    def drawn(self, n: int) -> None:
        self.bar.advance(self.task, n)

    def running(self, total: int) -> None:
        self.stop.running = True  # no request is half added: the signal now waits for a step's end
        self.bar.remove_task(self.task)
        self.task = self.bar.add_task("recording", total=total)

    def stepped(self, finished: int, step: int) -> None:
        self.bar.advance(self.task, finished)
        self.bar.update(self.task, description=f"recording, step {step}")


def _refuse_existing(out: Path, world_size: int, force: bool) -> None:
    """record never replaces a trace unless --force, and never leaves a run unreadable: a rank file of
    another run beside OUT is refused even then (removing it is the user's call)."""
    from tracing.ranks import rank_path

    if world_size == 1:
        if out.exists() and not force:
            raise SystemExit(f"mdi-trace: {out} exists; give another -o, or --force to replace it.")
        return
    ours = {rank_path(out, r) for r in range(world_size)}
    others = sorted(p for p in out.parent.glob(f"{glob.escape(out.stem)}.rank*{glob.escape(out.suffix)}")
                    if p not in ours) if out.parent.is_dir() else []
    if others:
        raise SystemExit(f"mdi-trace: {others[0]} lies beside {out} and would join its run; remove it or give "
                         f"another -o.")
    there = sorted(p for p in ours if p.exists())
    if there and not force:
        raise SystemExit(f"mdi-trace: {there[0]} exists; give another -o, or --force to replace the run's "
                         f"{world_size} rank files.")


def _record(a, argv: list[str]) -> int:
    from rich.console import Console

    from model.parallel import setup
    from tracing.workload import WorkloadError, WorkloadSpec, read_prompts

    try:  # a bad --prompts file fails before the model loads
        prompts = read_prompts(a.prompts) if a.prompts else None
    except WorkloadError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    spec = WorkloadSpec(num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
                        temperature=a.temperature, cancel_rate=a.cancel_rate, seed=a.seed, prompts=prompts,
                        arrivals=a.arrivals, virtual_clock_ms=a.virtual_clock)
    timed = prompts is not None and prompts[0].arrival is not None
    if a.arrivals and timed:
        raise SystemExit(f"mdi-trace: {a.prompts} gives every request its arrival; drop --arrivals, or the file's "
                         f"arrivals.")
    if a.virtual_clock is not None and not (a.arrivals or timed):
        raise SystemExit("mdi-trace: --virtual-clock times arrivals, and every request arrives at 0 here; give "
                         "--arrivals or a prompts file with arrivals, or drop it.")
    _check_model(a.model)
    _check_device(a.device)
    out = Path(a.output or f"traces/run-{time.strftime('%Y%m%d-%H%M%S')}.mdt")
    if out.is_dir():
        raise SystemExit(f"mdi-trace: {out} is a folder; give -o a file name.")
    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        _refuse_existing(out, a.nproc, a.force)
        return _launch_record(a, argv, out)
    with _Stop() as stop:
        shard = setup(a.device)  # one process, or a rank of `--nproc` / torchrun
        if a.nproc not in (1, shard.world_size):
            raise SystemExit(f"mdi-trace: --nproc {a.nproc} but this process is one of {shard.world_size} ranks "
                             f"(WORLD_SIZE); drop --nproc under torchrun.")
        return _record_rank(a, argv, spec, out, shard, stop, Console())


def _record_rank(a, argv: list[str], spec, out: Path, shard, stop: _Stop, console) -> int:
    """One process's (or rank's) record (tracing/workload.py) under a progress bar, then the summary."""
    from model.parallel import barrier, from_rank0
    from tracing.ranks import open_run, rank_path
    from tracing.workload import record, recorded_llm

    out = Path(from_rank0(str(out), shard))  # one name for every rank, even a default made of the time
    path = rank_path(out, shard.rank) if shard.world_size > 1 else out
    if shard.world_size == 1 or "MDI_INIT_METHOD" not in os.environ:  # `--nproc` checked the run's files
        _refuse_existing(path, 1, a.force)
    try:
        llm = recorded_llm(path, ["mdi-trace", *argv], exclusive=not a.force, model=a.model, device=a.device,
                           seed=a.seed, shard=shard, **engine_kwargs(a))
    except ValueError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    skipped = getattr(llm.engine.runner.model.weights, "skipped_tensors", [])
    if skipped and shard.rank == 0:  # a released checkpoint's out-of-scope tensors (DSpark, vision)
        console.print(f"skipped {len(skipped)} tensors outside the model served here: {', '.join(skipped[:4])}"
                      f"{', …' if len(skipped) > 4 else ''}", soft_wrap=True)
    try:
        with _bar(console, disable=shard.rank > 0) as bar:
            outcome = record(llm, spec, lambda: stop.signum is not None, _BarProgress(bar, spec.size, stop))
    except Interrupted:  # while drawing the requests: none was added, the trace holds no step
        stop.running, outcome = True, None
    except ValueError as e:  # a request that does not fit the model or the KV pool: nothing is kept
        raise SystemExit(f"mdi-trace: {e}") from None
    barrier(shard)  # every rank's footer is written
    interrupted = outcome is None or outcome.stopped
    if shard.rank > 0:
        return stop.code if interrupted else 0
    if interrupted:
        print(f"mdi-trace: interrupted ({stop.name}); the unfinished requests were cancelled and the trace is in "
              f"{out}.", file=sys.stderr)
        return stop.code
    for trace in open_run(out).traces:
        _print_summary(console, trace, f"recorded {trace.path} in {outcome.seconds:.1f} s", size=True)
    q = shlex.quote(str(out))
    console.print(f"look at it:\n  [bold]mdi-trace view {q}[/]  (the TUI: timeline, steps, requests, resources)\n"
                  f"  [bold]mdi-trace info {q}[/]\n  [bold]mdi-trace verify {q}[/]\n  [bold]mdi-trace check {q}[/]\n"
                  f"  [bold]mdi-trace export {q}[/]  (Chrome trace JSON; then ui.perfetto.dev)",
                  soft_wrap=True)
    return 0


def _launch_record(a, argv: list[str], out: Path) -> int:
    """`record --nproc N`: the same command as N ranks (engine/launch.py), after the checks that would
    otherwise fail in every rank at once."""
    from engine.launch import launch
    from model.config import PRESETS, preset
    from model.parallel import Shard
    from model.released import checkpoint_args

    args = preset(a.model) if a.model in PRESETS and not Path(a.model).is_dir() else checkpoint_args(a.model)
    Shard(0, a.nproc).experts(args.n_routed_experts)  # ConfigError unless N divides the routed experts
    if a.device == "cuda":
        import torch
        if torch.cuda.device_count() < a.nproc:
            raise SystemExit(f"mdi-trace: --nproc {a.nproc} on cuda needs {a.nproc} GPUs and "
                             f"{torch.cuda.device_count()} are visible.")
    return launch([sys.executable, "-m", "tui.cli", *argv, *([] if a.output else ["-o", str(out)])], a.nproc)


# ---- info / export / verify ------------------------------------------------------------------------
def _print_summary(console, trace, title: str, size: bool = False) -> None:
    from rich.table import Table

    from tracing.summary import summarize

    s = summarize(trace)
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    rows = [("requests", f"{s.requests}"),
            ("steps", f"{s.num_steps} ({s.steps['prefill']} prefill, {s.steps['decode']} decode)"),
            ("tokens", f"{s.prompt_tokens:,} prompt, {s.computed_tokens:,} computed (with recomputation), "
                       f"{s.output_tokens:,} output"),
            ("stale tokens", f"{s.stale_tokens}"),
            ("preemptions", f"{s.preemptions}"),
            ("cancellations", f"{s.cancellations}"),
            ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(s.finish_reasons.items())) or "none"),
            ("duration", f"{s.duration_s:.2f} s"),
            ("tokens/s", f"{s.per_second(s.computed_tokens):,.0f} computed, {s.per_second(s.output_tokens):,.0f} "
                         "output"),
            ("device busy", f"{100 * s.device_busy:.0f}%")]
    if size:
        rows.append(("trace size", f"{trace.path.stat().st_size / 1024:,.0f} KiB, {s.events:,} events"))
    for row in rows:
        t.add_row(*row)
    t.add_row("log", f"[red]{trace.cut}[/]" if trace.cut else "complete (footer present)")
    console.print(t)


def _print_latency(console, trace) -> None:
    """Per-request latency (tracing/latency.py): TTFT, TPOT, queue time and time preempted as percentiles, each
    over the requests it applies to, then how the requests ended and when they arrived."""
    from rich.table import Table

    from tracing.latency import METRICS, scan_latency, wall_time
    from tui.format import fmt_ns

    lat = scan_latency(trace)
    t = Table(title="latency", title_justify="left", caption_justify="left",
              caption="TTFT: arrival to first token; TPOT: time per output token after the first; queue time: "
                      "arrival to first scheduled; time preempted: per request preempted. Each over the requests "
                      "it applies to (count).")
    for k, col in enumerate(("", "count", "mean", "p50", "p90", "p99", "max")):
        t.add_column(col, justify="left" if k == 0 else "right", style="bold" if k == 0 else None)
    for metric, label in METRICS.items():
        st = lat.stats(metric)
        t.add_row(label, "0", *["-"] * 5) if st is None else t.add_row(
            label, f"{st.count:,}", *(fmt_ns(v) for v in (st.mean, st.p50, st.p90, st.p99, st.max)))
    console.print(t)
    console.print(f"[bold]ends[/]: {lat.outcomes_text()}", soft_wrap=True)
    first_last = lat.arrivals()
    if first_last:
        first, last = first_last
        wall = wall_time(trace.header, first)
        console.print(f"[bold]arrivals[/]: {plural(len(lat.requests), 'request')} from {fmt_ns(first)}"
                      + (f" (≈ {wall})" if wall else "") + f" to {fmt_ns(last)} after t0", soft_wrap=True)


def _info(a) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.platform import describe

    from tracing.ranks import open_run

    run = open_run(a.trace)
    h = run.header
    m, e = h.get("model") or {}, h.get("engine") or {}
    t = Table(title=f"{a.trace}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    rows = [("device", h.get("device")),
            ("platform", describe(h.get("platform"))),
            ("versions", f"schema {h.get('schema_version')}, torch {h.get('torch')}, triton {h.get('triton')}"),
            ("model", f"vocab {m.get('vocab_size')}, dim {m.get('dim')}, {m.get('n_layers')} layers, "
                      f"max_seq_len {m.get('max_seq_len')}, {h.get('dtype')}"),
            ("checkpoint digest", h.get("checkpoint_digest")),
            ("engine", ", ".join(f"{k} {v}" for k, v in e.items() if k != "eos_token_id")),
            ("seed", h.get("seed")),
            ("time", h.get("time")),
            ("argv", shlex.join(map(str, h.get("argv") or [])))]
    if run.world_size > 1:
        rows.append(("ranks", f"{run.world_size} (EP x DP, run id {h.get('run_id')}): "
                              + ", ".join(str(t.path.name) for t in run.traces)))
    for k, v in rows:
        t.add_row(k, str(v))
    console = Console()
    console.print(t)
    for rank, trace in enumerate(run.traces):
        _print_summary(console, trace, "summary" if run.world_size == 1 else f"rank {rank}: {trace.path.name}")
        _print_latency(console, trace)
    return 0


def _export(a) -> int:
    from tracing.export import export_perfetto
    from tracing.ranks import open_run

    with open_run(a.trace) as run:  # every rank of a run (a process each), or the one rank named
        out = Path(a.output or f"{run.path.stem}.perfetto.json")
        if out.is_dir():
            raise SystemExit(f"mdi-trace: {out} is a folder; give -o a file name.")
        if out.exists() and not a.force:
            raise SystemExit(f"mdi-trace: {out} exists; give another -o, or --force to replace it.")
        n = export_perfetto(run, out, force=a.force)
        cuts = [f"{'' if run.world_size == 1 else f'rank {r}: '}{run.traces[r].cut}" for r in run.selected
                if run.traces[r].cut]
    ranks = f" of {len(run.selected)} ranks" if len(run.selected) > 1 else ""
    print(f"wrote {out}: {n:,} trace events{ranks}{''.join('; ' + c for c in cuts)}; open it at "
          f"https://ui.perfetto.dev")
    return 0


def _verify(a) -> int:
    try:
        from tracing.verify import verify_run
    except ImportError as e:
        if e.name != "tracing.verify":
            raise
        raise SystemExit("mdi-trace: verify is not built yet (tracing/verify.py is missing).") from None
    from tracing.ranks import open_run

    run = open_run(a.trace)  # one log, or every rank's log of a run and what ties them together
    findings = verify_run(run)
    violations = [f for f in findings if f.violation]  # a log cut short is a note, not a finding
    total = max(getattr(findings, "total", 0), len(violations))  # verify keeps the first ones
    for f in violations:
        print(f)
    if total > len(violations):
        print(f"… and {total - len(violations):,} more (the first {len(violations)} are shown)")
    for rank in run.selected:
        if run.traces[rank].cut:
            print(f"note: {'' if run.world_size == 1 else f'rank {rank}: '}{run.traces[rank].cut}")
    print(plural(total, "finding", spec=",") if total else "no findings")
    return 1 if total else 0


def _os_error(e: OSError) -> str:
    """An OSError in the command line's words: what, and which file, without Python's [Errno N]."""
    what = (e.strerror or str(e)).rstrip(".")
    name = e.filename if e.filename is not None else ""
    return f"{name}: {what[0].lower() + what[1:]}." if name else f"{what}."


def _check_options(a) -> None:
    """Combinations of options that would silently ignore one of them."""
    if a.command != "check":
        return
    if a.scheduler:
        given = [f for f, on in (("--against", a.against), ("--until", a.until is not None),
                                 ("--step", a.step is not None), ("--model", a.model),
                                 ("--device cuda", a.device == "cuda")) if on]
        if given:
            raise SystemExit(f"mdi-trace: check --scheduler replays the whole log with no model, so {given[0]} "
                             f"has no effect there; drop one of the two.")
    if a.against and a.step is not None:
        raise SystemExit("mdi-trace: check --against reference compares every step up to --until N; --step N "
                         "is for re-execution alone (`check --step N`).")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if not argv:  # a bare call: what the commands are
        parser.print_help()
        return 2
    a = parser.parse_args(argv)
    from engine.host import tune_cpu_allocator
    from model.config import ConfigError
    from tracing.reader import TraceError

    tune_cpu_allocator()  # a CPU step's large tensors stay mapped between steps (engine/host.py)

    def user_errors():  # evaluated when an exception is matched: CheckpointError only if torch was loaded
        loaded = [(sys.modules.get(m), name) for m, name in (("model.checkpoint", "CheckpointError"),
                                                            ("engine.tokenizer", "TokenizerError"))]
        return (ConfigError, TraceError, OSError) + tuple(getattr(m, name) for m, name in loaded if m)

    commands = {"checkpoint": _checkpoint, "generate": _generate, "info": _info, "export": _export,
                "verify": _verify, "check": _check, "diff": _diff, "record": lambda a: _record(a, argv),
                "serve": lambda a: __import__("tui.serve").serve.serve(a, argv),
                "view": lambda a: __import__("tui.app").app.run_view(a.trace, a.follow, a.verify)}
    try:
        _check_options(a)
        return commands[a.command](a)
    except OSError as e:
        print(f"mdi-trace: {_os_error(e)}", file=sys.stderr)
        return 2
    except user_errors() as e:
        print(f"mdi-trace: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except Interrupted as e:  # record, before its run started
        print(f"mdi-trace: interrupted ({e}) before the run started; no trace was written.", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
