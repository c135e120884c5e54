"""The mdi-trace command line as a user runs it: exit codes and one-sentence errors, no tracebacks."""
import subprocess
import sys

from model.load import load_model


def mdi(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, env=env)


def test_checkpoint_init_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    run = mdi("checkpoint", "init", "--preset", "micro", "--seed", "3", "-o", str(out))
    assert run.returncode == 0, run.stderr
    model, digest = load_model(str(out))
    assert digest in run.stdout and model.args.vocab_size == 1024
    again = mdi("checkpoint", "init", "--preset", "micro", "--seed", "3", "-o", str(tmp_path / "again"))
    assert digest in again.stdout  # same seed, same weights


def test_generate_runs_on_a_checkpoint_folder(tmp_path):
    mdi("checkpoint", "init", "--preset", "micro", "-o", str(tmp_path / "c"))
    run = mdi("generate", "--model", str(tmp_path / "c"), "--num-prompts", "2", "--prompt-len", "40",
              "--max-tokens", "3")
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout


def test_bad_input_is_one_sentence_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    for args in (["generate", "--model", str(tmp_path / "missing")],
                 ["generate", "--model", str(tmp_path / "empty")],
                 ["checkpoint", "init", "--preset", "huge", "-o", str(tmp_path / "x")],
                 ["generate", "--model", "micro", "--max-tokens", "0"]):
        run = mdi(*args)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr and run.stderr.startswith("mdi-trace: ")
        assert len(run.stderr.strip().splitlines()) == 1
