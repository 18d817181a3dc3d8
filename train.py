"""GRPO for Qwen and Llama-architecture models in one file: G completions per prompt from the engine, rewards, group
advantages, clipped policy-gradient steps (FSDP2 over "dp", TP over "tp"), weights pushed back. Flags: Config.
    torchrun --standalone --nproc_per_node=2 train.py --preset cpu   # CPU demo: tiny random model, toy task
    torchrun --nproc_per_node=8 train.py --tp 2                       # GPU: Countdown, Qwen2.5-3B-Instruct
Edit `PromptDataset.__getitem__` (what a prompt is) and `reward_fn` (how a completion scores), both in reward.py."""
import contextlib
import datetime
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import socket
import threading
import time
import types
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Literal

from huggingface_hub import snapshot_download
from safetensors.torch import load_file, safe_open, save_file
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Qwen2Config

import reward
from reward import PromptDataset


@dataclass
class Config:
    model: str = "Qwen/Qwen2.5-3B-Instruct"  # hub id or local folder; "tiny": random tiny Qwen2 + character tokenizer
    task: str = "countdown"  # countdown, gsm8k, math, addition, toy (README: tasks), or your own (README: your task)
    data_path: str = ""  # a local folder of train.* and test.* (jsonl / parquet) or a hub id; "": the task's own data
    train_size: int = 20000  # countdown / toy / addition: problems generated for training
    test_size: int = 500  # countdown / toy / addition: held-out problems, disjoint from training
    plain_template: bool = False  # R1-Zero's plain prompt even when the tokenizer has a chat template (base models)
    preset: Literal["", "cpu"] = ""  # cpu: tiny model, toy task, small batches; flags given explicitly still win
    engine: Literal["sglang", "hf"] = "sglang" if torch.cuda.is_available() else "hf"  # hf: HF generate (CPU)
    mem_fraction: float = 0.5  # sglang: fraction of the GPU's free memory at start for its weights and KV cache
    engine_port: int = 0  # sglang: 0: each engine takes a free port; > 0: engine_port + its first rank's local rank
    bucket_mb: int = 512  # weight push: MB of full bf16 tensors gathered and sent at a time
    prompts_per_step: int = 32  # prompts per optimizer step, over all ranks
    group_size: int = 8  # G: samples per prompt
    max_new_tokens: int = 1024  # response length limit
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low (README: the settings of GRPO, Dr. GRPO and DAPO)
    clip_high: float = 0.28  # and above at 1 + clip_high (clip-higher, DAPO)
    ratio_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's one ratio per response (README: recipe)
    objective: Literal["clip", "cispo"] = "clip"  # cispo: a clipped, detached ratio weights every token's log p
    loss_agg: Literal["token", "sequence", "constant"] = "token"  # DAPO's token mean | GRPO's | Dr. GRPO's constant
    scale_std: bool = True  # divide advantages by the group's std (False: Dr. GRPO)
    beta: float = 0.0  # weight of the KL to the initial policy; 0 builds no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators of KL(policy || reference) per token
    kl_in_reward: bool = False  # subtract beta x the sequence's summed KL from its reward instead of adding a loss
    entropy_coef: float = 0.0  # entropy bonus
    overlong_buffer: int = 0  # > 0: DAPO's soft overlong penalty, 0 down to -1 over the last N tokens of the limit
    dynamic_sampling_rounds: int = 0  # > 0: DAPO's dynamic sampling, refilling dropped groups in up to N more rounds
    tis_cap: float = 0.0  # > 0: importance sampling against the engine / trainer mismatch, r = p_old / p_engine
    is_mode: Literal["truncate", "mask"] = "truncate"  # with --tis_cap: weight min(r, cap), or r masked to [1/cap, cap]
    is_level: Literal["token", "sequence"] = "token"  # with --tis_cap: r per token, or its response's geometric mean
    logprob_chunk: int = 1024  # response tokens per chunk of fp32 full-vocabulary logits
    steps: int = 200
    lr: float = 1e-6
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: down to 10% of lr at the last step
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_minibatches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 8  # sequences per forward / backward on each rank
    max_tokens_per_microbatch: int = 0  # > 0: length-sorted micro-batches of at most this many tokens, padding included
    tp: int = 1  # tensor-parallel size; dp = world size / tp
    activation_checkpointing: bool = False
    lora_rank: int = 0  # > 0: LoRA of this rank on every linear layer of the blocks, the rest frozen (README: LoRA)
    lora_alpha: float = 32.0  # LoRA's update is scaled by alpha / rank (32: as "LoRA Without Regret")
    eval_every: int = 50  # evaluate on the held-out split every N steps and at the end; 0: never
    eval_prompts: int = 256  # held-out prompts per evaluation
    eval_k: int = 4  # samples per prompt for mean@k and pass@k
    eval_temperature: float = 1.0
    save_every: int = 50  # checkpoint every N steps; always at the end and when stopped by a signal
    keep_checkpoints: int = 2  # the newest K complete checkpoints are kept
    resume: str = ""  # a checkpoint folder, or "auto": the newest complete one under out_dir (if any)
    reward_workers: int = 4  # processes computing rewards in parallel
    reward_timeout: float = 5.0  # seconds before a reward_fn call is cut off; it scores 0
    seed: int = 0
    out_dir: str = "runs/grpo"  # config.json, metrics.jsonl, checkpoints/ (layout in README)
    wandb_project: str = ""  # log to wandb too when set (WANDB_MODE=offline needs no network)
    sample_every: int = 10  # print a sampled prompt, completion and reward every N steps; 0: never
    tool: Literal["", "python"] = ""  # python: responses may run ```python blocks (README: the Python tool)
    max_turns: int = 4  # with --tool: generation turns per response, each but the last may end in a block that is run


PRESETS = {"cpu": dict(model="tiny", task="toy", engine="hf", steps=30, prompts_per_step=8, group_size=8, lr=1e-2,
                       max_new_tokens=16, warmup_steps=0, micro_batch_size=32, train_size=1000, test_size=100,
                       out_dir="runs/cpu", eval_every=10, eval_prompts=16, save_every=0, reward_workers=2)}


def parse_config(argv=None):
    parser = HfArgumentParser(Config, allow_abbrev=False)
    quiet = os.environ.get("RANK", "0") != "0"  # argparse's errors (usage and message, to stderr) once: rank 0's
    with contextlib.redirect_stderr(open(os.devnull, "w")) if quiet else contextlib.nullcontext():
        parser.set_defaults(**PRESETS.get(parser.parse_known_args(argv)[0].preset, {}))
        return Config(**vars(parser.parse_args(argv)))  # an unknown flag: argparse's one line, and its usage


def check_config(cfg, world):
    """Catch bad flags before any model is loaded, one at a time; each message names the flag to change."""
    minimum = dict(tp=1, prompts_per_step=1, group_size=2, num_minibatches=1, micro_batch_size=1, max_new_tokens=1,
                   eval_k=1, logprob_chunk=1, reward_workers=1, beta=0, entropy_coef=0, tis_cap=0, overlong_buffer=0,
                   dynamic_sampling_rounds=0, max_tokens_per_microbatch=0, eval_every=0, save_every=0, lr=0, steps=1,
                   keep_checkpoints=1, sample_every=0, reward_timeout=0.001, max_turns=1, eval_prompts=1, bucket_mb=1,
                   temperature=0, eval_temperature=0, clip_low=0, clip_high=0, weight_decay=0, max_grad_norm=0,
                   lora_rank=0)
    for flag, low in minimum.items():
        if not low <= getattr(cfg, flag) < math.inf:  # NaN too
            raise SystemExit(f"--{flag} must be a number from {low} up, not {getattr(cfg, flag)}")
    dp, sglang = max(world // cfg.tp, 1), cfg.engine == "sglang"
    for bad, message in (
            (world % cfg.tp, f"--tp {cfg.tp} does not divide the world size {world}: use a divisor of {world}"),
            (cfg.prompts_per_step % dp, f"--prompts_per_step {cfg.prompts_per_step} must divide by dp = {dp}"),
            (cfg.prompts_per_step // dp * cfg.group_size % cfg.num_minibatches,
             f"--num_minibatches {cfg.num_minibatches} must divide a rank's {cfg.prompts_per_step // dp} x G samples"),
            (cfg.kl_in_reward and cfg.beta == 0, "--kl_in_reward needs --beta above 0: beta scales the KL penalty"),
            (cfg.temperature == 0, "--temperature must be above 0: greedy samples are all alike, nothing to learn"),
            (not 0 < cfg.top_p <= 1, f"--top_p must be above 0 and at most 1, not {cfg.top_p}"),
            (not 0 < cfg.lora_alpha < math.inf, f"--lora_alpha must be above 0, not {cfg.lora_alpha}"),
            (not 0 < cfg.mem_fraction < 1, f"--mem_fraction is a share: above 0, below 1, not {cfg.mem_fraction}"),
            (os.path.realpath(cfg.out_dir) == os.path.realpath(cfg.model), "--out_dir must differ from --model"),
            (cfg.overlong_buffer > cfg.max_new_tokens, "--overlong_buffer must be at most --max_new_tokens"),
            ((cfg.is_mode, cfg.is_level) != ("truncate", "token") and cfg.tis_cap <= 1,
             "--is_mode and --is_level act through --tis_cap: set it above 1, the bound on the ratio"),
            (sglang and not torch.cuda.is_available(), "--engine sglang needs a CUDA GPU: use --engine hf here"),
            (sglang and importlib.util.find_spec("sglang") is None,
             "--engine sglang needs SGLang (pip install -r requirements.txt), or use --engine hf"),
            (sglang and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) % cfg.tp,
             f"--tp {cfg.tp} must divide the GPUs per node: an engine's TP group lives on one node")):
        if bad:
            raise SystemExit(message)


def load_tokenizer_and_config(cfg, items):
    """--model's tokenizer and config, checked against the items' prompts; "tiny": random, a character tokenizer."""
    if cfg.model == "tiny":
        chars = [chr(c) if c > 32 else chr(256 + c) for c in [*range(9, 14), *range(32, 127)]]  # printable; " " is Ġ
        vocab = {token: i for i, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + chars)}
        tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
        config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=reward.stop_token_ids(tokenizer), pad_token_id=0,
                             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                             initializer_range=0.2 if cfg.lora_rank else 0.02,  # frozen by LoRA: wide enough to learn
                             architectures=["Qwen2ForCausalLM"])  # SGLang reads architectures
    else:
        try:
            tokenizer, config = AutoTokenizer.from_pretrained(cfg.model), AutoConfig.from_pretrained(cfg.model)
        except (OSError, ValueError) as error:  # a name that is no folder here is looked up on the hub
            raise SystemExit(f"--model {cfg.model}: not a model's folder, nor a hub id: {str(error).splitlines()[0]}")
    longest = max(len(reward.encode_prompt(tokenizer, item["prompt"], cfg.plain_template)) for item in items)
    if longest + cfg.max_new_tokens > config.max_position_embeddings - 6:  # SGLang fails a batch with an input of C - 6
        raise SystemExit(f"the longest prompt ({longest} tokens) and --max_new_tokens {cfg.max_new_tokens} exceed the "
                         f"context length {config.max_position_embeddings} less 6 (SGLang's margin): lower one of them")
    if 0 < cfg.max_tokens_per_microbatch < longest + cfg.max_new_tokens:  # a sample must fit one micro-batch
        raise SystemExit(f"--max_tokens_per_microbatch {cfg.max_tokens_per_microbatch} is below the longest sample: "
                         f"{longest} prompt tokens + --max_new_tokens {cfg.max_new_tokens}; raise it or lower those")
    return tokenizer, config


def step_items(dataset, step, cfg, dp_rank, dp, sampling_round=0):
    """This rank's prompts for a step, from a seeded permutation per (epoch, dynamic sampling round)."""
    epoch, i = divmod(step, len(dataset) // cfg.prompts_per_step)
    seed = hash((cfg.seed, epoch, sampling_round))  # a tuple of ints hashes the same in every process
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    per_rank = cfg.prompts_per_step // dp
    start = i * cfg.prompts_per_step + dp_rank * per_rank
    return [dataset[j] for j in order[start:start + per_rank]]


@dataclass
class Sample:
    """One response and what the step learns about it; per-token fields are float32 tensors over its sampled tokens."""
    prompt_ids: list[int]  # the prompt's tokens as the engine saw them
    response_ids: list[int] = field(default_factory=list)  # the tokens after it as sampled, stop included: never
    sampled: list[bool] = field(default_factory=list)  # re-tokenised; per token: sampled, or tool output (no loss)
    engine_logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # of the sampled, of logits / T
    tool_outputs: list[str] = field(default_factory=list)  # what each run of its code printed (--tool python)
    truncated: bool = False  # cut off by --max_new_tokens rather than ended by a stop token
    score: float = 0.0  # reward_fn's value
    reward: float = 0.0  # score plus shaping (the overlong penalty): what advantages are made from
    advantage: float = 0.0
    loss_weight: float = 0.0  # the weight of each of its tokens in the mini-batch loss (--loss_agg)
    old_logprobs: torch.Tensor | None = None  # the policy's before the update, where the step needs them
    ref_logprobs: torch.Tensor | None = None  # the reference model's (--beta > 0)


KL_ESTIMATORS = {"k1": lambda x: x, "k2": lambda x: x ** 2 / 2, "k3": lambda x: torch.expm1(-x) + x}
# q/k/v and gate/up split their output features over tp, o and down their input: one all-reduce per block each way.
TP_PLAN = {**{f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
           **{f"mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")}, "mlp.down_proj": RowwiseParallel()}
# Qwen3's per-head q/k norms see a rank's heads only (dim 2): replicated weights, gradients summed over tp in backward.
QK_NORM_PLAN = {f"self_attn.{x}_norm": SequenceParallel(sequence_dim=2, use_local_output=True) for x in "qk"}


def build_model(model_config, mesh, device, activation_checkpointing=False, lora_rank=0, lora_alpha=32.0):
    """On meta: TP in each decoder layer, LoRA, activation checkpointing, FSDP per layer and root; load_weights then."""
    dtype = torch.bfloat16 if lora_rank and mesh.device_type == "cuda" else torch.float32  # LoRA's frozen base: bf16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    tp = mesh["tp"].size()
    for heads in ("num_attention_heads", "num_key_value_heads"):  # each rank computes whole heads
        if getattr(model.config, heads) % tp:
            raise SystemExit(f"--tp {tp} must divide the model's {heads} ({getattr(model.config, heads)})")
    if tp > 1:
        for layer in model.model.layers:
            qk_norm = QK_NORM_PLAN if hasattr(layer.self_attn, "q_norm") else {}
            parallelize_module(layer, mesh["tp"], {**TP_PLAN, **qk_norm})
    add_lora(model, lora_rank, lora_alpha, mesh["tp"])
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_dtype = torch.bfloat16 if mesh.device_type == "cuda" else None  # GPU: bf16 compute, fp32 master weights
    for module in [*model.model.layers, model]:  # FSDP per decoder layer, then the root; gradients reduced in fp32
        fully_shard(module, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype, torch.float32))
    model.to_empty(device=device)
    with torch.device(device):  # rotary frequencies are a non-persistent buffer: rebuild it off the meta device
        model.model.rotary_emb = type(model.model.rotary_emb)(model_config)
    return model


def add_lora(model, rank, alpha, tp_mesh):
    """Rank > 0: LoRA on the blocks' linear layers, all else frozen. Hooks add x A^T B^T x model.lora_scale (A [R, in],
    B [out, R]) before TP's: B split as a column-parallel output, A as a row-parallel input: no collective is added."""
    model.lora_scale = alpha / rank if rank else 0.0  # 0: the base alone, as the reference of --beta takes it
    model.requires_grad_(rank == 0)
    for layer in model.model.layers if rank else []:
        for name, style in TP_PLAN.items():
            linear = layer.get_submodule(name)
            linear.lora_A = torch.nn.Linear(linear.in_features, rank, bias=False, device="meta")  # PEFT's names
            linear.lora_B = torch.nn.Linear(rank, linear.out_features, bias=False, device="meta")
            splits = (Shard(1), Replicate()) if isinstance(style, RowwiseParallel) else (Replicate(), Shard(0))
            for adapter, split in zip((linear.lora_A, linear.lora_B), splits if tp_mesh.size() > 1 else ()):
                adapter.weight = torch.nn.Parameter(distribute_tensor(adapter.weight, tp_mesh, [split]))
            linear.register_forward_hook(
                lambda module, args, out: out + module.lora_B(module.lora_A(args[0]) * model.lora_scale), prepend=True)


def weight_files(cfg):
    """On rank 0: --model's model*.safetensors files (a hub id is downloaded), each checked to be whole."""
    folder = cfg.model if os.path.isdir(cfg.model) else snapshot_download(cfg.model, allow_patterns="*.safetensors")
    files = sorted(map(str, pathlib.Path(folder).glob("model*.safetensors")))
    for file in files:
        try:
            safe_open(file, "pt")  # reads the header, which must cover the whole file
        except Exception as error:  # a truncated download, a full disk at save time
            raise SystemExit(f"--model: {file} cannot be read ({error}): download or save it again")
    return files


def load_weights(models, files, cfg, model_config, world):
    """`files` (weight_files) into the sharded models one at a time, rank 0 reading: host memory holds one at most."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    loaded = {"lm_head.weight"} if model_config.tie_word_embeddings else set()  # a tied lm_head is the embedding
    torch.manual_seed(cfg.seed)  # --model tiny: one part (None), random weights seeded with --seed
    for part in files:
        state = {}
        if dist.get_rank() == 0:  # with the first part, LoRA's adapters: A uniform within 1 / sqrt(in) as PEFT's, B 0
            state = load_file(part) if part else AutoModelForCausalLM.from_config(model_config).state_dict()
            state |= {name: (torch.rand(p.shape) * 2 - 1) / p.shape[1] ** 0.5 * ("lora_A" in name)
                      for name, p in models[0].named_parameters() if ".lora_" in name and part == files[0]}
        loaded |= state.keys()
        for model in models:  # a shallow copy: set_model_state_dict replaces the dict's entries with their shards
            set_model_state_dict(model, dict(state), options=options)
    missing = on_first_rank(lambda: sorted(set(models[0].state_dict()) - loaded), world)
    if missing:
        raise SystemExit(f"--model {cfg.model}: its model*.safetensors files lack {missing[:3]} "
                         f"({len(missing)} tensors); save the model with save_pretrained")


def parallel_groups(device_type, tp):
    """The device mesh over (dp, tp), and gloo groups world, dp, tp for waits and objects: no NCCL kernel spins then."""
    shape, names = (dist.get_world_size() // tp, tp), ("dp", "tp")
    gloo = init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, "gloo"))
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return types.SimpleNamespace(mesh=mesh, world=dist.new_group(backend="gloo"), dp=gloo["dp"].get_group(),
                                 tp=gloo["tp"].get_group())


def on_first_rank(work, group):
    """work() on the group's first rank, sent to the group: one answer; a SystemExit there stops every rank."""
    box = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = work()
        except SystemExit as error:  # a check made on one rank: the others would fail in the next collective
            box[0] = error
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], SystemExit):
        raise box[0]
    return box[0]


class Engine:
    """Run by a TP group's first rank. generate(prompts, budgets, temperature, top_p, stop_ids, seed): sampled ids
    (stop included) and log-probs of logits / T, per prompt. The rest do nothing here, as on an HF engine's others."""
    push_dtype = torch.float32  # of the pushed tensors
    release_memory = begin_update = update = end_update = shutdown = lambda self, *args: None


class HFEngine(Engine):
    """HF generate on the owner's unsharded fp32 copy of the policy; the push hands it each bucket as a state dict."""
    batch_bytes = 1 << 30  # generate keeps every step's fp32 logits [prompts, T, V]: this much at most, then batches
    def __init__(self, model_config, device):
        self.model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).to(device).eval()
    def update(self, bucket, group):
        self.model.load_state_dict(dict(bucket), strict=False)  # check_pushed_names vouches for the names
    def generate(self, prompts, budgets, temperature, top_p, stop_ids, seed):  # HF's generate runs without grad
        n = max(1, self.batch_bytes // (max(budgets) * self.model.config.vocab_size * 4))
        if len(prompts) > n:  # in batches of n prompts, each seeded afresh
            return [out for i in range(0, len(prompts), n) for out in self.generate(
                prompts[i:i + n], budgets[i:i + n], temperature, top_p, stop_ids, seed + i)]
        longest, device = max(map(len, prompts)), self.model.device
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)  # left-padded, masked
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
        with torch.random.fork_rng(devices=[]):  # seeded sampling that leaves the global RNG alone
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets),
                                      eos_token_id=stop_ids, pad_token_id=0, return_dict_in_generate=True,
                                      output_logits=True, **sampling)
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / (temperature or 1.0), -1)  # [N, T, V]
        seqs = [seq[:budget] for seq, budget in zip(out.sequences[:, longest:].tolist(), budgets)]  # below the batch's
        seqs = [seq[:next((t + 1 for t, tok in enumerate(seq) if tok in stop_ids), len(seq))] for seq in seqs]  # stop
        return [(seq, lps[torch.arange(len(seq)), seq].cpu()) for seq, lps in zip(seqs, logprobs)]


class SGLangEngine(Engine):
    """In-process SGLang on the TP group's GPUs, run by the owner; bf16 buckets come by CUDA IPC, not through disk."""
    push_dtype = torch.bfloat16
    def __init__(self, cfg, model_config, owner, world):
        import sglang
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        if torch.cuda.is_available():
            monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID, as the engine's side expects
        self.engine = None
        base_gpu_id = int(os.environ.get("LOCAL_RANK", 0))  # the TP group's first GPU
        with socket.socket() as port:  # free (or --engine_port's), held until every engine of the node has its own
            port.bind(("127.0.0.1", cfg.engine_port + base_gpu_id if cfg.engine_port else 0))
            nccl_port = port.getsockname()[1]
            dist.barrier(group=world)
        if not owner:
            return
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False",  # or its schedulers hang joining torchrun's store
                          SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK="false")  # GPUs >10% apart in free memory: safe
        config_dir = os.path.join(cfg.out_dir, f"engine_model_rank{dist.get_rank()}")  # read from disk by SGLang
        model_config.save_pretrained(config_dir)
        # The engine's processes inherit ignored SIGINT / SIGTERM: torchrun's signals are the trainer's to act on.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.engine = sglang.Engine(  # logits in fp32 from bf16 inputs, as the trainer's (sglang 0.5.3 and newer)
            model_path=config_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", tp_size=cfg.tp,
            dp_size=1, base_gpu_id=base_gpu_id, nccl_port=nccl_port, random_seed=cfg.seed + dist.get_rank(),
            enable_memory_saver=True, mem_fraction_static=cfg.mem_fraction, log_level="error", enable_fp32_lm_head=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # The first request starts SGLang's event loop, which installs its own SIGTERM handler: the trainer's wins.
        self.engine.generate(input_ids=[[0]], sampling_params={"max_new_tokens": 1})
    def generate(self, prompts, budgets, temperature, top_p, stop_ids, seed):  # seeded at start, by --seed
        outputs = self.engine.generate(input_ids=prompts, return_logprob=True, sampling_params=[
            dict(temperature=temperature, top_p=top_p, stop_token_ids=stop_ids, max_new_tokens=n) for n in budgets])
        return [(out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]))
                for out in outputs]
    def release_memory(self):
        if self.engine:
            self.engine.release_memory_occupation(tags=["kv_cache", "weights"])
    def begin_update(self):
        if self.engine:
            self.engine.resume_memory_occupation(tags=["weights"])  # freed, not kept: every weight is pushed
            getattr(self.engine, "begin_weight_update", lambda: None)()  # sglang >= 0.5.21: updates need a session
    def update(self, bucket, group):  # each rank's own copy: engine TP rank i reads trainer rank i's GPU, its own
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        flat = FlattenedTensorBucket(named_tensors=bucket)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        ranks = [None] * dist.get_world_size(group) if self.engine else None
        dist.gather_object(MultiprocessingSerializer.serialize(payload, output_str=True), ranks,
                           dst=dist.get_global_rank(group, 0), group=group)
        if self.engine:  # SGLang reports a failed weight update as (False, why) rather than raising
            result = self.engine.update_weights_from_tensor(ranks, load_format="flattened_bucket", flush_cache=False)
            if not result[0]:
                raise RuntimeError(f"SGLang weight update failed: {result[1]}")
    def end_update(self):
        if self.engine:
            getattr(self.engine, "end_weight_update", lambda: None)()
            self.engine.flush_cache()  # cached prefixes were computed with the old weights
            self.engine.resume_memory_occupation(tags=["kv_cache"])
    def shutdown(self):
        if self.engine:
            self.engine.shutdown()  # and its scheduler processes


def free_gpu_cache(group):
    """Freed GPU memory (IPC handles released by the engine too) back to the device, then wait for the group."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    dist.barrier(group=group)


def check_pushed_names(model, model_config):
    """Pushed names and shapes must be those of SGLang's `architectures` class: it skips unknown names silently."""
    architecture = (model_config.architectures or [""])[0]
    if not hasattr(transformers, architecture):
        raise SystemExit(f"`architectures` in --model's config.json is {architecture!r}: no class of transformers")
    with torch.device("meta"):
        expected = {n: list(p.shape) for n, p in getattr(transformers, architecture)(model_config).named_parameters()}
    pushed = {name: list(param.shape) for name, param in model.named_parameters() if ".lora_" not in name}
    for name in [*pushed, *sorted(expected.keys() - pushed.keys())]:  # the model's order, then what it lacks
        if pushed.get(name) != expected.get(name):
            raise SystemExit(f"the trainer pushes {name} as {pushed.get(name)}, the engine's {architecture} has it as "
                             f"{expected.get(name)}: check `architectures` in --model's config.json")


def weight_buckets(model, bucket_bytes, dtype):
    """Full HF-named `dtype` tensors (shards cast, then gathered; LoRA's W + alpha / R B A) in ~bucket_bytes buckets."""
    bucket = []
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        full = param.detach().to(dtype)
        full = full.full_tensor() if isinstance(full, DTensor) else full
        if name.endswith(".weight") and hasattr(linear := model.get_submodule(name[:-7]), "lora_A"):  # not a bias
            b, a = (adapter.weight.detach().float().full_tensor() for adapter in (linear.lora_B, linear.lora_A))
            full = full + (model.lora_scale * b @ a).to(dtype)
        bucket.append((name, full))
        if sum(full.nbytes for _, full in bucket) >= bucket_bytes:
            yield bucket
            bucket = []
    if bucket:
        yield bucket


def push_weights(model, engine, cfg, par):
    """The new weights into the engine, whose memory the rollouts' end released; every rank of a TP group runs it."""
    free_gpu_cache(par.tp)  # the trainer's cached blocks back to the GPU before the engine's weights come back
    engine.begin_update()
    for bucket in weight_buckets(model, cfg.bucket_mb << 20, engine.push_dtype):
        engine.update(bucket, par.tp)
        dist.barrier(group=par.tp)  # the others gather the next bucket only once the owner has loaded this one
    del bucket  # the last: nothing of the push stays referenced
    free_gpu_cache(par.tp)  # the buckets' memory back to the GPU before the engine's KV cache comes back
    engine.end_update()


def generate_rollouts(engine, workers, tokenizer, items, cfg, seed, temperature, n=1):
    """On the engine's rank: n samples per item, scored (and why failed calls failed); --tool: turns, one budget."""
    items = [item for item in items for _ in range(n)]
    stop_ids, fence_ids = reward.stop_token_ids(tokenizer), reward.fence_token_ids(tokenizer) if cfg.tool else []
    samples = running = [Sample(reward.encode_prompt(tokenizer, item["prompt"], cfg.plain_template)) for item in items]
    while running := [s for s in running if len(s.response_ids) < cfg.max_new_tokens]:
        outputs = engine.generate([s.prompt_ids + s.response_ids for s in running],
                                  [cfg.max_new_tokens - len(s.response_ids) for s in running],
                                  temperature, cfg.top_p, stop_ids + fence_ids, seed)
        for s, (ids, logprobs) in zip(running, outputs):
            s.response_ids += ids
            s.sampled += [True] * len(ids)
            s.engine_logprobs = torch.cat([s.engine_logprobs, logprobs])
        running = [s for s, (ids, _) in zip(running, outputs) if ids and ids[-1] in fence_ids]
        reward.run_tools(running, workers, tokenizer, cfg.max_turns, cfg.max_new_tokens)
        seed += 1  # HFEngine's next round samples afresh
    return workers.score_samples(samples, items, tokenizer, cfg.max_new_tokens, cfg.overlong_buffer)


def collect_rollouts(engine, workers, dataset, tokenizer, cfg, step, par):
    """G samples per prompt with reward, tracebacks, groups dropped (dynamic sampling: equal scores, so more rounds)."""
    dp_rank, dp = par.mesh["dp"].get_local_rank(), par.mesh["dp"].size()
    kept, dropped, errors = [], [], []
    for sampling_round in range(cfg.dynamic_sampling_rounds + 1):
        items = step_items(dataset, step, cfg, dp_rank, dp, sampling_round)
        seed = hash((cfg.seed, step, sampling_round, dp_rank))
        samples, failed = on_first_rank(lambda: generate_rollouts(  # on the engine's rank, sent to its TP group
            engine, workers, tokenizer, items, cfg, seed, cfg.temperature, cfg.group_size), par.tp)
        errors += failed
        for group in (samples[i:i + cfg.group_size] for i in range(0, len(samples), cfg.group_size)):
            (dropped if cfg.dynamic_sampling_rounds and len({s.score for s in group}) == 1 else kept).append(group)
        if len(kept) >= len(items):
            break
    filled = dropped[:max(0, len(items) - len(kept))]
    return [s for group in kept[:len(items)] + filled for s in group], errors, len(dropped) - len(filled)


def group_advantages(rewards, group_size, scale_std=True, eps=1e-6):
    """(r - group mean) / (group std + eps), std unbiased as in GRPO; without the division for Dr. GRPO."""
    r = rewards.view(-1, group_size).double()
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps if scale_std else 1.0)
    return adv.masked_fill((r == r[:, :1]).all(1, keepdim=True), 0.0).view(-1)  # equal rewards: no signal, 0


def set_advantages(samples, cfg):
    """Group advantages; --kl_in_reward subtracts beta x summed KL, centred, not std-scaled (that would cancel beta)."""
    advantages = group_advantages(torch.tensor([s.reward for s in samples]), cfg.group_size, cfg.scale_std)
    if cfg.kl_in_reward:
        kl = torch.stack([KL_ESTIMATORS[cfg.kl_estimator](s.old_logprobs - s.ref_logprobs).sum() for s in samples])
        advantages -= cfg.beta * group_advantages(kl.cpu(), cfg.group_size, scale_std=False)
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage


class FP32Logits(torch.autograd.Function):
    """hidden @ w.T [C, V / tp] in fp32 from bf16 inputs, as SGLang's fp32 LM head (bf16 logits lose ~0.01 nats)."""
    @staticmethod
    def forward(ctx, hidden, w):
        ctx.save_for_backward(hidden, w)  # CPU torch lacks mm's out_dtype: an upcast there
        return torch.mm(hidden, w.T, out_dtype=torch.float32) if hidden.is_cuda else hidden.float() @ w.float().T
    @staticmethod
    def backward(ctx, grad):  # CUDA's mm(out_dtype=) has no derivative: bf16 products, as autograd's for a bf16 matmul
        hidden, w = ctx.saved_tensors
        return grad.to(hidden.dtype) @ w, grad.T.to(hidden.dtype) @ hidden if ctx.needs_input_grad[1] else None


def logprobs_and_entropy(hidden, weight, targets, temperature, tp_mesh):
    """Per token: log p(target), entropy of softmax(hidden @ weight.T / T); weight sharded over tp by vocabulary."""
    def sum_over_tp(x):  # all-reduce in forward, identity in backward: every tp rank computes the same loss from it
        return DTensor.from_local(x, tp_mesh, [Partial()]).full_tensor()
    # Backward sums hidden's gradient over tp (Partial): each rank's slice of the vocabulary adds its part.
    logits = FP32Logits.apply(hidden.to_local(grad_placements=[Partial()]), weight.to_local()) / temperature
    max_logit = DTensor.from_local(logits.detach().amax(-1), tp_mesh, [Partial("max")]).full_tensor()  # over tp
    exp = torch.exp(logits - max_logit[:, None])
    sum_exp = sum_over_tp(exp.sum(-1))
    slice_start = tp_mesh.get_local_rank() * math.ceil(weight.shape[0] / tp_mesh.size())  # this rank's first id
    in_slice = (targets >= slice_start) & (targets < slice_start + logits.shape[1])
    slice_targets = (targets - slice_start).clamp(0, logits.shape[1] - 1)
    target_logit = sum_over_tp(logits.gather(-1, slice_targets[:, None]).squeeze(-1) * in_slice)
    log_z = max_logit + sum_exp.log()
    return target_logit - log_z, log_z - sum_over_tp((exp * logits).sum(-1)) / sum_exp


def response_logprobs(model, samples, cfg, tp_mesh):
    """Log-probs and entropies [N] of the sampled response tokens; lm_head per --logprob_chunk, recomputed."""
    seqs, device = [s.prompt_ids + s.response_ids for s in samples], torch.device(tp_mesh.device_type)
    longest = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (longest - len(q)) for q in seqs], device=device)  # right-padded, masked
    mask = torch.tensor([[1] * len(q) + [0] * (longest - len(q)) for q in seqs], device=device)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=ids.new_zeros(0), output_hidden_states=True)
    last = out.hidden_states[-1]  # the final norm's output [B, T, H]; position t predicts token t + 1
    sampled = torch.tensor([m for s in samples for m in s.sampled], dtype=torch.bool, device=device)  # not tool output
    hidden = torch.cat([last[b, len(s.prompt_ids) - 1:len(seqs[b]) - 1] for b, s in enumerate(samples)])[sampled]
    targets = torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.long, device=device)[sampled]
    # lm_head, a root parameter, stays unsharded until backward; as DTensors, backward gathers its grad, sums hidden's.
    weight = DTensor.from_local(model.lm_head.weight, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(0)])
    hidden = DTensor.from_local(hidden, tp_mesh, [Replicate()])
    compute = ((lambda *args: torch.utils.checkpoint.checkpoint(logprobs_and_entropy, *args, use_reentrant=False))
               if torch.is_grad_enabled() else logprobs_and_entropy)
    chunks = range(0, max(len(targets), 1), cfg.logprob_chunk)  # one, empty, where no token was sampled
    logp, entropy = zip(*[compute(hidden[i:i + cfg.logprob_chunk], weight, targets[i:i + cfg.logprob_chunk],
                                  cfg.temperature, tp_mesh) for i in chunks])
    return torch.cat(logp), torch.cat(entropy)


def policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp=None, entropy=None, is_weights=None, lengths=None):
    """Per-token PG term (clip or CISPO) x is_weights, + beta KL, - entropy bonus, summed with weights; metric sums."""
    log_ratio = (logp - old_logp).clamp(-20, 20)  # as verl: exp overflows above ~88, and one token would skip a step
    if cfg.ratio_level == "sequence":  # GSPO-token: value s_i = exp(response mean of log ratio), gradient s_i x d log p
        means = torch.segment_reduce(log_ratio.detach(), "mean", lengths=lengths)
        log_ratio = means.repeat_interleave(lengths) + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    if cfg.objective == "cispo":  # MiniMax-M1: the ratio, clipped and detached, weights log p; no token is dropped
        per_token = -ratio.detach().clamp(max=1 + cfg.clip_high) * advantages * logp
        clip_mask = ratio.detach() > 1 + cfg.clip_high
    else:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        clip_mask = clipped < unclipped
    per_token = per_token if is_weights is None else per_token * is_weights
    metrics = {"clip_frac": clip_mask.sum(), "kl": logp.new_zeros(()), "entropy": logp.new_zeros(()),
               "ratio_clamped": ((logp - old_logp).detach().abs() > 20).sum()}
    if ref_logp is not None:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp - ref_logp)
        metrics["kl"] = kl.detach().sum()
        per_token = per_token if cfg.kl_in_reward else per_token + cfg.beta * kl
    if entropy is not None:  # in the graph even at coef 0: backward then frees each chunk's recomputed logits
        metrics["entropy"] = entropy.detach().sum()
        per_token = per_token - cfg.entropy_coef * entropy
    return (per_token * weights).sum(), metrics


def engine_mismatch(trainer_logp, engine_logp, cfg, lengths):
    """IS weights, r = p_trainer / p_engine (None at --tis_cap 0); sums of |log r|, k3 KL (bad pushes show), masks."""
    log_ratio = trainer_logp - engine_logp
    sums = {"mismatch_abs": log_ratio.abs().sum(), "mismatch_kl": KL_ESTIMATORS["k3"](-log_ratio).sum()}
    if cfg.tis_cap == 0:
        return None, sums
    if cfg.is_level == "sequence":
        log_ratio = torch.segment_reduce(log_ratio, "mean", lengths=lengths).repeat_interleave(lengths)
    ratio = log_ratio.exp()
    if cfg.is_mode == "truncate":
        return ratio.clamp(max=cfg.tis_cap), sums
    masked = (ratio < 1 / cfg.tis_cap) | (ratio > cfg.tis_cap)  # IcePop: r where kept, 0 outside the bound
    sums["is_masked_tokens"] = masked.sum()
    return ratio.masked_fill(masked, 0.0), sums


def set_loss_weights(samples, cfg, dp_group):
    """Per-token loss_weight by --loss_agg, from counts over all ranks, times dp (FSDP averages gradients over dp)."""
    counts = torch.tensor([sum(sum(s.sampled) for s in samples), len(samples)], dtype=torch.float64)
    dist.all_reduce(counts, group=dp_group)  # response tokens and sequences of the whole mini-batch
    (tokens, sequences), dp = counts.tolist(), dist.get_world_size(dp_group)
    for s in samples:
        if cfg.loss_agg == "sequence":  # each sequence's token mean, then the mean over sequences (GRPO)
            s.loss_weight = dp / (max(sum(s.sampled), 1) * sequences)
        else:  # every token alike: over the tokens (DAPO), or over sequences x the length limit (Dr. GRPO)
            s.loss_weight = dp / (max(tokens, 1) if cfg.loss_agg == "token" else cfg.max_new_tokens * sequences)


def micro_batches(samples, cfg, group):
    """--micro_batch_size each, or packed to --max_tokens_per_microbatch; equal count on all ranks (collectives)."""
    if cfg.max_tokens_per_microbatch == 0:
        return [samples[i:i + cfg.micro_batch_size] for i in range(0, len(samples), cfg.micro_batch_size)]
    batches, longest = [], 0  # longest: the length of the last micro-batch's first sequence
    for sample in sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True):
        if batches and (len(batches[-1]) + 1) * longest <= cfg.max_tokens_per_microbatch:
            batches[-1].append(sample)
        else:
            batches.append([sample])
            longest = len(sample.prompt_ids) + len(sample.response_ids)
    count = torch.tensor(len(batches))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    while len(batches) < count:
        largest = batches.pop(max(range(len(batches)), key=lambda i: len(batches[i])))
        batches += [largest[:len(largest) // 2], largest[len(largest) // 2:]]
    return batches


@torch.no_grad()
def store_logprobs(model, samples, into, cfg, par):
    """The model's log-probs of each sample's sampled response tokens, without grad, into sample.<into>."""
    for batch in micro_batches(samples, cfg, par.world):
        logp = response_logprobs(model, batch, cfg, par.mesh["tp"])[0]
        for sample, values in zip(batch, logp.split([sum(s.sampled) for s in batch])):
            setattr(sample, into, values)


def train_on_rollouts(model, optimizer, samples, cfg, par):
    """--num_minibatches steps, the ratio vs old_logprobs if stored, else on-policy; returns metric sums by kind."""
    sums = {"token": defaultdict(float), "max": defaultdict(float)}  # same keys, same order on every rank
    per_minibatch, device = len(samples) // cfg.num_minibatches, model.device
    for minibatch in (samples[i:i + per_minibatch] for i in range(0, len(samples), per_minibatch)):
        set_loss_weights(minibatch, cfg, par.dp)
        for batch in micro_batches(minibatch, cfg, par.world):
            logp, entropy = response_logprobs(model, batch, cfg, par.mesh["tp"])
            stored = batch[0].old_logprobs is not None
            old_logp = torch.cat([s.old_logprobs for s in batch]).to(device) if stored else logp.detach()
            lengths = torch.tensor([sum(s.sampled) for s in batch], device=device)
            advantages = torch.tensor([s.advantage for s in batch], device=device).repeat_interleave(lengths)
            weights = torch.tensor([s.loss_weight for s in batch], device=device).repeat_interleave(lengths)
            engine_logp = torch.cat([s.engine_logprobs for s in batch]).to(device)
            is_weights, mismatch = engine_mismatch(old_logp, engine_logp, cfg, lengths)
            ref_logp = torch.cat([s.ref_logprobs for s in batch]).to(device) if cfg.beta > 0 else None
            loss, stats = policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp, entropy, is_weights, lengths)
            loss.backward()
            for key, value in {**stats, **mismatch}.items():
                sums["token"][key] += value
        by_mesh = defaultdict(list)  # the global grad norm, a norm per mesh: clip_grad_norm_ can't mix dp and (dp, tp)
        for grad in [param.grad for param in model.parameters() if param.grad is not None]:
            by_mesh[grad.device_mesh].append(grad)
        grad_norm = math.sqrt(sum(torch.nn.utils.get_total_norm(g).full_tensor().item() ** 2 for g in by_mesh.values()))
        if math.isfinite(grad_norm):  # a step with a non-finite norm is skipped, and counted
            for grads in by_mesh.values() if 0 < cfg.max_grad_norm < grad_norm else []:  # clipped
                torch._foreach_mul_(grads, cfg.max_grad_norm / (grad_norm + 1e-6))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums["max"]["skipped_steps"] += not math.isfinite(grad_norm)  # the norm is global: equal on every rank
        sums["max"]["grad_norm"] += grad_norm / cfg.num_minibatches
    return sums


def lr_factor(step, cfg):
    """The multiple of --lr at a step: linear warm-up, then constant or cosine down to 0.1 at the last step."""
    if step < cfg.warmup_steps or cfg.lr_schedule == "constant":
        return min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def step_metrics(samples, sums, errors, dropped, par):
    """The step's metrics over all ranks, each sum averaged by its kind: "token" sums per sampled token, and so on."""
    lengths = [sum(s.sampled) for s in samples]  # tool output is not counted
    failures = [reward.tool_failure(output) for s in samples for output in s.tool_outputs]
    sums["sample"] = dict(reward=sum(s.score for s in samples), accuracy=sum(s.score >= 1 for s in samples),
                          response_len=sum(lengths), truncated=sum(s.truncated for s in samples),
                          turns=sum(len(s.tool_outputs) + sum(s.sampled[-1:]) for s in samples),  # one per output
                          tool_calls=len(failures), tool_use=sum(bool(s.tool_outputs) for s in samples))
    sums["count"] = dict(samples=len(samples), tokens=sum(lengths), reward_errors=len(errors), groups_dropped=dropped,
                         tool_errors=failures.count("error"), tool_timeouts=failures.count("timeout"))
    sums["max"]["response_len_max"] = max(lengths)
    local = {kind: {key: float(value) for key, value in values.items()} for kind, values in sums.items()}
    ranks = [None] * dist.get_world_size(par.world)
    dist.all_gather_object(ranks, local, group=par.world)
    total = {kind: {key: sum(r[kind][key] for r in ranks) / par.mesh["tp"].size() for key in local[kind]}
             for kind in ("token", "sample", "count")}
    metrics = {key: value / max(total["count"]["tokens"], 1) for key, value in total["token"].items()}
    metrics.update({key: value / total["count"]["samples"] for key, value in total["sample"].items()})
    return dict(metrics, **total["count"], **{key: max(r["max"][key] for r in ranks) for key in local["max"]})


def open_run_dir(cfg, par, start_step, wandb_id):
    """Rank 0 prints the config, starts wandb (returned), writes config.json, its run_id seen by all, trims metrics."""
    wandb_run = []
    def write():
        print(" ".join(f"{k}={v}" for k, v in asdict(cfg).items()), flush=True)
        config = dict(asdict(cfg), run_id=os.urandom(8).hex())  # new: a folder that only one node sees lacks it
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
            if cfg.wandb_project:
                import wandb
                wandb_run.append(wandb.init(project=cfg.wandb_project, config=asdict(cfg), id=wandb_id, resume="allow",
                                            dir=cfg.out_dir))
            pathlib.Path(cfg.out_dir, "config.json").write_text(json.dumps(config, indent=1))
        except OSError as error:  # the other ranks stop with it: torchrun ends every rank when one fails
            raise SystemExit(f"--out_dir {cfg.out_dir}: cannot write there ({error.strerror}): choose another folder")
        except Exception as error:  # wandb.init's: no API key (in a terminal it asks for one), no network
            raise SystemExit(f"--wandb_project {cfg.wandb_project}: {error} (log offline with WANDB_MODE=offline)")
        metrics = pathlib.Path(cfg.out_dir, "metrics.jsonl")
        if metrics.exists():  # steps after start_step run again; a line torn by a crash has no newline
            lines = metrics.read_text().splitlines(keepends=True)
            metrics.write_text("".join(x for x in lines if x.endswith("\n") and json.loads(x)["step"] <= start_step))
        return config["run_id"]
    run_id = on_first_rank(write, par.world)
    path = pathlib.Path(cfg.out_dir, "config.json")
    seen = torch.tensor(int(path.exists() and run_id in path.read_text()))  # checkpoints go there, read by every rank
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=par.world)
    if not seen:
        raise SystemExit(f"--out_dir {cfg.out_dir}: ranks on other nodes do not see what rank 0 writes there; it must "
                         "be a folder every node sees (a shared file system), as the same path on each")
    return wandb_run[0] if wandb_run else None


def log_step(step, metrics, cfg, wandb_run, sample, tokenizer):
    """A console line, a metrics.jsonl line and wandb; every --sample_every steps, a sample too."""
    line = ("step {step}/{steps} | reward {reward:.3f} acc {accuracy:.2f} | len {response_len:.0f} | ent {entropy:.2f}"
            " kl {kl:.4f} | {time_step:.1f}s (gen {time_rollout:.1f} train {time_train:.1f} push {time_push:.1f})"
            " | eta {eta}").format(step=step + 1, steps=cfg.steps, **metrics,
                                   eta=datetime.timedelta(seconds=round(metrics["eta_s"])))
    line += f" | tool {metrics['tool_calls']:.1f}/sample" if cfg.tool else ""
    problems = "".join(f" | {k} {metrics[k]:.0f}" for k in ("reward_errors", "skipped_steps") if metrics[k])  # not 0
    evals = " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval_") and k != "eval_prompts")
    print(line + problems + (f"\n  eval ({metrics['eval_prompts']:.0f} prompts): {evals}" if evals else ""), flush=True)
    finite = {k: v if math.isfinite(v) else None for k, v in metrics.items()}  # strict JSON: a NaN norm is null
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step + 1, **finite}) + "\n")
    if cfg.sample_every > 0 and (step + 1) % cfg.sample_every == 0:
        text = tokenizer.decode(sample.prompt_ids) + tokenizer.decode(sample.response_ids)  # wandb keeps the console
        print(f"  sample (reward {sample.reward:.3f}):\n{text}", flush=True)
    if wandb_run is not None:
        wandb_run.log(metrics, step=step + 1)


def evaluate(engine, tokenizer, test_set, workers, cfg, par):
    """Greedy accuracy, mean@k and pass@k (of k samples at --eval_temperature) on --eval_prompts held-out prompts."""
    dp_rank, dp = par.mesh["dp"].get_local_rank(), par.mesh["dp"].size()
    items = [test_set[i] for i in range(dp_rank, min(cfg.eval_prompts, len(test_set)), dp)]
    def solved(n, temperature):  # [len(items), n]: reward 1.0; a rank without items (more ranks than prompts): [0, n]
        samples, _ = on_first_rank(
            lambda: generate_rollouts(engine, workers, tokenizer, items, cfg, cfg.seed, temperature, n), par.tp)
        return torch.tensor([s.score for s in samples]).view(-1, n) >= 1
    sampled = solved(cfg.eval_k, cfg.eval_temperature)
    sums = torch.tensor([solved(1, 0.0).sum(), sampled.float().mean(1).sum(), sampled.any(1).sum(), len(items)])
    dist.all_reduce(sums, group=par.world)
    greedy, mean_at_k, pass_at_k, n = (sums / par.mesh["tp"].size()).tolist()  # n >= 1: --eval_prompts >= 1
    return {"eval_greedy_acc": greedy / n, f"eval_mean@{cfg.eval_k}": mean_at_k / n,
            f"eval_pass@{cfg.eval_k}": pass_at_k / n, "eval_prompts": n}


def save_checkpoint(cfg, step, model, optimizer, tokenizer, wandb_id, world):
    """checkpoints/step_N: hf/, dcp/, trainer_state.json (data, sampling and lr follow the step); .tmp, then renamed."""
    rank, final = dist.get_rank(), os.path.join(cfg.out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier(group=world)
        trained = {name: param for name, param in model.named_parameters() if param.requires_grad}  # LoRA: adapters
        dcp.save({"model": trained, "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=f"{tmp}/dcp")
        full = {name: t.cpu() for bucket in weight_buckets(model, 0, torch.float32) for name, t in bucket if rank == 0}
        adapters = {f"base_model.model.{n}": p.detach().full_tensor().cpu() for n, p in trained.items() if "lora" in n}
        if rank == 0:  # config and safetensors files of 5 GB at most, which load_weights streams one at a time
            model.save_pretrained(os.path.join(tmp, "hf"), state_dict=full, max_shard_size="5GB")
            tokenizer.save_pretrained(os.path.join(tmp, "hf"))
            if adapters:  # PEFT's layout: peft.PeftModel.from_pretrained(base model, "adapter") loads it
                os.makedirs(os.path.join(tmp, "adapter"))
                save_file(adapters, os.path.join(tmp, "adapter", "adapter_model.safetensors"))
                pathlib.Path(tmp, "adapter", "adapter_config.json").write_text(json.dumps(dict(
                    peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                    target_modules=[name.split(".")[-1] for name in TP_PLAN], base_model_name_or_path=cfg.model)))
            for file in pathlib.Path(tmp, "hf").iterdir():
                os.chmod(file, 0o644)  # transformers writes the weights 0600; readable like the rest
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in pathlib.Path(tmp).rglob("*") if f.is_file()}
            state = dict(step=step, wandb_id=wandb_id, config=asdict(cfg), files=files)  # a resume checks flags, sizes
            pathlib.Path(tmp, "trainer_state.json").write_text(json.dumps(state))
            os.sync()  # every file and folder on disk before the rename, the rename after: a power cut leaves one
            os.replace(tmp, final)  # checkpoint whole, the old or the new
            os.sync()
            for old in checkpoints(cfg.out_dir)[:-cfg.keep_checkpoints] + checkpoints(cfg.out_dir, ".tmp"):
                shutil.rmtree(old)  # the oldest, and the .tmp of saves that a kill cut off
    except BaseException as error:  # a full disk (dcp raises a BaseException): no half-written folder is left
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"saving {final} failed ({str(error).strip().splitlines()[-1][:300]}); removed {tmp}: free "
                         "space under --out_dir, then --resume auto continues from the last checkpoint")
    dist.barrier(group=world)
    return final


def damage(path):
    """What is missing, cut short or unreadable in checkpoint `path` ("" if nothing), by trainer_state.json's sizes."""
    try:
        sizes = json.loads(pathlib.Path(path, "trainer_state.json").read_text()).get("files", {})  # older: no sizes
        return next((f"{name} is not the {size} bytes saved" for name, size in sizes.items()
                     if os.path.getsize(os.path.join(path, name)) != size), "")  # an OSError names a missing one
    except (ValueError, AttributeError):
        return "trainer_state.json is not the JSON saved"
    except OSError as error:
        return f"{error.strerror}: {error.filename}"


def checkpoints(out_dir, suffix=""):
    """Complete checkpoints under out_dir, oldest first; with suffix ".tmp", the saves in progress or cut off."""
    return sorted(map(str, pathlib.Path(out_dir, "checkpoints").glob("step_" + "[0-9]" * 6 + suffix)))


def resume_folder(cfg, model_config):
    """The --resume folder ("auto": the newest whole one under out_dir; "": none), its step and wandb id."""
    found = checkpoints(cfg.out_dir)
    while cfg.resume == "auto" and found and (why := damage(found[-1])):  # out of the way of the saves to come
        print(f"--resume auto: skipping {found[-1]} ({why}), moved to {found[-1]}.damaged", flush=True)
        os.replace(found[-1], found.pop() + ".damaged")
    path = (found[-1] if found else "") if cfg.resume == "auto" else cfg.resume  # auto: the newest that reads whole
    if path and (why := damage(path)):
        raise SystemExit(f"--resume {path}: not a whole checkpoint ({why}): --resume auto takes the newest whole one")
    state = json.loads(pathlib.Path(path, "trainer_state.json").read_text()) if path else {"step": 0, "wandb_id": None}
    for key in ("lora_rank", "lora_alpha") if path else ():  # other parameters; or B A rescaled, the policy moved
        saved_value = state.get("config", {}).get(key, getattr(Config, key))  # before LoRA: full fine-tuning
        if saved_value != getattr(cfg, key) and (key == "lora_rank" or cfg.lora_rank):  # alpha scales LoRA alone
            raise SystemExit(f"--resume {path} was trained with --{key} {saved_value}: resume with that --{key}")
    if path and state["step"] >= cfg.steps:
        raise SystemExit(f"--resume {path} is at step {state['step']}, --steps {cfg.steps}: raise --steps to go on")
    if later := [folder for folder in found if int(folder[-6:]) > state["step"]]:  # its saves would collide, or mix
        raise SystemExit(f"--out_dir {cfg.out_dir} holds checkpoints after step {state['step']} ({later[-1]}): "
                         "--resume auto continues the newest; else delete them, or use another --out_dir")
    saved = AutoConfig.from_pretrained(os.path.join(path, "hf")) if path else model_config
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if (was := getattr(saved, key, None)) != (now := getattr(model_config, key, None)):
            raise SystemExit(f"--resume {path} is of another model ({key} {was}, --model's {now}): pass its --model")
    changed = [f"--{key} {value} -> {getattr(cfg, key)}" for key, value in state.get("config", {}).items()
               if key != "resume" and value != getattr(cfg, key, value)]
    if changed:
        print(f"resuming {path} with flags changed since it was saved: {', '.join(changed)}", flush=True)
    return path, state["step"], state["wandb_id"]


@contextlib.contextmanager
def announce(what, rank):  # on rank 0: what is being done, then how long it took
    start = time.perf_counter()
    if rank == 0:
        print(f"{what}...", end=" ", flush=True)
    yield
    if rank == 0:
        print(f"{time.perf_counter() - start:.1f}s", flush=True)


def shut_down(engine, reward_workers, wandb_run):
    """Reward workers and wandb first: SGLang's shutdown SIGKILLs every child, and wandb's killed service hangs."""
    try:
        reward_workers.close()
        if wandb_run is not None:
            import wandb
            wandb.teardown()  # finishes the run, and ends its service process
    finally:
        engine.shutdown()  # and its scheduler processes


def main():
    cfg = parse_config()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = None if "MASTER_ADDR" in os.environ else dist.HashStore()  # `python train.py`: one process, no torchrun
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world, store=store,
                            timeout=datetime.timedelta(hours=1), device_id=device if cuda else None)  # covers a start
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # none changed in place
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # TP's few small tensors
    transformers.utils.logging.disable_progress_bar()
    check_config(cfg, world)  # from here: everything that can be checked before a model is built
    par = parallel_groups(device.type, cfg.tp)
    train_set = PromptDataset(cfg, "train")
    test_set = PromptDataset(cfg, "test") if cfg.eval_every > 0 else None  # no evaluation needs no test split
    tokenizer, model_config = load_tokenizer_and_config(cfg, [*train_set, *(test_set or [])])
    files = on_first_rank(lambda: weight_files(cfg) if cfg.model != "tiny" else [None], par.world)
    resumed_from, start_step, wandb_id = on_first_rank(lambda: resume_folder(cfg, model_config), par.world)
    wandb_run = open_run_dir(cfg, par, start_step, wandb_id)  # after every check: a run refused leaves it as it was
    with announce(f"loading {cfg.model} and the engine{', resuming ' + resumed_from if resumed_from else ''}", rank):
        model = build_model(model_config, par.mesh, device, cfg.activation_checkpointing, cfg.lora_rank, cfg.lora_alpha)
        ref_model = build_model(model_config, par.mesh, device).requires_grad_(False) \
            if cfg.beta > 0 and not cfg.lora_rank else None  # LoRA's reference: the base, its adapters off
        load_weights([model, ref_model] if ref_model else [model], files, cfg, model_config, par.world)
        check_pushed_names(model, model_config)
        # Before any forward: FSDP2 then leaves root parameters unsharded, and an optimizer would hold stale tensors.
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)  # frozen: no state
        if resumed_from:  # the model and optimizer as save_checkpoint wrote them
            trained = {name: param for name, param in model.named_parameters() if param.requires_grad}
            state = {"model": trained, "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(resumed_from, "dcp"))  # the parameters in place
            set_optimizer_state_dict(model, optimizer, state["optim"])
        # Forked before the engine and the signal handlers exist. Rank 0 shows the first failed call's traceback.
        reward_workers = reward.RewardWorkers(cfg.reward_workers, cfg.reward_timeout, show_first_error=rank == 0)
        free_gpu_cache(par.tp)  # SGLang sizes itself from the free memory it sees at start
        owner = par.mesh["tp"].get_local_rank() == 0  # one engine per TP group, run by the group's first rank
        engine = SGLangEngine(cfg, model_config, owner, par.world) if cfg.engine == "sglang" else \
            HFEngine(model_config, device) if owner else Engine()
    stop = threading.Event()  # set by SIGTERM or Ctrl-C: finish the step, save, exit (README: stopping a run)
    def request_stop(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt
        if rank == 0 and not stop.is_set():
            print(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    try:
        engine.release_memory()  # the first push, as every other, finds the engine's memory released
        push_weights(model, engine, cfg, par)
        run_start = time.perf_counter()
        for step in range(start_step, cfg.steps):
            start = time.perf_counter()  # generate, reward G samples per prompt (dynamic sampling: maybe more rounds)
            samples, errors, dropped = collect_rollouts(engine, reward_workers, train_set, tokenizer, cfg, step, par)
            engine.release_memory()
            rollout_done = time.perf_counter()
            on_policy = 0 if cfg.kl_in_reward else len(samples) // cfg.num_minibatches  # the first mini-batch's: live
            store_logprobs(model, samples[on_policy:], "old_logprobs", cfg, par)
            if cfg.beta > 0:  # the reference: the initial policy, or with LoRA the base (adapters scaled by 0)
                lora_scale, model.lora_scale = model.lora_scale, 0.0
                store_logprobs(ref_model or model, samples, "ref_logprobs", cfg, par)
                model.lora_scale = lora_scale
                if ref_model is not None:  # FSDP keeps root parameters whole after a forward that has no backward
                    ref_model.reshard()  # (the policy's are used whole by the update next, as without --beta)
            set_advantages(samples, cfg)  # within each group of G
            for group in optimizer.param_groups:  # the flags', not a checkpoint's; lr a function of the step
                group.update(lr=cfg.lr * lr_factor(step, cfg), weight_decay=cfg.weight_decay)
            sums = train_on_rollouts(model, optimizer, samples, cfg, par)  # loss and update
            train_done = time.perf_counter()
            push_weights(model, engine, cfg, par)  # the new weights into the engine
            end = time.perf_counter()
            metrics = step_metrics(samples, sums, errors, dropped, par)
            metrics.update(time_rollout=rollout_done - start, time_train=train_done - rollout_done,
                           time_push=end - train_done, time_step=end - start, lr=optimizer.param_groups[0]["lr"],
                           eta_s=(end - run_start) / (step + 1 - start_step) * (cfg.steps - step - 1))  # rank 0's
            stopping = torch.tensor(int(stop.is_set()))
            dist.all_reduce(stopping, op=dist.ReduceOp.MAX, group=par.world)  # a signal to any rank stops all
            last = step + 1 == cfg.steps
            if cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last):  # evaluate, then log
                with announce(f"evaluating on {min(cfg.eval_prompts, len(test_set))} held-out prompts", rank):
                    metrics.update(evaluate(engine, tokenizer, test_set, reward_workers, cfg, par))
            if rank == 0:
                log_step(step, metrics, cfg, wandb_run, samples[0], tokenizer)
            if stopping or last or (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0):  # on a signal: save, stop
                with announce(f"saving the checkpoint of step {step + 1}", rank):
                    path = save_checkpoint(cfg, step + 1, model, optimizer, tokenizer,
                                           wandb_run.id if wandb_run else wandb_id, par.world)
            if stopping:
                if rank == 0:
                    print(f"stopped after step {step + 1}: checkpoint {path}; continue with --resume auto", flush=True)
                break
    finally:  # no orphaned engine or reward processes, whatever ended the run
        shut_down(engine, reward_workers, wandb_run)
    dist.barrier(group=par.world)  # gloo aborts a rank whose peer tears down first
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except SystemExit as error:  # every rank stops alike: rank 0 says why, once
        raise SystemExit(error.code if int(os.environ.get("RANK", 0)) == 0 or not error.code else 1)
