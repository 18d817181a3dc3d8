"""Checkpoints and resume through torchrun: k steps + resume + k steps equals 2k steps exactly, a kill at any
moment leaves a loadable checkpoint, and the HF folder loads with from_pretrained and holds the trained weights."""

import json
import os
import pathlib
import re
import resource
import signal
import stat
import string
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import checkpoint
import launch
import reward
import train
from demo_model import demo_config, demo_tokenizer
from test_train import ROOT, metrics, metrics_lines, torchrun
from workers import run_ranks

FLAGS = (
    "--preset",
    "cpu",
    "--eval_every",
    "3",
    "--eval_prompts",
    "4",
    "--warmup_steps",
    "2",
    "--lr_schedule",
    "cosine",
)
TIMING = ("time_", "eta_s")


def logged(out_dir):
    """The metrics of each step without the timings, which no two runs share."""
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in metrics(out_dir)]


def hf_weights(out_dir, step):
    folder = os.path.join(out_dir, "checkpoints", f"step_{step:06d}", "hf")
    return {
        k: v
        for name in os.listdir(folder)
        if name.endswith(".safetensors")
        for k, v in load_file(os.path.join(folder, name)).items()
    }


def test_k_steps_resume_k_steps_equals_2k_steps(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert torchrun(2, *FLAGS, "--steps", "6", "--out_dir", str(straight)).returncode == 0
    first = torchrun(2, *FLAGS, "--steps", "3", "--out_dir", str(split))
    assert first.returncode == 0, first.stderr[-3000:]
    # A save that died half-way (a .tmp folder) must be ignored by --resume auto.
    os.makedirs(split / "checkpoints" / "step_000005.tmp" / "dcp")
    (split / "checkpoints" / "step_000005.tmp" / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 10)
    second = torchrun(2, *FLAGS, "--steps", "6", "--resume", "auto", "--out_dir", str(split))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming " in second.stdout and "checkpoints/step_000003... " in second.stdout
    assert logged(split) == logged(straight)  # same rewards, losses, grad norms, eval, step by step
    # The evaluation before training belongs to the first start: the resumed run keeps its line and adds none.
    assert "step 0/3\n" in first.stdout and "step 0/" not in second.stdout
    assert [row["step"] for row in metrics_lines(split)] == list(range(7))
    assert metrics_lines(split)[0] == metrics_lines(straight)[0]
    # lr 1e-2: warm-up over 2 steps, then cosine from 1 down to 0.1 at the last of 6: 1 + cos(pi x (0, 1/3, 2/3, 1))
    assert [row["lr"] for row in logged(split)] == pytest.approx([0.005, 0.01, 0.01, 0.00775, 0.00325, 0.001])
    a, b = hf_weights(straight, 6), hf_weights(split, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(os.listdir(split / "checkpoints")) == ["step_000003", "step_000006"]  # a save removes any .tmp


def test_hf_folder_loads_with_from_pretrained_and_holds_the_trained_weights(tmp_path):
    run = torchrun(2, "--preset", "cpu", "--steps", "2", "--eval_every", "0", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "checkpoints" / "step_000002"
    model = AutoModelForCausalLM.from_pretrained(folder / "hf")
    # The export loads as it was trained: the tokenizer (AutoTokenizer and train.py --model alike) gives the
    # training ids and round-trips; config and generation config carry the stop and pad ids; files are 0644.
    trained_with = demo_tokenizer()
    for tokenizer in (
        AutoTokenizer.from_pretrained(folder / "hf"),
        checkpoint.load_tokenizer_and_config(
            train.Config(model=str(folder / "hf"), max_new_tokens=1), [{"prompt": ""}]
        )[0],
    ):
        for text in ("Say a:", "a b\n\tc  d", string.printable):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            assert ids == trained_with(text, add_special_tokens=False).input_ids and tokenizer.decode(ids) == text
        assert reward.stop_token_ids(tokenizer) == reward.stop_token_ids(trained_with)
    stop_ids, pad_id = reward.stop_token_ids(trained_with), trained_with.pad_token_id
    generation = GenerationConfig.from_pretrained(folder / "hf")
    assert (model.config.eos_token_id, model.config.pad_token_id) == (stop_ids, pad_id)
    assert (generation.eos_token_id, generation.pad_token_id) == (stop_ids, pad_id)
    for name in os.listdir(folder / "hf"):
        assert stat.S_IMODE(os.stat(folder / "hf" / name).st_mode) == 0o644, name
    # The distributed checkpoint, converted by torch's own tool, is an independent copy of the trained weights.
    dcp_to_torch_save(folder / "dcp", tmp_path / "full.pt")
    trained = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    for name, param in model.named_parameters():  # a tied lm_head is embed_tokens itself, and saved as that
        assert torch.equal(param, trained[name]), name
    initial = AutoModelForCausalLM.from_config(model.config)  # and they did move away from the start
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, initial.model.layers[0].mlp.up_proj.weight)


def test_a_resume_takes_the_flags_given_and_names_the_changed_and_a_refused_run_leaves_the_folder_alone(tmp_path):
    flags = ("--preset", "cpu", "--eval_every", "0", "--out_dir", str(tmp_path))
    first = torchrun(2, *flags, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    written = (tmp_path / "config.json").read_text()
    # A fresh run must not mix its checkpoints with this run's: refused, naming the ways out, the run's record kept.
    again = torchrun(2, *flags, "--steps", "2", "--lr", "0.5")
    assert again.returncode != 0 and "holds checkpoints after step 0" in again.stderr + again.stdout
    assert (tmp_path / "config.json").read_text() == written
    # AdamW's decay is the flag's, not the checkpoint optimizer's: lr 0.01 x decay 100 zeroes each weight before its
    # Adam step of about lr, so the final norm's weights (ones at the start) fall to near 0.
    resumed = torchrun(2, *flags, "--steps", "3", "--weight_decay", "100", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "flags changed since it was saved: --steps 2 -> 3, --weight_decay 0.0 -> 100.0\n" in resumed.stdout
    before, after = hf_weights(tmp_path, 2)["model.norm.weight"], hf_weights(tmp_path, 3)["model.norm.weight"]
    assert before.abs().min() > 0.5 and after.abs().max() < 0.1


def kill_tree(pid):
    """SIGKILL a process and all its descendants at once, as a node failure or an OOM killer would: torchrun
    starts its workers in sessions of their own, so killing its process group is not enough."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_kill_at_a_random_moment_loses_at_most_the_steps_since_the_last_checkpoint(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        "--preset",
        "cpu",
        "--steps",
        "200",
        "--save_every",
        "1",
        "--eval_every",
        "0",
        "--out_dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not os.path.exists(tmp_path / "checkpoints" / "step_000004"):
            time.sleep(0.05)
        time.sleep(0.37)  # somewhere inside a later step or save
    finally:
        kill_tree(proc.pid)
        proc.wait()
    saved = [n for n in os.listdir(tmp_path / "checkpoints") if not n.endswith(".tmp")]
    last = max(int(n.split("_")[1]) for n in saved)
    logged_steps = len(metrics(tmp_path))
    assert last >= 4 and logged_steps - last <= 1  # a kill loses at most the step in flight
    resumed = torchrun(
        2,
        "--preset",
        "cpu",
        "--steps",
        str(last + 2),
        "--eval_every",
        "0",
        "--resume",
        "auto",
        "--out_dir",
        str(tmp_path),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {tmp_path}/checkpoints/step_{last:06d}... " in resumed.stdout
    assert [row["step"] for row in metrics(tmp_path)] == list(range(1, last + 3))
    # --keep_checkpoints 2: the newest two are left, and no .tmp of a save that the kill cut off
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step_{last:06d}", f"step_{last + 2:06d}"]


@pytest.mark.parametrize(
    "sig, to", [(signal.SIGTERM, "torchrun"), (signal.SIGINT, "torchrun"), (signal.SIGTERM, "ranks")]
)
def test_sigterm_or_ctrl_c_finishes_the_step_saves_and_exits_saying_where_the_results_are(sig, to, tmp_path):
    """SIGTERM: what a scheduler sends before preempting the job. Ctrl-C in a terminal reaches torchrun alone (its
    ranks run in sessions of their own), which forwards it to every rank, then prints its own traceback and exits 1
    whatever the ranks did: the trainer's last line above it is what matters. Sent to the ranks alone, the stop is
    clean under torchrun too: exit 0, no traceback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    cmd += ["--preset", "cpu", "--steps", "500", "--eval_every", "0", "--out_dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/500"):
            if to == "torchrun":
                proc.send_signal(sig)
            else:
                for rank in psutil.Process(proc.pid).children():
                    rank.send_signal(sig)
            break
    stdout, stderr = proc.communicate(timeout=120)
    out = "".join(lines) + stdout
    assert out.count(f"{sig.name}: finishing this step, then saving a checkpoint") == 1, out[-3000:]  # rank 0's
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"stopped after step (\d+) in 0:00:\d\d: checkpoint (\S+), metrics (\S+); continue with "
        r"--resume auto",
        last,
    )
    assert match, out[-3000:]
    step = int(match.group(1))
    assert match.group(2) == f"{tmp_path}/checkpoints/step_{step:06d}" and match.group(3) == f"{tmp_path}/metrics.jsonl"
    assert os.path.isdir(tmp_path / "checkpoints" / f"step_{step:06d}" / "hf")
    assert [row["step"] for row in metrics(tmp_path)] == list(range(1, step + 1))
    with open(tmp_path / "checkpoints" / f"step_{step:06d}" / "trainer_state.json") as f:
        assert json.load(f)["step"] == step
    if to == "ranks":
        assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    else:
        assert proc.returncode != 0 and "SignalException" in stderr  # torchrun's own, after the trainer's line


def test_a_save_that_fails_for_lack_of_space_removes_its_tmp_folder_and_says_so_once(tmp_path):
    """A file-size limit (as a full disk) makes the checkpoint's writes fail with EFBIG: the run stops with one line
    naming the checkpoint, and no step_N.tmp is left for --resume to trip on."""

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the tiny model's weights are ~350 KB

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        "--preset",
        "cpu",
        "--steps",
        "2",
        "--eval_every",
        "0",
        "--out_dir",
        str(tmp_path),
    ]
    run = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert out.count("checkpoints/step_000002 failed (") == 1, out[-3000:]
    assert f"removed {tmp_path}/checkpoints/step_000002.tmp" in out
    assert os.listdir(tmp_path / "checkpoints") == []
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def save_two_checkpoints_recording_syncs(rank, world, out_dir):
    """Checkpoints of steps 1 and 2 of the tiny model, with every sync and rename recorded in order, and what the
    checkpoint folder held at each sync."""
    events, sync, replace = [], os.sync, os.replace
    os.sync = lambda: events.append(("sync", sorted(str(p) for p in pathlib.Path(out_dir).rglob("*")))) or sync()
    os.replace = lambda src, dst: events.append(("replace", str(src), str(dst))) or replace(src, dst)
    par = launch.parallel_groups("cpu", 1)
    cfg, config = train.Config(model="tiny", out_dir=out_dir), demo_config()
    model = train.build_model(config, par.mesh, torch.device("cpu"))
    checkpoint.load_weights([model], [None], cfg, config, par.world_group)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        checkpoint.save(cfg, step, model, optimizer, demo_tokenizer(), None, par.world_group)
    return events


def test_a_checkpoint_is_on_disk_before_its_rename_and_the_rename_after_it(tmp_path):
    """A power cut then leaves the old checkpoint or the new one whole: every file and folder of step_N.tmp is
    synced to disk (os.sync: all of them, the dcp shards of other ranks too) before the rename to step_N, and the
    rename itself after it."""
    events = run_ranks(save_two_checkpoints_recording_syncs, 1, str(tmp_path))[0]
    final = str(tmp_path / "checkpoints" / "step_000001")
    rename = events.index(("replace", final + ".tmp", final))
    kind, before = events[rename - 1]
    on_disk = {
        os.path.join(root, name).replace(final, final + ".tmp")
        for root, folders, files in os.walk(final)
        for name in folders + files
    }
    assert kind == "sync" and on_disk <= set(before) and len(on_disk) >= 8  # dcp/, hf/, trainer_state.json
    assert events[rename + 1] == ("sync", events[rename + 1][1]) and final in events[rename + 1][1]
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()


def test_a_damaged_checkpoint_stops_its_resume_in_one_line_naming_the_file_and_auto_takes_the_newest_whole_one(
    tmp_path, capsys
):
    run_ranks(save_two_checkpoints_recording_syncs, 1, str(tmp_path))
    first, second = (str(tmp_path / "checkpoints" / f"step_{step:06d}") for step in (1, 2))
    model = demo_config()

    def resume(path):
        return checkpoint.find_resume(train.Config(model="tiny", out_dir=str(tmp_path), resume=path), model)

    assert resume("auto")[:2] == (second, 2)
    [shard] = [name for name in os.listdir(f"{second}/dcp") if name.endswith(".distcp")]
    with open(f"{second}/dcp/{shard}", "r+b") as f:  # cut short, as by a full disk or a copy that stopped
        f.truncate(100)
    with pytest.raises(
        SystemExit,
        match=f"--resume {second}: not a whole checkpoint \\(dcp/{shard} is not the \\d+ "
        "bytes saved\\): --resume auto takes the newest whole one",
    ):
        resume(second)
    os.remove(f"{first}/hf/model.safetensors")
    with pytest.raises(SystemExit, match=f"not a whole checkpoint \\(No such file or directory: {first}/hf/model"):
        resume(first)
    pathlib.Path(first, "trainer_state.json").write_text('{"step": 1, "wandb')  # a torn write
    with pytest.raises(SystemExit, match="not a whole checkpoint \\(trainer_state.json is not the JSON saved\\)"):
        resume(first)
    # A folder that does not exist is said to be none, with the way on.
    with pytest.raises(SystemExit, match=f"--resume {tmp_path}/nowhere: no such folder: .* or --resume auto"):
        resume(str(tmp_path / "nowhere"))
    # auto: both damaged, so a fresh start; each moved aside, out of the way of the saves to come, and named.
    capsys.readouterr()
    assert resume("auto") == ("", 0, None)
    out = capsys.readouterr().out
    assert f"--resume auto: skipping {second} (dcp/{shard} is not the" in out and f"moved to {second}.damaged" in out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001.damaged", "step_000002.damaged"]


def test_resume_auto_goes_on_from_the_newest_whole_checkpoint_past_a_damaged_one(tmp_path):
    flags = ("--preset", "cpu", "--eval_every", "0", "--save_every", "1", "--out_dir", str(tmp_path))
    assert torchrun(2, *flags, "--steps", "2").returncode == 0
    second = tmp_path / "checkpoints" / "step_000002"
    (second / "trainer_state.json").write_text("")
    resumed = torchrun(2, *flags, "--steps", "3", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping {second} (trainer_state.json is not the JSON saved), moved to {second}.damaged" in resumed.stdout
    assert f"resuming {tmp_path}/checkpoints/step_000001... " in resumed.stdout
    assert [row["step"] for row in metrics(tmp_path)] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002", "step_000002.damaged", "step_000003"]
