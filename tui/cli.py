"""The `mdi-trace` command line (ARCHITECTURE.md §1: tui/ is the face of the project).

Exit codes: 0 success, 1 a finding, 2 bad usage or unreadable input. Every error a user can meet is
one sentence on stderr, never a traceback. Subcommands: `checkpoint init|quantize`, `generate` (random
prompts through the engine, a smoke run), `record` (a run under the Recorder, `--nproc N` for EP x DP),
and of a trace: `info`, `export`, `verify`, `view` (tui/app.py), `check` and `diff` (tui/check.py).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import signal
import sys
import time
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block and message, as one sentence
        self.exit(2, f"mdi-trace: {message}.\n")


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


def _step(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a step number (0 or more), not {text!r}")
    return n


def _check(a) -> int:
    from tui.check import check
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
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return n


def _record_parser(sub) -> None:
    rec = sub.add_parser("record", help="run the engine on random prompts (or a jsonl file) and record a trace")
    rec.add_argument("-o", "--output", help="trace file (default: traces/run-YYYYmmdd-HHMMSS.mdt)")
    rec.add_argument("--model", default="tiny-68m", help="a preset name or a checkpoint folder")
    rec.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    rec.add_argument("--num-prompts", type=_positive, default=16)
    rec.add_argument("--input-len", type=_range, default=(64, 512), metavar="MIN:MAX",
                     help="prompt lengths, uniform in [MIN, MAX] (default 64:512)")
    rec.add_argument("--output-len", type=_range, default=(16, 64), metavar="MIN:MAX",
                     help="max_tokens, uniform in [MIN, MAX] (default 16:64)")
    rec.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one {"prompt": text or token ids, "max_tokens": N (optional)} per line')
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--seed", type=int, default=0, help="seed of the prompts, the cancellations and the sampler")
    rec.add_argument("--zos", action=argparse.BooleanOptionalAction, default=True,
                     help="zero-overhead scheduling: schedule step N while the device runs N-1")
    rec.add_argument("--batch-invariant", action="store_true",
                     help="logits bitwise independent of batching and chunking (model/invariant.py)")
    rec.add_argument("--max-num-batched-tokens", type=_positive, default=512)
    rec.add_argument("--max-num-seqs", type=_positive, default=8)
    rec.add_argument("--num-kv-blocks", type=_positive, default=24,
                     help="KV pool in 128-token blocks; the default is small enough that some preemption happens")
    rec.add_argument("--num-state-slots", type=_positive, default=None, help="default: --max-num-seqs")
    rec.add_argument("--cancel-rate", type=_probability, default=0.1, metavar="P",
                     help="cancel each request with probability P, after a random number of its output tokens")
    rec.add_argument("--nproc", type=_positive, default=1, metavar="N",
                     help="ranks of an EP x DP run (gloo on CPU, NCCL with one GPU each): requests round-robin, "
                          "one trace per rank beside the output, NAME.rankR.mdt")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mdi-trace", description="mini-DeepInfer's debugger.")
    sub = p.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoint", help="create or inspect checkpoints").add_subparsers(dest="action", required=True)
    init = ck.add_parser("init", help="write a random-weight checkpoint from a preset and a seed")
    init.add_argument("--preset", default="tiny-68m", help="tiny-68m, micro or stress")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("-o", "--output", required=True, help="output folder")
    quant = ck.add_parser("quantize", help="write a checkpoint in the released format (FP8 dense, FP4 experts, "
                                           "sharded with model.safetensors.index.json)")
    quant.add_argument("--from", dest="source", required=True, help="a checkpoint folder made by `checkpoint init`")
    quant.add_argument("-o", "--output", required=True, help="output folder")
    gen = sub.add_parser("generate", help="run random prompts through the engine (a smoke run)")
    gen.add_argument("--model", default="tiny-68m", help="a preset name or a checkpoint folder")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--num-prompts", type=int, default=4)
    gen.add_argument("--prompt-len", type=int, default=200)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    _record_parser(sub)
    info = sub.add_parser("info", help="a trace's header and summary, and whether it was cut short")
    info.add_argument("trace")
    view = sub.add_parser("view", help="the trace viewer: timeline, steps, requests, resources, events (a TUI)")
    view.add_argument("trace", help="a log, one rank's log, or the OUT of `record --nproc N` (opens every rank)")
    view.add_argument("--follow", action="store_true", help="tail a log that is still being written")
    view.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                      help="run `mdi-trace verify` in the background and show its findings "
                           "(default: logs under 32 MiB)")
    exp = sub.add_parser("export", help="convert a trace (Chrome trace JSON for Perfetto)")
    exp.add_argument("trace")
    exp.add_argument("--format", default="perfetto", choices=["perfetto"])
    exp.add_argument("-o", "--output", help="output file (default: the trace's name with .json)")
    ver = sub.add_parser("verify", help="check a trace against the engine's invariants (exit 1 on a finding)")
    ver.add_argument("trace")
    chk = sub.add_parser("check", help="replay a trace and compare it with the recording (exit 1 on a mismatch)")
    chk.add_argument("trace")
    chk.add_argument("--scheduler", action="store_true",
                     help="replay the scheduler alone, with no model: the recorded arrivals, cancellations and "
                          "sampled tokens in, every batch and resource digest compared")
    chk.add_argument("--against", choices=["reference"],
                     help="compare every row's logits and token with the plain reference model and localise the "
                          "first divergence to a step, layer and module")
    when = chk.add_mutually_exclusive_group()
    when.add_argument("--until", type=_step, metavar="N", help="re-execute the steps up to and including step N")
    when.add_argument("--step", type=_step, metavar="N",
                      help="check step N alone, after re-executing the steps it depends on")
    chk.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    chk.add_argument("--model", help="the recorded checkpoint (default: the trace's model_source)")
    dif = sub.add_parser("diff", help="the first step where two traces' decisions or tokens differ (exit 1 if any)")
    dif.add_argument("a", metavar="A")
    dif.add_argument("b", metavar="B")
    dif.add_argument("--tokens", action="store_true",
                     help="compare the sampled tokens only (runs that decide differently, e.g. ZOS on vs off)")
    return p


def _checkpoint(a) -> int:
    return {"init": _checkpoint_init, "quantize": _checkpoint_quantize}[a.action](a)


def _checkpoint_quantize(a) -> int:
    from model.released import quantize_checkpoint

    digest = quantize_checkpoint(a.source, a.output)
    print(f"wrote {a.output}: {a.source} in the released format (FP8 e4m3 32x32 tiles, FP4 e2m1 experts), "
          f"digest {digest}")
    return 0


def _checkpoint_init(a) -> int:
    from model.checkpoint import init_checkpoint

    digest = init_checkpoint(a.preset, a.seed, a.output)
    print(f"wrote {a.output}: preset {a.preset}, seed {a.seed}, weights digest {digest}")
    return 0


def _generate(a) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine import LLM, SamplingParams

    if min(a.num_prompts, a.prompt_len, a.max_tokens) < 1:
        raise SystemExit("mdi-trace: --num-prompts, --prompt-len and --max-tokens must be at least 1.")
    try:
        llm = LLM(a.model, device=a.device)
    except ValueError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    g = torch.Generator().manual_seed(a.seed)
    vocab = llm.engine.runner.model.args.vocab_size
    prompts = [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.num_prompts)]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except ValueError as e:
        raise SystemExit(f"mdi-trace: {e}") from None
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    table = Table(title=f"{a.model} on {a.device}, weights {llm.digest[:12]}")
    for col in ("request", "prompt tokens", "output tokens", "finish"):
        table.add_column(col)
    for o in outs:
        table.add_row(str(o.request_id), str(len(o.prompt_token_ids)), " ".join(map(str, o.token_ids)), o.finish_reason)
    console = Console()
    console.print(table)
    total = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    console.print(f"{len(outs)} requests, {total:,} tokens in {elapsed:.2f} s ({total / elapsed:,.0f} tokens/s), "
                  f"ZOS on, temperature {a.temperature}")
    return 0


# ---- record --------------------------------------------------------------------------------------
def _read_prompts(path: str) -> list[tuple[str | list[int], int | None]]:
    """(prompt, max_tokens or None) per line of a jsonl file; a bad line is one sentence with its number."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"mdi-trace: cannot read {path}: {getattr(e, 'strerror', None) or e}.") from None
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
            raise SystemExit(f'mdi-trace: {path} line {n} is not {{"prompt": text or token ids, '
                             f'"max_tokens": N (optional)}}.')
        prompts.append((prompt, max_tokens))
    if not prompts:
        raise SystemExit(f"mdi-trace: {path} has no prompts.")
    return prompts


def _requests(a, llm, rng: random.Random) -> list[tuple[list[int], object]]:
    """(prompt token ids, SamplingParams) per request: random ids and lengths, or the --prompts file."""
    from engine import SamplingParams

    def max_tokens():
        return rng.randint(*a.output_len)
    if a.prompts:
        return [(llm.tokenizer.encode(p) if isinstance(p, str) else p,
                 SamplingParams(temperature=a.temperature, max_tokens=m or max_tokens()))
                for p, m in _read_prompts(a.prompts)]
    vocab = llm.engine.runner.model.args.vocab_size
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*a.input_len))],
             SamplingParams(temperature=a.temperature, max_tokens=max_tokens(), ignore_eos=True))
            for _ in range(a.num_prompts)]


def _run(engine, cancel_at: dict[int, int], total: int) -> bool:
    """Steps the engine to the end under a progress bar, cancelling request i once it has cancel_at[i]
    output tokens (0: as soon as it has been scheduled). Ctrl-C stops at the end of the step under way
    and cancels the unfinished requests, so the trace stays consistent; returns whether that happened.
    Under EP x DP the ranks agree on both every step, so they stop together."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from model.parallel import any_rank

    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    try:
        with Progress(*columns, transient=True, disable=engine.shard.rank > 0) as bar:
            task, steps, stopped = bar.add_task("recording", total=total), 0, False
            while engine.has_unfinished():
                if any_rank(bool(interrupted), engine.shard):
                    stopped = True
                    break
                bar.advance(task, len(engine.step()))
                steps += 1
                bar.update(task, description=f"recording, step {steps}")
                for seq_id, k in list(cancel_at.items()):
                    seq = engine.scheduler.seqs.get(seq_id)
                    if seq is None or (seq.num_cached_tokens and seq.num_output_tokens >= k):
                        del cancel_at[seq_id]
                        if seq is not None:
                            engine.abort(seq_id)
            if stopped:
                for seq_id in list(engine.scheduler.seqs):
                    engine.abort(seq_id)
                engine.step()  # applies the cancellations and processes the step in flight
    finally:
        signal.signal(signal.SIGINT, previous)
    return stopped


def _record(a, argv: list[str]) -> int:
    import os

    from rich.console import Console

    from engine import LLM
    from model.parallel import barrier, from_rank0, setup
    from tracing import Recorder
    from tracing.ranks import open_run, rank_path

    if a.prompts:
        _read_prompts(a.prompts)  # a bad file fails before the model loads
    out = Path(a.output or f"traces/run-{time.strftime('%Y%m%d-%H%M%S')}.mdt")
    if out.is_dir():
        raise SystemExit(f"mdi-trace: {out} is a folder; give -o a file name.")
    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_record(a, argv, out)
    shard = setup(a.device)  # one process, or a rank of `--nproc` / torchrun
    if a.nproc not in (1, shard.world_size):
        raise SystemExit(f"mdi-trace: --nproc {a.nproc} but this process is one of {shard.world_size} ranks "
                         f"(WORLD_SIZE); drop --nproc under torchrun.")
    out = Path(from_rank0(str(out), shard))  # one name for every rank, even a default made of the time
    path = rank_path(out, shard.rank) if shard.world_size > 1 else out
    recorder = Recorder(path, argv=["mdi-trace", *argv])
    try:
        llm = LLM(a.model, device=a.device, enable_zos=a.zos, max_num_batched_tokens=a.max_num_batched_tokens,
                  max_num_seqs=a.max_num_seqs, num_kv_blocks=a.num_kv_blocks, num_state_slots=a.num_state_slots,
                  tracer=recorder, seed=a.seed, shard=shard, batch_invariant=a.batch_invariant)
    except BaseException as e:
        recorder.file.close()
        path.unlink(missing_ok=True)
        if isinstance(e, ValueError):
            raise SystemExit(f"mdi-trace: {e}") from None
        raise
    console = Console()
    skipped = getattr(llm.engine.runner.model.weights, "skipped_tensors", [])
    if skipped and shard.rank == 0:  # a released checkpoint's out-of-scope tensors (DSpark, vision)
        console.print(f"skipped {len(skipped)} tensors outside the model served here: {', '.join(skipped[:4])}"
                      f"{', …' if len(skipped) > 4 else ''}", soft_wrap=True)
    rng = random.Random(a.seed)
    engine, interrupted, refused = llm.engine, False, None
    try:
        requests = _requests(a, llm, rng)  # every rank draws all of them, then serves its share
        for prompt, params in requests:
            engine.check_request(prompt, params)
        ids = [engine.add_request(*requests[i]) for i in shard.requests(len(requests))]
        cancel_at = {i: rng.randrange(p.max_tokens) for i, (_, p) in enumerate(requests)
                     if rng.random() < a.cancel_rate}
        cancel_at = {i: k for i, k in cancel_at.items() if i in ids}
        start = time.perf_counter()
        interrupted = _run(engine, cancel_at, len(ids))
    except KeyboardInterrupt:  # before the run started
        interrupted = True
    except ValueError as e:  # a request that does not fit the model or the KV pool
        refused = e
    finally:
        engine.shutdown()  # writes the footer
    if refused:
        path.unlink(missing_ok=True)
        raise SystemExit(f"mdi-trace: {refused}")
    barrier(shard)  # every rank's footer is written
    if shard.rank > 0:
        return 130 if interrupted else 0
    if interrupted:
        print(f"mdi-trace: interrupted; the unfinished requests were cancelled and the trace is in {out}.",
              file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    for trace in open_run(out).traces:
        _print_summary(console, trace, f"recorded {trace.path} in {elapsed:.1f} s", size=True)
    q, one = shlex.quote(str(out)), shlex.quote(str(path))  # export takes one rank's log
    console.print(f"look at it:\n  [bold]mdi-trace view {q}[/]  (the TUI: timeline, steps, requests, resources)\n"
                  f"  [bold]mdi-trace info {q}[/]\n  [bold]mdi-trace verify {q}[/]\n  [bold]mdi-trace check {q}[/]\n"
                  f"  [bold]mdi-trace export {one} --format perfetto -o run.json[/]  (then ui.perfetto.dev)",
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
    return 0


def _export(a) -> int:
    from tracing.export import export_perfetto
    from tracing.reader import open_trace

    out = Path(a.output or Path(a.trace).with_suffix(".json"))
    trace = open_trace(a.trace)
    n = export_perfetto(trace, out)
    cut = f"; {trace.cut}" if trace.cut else ""
    print(f"wrote {out}: {n:,} trace events{cut}; open it at https://ui.perfetto.dev")
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
    violations = [f for f in verify_run(run) if f.violation]  # a log cut short is a note, not a finding
    for f in violations:
        print(f)
    for rank in run.selected:
        if run.traces[rank].cut:
            print(f"note: {'' if run.world_size == 1 else f'rank {rank}: '}{run.traces[rank].cut}")
    print(f"{len(violations)} finding{'' if len(violations) == 1 else 's'}" if violations else "no findings")
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _parser().parse_args(argv)
    from model.config import ConfigError
    from tracing.reader import TraceError

    def user_errors():  # evaluated when an exception is matched: CheckpointError only if torch was loaded
        checkpoint = sys.modules.get("model.checkpoint")
        return (ConfigError, TraceError, OSError) + ((checkpoint.CheckpointError,) if checkpoint else ())

    commands = {"checkpoint": _checkpoint, "generate": _generate, "info": _info, "export": _export,
                "verify": _verify, "check": _check, "diff": _diff, "record": lambda a: _record(a, argv),
                "view": lambda a: __import__("tui.app").app.run_view(a.trace, a.follow, a.verify)}
    try:
        return commands[a.command](a)
    except user_errors() as e:
        print(f"mdi-trace: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
