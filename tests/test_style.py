"""Every Python file of the project is formatted by ruff and passes its lint rules (pyproject.toml), train.py stays a
file a researcher reads (under 1,000 lines, at most 9.5 tokens per code line) and reward.py the task alone (under 500
lines): limits a new feature meets by moving machinery out, not by squeezing."""

import dataclasses
import io
import os
import re
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


def test_train_py_stays_under_1000_lines_at_9_5_tokens_a_line_and_reward_py_under_500_lines():
    with open(os.path.join(ROOT, "train.py")) as f:
        assert len(f.readlines()) < 1000
    assert tokens_per_code_line(os.path.join(ROOT, "train.py")) <= 9.5
    with open(os.path.join(ROOT, "reward.py")) as f:
        assert len(f.readlines()) <= 500


def documented_defaults():
    """{flag: the default docs/flags.md gives it}: a row names its flags (`--a` or `--a` / `--b`) in its first cell
    and their defaults in the second, in the same order; a single flag's cell may say more (`sglang` on CUDA, else
    `hf`), and an empty cell is the empty string."""
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        rows = [line.split("|")[1:3] for line in f if line.startswith("| `--")]
    documented = {}
    for names, defaults in rows:
        flags = re.findall(r"`--(\w+)`", names)
        values = re.findall(r"`([^`]*)`", defaults) or [""]
        if len(flags) == 1:
            documented[flags[0]] = values
        else:
            assert len(values) == len(flags), (names, defaults)
            documented.update((flag, [value]) for flag, value in zip(flags, values))
    return documented


def shows(value, default):
    """Whether docs/flags.md's `value` is the default: true / false, a number equal to it, or the string itself."""
    if isinstance(default, bool):
        return value == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(value) == default
        except ValueError:
            return False
    return value == default


def test_docs_flags_md_lists_every_flag_of_config_with_its_default():
    import train

    documented = documented_defaults()
    for field in dataclasses.fields(train.Config):
        assert field.name in documented, f"--{field.name} is not in docs/flags.md"
        values = documented[field.name]
        assert any(shows(value, field.default) for value in values), (field.name, values, field.default)
    assert documented.keys() <= {field.name for field in dataclasses.fields(train.Config)}  # no flag that went
