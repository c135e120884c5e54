"""benchmarks/reading_path.py: the reading path is measured in code lines (no blanks, comments or docstrings),
every module of engine/, model/ and kernels/ is placed on it or off it with a reason, and it stays within the
budget of about 2,000 code lines (issue #18; at most reading_path.CEILING)."""
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import reading_path  # noqa: E402


def test_code_lines_skip_blanks_comments_and_docstrings(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""A module docstring\nover two lines."""\n\n# a comment\nimport os  # trailing\n\n\n'
                      'def f(x):\n    """One line."""\n    y = (x +\n         1)\n    return y\n')
    assert reading_path.code_lines(source) == 5  # import, def, the two lines of y, return


def test_every_module_is_placed_and_the_path_is_within_budget(capsys):
    assert reading_path.unlisted() == []
    assert not set(reading_path.ON_PATH) & set(reading_path.OFF_PATH)
    assert reading_path.main() == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total"))
    assert int(total.split()[1]) <= reading_path.CEILING
