"""SVG snapshots of every view of `mdi-trace view` on the committed example trace, at 80x24 and 160x48, and of
the timeline of the committed two-rank run at 160x48
(pytest-textual-snapshot). Nothing on screen depends on the clock: the times shown are the log's own, the
verify subprocess is off, and each snapshot waits for the index. After a deliberate change, look at the
diff (`pytest tests/test_view_snapshots.py --snapshot-report`) before `--snapshot-update`."""
import asyncio
from pathlib import Path

import pytest

from tui.app import TraceApp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "traces/examples/micro-preempt-cancel.mdt"   # relative: the overview shows the path as given
VIEWS = [("1", []), ("2", ["full_stop"] * 3), ("3", ["g", "4", "0", "enter"]), ("4", ["down", "down", "down"]),
         ("5", ["g", "6", "0", "enter"]), ("6", ["slash", *"preempt", "enter"])]


def _settled(keys):
    async def run_before(pilot):
        app = pilot.app
        for _ in range(500):
            if app.model.ready and app.generation > 0:
                break
            await asyncio.sleep(0.01)
        await pilot.pause()
        await pilot.press(*keys)
        await app.workers.wait_for_complete()
        await pilot.pause()
    return run_before


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("view,keys", VIEWS, ids=["overview", "timeline", "steps", "requests", "resources",
                                                    "events"])
def test_view_snapshot(snap_compare, monkeypatch, view, keys, size):
    monkeypatch.chdir(ROOT)
    assert snap_compare(TraceApp(EXAMPLE), run_before=_settled([view, *keys]), terminal_size=size)


def test_help_snapshot(snap_compare, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert snap_compare(TraceApp(EXAMPLE), run_before=_settled(["question_mark"]), terminal_size=(100, 30))


def test_two_rank_timeline_snapshot(snap_compare, monkeypatch):
    """A run of two ranks (record --nproc 2): both ranks' lanes on one time axis, rank 1 on show."""
    monkeypatch.chdir(ROOT)
    assert snap_compare(TraceApp("traces/examples/micro-2rank.mdt"),
                        run_before=_settled(["2", "R", "full_stop", "full_stop"]), terminal_size=(160, 48))
