"""Runs that survive bad input: a reward_fn that raises or hangs scores 0 and training goes on; a model that
cannot be split over --tp is refused before any weights load."""

import glob
import json
import multiprocessing
import os
import shutil
import signal
import time

import pytest

import reward
import sandbox
import stopping
import task_data
from demo_model import demo_config, demo_tokenizer
from test_train import torchrun

BAD_REWARD = '''

_reward_fn = reward_fn


def reward_fn(completion, item, args=None):
    """Raises on some completions, hangs on others (in Python, and where SIGALRM cannot reach), returns what is not
    a number, ends its process, starts a process of its own, and scores the rest."""
    import os, signal, subprocess, time
    if "n" in completion:
        return float("nan")
    if "o" in completion:
        return None
    if "e" in completion:
        os._exit(3)
    if "g" in completion:  # a process of its own, then stuck
        with open(item["pid_file"], "w") as f:
            f.write(str(subprocess.Popen(["sleep", "60"]).pid))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if "b" in completion:
        raise RuntimeError("a bug in the user's reward")
    if "c" in completion:
        while True:
            time.sleep(1)
    if "d" in completion and item.get("stuck", True):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like C code that never checks signals
        time.sleep(60)
    return _reward_fn(completion, item)
'''


@pytest.fixture
def bad_reward(monkeypatch):
    # As if defined in reward.py: a call names reward_fn by its module and name, which a worker (forked with the
    # patch) looks up; without a module, pickle would search every loaded module for it.
    namespace = {"__name__": reward.__name__, "reward_fn": reward.reward_fn}
    exec(BAD_REWARD, namespace)
    monkeypatch.setattr(reward, "reward_fn", namespace["reward_fn"])  # the workers fork with it


def score_timed(workers, texts, items):
    start = time.perf_counter()
    rewards, errors = workers.score(texts, items)
    return rewards, errors, time.perf_counter() - start


def test_raising_and_hanging_rewards_score_zero_and_the_rest_score_normally(bad_reward):
    texts = ["aaaa", "abab", "aaaa", "acac", "adad", "aaxx"]
    items = [{"task": "toy", "target": "a"}] * 6
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=0.5)
    try:
        rewards, errors, seconds = score_timed(workers, texts, items)
    finally:
        workers.close()
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    assert len(errors) == 3
    assert "a bug in the user's reward" in errors[0] and "TimeoutError" in errors[1]
    assert "did not answer within 1.5 s (stuck where SIGALRM cannot reach" in errors[2]
    assert "the worker replaced" in errors[2]
    assert seconds < 0.5 + 1.0 + 0.5 + 1.5  # the stuck call's timeout and second of grace, beside a 0.5 s timeout
    children = multiprocessing.active_children()
    assert not children, children


def test_stuck_workers_are_replaced_so_later_batches_score_normally(bad_reward):
    """Every worker stuck where SIGALRM cannot reach: each is killed and replaced a second past the timeout."""
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=0.5)
    item = {"task": "toy", "target": "a"}
    try:
        first = score_timed(workers, ["adad", "adda", "aaaa"], [item] * 3)
        second = score_timed(workers, ["aaaa", "aaxx", "aaaa", "xxxx"], [item] * 4)
    finally:
        workers.close()
    assert first[0] == [0.0, 0.0, 1.0] and len(first[1]) == 2 and first[2] < 0.5 + 1.0 + 1.5
    assert second[:2] == ([1.0, 0.5, 1.0, 0.0], []) and second[2] < 1.0


def test_a_worker_that_dies_is_replaced_at_once_and_the_others_still_score(bad_reward):
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
    item = {"task": "toy", "target": "a"}
    try:
        rewards, errors, seconds = score_timed(workers, ["aeae", "aaaa", "aaxx", "eeee"], [item] * 4)
        again = workers.score(["aaaa"] * 3, [item] * 3)
    finally:
        workers.close()
    assert rewards == [0.0, 1.0, 0.5, 0.0] and seconds < 2.0  # no wait for the 5 s timeout
    assert len(errors) == 2 and all("reward_fn worker died (exit code 3)" in e for e in errors)
    assert again == ([1.0] * 3, [])


def test_a_stopped_worker_is_killed_at_its_calls_deadline_and_replaced():
    """A worker stopped by SIGSTOP is alive and reads nothing: a call larger than every pipe and socket buffer could
    not even be sent to it. The exchange ends at the call's deadline, the sample scores 0 with the reason counted, the
    others score, and its replacement scores the next batch."""

    def give_up(signum, frame):
        raise TimeoutError("the batch still waits on the stopped worker")

    previous = signal.signal(signal.SIGALRM, give_up)
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=0.5)
    item = {"task": "toy", "target": "a"}
    try:
        os.kill(workers.workers[0][0].pid, signal.SIGSTOP)  # the first call, of 4 MB, goes to worker 0
        signal.setitimer(signal.ITIMER_REAL, 10)
        rewards, errors, seconds = score_timed(workers, ["a" * (4 << 20), "aaxx", "aaaa"], [item] * 3)
        signal.setitimer(signal.ITIMER_REAL, 0)
        again = workers.score(["aaaa"] * 2, [item] * 2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        workers.close()
    assert rewards == [0.0, 0.5, 1.0] and seconds < 0.5 + 1.0 + 1.0
    assert len(errors) == 1 and "did not answer within 1.5 s" in errors[0] and "(exit code -9)" in errors[0]
    assert again == ([1.0, 1.0], [])


def test_a_reward_that_is_not_a_finite_number_is_a_failed_call(bad_reward):
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    try:
        rewards, errors = workers.score(["anan", "aoao", "aaaa"], [{"task": "toy", "target": "a"}] * 3)
    finally:
        workers.close()
    assert rewards == [0.0, 0.0, 1.0]
    assert "reward_fn returned nan, not a finite number" in errors[0]
    assert "reward_fn returned None, not a finite number" in errors[1] and len(errors) == 2


TERMS_REWARD = '''

_reward_fn = reward_fn


def reward_fn(completion, item, args=None):
    """Named terms, and on some completions a hostile return: a NaN or a string for a term, a term missing, an
    unknown one, a number or a list instead of a dict, a call that raises."""
    correct = _reward_fn(completion, item)
    terms = {"correct": correct, "format": 0.5}
    if "n" in completion:
        terms["format"] = float("nan")
    if "s" in completion:
        terms["correct"] = "1.0"
    if "m" in completion:
        del terms["format"]
    if "u" in completion:
        terms["style"] = 1.0
    if "f" in completion:
        return 0.25
    if "l" in completion:
        return [correct, 0.5]
    if "b" in completion:
        raise RuntimeError("a bug in the user's reward")
    return terms
'''


@pytest.fixture
def terms_reward(monkeypatch):
    namespace = {"__name__": reward.__name__, "reward_fn": reward.reward_fn}
    exec(TERMS_REWARD, namespace)
    monkeypatch.setattr(reward, "reward_fn", namespace["reward_fn"])


def test_reward_terms_are_scored_by_name_and_a_hostile_term_scores_zero_and_is_counted(terms_reward):
    """Each completion gets a dict of the run's terms. A term that is NaN, not a number or missing scores 0 and the
    rest of its dict counts; an unknown term is left out; a return that is no dict, or a call that fails, scores 0
    for every term. Each such completion is one error naming what was wrong."""
    texts = ["aaaa", "anan", "asas", "amam", "auau", "afaf", "alal", "abab"]
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0, terms=("correct", "format"))
    try:
        scores, errors = workers.score(texts, [{"task": "toy", "target": "a"}] * len(texts))
    finally:
        workers.close()
    assert scores == [
        {"correct": 1.0, "format": 0.5},
        {"correct": 0.5, "format": 0.0},
        {"correct": 0.0, "format": 0.5},
        {"correct": 0.5, "format": 0.0},
        {"correct": 0.5, "format": 0.5},
        {"correct": 0.0, "format": 0.0},
        {"correct": 0.0, "format": 0.0},
        {"correct": 0.0, "format": 0.0},
    ]
    assert [list(s) for s in scores] == [["correct", "format"]] * len(texts)  # the run's order, on every sample
    assert len(errors) == 7
    assert "term 'format' is nan, not a finite number" in errors[0]
    assert "term 'correct' is '1.0', not a finite number" in errors[1]
    assert "no term 'format'" in errors[2]
    assert "terms 'style' that no item returned at start (left out)" in errors[3]
    assert "reward_fn returned 0.25, not a dict of its terms ['correct', 'format']" in errors[4]
    assert "not a dict of its terms" in errors[5] and "a bug in the user's reward" in errors[6]


def test_the_run_takes_its_reward_terms_from_what_reward_fn_returns_on_the_items(terms_reward, monkeypatch):
    """check_items, before any model loads: the names of the terms reward_fn returns, in their order; () for a
    reward_fn that returns a number; a reward_fn that returns a number for some items and a dict for others, or a
    term whose name is not a string, stops the run in one line."""
    items = [{"prompt": "Say a:", "task": "toy", "target": t} for t in "abc"]
    assert task_data.check_items(items, "train", reward.reward_fn) == ("correct", "format")
    monkeypatch.setattr(reward, "reward_fn", lambda completion, item, args=None: 0.0)
    assert task_data.check_items(items, "train", reward.reward_fn) == ()
    monkeypatch.setattr(
        reward, "reward_fn", lambda completion, item, args=None: {"c": 1.0} if item["target"] == "a" else 1.0
    )
    with pytest.raises(SystemExit, match="a dict of terms \\('c', ...\\) for some train items and a number for others"):
        task_data.check_items(items, "train", reward.reward_fn)
    monkeypatch.setattr(reward, "reward_fn", lambda completion, item, args=None: {"c": 1.0, 2: 0.5})
    with pytest.raises(SystemExit, match="reward_fn returns a term named 2: name each term with a string"):
        task_data.check_items(items, "train", reward.reward_fn)
    monkeypatch.setattr(
        reward, "reward_fn", lambda completion, item, args=None: {"c/std": 1.0}
    )  # its std's key is c/std's
    with pytest.raises(SystemExit, match="a term named 'c/std': name each term with a string, no /"):
        task_data.check_items(items, "train", reward.reward_fn)
    monkeypatch.setattr(reward, "reward_fn", lambda completion, item, args=None: {"c": 1.0} if completion else {})
    with pytest.raises(SystemExit, match="reward_fn returns an empty dict for an empty completion: return every term"):
        task_data.check_items(items, "train", reward.reward_fn)


def test_workers_take_no_trainer_stop_handler_and_close_ends_what_reward_fn_started(bad_reward, tmp_path):
    """Workers forked after the trainer's stop handler (replacements are) take none of it: SIGINT and SIGUSR1 (a
    batch system's warning, sent to every process of a job) leave them scoring, SIGTERM ends them (multiprocessing's
    clean-up at exit sends it) rather than print that they finish the step; close() ends a stuck worker at once, and
    the process its reward_fn started."""
    import psutil

    previous = {sig: signal.signal(sig, lambda signum, frame: print("finishing this step")) for sig in stopping.SIGNALS}
    try:
        workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=0.5)
        process = workers.workers[0][0]
        for sig in (signal.SIGINT, signal.SIGUSR1):
            os.kill(process.pid, sig)
        process.join(0.5)
        assert process.is_alive()
        assert workers.score(["aaax"], [{"task": "toy", "target": "a"}]) == ([0.75], [])  # scored by a worker
        os.kill(process.pid, signal.SIGTERM)
        process.join(5)
        assert process.exitcode == -signal.SIGTERM
        rewards, errors = workers.score(["agag"], [{"task": "toy", "target": "a", "pid_file": str(tmp_path / "pid")}])
        started = psutil.Process(int((tmp_path / "pid").read_text()))
        assert rewards == [0.0] and "did not answer within" in errors[0]
        assert not started.is_running() or started.status() == psutil.STATUS_ZOMBIE  # killed with its worker
        start = time.perf_counter()
        workers.close()
        assert time.perf_counter() - start < 2.0 and not multiprocessing.active_children()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_failing_reward_fn_does_not_stop_training(tmp_path):
    """The whole loop with a reward.py whose reward_fn raises, hangs, returns NaN or None, or ends its worker on some
    completions: those score 0 and are counted, metrics.jsonl stays strict JSON, and no step is skipped."""
    # Only the hang that SIGALRM cuts off here: the other costs a second more per call (tested above).
    for path in glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "*.py")):  # train.py, its modules
        shutil.copy(path, tmp_path)
    with open(tmp_path / "reward.py", "a") as f:
        f.write(BAD_REWARD.replace('item.get("stuck", True)', "False"))
    out = tmp_path / "out"
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--steps",
        "3",
        "--reward_timeout",
        "0.2",
        "--eval_every",
        "0",
        "--out_dir",
        str(out),
        cwd=str(tmp_path),
    )
    assert run.returncode == 0, run.stderr[-3000:]

    def refuse(constant):
        raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON has not")

    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line, parse_constant=refuse) for line in f]
    assert len(rows) == 3 and sum(r["reward_errors"] for r in rows) > 0
    assert all(r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in rows)  # a NaN reward skipped every step
    assert run.stdout.count("reward_fn failed") == 1  # the first traceback, shown once
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert any(" | reward_errors " in line for line in steps)  # the step line shows them when there are any
    assert not any("skipped_steps" in line for line in steps)  # and says nothing of what did not happen
    shown = ("a bug in the user's reward", "TimeoutError", "not a finite number", "reward_fn worker died", "KeyError")
    assert any(failure in run.stdout for failure in shown)


def test_heads_that_do_not_divide_by_tp_are_refused_before_loading(tmp_path):
    tokenizer = demo_tokenizer()
    config = demo_config()
    config.num_attention_heads, config.num_key_value_heads = 6, 3  # 3 KV heads cannot be split in two
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    run = torchrun(2, "--preset", "cpu", "--model", str(tmp_path), "--tp", "2", "--out_dir", str(tmp_path / "out"))
    assert run.returncode != 0
    assert "--tp 2 must divide the model's num_key_value_heads (3)" in run.stderr + run.stdout
    assert "Loading weights" not in run.stderr + run.stdout
