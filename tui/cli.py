"""The `mdi-trace` command line (ARCHITECTURE.md §1: tui/ is the face of the project).

Exit codes: 0 success, 1 a finding, 2 bad usage or unreadable input. Every error a user can meet is
one sentence on stderr, never a traceback. Subcommands so far: `checkpoint init` and `generate` (a
greedy smoke run of the paged model); `record`, `view`, `verify` and `check` arrive with the engine
and the tracer (issues #3-#6).
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
    gen = sub.add_parser("generate", help="greedy generation with the paged model (a smoke run)")
    gen.add_argument("--model", default="tiny-68m", help="a preset name or a checkpoint folder")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--num-prompts", type=int, default=4)
    gen.add_argument("--prompt-len", type=int, default=200)
    gen.add_argument("--max-tokens", type=int, default=16)
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
    from rich.progress import track
    from rich.table import Table

    from model.checkpoint import load_model
    from model.paged import BLOCK_SIZE, ForwardBatch, PagedModel

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mdi-trace: --device cuda needs a CUDA GPU and none is visible; use --device cpu.")
    if min(a.num_prompts, a.prompt_len, a.max_tokens) < 1:
        raise SystemExit("mdi-trace: --num-prompts, --prompt-len and --max-tokens must be at least 1.")
    torch.set_num_threads(min(4, torch.get_num_threads()))
    model, digest = load_model(a.model, a.device)
    total = a.prompt_len + a.max_tokens
    if total > model.args.max_seq_len:
        raise SystemExit(f"mdi-trace: prompt plus output ({total}) exceeds max_seq_len {model.args.max_seq_len}.")
    B, per_seq, dev = a.num_prompts, -(-total // BLOCK_SIZE), a.device
    paged = PagedModel(model, num_blocks=B * per_seq, num_slots=B)
    tables = torch.arange(B * per_seq, device=dev).view(B, per_seq)
    slots = torch.arange(B, device=dev)
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, model.args.vocab_size, (B, a.prompt_len), generator=g).to(dev)
    t0 = time.perf_counter()
    logits = paged.forward(ForwardBatch(ids, torch.zeros(B, dtype=torch.long, device=dev),
                                        torch.full((B,), a.prompt_len, device=dev), tables, slots, a.prompt_len, False))
    t1 = time.perf_counter()
    out = [logits.argmax(-1)]
    for k in track(range(a.max_tokens - 1), description="decoding", transient=True):
        pos = a.prompt_len + k
        logits = paged.forward(ForwardBatch(out[-1][:, None], torch.full((B,), pos, device=dev),
                                            torch.ones(B, dtype=torch.long, device=dev), tables, slots, pos + 1, True))
        out.append(logits.argmax(-1))
    tokens = torch.stack(out, 1).cpu()
    t2 = time.perf_counter()
    table = Table(title=f"{a.model} on {dev}, weights {digest[:12]}")
    for col in ("request", "prompt tokens", "output tokens (greedy)"):
        table.add_column(col)
    for i in range(B):
        table.add_row(str(i), str(a.prompt_len), " ".join(map(str, tokens[i].tolist())))
    console = Console()
    console.print(table)
    console.print(f"prefill {B}x{a.prompt_len}: {B * a.prompt_len / (t1 - t0):,.0f} tokens/s; decode batch {B}: "
                  f"{B * (a.max_tokens - 1) / max(t2 - t1, 1e-9):,.0f} tokens/s")
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
