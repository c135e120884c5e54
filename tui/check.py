"""The checking commands of the command line: `mdi-trace check` (re-execution, scheduler replay, against
the reference) and `mdi-trace diff` (ARCHITECTURE.md §6). Each prints a rich table and returns the exit code:
0 all agree, 1 a finding. Torch is loaded only by the checks that run the model."""
from __future__ import annotations

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tracing.reader import open_trace
from tui.format import noun


def _table(title: str, rows) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for row in rows:
        t.add_row(*row)
    return t


def _log(cut, trace) -> str:
    """What a check read of the log: cut short, complete, or (a stop at the first mismatch) not to its end."""
    if cut:
        return f"[yellow]{cut}[/]"
    return "complete (footer present)" if trace.clean else "no footer (not read to its end: the check stopped first)"


def check(a) -> int:
    trace = open_trace(a.trace)
    if a.scheduler:
        return _scheduler(a, trace)
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("mdi-trace: --device cuda needs a CUDA GPU and none is visible; use --device cpu.")
    if a.against == "reference":
        return _against(a, trace)
    return _tokens(a, trace)


def _progress(console: Console, what: str, run):
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(what, total=None)
        return run(lambda i, n: bar.update(task, completed=i, total=n))


def _scheduler(a, trace) -> int:
    from tracing.replay import replay_scheduler

    r = replay_scheduler(trace)
    if r.note:
        Console().print(f"[yellow]{r.note}[/]", soft_wrap=True)
    if r.mismatch:
        print(f"mismatch: {r.mismatch}")
    Console().print(_table(f"scheduler replay of {a.trace}", (
        ("steps replayed", f"{r.steps} ({r.kinds['prefill']} prefill, {r.kinds['decode']} decode)"),
        ("rows compared", f"{r.rows:,}"),
        ("digests compared", f"{r.digests}"),
        ("tokens fed", f"{r.tokens:,}"),
        ("cancellations", f"{r.cancellations}"),
        ("log", _log(r.cut, trace)),
        ("result", f"[red]first mismatch at step {r.mismatch.step}[/]" if r.mismatch
         else "[green]every step matches[/]"))))
    return 1 if r.mismatch else 0


def _tokens(a, trace) -> int:
    """Re-execute the recorded batches on the model and compare every sampled token; the per-step resource
    digests are compared by a scheduler replay first (no model, a fraction of the time)."""
    from tracing.execute import check_tokens
    from tracing.replay import replay_scheduler

    console = Console()
    replay = replay_scheduler(trace)
    if replay.note:
        console.print(f"[yellow]{replay.note}[/]", soft_wrap=True)
    if replay.mismatch:
        print(f"mismatch: {replay.mismatch}")
        return 1
    r = _progress(console, "re-executing",
                  lambda on_step: check_tokens(trace, a.model, a.device, a.until, a.step, on_step))
    if r.platform_note:
        console.print(f"[yellow]{r.platform_note}[/]", soft_wrap=True)
    if r.cut:
        console.print(f"[yellow]{r.cut}: re-executed what it holds[/]", soft_wrap=True)
    for what, items in (("near tie", r.near_ties), ("platform difference", r.platform_differences)):
        for item in items[:5]:
            console.print(f"{what} (not a mismatch): {item}", soft_wrap=True)
        if len(items) > 5:
            console.print(f"… and {len(items) - 5} more {what}s", soft_wrap=True)
    if r.against is not None and r.mismatch is None:
        n = len({d.seq_id for d in r.platform_differences})
        console.print(f"the {n} {noun(n, 'request')} with tokens beyond a near tie, "
                      f"checked against the reference ({r.against.rows:,} positions, {r.against.tokens:,} tokens): no "
                      "divergence, so this platform's engine agrees with the reference and the recording platform "
                      "computed other bits", soft_wrap=True)
    if r.mismatch:
        print(f"mismatch: {r.mismatch}")
        return 1
    what = f"step {a.step}" if a.step is not None else f"{r.steps} {noun(r.steps, 'step')}"
    differ = len(r.near_ties) + len(r.platform_differences)
    tokens = f"{r.tokens:,} sampled {noun(r.tokens, 'token')}"
    same = (f"{tokens} compared, {r.tokens - differ:,} identical, {len(r.near_ties)} near "
            f"{noun(len(r.near_ties), 'tie')} and {len(r.platform_differences)} platform "
            f"{noun(len(r.platform_differences), 'difference')} ({r.after_ties:,} tokens compared after them, "
            "the recorded tokens fed)") if differ else f"{tokens} identical"
    console.print(f"[green]{what} re-executed, {same}; {replay.digests} step {noun(replay.digests, 'digest')} and "
                  f"{replay.rows:,} scheduled {noun(replay.rows, 'row')} identical in a scheduler replay[/]",
                  soft_wrap=True)
    return 0


def _against(a, trace) -> int:
    """Every row's logits and sampled token against the plain reference model; localise the first divergence."""
    from tracing.divergence import check_against_reference

    console = Console()
    r = _progress(console, "against the reference",
                  lambda on_step: check_against_reference(trace, a.model, a.device, a.until, on_step))
    if r.platform_note:
        console.print(f"[yellow]{r.platform_note}[/]", soft_wrap=True)
    d = r.divergence
    rows = [("steps re-executed", f"{r.steps}"),
            ("rows compared", f"{r.rows:,} (logits within {r.tolerance}: max diff {r.max_diff:.3g}; {r.after_ties:,} "
                              "after their request's first near tie)"),
            ("tokens compared", f"{r.tokens:,}"),
            ("near ties", _listed(r.near_ties)),
            ("platform differences", _listed(r.platform_differences)),
            ("shape noise", f"{r.noise:,} positions over the tolerance (max {r.noise_max:.3g}) where, with teacher-forced "
                            "inputs, no module differs" + _listed(r.noise_notes, count=False) if r.noise else "none"),
            ("log", _log(r.cut, trace))]
    if d:
        rows += [("[red]divergence[/]", str(d)),
                 ("first module", f"[red]{d.module}[/]" if d.module else d.module_note or "not localised")]
    else:
        rows.append(("result", "[green]no divergence from the reference[/]"))
    console.print(_table(f"{a.trace} against the reference model", rows))
    if d:
        print(f"divergence: {d}" + (f"; first module: {d.module}" if d.module else ""))
    return 1 if d else 0


def _listed(items, count: bool = True, most: int = 8) -> str:
    """'N' (or nothing) and the first `most` of (step, request, what) items, one a line."""
    lines = "".join(f"\nstep {s}, request {q}: {what}" for s, q, what in items[:most])
    return (f"{len(items)}" if count else "") + lines + ("\n…" if len(items) > most else "")


def diff(a) -> int:
    """The first step where two traces' decisions or tokens differ, both sides shown."""
    from tracing.diff import diff_traces

    with open_trace(a.a) as ta, open_trace(a.b) as tb:
        r = diff_traces(ta, tb, tokens_only=a.tokens)
    console = Console()
    for line in r.header_notes:
        console.print(f"[yellow]{line}[/]", soft_wrap=True)
    t = Table(title=f"diff {a.a} {a.b}", title_justify="left")
    t.add_column("", style="bold")
    t.add_column("A")
    t.add_column("B")
    t.add_row("steps", f"{r.steps[0]}", f"{r.steps[1]}")
    t.add_row("tokens", f"{r.tokens[0]:,}", f"{r.tokens[1]:,}")
    for finding in r.findings:
        t.add_row(f"[red]{finding.what}[/]", finding.a, finding.b)
    console.print(t)
    for finding in r.findings:
        print(f"differ: {finding.what}")
    if not r.findings:
        console.print("[green]the traces agree[/]" + (" on every token" if a.tokens else " on every decision and token"))
    return 1 if r.findings else 0
