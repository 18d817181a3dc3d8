"""One model's multi-turn samples with the Python tool, token by token: which ids were sampled and which are tool
output (no loss), what each turn cost, with train.py's own engine, weight push and rollout loop.

    python3 benchmarks/tool_sample.py --model FOLDER [--engine sglang] [--task addition] [--n 16]

Prints the first sample that ran code (ids, the sampled / tool mask, text) and the time of the rollout.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import engines  # noqa: E402
import launch  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import train  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", default="sglang" if torch.cuda.is_available() else "hf")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--n", type=int, default=16, help="prompts, one sample each")
    parser.add_argument("--max_new_tokens", type=int, default=300)
    args = parser.parse_args()
    cfg = train.Config(
        model=args.model,
        engine=args.engine,
        task=args.task,
        tool="python",
        max_turns=3,
        max_new_tokens=args.max_new_tokens,
        train_size=700,
        test_size=200,
        out_dir="/tmp/tool_sample",
        temperature=1.0,
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=0, world_size=1)
    tokenizer, config = AutoTokenizer.from_pretrained(args.model), AutoConfig.from_pretrained(args.model)
    par = launch.parallel_groups(device.type, 1)
    model = train.build_model(config, par.mesh, device)
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, config, par.world_group)
    workers = sandbox.RewardWorkers(reward.reward_fn, 8, timeout=5.0)
    engine = engines.start_engine(cfg, config, par, device)  # --engine's, owned by this one rank
    try:
        engine.release_memory()  # as main(): a push finds the engine's memory released
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
        items = [train.PromptDataset(cfg, "test")[i] for i in range(args.n)]
        start = time.perf_counter()
        samples, _ = train.generate_rollouts(engine, workers, tokenizer, items, cfg, 0, cfg.temperature)
        seconds = time.perf_counter() - start
        used = [s for s in samples if s.tool_outputs]
        runs = sum(len(s.tool_outputs) for s in samples)
        print(
            f"{len(samples)} samples in {seconds:.2f} s; {len(used)} ran code, {runs} runs; "
            f"reward {sum(s.reward for s in samples) / len(samples):.2f}"
        )
        for s in used[:1] or samples[:1]:
            print("prompt ids:", s.prompt_ids)
            print("response ids:", s.response_ids)
            print("sampled (1) / tool output (0):", "".join(str(int(m)) for m in s.sampled))
            print(f"engine log-probs: {len(s.engine_logprobs)} for {sum(s.sampled)} sampled tokens")
            print("text:\n" + tokenizer.decode(s.prompt_ids) + tokenizer.decode(s.response_ids))
            print("tool outputs:", s.tool_outputs)
    finally:
        launch.shut_down(engine, workers, None)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
