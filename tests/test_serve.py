"""`mdi-trace serve` with the real `openai` client (issue #19 items 1 and 5): a server on 127.0.0.1 (micro, CPU)
in a subprocess, as a user starts it; streaming and non-streaming completions and chat completions; 32 concurrent
clients, a quarter of them disconnecting mid-stream, arriving while others decode; the OpenAI API's errors; then
SIGTERM (drain) or SIGINT (--on-shutdown cancel): exit 0, and the recorded trace verifies and re-executes clean,
with no request left unfinished and every disconnect recorded as a cancel of cause "disconnect"."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tracing.reader import TraceFile  # noqa: E402
from tracing.schema import CANCEL_CAUSES, FINISH_REASONS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "micro"


class Served:
    """A `mdi-trace serve` subprocess: `url`, `client()`, `stop(sig)` -> (exit code, stdout, stderr)."""

    def __init__(self, tmp: Path, *options: str):
        self.trace, self.prompts = tmp / "served.mdt", tmp / "received.jsonl"
        argv = [sys.executable, "-m", "tui.cli", "serve", "--model", MODEL, "--port", "0", "-o", str(self.trace),
                "--prompts-out", str(self.prompts), "--max-num-seqs", "16", *options]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()
        if " on http://" not in line:
            self.proc.kill()
            raise AssertionError(f"serve did not start: {line!r} {self.proc.stderr.read()!r}")
        self.banner = line
        self.url = line.split(" on ", 1)[1].split(" ", 1)[0]

    def client(self, cls=None):
        return (cls or openai.OpenAI)(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err


def cli(*argv: str, capsys) -> tuple[int, str, str]:
    """`mdi-trace ARGV` in this process (as tests/test_fuzz.py runs it): exit code, stdout, stderr."""
    from tui.cli import main
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def health(served) -> dict:
    import urllib.request
    return json.loads(urllib.request.urlopen(f"{served.url}/health").read())


def events(path: Path) -> list:
    with TraceFile(path) as tf:
        assert tf.clean, "the trace has its footer"
        return list(tf.events())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module's tests; stopped (SIGTERM) by the last one."""
    s = Served(tmp_path_factory.mktemp("serve"))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def test_a_completion_and_a_chat_completion_whole_and_streamed(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body={
        "ignore_eos": True})
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (5, 5)   # the byte tokenizer: 5 bytes
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
    assert len({ch.id for ch in chunks}) == 1
    deltas = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    assert deltas[0].choices[0].delta.role == "assistant" and deltas[-1].choices[0].finish_reason == "length"


def test_errors_are_the_openai_apis(served):
    client = served.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_model_len") as e:  # a prompt over the context
        client.completions.create(model=MODEL, prompt=[5] * 4000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="not in the model's vocabulary"):
        client.completions.create(model=MODEL, prompt=[5, 10 ** 9], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{served.url}/v1/completions", data=b"{not json"))
    assert e.value.code == 400 and "not valid JSON" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{served.url}/v2/nothing")
    assert e.value.code == 404
    assert health(served)["status"] == "ok"


def test_32_clients_a_quarter_disconnecting_then_sigterm_drains_and_the_trace_is_clean(served, capsys):
    """Clients arrive over ~1 s while earlier ones decode; every fourth breaks off after its second chunk (the
    connection closed mid-stream). Then SIGTERM: serve drains and exits 0; the trace verifies and re-executes
    to identical tokens, every request finished, and the disconnects are exactly the cancellations."""
    async def one(i: int, client) -> tuple[str, int]:
        await asyncio.sleep(0.03 * i)
        leaves = i % 4 == 3
        stream = await client.completions.create(model=MODEL, prompt=[5 + i, 6, 7, 8], stream=True,
                                                 max_tokens=400 if leaves else 6, temperature=1.0, seed=i,
                                                 extra_body={"ignore_eos": True})
        got = 0
        async for chunk in stream:
            got += 1
            if leaves and got == 2:
                await stream.close()
                return "left", got
        return chunk.choices[0].finish_reason, got

    async def clients():
        async with served.client(openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(i, client) for i in range(32)))

    results = asyncio.run(clients())
    assert Counter(r for r, _ in results) == {"length": 24, "left": 8}
    deadline = time.time() + 30  # the disconnects are cancelled between two steps, long before 400 tokens
    while (left := health(served)["unfinished_requests"]) and time.time() < deadline:
        time.sleep(0.1)
    assert left == 0, "the clients that went away were cancelled while the server ran"
    code, out, err = served.stop(signal.SIGTERM)
    assert code == 0 and "Traceback" not in err and "stopped; the trace is in" in out, (code, out, err)
    evs = events(served.trace)
    added = {e.seq_id for e in evs if e.kind == "request_added"}
    finished = {e.seq_id: FINISH_REASONS[e.reason] for e in evs if e.kind == "finish"}
    cancels = [CANCEL_CAUSES[e.cause] for e in evs if e.kind == "cancel"]
    assert added == set(finished), "no request is left in the engine"
    assert cancels == ["disconnect"] * 8 and Counter(finished.values())["abort"] == 8
    assert all(e.arrival <= e.t for e in evs if e.kind == "request_added")
    first_decode = min(e.t for e in evs if e.kind == "schedule" and e.batch_kind == 1)
    assert sum(e.t > first_decode for e in evs if e.kind == "request_added") > 8, "requests came while others decoded"
    from tracing.workload import read_prompts   # what `record --prompts` replays: every request, in arrival order
    replay = read_prompts(served.prompts)
    recorded = sorted((e.arrival, e.prompt_token_ids, e.max_tokens, e.seed) for e in evs if e.kind == "request_added")
    assert [(p.prompt, p.max_tokens) for p in replay] == [r[1:3] for r in recorded] and len(replay) >= 32
    assert all(p.seed in (None, r[3]) for p, r in zip(replay, recorded))  # None: derived from the engine's seed
    assert [p.arrival for p in replay] == sorted(p.arrival for p in replay)
    code, out, err = cli("verify", str(served.trace), capsys=capsys)
    assert code == 0 and "no findings" in out, out + err
    code, out, err = cli("check", str(served.trace), capsys=capsys)
    assert code == 0 and "identical" in out, out + err


def test_sigint_with_on_shutdown_cancel_cancels_what_runs_and_exits_0(tmp_path, capsys):
    s = Served(tmp_path, "--on-shutdown", "cancel")
    client = s.client()
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    code, out, err = s.stop(signal.SIGINT)
    rest = list(stream)
    assert code == 0 and "Traceback" not in err, (code, out, err)
    assert rest and rest[-1].choices[0].finish_reason == "abort"
    evs = events(s.trace)
    assert [CANCEL_CAUSES[e.cause] for e in evs if e.kind == "cancel"] == ["shutdown"]
    assert cli("verify", str(s.trace), capsys=capsys)[0] == 0


def test_bad_options_are_one_sentence(tmp_path, capsys):
    (tmp_path / "x.mdt").write_bytes(b"keep")
    for argv, words in ((["--port", "70000"], "a port number"),
                        (["-o", str(tmp_path / "x.mdt")], "exists; give another -o"),
                        (["--model", "nosuch"], "neither a preset nor a folder")):
        try:
            code, _, err = cli("serve", *argv, capsys=capsys)
        except SystemExit as e:  # argparse's own exit, with its one sentence
            code, err = e.code, capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err
    assert (tmp_path / "x.mdt").read_bytes() == b"keep"
