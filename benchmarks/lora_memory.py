"""Memory per GPU of train.py's weights, gradients and AdamW state, full fine-tuning against LoRA, at Qwen2.5 shapes.

    python3 benchmarks/lora_memory.py   # seconds on a CPU: the models are built on the meta device, nothing downloaded

Each model is built by train.build_model (TP plan, add_lora, FSDP) on the meta device on a 1-rank (dp 1, tp 1) mesh;
what trains is what has requires_grad there, so the count follows train.py. Bytes per parameter are those train.py
keeps on a GPU: full fine-tuning an fp32 weight, an fp32 gradient and AdamW's two fp32 moments (16 B); LoRA the
frozen base in bf16 (2 B, no gradient, no state) and the adapters at 16 B. At dp N, FSDP2 keeps 1/N of each
parameter's dim 0 per rank (rounded up). The engine (SGLang, tp 1) holds its own bf16 copy of the whole model on
every GPU. "left" is what an 80 GB GPU keeps for the KV cache and activations once all of these are resident.
Prints one markdown table (GB = 1e9 bytes).
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import launch  # noqa: E402
import train  # noqa: E402

# From Qwen/Qwen2.5-1.5B-Instruct's and Qwen/Qwen2.5-7B-Instruct's config.json (the base models' are the same shapes).
# The 7B's vocabulary is padded to 152,064 rows, the 1.5B's to 151,936; the 1.5B ties lm_head to the embedding.
SHAPES = {
    "Qwen2.5-1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
LORA_RANKS = (0, 1, 16, 64)  # 0: full fine-tuning
LORA_ALPHA = 32.0  # train.py's default; it scales the update and changes no size
DP_SIZES = (1, 8)
GPU_GB = 80.0
TRAINED_BYTES = (4, 4, 8)  # per trained parameter: fp32 weight, fp32 gradient, AdamW's exp_avg + exp_avg_sq in fp32
FROZEN_BYTES = 2  # per frozen parameter (LoRA's base on a GPU): bf16 weight alone
ENGINE_BYTES = 2  # per parameter of the engine's copy: bf16


def shard_numel(shape, dp):
    """Elements one rank keeps of a parameter under FSDP2 over dp ranks: dim 0 split, the last shard padded."""
    return math.ceil(shape[0] / dp) * math.prod(shape[1:])


def count(name, lora_rank, par):
    """Parameter shapes of train.py's model for this shape and LoRA rank: (trained, frozen), and the number of
    elements the engine holds (the base's: it receives LoRA's update merged into the base weights)."""
    model = train.build_model(
        Qwen2Config(**SHAPES[name]), par.mesh, torch.device("meta"), lora_rank=lora_rank, lora_alpha=LORA_ALPHA
    )
    trained = [p.shape for p in model.parameters() if p.requires_grad]
    frozen = [p.shape for p in model.parameters() if not p.requires_grad]
    return trained, frozen, sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    par = launch.parallel_groups("cpu", 1)
    print(
        "| model | training | dp | trained params | weights GB | gradients GB | AdamW GB | trainer GB "
        "| engine bf16 GB | left of 80 GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        for lora_rank in LORA_RANKS:
            trained, frozen, n_base = count(name, lora_rank, par)
            n_trained = sum(math.prod(s) for s in trained)
            n_all = n_trained + sum(math.prod(s) for s in frozen)
            for dp in DP_SIZES:
                t, f = sum(shard_numel(s, dp) for s in trained), sum(shard_numel(s, dp) for s in frozen)
                weights = t * TRAINED_BYTES[0] + f * FROZEN_BYTES
                grads, adam = t * TRAINED_BYTES[1], t * TRAINED_BYTES[2]
                trainer, engine = (weights + grads + adam) / 1e9, n_base * ENGINE_BYTES / 1e9
                mode = f"LoRA r{lora_rank}" if lora_rank else "full"
                print(
                    f"| {name} | {mode} | {dp} | {n_trained / 1e6:,.2f} M ({100 * n_trained / n_all:.2f} %) "
                    f"| {weights / 1e9:.2f} | {grads / 1e9:.2f} | {adam / 1e9:.2f} | {trainer:.2f} | {engine:.2f} "
                    f"| {GPU_GB - trainer - engine:.1f} |"
                )
    print(f"\ntorch {torch.__version__}; train.build_model on the meta device; GB = 1e9 bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
