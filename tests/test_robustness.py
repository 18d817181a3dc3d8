"""Runs that survive bad input: a reward_fn that raises or hangs scores 0 and training goes on; a model that
cannot be split over --tp is refused before any weights load."""
import multiprocessing
import os
import shutil
import time

import pytest
from transformers import Qwen2Config

import reward
import train
from test_train import metrics, torchrun

BAD_REWARD = '''

_reward_fn = reward_fn


def reward_fn(completion, sample):
    """Raises on some completions, hangs on others (in Python, and where SIGALRM cannot reach), scores the rest."""
    import signal, time
    if "b" in completion:
        raise RuntimeError("a bug in the user's reward")
    if "c" in completion:
        while True:
            time.sleep(1)
    if "d" in completion and sample.get("stuck", True):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like C code that never checks signals
        time.sleep(60)
    return _reward_fn(completion, sample)
'''


@pytest.fixture
def bad_reward(monkeypatch):
    namespace = {"reward_fn": reward.reward_fn}
    exec(BAD_REWARD, namespace)
    monkeypatch.setattr(reward, "reward_fn", namespace["reward_fn"])  # the workers fork with it


def test_raising_and_hanging_rewards_score_zero_and_the_rest_score_normally(bad_reward):
    texts = ["aaaa", "abab", "aaaa", "acac", "adad", "aaxx"]
    items = [{"task": "toy", "target": "a"}] * 6
    workers = reward.RewardWorkers(2, timeout=0.5)
    start = time.perf_counter()
    try:
        rewards, errors = workers.score(texts, items)
    finally:
        seconds = time.perf_counter() - start
        workers.close()
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    assert len(errors) == 3
    assert "a bug in the user's reward" in errors[0] and "TimeoutError" in errors[1]
    assert "did not return" in errors[2]  # unreachable by SIGALRM: given up at the batch's deadline
    assert seconds < 0.5 * 3 + 5 + 2  # the deadline: timeout x (samples / workers) + 5 s
    children = multiprocessing.active_children()
    assert not children, children


def test_a_failing_reward_fn_does_not_stop_training(tmp_path):
    """The whole loop with a reward.py whose reward_fn raises and hangs on some completions."""
    # Only the hang that SIGALRM cuts off here: the other costs the whole batch deadline (tested above).
    for name in ("train.py", "reward.py"):
        shutil.copy(os.path.join(os.path.dirname(os.path.dirname(__file__)), name), tmp_path / name)
    with open(tmp_path / "reward.py", "a") as f:
        f.write(BAD_REWARD.replace('sample.get("stuck", True)', "False"))
    out = tmp_path / "out"
    run = torchrun(2, "--preset", "cpu", "--steps", "3", "--reward_timeout", "0.2", "--eval_every", "0",
                   "--out_dir", str(out), cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(out)
    assert len(rows) == 3 and sum(r["reward_errors"] for r in rows) > 0
    assert run.stdout.count("reward_fn failed") == 1  # the first traceback, shown once
    assert "a bug in the user's reward" in run.stdout or "TimeoutError" in run.stdout


def test_heads_that_do_not_divide_by_tp_are_refused_before_loading(tmp_path):
    tokenizer = train.char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), **train.TINY_MODEL)
    config.num_attention_heads, config.num_key_value_heads = 6, 3  # 3 KV heads cannot be split in two
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    run = torchrun(2, "--preset", "cpu", "--model", str(tmp_path), "--tp", "2", "--out_dir", str(tmp_path / "out"))
    assert run.returncode != 0
    assert "--tp 2 must divide the model's num_key_value_heads (3)" in run.stderr + run.stdout
    assert "Loading weights" not in run.stderr + run.stdout
