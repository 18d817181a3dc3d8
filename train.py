"""GRPO for Qwen models (Qwen2, Qwen2.5, Qwen3) in one file.

One step: sample G completions per prompt from the rollout engine, score them with reward.reward_fn, normalise
rewards within each group into advantages, take clipped policy-gradient steps on the policy (FSDP2 over "dp",
DTensor tensor parallelism over "tp"), and push the new weights into the engine.

Launch:
    torchrun --standalone --nproc_per_node=2 train.py --preset cpu   # CPU demo: tiny random model, toy task
    torchrun --nproc_per_node=8 train.py --tp 2                       # GPU: Countdown, Qwen2.5-3B-Instruct

Edit two places: `PromptDataset.__getitem__` below (what a prompt is and what the reward needs) and
`reward_fn` in reward.py (how a completion is scored). Every flag is a field of `Config`.

Departures from the GRPO paper (DeepSeekMath): the loss is a token-level mean over all response tokens of the
batch (DAPO) unless --loss_agg sequence; the clip range may be asymmetric (clip-higher, DAPO); the KL term (k3) is
off by default (--beta 0); logprobs are those of logits / temperature, the distribution the engine samples from.
"""
import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import string
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass
from fractions import Fraction

import tokenizers
import torch
from safetensors.torch import save_file
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser,
                          PreTrainedTokenizerFast, Qwen2Config)

import reward


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    # model and task
    model: str = "Qwen/Qwen2.5-3B-Instruct"  # hub id or local folder; "tiny": random tiny Qwen2 + character tokenizer
    task: str = "countdown"  # countdown | gsm8k | toy
    data_path: str = "openai/gsm8k"  # gsm8k: hub id, or a local folder of train.* and test.* (jsonl / parquet)
    train_size: int = 20000  # countdown / toy: problems generated for training
    test_size: int = 500  # countdown / toy: held-out problems, disjoint from training
    preset: str = ""  # "cpu": tiny model, toy task, small batches; flags given explicitly still win
    # rollout
    engine: str = "sglang" if torch.cuda.is_available() else "hf"  # hf: HF generate on an unsharded copy (CPU)
    mem_fraction: float = 0.5  # sglang: fraction of the GPU's free memory at start for its weights and KV cache
    engine_port: int = 30000  # sglang: each TP group's engine uses engine_port + its first rank's local rank
    keep_engine_memory: bool = False  # sglang: keep weights and KV cache resident while training (debugging)
    bucket_mb: int = 512  # weight push: MB of full bf16 tensors gathered and sent at a time
    prompts_per_step: int = 32  # prompts per optimizer step, over all ranks
    group_size: int = 8  # G: samples per prompt
    max_new_tokens: int = 1024  # response length limit
    temperature: float = 1.0
    top_p: float = 1.0
    # loss
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # and above at 1 + clip_high (clip-higher, DAPO)
    loss_agg: str = "token"  # token: mean over all response tokens of the batch | sequence: per-sequence mean first
    scale_std: bool = True  # divide advantages by the group's std (False: Dr. GRPO)
    beta: float = 0.0  # weight of the k3 KL to the initial policy; 0 builds no reference model
    entropy_coef: float = 0.0  # entropy bonus
    tis_cap: float = 0.0  # > 0: truncated importance sampling, tokens weighted by min(p_old / p_engine, tis_cap)
    logprob_chunk: int = 1024  # response tokens per chunk of fp32 full-vocabulary logits
    # optimisation
    steps: int = 200
    lr: float = 1e-6
    lr_schedule: str = "constant"  # constant | cosine (to 10% of lr at the last step)
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_minibatches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 8  # sequences per forward / backward on each rank
    # parallelism and memory
    tp: int = 1  # tensor-parallel size; dp = world size / tp
    activation_checkpointing: bool = False
    # evaluation, checkpoints, rewards
    eval_every: int = 50  # evaluate on the held-out split every N steps and at the end; 0: never
    eval_prompts: int = 256  # held-out prompts per evaluation
    eval_k: int = 4  # samples per prompt for mean@k and pass@k
    eval_temperature: float = 1.0
    save_every: int = 50  # checkpoint every N steps; always at the end and when stopped by a signal
    keep_checkpoints: int = 2  # the newest K complete checkpoints are kept
    resume: str = ""  # a checkpoint folder, or "auto": the newest complete one under out_dir (if any)
    reward_workers: int = 4  # processes computing rewards in parallel
    reward_timeout: float = 5.0  # seconds before a reward_fn call is cut off; it scores 0
    # logging
    seed: int = 0
    out_dir: str = "runs/grpo"  # config.json, metrics.jsonl, checkpoints/ (layout in README)
    wandb_project: str = ""  # log to wandb too when set (WANDB_MODE=offline needs no network)


PRESETS = {
    "cpu": dict(model="tiny", task="toy", engine="hf", steps=30, prompts_per_step=8, group_size=8, max_new_tokens=16,
                temperature=1.0, lr=1e-2, warmup_steps=0, micro_batch_size=32, train_size=1000, test_size=100,
                out_dir="runs/cpu", eval_every=10, eval_prompts=16, save_every=0, reward_workers=2),
}


def parse_config(argv=None):
    parser = HfArgumentParser(Config, allow_abbrev=False)
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        if preset not in PRESETS:
            raise SystemExit(f"--preset {preset!r} is unknown: choose one of {sorted(PRESETS)}")
        parser.set_defaults(**PRESETS[preset])
    cfg, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"unknown flags {unknown}: every flag is a field of Config in train.py")
    return cfg


def check_config(cfg, world):
    """Catch bad flags before any model is loaded; each message names the flag to change."""
    choices = dict(task=("countdown", "gsm8k", "toy"), engine=("sglang", "hf"), loss_agg=("token", "sequence"),
                   lr_schedule=("constant", "cosine"))
    positive = ("tp", "prompts_per_step", "num_minibatches", "micro_batch_size", "max_new_tokens", "logprob_chunk",
                "reward_workers", "eval_k")
    problems = [(getattr(cfg, f) < 1, f"--{f} must be at least 1, not {getattr(cfg, f)}") for f in positive]
    problems += [(getattr(cfg, f) not in allowed, f"--{f} {getattr(cfg, f)!r}: choose one of {allowed}")
                 for f, allowed in choices.items()]
    dp = world // max(cfg.tp, 1)
    samples = cfg.prompts_per_step // max(dp, 1) * cfg.group_size
    sglang = cfg.engine == "sglang"
    problems += [
        (world % max(cfg.tp, 1), f"--tp {cfg.tp} does not divide the world size {world}: use a divisor of {world}"),
        (cfg.prompts_per_step % max(dp, 1), f"--prompts_per_step {cfg.prompts_per_step} must divide by dp = {dp}"),
        (samples % max(cfg.num_minibatches, 1),
         f"--num_minibatches {cfg.num_minibatches} must divide the {samples} samples per rank (prompts / dp * G)"),
        (cfg.group_size < 2, "--group_size must be at least 2: advantages compare samples of one prompt"),
        (sglang and importlib.util.find_spec("sglang") is None,
         "--engine sglang needs SGLang: pip install -r requirements.txt (sglang==0.5.23), or use --engine hf"),
        (sglang and not torch.cuda.is_available(), "--engine sglang needs a CUDA GPU: use --engine hf here"),
        (sglang and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) % cfg.tp,
         f"--tp {cfg.tp} must divide the GPUs per node: an engine's TP group lives on one node"),
    ]
    for bad, message in problems:
        if bad:
            raise SystemExit(message)


# ----------------------------------------------------------------------------- data
COUNTDOWN_PROMPT = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
                    "operations (+, -, *, /) and each number must be used exactly once. Show your work in "
                    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
                    "<answer> (1 + 2) / 3 </answer>.")
GSM8K_PROMPT = "{question}\nThink step by step, then give the final answer as \\boxed{{number}}."
# The R1-Zero template, for tokenizers without a chat template (base models).
PLAIN_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                  "The assistant first thinks about the reasoning process in the mind and then provides the user "
                  "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
                  "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
                  "<answer> answer here </answer>. User: {question} Assistant: <think>")


def countdown_problems(n, seed):
    """n distinct Countdown problems: 3-4 numbers in 1..99 and a target reachable by construction."""
    rng = random.Random(seed)
    problems = {}
    while len(problems) < n:
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        order = rng.sample(nums, len(nums))
        value = Fraction(order[0])
        for x in order[1:]:
            value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[rng.choice("+-*/")]
        if value.denominator == 1 and 0 < value <= 1000:
            problems[(tuple(sorted(nums)), int(value))] = nums
    return [{"nums": nums, "target": target} for (_, target), nums in problems.items()]


def load_rows(cfg, split):
    """The raw rows of one split. Countdown and toy rows are generated, so the default job needs no download."""
    if cfg.task == "countdown":
        # One stream of distinct problems: the first test_size are the test split, so the splits are disjoint.
        problems = countdown_problems(cfg.test_size + cfg.train_size, cfg.seed)
        return problems[:cfg.test_size] if split == "test" else problems[cfg.test_size:]
    if cfg.task == "toy":
        return [{"target": "a"}] * (cfg.test_size if split == "test" else cfg.train_size)
    import datasets
    local = os.path.isdir(cfg.data_path)  # datasets reads the splits from the file names
    return list(datasets.load_dataset(cfg.data_path, None if local else "main", split=split))


class PromptDataset(torch.utils.data.Dataset):
    """Prompts of one task. Edit __getitem__ to change what a prompt says or to add a task."""

    def __init__(self, cfg, split):
        self.task, self.rows = cfg.task, load_rows(cfg, split)
        if len(self.rows) < (cfg.prompts_per_step if split == "train" else 1):
            raise SystemExit(f"the {split} split has {len(self.rows)} rows, fewer than a step's "
                             f"--prompts_per_step {cfg.prompts_per_step}: check --task, --data_path, --train_size")
        try:  # catch items that lack what the prompt or the reward reads, before any model is loaded
            item = self[0]
            _ = item["prompt"]
            reward.reward_fn("", item)
        except KeyError as missing:
            raise SystemExit(f"{split} items lack the field {missing} that the prompt or reward_fn reads: "
                             "return it from PromptDataset.__getitem__ in train.py")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        """{"prompt": chat messages, or a string used as is; "task"; and the fields reward.reward_fn reads}."""
        row = self.rows[i]
        if self.task == "countdown":
            content = COUNTDOWN_PROMPT.format(nums=row["nums"], target=row["target"])
            return {"prompt": [{"role": "user", "content": content}], "task": "countdown",
                    "nums": row["nums"], "target": row["target"]}
        if self.task == "gsm8k":
            content = GSM8K_PROMPT.format(question=row["question"])
            return {"prompt": [{"role": "user", "content": content}], "task": "gsm8k",
                    "answer": row["answer"].split("####")[-1].strip()}
        return {"prompt": f"Say {row['target']}:", "task": "toy", "target": row["target"]}


def char_tokenizer():
    """A character-level tokenizer with Qwen's special tokens, for the tiny CPU model: nothing to download."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(string.printable)))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])


def load_tokenizer(cfg):
    return char_tokenizer() if cfg.model == "tiny" else AutoTokenizer.from_pretrained(cfg.model)


def encode_prompt(tokenizer, prompt):
    """Token ids of a prompt: the chat template when the tokenizer has one, else the R1-Zero plain template."""
    if isinstance(prompt, str):
        text = prompt
    elif tokenizer.chat_template:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = PLAIN_TEMPLATE.format(question=prompt[-1]["content"])
    return tokenizer(text, add_special_tokens=False).input_ids


def stop_token_ids(tokenizer):
    """EOS of the tokenizer plus Qwen's end-of-turn and end-of-text tokens, where the vocabulary has them."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    return sorted(i for i in ids if i is not None)


def step_rows(dataset, step, cfg, dp_rank, dp):
    """This rank's prompts for a step: a fresh seeded permutation every epoch, so the order follows from the step."""
    epoch, i = divmod(step, len(dataset) // cfg.prompts_per_step)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = torch.randperm(len(dataset), generator=generator).tolist()
    per_rank = cfg.prompts_per_step // dp
    start = i * cfg.prompts_per_step + dp_rank * per_rank
    return [dataset[j] for j in order[start:start + per_rank]]


# ----------------------------------------------------------------------------- model and mesh
def init_distributed(cfg):
    """Rank, device and the ("dp", "tp") mesh, once the flags are checked."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # gloo carries object collectives and barriers, so no NCCL kernel spins on a GPU while its engine generates;
    # the long timeout covers the engine's start, which the first weight push waits for.
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=1))
    check_config(cfg, world)
    return rank, device, init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))


def tiny_model_config(vocab_size):
    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True)


# Per decoder layer: q/k/v and gate/up split their output features over tp, o and down their input features,
# so each attention block and each MLP needs one all-reduce in forward and one in backward.
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def parallelize(model, mesh, activation_checkpointing):
    """TP inside each decoder layer, then activation checkpointing, then FSDP per layer and at the root."""
    if mesh["tp"].size() > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], TP_PLAN)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; plain fp32 on CPU.
    on_gpu = mesh.device_type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def full_state_dict(cfg, model_config):
    """Full fp32 weights, read on rank 0 only: the other ranks receive their shards from it."""
    if cfg.model == "tiny":
        torch.manual_seed(cfg.seed)
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).state_dict()
    return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).state_dict()


def build_model(model_config, mesh, device, state_dict, activation_checkpointing=False):
    """Build on the meta device, shard, then load: no rank ever holds a full copy it does not need."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    parallelize(model, mesh, activation_checkpointing)
    model.to_empty(device=device)
    with torch.device(device):  # rotary frequencies are a non-persistent buffer: rebuild it off the meta device
        model.model.rotary_emb = type(model.model.rotary_emb)(model_config)
    # A shallow copy: set_model_state_dict replaces the entries of the dict it is given with their shards.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(state_dict), options=options)
    return model


# ----------------------------------------------------------------------------- engine
class HFEngine:
    """Rollouts with HF generate on an unsharded copy of the policy, refreshed after every step. The interface
    SGLangEngine shares: generate() returns per sample "ids" (sampled ids, stop token included) and the engine's
    "logprobs" (log_softmax(logits / T) of each sampled token); update_weights() takes buckets of (HF name, full
    tensor in engine.dtype); shutdown()."""
    dtype = torch.float32

    def __init__(self, model_config, device, pad_id):
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(model_config, dtype=self.dtype).eval()
        self.model.generation_config = GenerationConfig()  # no sampling defaults (top_k=50) sneak in
        self.pad_id = pad_id

    @torch.no_grad()
    def update_weights(self, buckets):
        for name, tensor in (named for bucket in buckets for named in bucket):
            self.model.get_parameter(name).copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts, temperature, top_p, max_new_tokens, stop_ids, seed):
        device = self.model.device
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.random.fork_rng(devices=[]):  # seeded sampling that leaves the global RNG alone
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=temperature > 0, temperature=temperature or None,
                top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True)
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / (temperature or 1.0), -1)  # [N, T, V]
        samples = []
        for seq, lp in zip(out.sequences[:, width:].tolist(), logprobs):
            end = next((t + 1 for t, tok in enumerate(seq) if tok in stop_ids), len(seq))  # generate pads after
            samples.append({"ids": seq[:end], "logprobs": lp[torch.arange(end), seq[:end]].tolist()})
        return samples

    def shutdown(self):
        del self.model


class SGLangEngine:
    """Rollouts from an in-process SGLang engine: one per TP group of the trainer, on the same GPUs, created by
    the group's first rank. Weights arrive as flattened bf16 buckets through CUDA IPC, never through disk."""
    dtype = torch.bfloat16

    def __init__(self, cfg, model_config, tp, base_gpu_id, rank=0):
        import sglang
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID, as the engine's side expects
        # Under torchrun the engine's schedulers would join torchrun's store as clients and hang at start.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        if not model_config.architectures:  # a config built in code (--model tiny) names no class; SGLang needs one
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            model_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_config.model_type]]
        config_dir = os.path.join(cfg.out_dir, f"engine_model_rank{rank}")  # read from disk by SGLang
        model_config.save_pretrained(config_dir)
        # The engine's processes inherit ignored SIGINT / SIGTERM: the job's signals (torchrun signals process
        # groups) are for the trainer, which finishes its step and then shuts the engine down.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.engine = sglang.Engine(
            model_path=config_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", tp_size=tp,
            dp_size=1, base_gpu_id=base_gpu_id, nccl_port=cfg.engine_port + base_gpu_id,
            random_seed=cfg.seed * 1000 + rank,
            enable_memory_saver=True, mem_fraction_static=cfg.mem_fraction, log_level="error")
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # The first request starts SGLang's event loop, which installs its own SIGTERM handler: the trainer's wins.
        self.engine.generate(input_ids=[[0]], sampling_params={"max_new_tokens": 1})
        self.tp, self.released = tp, False

    def generate(self, prompts, temperature, top_p, max_new_tokens, stop_ids, seed):
        # SGLang samples from its schedulers' RNG, seeded once with --seed; `seed` only steers the hf engine.
        params = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [{"ids": o["output_ids"], "logprobs": [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]}
                for o in outputs]

    def release_memory(self):
        """Free the engine's weights and KV cache for the training phase."""
        self.engine.release_memory_occupation(tags=["kv_cache", "weights"])
        self.released = True

    def update_weights(self, buckets):
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        if self.released:  # resuming what was not released crashes the engine
            self.engine.resume_memory_occupation(tags=["weights"])  # freed, not kept: every weight is pushed
        session = hasattr(self.engine, "begin_weight_update")  # sglang >= 0.5.21 pushes inside a session
        if session:
            check(self.engine.begin_weight_update())
        try:
            for bucket in buckets:
                flat = FlattenedTensorBucket(named_tensors=bucket)
                payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
                # One serialization per engine TP rank: each rank opens (and releases) its own IPC handles.
                per_rank = [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(self.tp)]
                check(self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket",
                                                             flush_cache=False))
        finally:  # an open session would refuse the next push
            if session:
                check(self.engine.end_weight_update())
        self.engine.flush_cache()  # cached prefixes were computed with the old weights
        if self.released:
            self.engine.resume_memory_occupation(tags=["kv_cache"])
            self.released = False
        torch.cuda.ipc_collect()

    def shutdown(self):
        self.engine.shutdown()


def check(result):
    """SGLang reports a failed weight update as (False, message) rather than raising."""
    ok, message = result
    if not ok:
        raise RuntimeError(f"SGLang weight update failed: {message}")


def create_engine(cfg, model_config, mesh, device, pad_id):
    """The engine of this rank's TP group, owned by the group's first rank; None on the other ranks."""
    if mesh["tp"].get_local_rank() != 0:
        return None
    if cfg.engine == "hf":
        return HFEngine(model_config, device, pad_id)
    return SGLangEngine(cfg, model_config, cfg.tp, int(os.environ.get("LOCAL_RANK", 0)), dist.get_rank())


def free_gpu_cache(group):
    """Give the caching allocator's memory back and wait for the group: SGLang, on the same GPUs, re-takes its own."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        dist.barrier(group=group)


def weight_buckets(model, bucket_bytes, dtype, tp_group):
    """Full tensors with HF names, in buckets of about bucket_bytes: one parameter is gathered at a time, so extra
    memory stays near one bucket plus one full fp32 tensor. Every rank runs this to the end (each full_tensor() is
    a collective, and the group frees its cache at the end, before the engine's KV cache comes back)."""
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
    free_gpu_cache(tp_group)


def push_weights(model, engine, bucket_mb, tp_group):
    """The new weights into the engine; ranks without an engine still join every gather."""
    free_gpu_cache(tp_group)  # before the engine's weights come back
    buckets = weight_buckets(model, bucket_mb << 20, engine.dtype if engine else torch.float32, tp_group)
    if engine is None:
        for _ in buckets:
            pass
    else:
        engine.update_weights(buckets)


def on_first_tp_rank(tp_group, work):
    """work() on the tp group's first rank, its result sent to the other ranks, so the whole group acts on one
    answer: one engine generates, and one reward pass decides (a timeout seen on one tp rank only would make the
    group's replicated weights drift apart)."""
    result = [work() if dist.get_rank(group=tp_group) == 0 else None]
    if dist.get_world_size(tp_group) > 1:
        dist.broadcast_object_list(result, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return result[0]


def generate_rollouts(engine, tokenizer, rows, cfg, seed, tp_group, n, temperature):
    """n samples per prompt, grouped by prompt, from the engine of this rank's tp group."""
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    repeated = [p for p in prompts for _ in range(n)]
    stop_ids = stop_token_ids(tokenizer)
    samples = on_first_tp_rank(tp_group, lambda: engine.generate(repeated, temperature, cfg.top_p, cfg.max_new_tokens,
                                                                 stop_ids, seed))
    for prompt, sample in zip(repeated, samples):
        # Finish from the last token, the same for every engine (SGLang versions disagree on a stop at the limit).
        sample.update(prompt_ids=prompt, finish="stop" if sample["ids"][-1:] in ([t] for t in stop_ids) else "length")
    return samples


# ----------------------------------------------------------------------------- reward and advantages
def raise_timeout(signum, frame):
    raise TimeoutError("reward_fn ran past --reward_timeout")


def reward_or_error(completion, sample, timeout):
    """In a reward worker: (score, None), or (0.0, traceback) when reward_fn raises or runs past `timeout`."""
    signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout, 1.0)  # repeats if reward_fn swallows the TimeoutError
    try:
        return float(reward.reward_fn(completion, sample)), None
    except Exception:
        return 0.0, traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def score(pool, samples, rows, tokenizer, cfg):
    """Rewards [N] of the decoded completions, each scored in the reward workers with the row of its prompt, and
    the tracebacks of failed calls (they score 0). The batch has a deadline that calls cut off by SIGALRM always
    meet; a call that SIGALRM cannot reach (signals blocked in C code) misses it and scores 0."""
    per_prompt = len(samples) // len(rows)
    deadline = time.monotonic() + cfg.reward_timeout * math.ceil(len(samples) / cfg.reward_workers) + 5
    jobs = [pool.apply_async(reward_or_error, (tokenizer.decode(s["ids"], skip_special_tokens=True),
                                               rows[i // per_prompt], cfg.reward_timeout))
            for i, s in enumerate(samples)]
    results = []
    for job in jobs:
        try:
            results.append(job.get(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as error:  # the deadline passed, or an alarm escaped the worker's own handling
            results.append((0.0, f"reward_fn did not return by the batch's deadline ({error!r})"))
    return torch.tensor([r for r, _ in results]), [error for _, error in results if error]


def group_advantages(rewards, group_size, scale_std=True, eps=1e-6):
    """(r - group mean) / (group std + eps), std unbiased as in GRPO; without the division for Dr. GRPO."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale_std:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


# ----------------------------------------------------------------------------- logprobs and entropy
def logprobs_and_entropy(hidden, weight, targets, temperature):
    """Per token: log p(target) and the entropy of softmax(hidden @ weight.T / temperature)."""
    logits = (hidden @ weight.T).float() / temperature  # [C, V] in fp32: logsumexp in bf16 loses ~3 digits
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


def pad_batch(samples, pad_id, device):
    """Right-padded prompt + response ids, the attention mask, and where the response tokens are."""
    seqs = [s["prompt_ids"] + s["ids"] for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs], device=device)
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], device=device)
    # response[b, t]: token t + 1 of sequence b is a response token, predicted at position t.
    response = torch.tensor([[len(s["prompt_ids"]) - 1 <= t < len(q) - 1 for t in range(width)]
                             for s, q in zip(samples, seqs)], device=device)
    return ids, mask, response


def response_logprobs(model, samples, cfg, pad_id):
    """Log-probs and entropies of the response tokens, flat over the samples [N_tokens]. The final hidden states
    go through lm_head in chunks of cfg.logprob_chunk tokens, each recomputed in backward, so at most one chunk
    of full-vocabulary fp32 logits is alive at a time."""
    ids, mask, response = pad_batch(samples, pad_id, model.device)
    no_logits = torch.zeros(0, dtype=torch.long, device=ids.device)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=no_logits, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1][response[:, :-1]]  # final-norm output at response positions
    targets = ids[:, 1:][response[:, :-1]]
    # lm_head is a root parameter, left unsharded by FSDP after the root forward until backward.
    weight = model.lm_head.weight
    parts = []
    for start in range(0, len(targets), cfg.logprob_chunk):
        chunk = (hidden[start:start + cfg.logprob_chunk], weight, targets[start:start + cfg.logprob_chunk],
                 cfg.temperature or 1.0)
        parts.append(checkpoint(logprobs_and_entropy, *chunk, use_reentrant=False)
                     if torch.is_grad_enabled() else logprobs_and_entropy(*chunk))
    return tuple(torch.cat(x) for x in zip(*parts))  # logp, entropy


# ----------------------------------------------------------------------------- loss
def policy_loss(logp, old_logp, advantages, weights, clip_low, clip_high,
                beta=0.0, ref_logp=None, entropy_coef=0.0, entropy=None, is_weights=None):
    """Clipped surrogate per response token, summed with `weights` (which carry the aggregation); inputs are flat
    over response tokens [N], `is_weights` (truncated importance sampling) scale the policy-gradient term.
    Returns the loss and metric sums over the tokens."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {"clip_frac": (clipped < unclipped).sum().item(), "kl": 0.0}
    if beta > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + beta * kl
        metrics["kl"] = kl.sum().item()
    if entropy_coef > 0:
        per_token = per_token - entropy_coef * entropy
    return (per_token * weights).sum(), metrics


def engine_mismatch(trainer_logp, engine_logp, tis_cap):
    """How far the engine's sampling distribution is from the trainer's on the sampled tokens: a stale or wrong
    weight push shows up here at once. Returns truncated importance weights min(p_trainer / p_engine, tis_cap)
    (None when tis_cap is 0) and sums of |log ratio| and of the k3 estimate of KL(engine || trainer)."""
    log_ratio = trainer_logp - engine_logp
    sums = {"mismatch_abs": log_ratio.abs().sum().item(), "mismatch_kl": (log_ratio.exp() - 1 - log_ratio).sum().item()}
    return (log_ratio.exp().clamp(max=tis_cap) if tis_cap > 0 else None), sums


def token_weights(samples, loss_agg, dp_group, device):
    """Per-token loss weights of one mini-batch, flat [N]. FSDP averages gradients over dp, so the weights are
    scaled by dp and normalised by global counts: micro-batches then sum to exactly the full-batch gradient."""
    lengths = torch.tensor([len(s["ids"]) for s in samples], dtype=torch.float64, device=device)
    counts = torch.tensor([lengths.sum().item(), len(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(counts, group=dp_group)  # response tokens and sequences of the whole mini-batch
    dp = dist.get_world_size(dp_group)
    per_seq = (torch.full_like(lengths, dp / counts[0].item()) if loss_agg == "token"
               else dp / (lengths.clamp(min=1) * counts[1]))
    return per_seq.repeat_interleave(lengths.long()).float()


# ----------------------------------------------------------------------------- update
def clip_grad_norm(model, max_norm):
    """The global grad norm, and gradients scaled to at most max_norm. torch's clip_grad_norm_ cannot mix
    DTensors of the dp mesh (root, norms) and the (dp, tp) mesh (TP weights): take a norm per mesh, combine,
    and scale by a Python float. A non-finite norm is returned without touching the gradients."""
    by_mesh = defaultdict(list)
    for param in model.parameters():
        if param.grad is not None:
            by_mesh[getattr(param.grad, "device_mesh", None)].append(param.grad)
    total_sq = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        total_sq += (norm.full_tensor() if isinstance(norm, DTensor) else norm).item() ** 2
    total = math.sqrt(total_sq)
    if math.isfinite(total) and max_norm > 0 and total > max_norm:
        for grad in (g for grads in by_mesh.values() for g in grads):
            grad.mul_(max_norm / (total + 1e-6))
    return total


def micro_batches(samples, size):
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def store(samples, key, values):
    """Split flat per-token values [N] into the samples they belong to."""
    for s, v in zip(samples, values.split([len(s["ids"]) for s in samples])):
        s[key] = v


def flat(samples, key):
    """Concatenate per-token values (tensors or lists) of samples; a per-sample float covers all its tokens."""
    return torch.cat([torch.full((len(s["ids"]),), s[key]) if isinstance(s[key], float)
                      else torch.as_tensor(s[key], dtype=torch.float32) for s in samples])


def train_on_rollouts(model, optimizer, samples, cfg, mesh, pad_id, ref_model=None):
    """cfg.num_minibatches optimizer steps over one rollout batch; returns metric sums over this rank's tokens.
    The ratio's denominator is the policy that sampled: the first mini-batch trains before any update, so its
    own logprobs serve (detached); later mini-batches get theirs from a no-grad pass before the first update."""
    keys = ("clip_frac", "kl", "entropy", "tokens", "mismatch_abs", "mismatch_kl", "skipped_steps", "grad_norm")
    sums = dict.fromkeys(keys, 0.0)  # the same keys on every rank: they are all-reduced
    per_minibatch = len(samples) // cfg.num_minibatches
    timer = time.perf_counter()
    with torch.no_grad():
        for batch in micro_batches(samples[per_minibatch:], cfg.micro_batch_size):
            store(batch, "old_logp", response_logprobs(model, batch, cfg, pad_id)[0])
        for batch in micro_batches(samples, cfg.micro_batch_size) if ref_model is not None else []:
            store(batch, "ref_logp", response_logprobs(ref_model, batch, cfg, pad_id)[0])
    sums["time_logprobs"] = time.perf_counter() - timer
    dp_group, device = mesh["dp"].get_group(), model.device
    for m in range(cfg.num_minibatches):
        minibatch = samples[m * per_minibatch:(m + 1) * per_minibatch]
        weights = token_weights(minibatch, cfg.loss_agg, dp_group, device)
        offset = 0
        for batch in micro_batches(minibatch, cfg.micro_batch_size):
            logp, entropy = response_logprobs(model, batch, cfg, pad_id)
            old_logp = logp.detach() if m == 0 else flat(batch, "old_logp")
            is_weights, mismatch = engine_mismatch(old_logp, flat(batch, "logprobs").to(device), cfg.tis_cap)
            loss, metrics = policy_loss(
                logp, old_logp, flat(batch, "advantage").to(device), weights[offset:offset + len(logp)],
                cfg.clip_low, cfg.clip_high, cfg.beta, flat(batch, "ref_logp") if cfg.beta > 0 else None,
                cfg.entropy_coef, entropy, is_weights)
            loss.backward()
            offset += len(logp)
            for key, value in {**metrics, **mismatch}.items():
                sums[key] += value
            sums["entropy"] += entropy.detach().sum().item()
            sums["tokens"] += len(logp)
        # Qwen3's q_norm / k_norm weights are replicated over tp, but each rank normalises only its own heads:
        # their gradients are partial sums, to be summed over tp (without this, tp ranks drift apart).
        for name, param in model.named_parameters() if mesh["tp"].size() > 1 else []:
            if name.endswith(("q_norm.weight", "k_norm.weight")) and param.grad is not None:
                dist.all_reduce(param.grad.to_local(), group=mesh["tp"].get_group())
        grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            sums["skipped_steps"] += 1
        optimizer.zero_grad(set_to_none=True)
        sums["grad_norm"] += grad_norm / cfg.num_minibatches
    return sums


def lr_lambda(cfg):
    """Linear warm-up, then constant or cosine down to 10% of --lr at the last step."""
    def factor(step):
        if step < cfg.warmup_steps or cfg.lr_schedule == "constant":
            return min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


# ----------------------------------------------------------------------------- logging
def reduce_over_ranks(sums, maxes, mesh, device):
    """Sums and maxima over all ranks; the tp ranks of one dp group hold the same values, so sums count once."""
    keys = sorted(sums)
    total = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    top = torch.tensor([float(v) for v in maxes.values()], dtype=torch.float64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(keys, (total / mesh["tp"].size()).tolist())), dict(zip(maxes, top.tolist()))


def step_metrics(sums, maxes, lr, seconds):
    """The numbers of one step as logged: means over all samples or all response tokens, maxima, counts."""
    metrics = {k: sums[k] / sums["samples"] for k in ("reward", "accuracy", "response_len", "truncated")}
    per_token = ("entropy", "kl", "clip_frac", "mismatch_abs", "mismatch_kl")
    metrics.update({k: sums[k] / max(sums["tokens"], 1) for k in per_token}, **maxes)
    metrics.update(reward_errors=sums["reward_errors"], lr=lr,
                   tokens_per_s=sums["response_len"] / seconds, time_step=seconds)
    return metrics


def log_step(step, m, cfg, wandb_run):
    """One line on the console, one JSON line in metrics.jsonl, and wandb, from the step's metrics `m`."""
    line = (f"step {step + 1}/{cfg.steps} | reward {m['reward']:.3f} | acc {m['accuracy']:.3f} | "
            f"len {m['response_len']:.1f} | ent {m['entropy']:.3f} | kl {m['kl']:.4f} | clip {m['clip_frac']:.3f} | "
            f"gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | mismatch {m['mismatch_abs']:.2e} | "
            f"{m['time_step']:.2f}s (gen {m['time_generate']:.2f} train {m['time_train']:.2f} "
            f"push {m['time_push']:.2f}) | {m['tokens_per_s']:.0f} tok/s")
    evals = " | ".join(f"{k} {v:.3f}" for k, v in m.items() if k.startswith("eval_") and k != "eval_prompts")
    print(line + (f"\n  eval ({m['eval_prompts']:.0f} prompts): {evals}" if evals else ""), flush=True)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step + 1, **m}) + "\n")
    if wandb_run is not None:
        wandb_run.log(m, step=step + 1)


# ----------------------------------------------------------------------------- eval
def evaluate(engine, tokenizer, test_set, pool, cfg, mesh, device):
    """On the first --eval_prompts held-out prompts: greedy accuracy, and mean@k (the fraction of k samples at
    --eval_temperature that are right) and pass@k (at least one of the k is right). Right = reward 1.0."""
    dp_rank, dp, tp_group = mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["tp"].get_group()
    rows = [test_set[i] for i in range(dp_rank, min(cfg.eval_prompts, len(test_set)), dp)]
    sums = dict.fromkeys(("greedy", "mean_at_k", "pass_at_k", "prompts"), 0.0)
    if rows:
        def right(n, temperature):  # [len(rows), n]: reward 1.0, scored once per tp group
            samples = generate_rollouts(engine, tokenizer, rows, cfg, cfg.seed, tp_group, n, temperature)
            return on_first_tp_rank(tp_group, lambda: score(pool, samples, rows, tokenizer, cfg)[0]).view(-1, n) >= 1
        sampled = right(cfg.eval_k, cfg.eval_temperature)
        sums = {"greedy": right(1, 0.0).sum().item(), "mean_at_k": sampled.float().mean(1).sum().item(),
                "pass_at_k": sampled.any(1).sum().item(), "prompts": len(rows)}
    sums, _ = reduce_over_ranks(sums, {}, mesh, device)
    n = max(sums.pop("prompts"), 1)
    return {"eval_greedy_acc": sums["greedy"] / n, f"eval_mean@{cfg.eval_k}": sums["mean_at_k"] / n,
            f"eval_pass@{cfg.eval_k}": sums["pass_at_k"] / n, "eval_prompts": n}


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(cfg, step, model, optimizer, scheduler, tokenizer, wandb_id):
    """out_dir/checkpoints/step_N: hf/ (from_pretrained and SGLang load it as is), dcp/ (sharded model and
    optimizer), trainer_state.json (step, lr schedule, wandb id); no RNG state, as data order and sampling are
    seeded from (--seed, step). Written as step_N.tmp, then renamed: a crash mid-save leaves the last one usable."""
    rank, root = dist.get_rank(), os.path.join(cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        hf = os.path.join(tmp, "hf")
        model.config.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        tied = model.config.tie_word_embeddings  # HF stores a tied lm_head once, as the embedding
        save_file({k: v.contiguous() for k, v in full.items() if not (tied and k == "lm_head.weight")},
                  os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "scheduler": scheduler.state_dict(), "wandb_id": wandb_id}, f)
        os.replace(tmp, final)
        for old in complete_checkpoints(cfg.out_dir)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def complete_checkpoints(out_dir):
    """Complete checkpoints under out_dir, oldest first (a .tmp folder is an interrupted save)."""
    root = os.path.join(out_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in sorted(names) if n.startswith("step_") and not n.endswith(".tmp")]


def resume_path(cfg):
    """The checkpoint to resume from; "" to start afresh."""
    found = complete_checkpoints(cfg.out_dir)
    path = (found or [""])[-1] if cfg.resume == "auto" else cfg.resume
    if path and not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise SystemExit(f"--resume {path}: not a complete checkpoint folder (no trainer_state.json)")
    if found and not path:
        raise SystemExit(f"--out_dir {cfg.out_dir} holds checkpoints: --resume auto continues them, or use another")
    return path


def load_checkpoint(path, model, optimizer, scheduler):
    """Restore everything save_checkpoint wrote; returns (step, wandb id)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    scheduler.load_state_dict(trainer_state["scheduler"])
    return trainer_state["step"], trainer_state["wandb_id"]


def stop_on_signal():
    """SIGTERM or Ctrl-C: finish the current step, save a checkpoint, exit. A second Ctrl-C exits at once."""
    requested = threading.Event()

    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt
        requested.set()
        print(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return requested


# ----------------------------------------------------------------------------- main
def main():
    cfg = parse_config()
    rank, device, mesh = init_distributed(cfg)
    tokenizer = load_tokenizer(cfg)
    train_set, test_set = PromptDataset(cfg, "train"), PromptDataset(cfg, "test")
    model_config = tiny_model_config(len(tokenizer)) if cfg.model == "tiny" else AutoConfig.from_pretrained(cfg.model)
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model_config, field) % cfg.tp:
            raise SystemExit(f"--tp {cfg.tp} must divide the model's {field} ({getattr(model_config, field)})")

    state_dict = full_state_dict(cfg, model_config) if rank == 0 else {}
    model = build_model(model_config, mesh, device, state_dict, cfg.activation_checkpointing)
    ref_model = build_model(model_config, mesh, device, state_dict).requires_grad_(False) if cfg.beta > 0 else None
    del state_dict
    # Built before the first forward: after any forward FSDP2 leaves root parameters unsharded, and an
    # optimizer built then would hold tensors that never update.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    path = resume_path(cfg)
    start_step, wandb_id = load_checkpoint(path, model, optimizer, scheduler) if path else (0, None)
    wandb_run = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        config_text = json.dumps(asdict(cfg), indent=1)
        print(config_text + (f"\nresumed from {path} at step {start_step}" if path else ""), flush=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            f.write(config_text)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a+") as f:  # on resume, drop steps that run again
            f.seek(0)
            kept = [line for line in f if json.loads(line)["step"] <= start_step]
            f.truncate(0)
            f.writelines(kept)
        if cfg.wandb_project:
            import wandb
            wandb_run = wandb.init(project=cfg.wandb_project, config=asdict(cfg), id=wandb_id, resume="allow",
                                   dir=cfg.out_dir)
    # Reward workers: forked before the engine starts and before the signal handlers below, in a session of their
    # own, so that the job's signals (Ctrl-C, torchrun's SIGTERM) reach only the trainer, which finishes the step.
    pool = multiprocessing.get_context("fork").Pool(cfg.reward_workers, initializer=os.setsid)
    dp_rank, dp, tp_group = mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["tp"].get_group()
    free_gpu_cache(tp_group)  # SGLang sizes itself from the free memory it sees at start
    engine = create_engine(cfg, model_config, mesh, device, tokenizer.pad_token_id)
    stop = stop_on_signal()
    reward_failed = False
    try:
        push_weights(model, engine, cfg.bucket_mb, tp_group)
        for step in range(start_step, cfg.steps):
            times, start = {}, time.perf_counter()
            # --- generate: G samples per prompt from the engine
            rows = step_rows(train_set, step, cfg, dp_rank, dp)
            seed = (cfg.seed * 1_000_003 + step) * dp + dp_rank
            samples = generate_rollouts(engine, tokenizer, rows, cfg, seed, tp_group, cfg.group_size, cfg.temperature)
            if engine is not None and cfg.engine == "sglang" and not cfg.keep_engine_memory:
                engine.release_memory()  # the training phase gets the engine's weights and KV cache memory
            times["time_generate"] = time.perf_counter() - start
            # --- reward
            timer = time.perf_counter()
            rewards, errors = on_first_tp_rank(tp_group, lambda: score(pool, samples, rows, tokenizer, cfg))
            if errors and not reward_failed and rank == 0:
                print(f"reward_fn failed; it scores 0, counted as reward_errors (shown once):\n{errors[0]}")
            reward_failed = reward_failed or bool(errors)
            times["time_reward"] = time.perf_counter() - timer
            # --- advantages: within each group of G samples of one prompt
            for sample, advantage in zip(samples, group_advantages(rewards, cfg.group_size, cfg.scale_std).tolist()):
                sample["advantage"] = advantage
            # --- logprobs, loss and update
            timer = time.perf_counter()
            sums = train_on_rollouts(model, optimizer, samples, cfg, mesh, tokenizer.pad_token_id, ref_model)
            scheduler.step()
            times["time_logprobs"] = sums.pop("time_logprobs")
            times["time_train"] = time.perf_counter() - timer - times["time_logprobs"]
            # --- push the new weights into the engine
            timer = time.perf_counter()
            push_weights(model, engine, cfg.bucket_mb, tp_group)
            times["time_push"] = time.perf_counter() - timer
            # --- log, evaluate
            lengths = [len(s["ids"]) for s in samples]
            sums.update(reward=rewards.sum().item(), accuracy=(rewards >= 1).sum().item(), samples=len(samples),
                        response_len=sum(lengths), truncated=sum(s["finish"] == "length" for s in samples),
                        reward_errors=len(errors))
            maxes = {"response_len_max": max(lengths), "grad_norm": sums.pop("grad_norm"),
                     "skipped_steps": sums.pop("skipped_steps"), **times,
                     "stop": float(stop.is_set())}  # a signal seen by any rank stops all of them after this step
            sums, maxes = reduce_over_ranks(sums, maxes, mesh, device)
            stopping = maxes.pop("stop")
            metrics = step_metrics(sums, maxes, scheduler.get_last_lr()[0], time.perf_counter() - start)
            last = step + 1 == cfg.steps
            if cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last):
                metrics.update(evaluate(engine, tokenizer, test_set, pool, cfg, mesh, device))
            if rank == 0:
                log_step(step, metrics, cfg, wandb_run)
            # --- checkpoint; on SIGTERM / Ctrl-C save and stop
            if stopping or last or (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0):
                path = save_checkpoint(cfg, step + 1, model, optimizer, scheduler, tokenizer,
                                       wandb_run.id if wandb_run else wandb_id)
            if stopping:
                if rank == 0:
                    print(f"stopped after step {step + 1}: checkpoint {path}; continue with --resume auto", flush=True)
                break
    finally:  # no orphaned engine or reward processes, whatever ended the run
        if engine is not None:
            engine.shutdown()
        pool.terminate()
    if wandb_run is not None:
        wandb_run.finish()
    dist.barrier()  # gloo aborts a rank whose peer tears down first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
