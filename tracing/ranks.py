"""A run of several ranks, read as one (ARCHITECTURE.md §8): find a run's rank traces, check that they belong
together, and open them. Imports neither torch, engine/ nor Textual: the viewer's data model builds on it.

No DeepInfer file does this. `mdi-trace record --nproc N -o run.mdt` (and a torchrun run) writes one log per
rank beside OUT: run.rank0.mdt ... run.rank{N-1}.mdt, each with `rank`, `world_size` and the run's `run_id`
in its header. `open_run` accepts OUT itself (it need not exist), any one rank's file, or a plain
single-process log, and returns a `Run`:

    from tracing.ranks import open_run
    with open_run("run.mdt") as run:
        for rank, trace in enumerate(run.traces):   # reader.TraceFile, by rank
            print(rank, trace.header["device"], run.offset_ns(rank))

A set that does not belong together (a rank file missing, a stray rank, another run's file, a rank that
disagrees on the world size) is a `TraceError` of one sentence.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tracing.reader import TraceError, TraceFile, open_trace

_RANK_NAME = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)(?P<suffix>\.[^.]*)?$")


def rank_path(out: str | Path, rank: int) -> Path:
    """Where rank `rank` of a run recorded as `out` writes its log: run.mdt -> run.rank1.mdt."""
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def _run_name(path: Path) -> tuple[Path, int] | None:
    """(OUT, rank) for a rank file's name, None for any other name."""
    m = _RANK_NAME.match(path.name)
    return (path.with_name(m["stem"] + (m["suffix"] or "")), int(m["rank"])) if m else None


@dataclass(slots=True)
class Run:
    """The logs of one run by rank (one log for a single process). `path`: the name it was opened by;
    `named_rank`: the rank whose own file that name is (None for OUT or a single-process log)."""
    path: Path
    traces: list[TraceFile]
    named_rank: int | None = None

    @property
    def selected(self) -> list[int]:
        """The ranks a command should work on: the one named, else every rank."""
        return list(range(self.world_size)) if self.named_rank is None else [self.named_rank]

    @property
    def world_size(self) -> int:
        return len(self.traces)

    @property
    def header(self) -> dict:
        """Rank 0's header: the run's configuration, which every rank shares."""
        return self.traces[0].header

    def offset_ns(self, rank: int) -> int:
        """Add to rank `rank`'s event times to put every rank on one time axis (the earliest t0 is 0). The
        ranks' t0_ns come from one monotonic clock when they share a host, as `record --nproc` does."""
        t0 = [t.header.get("t0_ns", 0) for t in self.traces]
        return t0[rank] - min(t0)

    def close(self) -> None:
        for t in self.traces:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_run(path: str | Path) -> Run:
    """The run that `path` names: a single-process log, one rank's log, or the OUT of a multi-rank record."""
    path = Path(path)
    if not path.exists() and rank_path(path, 0).exists():  # the OUT of a multi-rank record
        return Run(path, _open_ranks(path))
    trace = open_trace(path)  # a missing file without rank logs beside it: the reader's one sentence
    world = trace.header.get("world_size") or 1
    if world == 1:
        return Run(path, [trace])
    trace.close()
    named = _run_name(path)
    if named is None or named[1] != trace.header.get("rank"):
        raise TraceError(f"{path} is rank {trace.header.get('rank')} of a run of {world} ranks, but its name is "
                         f"not the NAME.rankR form that finds the others; rename it as recorded.")
    return Run(path, _open_ranks(named[0]), named[1])


def _open_ranks(out: Path) -> list[TraceFile]:
    """Every rank log of the run recorded as `out`, checked to belong together."""
    first = rank_path(out, 0)
    if not first.exists():
        raise TraceError(f"{out.name} names a run of several ranks but its rank 0 log {first.name} is missing; "
                         f"copy every rank's log together.")
    traces = [open_trace(first)]
    try:
        world, run_id = traces[0].header.get("world_size") or 1, traces[0].header.get("run_id")
        for rank in range(1, world):
            p = rank_path(out, rank)
            if not p.exists():
                raise TraceError(f"{out} is a run of {world} ranks but {p.name} is missing; copy every rank's "
                                 f"log together.")
            traces.append(open_trace(p))
        for rank, t in enumerate(traces):
            h = t.header
            if h.get("run_id") != run_id or h.get("world_size") != world or h.get("rank") != rank:
                raise TraceError(f"{t.path.name} does not belong to the run of {first.name} (rank "
                                 f"{h.get('rank')} of {h.get('world_size')}, run id {h.get('run_id')}; expected "
                                 f"rank {rank} of {world}, run id {run_id}); remove the stray file or record again.")
        stray = rank_path(out, world)
        if stray.exists():
            raise TraceError(f"{stray.name} lies beside a run of {world} ranks ({out.name}); remove the stray file "
                             f"or record again.")
    except BaseException:
        for t in traces:
            t.close()
        raise
    return traces
