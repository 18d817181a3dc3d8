"""What truncated sampling costs a step on a CPU: SmolLM2-135M-Instruct (a 49,152-token vocabulary) on addition,
train.py's stages one rank runs in a step (rollouts on the HF engine, the old policy's log-probs, the update), with
--top_p 0.9, with --top_k 50, and with neither.

    python3 benchmarks/truncated_sampling.py              # ~9 min on 2 cores; SmolLM2 from PyPI (benchmarks/smollm2.py)
    python3 benchmarks/truncated_sampling.py --smollm2 DIR  # a folder benchmarks/smollm2.py wrote

Each setting runs in a process of its own (peak memory is the process's), the same prompts and seed, --steps steps
after one untimed. Prints one markdown table: seconds per step and per stage as a ratio to "neither" (measured on
this machine in this run; the number of tokens differs with what is sampled, so seconds per sampled token too), the
peak resident memory, what the samples store of the kept sets (ids per sampled token, the largest set, bytes per
step), the mean log kept mass (log of the probability the truncation keeps, which renormalising subtracts from log p)
and the mean |log r| between the trainer's log-probs of the sampled tokens and the engine's (both renormalised when
truncated).
"""

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import engines  # noqa: E402
import launch  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import train  # noqa: E402
from smollm2 import write_smollm2  # noqa: E402

SETTINGS = {"neither": dict(), "top_p 0.9": dict(top_p=0.9), "top_k 50": dict(top_k=50)}
JOB = dict(task="addition", train_size=700, test_size=200, prompts_per_step=4, group_size=8, max_new_tokens=48)


def run_setting(folder, setting, steps):
    """One setting's steps, as train.main runs them on one rank; a dict of its figures."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    par = launch.parallel_groups("cpu", 1)
    cfg = train.Config(model=folder, engine="hf", micro_batch_size=16, lr=1e-5, warmup_steps=0, **JOB)
    cfg = dataclasses.replace(cfg, **SETTINGS[setting])
    dataset = train.PromptDataset(cfg, "train")
    tokenizer, model_config = checkpoint.tokenizer_and_config(cfg.model)
    model = train.build_model(model_config, par.mesh, torch.device("cpu"))
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, model_config, par.world_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine = engines.start_engine(cfg, model_config, par, torch.device("cpu"))
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, cfg.reward_timeout)
    totals = dict(rollout=0.0, logprobs=0.0, update=0.0, tokens=0, kept_ids=0, kept_bytes=0)
    totals.update(log_kept_mass=0.0, mismatch_abs=0.0)
    largest = 0
    try:
        for step in range(steps + 1):  # the first, untimed: allocations and caches warm
            engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
            start = time.perf_counter()
            samples, _, _ = train.collect_rollouts(engine, workers, dataset, tokenizer, None, cfg, step, par)
            rolled = time.perf_counter()
            for sample, logprobs in zip(samples, train.policy_logprobs(model, samples, cfg, par)):
                sample.old_logprobs = logprobs
            logprobs_done = time.perf_counter()
            train.set_advantages(samples, cfg, par.dp_group)
            token_sums, _ = train.train_on_rollouts(model, optimizer, samples, cfg, par)
            end = time.perf_counter()
            if step == 0:
                continue
            totals["rollout"] += rolled - start
            totals["logprobs"] += logprobs_done - rolled
            totals["update"] += end - logprobs_done
            totals["tokens"] += sum(s.num_sampled for s in samples)
            totals["kept_ids"] += sum(len(s.kept_ids) for s in samples)
            totals["kept_bytes"] += sum(s.kept_ids.nbytes + s.kept_sizes.nbytes for s in samples)
            totals["log_kept_mass"] += float(token_sums.get("log_kept_mass", 0.0))
            totals["mismatch_abs"] += float(token_sums["mismatch_abs"])
            largest = max([largest, *[int(s.kept_sizes.max()) for s in samples if len(s.kept_sizes)]])
    finally:
        workers.close()
    dist.destroy_process_group()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return dict(totals, steps=steps, largest_set=largest, peak_mb=peak_mb)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm2", default="", help="a folder benchmarks/smollm2.py wrote (default: write one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--setting", default="", help=argparse.SUPPRESS)  # a child process's one setting
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(args.smollm2, args.setting, args.steps)))
        return
    with tempfile.TemporaryDirectory() as work:
        folder = args.smollm2 or write_smollm2(os.path.join(work, "smollm2"))
        results = {}
        for setting in SETTINGS:
            flags = ["--smollm2", folder, "--steps", str(args.steps), "--setting", setting]
            run = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True, check=True)
            results[setting] = json.loads(run.stdout.strip().splitlines()[-1])
    base = results["neither"]
    shape = f"{JOB['prompts_per_step']} prompts x G {JOB['group_size']}, {JOB['max_new_tokens']} new tokens at most"
    print(f"\nSmolLM2-135M-Instruct, addition, {shape}, one rank, {args.steps} timed steps; times: ratio to neither\n")
    columns = "sampling | s/step | rollouts | log-probs | update | s/token | peak MB | ids/token | largest set"
    print(f"| {columns} | kept sets KB/step | log kept mass | mean abs log r |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting, r in results.items():
        step = r["rollout"] + r["logprobs"] + r["update"]
        base_step = base["rollout"] + base["logprobs"] + base["update"]
        per_token = step / r["tokens"] / (base_step / base["tokens"])
        print(
            f"| {setting} | {step / base_step:.2f} | {r['rollout'] / base['rollout']:.2f} "
            f"| {r['logprobs'] / base['logprobs']:.2f} | {r['update'] / base['update']:.2f} | {per_token:.2f} "
            f"| {r['peak_mb']:.0f} | {r['kept_ids'] / r['tokens']:.1f} | {r['largest_set']} "
            f"| {r['kept_bytes'] / r['steps'] / 1024:.1f} | {r['log_kept_mass'] / r['tokens']:.3f} "
            f"| {r['mismatch_abs'] / r['tokens']:.1e} |"
        )


if __name__ == "__main__":
    main()
