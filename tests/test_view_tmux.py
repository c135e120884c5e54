"""The real `mdi-trace view` in a real terminal (tmux): it starts, draws the overview, answers keys, quits on
`q` with exit 0; a damaged log ends it with one sentence and exit 2, never a traceback."""
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "traces/examples/micro-preempt-cancel.mdt"
MDI = str(Path(sys.executable).with_name("mdi-trace"))

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not os.path.exists(MDI),
                                reason="needs tmux and the mdi-trace script")


class Tmux:
    """One detached tmux session running a command, then printing its exit code and waiting."""

    def __init__(self, command: str, width: int = 100, height: int = 30):
        self.name = f"mdi-view-{uuid.uuid4().hex[:8]}"
        script = f"cd {ROOT} && {command}; echo EXIT=$?; sleep 60"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height),
                        "bash", "-c", script], check=True, env={**os.environ, "TERM": "xterm-256color"})

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True,
                              text=True).stdout

    def keys(self, *keys: str) -> None:
        for k in keys:
            subprocess.run(["tmux", "send-keys", "-t", self.name, k], check=True)
            time.sleep(0.2)

    def wait_for(self, *words: str, timeout: float = 30) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.screen()
            if all(w in text for w in words):
                return text
            time.sleep(0.2)
        raise AssertionError(f"never saw {words} on the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_view_in_a_terminal_draws_answers_keys_and_quits():
    t = Tmux(f"{MDI} view {EXAMPLE} --no-verify")
    try:
        t.wait_for("1 Overview", "176 (24 prefill, 152 decode)", "Quit")
        t.keys("3")
        t.wait_for("block_table", "step 0: prefill")
        t.keys(".", ".")
        t.wait_for("step 2: prefill, 3 rows, 512 tokens")
        t.keys("2")
        t.wait_for("schedule", "execute", "process", "device", "overlap", "idle", "Zoom in")
        t.keys("q")
        t.wait_for("EXIT=0")
    finally:
        t.close()


def test_view_of_a_damaged_log_says_so_in_one_sentence(tmp_path):
    data = bytearray((ROOT / EXAMPLE).read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xc1" * 64
    bad = tmp_path / "bad.mdt"
    bad.write_bytes(bytes(data))
    t = Tmux(f"{MDI} view {bad} --no-verify")
    try:
        text = t.wait_for("EXIT=2")
        assert f"mdi-trace: {bad} is damaged at byte" in text.replace("\n", "")
        assert "Traceback" not in text
    finally:
        t.close()
