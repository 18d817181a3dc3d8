"""The whole loop through torchrun, as a user runs it: the README's CPU command learns the toy reward; one process
without torchrun; a resume past a torn metrics line."""
import json
import os
import subprocess
import sys

import pytest

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc, *flags, timeout=300, cwd=ROOT, **env_vars):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "train.py", *flags]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_cpu_preset_learns_the_toy_reward(tmp_path):
    """The README's first command: 2 ranks, tiny random Qwen2, 30 steps."""
    run = torchrun(2, "--preset", "cpu", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert "step 30/30 | reward" in run.stdout
    first, last = rows[:5], rows[-5:]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    assert mean(first, "reward") < 0.3 and mean(last, "reward") > 0.8
    assert mean(last, "entropy") < mean(first, "entropy")
    # Engine and trainer hold the same weights after every push: their logprobs agree on every step.
    assert max(r["mismatch_abs"] for r in rows) < 1e-4
    for key in ("accuracy", "response_len", "truncated", "clip_frac", "grad_norm", "lr", "tokens_per_s",
                "time_rollout", "time_train", "time_push", "reward_errors", "groups_dropped"):
        assert all(key in r for r in rows), key
    # Held-out evaluation every 10 steps on 16 prompts. The trained model says only "a": every answer is right.
    evals = [r for r in rows if "eval_greedy_acc" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and all(r["eval_prompts"] == 16 for r in evals)
    assert all(r["eval_mean@4"] <= r["eval_pass@4"] for r in evals)
    assert evals[-1]["eval_greedy_acc"] == evals[-1]["eval_mean@4"] == evals[-1]["eval_pass@4"] == 1.0
    assert evals[0]["eval_mean@4"] < 0.5  # at step 10 sampling still strays: mean@4 is not yet 1


def test_tensor_parallel_run_with_reference_model_logged_to_offline_wandb(tmp_path):
    """tp 2 on 2 ranks with the k3 KL to a reference model and an entropy bonus; wandb offline (no network)."""
    run = torchrun(2, "--preset", "cpu", "--tp", "2", "--beta", "0.1", "--steps", "4", "--entropy_coef", "0.01",
                   "--wandb_project", "grpo-test", "--out_dir", str(tmp_path), WANDB_MODE="offline")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 4
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # the reference model starts as the policy
    assert rows[-1]["kl"] > 0  # later the policy has moved away from it
    assert all(r["clip_frac"] >= 0 and r["mismatch_abs"] < 1e-4 for r in rows)
    [wandb_run] = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / wandb_run))


def test_bad_flag_exits_before_loading_a_model(tmp_path):
    run = torchrun(2, "--preset", "cpu", "--prompts_per_step", "3", "--out_dir", str(tmp_path))
    assert run.returncode != 0 and "--prompts_per_step 3 must divide by dp = 2" in run.stderr + run.stdout


def test_train_py_stays_under_1000_lines():
    with open(os.path.join(ROOT, "train.py")) as f:
        assert len(f.readlines()) < 1000


def test_dapo_and_dr_grpo_settings_run_end_to_end(tmp_path):
    """DAPO: token-mean loss, clip-higher, dynamic sampling, the soft overlong penalty, token-budget micro-batches;
    with the k1 KL to a CPU-kept reference subtracted from the reward. Then Dr. GRPO: constant normaliser, no std."""
    dapo = tmp_path / "dapo"
    run = torchrun(2, "--preset", "cpu", "--steps", "4", "--eval_every", "0", "--loss_agg", "token",
                   "--clip_high", "0.28", "--dynamic_sampling_rounds", "3", "--overlong_buffer", "4",
                   "--max_tokens_per_microbatch", "200", "--beta", "0.05", "--kl_in_reward", "true",
                   "--kl_estimator", "k1", "--ref_on_cpu", "true", "--out_dir", str(dapo))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(dapo)
    assert len(rows) == 4 and all("groups_dropped" in r for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[-1]["kl"] != 0  # k1 can be negative
    dr_grpo = tmp_path / "dr_grpo"
    run = torchrun(2, "--preset", "cpu", "--steps", "6", "--eval_every", "0", "--loss_agg", "constant",
                   "--scale_std", "false", "--lr", "0.1", "--out_dir", str(dr_grpo))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(dr_grpo)
    assert rows[-1]["reward"] > rows[0]["reward"]


@pytest.mark.parametrize("flags", [
    ("--ratio_level", "sequence", "--loss_agg", "sequence", "--clip_low", "3e-4", "--clip_high", "4e-4"),  # GSPO
    ("--objective", "cispo"),
    ("--tis_cap", "2", "--is_mode", "mask", "--is_level", "sequence"),
], ids=["gspo", "cispo", "masked_is"])
def test_gspo_cispo_and_masked_importance_sampling_learn_the_toy_reward(flags, tmp_path):
    """Two mini-batches a step, so the ratio leaves 1 in the second and GSPO's tiny clip range binds."""
    run = torchrun(2, "--preset", "cpu", "--steps", "15", "--eval_every", "0", "--num_minibatches", "2", *flags,
                   "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert rows[0]["reward"] < 0.3 and rows[-1]["reward"] > 0.8
    assert all(r["is_masked_tokens"] == r["is_masked_responses"] == 0 for r in rows)  # the CPU engine matches
    if "cispo" not in flags:
        assert max(r["clip_frac"] for r in rows) > 0


def test_python_train_py_runs_as_one_process_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, "train.py", "--preset", "cpu", "--steps", "3", "--eval_every", "0",
                          "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]


def test_a_metrics_line_torn_by_a_crash_does_not_block_resuming(tmp_path):
    lines = [json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "rew')  # killed mid-write
    train.open_run_dir(train.Config(out_dir=str(tmp_path)), str(tmp_path / "checkpoints" / "step_000002"), 2, None)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])  # steps 3 and 4 run again
