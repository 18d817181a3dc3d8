"""Several nodes and the waits between ranks, through torchrun on this machine: two torchrun agents on 127.0.0.1 act
as two nodes of 2 ranks each (--tp 2: an engine per node). A shared --out_dir trains, saves and resumes exactly; a
folder that only one node sees is refused at start. Every wait the trainer makes (train.py and the modules beside it)
runs on a gloo group."""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

from test_checkpoint import logged
from test_train import ROOT, torchrun
from workers import free_port

FLAGS = ("--preset", "cpu", "--tp", "2", "--eval_every", "0", "--save_every", "2")


def two_nodes(*flags, cwds=(ROOT, ROOT), timeout=600):
    """train.py on two torchrun agents (node ranks 0 and 1, 2 ranks each), each started in its own folder; returns
    (both exit codes, both outputs, seconds)."""
    port, start = free_port(), time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "2",
                "--node_rank",
                str(node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "train.py",
                *flags,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node, cwd in enumerate(cwds)
    ]
    outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    return [agent.returncode for agent in agents], "".join(outputs), time.monotonic() - start


def test_two_nodes_with_a_shared_out_dir_train_save_and_resume_as_one_uninterrupted_run(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    codes, out, _ = two_nodes(*FLAGS, "--steps", "4", "--out_dir", str(straight))
    assert codes == [0, 0], out[-3000:]
    codes, out, _ = two_nodes(*FLAGS, "--steps", "2", "--out_dir", str(split))
    assert codes == [0, 0], out[-3000:]
    codes, out, _ = two_nodes(*FLAGS, "--steps", "4", "--resume", "auto", "--out_dir", str(split))
    assert codes == [0, 0], out[-3000:]
    assert "checkpoints/step_000002... " in out  # rank 0 chose the folder, every rank loaded it
    assert logged(split) == logged(straight) and len(logged(straight)) == 4
    assert sorted(os.listdir(split / "checkpoints")) == ["step_000002", "step_000004"]  # nothing left in .tmp


def test_an_out_dir_that_the_other_node_does_not_see_is_refused_at_start_in_one_line(tmp_path):
    """Each agent in its own copy of the project with the default relative --out_dir: two folders, one per node."""
    copies = []
    for node in range(2):
        copy = tmp_path / f"node{node}"
        copy.mkdir()
        for path in glob.glob(os.path.join(ROOT, "*.py")):  # train.py and the modules beside it
            shutil.copy(path, copy)
        copies.append(str(copy))
    codes, out, seconds = two_nodes(*FLAGS, "--steps", "2", cwds=copies)
    assert codes[0] != 0 and codes[1] != 0 and seconds < 60, (codes, seconds)
    assert out.count("--out_dir runs/cpu: ranks on other nodes do not see what rank 0 writes there") == 1, out
    assert "a folder every node sees" in out and "loading" not in out
    assert os.listdir(os.path.join(copies[0], "runs", "cpu")) == ["config.json"]  # the check's own file is gone


def test_every_wait_and_object_collective_of_a_run_is_on_a_gloo_group_not_the_default_one(tmp_path):
    """On a GPU the default group is NCCL, bound to the device: a barrier there spins a kernel on the GPU that the
    engine uses. A run with an engine per TP group of 2, evaluation and checkpoints goes through every kind of wait;
    each must name a gloo group of its own. (The device mesh's own collectives, in the forward pass, are not waits.)"""
    run = torchrun(
        2,
        *FLAGS,
        "--steps",
        "2",
        "--eval_every",
        "1",
        "--save_every",
        "1",
        "--out_dir",
        str(tmp_path),
        "--max_tokens_per_microbatch",
        "256",
        script="tests/record_waits.py",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"waits_rank{rank}.json") as f:
            calls = [c for c in json.load(f) if c["caller"] != "logprobs_and_entropy"]
        callers = {c["caller"] for c in calls}
        for needed in (
            "check_every_rank_sees",
            "on_first_rank",
            "free_gpu_cache",
            "push_weights",
            "set_loss_weights",
            "micro_batches",
            "any_rank",
            "max_over_world",
            "sum_over_world",
            "save",
            "main",
        ):
            assert needed in callers, (needed, callers)
        # evaluate's sums go through sum_over_world, which step_metrics' calls too: one of its calls is evaluate's.
        assert any(c["caller"] == "sum_over_world" and "evaluate" in c["callers"] for c in calls), calls
        wrong = [c for c in calls if c["default"] or c["backend"] != "gloo"]
        assert not wrong, wrong
