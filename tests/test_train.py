"""The whole loop through torchrun, as a user runs it: the README's CPU command learns the toy reward; one process
without torchrun; a resume past a torn metrics line."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM

import checkpoint
import launch
import train
from demo_model import demo_config, demo_tokenizer
from workers import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc, *flags, timeout=300, cwd=ROOT, script="train.py", **env_vars):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", script, *flags]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def metrics_lines(out_dir):
    """Every line of a run's metrics.jsonl: the evaluation before training as step 0, then each step's."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def metrics(out_dir):
    """The training steps' lines of a run's metrics.jsonl."""
    return [row for row in metrics_lines(out_dir) if row["step"] > 0]


def test_cpu_preset_learns_the_toy_reward(tmp_path):
    """The README's first command: 2 ranks, tiny random Qwen2, 30 steps."""
    run = torchrun(2, "--preset", "cpu", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert "step 30/30 | reward" in run.stdout
    first, last = rows[:5], rows[-5:]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    assert mean(first, "reward") < 0.3 and mean(last, "reward") > 0.8
    assert mean(last, "entropy") < mean(first, "entropy")
    # Engine and trainer hold the same weights after every push: their logprobs agree on every step.
    assert max(r["mismatch_abs"] for r in rows) < 1e-4
    assert all("log_kept_mass" not in r for r in rows)  # sampling not truncated: nothing renormalised
    assert all("expert_load_max" not in r for r in rows)  # a dense model: no routed experts
    for key in (
        "accuracy",
        "response_len",
        "truncated",
        "clip_frac",
        "grad_norm",
        "lr",
        "tokens",
        "time_rollout",
        "time_train",
        "time_push",
        "reward_errors",
        "groups_dropped",
        "frac_reward_zero_std",
    ):
        assert all(key in r for r in rows), key
    # A group whose rewards are all equal has no signal: toy rewards vary until the model says only "a".
    assert rows[0]["frac_reward_zero_std"] < 0.5 and rows[-1]["frac_reward_zero_std"] == 1.0
    # Held-out evaluation every 10 steps on 16 prompts. The trained model says only "a": every answer is right.
    evals = [r for r in rows if "eval_greedy_acc" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and all(r["eval_prompts"] == 16 for r in evals)
    assert all(r["eval_mean@4"] <= r["eval_pass@4"] for r in evals)
    assert evals[-1]["eval_greedy_acc"] == evals[-1]["eval_mean@4"] == evals[-1]["eval_pass@4"] == 1.0
    assert evals[0]["eval_mean@4"] < 0.5  # at step 10 sampling still strays: mean@4 is not yet 1
    # And before step 1, the baseline: metrics.jsonl's first line is step 0, an evaluation alone, of the random model.
    baseline = metrics_lines(tmp_path)[0]
    assert baseline.keys() == {"step", "eval_greedy_acc", "eval_mean@4", "eval_pass@4", "eval_prompts"}
    assert baseline["step"] == 0 and baseline["eval_greedy_acc"] == baseline["eval_pass@4"] == 0.0
    # The console: the flags that differ from the defaults at once, before the model loads; loading, evaluation and
    # saving say how long they took; one step a line with the share of responses cut off, the learning rate and its
    # ETA; a sample at step 1 and every --sample_every (10) steps; a last line saying where the results are and how
    # long the run took; no warning on stderr.
    out = run.stdout
    assert out.index("config: model=tiny task=toy train_size=1000") < out.index("loading tiny and the engine")
    assert (
        out.index("loading tiny and the engine")
        < out.index("step 0/30\n  eval (16 prompts): ")
        < out.index("step 1/30")
    )
    assert out.count("evaluating on 16 held-out prompts... ") == 4  # before step 1, after steps 10, 20 and 30
    assert "clip_low=" not in out  # a default: config.json holds it
    assert json.loads((tmp_path / "config.json").read_text())["clip_low"] == 0.2
    assert re.search(r"loading tiny and the engine\.\.\. [0-9.]+s", out)
    assert re.search(r"evaluating on 16 held-out prompts\.\.\. [0-9.]+s", out)
    assert re.search(r"saving the checkpoint of step 30\.\.\. [0-9.]+s", out)
    steps = [line for line in out.splitlines() if re.match(r"step \d+/30 ", line)]
    assert len(steps) == 30 and all(len(line) <= 120 and ") eta 0:" in line for line in steps)
    # Once every response says only "a", every group's rewards are equal: said once, with the causes.
    assert out.count("learned nothing") == 1 and "already learned (reward 1.000)" in " ".join(out.split())
    assert all(re.search(r" cut [01]\.\d\d \| ent [0-9.]+ lr 1e-02 \|", line) for line in steps)
    assert " kl " not in steps[0]  # without --beta there is no KL to show
    assert steps[-1].endswith("eta 0:00:00")
    assert out.count("  sample (reward ") == 4 and out.count("\nSay a:") == 4  # steps 1, 10, 20, 30
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"done after step 30 in 0:00:\d\d: checkpoint {tmp_path}/checkpoints/step_000030, metrics "
        rf"{tmp_path}/metrics.jsonl",
        last,
    ), last
    assert "Warning" not in run.stderr and "top_k" not in run.stderr and "view tensor" not in run.stderr
    # A step's time and its parts are one rank's: the parts add up to the total.
    assert all(abs(r["time_rollout"] + r["time_train"] + r["time_push"] - r["time_step"]) < 1e-6 for r in rows)


def test_tensor_parallel_run_with_reference_model_logged_to_offline_wandb(tmp_path):
    """tp 2 on 2 ranks with the k3 KL to a reference model and an entropy bonus; wandb offline (no network)."""
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--tp",
        "2",
        "--beta",
        "0.1",
        "--steps",
        "4",
        "--entropy_coef",
        "0.01",
        "--sample_every",
        "2",
        "--wandb_project",
        "grpo-test",
        "--out_dir",
        str(tmp_path),
        WANDB_MODE="offline",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 4
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # the reference model starts as the policy
    assert rows[-1]["kl"] > 0  # later the policy has moved away from it
    assert all(r["clip_frac"] >= 0 and r["mismatch_abs"] < 1e-4 for r in rows)
    assert rows[-1]["eval_prompts"] == 16 and 0 <= rows[-1]["eval_greedy_acc"] <= 1  # both tp ranks count a prompt once
    [wandb_run] = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / wandb_run))
    console = (tmp_path / "wandb" / wandb_run / "files" / "output.log").read_text()  # what wandb kept of rank 0's
    assert console.count("  sample (reward") == 3  # the samples of steps 1, 2 and 4
    steps = [line for line in console.splitlines() if re.match(r"step \d+/4 ", line)]
    assert len(steps) == 4 and all(re.search(r" kl \d\.\d{4} lr ", line) for line in steps)  # with --beta
    assert "redistribut" not in run.stderr and "Warning" not in run.stderr  # TP's notices are silenced


def test_bad_flag_exits_before_loading_a_model_saying_so_once(tmp_path):
    run = torchrun(2, "--preset", "cpu", "--prompts_per_step", "3", "--out_dir", str(tmp_path))
    assert run.returncode != 0 and (run.stderr + run.stdout).count("--prompts_per_step 3 must divide by dp = 2") == 1


def one_process(*flags, **env_vars):
    """`python train.py` as one process, as a first try of a new setting would run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "train.py", *flags],
        cwd=ROOT,
        env=dict(env, OMP_NUM_THREADS="1", **env_vars),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_model_folder_that_does_not_exist_or_holds_no_model_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "no_model").mkdir()
    (tmp_path / "no_model" / "config.json").write_text("{}")  # no model_type, no tokenizer
    said = {
        "no_such_model": "no such local folder (nor a hub id, org/name): check the path",  # said without the hub
        "no_model": "not a model's folder, nor a hub id: ",
    }
    for model, why in said.items():
        run = one_process("--model", str(tmp_path / model), "--engine", "hf", "--out_dir", str(tmp_path / "out"))
        assert run.returncode != 0 and "Traceback" not in run.stderr and "asking" not in run.stdout
        [line] = run.stderr.strip().splitlines()
        assert line.startswith(f"--model {tmp_path}/{model}: {why}"), line


def test_a_truncated_safetensors_file_is_named_before_any_model_is_built(tmp_path):
    tokenizer = demo_tokenizer()
    AutoModelForCausalLM.from_config(demo_config()).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a download cut short
    run = one_process("--preset", "cpu", "--model", str(tmp_path / "model"), "--out_dir", str(tmp_path / "out"))
    assert run.returncode != 0 and "Traceback" not in run.stderr and "loading" not in run.stdout
    assert run.stderr.startswith(f"--model: {weights} cannot be read (") and "download or save it again" in run.stderr


def test_an_out_dir_that_cannot_be_written_stops_the_run_at_once(tmp_path):
    (tmp_path / "a_file").write_text("")
    run = torchrun(2, "--preset", "cpu", "--out_dir", str(tmp_path / "a_file" / "run"))
    out = run.stdout + run.stderr
    assert run.returncode != 0 and out.count(f"--out_dir {tmp_path}/a_file/run: cannot write there") == 1
    assert "loading" not in out and "[rank1]" not in out  # rank 1 stops with rank 0, quietly: no traceback of it


def test_without_evaluation_no_test_split_is_needed_and_bad_reference_answers_are_counted(tmp_path):
    rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(7)] + [
        {"question": "?", "answer": "#### many"}
    ]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = (
        "--preset",
        "cpu",
        "--task",
        "gsm8k",
        "--data_path",
        str(tmp_path / "data"),
        "--max_new_tokens",
        "8",
        "--prompts_per_step",
        "4",
        "--steps",
        "1",
        "--eval_every",
        "0",
        "--out_dir",
        str(tmp_path / "out"),
    )
    run = one_process(*flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("warning: 1 of 8 train items have a reference answer that does not parse") == 1
    asked = one_process(*flags[:-4], "--eval_every", "1", "--out_dir", str(tmp_path / "out2"))
    assert asked.returncode != 0 and "Traceback" not in asked.stderr
    assert f"--data_path {tmp_path}/data: no readable test split" in asked.stderr and "test.jsonl" in asked.stderr


def test_dapo_and_dr_grpo_settings_run_end_to_end(tmp_path):
    """DAPO: token-mean loss, clip-higher, dynamic sampling, the soft overlong penalty, token-budget micro-batches;
    with the k1 KL to a CPU-kept reference subtracted from the reward. Then Dr. GRPO: constant normaliser, no std."""
    dapo = tmp_path / "dapo"
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--steps",
        "4",
        "--eval_every",
        "0",
        "--loss_agg",
        "token",
        "--clip_high",
        "0.28",
        "--dynamic_sampling_rounds",
        "3",
        "--overlong_buffer",
        "4",
        "--max_tokens_per_microbatch",
        "200",
        "--beta",
        "0.05",
        "--kl_in_reward",
        "true",
        "--kl_estimator",
        "k1",
        "--out_dir",
        str(dapo),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(dapo)
    assert len(rows) == 4 and all("groups_dropped" in r for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[-1]["kl"] != 0  # k1 can be negative
    dr_grpo = tmp_path / "dr_grpo"
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--steps",
        "6",
        "--eval_every",
        "0",
        "--loss_agg",
        "constant",
        "--scale_std",
        "false",
        "--lr",
        "0.1",
        "--out_dir",
        str(dr_grpo),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(dr_grpo)
    assert rows[-1]["reward"] > rows[0]["reward"]


@pytest.mark.parametrize(
    "flags",
    [
        ("--ratio_level", "sequence", "--loss_agg", "sequence", "--clip_low", "3e-4", "--clip_high", "4e-4"),  # GSPO
        ("--tis_cap", "2", "--is_mode", "mask", "--is_level", "sequence"),
        ("--objective", "dppo_kl", "--std_of", "batch"),
        ("--advantage", "rloo", "--scale_std", "false"),
    ],
    ids=["gspo", "masked_is", "dppo_kl_batch_std", "rloo"],
)
def test_gspo_dppo_kl_rloo_and_masked_importance_sampling_learn_the_toy_reward(flags, tmp_path):
    """Two mini-batches a step, so the ratio leaves 1 in the second and GSPO's tiny clip range (DPPO's divergence
    bound) binds."""
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--steps",
        "15",
        "--eval_every",
        "0",
        "--num_minibatches",
        "2",
        *flags,
        "--out_dir",
        str(tmp_path),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert rows[0]["reward"] < 0.3 and rows[-1]["reward"] > 0.8
    if "mask" in flags:
        assert all(r["is_masked_tokens"] == 0 for r in rows)  # the CPU engine matches: r is 1, inside the bound
    else:
        assert all("is_masked_tokens" not in r for r in rows)  # no masking without --is_mode mask
    if "rloo" not in flags:  # the clip, or DPPO's mask, binds somewhere (RLOO's run clips within 0.2 / 0.28)
        assert max(r["clip_frac"] for r in rows) > 0


def test_the_objectives_off_policy_make_different_updates_and_each_learns(tmp_path):
    """Two mini-batches a step: the second is trained off-policy (its ratio to the policy that sampled it leaves 1),
    where clip, CISPO, DPPO and SAPO part ways. With one mini-batch the ratio is 1 and their gradients coincide,
    which is why the CPU demo alone cannot tell them apart. Each run still learns the toy reward."""
    runs = {}
    for objective in ("clip", "cispo", "dppo_tv", "sapo"):
        flags = ("--preset", "cpu", "--steps", "15", "--eval_every", "0", "--num_minibatches", "2")
        run = torchrun(2, *flags, "--objective", objective, "--out_dir", str(tmp_path / objective))
        assert run.returncode == 0, run.stderr[-3000:]
        runs[objective] = metrics(tmp_path / objective)
        assert runs[objective][0]["reward"] < 0.3 and runs[objective][-1]["reward"] > 0.8, objective
    first_norms = {objective: rows[0]["grad_norm"] for objective, rows in runs.items()}
    assert len(set(first_norms.values())) == 4, first_norms  # step 1's second mini-batch already differs
    assert all(rows[0]["reward"] == runs["clip"][0]["reward"] for rows in runs.values())  # the same samples
    assert runs["clip"][0]["clip_frac"] > 0  # the second mini-batch's ratio left [0.8, 1.28] for some tokens


@pytest.mark.parametrize(
    "flags", [("--top_p", "0.9"), ("--top_p", "0.95", "--top_k", "20", "--tp", "2")], ids=["top_p", "top_k_tp2"]
)
def test_truncated_sampling_is_trained_as_sampled_and_the_kept_mass_is_reported(flags, tmp_path):
    """The HF engine samples from the truncated distribution and reports each token's kept set; the trainer's
    log-probs (old and new, two mini-batches a step), renormalised over those sets, agree with the engine's to fp32
    noise, where over the full vocabulary they would differ by the log of the kept mass, logged every step."""
    common = ("--preset", "cpu", "--steps", "15", "--eval_every", "0", "--num_minibatches", "2")
    run = torchrun(2, *common, *flags, "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert rows[0]["reward"] < 0.3 and rows[-1]["reward"] > 0.8
    assert all(r["log_kept_mass"] <= 0 for r in rows) and rows[0]["log_kept_mass"] < -0.05
    assert all(r["mismatch_abs"] < 1e-5 for r in rows)
    assert rows[0]["mismatch_abs"] < 1e-4 * -rows[0]["log_kept_mass"]


def test_python_train_py_runs_as_one_process_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    run = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--preset",
            "cpu",
            "--steps",
            "3",
            "--eval_every",
            "0",
            "--out_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]


def open_run_dir(rank, world, out_dir):
    """As train.main: rank 0 opens the run folder at start step 2, then every rank checks that it sees it."""
    cfg, par = train.Config(out_dir=out_dir), launch.parallel_groups("cpu", 1)
    run_id, _ = launch.on_first_rank(par.world_group, checkpoint.open_run_dir, cfg, 2, None)
    checkpoint.check_every_rank_sees(cfg.out_dir, run_id, par.world_group)


def test_a_metrics_line_torn_by_a_crash_does_not_block_resuming(tmp_path):
    lines = [json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "rew')  # killed mid-write
    run_ranks(open_run_dir, 1, str(tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])  # steps 3 and 4 run again


def readme_section(title):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(f"\n## {title}\n")
    return text[start : text.index("\n## ", start + 1)]


def test_a_new_task_in_two_edits_learns_from_a_jsonl_folder_or_a_generator(tmp_path):
    """README "Your own task", done as a user would: its Python makes the jsonl folder, its two code blocks go into a
    copy of reward.py (PromptDataset.__getitem__ and reward_fn), and its command trains, reward rising. Then its
    generator goes at the end of reward.py in place of the folder: its command trains too, on disjoint splits."""
    section = readme_section("Your own task")
    make_data, getitem_branch, reward_branch, generator = re.findall(r"```python\n(.*?)```", section, re.S)
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    for anchor, branch in (
        ('        if task == "toy":', getitem_branch),
        ('    raise ValueError(f"unknown task', reward_branch),
    ):
        assert source.count(anchor) == 1, anchor  # the one place the README's edit goes
        source = source.replace(anchor, branch + anchor)
    copy_project(tmp_path, source + "\n\n" + generator)
    subprocess.run([sys.executable, "-c", make_data], cwd=tmp_path, check=True)
    folder_command, generated_command = [line for line in section.splitlines() if line.startswith("torchrun")]
    for name, command in (("folder", folder_command), ("generated", generated_command)):
        flags = command.split("train.py ")[1].split()
        run = torchrun(2, *flags, "--out_dir", str(tmp_path / name), cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        rows = metrics(tmp_path / name)
        assert len(rows) == 30 and all(r["reward_errors"] == 0 for r in rows)
        first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
        assert first < 0.2 and last > first + 0.4, (name, first, last)
    # 1,100 words of 12 letters drawn from 4,096: the train words that a test word repeats are left out, and said.
    said = re.search(
        r"note: (\d+) of the 1000 train problems that --task letters generated ask what a test", run.stdout
    )
    assert said and 0 < int(said.group(1)) < 100, run.stdout[:2000]


def readme_block(heading):
    """The ```python block after the README line that starts with `heading`."""
    text = readme_section("Where to edit")
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


def copy_project(folder, reward_source):
    """train.py and the modules beside it in `folder`, with reward.py's source replaced."""
    for path in glob.glob(os.path.join(ROOT, "*.py")):
        shutil.copy(path, folder)
    (folder / "reward.py").write_text(reward_source)


def test_a_reward_term_with_its_metric_is_one_edit_of_reward_fn(tmp_path):
    """README "Where to edit", a new reward term: reward_fn returns a dict of named terms (the README's block, in a
    copy of reward.py). The reward is their sum weighted by --reward_weights, each term is logged as reward/<name>
    with its std, the console shows them, and the run learns both. A weight for a term that reward_fn does not
    return stops the run at start, in one line."""
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    anchor = '    if task == "toy":\n        return toy_reward('
    assert source.count(anchor) == 1
    copy_project(tmp_path, source.replace(anchor, readme_block("- **A reward term**") + anchor))
    lines = readme_section("Where to edit").splitlines()
    command = next(line for line in lines if line.startswith("torchrun") and "--reward_weights" in line)
    flags = command.split("train.py ")[1].split("#")[0].split()
    run = torchrun(2, *flags, "--steps", "12", "--eval_every", "0", "--out_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    weight = float(flags[flags.index("--reward_weights") + 1].split("=")[1])
    for r in rows:
        assert r["reward"] == pytest.approx(r["reward/letter"] + weight * r["reward/first"], rel=1e-9)
        assert 0 <= r["reward/first/std"] <= 0.5 and r["reward_errors"] == 0
    assert rows[-1]["reward/letter"] > rows[0]["reward/letter"] + 0.4
    assert rows[-1]["reward/first"] > rows[0]["reward/first"] + 0.4
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert all(re.search(r" acc \d\.\d\d \[letter \d\.\d\d first \d\.\d\d\] \| len ", line) for line in steps)
    refused = torchrun(2, *flags, "--reward_weights", "style=1", "--out_dir", str(tmp_path / "x"), cwd=tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "loading" not in out
    assert out.count("--reward_weights weighs 'style', which reward_fn does not return (only ('letter', 'first'))") == 1


def test_dynamic_sampling_keeps_a_group_whose_shaped_rewards_differ(tmp_path):
    """Dynamic sampling judges the value advantages are made from: with a reward_fn that scores every completion
    alike and DAPO's overlong penalty over the whole length, a group whose responses differ in length has a signal
    and is kept. Judged by reward_fn's scores, every group of every round would be dropped (groups_dropped 8 at
    each step: 2 ranks x 2 rounds x 4 groups, less the 4 a rank refills with)."""
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    copy_project(tmp_path, source + "\n\ndef reward_fn(completion, item, args=None):\n    return 0.5\n")
    flags = ("--preset", "cpu", "--steps", "3", "--eval_every", "0", "--overlong_buffer", "16")
    run = torchrun(2, *flags, "--dynamic_sampling_rounds", "1", "--out_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert all(r["reward"] == 0.5 and r["shaped_reward"] < 0.5 for r in rows)
    assert all(r["groups_dropped"] < 4 and r["frac_reward_zero_std"] < 0.5 for r in rows), rows


def test_an_unknown_task_stops_at_once_naming_the_flag_and_the_tasks_with_data(tmp_path):
    run = torchrun(2, "--preset", "cpu", "--task", "mnist", "--out_dir", str(tmp_path))
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "loading" not in out and "[rank1]" not in out  # one line, from rank 0
    assert out.count("--task mnist: reward.py has no data for it") == 1
    assert all(task in out for task in ("countdown", "addition", "toy", "gsm8k", "math", "README: your own task"))
    (tmp_path / "data").mkdir()
    for split in ("train", "test"):
        (tmp_path / "data" / f"{split}.jsonl").write_text('{"x": 1}\n' * 16)
    with_data = torchrun(
        2,
        "--preset",
        "cpu",
        "--task",
        "mnist",
        "--data_path",
        str(tmp_path / "data"),
        "--out_dir",
        str(tmp_path / "out"),
    )
    out = with_data.stdout + with_data.stderr
    assert with_data.returncode != 0 and "loading" not in out and "[rank1]" not in out
    assert out.count("--task mnist: PromptDataset.__getitem__ in reward.py has no branch for it") == 1


def test_a_flag_argparse_cannot_read_is_said_once_under_torchrun_in_one_line(tmp_path):
    run = torchrun(2, "--preset", "cpu", "--steps", "ten", "--out_dir", str(tmp_path))
    out = run.stdout + run.stderr
    said = "argument --steps: invalid int value: 'ten' (python train.py --help lists the flags)"
    assert run.returncode != 0 and out.count(said) == 1, out[-3000:]
    assert "usage: train.py" not in out  # not argparse's 36-line usage of every flag


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--prompts_per_setp", "4"), "unknown flag --prompts_per_setp: did you mean --prompts_per_step?"),
        (("--prompts_per_step", "3"), "--prompts_per_step 3 must divide by dp = 2"),
        (("--task", "mnist"), "--task mnist: reward.py has no data for it"),
    ],
    ids=["unknown_flag", "flag_out_of_range", "unknown_task"],
)
def test_a_refusal_is_said_once_even_when_rank_0_starts_last(flags, said, tmp_path):
    """Rank 0 starts 3 s after rank 1 (tests/slow_first_rank.py), as it may on a loaded machine. torchrun stops every
    rank once one exits with an error, so no rank may exit before rank 0 has said why."""
    run = torchrun(2, "--preset", "cpu", *flags, "--out_dir", str(tmp_path), script="tests/slow_first_rank.py")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and out.count(said) == 1, out[-3000:]
    assert "loading" not in out


def test_wandb_without_an_api_key_stops_in_one_line_before_the_model_loads(tmp_path):
    """wandb.init starts before the model loads: without a key (here no ~/.netrc, no WANDB_API_KEY, no terminal to
    ask in) the run stops at once, saying how to log in or to log offline, and writes no config.json."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--standalone",
            "train.py",
            "--preset",
            "cpu",
            "--wandb_project",
            "p",
            "--out_dir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=dict(env, OMP_NUM_THREADS="1", HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "loading" not in out, out[-3000:]
    assert (
        out.count(
            "--wandb_project p: No API key configured. Use `wandb login` to log in. (log offline with "
            "WANDB_MODE=offline)"
        )
        == 1
    ), out[-3000:]
    assert not os.path.exists(tmp_path / "out" / "config.json")


def test_the_readme_quick_start_runs_verbatim_in_a_fresh_copy(tmp_path):
    """Its two demo commands, as written, one after the other in a copy of the project: both train to the end."""
    text = readme_section("Quick start")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith(("torchrun ", "python3 train.py"))]
    assert len(commands) == 2, block
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for command in commands:
        run = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (command, run.stderr[-3000:])
        assert run.stdout.strip().splitlines()[-1].startswith("done after step 30 in "), run.stdout[-2000:]
    assert sorted(os.listdir(tmp_path / "runs")) == ["cpu", "cpu-1proc"]


def test_a_run_that_learns_nothing_says_so_once_with_the_usual_causes(tmp_path):
    """GSM8K-format rows whose answers (seven digits) no 4-token response can give: every reward is 0, every group
    without signal. The console shows the share of responses cut off and the learning rate (still in warm-up),
    prints a sample at step 1 though --sample_every is 10, and says once why nothing is learned."""
    rows = [{"question": f"{i} + 1?", "answer": f"#### {1_000_000 + i}"} for i in range(16)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ("--preset", "cpu", "--task", "gsm8k", "--data_path", str(tmp_path / "data"), "--max_new_tokens", "4")
    flags += ("--prompts_per_step", "4", "--steps", "3", "--eval_every", "0", "--sample_every", "10")
    run = one_process(*flags, "--lr", "1e-6", "--warmup_steps", "10", "--out_dir", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert all(r["frac_reward_zero_std"] == 1.0 and r["reward"] == 0 for r in rows)
    out = run.stdout
    steps = [line for line in out.splitlines() if re.match(r"step \d+/3 ", line)]
    assert [re.search(r" lr (\S+) ", line).group(1) for line in steps] == ["1e-07", "2e-07", "3e-07"], steps
    assert all(re.search(r" cut (0\.[6-9]\d|1\.00) ", line) for line in steps), steps  # 4 tokens: most cut
    assert out.count("  sample (reward ") == 1  # step 1's
    assert out.count("learned nothing") == 1, out
    note = " ".join(out[out.index("step 1 learned nothing") :].split())
    assert "in every group the rewards are equal, so no advantage and no gradient" in note
    assert "cut off by --max_new_tokens 4 (cut " in note and "(reward 0.000)" in note and "reward_fn" in note


@pytest.mark.parametrize("flag, value", [("--model", "tmp/smol"), ("--data_path", "data/revers")])
def test_a_path_that_is_no_local_folder_fails_in_seconds_saying_the_hub_was_asked(flag, value, tmp_path):
    """A mistyped local path reads as a hub id. Without a network (these machines reach no hub), the hub's retries
    took 57 s (--model) and 34 s (--data_path) before failing; the first line now says what is happening, and the
    run stops within seconds, naming the flag. With HF_HUB_OFFLINE=1 the loaders read the cache alone, also fast."""
    task = "toy" if flag == "--model" else "gsm8k"
    flags = ("--preset", "cpu", "--task", task, flag, value, "--out_dir", str(tmp_path / "out"))
    start = time.monotonic()
    run = one_process(*flags)
    seconds = time.monotonic() - start
    assert run.returncode != 0 and seconds < 30, (seconds, run.stdout[-2000:], run.stderr[-2000:])
    kind = "model" if flag == "--model" else "dataset"
    assert run.stdout.startswith(f"{flag} {value}: no local folder of that name, so a {kind} of the Hugging Face hub")
    [line] = run.stderr.strip().splitlines()
    assert line.startswith(f"{flag} {value}: no such local folder, ") and "Traceback" not in run.stderr
    start = time.monotonic()
    offline = one_process(*flags[:-2], "--out_dir", str(tmp_path / "offline"), HF_HUB_OFFLINE="1")
    assert offline.returncode != 0 and time.monotonic() - start < 30 and "Traceback" not in offline.stderr
    assert offline.stderr.strip().splitlines()[-1].startswith(f"{flag} {value}")


def test_a_broken_jsonl_line_is_named_once_by_its_file_and_line(tmp_path):
    """A line cut inside a two-byte character, as a copy that stopped mid-file leaves it: pyarrow said "Invalid
    encoding in string. in row 5" (zero-based) once per rank."""
    lines = [json.dumps({"question": f"{i} + 1 é?", "answer": f"#### {i + 1}"}, ensure_ascii=False) for i in range(8)]
    data = [line.encode() for line in lines]
    data[5] = data[5][: data[5].index("é".encode()) + 1]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(b"\n".join(data) + b"\n")
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--task",
        "gsm8k",
        "--data_path",
        str(tmp_path / "data"),
        "--out_dir",
        str(tmp_path / "out"),
        "--prompts_per_step",
        "2",
        "--eval_every",
        "0",
    )
    out = run.stdout + run.stderr
    said = f"--data_path {tmp_path}/data: {tmp_path}/data/train.jsonl, line 6: "
    assert run.returncode != 0 and out.count(said) == 1, out[-3000:]
    assert "fix or remove that line" in out and "JSON parse error" not in out and "loading" not in out


# A toy reward of three terms: correctness (every character the letter), the share of the letter (which the model
# learns from), and a bonus for starting with the letter, which alone brings the sum to 1: a response "ab..." would
# count as accurate by the sum.
CORRECT_AND_BONUS = """    if task == "toy":
        share = toy_reward(completion, item["target"])
        return {"correct": float(share == 1), "letter": share, "bonus": float(completion.strip()[:1] == item["target"])}
"""


def test_accuracy_is_the_accuracy_terms_share_at_training_and_evaluation_and_the_sum_is_said_at_start(tmp_path):
    """--accuracy_term correct: each step's accuracy is the share of responses whose correctness term is 1 (its
    mean, as the term is 0 or 1), though the bonus alone reaches 1; each evaluation's greedy accuracy is that of its
    greedy responses, and it logs each term's mean over them. Without the flag, accuracy counts the sum, and the run
    says so at start, once, naming the flag; a term that reward_fn does not return is refused."""
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    anchor = '    if task == "toy":\n        return toy_reward('
    copy_project(tmp_path, source.replace(anchor, CORRECT_AND_BONUS + anchor))
    flags = ("--preset", "cpu", "--eval_every", "8", "--eval_k", "2", "--sample_every", "0")
    run = torchrun(
        2, *flags, "--steps", "16", "--accuracy_term", "correct", "--out_dir", str(tmp_path / "a"), cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "note: accuracy" not in run.stdout
    rows = metrics(tmp_path / "a")
    assert all(r["accuracy"] == pytest.approx(r["reward/correct"], abs=1e-12) for r in rows)
    assert rows[-1]["accuracy"] > 0.5  # learned: the check is not one of zeros
    assert any(r["reward/bonus"] > r["reward/correct"] + 0.2 for r in rows)  # the bonus alone, often: not counted
    evals = [r for r in metrics_lines(tmp_path / "a") if "eval_greedy_acc" in r]
    assert [r["step"] for r in evals] == [0, 8, 16]
    assert all(r["eval_greedy_acc"] == pytest.approx(r["eval_reward/correct"], abs=1e-12) for r in evals)
    assert all(0 <= r["eval_reward/bonus"] <= 1 for r in evals) and evals[-1]["eval_greedy_acc"] == 1.0
    assert re.search(
        r"eval_greedy_acc 1\.000 \| eval_mean@2 [0-9.]+ \| eval_pass@2 [0-9.]+ \| eval_reward/correct", run.stdout
    )
    summed = torchrun(2, *flags, "--steps", "3", "--out_dir", str(tmp_path / "s"), cwd=tmp_path)
    assert summed.returncode == 0, summed.stderr[-3000:]
    terms = "correct, letter, bonus"
    note = f"note: accuracy counts a response right when its reward, the weighted sum of the terms {terms}, is 1"
    assert " ".join(summed.stdout.split()).count(note) == 1 and "--accuracy_term" in summed.stdout
    for r in metrics(tmp_path / "s"):  # a bonus of 1 is accurate by the sum
        assert r["accuracy"] >= r["reward/bonus"] - 1e-12
    refused = torchrun(2, *flags, "--accuracy_term", "right", "--out_dir", str(tmp_path / "r"), cwd=tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "loading" not in out
    assert out.count("--accuracy_term right: reward_fn returns no such term (only ('correct', 'letter', 'bonus'))") == 1


def test_task_args_reach_the_tasks_data_and_the_demo_learns_the_letter_they_give(tmp_path):
    """--task_args letter=b: the toy task's rows say b (its generator takes the option), and the run learns it."""
    flags = ("--preset", "cpu", "--steps", "14", "--eval_every", "0", "--sample_every", "7")
    run = torchrun(2, *flags, "--task_args", "letter=b", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\nSay b:") == 3 and "Say a:" not in run.stdout  # the samples of steps 1, 7 and 14
    rows = metrics(tmp_path)
    assert rows[0]["reward"] < 0.1 and rows[-1]["reward"] > 0.8
    assert json.loads((tmp_path / "config.json").read_text())["task_args"] == "letter=b"


def docs_tasks_blocks():
    """docs/tasks.md's reasoning-gym recipe: its ```python blocks after its heading, and its command."""
    with open(os.path.join(ROOT, "docs", "tasks.md")) as f:
        text = f.read()
    recipe = text[text.index("## A task from a library") :]
    blocks = re.findall(r"```python\n(.*?)```", recipe, re.S)
    [command] = [line for line in recipe.splitlines() if line.startswith("torchrun")]
    return blocks, command


def test_the_reasoning_gym_recipe_of_docs_tasks_md_runs_and_logs_its_terms(tmp_path):
    """docs/tasks.md's recipe, done to a copy of reward.py as a user would: the task's TASK_ARGS line, its generator
    (the library's own), its __getitem__ branch and its reward_fn branch (the library's own scorer); its command
    runs 2 steps on the tiny model and logs both terms, at training and at the baseline evaluation."""
    (task_args_line, generator, getitem_branch, reward_branch), command = docs_tasks_blocks()
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    [current] = [line for line in source.splitlines() if line.startswith("TASK_ARGS = ")]
    source = source.replace(current + "\n", task_args_line)
    for anchor, branch in (
        ('        if task == "toy":', getitem_branch),
        ('    raise ValueError(f"unknown task', reward_branch),
    ):
        assert source.count(anchor) == 1, anchor
        source = source.replace(anchor, branch + anchor)
    copy_project(tmp_path, source + "\n\n" + generator)
    flags = command.split("train.py ")[1].split()
    run = torchrun(2, *flags, "--steps", "2", "--test_size", "8", "--out_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert len(rows) == 2 and all(r["reward_errors"] == 0 for r in rows)
    for r in rows:  # the random tiny model: answers rarely boxed, never right; the sum weighs format by 0.1
        assert r["reward"] == pytest.approx(r["reward/correct"] + 0.1 * r["reward/format"], abs=1e-12)
        assert r["accuracy"] == pytest.approx(r["reward/correct"], abs=1e-12)
    baseline = metrics_lines(tmp_path / "out")[0]
    assert baseline["step"] == 0 and {"eval_reward/correct", "eval_reward/format"} <= baseline.keys()
    assert "Calculate " in run.stdout  # a sample's prompt: basic_arithmetic's question
