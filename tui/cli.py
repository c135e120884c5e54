"""The `mdi-trace` command line (ARCHITECTURE.md §1: tui/ is the face of the project).

Exit codes: 0 success, 1 a finding, 2 bad usage or unreadable input. Every error a user can meet is
one sentence on stderr, never a traceback. Subcommands so far: `checkpoint init` and `generate` (random
prompts through the engine, a smoke run); `record`, `view`, `verify` and `check` arrive with the
tracer (issues #4-#6).
"""
from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mdi-trace", description="mini-DeepInfer's debugger.")
    sub = p.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoint", help="create or inspect checkpoints").add_subparsers(dest="action", required=True)
    init = ck.add_parser("init", help="write a random-weight checkpoint from a preset and a seed")
    init.add_argument("--preset", default="tiny-68m", help="tiny-68m, micro or stress")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("-o", "--output", required=True, help="output folder")
    gen = sub.add_parser("generate", help="run random prompts through the engine (a smoke run)")
    gen.add_argument("--model", default="tiny-68m", help="a preset name or a checkpoint folder")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--num-prompts", type=int, default=4)
    gen.add_argument("--prompt-len", type=int, default=200)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    return p


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


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from model.checkpoint import CheckpointError
    from model.config import ConfigError

    try:
        if a.command == "checkpoint":
            return _checkpoint_init(a)
        return _generate(a)
    except (CheckpointError, ConfigError, OSError) as e:
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
