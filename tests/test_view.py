"""`mdi-trace view` driven by keys (App.run_test and Pilot) on the committed example trace: every view is
reachable by its key and shows the selected step, the jumps (step, time, request, event kind, command
palette) move the selection every view shares, the timeline zooms, pans and finds idle gaps, the events
view searches and filters, and a cut-short, a growing (--follow) and a damaged log each end well. A run of two
ranks (traces/examples/micro-2rank.rank{0,1}.mdt, recorded with `record --nproc 2`) opens as one: a lane set
per rank on one time axis, per-rank counts, and R switching the other views (and their step numbers) to the
next rank. Tab stays within the view on show."""
import asyncio
import gc
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tracing.schema import EVENTS, KIND, ROW_FIELDS
from tui.app import TraceApp
from tui.data import TraceModel
from tui.dialogs import Ask
from tui.help import HelpScreen
from tui.lines import LineList
from tui.views.timeline import TimelineChart

EXAMPLE = Path(__file__).resolve().parents[1] / "traces" / "examples" / "micro-preempt-cancel.mdt"
SIZE = (120, 36)


async def until(pilot, condition, seconds: float = 10.0) -> None:
    """Wait (polling) until `condition()` holds or `seconds` pass, then for the app to settle."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            break
        await asyncio.sleep(0.01)
    await pilot.pause()


async def ready(pilot):
    """Wait for the index worker, then for the app to settle."""
    app = pilot.app
    await until(pilot, lambda: app.model.ready and app.generation > 0 or app.error, 5)


def notes(app) -> str:
    """Every notification the app has shown."""
    return " ".join(n.message for n in app._notifications)


def shown_text(widget) -> str:
    """The text a Static shows, rendered as plain text."""
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


@pytest.fixture(scope="module")
def model():
    m = TraceModel(EXAMPLE)
    m.load()
    return m


@pytest.mark.asyncio
async def test_each_view_is_reached_by_its_key_and_named_on_screen():
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        bar = app.query_one("#viewbar")
        assert "indexing" not in shown_text(bar) and "step 0 · request 0" in shown_text(bar)
        for key, name, title in (("2", "TimelineView", "Timeline"), ("3", "StepsView", "Steps"),
                                 ("4", "RequestsView", "Requests"), ("5", "ResourcesView", "Resources"),
                                 ("6", "EventsView", "Events"), ("1", "OverviewView", "Overview")):
            await pilot.press(key)
            await pilot.pause(0.05)
            on_screen = [v.id for v in app.query("View") if v.region.y < app.size.height]
            assert app.view == name and on_screen == [name]         # the others lie off screen
            assert f"{key} {title}" in shown_text(bar)
        overview = shown_text(app.query_one("#overview"))
        for word in ("16; finished: abort 1, length 15", "176 (24 prefill, 152 decode)", "computed tokens/s",
                     "ZOS overlap", "idle gaps"):
            assert word in overview, word


@pytest.mark.asyncio
async def test_the_selected_step_is_shared_by_every_view(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("3", "down", "down", "full_stop")     # the step list's cursor, then the global key
        assert app.step_row == 3
        assert app.query_one("#step-list", LineList).cursor == 3
        assert "step 3:" in model.step_detail(3)[0]
        await pilot.press("2")
        assert app.query_one(TimelineChart).selected == 3
        await pilot.press("comma", "5")
        assert app.step_row == 2 and shown_text(app.query_one("#resources")).startswith("step 2:")
        await pilot.press("6")
        events = app.query_one("#event-list", LineList)
        assert app.query_one("EventsView").shown[events.cursor] == model.sched_event[2]
        await pilot.press("down")   # an event of another step moves the step everywhere
        assert app.step_row == model.row_of_event(int(model.sched_event[2]) + 1)


@pytest.mark.asyncio
async def test_steps_detail_lists_each_row_with_its_block_table_and_sampled_token(model):
    e = model.schedule_event(40)
    lines = model.step_detail(40)
    assert len(lines) == 3 + len(e.rows)
    for raw, line in zip(e.rows, lines[3:]):
        seq, epoch, start, tokens, table, slot = raw[:6]
        assert line.split()[:4] == [str(seq), str(epoch), str(start), str(len(tokens))]
        assert " ".join(map(str, table)) in line and f" {slot} " in line
    tokens = {model.index.event_at(i).seq_id: model.index.event_at(i).token_id
              for i in model.index.events_of_step(int(model.steps.step[40])) if model.index.kind[i] == 10}
    for raw, line in zip(e.rows, lines[3:]):
        if raw[6]:
            assert str(tokens[raw[0]]) in line.split()


@pytest.mark.asyncio
async def test_go_to_step_time_and_request_from_keys(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("g", *"40", "enter")
        assert model.steps.step[app.step_row] == 40 and app.view == "StepsView"
        await pilot.press("g", *"99999", "enter")           # no such step: a notification, the same step
        assert model.steps.step[app.step_row] == 40 and "no step 99999" in notes(app)
        t = int(model.steps.schedule_start[100]) + 1
        await pilot.press("t", *f"{t}ns", "enter")
        assert app.step_row == 100
        await pilot.press("t", *"soon", "enter")
        assert app.step_row == 100
        await pilot.press("r", *"3", "enter")
        assert app.view == "RequestsView" and app.seq_id == 3
        assert shown_text(app.query_one("#lifeline-head")).startswith("request 3: arrived")
        assert app.query_one("#lifeline", LineList).count == len(model.index.events_of_request(3))


@pytest.mark.asyncio
async def test_next_and_previous_event_of_a_kind(model):
    preempts = model.index.events_of_kind("preempt")
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("k", *"preempt", "enter")
        assert app.event_index == preempts[0]
        await pilot.press("right_square_bracket")
        assert app.event_index == preempts[1]
        assert app.step_row == model.row_of_event(int(preempts[1]))
        await pilot.press("left_square_bracket", "left_square_bracket")   # none before the first: stays
        assert app.event_index == preempts[0]
        await pilot.press("k", *"preemption", "enter")                    # not a kind: a notification
        assert app.kind == "preempt" and "no event kind 'preemption'" in notes(app)


@pytest.mark.asyncio
async def test_command_palette_jumps():
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p", *"step 12")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.model.steps.step[app.step_row] == 12
        await pilot.press("ctrl+p", *"next cancel")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.model.index.kind[app.event_index] == 9


@pytest.mark.asyncio
async def test_timeline_zoom_pan_fit_and_idle_gaps(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2")
        chart = app.query_one(TimelineChart)
        t0, span = chart.t0, chart.span
        await pilot.press("plus")
        assert chart.span == span // 2
        await pilot.press("minus", "minus")
        assert chart.span == (span // 2) * 4
        before = chart.t0
        await pilot.press("right")
        assert chart.t0 == before + chart.span // 8
        await pilot.press("0")
        lanes = model.lanes
        assert (chart.t0, chart.span) == (lanes.t_min, lanes.t_max - lanes.t_min)
        await pilot.press("L")     # the longest device idle gap: its step is selected
        assert app.step_row == lanes.gap_row[np.argmax(lanes.gap_len)]
        assert "device idle" in shown_text(app.query_one("#timeline-info"))
        await pilot.press("i")
        after = lanes.gap_row[lanes.gap_start > lanes.gap_start[np.argmax(lanes.gap_len)]][0]
        assert app.step_row == after


@pytest.mark.asyncio
async def test_timeline_draws_every_lane_and_marks_overlap_and_idle(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=(160, 30)) as pilot:
        await ready(pilot)
        await pilot.press("2")
        chart = app.query_one(TimelineChart)
        rows = [chart.render_line(y).text for y in range(9)]
        assert [r.split()[0] for r in rows[:7]] == ["time", "schedule", "execute", "process", "device", "overlap",
                                                    "idle"]
        assert all("█" in r or "▒" in r for r in rows[1:5])
        # ZOS: step 1 is scheduled while the device runs step 0, and the overlap row says so there
        lo, hi = chart.columns()
        col = int(np.searchsorted(lo, model.steps.schedule_start[1], "right")) - 1
        assert rows[5][10 + col] == "▀"
        both = _naive_overlaps(model)   # every column, against a naive scan: a CPU phase within a device span
        for c, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            want = "▀" if any(x < b and y > a for x, y in both) else " "
            assert rows[5][10 + c] == want, c
        gap = int(np.argmax(model.lanes.gap_len))   # zoomed onto a gap, the idle row shows it and its length
        chart.t0, chart.span = int(model.lanes.gap_start[gap]) - 1000, int(model.lanes.gap_len[gap]) * 2
        await pilot.pause()
        idle = chart.render_line(6).text
        assert "━" in idle and idle.count("━") < len(idle) and "µs" in idle


@pytest.mark.asyncio
async def test_requests_view_lifeline_and_enter_selects_the_events_step(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("4", "down", "down")
        assert app.seq_id == 2
        evs = model.index.events_of_request(2)
        lines = [model.lifeline_line(2, int(i)) for i in evs]
        assert "request_added" in lines[0] and "finish" in lines[-1]
        assert sum("prefill chunk" in s or " decode " in s for s in lines) == \
            int(np.count_nonzero(model.index.kind[evs] == 1))
        await pilot.press("tab", "end", "enter")
        assert app.event_index == evs[-1] and app.step_row == model.row_of_event(int(evs[-1]))


@pytest.mark.asyncio
async def test_resources_view_shows_owners_at_the_selected_step(model):
    # a naive replay of the block and slot events up to step 60's schedule event
    blocks, slots = {}, {}
    for i in range(int(model.sched_event[60]) + 1):
        e = model.index.event_at(i)
        if e.kind == "block_alloc":
            blocks.update({b: e.seq_id for b in e.block_ids})
        elif e.kind == "block_free":
            [blocks.pop(b) for b in e.block_ids]
        elif e.kind == "slot_alloc":
            slots[e.state_slot] = e.seq_id
        elif e.kind == "slot_free":
            slots.pop(e.state_slot)
    owners_b, owners_s = model.owners(60)
    assert {b: s for b, s in enumerate(owners_b.tolist()) if s >= 0} == blocks
    assert {b: s for b, s in enumerate(owners_s.tolist()) if s >= 0} == slots
    assert model.blocks_in_use[60] == len(blocks) and model.slots_in_use[60] == len(slots)
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("g", *"60", "enter", "5")
        text = shown_text(app.query_one("#resources"))
        assert f"KV blocks {len(blocks)}/16 owned" in text and f"state slots {len(slots)}/8 owned" in text
        for b, s in blocks.items():
            assert f"{b}:{s}" in text


@pytest.mark.asyncio
async def test_events_view_search_filter_and_bad_input(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("6", "slash", *"stale", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        view, events = app.query_one("EventsView"), app.query_one("#event-list", LineList)
        stale = [i for i in range(len(model.index)) if model.index.kind[i] == 10 and
                 not model.index.event_at(i).appended]
        assert view.shown[events.cursor] == stale[0]
        await pilot.press("n")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert view.shown[events.cursor] == stale[1]
        await pilot.press("f", *"kind=preempt,cancel step=50:", "enter")
        want = [i for i in np.flatnonzero(np.isin(model.index.kind, [8, 9])) if model.index.step[i] >= 50]
        assert list(view.shown) == want and "kind=preempt,cancel" in shown_text(app.query_one("#event-status"))
        await pilot.press("f", *"kind=nothing", "enter")       # a bad filter: a notification, the same filter
        assert list(view.shown) == want and "no event kind 'nothing'" in notes(app)
        await pilot.press("x")
        assert len(view.shown) == len(model.index)
        await pilot.press("slash", *"(unclosed", "enter")
        assert "missing )" in notes(app)


@pytest.mark.asyncio
async def test_help_screen_and_q_quits():
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("g")
        assert isinstance(app.screen, Ask)
        await pilot.press("escape", "q")
        await pilot.pause()
    assert app.return_code == 0 and app.error is None


@pytest.mark.asyncio
async def test_a_cut_short_log_opens_with_a_warning(tmp_path):
    data = EXAMPLE.read_bytes()
    cut = tmp_path / "cut.mdt"
    cut.write_bytes(data[:len(data) // 2])
    app = TraceApp(str(cut))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        warnings = shown_text(app.query_one("#warnings"))
        assert "the log was cut short" in warnings
        assert len(app.model.steps) < 176
        await pilot.press("3", "end")
        assert app.step_row == len(app.model.steps) - 1


@pytest.mark.asyncio
async def test_a_damaged_log_ends_the_app_with_one_sentence(tmp_path):
    data = bytearray(EXAMPLE.read_bytes())
    bad = tmp_path / "bad.mdt"
    data[len(data) // 2:len(data) // 2 + 64] = b"\xc1" * 64      # 0xc1: never used by msgpack
    bad.write_bytes(bytes(data))
    app = TraceApp(str(bad))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause()
    assert app.return_code == 2 and "is damaged at byte" in app.error and "\n" not in app.error


@pytest.mark.asyncio
async def test_follow_reindexes_a_growing_log_until_it_is_complete(tmp_path, monkeypatch):
    monkeypatch.setattr("tui.app.FOLLOW_EVERY", 0.05)
    data = EXAMPLE.read_bytes()
    live = tmp_path / "live.mdt"
    live.write_bytes(data[:len(data) // 3])
    app = TraceApp(str(live), follow=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = len(app.model.steps)
        assert app.follow and "following" in shown_text(app.query_one("#viewbar"))
        await pilot.press("3", "end")
        with open(live, "ab") as f:
            f.write(data[len(data) // 3:])
        await until(pilot, lambda: len(app.model.steps) == 176 and not app.follow, 6)
        assert first < 176 == len(app.model.steps) and not app.follow
        assert app.step_row == 175   # it was at the tail, so it stays at the tail


@pytest.mark.asyncio
async def test_verify_findings_reach_the_overview(tmp_path):
    app = TraceApp(str(EXAMPLE), verify=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await until(pilot, lambda: app.verify_lines is not None, 30)
        assert app.verify_lines == ["no findings"], app.verify_lines
        assert "verify: no findings" in shown_text(app.query_one("#warnings"))


def test_the_data_model_imports_no_textual_torch_or_engine():
    import subprocess
    import sys
    code = ("import sys; import tui.data, tui.format, tui.lanes, tracing.index; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('textual', 'torch', 'engine')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    code = "import sys; import tui.app; print([m for m in sys.modules if m.split('.')[0] in ('torch', 'engine')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cli_bad_input_is_one_sentence_and_exit_2(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    empty = tmp_path / "empty.mdt"
    empty.write_bytes(b"")
    shutil.copy(EXAMPLE, tmp_path / "ok.mdt")
    for args, words in (([str(tmp_path / "missing.mdt")], "cannot read"), ([str(empty)], "is empty"),
                        ([str(root / "README.md")], "not an mdi-trace log"),
                        ([str(tmp_path / "ok.mdt"), "--colour"], "unrecognized arguments")):
        out = subprocess.run([sys.executable, "-m", "tui.cli", "view", *args], capture_output=True, text=True,
                             cwd=root, timeout=60)
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1, out.stderr


@pytest.mark.asyncio
async def test_remaining_keys_center_previous_gap_previous_match_and_paging(model):
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2", "L", "I")                 # the gap before the longest one
        lanes = model.lanes
        longest = int(np.argmax(lanes.gap_len))
        assert app.step_row == lanes.gap_row[longest - 1]
        chart = app.query_one(TimelineChart)
        await pilot.press("c")                           # the selected step's schedule span in the middle
        mid = chart.t0 + chart.span // 2
        assert abs(mid - model.steps.schedule_start[app.step_row]) <= 1
        await pilot.press("3", "home")
        assert app.step_row == 0
        steps = app.query_one("#step-list", LineList)
        await pilot.press("pagedown")
        assert app.step_row == steps.size.height - 1
        await pilot.press("pageup")
        assert app.step_row == 0
        await pilot.press("6", "end", "slash", *"preempt$", "enter")   # wraps nowhere: no later match
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "no more matches" in shown_text(app.query_one("#event-status"))
        await pilot.press("N")
        await app.workers.wait_for_complete()
        await pilot.pause()
        view = app.query_one("EventsView")
        events = app.query_one("#event-list", LineList)
        last = model.index.events_of_kind("preempt")[-1]
        assert view.shown[events.cursor] == last


def _rewrite(tmp_path, name, change):
    """A copy of the example whose events went through `change(kind_name, fields)`, `fields` the event's values
    as a list in schema order, rows as lists (no footer: cut short)."""
    import msgpack

    from tracing.reader import TraceFile
    from tracing.schema import SCHEMA_VERSION
    src = TraceFile(EXAMPLE)
    out = msgpack.packb({**src.header, "schema_version": SCHEMA_VERSION}, use_bin_type=True)  # events read as it
    for e in src.events():
        fields = [[list(r) for r in e.rows] if name == "rows" else getattr(e, name) for name in e.names]
        change(e.kind, fields)
        out += msgpack.packb([KIND[e.kind], *fields], use_bin_type=True)
    path = tmp_path / name
    path.write_bytes(out)
    return path


@pytest.mark.asyncio
async def test_malformed_fields_give_a_sentence_or_a_marked_line_never_a_traceback(tmp_path):
    def bad_reason(kind, f):
        if kind == "finish":
            f[EVENTS[KIND["finish"]][1].index("reason")] = "stop"          # a string where an enum code belongs
    app = TraceApp(str(_rewrite(tmp_path, "reason.mdt", bad_reason)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
    assert app.return_code == 2 and "is damaged at byte" in app.error and "\n" not in app.error
    # the viewer's sentence, or the reader's where it checks the field's type itself (tracing/reader.py)
    assert "malformed finish event" in app.error or "finish event whose reason is not an int" in app.error

    def bad_table(kind, f):
        if kind == "schedule":
            for row in f[EVENTS[KIND["schedule"]][1].index("rows")]:
                row[ROW_FIELDS.index("block_table")] = 7         # a block_table that is not a list
    app = TraceApp(str(_rewrite(tmp_path, "table.mdt", bad_table)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("3", "down", "4", "down", "tab", "down", "5", "6", "down", "2", "1")
        assert app.error is None and "a malformed row" in app.model.step_detail(1)[3]
        assert "malformed schedule event" in app.model.lifeline_line(0, int(app.model.sched_event[0]))


# ---- a run of several ranks (record --nproc 2): traces/examples/micro-2rank.rank{0,1}.mdt --------------------
RUN = EXAMPLE.parent / "micro-2rank.mdt"    # the OUT of the record: only its rank logs exist


def _device_columns(chart, rank_model, row):
    """(drawn, expected) device lane of one rank: a naive scan of that rank's spans, shifted by its offset."""
    lo, hi = chart.columns()
    s, off = rank_model.steps, rank_model.offset
    spans = [(a + off, e + off) for a, e in zip(s.device_start.tolist(), s.device_end.tolist()) if a >= 0]
    want = "".join("█" if any(a < b_ and e > a_ for a, e in spans) else " " for a_, b_ in zip(lo.tolist(),
                                                                                             hi.tolist()))
    got = chart.render_line(row).text[chart.label:chart.label + len(lo)].replace("▒", "█")
    return got, want


def _help_text(app) -> str:
    return " ".join(shown_text(w) for w in app.screen.query("Static"))


@pytest.mark.asyncio
async def test_a_two_rank_run_draws_a_device_lane_per_rank_on_one_time_axis():
    app = TraceApp(str(RUN))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        run = app.logs
        assert run.world_size == 2 and [m.rank for m in run.models] == [0, 1] and run.models[1].offset > 0
        await pilot.press("2")
        chart = app.query_one(TimelineChart)
        labels = [chart.render_line(y).text[:chart.label].strip() for y in range(len(chart.rows))]
        assert labels == ["time", *(f"r{r} {n}" for r in (0, 1) for n in ("schedule", "execute", "process",
                                                                          "device", "overlap", "idle")), "r0 step"]
        assert chart.size.height == len(chart.rows) == 14
        # zoomed onto rank 1's first device span start: its lane is drawn at its own times plus its offset
        m1 = run.models[1]
        start = int(m1.steps.device_start[0]) + m1.offset
        chart.t0, chart.span = start - 40 * 1000, chart.chart_width() * 1000    # 1 µs per column
        await pilot.pause()
        for rank, row in ((0, 4), (1, 10)):
            got, want = _device_columns(chart, run.models[rank], row)
            assert got == want, rank
        got, _ = _device_columns(chart, m1, 10)
        assert got[39] == " " and got[40] == "█"      # it starts at its offset, not at its own t


@pytest.mark.asyncio
async def test_a_two_rank_run_overview_names_the_ranks_and_counts_each():
    app = TraceApp(str(RUN))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        text = shown_text(app.query_one("#overview"))
        assert "2 rank logs" in text and "micro-2rank.rank0.mdt" in text and "micro-2rank.rank1.mdt" in text
        for m in app.logs.models:
            line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"rank {m.rank} ") and "events" in ln)
            assert f"{len(m.index):,} events" in line and f"{len(m.steps)} steps" in line
        assert "rank 0/2" in shown_text(app.query_one("#viewbar"))


@pytest.mark.asyncio
async def test_the_rank_key_switches_every_view_to_the_next_rank_and_step_numbers_are_per_rank():
    app = TraceApp(str(RUN))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        m0, m1 = app.logs.models
        assert " R  Rank " in shown_text(app.query_one("KeyBar"))
        await pilot.press("3", "full_stop", "full_stop")
        assert app.rank == 0 and app.step_row == 2
        await pilot.press("R")
        assert app.rank == 1 and app.model is m1 and "rank 1/2" in shown_text(app.query_one("#viewbar"))
        assert m1.steps.step[app.step_row] == 2                     # the same step number, on rank 1
        steps = app.query_one("#step-list", LineList)
        assert steps.count == len(m1.steps) and steps.cursor == app.step_row
        await pilot.press("4")
        assert app.seq_id in m1.seq_ids and app.query_one("#request-list", LineList).count == len(m1.seq_ids)
        last = int(m0.steps.step.max())                              # rank 0 has a step that rank 1 lacks
        assert last > m1.steps.step.max()
        await pilot.press("g", *str(last), "enter")
        assert f"no step {last}" in notes(app) and app.rank == 1
        await pilot.press("R", "g", *str(last), "enter")
        assert app.rank == 0 and m0.steps.step[app.step_row] == last
        await pilot.press("R")                                        # back to rank 1: where it was left
        assert app.rank == 1 and m1.steps.step[app.step_row] == 2
        seq0 = int(m0.seq_ids[0])                                 # a request of the other rank: its rank
        await pilot.press("r", *str(seq0), "enter")
        assert app.rank == 0 and app.seq_id == seq0 and app.view == "RequestsView"
        await pilot.press("6")
        events = app.query_one("#event-list", LineList)
        assert events.count == len(m0.index)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and "next rank of a run" in _help_text(app)


@pytest.mark.asyncio
async def test_a_rank_file_opens_the_whole_run_on_that_rank_and_a_single_log_has_no_rank_key():
    app = TraceApp(str(RUN.with_name("micro-2rank.rank1.mdt")))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        assert app.logs.world_size == 2 and app.rank == 1
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        assert "Rank" not in shown_text(app.query_one("KeyBar")) and "rank" not in shown_text(app.query_one("#viewbar"))
        await pilot.press("R")      # it says why nothing changes (it said nothing)
        assert app.rank == 0 and app.model.rank is None and "this trace has one rank" in notes(app)
        await pilot.press("question_mark")   # the help lists every key, R too (it left R out on a single log)
        assert isinstance(app.screen, HelpScreen) and "next rank" in _help_text(app)


def test_a_run_with_a_rank_log_missing_is_one_sentence_and_exit_2(tmp_path):
    import subprocess
    import sys
    shutil.copy(RUN.with_name("micro-2rank.rank0.mdt"), tmp_path / "run.rank0.mdt")
    out = subprocess.run([sys.executable, "-m", "tui.cli", "view", str(tmp_path / "run.mdt")], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert out.returncode == 2 and "run.rank1.mdt is missing" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


@pytest.mark.asyncio
async def test_tab_cycles_the_lists_of_the_view_on_show_only():
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("4")
        assert app.focused.id == "request-list"
        seen = []
        for key in ("tab", "tab", "tab", "shift+tab"):
            await pilot.press(key)
            seen.append(app.focused.id)
        assert seen == ["lifeline", "request-list", "lifeline", "request-list"]   # never a view off screen
        await pilot.press("3", "tab", "tab")
        assert app.focused.id == "step-list"


@pytest.mark.asyncio
async def test_the_views_off_screen_are_drawn_ahead_and_the_loaded_log_is_frozen_out_of_the_collector():
    app = TraceApp(str(EXAMPLE))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            requests = app.query_one("#request-list", LineList)
            for _ in range(20):   # drawn while idle, a refresh or two after the index is in
                if requests._strips and gc.get_freeze_count():
                    break
                await pilot.pause()
            assert requests._strips and requests._styles_cache._cache   # its lines, while still off screen
            assert gc.get_freeze_count() > 0
            await pilot.press("4")
            assert app.focused is requests and requests.line(0) == app.model.request_line(0)
    finally:
        gc.unfreeze()   # the rest of the test session collects as usual


# ---- issue #17: a pipe, --follow with verify, the view bar at 80 columns, the help, plurals, one ZOS figure,
# ---- one token count ---------------------------------------------------------------------------------------------
def _naive_overlaps(model):
    """(start, end) of every stretch where a CPU span and a device span overlap (each kind never overlaps
    itself, tracing/SCHEMA.md, so these are disjoint)."""
    s = model.steps
    dev = [(a, e) for a, e in zip(s.device_start.tolist(), s.device_end.tolist()) if a >= 0]
    out = []
    for starts, ends in ((s.schedule_start, s.schedule_end), (s.execute_start, s.execute_end),
                         (s.process_start, s.process_end)):
        for a, e in zip(starts.tolist(), ends.tolist()):
            out += [(max(a, da), min(e, de)) for da, de in dev if a >= 0 and max(a, da) < min(e, de)]
    return out


def _bar(app) -> str:
    """The view bar as drawn: its one line at the screen's width."""
    return app.query_one("#viewbar").render_line(0).text


def test_view_with_stdout_or_stdin_not_a_terminal_is_one_sentence_and_exit_2(monkeypatch):
    import subprocess
    import sys
    from tui.app import run_view
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tui.cli", "view", str(EXAMPLE), "--no-verify"], capture_output=True,
                         stdin=subprocess.DEVNULL, text=True, cwd=root, timeout=30)   # it hung, writing escape codes
    assert out.returncode == 2 and out.stdout == "", out.stdout[:200]
    assert out.stderr == ("mdi-trace: view needs a terminal; stdout is not one (use `mdi-trace info` or "
                          "`mdi-trace export` for a pipe).\n")

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdout", Tty())
    monkeypatch.setattr("sys.stdin", io.StringIO())
    with pytest.raises(SystemExit, match="view needs a terminal; stdin is not one"):
        run_view(str(EXAMPLE), verify=False)


@pytest.mark.asyncio
async def test_follow_labels_the_log_live_then_complete_and_verifies_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr("tui.app.FOLLOW_EVERY", 0.05)
    data = EXAMPLE.read_bytes()
    live = tmp_path / "live.mdt"
    live.write_bytes(data[:len(data) // 3])
    app = TraceApp(str(live), follow=True, verify=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await until(pilot, lambda: app.verify_lines is not None, 8)
        warnings = shown_text(app.query_one("#warnings"))
        assert "live: the log is still being written" in warnings and "cut short" not in warnings, warnings
        assert "following: live" in _bar(app)
        with open(live, "ab") as f:
            f.write(data[len(data) // 3:])
        await until(pilot, lambda: not app.follow and not app.verify_running and app.verify_runs[-1], 12)
        warnings = shown_text(app.query_one("#warnings"))
        assert not app.follow and app.verify_runs[0] is False and app.verify_runs[-1] is True  # once more, complete
        assert "complete: the footer is written" in warnings and "verify: no findings" in warnings, warnings
        assert "cut short" not in warnings and "live" not in warnings and "complete" in _bar(app)


def test_verify_is_counted_from_its_summary_line():
    from tui.views.overview import verify_summary
    lines = [f"step {k}, request 1: a finding" for k in range(100)] + ["note: a note", "250 findings"]
    assert verify_summary(lines) == (250, lines[:100])       # verify lists at most 100, counts them all
    assert verify_summary(["step 1: one", "1 finding"]) == (1, ["step 1: one"])   # it counted 2 (the summary too)
    assert verify_summary(["note: the log was cut short", "no findings"]) == (0, [])


@pytest.mark.asyncio
async def test_the_view_bar_keeps_the_rank_at_80_columns():
    app = TraceApp(str(RUN))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        for key in ("1", "2", "3", "4", "5", "6"):
            await pilot.press(key)
            bar = _bar(app)
            assert "rank 0/2" in bar and "step 0" in bar, (key, bar)
        await pilot.press("R", "end")
        assert "rank 1/2" in _bar(app)
        app.follow = True      # the longest state too
        app._viewbar()
        await pilot.pause()
        assert "rank 1/2" in _bar(app) and "live" in _bar(app)
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:   # wide: every title, padded, and "request"
        await ready(pilot)
        assert " 1 Overview │ 2 Timeline │" in _bar(app) and "step 0 · request 0" in _bar(app)


@pytest.mark.asyncio
async def test_every_binding_is_in_the_help():
    from textual.binding import Binding
    from tui.app import VIEWS
    from tui.help import KEYS
    from tui.views.base import View
    listed = {k for row in KEYS for k in row[3]}
    bound = set()
    for cls in (TraceApp, View, *VIEWS, LineList, HelpScreen, Ask):
        for b in cls.__dict__.get("BINDINGS", []):
            b = b if isinstance(b, Binding) else Binding(*b)
            bound |= {k.strip() for k in b.key.split(",")}
    bound.add(TraceApp.COMMAND_PALETTE_BINDING)
    assert bound - listed == set(), "keys bound but not in the help"
    assert listed - bound == set(), "keys in the help that nothing binds"
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("question_mark")
        text = _help_text(app)
        assert all(row[1] in text for row in KEYS)


def test_counts_agree_with_their_nouns(model):
    import re
    one = int(np.flatnonzero(model.steps.rows == 1)[0])
    assert ", 1 row, " in model.step_detail(one)[0]
    assert ", 1 row: " in model.event_line(int(model.sched_event[one]))
    head = model.lifeline(1)[0][2]       # request 1: cancelled once
    assert "1 cancellation;" in head and "1 epoch bump," in head
    assert "1 preemption," in model.lifeline(2)[0][2]
    lines = [model.step_detail(r)[0] for r in range(len(model.steps))] + [model.counts()]
    lines += [t for seq in model.seq_ids.tolist() for t in model.lifeline(seq)[0]]
    lines += [model.event_line(i) for i in range(len(model.index))]
    bad = [ln for ln in lines if re.search(r"(?<![\d.,])1 (prefill |decode |epoch )?(row|token|step|event|request|"
                                           r"chunk|bump|reservation|preemption|cancellation|finding)s\b", ln)]
    assert not bad, bad[:3]


@pytest.mark.asyncio
async def test_the_overview_zos_figure_and_the_timeline_marks_are_one_overlap(model):
    both = _naive_overlaps(model)
    s = model.steps
    cpu = sum(int(np.sum(np.where(a >= 0, e - a, 0))) for a, e in ((s.schedule_start, s.schedule_end),
                                                                    (s.execute_start, s.execute_end),
                                                                    (s.process_start, s.process_end)))
    overlap = sum(e - a for a, e in both)
    assert model.lanes.overlap == overlap and model.lanes.cpu_busy == cpu
    device = dict(model.overview())["device"]
    assert f"the CPU phases ran {100 * overlap / cpu:.0f}% of their time" in device     # it said 0% on this trace
    assert 0 < 100 * overlap / cpu < 100   # how much is the recording machine's load; none is the old bug
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=(160, 30)) as pilot:
        await ready(pilot)
        await pilot.press("2")
        chart = app.query_one(TimelineChart)
        lanes, w = model.lanes, chart.chart_width()
        gap = int(lanes.gap_start[np.argmax(lanes.gap_len)])
        # one stretch of overlap at 1 µs a column; the longest idle gap at 200 µs a column, where a column holds
        # the device's last span and the CPU's next phase apart in time (marked, before, as an overlap)
        for t0, per_column in ((both[3][0] - 20_000, 1000), (gap - 100_000 - 75 * 200_000, 200_000)):
            chart.t0, chart.span = t0, w * per_column
            await pilot.pause()
            lo, hi = chart.columns()
            row = chart.render_line(5).text[chart.label:]
            want = "".join("▀" if any(x < h and y > l for x, y in both) else " "
                           for l, h in zip(lo.tolist(), hi.tolist()))
            assert row == want and (per_column > 1000 or "▀" in row and " " in row), per_column


@pytest.mark.asyncio
async def test_a_requests_token_count_is_one_number_in_the_list_and_its_lifeline(model):
    appended, stale = {}, {}
    for i in model.index.events_of_kind("token"):
        e = model.index.event_at(int(i))
        (appended if e.appended else stale)[e.seq_id] = (appended if e.appended else stale).get(e.seq_id, 0) + 1
    assert stale   # this trace has stale tokens: the list counted them, the lifeline did not
    from tui.data import REQUEST_HEADER
    assert REQUEST_HEADER.split()[2] == "output"
    for k, seq in enumerate(model.seq_ids.tolist()):
        n = int(model.request_line(k).split()[2])
        assert n == appended.get(seq, 0), seq
        assert f"output: {n} token{'s' if n != 1 else ''} appended" in model.lifeline(seq)[0][3]
        if model.finish_reasons.get(seq) == "length":
            assert n == model.index.event_at(int(model.index.events_of_request(seq)[0])).max_tokens
    app = TraceApp(str(EXAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        seq = max(stale)
        await pilot.press("r", *str(seq), "enter")
        head = shown_text(app.query_one("#lifeline-head"))
        assert f"output: {appended[seq]} tokens appended" in head and f"{stale[seq]} stale" in head
