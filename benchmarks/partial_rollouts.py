"""Partial rollouts against the synchronous step, on a job whose response lengths have a long tail, measured in one
run on one machine: the two runs take turns, a few steps at a time, each going on from its own last checkpoint
(both resume exactly), so that what the machine does meanwhile falls on both alike. Run again, the command goes on
from the turns it has taken.

    python3 benchmarks/partial_rollouts.py                  # SmolLM2-135M-Instruct on additions, 256 tokens
    python3 benchmarks/partial_rollouts.py --steps 4 --turn 2 --max_new_tokens 32 --eval_prompts 8   # a quick look
    python3 benchmarks/partial_rollouts.py --engine sglang --nproc_per_node 1 --max_new_tokens 1024  # a GPU

The job: benchmarks/addition.py's (SmolLM2-135M-Instruct, "What is a + b?", 4 prompts x 8 samples a step, lr 1e-5)
with --max_new_tokens 256, where the model often rambles to the limit. Both runs train with --tis_cap 2 (partial
rollouts need it; the synchronous run's weights stay at 1 where the engine matches, as here). Prints the job's
length distribution (the first policy's responses to the first steps' prompts: median, 90th percentile, max),
then for each run, over the whole run: seconds of generation per trained response, seconds per step, samples per
second, reward per step and per minute, held-out greedy accuracy, and staleness; then the ratios. --out_json
writes them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engines  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
from addition import JOB  # noqa: E402
from smollm2 import write_smollm2  # noqa: E402

RUNS = {"synchronous": {}, "partial": {"partial_rollouts": "true"}}


def length_distribution(folder, job, prompts):
    """Response lengths (tokens) of the first policy: G samples of each of the first `prompts` training prompts."""
    cfg = train.Config(model=folder, **job)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = engines.HFEngine(AutoConfig.from_pretrained(folder), torch.device("cpu"))
    engine.model.load_state_dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict())
    items = train.step_items(train.PromptDataset(cfg, "train"), 0, cfg, 0, 1)[:prompts]
    ids = [reward.encode_prompt(tokenizer, item["prompt"]) for item in items for _ in range(cfg.group_size)]
    budgets = [cfg.max_new_tokens] * len(ids)
    outputs = engine.generate(ids, budgets, cfg.temperature, 1.0, 0, reward.stop_token_ids(tokenizer), cfg.seed)
    return sorted(len(response) for response, *_ in outputs)


def run_segment(folder, out_dir, job, steps, flags, engine, nproc, micro_batch_size):
    """train.py on `nproc` ranks up to step `steps`, going on from out_dir's last checkpoint."""
    all_flags = {
        **job,
        **flags,
        "model": folder,
        "steps": steps,
        "save_every": 0,
        "micro_batch_size": micro_batch_size,
        "reward_workers": 2,
        "eval_k": 1,
        "tis_cap": 2,
        "resume": "auto",
        "out_dir": out_dir,
        "engine": engine,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    cmd += [arg for key, value in all_flags.items() for arg in (f"--{key}", str(value))]
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)


def rows_of(out_dir):
    """The steps' rows of a run's metrics.jsonl (not step 0's, the evaluation before training); none before it
    starts."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [row for row in map(json.loads, f) if row["step"] > 0]


def summary(rows):
    """A run's figures over all its steps, from its metrics.jsonl rows."""
    samples = sum(r["samples"] for r in rows)
    minutes = sum(r["time_step"] for r in rows) / 60
    evals = [(r["step"], r["eval_greedy_acc"]) for r in rows if "eval_greedy_acc" in r]
    return {
        "generation_s_per_trained_response": sum(r["time_rollout"] for r in rows) / samples,
        "s_per_step": minutes * 60 / len(rows),
        "samples_per_s": samples / (minutes * 60),
        "reward_per_step": statistics.mean(r["reward"] for r in rows),
        "reward_last_quarter": statistics.mean(r["reward"] for r in rows[-max(1, len(rows) // 4) :]),
        "reward_per_minute": sum(r["reward"] for r in rows) / minutes,
        "held_out_greedy_acc": evals,
        "response_len_mean": statistics.mean(r["response_len"] for r in rows),
        "truncated": statistics.mean(r["truncated"] for r in rows),
        "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
        "staleness_max": max(r.get("staleness_max", 0.0) for r in rows),
        "responses_carried_mean": statistics.mean(r.get("responses_carried", 0.0) for r in rows),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--turn", type=int, default=5, help="steps a run takes before the other's turn")
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--round_tokens", type=int, default=0, help="0: --max_new_tokens / 8 (128 of 1,024)")
    parser.add_argument("--prompts_per_step", type=int, default=JOB["prompts_per_step"])
    parser.add_argument("--eval_prompts", type=int, default=50)
    parser.add_argument("--model_dir", default="runs/smollm2-135m-instruct")
    parser.add_argument("--out_dir", default="runs/partial-rollouts")
    parser.add_argument("--out_json", default="")
    parser.add_argument("--engine", choices=("hf", "sglang"), default="hf", help="train.py's rollout engine")
    parser.add_argument("--nproc_per_node", type=int, default=2, help="train.py's ranks (one per GPU with sglang)")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="train.py's flag: 4 x 300 tokens fit 24 GB")
    args = parser.parse_args()
    job = dict(JOB, max_new_tokens=args.max_new_tokens, prompts_per_step=args.prompts_per_step)
    job.update(eval_prompts=args.eval_prompts, eval_every=args.eval_every)
    round_tokens = args.round_tokens or max(1, args.max_new_tokens // 8)
    RUNS["partial"]["round_tokens"] = round_tokens
    folder = os.path.abspath(args.model_dir)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        write_smollm2(folder)
    for done in range(args.turn, args.steps + args.turn, args.turn):
        for name, flags in RUNS.items():
            out_dir = os.path.abspath(os.path.join(args.out_dir, name))
            steps = min(done, args.steps)
            if steps <= len(rows_of(out_dir)):  # a turn an earlier call of this command took
                continue
            run_segment(folder, out_dir, job, steps, flags, args.engine, args.nproc_per_node, args.micro_batch_size)
            print(f"{name}: step {steps}", flush=True)
    lengths = length_distribution(folder, job, prompts=job["prompts_per_step"])  # after the runs: their memory free
    cut = sum(n == args.max_new_tokens for n in lengths) / len(lengths)
    median, p90 = lengths[len(lengths) // 2], lengths[int(0.9 * (len(lengths) - 1))]
    print(f"lengths of the first policy's {len(lengths)} responses: median {median}, 90th percentile {p90}, ", end="")
    print(f"max {lengths[-1]} (limit {args.max_new_tokens}, {cut:.0%} cut off)", flush=True)
    results = {"lengths": {"median": median, "p90": p90, "max": lengths[-1], "cut": cut}}
    for name in RUNS:
        results[name] = summary(rows_of(os.path.join(args.out_dir, name)))
    sync, partial = results["synchronous"], results["partial"]
    print(f"\n{'':38s} {'synchronous':>12s} {'partial':>12s} {'ratio':>8s}")
    for key in sync:
        if key == "held_out_greedy_acc":
            continue
        ratio = partial[key] / sync[key] if sync[key] else float("nan")
        print(f"{key:38s} {sync[key]:12.3f} {partial[key]:12.3f} {ratio:8.2f}")
    print(f"{'held_out_greedy_acc (step, acc)':38s} {sync['held_out_greedy_acc']} | {partial['held_out_greedy_acc']}")
    productive = sync["generation_s_per_trained_response"] / partial["generation_s_per_trained_response"]
    print(f"\ngeneration {productive:.2f}x as productive (trained responses per second of generation), ", end="")
    print(f"step time x{partial['s_per_step'] / sync['s_per_step']:.2f}, --round_tokens {round_tokens}")
    results.update(productive=productive, round_tokens=round_tokens, job=job, steps=args.steps)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
