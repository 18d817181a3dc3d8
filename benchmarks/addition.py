"""A real pretrained model learns on a CPU: SmolLM2-135M-Instruct on held-out additions, with train.py or TRL.

    python3 benchmarks/addition.py                 # train.py on 2 ranks (torchrun), ~45 min on 2 cores
    python3 benchmarks/addition.py --trainer trl   # the same job with TRL's GRPOTrainer, one process
    python3 benchmarks/addition.py --trainer trl --vllm   # TRL generating with vLLM in its process (GPU, colocate)
    python3 benchmarks/addition.py --lora_rank 16 --lr 1e-4   # train.py with LoRA (rank 16, alpha 32)

Prints the held-out greedy accuracy before and after, and the curve (reward, accuracy, held-out accuracy, seconds
per step, peak memory per process); --out_json writes the summary (benchmarks/gpu.py reads it). Both trainers get
the same model, data, prompts, G, batch, learning rate, steps, response length and loss (DAPO's token mean, no KL,
one update per batch, temperature 1). --prompts_per_step, --group_size, --max_new_tokens and --eval_prompts shrink
the job (gpu.py's CPU run); --lr and --lora_rank (train.py only) change the update. On a GPU, TRL trains there in
bf16 autocast over fp32 weights, as train.py does.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engines  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
from smollm2 import write_smollm2  # noqa: E402

JOB = dict(
    task="addition",
    train_size=700,
    test_size=200,
    prompts_per_step=4,
    group_size=8,
    max_new_tokens=48,
    lr=1e-5,
    warmup_steps=0,
    temperature=1.0,
    eval_prompts=100,
    lora_rank=0,
)
SIZES = ("prompts_per_step", "group_size", "max_new_tokens", "eval_prompts")  # flags that shrink the job


def held_out_greedy_accuracy(folder, cfg):
    """Greedy accuracy on the first --eval_prompts held-out prompts, as train.py's evaluation scores them."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = engines.HFEngine(AutoConfig.from_pretrained(folder), torch.device("cpu"))
    engine.model.load_state_dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict())
    test_set = train.PromptDataset(cfg, "test")
    items = [test_set[i] for i in range(cfg.eval_prompts)]
    prompts = [reward.encode_prompt(tokenizer, item["prompt"]) for item in items]
    outputs = engine.generate(
        prompts, [cfg.max_new_tokens] * len(prompts), 0.0, 1.0, 0, reward.stop_token_ids(tokenizer), cfg.seed
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, *_ in outputs]
    return sum(reward.reward_fn(text, item) >= 1 for text, item in zip(texts, items)) / len(items)


def run_train_py(folder, out_dir, steps, eval_every, engine="hf", nproc=2, job=JOB):
    flags = {
        **job,
        "model": folder,
        "steps": steps,
        "eval_every": eval_every,
        "eval_k": 1,
        "save_every": 0,
        "eval_before_train": "false",  # the accuracy before is measured apart, alike for both trainers
        "micro_batch_size": 16,
        "reward_workers": 2,
        "out_dir": out_dir,
        "engine": engine,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    cmd += [arg for key, value in flags.items() for arg in (f"--{key}", str(value))]
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest rank (or worker)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [dict(json.loads(line), peak_rss_mb=peak_mb) for line in f]


def run_trl(folder, out_dir, steps, eval_every, job=JOB, vllm=False):
    """TRL's GRPOTrainer on one process (both cores, or the GPU), with train.py's data, prompts and reward_fn;
    vllm: generation by vLLM in the trainer's process (TRL's colocate mode)."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = train.Config(model=folder, **job)
    train_set, rows = train.PromptDataset(cfg, "train"), []
    for step in range(steps):  # the same prompts, step by step, as train.py draws them
        rows += train.step_items(train_set, step, cfg, 0, 1)
    data = datasets.Dataset.from_list([{key: r[key] for key in ("prompt", "answer", "task")} for r in rows])

    def addition_reward(completions, answer, task, **_):
        items = [{"answer": a, "task": t} for a, t in zip(answer, task)]
        return [reward.reward_fn(c[0]["content"], item) for c, item in zip(completions, items)]

    log = []

    class Curve(TrainerCallback):  # seconds per step (evaluation excluded), peak memory, held-out accuracy
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            row = {
                "step": state.global_step,
                "time_step": time.perf_counter() - self.start,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
            if state.global_step % eval_every == 0 or state.global_step == steps:
                kwargs["model"].save_pretrained(os.path.join(out_dir, "eval_model"))
                AutoTokenizer.from_pretrained(folder).save_pretrained(os.path.join(out_dir, "eval_model"))
                row["eval_greedy_acc"] = held_out_greedy_accuracy(os.path.join(out_dir, "eval_model"), cfg)
            log.append(row)
            print(json.dumps(row), flush=True)

    gpu = torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=not gpu,
        bf16=gpu,
        use_vllm=vllm,
        vllm_mode="colocate",
        per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_new_tokens,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.clip_low,
        epsilon_high=cfg.clip_high,
        temperature=cfg.temperature,
        top_k=0,
        num_iterations=1,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=folder, reward_funcs=addition_reward, args=args, train_dataset=data, callbacks=[Curve()]
    )
    trainer.train()
    rewards = {h["step"]: float(h["reward"]) for h in trainer.state.log_history if "reward" in h}  # after on_step_end
    return [dict(row, reward=rewards[row["step"]]) for row in log]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("train.py", "trl"), default="train.py")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--model_dir", default="runs/smollm2-135m-instruct")
    parser.add_argument("--out_dir", default="")
    parser.add_argument("--engine", choices=("hf", "sglang"), default="hf", help="train.py's rollout engine")
    parser.add_argument("--nproc_per_node", type=int, default=2, help="train.py's ranks (one per GPU with sglang)")
    parser.add_argument("--vllm", action="store_true", help="TRL: generate with vLLM in its process (colocate)")
    parser.add_argument("--out_json", default="", help="write the summary here")
    for key in SIZES:
        parser.add_argument(f"--{key}", type=int, default=JOB[key])
    parser.add_argument("--lr", type=float, default=JOB["lr"], help="AdamW's learning rate")
    parser.add_argument(
        "--lora_rank", type=int, default=JOB["lora_rank"], help="train.py: LoRA of this rank (0: full fine-tuning)"
    )
    args = parser.parse_args()
    if args.trainer == "trl" and args.lora_rank:
        parser.error("--lora_rank: train.py only (the TRL run is full fine-tuning)")
    job = {**JOB, **{key: getattr(args, key) for key in (*SIZES, "lr", "lora_rank")}}
    folder = os.path.abspath(args.model_dir)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        write_smollm2(folder)
    out_dir = os.path.abspath(args.out_dir or f"runs/addition-{args.trainer.replace('.py', '')}")
    before = held_out_greedy_accuracy(folder, train.Config(model=folder, **job))
    print(f"held-out greedy accuracy before: {before:.3f}", flush=True)
    start = time.perf_counter()
    if args.trainer == "trl":
        rows = run_trl(folder, out_dir, args.steps, args.eval_every, job, args.vllm)
    else:
        rows = run_train_py(folder, out_dir, args.steps, args.eval_every, args.engine, args.nproc_per_node, job)
    minutes = (time.perf_counter() - start) / 60
    print("\nstep | reward | held-out greedy acc | s/step | peak MB per process")
    for r in rows:
        acc = f"{r['eval_greedy_acc']:.3f}" if "eval_greedy_acc" in r else ""
        print(f"{r['step']:4d} | {r['reward']:.3f} | {acc:>6} | {r['time_step']:.1f} | {r['peak_rss_mb']:.0f}")
    after = [r["eval_greedy_acc"] for r in rows if "eval_greedy_acc" in r][-1]
    print(
        f"\n{args.trainer}: held-out greedy accuracy {before:.3f} -> {after:.3f} in {args.steps} steps, "
        f"{minutes:.1f} min"
    )
    if args.out_json:
        timed = [r["time_step"] for r in rows[1:] or rows]  # the first step warms up (CUDA, SGLang, vLLM)
        summary = dict(
            trainer=args.trainer,
            vllm=args.vllm,
            steps=args.steps,
            minutes=minutes,
            accuracy_before=before,
            accuracy_after=after,
            seconds_per_step=sum(timed) / len(timed),
            job=job,
        )
        with open(args.out_json, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
