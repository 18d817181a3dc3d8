"""Scale benchmark: time and peak memory of each stage, and each of train.py's memory measures against the naive way,
measured in one run on this machine. Prints one table; BENCHMARKS.md holds a copy and the command.

    python benchmarks/bench.py          # about 3 minutes on 2 CPU cores, ~8 GB of RAM at the peak

Ranks are forked gloo processes (tests/workers.py), so world 1 and world 2 run side by side in one script. Host memory
is the peak resident set of a rank above what it held before the stage (/proc/self/status VmHWM, reset through
/proc/self/clear_refs). Logits memory is the peak of [tokens, vocabulary]-shaped tensors alive at once, tracked
op by op; the naive full-vocabulary pass at 4 x 2,048 tokens would need ~20 GB, so it runs on fake tensors, which
have shapes and lifetimes but no storage.
"""

import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import checkpoint  # noqa: E402
import engines  # noqa: E402
import launch  # noqa: E402
import train  # noqa: E402
from live_logits import LiveLogits  # noqa: E402
from workers import run_ranks  # noqa: E402

VOCAB = 151_936  # Qwen2 / Qwen2.5 / Qwen3
MB = 1 << 20


def model_config(hidden=256, layers=4, vocab=VOCAB):
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )


def status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def measure(work):
    """(result, seconds, peak host MB above the resident set before work)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before, start = status_mb("VmRSS"), time.perf_counter()
    result = work()
    return result, time.perf_counter() - start, status_mb("VmHWM") - before


# ----------------------------------------------------------------------------- load
def load(rank, world, folder, streamed):
    par = launch.parallel_groups("cpu", 1)
    config = AutoConfig.from_pretrained(folder)

    def streamed_load():  # train.py: meta device, shard, then one safetensors file at a time from rank 0
        cfg = train.Config(model=folder)
        model = train.build_model(config, par.mesh, torch.device("cpu"))
        checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, config, par.world_group)

    def naive_load():  # every rank reads the whole checkpoint, then keeps its shards of it
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        model = train.build_model(config, par.mesh, torch.device("cpu"))
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return model

    _, seconds, peak = measure(streamed_load if streamed else naive_load)
    return seconds, peak


# ----------------------------------------------------------------------------- micro-batches
def padding(batches):
    lengths = [[len(s.prompt_ids) + len(s.response_ids) for s in batch] for batch in batches]
    return 1 - sum(map(sum, lengths)) / sum(len(batch) * max(batch) for batch in lengths)


def padding_fractions():
    g = torch.Generator().manual_seed(0)  # responses of 200 to 2,000 tokens: lengths vary 10x
    lengths = [int(torch.randint(200, 2001, (1,), generator=g)) for _ in range(64)]
    samples = [train.Sample([1] * 100, [2] * n, [True] * n) for n in lengths]
    fixed = launch.micro_batches(samples, train.Config(micro_batch_size=8), None)  # no collective: no group
    budget = run_ranks(
        lambda rank, world: padding(
            launch.micro_batches(samples, train.Config(max_tokens_per_microbatch=8 * 2100), dist.group.WORLD)
        ),
        1,
    )[0]
    return padding(fixed), budget


# ----------------------------------------------------------------------------- logits
def naive_logprobs(hidden, weight, targets):
    """Full-vocabulary log_softmax over every token at once: what a trainer without chunks does."""
    logits = (hidden @ weight.T).float()
    logp_all = torch.log_softmax(logits, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def logits_peak_naive(tokens, hidden_size):
    with FakeTensorMode():
        hidden = torch.randn(tokens, hidden_size, requires_grad=True)
        weight = torch.randn(VOCAB, hidden_size, requires_grad=True)
        targets = torch.randint(0, VOCAB, (tokens,))
        tracker = LiveLogits(VOCAB, hidden_size)
        with tracker:
            logp, entropy = naive_logprobs(hidden, weight, targets)
            (logp.sum() + entropy.sum()).backward()
    return tracker.peak


def logits_peak_trainer(rank, world, sequences, length, hidden_size, chunk):
    """train.py's response_logprobs on a 1-layer model with Qwen's vocabulary, vocabulary-sharded over tp = world."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(hidden_size, 1))
    samples = [
        train.Sample([1] * 48, torch.randint(3, VOCAB, (length - 48,)).tolist(), [True] * (length - 48))
        for _ in range(sequences)
    ]
    tp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))["tp"]
    cfg = train.Config(logprob_chunk=chunk)
    tracker = LiveLogits(math.ceil(VOCAB / world), hidden_size)
    start = time.perf_counter()
    with tracker:
        logp, entropy, _, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
        ones = torch.ones_like(logp)
        train.policy_loss(logp, logp.detach(), ones, ones / len(logp), cfg, None, entropy)[0].backward()
    return tracker.peak, time.perf_counter() - start


# ----------------------------------------------------------------------------- one step, stage by stage
def stages(rank, world, folder):
    """One GRPO step of the CPU engine on a small model with Qwen's vocabulary, dp = world."""
    par = launch.parallel_groups("cpu", 1)
    config = AutoConfig.from_pretrained(folder)
    cfg = train.Config(model=folder, group_size=4, max_new_tokens=64, micro_batch_size=8, logprob_chunk=512)
    (model, engine), t_load, m_load = measure(
        lambda: (
            train.build_model(config, par.mesh, torch.device("cpu")),
            engines.HFEngine(config, torch.device("cpu")),
        )
    )
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, config, par.world_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    push_cfg = train.Config(engine="hf", bucket_mb=64)

    def push():  # as train.py: the full weights gathered, then loaded by the engine
        engines.push_weights(model, engine, push_cfg.bucket_mb, par.tp_group)

    _, t_push, m_push = measure(push)
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (16, 32, 48, 64) for _ in range(4)]
    outputs, t_gen, m_gen = measure(
        lambda: engine.generate(prompts, [cfg.max_new_tokens] * len(prompts), 1.0, 1.0, 0, [2], seed=rank)
    )
    samples = [
        train.Sample(prompt, ids, [True] * len(ids), logprobs) for prompt, (ids, logprobs, *_) in zip(prompts, outputs)
    ]
    for sample in samples:
        sample.advantage = float(torch.randn(1, generator=g))

    def store_old_logprobs():
        for sample, logprobs in zip(samples, train.policy_logprobs(model, samples, cfg, par)):
            sample.old_logprobs = logprobs

    _, t_logp, m_logp = measure(store_old_logprobs)
    _, t_train, m_train = measure(lambda: train.train_on_rollouts(model, optimizer, samples, cfg, par))
    return {
        "build": (t_load, m_load),
        "generate": (t_gen, m_gen),
        "logprobs": (t_logp, m_logp),
        "train": (t_train, m_train),
        "weight gather": (t_push, m_push),
    }


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        torch.manual_seed(0)  # ~170 M parameters (the vocabulary's embedding and lm_head), saved in bf16 as HF does
        AutoModelForCausalLM.from_config(model_config(), dtype=torch.bfloat16).save_pretrained(
            folder, max_shard_size="80MB"
        )
        files = len([n for n in os.listdir(folder) if n.endswith(".safetensors")])
        load_peak = {}
        for streamed in (True, False):
            for world in (1, 2):
                results = run_ranks(load, world, folder, streamed, timeout=600)
                load_peak[streamed, world] = (max(s for s, _ in results), max(m for _, m in results))
        for streamed, name in ((True, "streamed (train.py)"), (False, "naive: each rank reads all")):
            (_, m1), (t2, m2) = load_peak[streamed, 1], load_peak[streamed, 2]
            rows.append(
                (
                    f"load, {name}",
                    f"{t2:.1f}",
                    f"{m2:.0f}",
                    f"host MB/rank: world 1 {m1:.0f}, world 2 {m2:.0f}",
                    f"world 2 / world 1 = {m2 / m1:.2f}",
                )
            )
        streamed, naive = load_peak[True, 2][1], load_peak[False, 2][1]
        rows.append(
            (
                "load at world 2",
                "",
                "",
                f"streamed {streamed:.0f} MB/rank, naive {naive:.0f} MB/rank",
                f"streamed / naive = {streamed / naive:.2f}",
            )
        )
        for name, (seconds, peak) in run_ranks(stages, 2, folder, timeout=600)[0].items():
            rows.append((name, f"{seconds:.2f}", f"{peak:.0f}", "rank 0 of dp 2, CPU engine", ""))
    fixed, budget = padding_fractions()
    rows.append(
        (
            "micro-batch padding",
            "",
            "",
            f"fixed 8 seqs {fixed:.1%}, token budget {budget:.1%}",
            f"budget / fixed = {budget / fixed:.2f}",
        )
    )
    tokens, hidden_size, chunk = 4 * 2048, 64, 1024
    naive = logits_peak_naive(tokens, hidden_size)
    ((tp1, t_tp1),) = run_ranks(logits_peak_trainer, 1, 4, 2048, hidden_size, chunk, timeout=900)
    tp2 = max(peak for peak, _ in run_ranks(logits_peak_trainer, 2, 4, 2048, hidden_size, chunk, timeout=900))
    rows.append(
        (
            "logits, 4 x 2,048 tokens",
            f"{t_tp1:.1f}",
            f"{tp1 / MB:.0f}",
            f"naive {naive / MB:.0f} MB; chunk {chunk}: tp 1 {tp1 / MB:.0f} MB, tp 2 {tp2 / MB:.0f} MB/rank",
            f"chunked / naive = {tp1 / naive:.3f}; tp 2 / tp 1 = {tp2 / tp1:.2f}",
        )
    )
    header = ("stage", "seconds", "peak MB", "measured", "ratio")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print(" | ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\n{files} safetensors files; torch {torch.__version__}; {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
