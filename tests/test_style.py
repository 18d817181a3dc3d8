"""Every Python file of the project is formatted by ruff and passes its lint rules (pyproject.toml), and train.py
stays a file a researcher reads: under 1,000 lines and at most 10 tokens per code line."""

import io
import os
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_every_python_file_is_formatted_by_ruff():
    run = ruff("format", "--check", ".")
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_python_file_passes_ruffs_lint_rules():
    run = ruff("check", ".")
    assert run.returncode == 0, run.stdout + run.stderr


def tokens_per_code_line(path):
    """As ../shared/tools/density.py counts: tokens other than comments and layout, over the lines that hold them."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    with open(path) as f:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(f.read()).readline) if t.type not in skip]
    lines = set()
    for token in tokens:
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(tokens) / len(lines)


def test_train_py_stays_under_1000_lines_at_most_10_tokens_a_line():
    path = os.path.join(ROOT, "train.py")
    with open(path) as f:
        assert len(f.readlines()) < 1000
    assert tokens_per_code_line(path) <= 10
