"""A run that its cluster stops: slurm/train.sbatch run as SLURM runs it, by stand-ins for sbatch, srun and scontrol
(tests/slurm_standins/: the script's commands here, two torchrun agents on 127.0.0.1 as two nodes of one rank each,
a requeue recorded and run); and train.py's stop within --stop_grace, whatever a step's length.

- The script's two agents rendezvous and learn the demo; a run that finishes, or fails, is not requeued.
- SIGUSR1 to the batch shell (the time limit's warning): every rank stops at one step with its checkpoint,
  status.json says "stopped", the job requeues itself, and the requeued job ends on the straight run's numbers.
- SIGTERM to one rank alone, or to a node's torchrun agent: every rank stops at one step, and the script reads
  "stopped" (the agent itself exits 1).
- A step slower than the grace: a stop mid-rollout saves the last step's state within the grace, and the resumed
  run equals the straight run.
- A second Ctrl-C while the stop's checkpoint is written: only whole checkpoints are left, and --resume auto takes
  the newest."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

import checkpoint
from test_train import ROOT, metrics, torchrun
from workers import free_port

STANDINS = os.path.join(ROOT, "tests", "slurm_standins")
DEMO = ("--preset", "cpu", "--eval_every", "4", "--eval_prompts", "8", "--save_every", "0")


def logged(out_dir):
    """metrics.jsonl's lines, timings aside: what a resumed run must repeat exactly."""
    rows = []
    for row in metrics(out_dir):
        rows.append({key: value for key, value in row.items() if not key.startswith("time_") and key != "eta_s"})
    return rows


def project(tmp_path):
    """A copy of the project where the job runs (the script's folder and the trainer's files), and the stand-ins'
    state folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), folder)
    shutil.copytree(os.path.join(ROOT, "slurm"), folder / "slurm")
    (tmp_path / "slurm").mkdir()
    return folder


def submit(tmp_path, *flags, attempts=3):
    """`sbatch --nodes 2 slurm/train.sbatch FLAGS` through the stand-ins, started; the job's --out_dir is
    tmp_path/run."""
    env = dict(
        os.environ,
        PATH=f"{STANDINS}:{os.environ['PATH']}",
        SLURM_STANDIN_DIR=str(tmp_path / "slurm"),
        SLURM_STANDIN_ATTEMPTS=str(attempts),
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
    )
    cmd = ["sbatch", "--nodes", "2", "slurm/train.sbatch", *flags, "--out_dir", str(tmp_path / "run")]
    return subprocess.Popen(cmd, cwd=tmp_path / "project", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_line(path, prefix, timeout=240):
    """Once a line of `path` starts with `prefix` (the file may not exist yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and any(line.startswith(prefix) for line in open(path, errors="replace")):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no line {prefix!r} in {path}")


def job_output(tmp_path):
    """What the batch shell printed, all attempts."""
    return (tmp_path / "project" / "grpo-4242.out").read_text()


def requeues(tmp_path):
    path = tmp_path / "slurm" / "requeued"
    return path.read_text().split() if path.exists() else []


def status(out_dir):
    with open(os.path.join(out_dir, "status.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The script's job run to its end, not stopped: 16 steps of the demo on two nodes of one rank each."""
    tmp_path = tmp_path_factory.mktemp("straight")
    project(tmp_path)
    job = submit(tmp_path, *DEMO, "--steps", "16")
    out = job.communicate(timeout=600)[0].decode()
    return tmp_path, job.returncode, out


def test_the_script_runs_an_agent_a_node_that_learn_the_demo_and_a_finished_run_is_not_requeued(straight):
    tmp_path, code, out = straight
    assert code == 0, out + job_output(tmp_path)
    assert status(tmp_path / "run") == {
        "status": "done",
        "step": 16,
        "checkpoint": f"{tmp_path}/run/checkpoints/step_000016",
        "why": "",
    }
    assert requeues(tmp_path) == [] and f"done: {tmp_path}/run" in job_output(tmp_path)
    node0 = (tmp_path / "run" / "logs" / "4242-node0.out").read_text()
    assert "step 16/16" in node0 and (tmp_path / "run" / "logs" / "4242-node1.out").exists()  # a log a node
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert rows[-1]["samples"] == 64 and rows[-1]["groups"] == 8  # both nodes' ranks: 4 prompts x G 8 each
    assert sum(r["reward"] for r in rows[-3:]) / 3 > sum(r["reward"] for r in rows[:3]) / 3 + 0.3  # it learns


def test_sigusr1_before_the_time_limit_stops_saves_requeues_and_the_requeued_job_ends_as_the_straight_run(
    straight, tmp_path
):
    project(tmp_path)
    job = submit(tmp_path, *DEMO, "--steps", "16")
    wait_for_line(tmp_path / "run" / "logs" / "4242-node0.out", "step 5/16")
    os.kill(int((tmp_path / "slurm" / "batch.pid").read_text()), signal.SIGUSR1)  # --signal=B:USR1@180
    out = job.communicate(timeout=600)[0].decode()
    assert job.returncode == 0, out + job_output(tmp_path)
    said = job_output(tmp_path)
    assert "SIGUSR1: the time limit is near; asking the run to stop" in said
    assert said.count("stopped with a checkpoint: requeuing job 4242") == 1 and requeues(tmp_path) == ["4242"]
    node0 = (tmp_path / "run" / "logs" / "4242-node0.out").read_text()
    stopped_at = int(re.search(r"stopped after step (\d+) in .*; continue with --resume auto", node0).group(1))
    assert 5 <= stopped_at < 16
    assert f"resuming {tmp_path}/run/checkpoints/step_{stopped_at:06d}" in node0  # the requeued job
    assert status(tmp_path / "run")["status"] == "done" and not (tmp_path / "run" / "STOP").exists()
    assert logged(tmp_path / "run") == logged(straight[0] / "run")  # no step lost, none twice


@pytest.mark.parametrize("target", ["rank", "agent"])
def test_sigterm_to_one_rank_or_to_its_agent_stops_every_rank_at_one_step_and_the_script_reads_stopped(
    target, tmp_path
):
    project(tmp_path)
    job = submit(tmp_path, *DEMO, "--steps", "300", attempts=1)  # the requeue recorded, not run
    wait_for_line(tmp_path / "run" / "logs" / "4242-node0.out", "step 5/300")
    srun = psutil.Process(int((tmp_path / "slurm" / "batch.pid").read_text())).children()[0]
    agent = srun.children()[1]  # node 1's torchrun
    (agent.children()[0] if target == "rank" else agent).send_signal(signal.SIGTERM)
    out = job.communicate(timeout=600)[0].decode()
    assert job.returncode == 0, out + job_output(tmp_path)
    assert "stopped with a checkpoint: requeuing job 4242" in job_output(tmp_path) and requeues(tmp_path) == ["4242"]
    state = status(tmp_path / "run")
    assert state["status"] == "stopped" and state["why"] == "another rank was asked to stop"  # node 1's
    step = state["step"]
    assert state["checkpoint"] == f"{tmp_path}/run/checkpoints/step_{step:06d}" and step >= 5
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, step + 1))
    shards = os.listdir(tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "dcp")
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(shards)  # both nodes' ranks saved the same step
    node1 = (tmp_path / "run" / "logs" / "4242-node1.out").read_text()
    assert ("SignalException" in node1) == (target == "agent")  # an agent signalled exits 1: the file says stopped


def test_a_run_that_fails_is_not_requeued(tmp_path):
    project(tmp_path)
    job = submit(tmp_path, *DEMO, "--steps", "0")  # refused at start
    out = job.communicate(timeout=300)[0].decode()
    assert job.returncode == 1, out
    assert "the run failed (status none" in job_output(tmp_path) and requeues(tmp_path) == []
    assert "--steps must be a number from 1 up, not 0" in (tmp_path / "run" / "logs" / "4242-node0.out").read_text()


SLOW_REWARD = """
    import time

    if completion:  # a grader that takes seconds a completion (the empty one, checked at start, is quick)
        time.sleep(2.0)
    text = completion.strip()"""


def test_a_step_slower_than_the_grace_gives_up_its_rollouts_and_saves_the_last_step_within_the_grace(tmp_path):
    """Each step scores 4 completions a rank for 2 s each on 2 reward workers: ~4 s a step, more than the grace of
    3 s. SIGUSR1 to both ranks mid-rollout: the step's rollouts are given up, the state after the step before it is
    saved and status.json written within the grace; the resumed run (the grader as quick as before) ends on the
    numbers of a straight run, which a grader that takes no time gives too."""
    slow = project(tmp_path)
    source = (slow / "reward.py").read_text()
    (slow / "reward.py").write_text(source.replace("\n    text = completion.strip()", SLOW_REWARD, 1))
    flags = ("--preset", "cpu", "--prompts_per_step", "2", "--group_size", "4", "--eval_every", "0", "--steps", "5")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *flags]
    cmd += ["--stop_grace", "3", "--out_dir", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=slow, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step 2/5"):
            break
    time.sleep(1.0)  # step 3's rollouts: its grader's first calls
    signalled = time.time()
    for rank in psutil.Process(proc.pid).children():
        rank.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "stopped after step 2 in" in out and "saving the checkpoint of step 2..." in out
    state = status(tmp_path / "run")
    assert state["status"] == "stopped" and state["step"] == 2 and state["why"] == "SIGUSR1"
    assert os.path.getmtime(tmp_path / "run" / "status.json") - signalled < 3  # the last byte, within the grace
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    resumed = torchrun(2, *flags, "--resume", "auto", "--out_dir", str(tmp_path / "run"))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    straight = torchrun(2, *flags, "--out_dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stdout[-3000:]
    assert logged(tmp_path / "run") == logged(tmp_path / "straight") and len(logged(tmp_path / "run")) == 5


def test_a_second_ctrl_c_while_the_stop_saves_leaves_whole_checkpoints_and_resume_auto_takes_the_newest(tmp_path):
    flags = ("--preset", "cpu", "--eval_every", "0", "--save_every", "2", "--out_dir", str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*cmd, *flags, "--steps", "300"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 5/300"):
            break
    ranks = psutil.Process(proc.pid).children()
    for rank in ranks:
        rank.send_signal(signal.SIGINT)  # the first: stop
    deadline = time.monotonic() + 60
    while not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "checkpoints")):
        assert time.monotonic() < deadline and proc.poll() is None, "the stop's save never began"
        time.sleep(0.002)
    for rank in ranks:
        rank.send_signal(signal.SIGINT)  # the second, while the checkpoint is written: KeyboardInterrupt
    proc.communicate(timeout=120)
    folders = os.listdir(tmp_path / "checkpoints")
    assert not [name for name in folders if name.endswith(".tmp")], folders  # the cut save removed its folder
    whole = sorted(name for name in folders if name.startswith("step_"))
    assert whole and all(checkpoint.what_is_damaged(tmp_path / "checkpoints" / name) == "" for name in whole)
    newest = int(whole[-1][len("step_") :])
    resumed = torchrun(2, *flags, "--steps", str(newest + 2), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {tmp_path}/checkpoints/{whole[-1]}" in resumed.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, newest + 3))
