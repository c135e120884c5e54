"""Every `mdi-trace` command on damaged and hostile logs (issue #17 item 2): one sentence on stderr and exit 2 for a
log it cannot read, 0 or 1 for one it can (a log cut short is readable), never a traceback.

A small clean log is recorded once (micro preset, random weights, about 2.5 KB: two requests, one cancelled), then
varied three ways, and each variant goes through the CLI in-process (`tui.cli.main`, stdout and stderr captured):
(a) cut at every byte offset: `verify` at every one, `info` at every offset of the header and of the trailer
    and at every event's first two bytes (a cut further inside an event reads as the same prefix as one at its
    second byte, and `info`'s tables take ~10 ms to draw), `export` and `check --scheduler` on a stride;
(b) bytes overwritten at random (seeded): `verify` and `export` on every variant, `info` and `check --scheduler`
    on a sample;
(c) hostile headers with the framing intact (fields of the wrong type, schema_version true or 1.0) and length
    claims beyond the reader's limits (a 4 GiB str, a 2^32-element array), in the header and in an event.

The oracle for (a) and (b) is the reader: a variant it opens and reads to the end is readable. `tui.cli._parser`
is built once for the module (argparse takes ~5 ms to build it, more than most commands take to run).
"""
from __future__ import annotations

import functools
import random
from pathlib import Path

import msgpack
import pytest

import tui.cli as cli
from tracing.ranks import open_run
from tracing.reader import TraceError, TraceFile
from tracing.schema import KIND, TRAILER_TAG


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> bytes:
    """A clean log's bytes: request 0 (4 prompt tokens, 3 output tokens) and request 1, cancelled at step 1."""
    from engine import LLM, SamplingParams
    from model.checkpoint import init_checkpoint
    from tracing import Recorder
    root = tmp_path_factory.mktemp("fuzz")
    init_checkpoint("micro", 0, root / "ckpt")
    path = root / "run.mdt"
    engine = LLM(str(root / "ckpt"), tracer=Recorder(path, argv=["fuzz"]), num_kv_blocks=2,
                 max_num_batched_tokens=64).engine
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    victim = engine.add_request([9, 8, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for step in range(50):
        if not engine.has_unfinished():
            break
        if step == 1:
            engine.abort(victim)
        engine.step()
    engine.shutdown()
    data = path.read_bytes()
    assert len(data) < 4096, "the log grew; the every-byte cuts would slow down"
    return data


@pytest.fixture(scope="module", autouse=True)
def parser_built_once():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "_parser", functools.lru_cache(maxsize=None)(cli._parser))
        yield


@pytest.fixture(scope="module")
def layout(clean, tmp_path_factory) -> dict:
    """Where the clean log's header ends and each event starts."""
    path = tmp_path_factory.mktemp("layout") / "run.mdt"
    path.write_bytes(clean)
    with TraceFile(path) as tf:
        starts = [offset for offset, _ in tf.objects()]
        return {"body": tf.body_offset, "starts": starts, "footer": tf.footer_offset, "size": len(clean)}


def readable(path: Path) -> bool:
    """Whether the commands' reader opens `path` as a run (`open_run`: a header whose rank and world size name
    other rank files it lacks is refused) and reads every event as its typed record (a schedule row of the
    wrong length is damage the reader refuses, not a finding)."""
    try:
        with open_run(path) as run:
            for tf in run.traces:
                for _ in tf.events():
                    pass
        return True
    except TraceError:
        return False


COMMANDS = {"info": lambda p, tmp: ["info", str(p)], "verify": lambda p, tmp: ["verify", str(p)],
            "export": lambda p, tmp: ["export", str(p), "-o", str(tmp / "out.json")],
            "check": lambda p, tmp: ["check", "--scheduler", str(p)]}


def run(command: str, path: Path, capsys, ok: bool | None) -> tuple[int, str]:
    """`mdi-trace COMMAND path` in-process: asserts no exception escapes and no traceback is printed, an exit code
    of 0 or 1 when the log is readable (`ok`), 2 with one line of stderr when not. `check --scheduler` stops at
    its first mismatch, which may come before the damage, and refuses a log it cannot replay: any of the three
    codes, with the one line on 2. Returns (exit code, stderr)."""
    out = path.parent / "out.json"
    out.unlink(missing_ok=True)
    argv = COMMANDS[command](path, path.parent)
    try:
        rc = cli.main(argv)
    except BaseException as e:  # noqa: BLE001 - the point: nothing may escape
        pytest.fail(f"mdi-trace {' '.join(argv)} raised {type(e).__name__}: {e}")
    captured = capsys.readouterr()
    where = f"mdi-trace {' '.join(argv)} -> {rc}: {captured.err!r}"
    assert "Traceback" not in captured.out + captured.err, where
    assert rc in (0, 1, 2), where
    if ok is not None:
        assert (rc in (0, 1)) == ok or command == "check", where
    if rc == 2:
        assert captured.err.startswith("mdi-trace: ") and captured.err.count("\n") == 1, where
        assert captured.err.rstrip("\n").endswith("."), where
    return rc, captured.err


# ---- (a) cut at every byte --------------------------------------------------------------------------------------
def test_a_log_cut_at_any_byte_is_read_up_to_the_cut_or_refused_in_one_sentence(clean, layout, tmp_path, capsys):
    """Cut inside the header: exit 2, "ends inside its header". Cut anywhere after it: readable, exit 0 or 1, and
    `info` and `verify` say it was cut; the whole log: exit 0, no note."""
    starts, body, size = layout["starts"], layout["body"], layout["size"]
    info_at = set(range(1, body + 2)) | set(range(size - 12, size + 1)) | {s + d for s in starts for d in (0, 1)}
    path = tmp_path / "cut.mdt"
    for n in range(1, size + 1):
        path.write_bytes(clean[:n])
        ok = n >= body
        commands = ["verify"] + ["info"] * (n in info_at) + ["export"] * (n % 5 == 0) + ["check"] * (n % 23 == 0)
        for command in commands:
            rc, err = run(command, path, capsys, ok)
            if not ok:
                assert "inside its header" in err or "empty" in err, err
    for command in COMMANDS:  # the whole log
        path.write_bytes(clean)
        assert run(command, path, capsys, True)[0] == 0


def test_info_and_verify_say_where_a_log_was_cut(clean, layout, tmp_path, capsys):
    path = tmp_path / "cut.mdt"
    path.write_bytes(clean[:layout["starts"][10] + 3])
    assert cli.main(["verify", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"the log was cut short: 10 complete events, the last ending at byte {layout['starts'][10]}" in out
    assert cli.main(["info", str(path)]) == 0
    assert "the log was cut short: 10 complete events" in " ".join(capsys.readouterr().out.split())


# ---- (b) random bytes overwritten --------------------------------------------------------------------------------
def test_random_damage_is_read_or_refused_in_one_sentence(clean, layout, tmp_path, capsys):
    """300 variants, seeded: 1 to 4 bytes overwritten, in a third of the variants anywhere, in the others after
    the header (where a flip reaches the events' checks rather than the header's)."""
    rng = random.Random(17)
    path = tmp_path / "damaged.mdt"
    body = layout["body"]
    refused = 0
    for i in range(300):
        log = bytearray(clean)
        lo = body if i % 3 else 0
        for _ in range(rng.randint(1, 4)):
            log[rng.randrange(lo, len(log))] = rng.randrange(256)
        path.write_bytes(bytes(log))
        ok = readable(path)
        refused += not ok
        for command in ["verify", "export"] + ["info"] * (i % 3 == 0) + ["check"] * (i % 10 == 0):
            # readable: verify reports what is wrong as findings; the others may refuse what they cannot use (an
            # enum index out of range, a row of the wrong shape: the consumers' to check) in one sentence
            run(command, path, capsys, ok if command == "verify" or not ok else None)
    assert 0 < refused < 300  # both kinds of variant occur


# ---- (c) hostile headers and length claims -----------------------------------------------------------------------
def split_log(data: bytes) -> tuple[dict, bytes, list]:
    """(header, the events' bytes, footer fields) of a clean log."""
    u = msgpack.Unpacker(raw=False, strict_map_key=False)
    u.feed(data)
    header = u.unpack()
    body = u.tell()
    footer_offset = int.from_bytes(data[-8:], "big")
    footer = msgpack.unpackb(data[footer_offset:-9], raw=False, strict_map_key=False)
    return header, data[body:footer_offset], footer[1:]


def with_header(data: bytes, **changes) -> bytes:
    """The log with its header's fields changed (None: removed), its footer's step offsets and trailer moved to
    match: a clean log whose framing is intact."""
    header, events, (counts, num_steps, step_offsets, done) = split_log(data)
    header = {**header, **changes}
    header = {k: v for k, v in header.items() if v is not None or k in ("triton", "run_id")}
    head = msgpack.packb(header, use_bin_type=True)
    shift = len(head) + len(events) - int.from_bytes(data[-8:], "big")
    footer = msgpack.packb([KIND["footer"], counts, num_steps, [[s, o + shift] for s, o in step_offsets], done])
    return head + events + footer + bytes([TRAILER_TAG]) + (len(head) + len(events)).to_bytes(8, "big")


def test_with_header_keeps_a_log_clean(clean, tmp_path, capsys):
    path = tmp_path / "same.mdt"
    path.write_bytes(with_header(clean, argv=["a", "much", "longer", "command", "line"]))
    with TraceFile(path) as tf:
        assert tf.clean and tf.header["argv"][1] == "much"
    for command in COMMANDS:
        assert run(command, path, capsys, True)[0] == 0


HOSTILE_HEADERS = {
    "engine a list": ({"engine": [8, 512]}, "engine is a list, not a map"),
    "engine a string": ({"engine": "max_num_seqs 8"}, "engine is a str, not a map"),
    "engine's num_kv_blocks a string": ({"engine": {"num_kv_blocks": "2"}}, "engine's num_kv_blocks is a str"),
    "engine's block_size a float": ({"engine": {"block_size": 128.0}}, "engine's block_size is a float"),
    "engine's max_num_seqs a list": ({"engine": {"max_num_seqs": [64]}}, "engine's max_num_seqs is a list"),
    "a pool of -5 KV blocks": ({"engine": {"num_kv_blocks": -5}}, "engine's num_kv_blocks is -5, not at least 0"),
    "max_num_seqs 0": ({"engine": {"max_num_seqs": 0}}, "engine's max_num_seqs is 0, not at least 1"),
    "argv an int": ({"argv": 7}, "argv is an int, not a list"),
    "argv holding an int": ({"argv": ["mdi-trace", 7]}, "argv[1] is an int, not a str"),
    "model a string": ({"model": "micro"}, "model is a str, not a map"),
    "platform a list": ({"platform": ["cpu"]}, "platform is a list, not a map"),
    "platform's isa_overrides a list": ({"platform": {"isa_overrides": ["MKL_CBWR"]}}, "isa_overrides is a list"),
    "world_size a string": ({"world_size": "1"}, "world_size is a str, not an int"),
    "world_size 0": ({"world_size": 0}, "world_size is 0, not at least 1"),
    "rank beyond world_size": ({"rank": 3}, "rank is 3, not between 0 and world_size - 1"),
    "t0_ns a string": ({"t0_ns": "0"}, "t0_ns is a str, not an int"),
    "intra_op_threads negative": ({"intra_op_threads": -2}, "intra_op_threads is -2, not at least 1"),
    "checkpoint_digest an int": ({"checkpoint_digest": 12}, "checkpoint_digest is an int, not a str"),
    "schema_version true": ({"schema_version": True}, "schema_version is a bool, not an int"),
    "schema_version 1.0": ({"schema_version": 1.0}, "schema_version is a float, not an int"),
    "schema_version 4": ({"schema_version": 4}, "schema version 4"),
    "no magic": ({"magic": None}, "wrong magic"),
}


@pytest.mark.parametrize("name", HOSTILE_HEADERS)
def test_a_hostile_header_is_one_sentence_from_every_command(clean, tmp_path, capsys, name):
    changes, words = HOSTILE_HEADERS[name]
    path = tmp_path / "hostile.mdt"
    path.write_bytes(with_header(clean, **{k: v for k, v in changes.items()}))
    for command in COMMANDS:
        rc, err = run(command, path, capsys, False)
        assert words in err, (command, err)


def test_odd_but_well_typed_header_values_never_traceback(clean, tmp_path, capsys):
    """Values of the right type that no engine writes (an empty engine config, zero or huge pools, another
    block size, a huge world size named by a single file): a finding, a refusal or a result, never a traceback."""
    path = tmp_path / "odd.mdt"
    engine = split_log(clean)[0]["engine"]
    for changes in ({"engine": {}}, {"engine": {**engine, "num_kv_blocks": 0}},
                    {"engine": {**engine, "num_kv_blocks": -5, "num_state_slots": -1}},
                    {"engine": {**engine, "max_num_seqs": 2**62}}, {"engine": {**engine, "block_size": 16}},
                    {"model": {}, "platform": {}}, {"world_size": 2**40, "rank": 0}, {"run_id": None},
                    {"argv": []}, {"t0_ns": -1}):
        path.write_bytes(with_header(clean, **changes))
        for command in COMMANDS:
            run(command, path, capsys, None)


# (bytes put where an event starts, how far into them the byte the error names is): length claims beyond
# reader.LIMITS, with the file ending before the bytes claimed
CLAIMS = {
    "a 4 GiB str in an event": (b"\x95\x0a\xdb\xff\xff\xff\xff", 2),
    "a 4 GiB bin": (b"\xc6\xff\xff\xff\xff", 0),
    "a 2**32-element array": (b"\xdd\xff\xff\xff\xff", 0),
    "a 2**32-entry map in an event": (b"\x92\x0a\xdf\xff\xff\xff\xff", 0),
    "an ext object": (b"\xc7\x10\x05", 0),
    "2**22-element arrays nested 5 deep": (b"\xdd\x00\x3f\xff\xff" * 5, 0),
}


@pytest.mark.parametrize("name", CLAIMS)
@pytest.mark.parametrize("where", ["at the end of a cut log", "in the middle of a clean log"])
def test_a_length_claim_beyond_the_limits_is_damage_not_a_cut(clean, layout, tmp_path, capsys, name, where):
    at, (claim, into) = layout["starts"][5], CLAIMS[name]
    path = tmp_path / "claims.mdt"
    path.write_bytes(clean[:at] + claim + (clean[at:] if "middle" in where else b""))
    for command in COMMANDS:
        rc, err = run(command, path, capsys, False)
        assert f"damaged at byte {at + into}" in err and "cut short" not in err, err


@pytest.mark.parametrize("field, value", [("time", b"\xdb\xff\xff\xff\xff"), ("argv", b"\xdd\xff\xff\xff\xff"),
                                          ("model", b"\xdf\xff\xff\xff\xff")])
def test_a_length_claim_beyond_the_limits_in_the_header_is_one_sentence(tmp_path, capsys, field, value):
    head = b"\x83\xa5magic\xa9mdi-trace\xaeschema_version\x01" + msgpack.packb(field) + value
    path = tmp_path / "claims.mdt"
    path.write_bytes(head)
    for command in COMMANDS:
        rc, err = run(command, path, capsys, False)
        assert "header" in err or "damaged at byte" in err, err
        assert "cut short" not in err, err


def test_export_names_the_byte_of_a_well_typed_but_malformed_event(clean, layout, tmp_path, capsys):
    """A schedule event whose rows are lists of the wrong length passes the reader's top-level type checks, not its
    records' (a row is an array of the row's fields): export names the event's byte."""
    path = tmp_path / "rows.mdt"
    starts = layout["starts"]
    for a, b in zip(starts, starts[1:]):
        event = msgpack.unpackb(clean[a:b])
        if event[0] == KIND["schedule"]:
            event[4] = [[1]]
            path.write_bytes(clean[:a] + msgpack.packb(event) + clean[b:])
            break
    rc, err = run("export", path, capsys, None)
    assert rc == 2 and f"damaged at byte {a}: a malformed schedule event" in err, err
