"""What each architecture's layers cost the trainer on this CPU, measured in one run: the training pass
(train.train_on_rollouts: forward, loss, backward, AdamW step) of models of the same size that differ in their
layers, on 2 gloo ranks at dp 2 x tp 1 and at dp 1 x tp 2.

    python3 benchmarks/models.py                  # ~3 min on 2 cores
    python3 benchmarks/models.py --repeats 5 --tokens 256

The models (random weights, hidden 256, 4 layers, 8 heads of 32, a vocabulary of 512):
- attention: Qwen3, every layer full attention and a dense MLP;
- gdn: Qwen3.5, three Gated DeltaNet layers for one of gated attention (transformers' PyTorch recurrence: the
  kernels of flash-linear-attention need a GPU), the same MLP;
- moe: Qwen3-MoE, attention with 8 routed experts of a quarter of the MLP, top 2 (the same active weights);
- gdn_moe: Qwen3.5-MoE's layers, both.
Prints seconds per pass (the median of --repeats, after a warm-up) and the ratios: each architecture over attention
at the same layout, and tp 2 over tp 1 for each; the MoE models' pass again with --routing_replay on. Then the
routed experts alone (a layer of 8 experts of 128, top 2, over 2,048 tokens, forward and backward) split over tp 2
the two ways: by expert (the trainer's, architectures.experts_by_rank) and inside each expert (each rank a slice of
every expert's gate, up and down rows, as SGLang splits them). CPU figures: gloo's collectives and a 2-core machine,
not a GPU's.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig  # noqa: E402

import architectures  # noqa: E402
import launch  # noqa: E402
import train  # noqa: E402
from workers import run_ranks  # noqa: E402

SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
SHAPE.update(head_dim=32, intermediate_size=512, max_position_embeddings=4096, tie_word_embeddings=True)
LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
LINEAR["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
ARCHITECTURES = {
    "attention": (Qwen3Config, {}),
    "gdn": (Qwen3_5TextConfig, LINEAR),
    "moe": (Qwen3MoeConfig, MOE),
    "gdn_moe": (Qwen3_5MoeTextConfig, dict(LINEAR, **MOE, shared_expert_intermediate_size=128)),
}


def training_pass(rank, world, name, tp, tokens, repeats, replay=False):
    """Seconds of each train_on_rollouts call on 8 samples of `tokens` tokens (half prompt), after a warm-up; with
    `replay`, --routing_replay on, each sample carrying an engine's routing (random experts at every position)."""
    torch.manual_seed(0)
    config_class, fields = ARCHITECTURES[name]
    config = architectures.text_config(config_class(**SHAPE, **fields))
    par = launch.parallel_groups("cpu", tp)
    model = train.build_model(config, par.mesh, torch.device("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(par.mesh["dp"].get_local_rank())
    samples = []
    for _ in range(8 // par.mesh["dp"].size()):
        ids = torch.randint(1, SHAPE["vocab_size"], (tokens,), generator=g).tolist()
        half = tokens // 2
        samples.append(train.Sample(ids[:half], ids[half:], [True] * (tokens - half), torch.zeros(tokens - half)))
        samples[-1].advantage = float(torch.randn(1, generator=g))
        if replay:
            scores = torch.rand(tokens - 1, config.num_hidden_layers, config.num_experts, generator=g)
            samples[-1].routing = scores.argsort(-1)[..., : config.num_experts_per_tok].to(torch.uint8)
    cfg = train.Config(micro_batch_size=8, routing_replay="on" if replay else "off")
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        train.train_on_rollouts(model, optimizer, samples, cfg, par)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def experts_split(rank, world, split, repeats):
    """Seconds of one experts layer's forward and backward at tp 2, split by expert or inside each expert."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    torch.manual_seed(0)
    tokens, hidden, experts, inner, top_k = 2048, 256, 8, 128, 2
    gate_up = torch.randn(experts, 2 * inner, hidden) * 0.02
    down = torch.randn(experts, hidden, inner) * 0.02
    x = torch.randn(tokens, hidden)
    ids = torch.randn(tokens, experts).topk(top_k, -1).indices
    weights = torch.rand(tokens, top_k)
    mesh = launch.parallel_groups("cpu", 2).mesh["tp"]
    if split == "by_expert":  # rank r: experts r E / 2 to (r + 1) E / 2, whole
        local = experts // 2
        gate_up, down = gate_up[rank * local : (rank + 1) * local], down[rank * local : (rank + 1) * local]
        ids = ids - rank * local
    else:  # rank r: a half of each expert's gate rows, up rows and down columns
        half = inner // 2
        gate, up = (
            gate_up[:, rank * half : (rank + 1) * half],
            gate_up[:, inner + rank * half : inner + (rank + 1) * half],
        )
        gate_up, down = torch.cat([gate, up], 1), down[:, :, rank * half : (rank + 1) * half]
    gate_up, down = gate_up.requires_grad_(), down.requires_grad_()
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        hidden_in = DTensor.from_local(x.requires_grad_(), mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        local_ids = ids.masked_fill((ids < 0) | (ids >= len(gate_up)), len(gate_up))
        token, choice = (local_ids < len(gate_up)).nonzero(as_tuple=True)
        expert = local_ids[token, choice]
        order = expert.argsort(stable=True)
        token, choice, expert = token[order], choice[order], expert[order]
        offsets = torch.bincount(expert, minlength=len(gate_up)).cumsum(0).to(torch.int32)
        g, u = architectures.grouped_linear(hidden_in[token], gate_up, offsets).chunk(2, -1)
        out = (
            architectures.grouped_linear(torch.nn.functional.silu(g) * u, down, offsets) * weights[token, choice, None]
        )
        summed = out.new_zeros(tokens, hidden).index_add(0, token, out)
        DTensor.from_local(summed, mesh, [Partial()]).full_tensor().sum().backward()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = {}
    for name in ARCHITECTURES:
        for tp in (1, 2):
            seconds[name, tp] = run_ranks(training_pass, 2, name, tp, args.tokens, args.repeats, timeout=1800)[0]
    print(f"\ntraining pass, 8 samples x {args.tokens} tokens, 2 gloo ranks, seconds (median of {args.repeats}):")
    print(f"{'':10} {'dp2 tp1':>8} {'dp1 tp2':>8} {'tp2/tp1':>8} {'/attn tp1':>10} {'/attn tp2':>10}")
    for name in ARCHITECTURES:
        one, two = seconds[name, 1], seconds[name, 2]
        attention = seconds["attention", 1], seconds["attention", 2]
        print(f"{name:10} {one:8.3f} {two:8.3f} {two / one:8.2f} {one / attention[0]:10.2f} {two / attention[1]:10.2f}")
    print("\n--routing_replay on, the same pass, seconds, and over the pass without it:")
    for name in ("moe", "gdn_moe"):
        for tp in (1, 2):
            replayed = run_ranks(training_pass, 2, name, tp, args.tokens, args.repeats, True, timeout=1800)[0]
            print(f"{name:10} tp{tp} {replayed:8.3f} {replayed / seconds[name, tp]:6.2f}")
    split = {way: run_ranks(experts_split, 2, way, args.repeats)[0] for way in ("by_expert", "inside_expert")}
    print("\nrouted experts at tp 2, one layer's forward and backward, seconds:")
    for way, value in split.items():
        print(f"{way:14} {value:8.4f} {value / split['by_expert']:6.2f}")


if __name__ == "__main__":
    main()
