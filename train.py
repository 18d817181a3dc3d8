"""GRPO for Qwen and Llama-architecture models in one file: G completions per prompt from the engine, rewards, group
advantages, clipped policy-gradient steps (FSDP2 over "dp", TP over "tp"), weights pushed back. Flags: Config.
    torchrun --standalone --nproc_per_node=2 train.py --preset cpu   # CPU demo: tiny random model, toy task
    torchrun --nproc_per_node=8 train.py --tp 2                       # GPU: Countdown, Qwen2.5-3B-Instruct
Edit `PromptDataset.__getitem__` below (what a prompt is) and `reward_fn` in reward.py (how a completion scores).
"""
import contextlib
import datetime
import functools
import glob
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import textwrap
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Literal

from huggingface_hub import snapshot_download
from safetensors.torch import load_file, safe_open
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.checkpoint import checkpoint
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Qwen2Config

import reward


@dataclass
class Config:
    model: str = "Qwen/Qwen2.5-3B-Instruct"  # hub id or local folder; "tiny": random tiny Qwen2 + character tokenizer
    task: Literal["countdown", "gsm8k", "math", "toy", "addition"] = "countdown"  # README: tasks and what to expect
    data_path: str = ""  # gsm8k / math: hub id or a local folder of train.* and test.* (jsonl / parquet); "": default
    train_size: int = 20000  # countdown / toy / addition: problems generated for training
    test_size: int = 500  # countdown / toy / addition: held-out problems, disjoint from training
    plain_template: bool = False  # R1-Zero's plain prompt even when the tokenizer has a chat template (base models)
    preset: Literal["", "cpu"] = ""  # cpu: tiny model, toy task, small batches; flags given explicitly still win
    engine: Literal["sglang", "hf"] = "sglang" if torch.cuda.is_available() else "hf"  # hf: HF generate (CPU)
    mem_fraction: float = 0.5  # sglang: fraction of the GPU's free memory at start for its weights and KV cache
    engine_port: int = 30000  # sglang: each TP group's engine uses engine_port + its first rank's local rank
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
    ref_on_cpu: bool = False  # keep the reference model's shards in CPU memory between uses (GPU)
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
    sample_every: int = 10  # print a sampled prompt, completion and reward every N steps (and log them); 0: never
    tool: Literal["", "python"] = ""  # python: responses may run ```python blocks (README: the Python tool)
    max_turns: int = 4  # with --tool: generation turns per response, each but the last may end in a block that is run


PRESETS = {"cpu": dict(model="tiny", task="toy", engine="hf", steps=30, prompts_per_step=8, group_size=8, lr=1e-2,
                       max_new_tokens=16, warmup_steps=0, micro_batch_size=32, train_size=1000, test_size=100,
                       out_dir="runs/cpu", eval_every=10, eval_prompts=16, save_every=0, reward_workers=2)}


def parse_config(argv=None):
    parser = HfArgumentParser(Config, allow_abbrev=False)
    parser.set_defaults(**PRESETS.get(parser.parse_known_args(argv)[0].preset, {}))
    cfg, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"unknown flags {unknown}: every flag is a field of Config in train.py")
    return cfg


def check_config(cfg, world):
    """Catch bad flags before any model is loaded, one at a time; each message names the flag to change."""
    minimum = dict(tp=1, prompts_per_step=1, group_size=2, num_minibatches=1, micro_batch_size=1, max_new_tokens=1,
                   eval_k=1, logprob_chunk=1, reward_workers=1, beta=0, entropy_coef=0, tis_cap=0, overlong_buffer=0,
                   dynamic_sampling_rounds=0, max_tokens_per_microbatch=0, eval_every=0, save_every=0, lr=0, steps=1,
                   keep_checkpoints=1, sample_every=0, reward_timeout=0.001, max_turns=1)
    for flag, low in minimum.items():
        if getattr(cfg, flag) < low:
            raise SystemExit(f"--{flag} must be at least {low}, not {getattr(cfg, flag)}")
    if world % cfg.tp:
        raise SystemExit(f"--tp {cfg.tp} does not divide the world size {world}: use a divisor of {world}")
    dp = world // cfg.tp
    if cfg.prompts_per_step % dp:
        raise SystemExit(f"--prompts_per_step {cfg.prompts_per_step} must divide by dp = {dp}")
    samples_per_rank = cfg.prompts_per_step // dp * cfg.group_size
    if samples_per_rank % cfg.num_minibatches:
        raise SystemExit(f"--num_minibatches {cfg.num_minibatches} must divide the {samples_per_rank} samples a rank")
    if cfg.kl_in_reward and cfg.beta == 0:
        raise SystemExit("--kl_in_reward needs --beta above 0: beta scales the KL penalty")
    if cfg.overlong_buffer > cfg.max_new_tokens:
        raise SystemExit("--overlong_buffer must be at most --max_new_tokens")
    if (cfg.is_mode, cfg.is_level) != ("truncate", "token") and cfg.tis_cap <= 1:
        raise SystemExit("--is_mode and --is_level act through --tis_cap: set it above 1, the bound on the ratio")
    if cfg.engine == "sglang":
        if not torch.cuda.is_available():
            raise SystemExit("--engine sglang needs a CUDA GPU: use --engine hf here")
        if importlib.util.find_spec("sglang") is None:
            raise SystemExit("--engine sglang needs SGLang (pip install -r requirements.txt), or use --engine hf")
        if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) % cfg.tp:
            raise SystemExit(f"--tp {cfg.tp} must divide the GPUs per node: an engine's TP group lives on one node")


class PromptDataset(torch.utils.data.Dataset):
    """Prompts of one task. Edit __getitem__ to change what a prompt says or to add a task."""
    def __init__(self, cfg, split):
        self.task, self.boxed_prompt = cfg.task, reward.TOOL_PROMPT if cfg.tool else reward.BOXED_PROMPT
        self.rows = reward.load_rows(cfg.task, split, cfg.data_path, cfg.train_size, cfg.test_size, cfg.seed)
        least = cfg.prompts_per_step if split == "train" else 1  # a step's prompts; an evaluation's
        warning = reward.check_items([self[i] for i in range(len(self))], split, least)  # stops on what cannot work
        if warning and int(os.environ.get("RANK", 0)) == 0:
            print(warning, flush=True)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        """{"prompt": chat messages, or a string used as is; "task"; and the fields reward.reward_fn reads}."""
        row = self.rows[i]
        if self.task == "toy":
            return {"prompt": f"Say {row['target']}:", "task": "toy", "target": row["target"]}
        if self.task == "countdown":
            content, fields = reward.COUNTDOWN_PROMPT.format(**row), row  # the row is {"nums", "target"}
        elif self.task in ("gsm8k", "addition"):  # addition's rows are generated in gsm8k's format
            content = self.boxed_prompt.format(question=row["question"])
            fields = {"answer": row["answer"].split("####")[-1].strip()}
        else:  # math: the answer is the last \boxed{} of the reference solution, in LaTeX
            content = self.boxed_prompt.format(question=row["problem"])
            fields = {"answer": reward.last_boxed(row["solution"])}
        return {"prompt": [{"role": "user", "content": content}], "task": self.task, **fields}


def load_tokenizer_and_config(cfg):
    """--model's tokenizer and config; for "tiny", the character tokenizer and reward.TINY_MODEL, stop and pad ids."""
    if cfg.model == "tiny":
        tokenizer = reward.char_tokenizer()
        return tokenizer, Qwen2Config(vocab_size=len(tokenizer), eos_token_id=reward.stop_token_ids(tokenizer),
                                      pad_token_id=tokenizer.pad_token_id, **reward.TINY_MODEL)
    try:
        return AutoTokenizer.from_pretrained(cfg.model), AutoConfig.from_pretrained(cfg.model)
    except OSError as error:  # a name that is no folder here is looked up on the hub
        raise SystemExit(f"--model {cfg.model}: no such folder, and the hub: {str(error).splitlines()[0]}")


def step_rows(dataset, step, cfg, dp_rank, dp, sampling_round=0):
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
    response_ids: list[int]  # the tokens after it as the engine saw them, stop token included: never re-tokenised
    sampled: list[bool]  # per response token: sampled by the engine, or tool output (no loss, no metric)
    engine_logprobs: torch.Tensor  # the engine's log-probs of the sampled tokens, of logits / temperature
    tool_outputs: list[str] = field(default_factory=list)  # what each run of its code printed (--tool python)
    truncated: bool = False  # cut off by --max_new_tokens rather than ended by a stop token
    score: float = 0.0  # reward_fn's value
    reward: float = 0.0  # score plus shaping (the overlong penalty): what advantages are made from
    advantage: float = 0.0
    loss_weight: float = 0.0  # the weight of each of its tokens in the mini-batch loss (--loss_agg)
    old_logprobs: torch.Tensor | None = None  # the policy's before the update, where the step needs them
    ref_logprobs: torch.Tensor | None = None  # the reference model's (--beta > 0)


# q/k/v and gate/up split their output features over tp, o and down their input: one all-reduce per block each way.
TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
           "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
# Qwen3's per-head q/k norms see a rank's heads only (dim 2): replicated weights, gradients summed over tp in backward.
QK_NORM_PLAN = {"self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def parallelize(model, mesh, activation_checkpointing, offload=False):
    """TP inside each decoder layer, then activation checkpointing, then FSDP per layer and at the root."""
    tp = mesh["tp"].size()
    for heads in ("num_attention_heads", "num_key_value_heads"):  # each rank computes whole heads
        if getattr(model.config, heads) % tp:
            raise SystemExit(f"--tp {tp} must divide the model's {heads} ({getattr(model.config, heads)})")
    if tp > 1:
        for layer in model.model.layers:
            qk_norm = QK_NORM_PLAN if hasattr(layer.self_attn, "q_norm") else {}
            parallelize_module(layer, mesh["tp"], {**TP_PLAN, **qk_norm})
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    on_gpu = mesh.device_type == "cuda"  # GPU: bf16 compute, fp32 master weights and reductions; CPU: fp32
    options = dict(mesh=mesh["dp"], offload_policy=CPUOffloadPolicy(pin_memory=on_gpu) if offload else OffloadPolicy(),
                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else None,
                                                  reduce_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


def build_model(model_config, mesh, device, activation_checkpointing=False, offload=False):
    """Built on the meta device and sharded; the weights are uninitialised until load_weights."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    parallelize(model, mesh, activation_checkpointing, offload)
    model.to_empty(device="cpu" if offload else device)
    with torch.device(device):  # rotary frequencies are a non-persistent buffer: rebuild it off the meta device
        model.model.rotary_emb = type(model.model.rotary_emb)(model_config)
    return model


def weight_files(cfg):
    """On rank 0: --model's model*.safetensors files (a hub id is downloaded), each checked to be whole."""
    folder = cfg.model if os.path.isdir(cfg.model) else snapshot_download(cfg.model, allow_patterns="*.safetensors")
    files = sorted(glob.glob(os.path.join(folder, "model*.safetensors")))
    for file in files:
        try:
            safe_open(file, "pt")  # reads the header, which must cover the whole file
        except Exception as error:  # a truncated download, a full disk at save time
            raise SystemExit(f"--model: {file} cannot be read ({error}): download or save it again")
    return files


def load_weights(models, files, cfg, model_config):
    """`files` (weight_files) into the sharded models one at a time, rank 0 reading: host memory holds one at most."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    loaded = set()
    torch.manual_seed(cfg.seed)  # --model tiny: one part (None), random weights seeded with --seed
    for part in files:
        state = {}
        if dist.get_rank() == 0:
            state = load_file(part) if part else AutoModelForCausalLM.from_config(model_config).state_dict()
        loaded |= state.keys()
        for model in models:  # a shallow copy: set_model_state_dict replaces the dict's entries with their shards
            set_model_state_dict(model, dict(state), options=options)
    tied = {"lm_head.weight"} if model_config.tie_word_embeddings else set()
    missing = on_first_rank(lambda: sorted(set(models[0].state_dict()) - loaded - tied))
    if missing:
        raise SystemExit(f"--model {cfg.model}: its model*.safetensors files lack {missing[:3]} "
                         f"({len(missing)} tensors); save the model with save_pretrained")


def on_first_rank(work, group=None):
    """work() on the group's first rank (default 0), sent to all: one answer; a SystemExit there stops every rank."""
    box, group = [None], group or dist.group.WORLD
    if dist.get_rank(group) == 0:
        try:
            box[0] = work()
        except SystemExit as error:  # a check made on one rank: the others would fail in the next collective
            box[0] = error
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], SystemExit):
        raise box[0]
    return box[0]


class HFEngine:
    """HF generate on an unsharded policy copy; as SGLangEngine, a Sample per prompt and (name, tensor) buckets in."""
    def __init__(self, model_config, device, pad_id):
        self.model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).to(device).eval()
        self.pad_id = pad_id

    def update_weights(self, buckets):
        for bucket in buckets:
            self.model.load_state_dict(dict(bucket), strict=False)  # check_pushed_names vouches for the names

    @torch.no_grad()
    def generate(self, prompts, temperature, top_p, budgets, stop_ids, seed):  # budgets: max new tokens per prompt
        longest, device = max(map(len, prompts)), self.model.device
        ids = torch.tensor([[self.pad_id] * (longest - len(p)) + p for p in prompts], device=device)  # left-padded
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
        with torch.random.fork_rng(devices=[]):  # seeded sampling that leaves the global RNG alone
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets),
                                      eos_token_id=stop_ids, pad_token_id=self.pad_id, return_dict_in_generate=True,
                                      output_logits=True, **sampling)
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / (temperature or 1.0), -1)  # [N, T, V]
        seqs = [seq[:budget] for seq, budget in zip(out.sequences[:, longest:].tolist(), budgets)]  # below the batch's
        seqs = [seq[:next((t + 1 for t, tok in enumerate(seq) if tok in stop_ids), len(seq))] for seq in seqs]  # stop
        return [Sample(prompt, seq, [True] * len(seq), lps[torch.arange(len(seq)), seq].cpu())
                for prompt, seq, lps in zip(prompts, seqs, logprobs)]


class SGLangEngine:
    """In-process SGLang, one per trainer TP group on its GPUs; weights come as bf16 buckets by CUDA IPC, not disk."""
    def __init__(self, cfg, model_config):
        import sglang
        rank, base_gpu_id = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))  # TP group's first
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # or its schedulers hang joining torchrun's store
        config_dir = os.path.join(cfg.out_dir, f"engine_model_rank{rank}")  # read from disk by SGLang
        model_config.save_pretrained(config_dir)
        # The engine's processes inherit ignored SIGINT / SIGTERM: torchrun's signals are the trainer's to act on.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.engine = sglang.Engine(
            model_path=config_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", tp_size=cfg.tp,
            dp_size=1, base_gpu_id=base_gpu_id, nccl_port=cfg.engine_port + base_gpu_id, random_seed=cfg.seed + rank,
            enable_memory_saver=True, mem_fraction_static=cfg.mem_fraction, log_level="error")
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # The first request starts SGLang's event loop, which installs its own SIGTERM handler: the trainer's wins.
        self.engine.generate(input_ids=[[0]], sampling_params={"max_new_tokens": 1})
        self.released = False

    def generate(self, prompts, temperature, top_p, budgets, stop_ids, seed):  # seed: hf only; SGLang: --seed
        sampling = dict(temperature=temperature, top_p=top_p, stop_token_ids=stop_ids)
        params = [dict(sampling, max_new_tokens=n) for n in budgets]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [Sample(prompt, out["output_ids"], [True] * len(out["output_ids"]),
                       torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]))
                for prompt, out in zip(prompts, outputs)]

    def release_memory(self):  # after each rollout: the training phase gets the engine's weights and KV cache memory
        self.engine.release_memory_occupation(tags=["kv_cache", "weights"])
        self.released = True

    def update_weights(self, payloads):  # per bucket, a serialized copy for each engine TP rank (sglang_payloads)
        if self.released:  # resuming what was not released crashes the engine
            self.engine.resume_memory_occupation(tags=["weights"])  # freed, not kept: every weight is pushed
        session = hasattr(self.engine, "begin_weight_update")  # sglang >= 0.5.21 pushes inside a session
        if session:
            self.check(self.engine.begin_weight_update())
        try:
            for per_rank in payloads:
                self.check(self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket",
                                                                  flush_cache=False))
        finally:  # an open session would refuse the next push
            if session:
                self.check(self.engine.end_weight_update())
        self.engine.flush_cache()  # cached prefixes were computed with the old weights
        if self.released:
            self.engine.resume_memory_occupation(tags=["kv_cache"])
            self.released = False

    @staticmethod
    def check(result):  # SGLang reports a failed weight update as (False, message) rather than raising
        if not result[0]:
            raise RuntimeError(f"SGLang weight update failed: {result[1]}")


def free_gpu_cache(group):
    """Give the caching allocator's memory back and wait for the group: SGLang, on the same GPUs, re-takes its own."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        dist.barrier(group=group)


def check_pushed_names(model, model_config):
    """Pushed names and shapes must be those of SGLang's `architectures` class: it skips unknown names silently."""
    architecture = (model_config.architectures or [""])[0]
    if not hasattr(transformers, architecture):
        raise SystemExit(f"`architectures` in --model's config.json is {architecture!r}: no class of transformers")
    with torch.device("meta"):
        expected = {n: list(p.shape) for n, p in getattr(transformers, architecture)(model_config).named_parameters()}
    pushed = {name: list(param.shape) for name, param in model.named_parameters()}
    for name in [*pushed, *sorted(expected.keys() - pushed.keys())]:  # the model's order, then what it lacks
        if pushed.get(name) != expected.get(name):
            raise SystemExit(f"the trainer pushes {name} as {pushed.get(name)}, the engine's {architecture} has it as "
                             f"{expected.get(name)}: check `architectures` in --model's config.json")


def weight_buckets(model, bucket_bytes, dtype, tp_group):
    """Full HF-named tensors in ~bucket_bytes buckets; every rank runs to the end (full_tensor() is a collective)."""
    bucket, size = [], 0
    for name, param in model.named_parameters():
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach().to(dtype)
        bucket.append((name, full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
    free_gpu_cache(tp_group)  # before the engine's KV cache comes back


def sglang_payloads(buckets, tp_group):
    """Per bucket, each tp rank's CUDA IPC handles of its own copy, gathered on the group's first rank (else None)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    if torch.cuda.is_available():
        monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID, as the engine's side expects
    for bucket in buckets:
        flat = FlattenedTensorBucket(named_tensors=bucket)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        per_rank = [None] * dist.get_world_size(tp_group) if dist.get_rank(tp_group) == 0 else None
        dist.gather_object(MultiprocessingSerializer.serialize(payload, output_str=True), per_rank,
                           dst=dist.get_global_rank(tp_group, 0), group=tp_group)
        yield per_rank


def push_weights(model, engine, cfg, tp_group):
    """The new weights into the engine; ranks without an engine still join every gather."""
    free_gpu_cache(tp_group)  # before the engine's weights come back
    on_sglang = cfg.engine == "sglang"
    buckets = weight_buckets(model, cfg.bucket_mb << 20, torch.bfloat16 if on_sglang else torch.float32, tp_group)
    if on_sglang:
        buckets = sglang_payloads(buckets, tp_group)
    if engine is not None:
        engine.update_weights(buckets)
    else:
        for _ in buckets:  # every gather is a collective that the engine's rank runs too; nothing is kept
            pass
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # free the buckets whose IPC handles the engine has released


def generate_rollouts(engine, workers, tokenizer, rows, cfg, seed, n, temperature):
    """On the engine's rank: n scored samples per row, failed reward_fn calls' tracebacks. With --tool, in turns: at a
    stop that closes a ```python block the workers run it, and its output is appended as unsampled tokens."""
    stop_ids, fence_ids = reward.stop_token_ids(tokenizer), reward.fence_token_ids(tokenizer) if cfg.tool else []
    samples = [Sample(reward.encode_prompt(tokenizer, row["prompt"], cfg.plain_template), [], [], torch.zeros(0))
               for row in rows for _ in range(n)]
    running = samples
    while running := [s for s in running if len(s.response_ids) < cfg.max_new_tokens]:  # budget left (all turns')
        turns = engine.generate([s.prompt_ids + s.response_ids for s in running], temperature, cfg.top_p,
                                [cfg.max_new_tokens - len(s.response_ids) for s in running], stop_ids + fence_ids, seed)
        for s, turn in zip(running, turns):
            s.response_ids += turn.response_ids
            s.sampled += turn.sampled
            s.engine_logprobs = torch.cat([s.engine_logprobs, turn.engine_logprobs])
        running = [s for s, turn in zip(running, turns) if turn.response_ids and turn.response_ids[-1] in fence_ids]
        # A block runs on any turn but the last, with budget left for its output; other stops simply go on.
        runs = [len(s.tool_outputs) < cfg.max_turns - 1 and len(s.response_ids) < cfg.max_new_tokens for s in running]
        texts = [tokenizer.decode(s.response_ids) if run else "" for s, run in zip(running, runs)]  # "": no run
        for s, (output, reply) in zip(running, workers.run_tools(texts, tokenizer)):  # no reply: generation goes on
            ids = reply[:cfg.max_new_tokens - len(s.response_ids)]
            s.response_ids += ids
            s.sampled += [False] * len(ids)
            s.tool_outputs += [output] if reply else []
        seed += 1  # HFEngine's next round samples afresh
    completions = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    scores, errors = workers.score(completions, [row for row in rows for _ in range(n)])
    for s, score in zip(samples, scores):  # truncated: by the last token, as SGLang versions differ at the limit
        s.score, s.truncated = score, not s.response_ids or s.response_ids[-1] not in stop_ids
        s.reward = score + reward.overlong_penalty(len(s.response_ids), cfg.max_new_tokens, cfg.overlong_buffer)
    return samples, errors


def collect_rollouts(engine, reward_workers, dataset, tokenizer, cfg, step, mesh):
    """G samples per prompt with reward, tracebacks, groups dropped (dynamic sampling: equal scores, so more rounds)."""
    dp_rank, dp, tp_group = mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["tp"].get_group()
    kept, dropped, errors = [], [], []
    for sampling_round in range(cfg.dynamic_sampling_rounds + 1):
        rows = step_rows(dataset, step, cfg, dp_rank, dp, sampling_round)
        seed = hash((cfg.seed, step, sampling_round, dp_rank))
        samples, failed = on_first_rank(lambda: generate_rollouts(
            engine, reward_workers, tokenizer, rows, cfg, seed, cfg.group_size, cfg.temperature), tp_group)
        errors += failed
        for group in (samples[i:i + cfg.group_size] for i in range(0, len(samples), cfg.group_size)):
            no_signal = len({s.score for s in group}) == 1  # as DAPO: on reward_fn's score, not the shaping
            (dropped if no_signal and cfg.dynamic_sampling_rounds else kept).append(group)
        if len(kept) >= len(rows):
            break
    filled = dropped[:max(0, len(rows) - len(kept))]
    return [s for group in kept[:len(rows)] + filled for s in group], errors, len(dropped) - len(filled)


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


def logprobs_and_entropy(hidden, weight, targets, temperature, tp_mesh):
    """Per token: log p(target), entropy of softmax(hidden @ weight.T / T); weight sharded over tp by vocabulary."""
    def sum_over_tp(x):  # all-reduce in forward, identity in backward: every tp rank computes the same loss from it
        return DTensor.from_local(x, tp_mesh, [Partial()]).full_tensor()
    logits = (hidden @ weight.T).to_local().float() / temperature  # [C, V / tp] in fp32: bf16 loses ~3 digits
    max_logit = logits.detach().amax(-1)
    dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    exp = torch.exp(logits - max_logit[:, None])
    sum_exp = sum_over_tp(exp.sum(-1))
    slice_start = tp_mesh.get_local_rank() * math.ceil(weight.shape[0] / tp_mesh.size())  # this rank's first id
    in_slice = (targets >= slice_start) & (targets < slice_start + logits.shape[1])
    slice_targets = (targets - slice_start).clamp(0, logits.shape[1] - 1)
    target_logit = sum_over_tp(logits.gather(-1, slice_targets[:, None]).squeeze(-1) * in_slice)
    log_z = max_logit + sum_exp.log()
    return target_logit - log_z, log_z - sum_over_tp((exp * logits).sum(-1)) / sum_exp


def response_logprobs(model, samples, cfg, tp_mesh, pad_id):
    """Log-probs and entropies [N] of the sampled response tokens; lm_head per --logprob_chunk, recomputed."""
    seqs, device = [s.prompt_ids + s.response_ids for s in samples], torch.device(tp_mesh.device_type)
    longest = max(map(len, seqs))
    ids = torch.tensor([q + [pad_id] * (longest - len(q)) for q in seqs], device=device)  # right-padded
    mask = torch.tensor([[1] * len(q) + [0] * (longest - len(q)) for q in seqs], device=device)
    no_logits = torch.zeros(0, dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=no_logits, output_hidden_states=True)
    last = out.hidden_states[-1]  # the final norm's output [B, T, H]; position t predicts token t + 1
    sampled = torch.tensor([m for s in samples for m in s.sampled], device=device)  # tool output: no log-prob taken
    hidden = torch.cat([last[b, len(s.prompt_ids) - 1:len(seqs[b]) - 1] for b, s in enumerate(samples)])[sampled]
    targets = torch.tensor([t for s in samples for t in s.response_ids], device=device)[sampled]
    # lm_head, a root parameter, stays unsharded until backward; as DTensors, backward gathers its grad, sums hidden's.
    weight = DTensor.from_local(model.lm_head.weight, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(0)])
    hidden = DTensor.from_local(hidden, tp_mesh, [Replicate()])
    compute = (functools.partial(checkpoint, logprobs_and_entropy, use_reentrant=False) if torch.is_grad_enabled()
               else logprobs_and_entropy)
    parts = [compute(hidden[start:start + cfg.logprob_chunk], weight, targets[start:start + cfg.logprob_chunk],
                     cfg.temperature or 1.0, tp_mesh) for start in range(0, len(targets), cfg.logprob_chunk)]
    logp, entropy = zip(*parts)
    return torch.cat(logp), torch.cat(entropy)


# KL(policy || reference) per sampled token from log_ratio = log p - log p_ref (Schulman 2020); GRPO uses k3.
KL_ESTIMATORS = {"k1": lambda log_ratio: log_ratio, "k2": lambda log_ratio: log_ratio ** 2 / 2,
                 "k3": lambda log_ratio: torch.expm1(-log_ratio) + log_ratio}


def response_means(x, lengths):
    """The mean of per-token values x [N] over each response's tokens [R]; lengths [R]: tokens per response."""
    index = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
    return x.new_zeros(len(lengths)).index_add(0, index, x) / lengths


def policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp=None, entropy=None, is_weights=None, lengths=None):
    """Per-token PG term (clip or CISPO) x is_weights, + beta KL, - entropy bonus, summed with weights; metric sums."""
    log_ratio = logp - old_logp
    if cfg.ratio_level == "sequence":  # GSPO-token: value s_i = exp(response mean of log ratio), gradient s_i x d log p
        log_ratio = response_means(log_ratio, lengths).repeat_interleave(lengths).detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    if cfg.objective == "cispo":  # MiniMax-M1: the ratio, clipped and detached, weights log p; no token is dropped
        per_token = -ratio.detach().clamp(max=1 + cfg.clip_high) * advantages * logp
        clip_mask = ratio.detach() > 1 + cfg.clip_high
    else:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        clip_mask = clipped < unclipped
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {"clip_frac": clip_mask.sum(), "kl": logp.new_zeros(()), "entropy": logp.new_zeros(())}
    if ref_logp is not None:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp - ref_logp)
        metrics["kl"] = kl.detach().sum()
        if not cfg.kl_in_reward:
            per_token = per_token + cfg.beta * kl
    if entropy is not None:  # in the graph even at coef 0: backward then frees each chunk's recomputed logits
        metrics["entropy"] = entropy.detach().sum()
        per_token = per_token - cfg.entropy_coef * entropy
    return (per_token * weights).sum(), metrics


def engine_mismatch(trainer_logp, engine_logp, cfg, lengths):
    """IS weights, r = p_trainer / p_engine (None at --tis_cap 0); sums of |log r|, k3 KL (bad pushes show), masks."""
    log_ratio = trainer_logp - engine_logp
    sums = {"mismatch_abs": log_ratio.abs().sum(), "mismatch_kl": KL_ESTIMATORS["k3"](-log_ratio).sum(),
            "is_masked_tokens": 0, "is_masked_responses": 0}
    if cfg.tis_cap == 0:
        return None, sums
    if cfg.is_level == "sequence":
        log_ratio = response_means(log_ratio, lengths).repeat_interleave(lengths)
    ratio = log_ratio.exp()
    if cfg.is_mode == "truncate":
        return ratio.clamp(max=cfg.tis_cap), sums
    masked = (ratio < 1 / cfg.tis_cap) | (ratio > cfg.tis_cap)  # IcePop: r where kept, 0 outside the bound
    sums.update(is_masked_tokens=masked.sum(), is_masked_responses=(response_means(masked.float(), lengths) > 0).sum())
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
            s.loss_weight = dp / (tokens if cfg.loss_agg == "token" else cfg.max_new_tokens * sequences)


def clip_grad_norm(model, max_norm):
    """Global grad norm, clipped to max_norm if finite; a norm per mesh (clip_grad_norm_ can't mix dp and (dp, tp))."""
    by_mesh = defaultdict(list)
    for param in model.parameters():
        if param.grad is not None:
            by_mesh[getattr(param.grad, "device_mesh", None)].append(param.grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    total = math.sqrt(sum((n.full_tensor() if isinstance(n, DTensor) else n).item() ** 2 for n in norms))
    if math.isfinite(total) and max_norm > 0 and total > max_norm:
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total


def micro_batches(samples, cfg):
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
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    while len(batches) < count:
        largest = batches.pop(max(range(len(batches)), key=lambda i: len(batches[i])))
        batches += [largest[:len(largest) // 2], largest[len(largest) // 2:]]
    return batches


@torch.no_grad()
def store_logprobs(model, samples, into, cfg, mesh, pad_id):
    """The model's log-probs of each sample's sampled response tokens, without grad, into sample.<into>."""
    for batch in micro_batches(samples, cfg):
        logp = response_logprobs(model, batch, cfg, mesh["tp"], pad_id)[0]
        for sample, values in zip(batch, logp.split([sum(s.sampled) for s in batch])):
            setattr(sample, into, values)


def train_on_rollouts(model, optimizer, samples, cfg, mesh, pad_id):
    """--num_minibatches optimizer steps; ratio vs own detached log-probs (first mini-batch) or old_logprobs."""
    sums = defaultdict(float)  # every rank runs as many micro-batches, so it adds the same keys in the same order
    per_minibatch, device = len(samples) // cfg.num_minibatches, model.device
    for start in range(0, len(samples), per_minibatch):
        minibatch = samples[start:start + per_minibatch]
        set_loss_weights(minibatch, cfg, mesh["dp"].get_group())
        for batch in micro_batches(minibatch, cfg):
            logp, entropy = response_logprobs(model, batch, cfg, mesh["tp"], pad_id)
            old_logp = logp.detach() if start == 0 else torch.cat([s.old_logprobs for s in batch]).to(device)
            lengths = torch.tensor([sum(s.sampled) for s in batch], device=device)
            advantages = torch.tensor([s.advantage for s in batch], device=device).repeat_interleave(lengths)
            weights = torch.tensor([s.loss_weight for s in batch], device=device).repeat_interleave(lengths)
            engine_logp = torch.cat([s.engine_logprobs for s in batch]).to(device)
            is_weights, mismatch = engine_mismatch(old_logp, engine_logp, cfg, lengths)
            ref_logp = torch.cat([s.ref_logprobs for s in batch]).to(device) if cfg.beta > 0 else None
            loss, stats = policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp, entropy, is_weights, lengths)
            loss.backward()
            for key, value in {**stats, **mismatch, "tokens": len(logp)}.items():
                sums[key] += value
        grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
        if math.isfinite(grad_norm):  # a step with a non-finite norm is skipped, and counted
            optimizer.step()
        sums["skipped_steps"] += not math.isfinite(grad_norm)
        optimizer.zero_grad(set_to_none=True)
        sums["grad_norm"] += grad_norm / cfg.num_minibatches
    return sums


def lr_factor(step, cfg):
    """The multiple of --lr at a step: linear warm-up, then constant or cosine down to 0.1 at the last step."""
    if step < cfg.warmup_steps or cfg.lr_schedule == "constant":
        return min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def reduce_over_ranks(sums, maxes, mesh):
    """Sums and maxima over all ranks, same key order on each (gloo); tp ranks hold the same values: sums count once."""
    total = torch.tensor([float(v) for v in sums.values()], dtype=torch.float64)
    dist.all_reduce(total)
    top = torch.tensor([float(v) for v in maxes.values()], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(sums, (total / mesh["tp"].size()).tolist())), dict(zip(maxes, top.tolist()))


def step_metrics(samples, train_sums, errors, dropped, times, stop_requested, lr, mesh):
    """The step's numbers over all ranks, as logged (means, maxima, counts), and whether any rank was asked to stop."""
    lengths, scores = [sum(s.sampled) for s in samples], [s.score for s in samples]  # tool output is not counted
    sums = dict(train_sums, reward=sum(scores), accuracy=sum(x >= 1 for x in scores), samples=len(samples),
                response_len=sum(lengths), truncated=sum(s.truncated for s in samples), reward_errors=len(errors),
                groups_dropped=dropped, turns=sum(len(s.tool_outputs) + sum(s.sampled[-1:]) for s in samples),
                **reward.tool_counts([s.tool_outputs for s in samples]))  # turns: a turn ends in each tool output
    maxes = {"response_len_max": max(lengths), "grad_norm": sums.pop("grad_norm"),
             "skipped_steps": sums.pop("skipped_steps"), "stop": float(stop_requested)}
    sums, maxes = reduce_over_ranks(sums, maxes, mesh)
    stopping = maxes.pop("stop") > 0  # a signal seen by any rank stops all of them after this step
    per_sample_keys = "reward accuracy response_len truncated is_masked_responses tool_calls tool_use turns".split()
    metrics = {k: sums[k] / sums["samples"] for k in per_sample_keys}
    per_token_keys = ("entropy", "kl", "clip_frac", "mismatch_abs", "mismatch_kl", "is_masked_tokens")
    metrics.update({k: sums[k] / max(sums["tokens"], 1) for k in per_token_keys}, **maxes)
    counts = {k: sums[k] for k in ("reward_errors", "groups_dropped", "tool_errors", "tool_timeouts")}
    metrics.update(times, **counts, lr=lr, tokens_per_s=sums["response_len"] / times["time_step"])  # times: rank 0's
    return metrics, stopping


def write_config(cfg):
    """On rank 0, at once: the config on the console and in out_dir/config.json."""
    print(textwrap.fill(" ".join(f"{k}={v}" for k, v in asdict(cfg).items()), 120), flush=True)
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        pathlib.Path(cfg.out_dir, "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    except OSError as error:  # the other ranks stop with it: torchrun ends every rank when one fails
        raise SystemExit(f"--out_dir {cfg.out_dir}: cannot write there ({error.strerror}): choose another folder")


def open_run_dir(cfg, start_step, wandb_id):
    """On rank 0: metrics.jsonl cut back to the resumed step, and the wandb run (None without --wandb_project)."""
    metrics = pathlib.Path(cfg.out_dir, "metrics.jsonl")
    lines = metrics.read_text().splitlines(keepends=True) if metrics.exists() else []  # a torn line has no newline
    metrics.write_text("".join(ln for ln in lines if ln.endswith("\n") and json.loads(ln)["step"] <= start_step))
    if not cfg.wandb_project:
        return None
    import wandb
    return wandb.init(project=cfg.wandb_project, config=asdict(cfg), id=wandb_id, resume="allow", dir=cfg.out_dir)


def log_step(step, metrics, cfg, wandb_run, sample, tokenizer):
    """One line on the console (every number is in metrics.jsonl), one JSON line in metrics.jsonl, and wandb; every
    --sample_every steps, a sampled prompt and completion with its reward, on the console and in a wandb table."""
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
        row = dict(step=step + 1, prompt=tokenizer.decode(sample.prompt_ids),
                   completion=tokenizer.decode(sample.response_ids), reward=sample.reward)
        print(f"  sample (reward {sample.reward:.3f}):\n{row['prompt']}{row['completion']}", flush=True)
        if wandb_run is not None:
            import wandb
            metrics = dict(metrics, sample=wandb.Table(columns=list(row), data=[list(row.values())]))
    if wandb_run is not None:
        wandb_run.log(metrics, step=step + 1)


def evaluate(engine, tokenizer, test_set, reward_workers, cfg, mesh):
    """Greedy accuracy, mean@k and pass@k (of k samples at --eval_temperature) on --eval_prompts held-out prompts."""
    dp_rank, dp, tp_group = mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["tp"].get_group()
    rows = [test_set[i] for i in range(dp_rank, min(cfg.eval_prompts, len(test_set)), dp)]
    def solved(n, temp):  # [len(rows), n]: reward 1.0; a rank without rows (more ranks than prompts) has [0, n]
        samples, _ = on_first_rank(
            lambda: generate_rollouts(engine, reward_workers, tokenizer, rows, cfg, cfg.seed, n, temp), tp_group)
        return torch.tensor([s.score for s in samples]).view(-1, n) >= 1
    sampled = solved(cfg.eval_k, cfg.eval_temperature)
    sums = {"greedy": solved(1, 0.0).sum().item(), "mean_at_k": sampled.float().mean(1).sum().item(),
            "pass_at_k": sampled.any(1).sum().item(), "prompts": len(rows)}
    sums, _ = reduce_over_ranks(sums, {}, mesh)
    n = max(sums.pop("prompts"), 1)
    return {"eval_greedy_acc": sums["greedy"] / n, f"eval_mean@{cfg.eval_k}": sums["mean_at_k"] / n,
            f"eval_pass@{cfg.eval_k}": sums["pass_at_k"] / n, "eval_prompts": n}


def save_checkpoint(cfg, step, model, optimizer, tokenizer, wandb_id):
    """checkpoints/step_N: hf/, dcp/, trainer_state.json (data and sampling are seeded by step); .tmp, then renamed."""
    rank, final = dist.get_rank(), os.path.join(cfg.out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=f"{tmp}/dcp")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # config and safetensors files of 5 GB at most, which load_weights streams one at a time
            model.save_pretrained(os.path.join(tmp, "hf"), state_dict=full, max_shard_size="5GB")
            tokenizer.save_pretrained(os.path.join(tmp, "hf"))
            for file in glob.glob(os.path.join(tmp, "hf", "*")):
                os.chmod(file, 0o644)  # transformers writes the weights 0600; readable like the rest
            state = {"step": step, "wandb_id": wandb_id}  # the learning rate is a function of the step
            pathlib.Path(tmp, "trainer_state.json").write_text(json.dumps(state))
            os.replace(tmp, final)
            for old in complete_checkpoints(cfg.out_dir)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old)
    except BaseException as error:  # a full disk (dcp raises a BaseException): no half-written folder is left
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"saving {final} failed ({str(error).strip().splitlines()[-1][:300]}); removed {tmp}: free "
                         "space under --out_dir, then --resume auto continues from the last checkpoint")
    dist.barrier()
    return final


def complete_checkpoints(out_dir):
    """Complete checkpoints under out_dir, oldest first (step_N.tmp is an interrupted save)."""
    return sorted(glob.glob(os.path.join(out_dir, "checkpoints", "step_" + "[0-9]" * 6)))


def resume_folder(cfg, model_config):
    """The --resume folder ("auto": newest under out_dir; "": fresh), checked to be complete and shaped as --model."""
    found = complete_checkpoints(cfg.out_dir)
    path = (found[-1] if found else "") if cfg.resume == "auto" else cfg.resume
    if path and not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise SystemExit(f"--resume {path}: not a complete checkpoint folder (no trainer_state.json)")
    if found and not path:
        raise SystemExit(f"--out_dir {cfg.out_dir} holds checkpoints: --resume auto continues them, or use another")
    saved = AutoConfig.from_pretrained(os.path.join(path, "hf")) if path else model_config
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if getattr(saved, key, None) != getattr(model_config, key, None):
            raise SystemExit(f"--resume {path}: a checkpoint of another model ({key} {getattr(saved, key, None)}, "
                             f"--model's {getattr(model_config, key, None)}): pass the --model it was trained from")
    return path


def resume(path, model, optimizer):
    """Restore what save_checkpoint wrote in `path` ("": a fresh start); returns (step, wandb id)."""
    if not path:
        return 0, None
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = json.loads(pathlib.Path(path, "trainer_state.json").read_text())
    return trainer_state["step"], trainer_state["wandb_id"]


def stop_on_signal(rank):
    """SIGTERM or Ctrl-C: finish the step, save, exit; a second Ctrl-C exits at once (README: stopping a run)."""
    requested = threading.Event()
    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt
        if rank == 0 and not requested.is_set():
            print(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)
        requested.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return requested


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
            wandb_run.finish()
            wandb.teardown()  # and its service process
    finally:
        if isinstance(engine, SGLangEngine):
            engine.engine.shutdown()  # and its scheduler processes


def main():
    cfg = parse_config()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # gloo for objects and barriers: no NCCL kernel spins while an engine generates; the timeout covers its start.
    store = None if "MASTER_ADDR" in os.environ else dist.HashStore()  # `python train.py`: one process, no torchrun
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world, store=store,
                            timeout=datetime.timedelta(hours=1), device_id=device if cuda else None)
    # Harmless notices of every run: no output of the model is changed in place; TP redistributes a few small tensors.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    check_config(cfg, world)  # from here: everything that can be checked before a model is built
    on_first_rank(lambda: write_config(cfg))
    tokenizer, model_config = load_tokenizer_and_config(cfg)
    train_set = PromptDataset(cfg, "train")
    test_set = PromptDataset(cfg, "test") if cfg.eval_every > 0 else None  # no evaluation needs no test split
    reward.check_prompt_lengths([*train_set, *(test_set or [])], tokenizer, cfg.max_new_tokens,
                                model_config.max_position_embeddings, cfg.plain_template)
    files = on_first_rank(lambda: weight_files(cfg) if cfg.model != "tiny" else [None])  # before any model is built
    resumed_from = resume_folder(cfg, model_config)
    with announce(f"loading {cfg.model} and the engine{', resuming ' + resumed_from if resumed_from else ''}", rank):
        mesh = init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
        model = build_model(model_config, mesh, device, cfg.activation_checkpointing)
        ref_model = (build_model(model_config, mesh, device, offload=cfg.ref_on_cpu).requires_grad_(False)
                     if cfg.beta > 0 else None)  # frozen: its log-probs are only read
        load_weights([model, ref_model] if ref_model else [model], files, cfg, model_config)
        check_pushed_names(model, model_config)
        # Before any forward: FSDP2 then leaves root parameters unsharded, and an optimizer would hold stale tensors.
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        start_step, wandb_id = resume(resumed_from, model, optimizer)
        wandb_run = open_run_dir(cfg, start_step, wandb_id) if rank == 0 else None
        # Forked before the engine and the signal handlers exist. Rank 0 shows the first failed call's traceback.
        reward_workers = reward.RewardWorkers(cfg.reward_workers, cfg.reward_timeout, show_first_error=rank == 0)
        tp_group, pad_id = mesh["tp"].get_group(), tokenizer.pad_token_id or 0  # any id: padding is masked
        free_gpu_cache(tp_group)  # SGLang sizes itself from the free memory it sees at start
        engine = None
        if mesh["tp"].get_local_rank() == 0:  # one engine per TP group, owned by the group's first rank
            engine = HFEngine(model_config, device, pad_id) if cfg.engine == "hf" else SGLangEngine(cfg, model_config)
    stop = stop_on_signal(rank)
    try:
        push_weights(model, engine, cfg, tp_group)
        run_start = time.perf_counter()
        for step in range(start_step, cfg.steps):
            start = time.perf_counter()  # generate, reward G samples per prompt (dynamic sampling: maybe more rounds)
            samples, errors, dropped = collect_rollouts(engine, reward_workers, train_set, tokenizer, cfg, step, mesh)
            if isinstance(engine, SGLangEngine):
                engine.release_memory()
            rollout_done = time.perf_counter()
            first_stored = 0 if cfg.kl_in_reward else len(samples) // cfg.num_minibatches  # the first's: at its step
            store_logprobs(model, samples[first_stored:], "old_logprobs", cfg, mesh, pad_id)
            if ref_model is not None:
                store_logprobs(ref_model, samples, "ref_logprobs", cfg, mesh, pad_id)
                ref_model.reshard()  # FSDP keeps root parameters whole after a forward that has no backward
            set_advantages(samples, cfg)  # within each group of G
            for group in optimizer.param_groups:  # a function of the step, so a resumed run has nothing to restore
                group["lr"] = cfg.lr * lr_factor(step, cfg)
            train_sums = train_on_rollouts(model, optimizer, samples, cfg, mesh, pad_id)  # loss and update
            train_done = time.perf_counter()
            push_weights(model, engine, cfg, tp_group)  # the new weights into the engine
            end = time.perf_counter()
            times = dict(time_rollout=rollout_done - start, time_train=train_done - rollout_done,
                         time_push=end - train_done, time_step=end - start,
                         eta_s=(end - run_start) / (step + 1 - start_step) * (cfg.steps - step - 1))
            metrics, stopping = step_metrics(samples, train_sums, errors, dropped, times, stop.is_set(),
                                             optimizer.param_groups[0]["lr"], mesh)
            last = step + 1 == cfg.steps
            if cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last):  # evaluate, then log
                with announce(f"evaluating on {min(cfg.eval_prompts, len(test_set))} held-out prompts", rank):
                    metrics.update(evaluate(engine, tokenizer, test_set, reward_workers, cfg, mesh))
            if rank == 0:
                log_step(step, metrics, cfg, wandb_run, samples[0], tokenizer)
            if stopping or last or (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0):  # on a signal: save, stop
                with announce(f"saving the checkpoint of step {step + 1}", rank):
                    path = save_checkpoint(cfg, step + 1, model, optimizer, tokenizer,
                                           wandb_run.id if wandb_run else wandb_id)
            if stopping:
                if rank == 0:
                    print(f"stopped after step {step + 1}: checkpoint {path}; continue with --resume auto", flush=True)
                break
    finally:  # no orphaned engine or reward processes, whatever ended the run
        shut_down(engine, reward_workers, wandb_run)
    dist.barrier()  # gloo aborts a rank whose peer tears down first
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except SystemExit as error:  # every rank stops alike: rank 0 says why, once
        raise SystemExit(error.code if int(os.environ.get("RANK", 0)) == 0 or not error.code else 1)
