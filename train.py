"""GRPO for Qwen and Llama-architecture models, in one file that reads as one step flows.

A step: G completions per prompt from the engine (SGLang on GPUs, HF generate on a CPU; with --partial_rollouts the
groups that ended, the rest going on next step), their rewards, advantages normalised within each group, log-probs
and entropy of the sampled tokens under the policy, clipped policy-gradient updates (FSDP2 over "dp", tensor
parallelism over "tp"), and the new weights pushed back into the engine.

    torchrun --standalone --nproc_per_node=2 train.py --preset cpu   # CPU demo: tiny random model, toy task
    torchrun --nproc_per_node=8 train.py --tp 2                       # GPUs: Countdown, Qwen2.5-3B-Instruct

The flags are Config's fields. A new task is two edits in reward.py: PromptDataset.__getitem__ (what a prompt is)
and reward_fn (how a completion scores, a number or named terms). Machinery beside this file: architectures.py (what
each model family needs: its TP plan per layer type, its names in files and in the engine), engines.py (the rollout
engines and the push into them), checkpoint.py (weights in and out of files), sandbox.py (reward_fn and model-written
code in worker processes), launch.py (the processes under torchrun), flags.py (the command line and its checks),
logs.py (the console, metrics.jsonl, wandb), stopping.py (a stop within --stop_grace), inflight.py (partial
rollouts' bookkeeping), lora.py and vocab_parallel.py.
"""

import functools
import itertools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

import architectures
import checkpoint
import engines
import flags
import launch
import logs
import lora
import reward
import sandbox
import stopping
import vision
import vocab_parallel
from flags import Above, AtLeast
from inflight import Group, InFlight
from reward import PromptDataset

# ----------------------------------------------------------------------------------------------------------------
# Config

# A numeric flag's bound rides on its type: a value below it, NaN or inf is refused at start (flags.check_bounds).
Count = Annotated[int, AtLeast(1)]  # a number of things, or a size
Natural = Annotated[int, AtLeast(0)]  # 0 turns it off, or means never
NonNegative = Annotated[float, AtLeast(0)]
Positive = Annotated[float, Above(0)]


@dataclass
class Config:
    model: str = "Qwen/Qwen2.5-3B-Instruct"  # hub id or local folder; "tiny" (or tiny-qwen3-moe, ...): docs/models.md
    task: str = "countdown"  # countdown, gsm8k, math, addition, toy (README: tasks), or your own (README)
    data_path: str = ""  # a local folder of train.* and test.* (jsonl / parquet) or a hub id; "": the task's own data
    task_args: str = ""  # key=value,...: the task's options (reward.TASK_ARGS), to its data and reward_fn
    train_size: int = 20000  # countdown / toy / addition: problems generated for training
    test_size: int = 500  # countdown / toy / addition: held-out problems, disjoint from training
    plain_template: bool = False  # R1-Zero's plain prompt even when the tokenizer has a chat template (base models)
    image_min_pixels: Count = 4096  # prompts with images: each resized to at least this many pixels (docs/tasks.md)
    image_max_pixels: Count = 1 << 20  # and at most this many, which bounds its tokens (Qwen3.5: 1,024 at most)
    train_vision: bool = False  # prompts with images: train the vision tower too (frozen by default)
    preset: Literal["", "cpu"] = ""  # cpu: tiny model, toy task, small batches; flags given explicitly still win
    engine: Literal["sglang", "hf"] = "sglang" if torch.cuda.is_available() else "hf"  # hf: HF generate (CPU)
    mem_fraction: float = 0.5  # sglang: fraction of the GPU's free memory at start for its weights and KV cache
    engine_port: int = 0  # sglang: 0: each engine takes a free port; > 0: engine_port + its first rank's local rank
    bucket_mb: Count = 512  # weight push: MB of full bf16 tensors gathered and sent at a time
    prompts_per_step: Count = 32  # prompts per optimizer step, over all ranks
    group_size: Annotated[int, AtLeast(2)] = 8  # G: samples per prompt
    max_new_tokens: Count = 1024  # response length limit
    temperature: NonNegative = 1.0
    top_p: float = 1.0  # < 1: nucleus sampling, trained as sampled (docs/losses.md: truncated sampling); eval too
    top_k: Natural = 0  # > 0: only the k likeliest tokens are sampled (at most 512); 0: off
    clip_low: NonNegative = 0.2  # ratio clipped below at 1 - clip_low (docs/losses.md: GRPO, Dr. GRPO, DAPO)
    clip_high: NonNegative = 0.28  # and above at 1 + clip_high (clip-higher, DAPO)
    ratio_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's one ratio per response (docs/losses.md)
    objective: Literal["clip", "cispo", "dppo_tv", "dppo_kl", "sapo"] = "clip"  # docs/losses.md: CISPO, DPPO, SAPO
    dppo_tv_delta: NonNegative = 0.15  # dppo_tv: a token's probability may move this far from the old policy's
    dppo_kl_delta: NonNegative = 0.05  # dppo_kl: its binary KL (sampled token vs the rest) to the old policy this far
    sapo_temperature_pos: Positive = 1.0  # sapo: the soft gate's temperature where the advantage is positive
    sapo_temperature_neg: Positive = 1.05  # and where it is not: a faster fall-off (the paper's, TRL's defaults)
    loss_agg: Literal["token", "sequence", "constant"] = "token"  # DAPO's token mean | GRPO's | Dr. GRPO's constant
    advantage: Literal["grpo", "rloo"] = "grpo"  # rloo: r less the mean of the group's other rewards (RLOO)
    scale_std: bool = True  # divide advantages by a std of the rewards (False: Dr. GRPO)
    std_of: Literal["group", "batch"] = "group"  # that std: each group's (GRPO), or the whole batch's (Lite PPO)
    beta: NonNegative = 0.0  # weight of the KL to the initial policy; 0 builds no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators of KL(policy || reference) per token
    kl_in_reward: bool = False  # subtract beta x the sequence's summed KL from its reward instead of adding a loss
    entropy_coef: NonNegative = 0.0  # entropy bonus
    overlong_buffer: Natural = 0  # > 0: DAPO's soft overlong penalty, 0 down to -1 over the last N tokens of the limit
    partial_rollouts: bool = False  # a step trains once a batch of groups ended; the rest go on (docs/losses.md)
    round_tokens: Count = 128  # --partial_rollouts: a round of generation gives a response at most this many tokens
    max_staleness: Count = 4  # --partial_rollouts: a trained token was sampled at most this many steps ago
    dynamic_sampling_rounds: Natural = 0  # > 0: DAPO's dynamic sampling, dropped groups refilled in up to N more rounds
    tis_cap: NonNegative = 0.0  # > 0: importance sampling against the engine / trainer mismatch, r = p_old / p_engine
    is_mode: Literal["truncate", "mask"] = "truncate"  # with --tis_cap: weight min(r, cap), or r masked to [1/cap, cap]
    is_level: Literal["token", "sequence"] = "token"  # with --tis_cap: r per token, or its response's geometric mean
    logprob_chunk: Count = 1024  # response tokens per chunk of fp32 full-vocabulary logits
    steps: Count = 200
    lr: NonNegative = 1e-6
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: down to 10% of lr at the last step
    warmup_steps: Natural = 10
    weight_decay: NonNegative = 0.0
    max_grad_norm: NonNegative = 1.0
    num_minibatches: Count = 1  # optimizer steps per rollout batch
    micro_batch_size: Count = 8  # sequences per forward / backward on each rank
    max_tokens_per_microbatch: Natural = 0  # > 0: length-sorted micro-batches of at most this many padded tokens
    tp: Count = 1  # tensor-parallel size; dp = world size / tp
    router_aux_loss_coef: NonNegative = 0.0  # routed experts: weight of the load-balancing loss (TRL's: 0.001)
    routing_replay: Literal["off", "measure", "on"] = "off"  # MoE: the engine reports its experts; on: trained on them
    activation_checkpointing: bool = False
    lora_rank: Natural = 0  # > 0: LoRA of this rank on every linear layer of the blocks, the rest frozen (docs/lora.md)
    lora_alpha: Positive = 32.0  # LoRA's update is scaled by alpha / rank (32: as "LoRA Without Regret")
    eval_every: Natural = 50  # evaluate on the held-out split every N steps and at the end; 0: never
    eval_before_train: bool = True  # with --eval_every: the baseline, evaluated before step 1 (logged as step 0)
    eval_prompts: Count = 256  # held-out prompts per evaluation
    eval_k: Count = 4  # samples per prompt for mean@k and pass@k
    eval_temperature: NonNegative = 1.0
    save_every: Natural = 50  # checkpoint every N steps; always at the end and when stopped (--stop_grace)
    keep_checkpoints: Count = 2  # the newest K complete checkpoints are kept
    stop_grace: NonNegative = 25.0  # seconds from a stop (SIGTERM, SIGUSR1, Ctrl-C) to its checkpoint on disk
    resume: str = ""  # a checkpoint folder, or "auto": the newest complete one under out_dir (if any)
    reward_workers: Count = min(4, launch.usable_cpus())  # processes computing rewards in parallel
    reward_timeout: Annotated[float, AtLeast(0.001)] = 5.0  # seconds before a reward_fn call is cut off; it scores 0
    reward_weights: str = ""  # name=weight,...: reward_fn's terms weighted, then summed; a term left out weighs 1
    accuracy_term: str = ""  # a term of reward_fn, correctness in [0, 1]: accuracy is its share at 1; "": reward's
    seed: int = 0
    out_dir: str = "runs/grpo"  # config.json, metrics.jsonl, checkpoints/ (README: where the outputs are)
    wandb_project: str = ""  # log to wandb too when set (WANDB_MODE=offline needs no network)
    sample_every: Natural = 10  # print a sampled prompt, completion and reward every N steps; 0: never
    tool: Literal["", "python"] = ""  # python: responses may run ```python blocks (docs/python-tool.md)
    max_turns: Count = 4  # with --tool: generation turns per response, each but the last may end in a block that is run

    @property
    def truncated_sampling(self):
        """--top_p or --top_k: the engines report each sampled token's kept set, log-probs are renormalised over it."""
        return self.top_p < 1 or self.top_k > 0


# --preset's values, under the flags given. The CPU demo's: what runs, the batch, the schedule.
CPU_PRESET = {
    "model": "tiny",
    "task": "toy",
    "engine": "hf",
    "out_dir": "runs/cpu",
    "train_size": 1000,
    "test_size": 100,
    "steps": 30,
    "prompts_per_step": 8,
    "group_size": 8,
    "max_new_tokens": 16,
    "micro_batch_size": 32,
    "lr": 1e-2,
    "warmup_steps": 0,
    "eval_every": 10,
    "eval_prompts": 16,
    "save_every": 0,
    "reward_workers": 2,
}
PRESETS = {"cpu": CPU_PRESET}


def step_items(dataset, step, cfg, dp_rank, dp, sampling_round=0):
    """This rank's prompts for a step, from a seeded permutation per (epoch, dynamic sampling round)."""
    epoch, i = divmod(step, len(dataset) // cfg.prompts_per_step)
    seed = hash((cfg.seed, epoch, sampling_round))  # a tuple of ints hashes the same in every process
    shuffle = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=shuffle).tolist()
    per_rank = cfg.prompts_per_step // dp
    start = i * cfg.prompts_per_step + dp_rank * per_rank
    return [dataset[j] for j in order[start : start + per_rank]]


def empty(dtype=torch.float32):
    """A Sample field that holds a tensor, empty until the engine's turns fill it."""
    return field(default_factory=lambda: torch.zeros(0, dtype=dtype))


@dataclass
class Sample:
    """One response and what the step learns about it; per-token fields are float32 tensors over its sampled tokens."""

    prompt_ids: list[int]  # the prompt's tokens as the engine saw them
    # The tokens after the prompt as sampled, stop included: never re-tokenised.
    response_ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # per response token: sampled, or tool output (no loss)
    # The engine's log-probs of the sampled tokens, of logits / temperature (renormalised over the kept sets).
    engine_logprobs: torch.Tensor = empty()
    # Truncated sampling: each sampled token's kept set (the ids it was drawn from), one set after another, and sizes.
    kept_ids: torch.Tensor = empty(torch.int32)
    kept_sizes: torch.Tensor = empty(torch.int32)
    tool_outputs: list[str] = field(default_factory=list)  # what each run of its code printed (--tool python)
    # Per sampled token: the step whose policy sampled it (the engine's weights then), for --partial_rollouts.
    versions: torch.Tensor = empty(torch.int32)
    # --routing_replay: the experts [positions, layers, k] the engine's latest weights chose at each position but last.
    routing: torch.Tensor = empty(torch.uint8)
    ended: bool = False  # a stop token sampled, or --max_new_tokens reached: generated to its end
    truncated: bool = False  # cut off by --max_new_tokens rather than ended by a stop token
    terms: dict = field(default_factory=dict)  # reward_fn's terms by name, when it returns a dict of them
    reward: float = 0.0  # reward_fn's value (its terms weighted by --reward_weights and summed), before shaping
    correct: bool = False  # what accuracy counts: the reward, or --accuracy_term's term, at least 1
    shaped_reward: float = 0.0  # the reward plus shaping (the overlong penalty): what advantages are made from
    advantage: float = 0.0
    loss_weight: float = 0.0  # the weight of each of its tokens in the mini-batch loss (--loss_agg)
    old_logprobs: torch.Tensor | None = None  # the policy's before the update, where the step needs them
    ref_logprobs: torch.Tensor | None = None  # the reference model's (--beta > 0)
    # The prompt's images' inputs, pixel values and grid, whose image tokens prompt_ids holds; None: a text prompt.
    images: dict | None = None

    @property
    def num_sampled(self):
        """Its sampled tokens: those the loss trains on (tool output is not counted)."""
        return sum(self.sampled)


# ----------------------------------------------------------------------------------------------------------------
# Model and mesh: tensor parallelism in each decoder layer, then FSDP

# Schulman's estimators of KL(policy || reference) from x = log p - log p_ref of a token sampled from the policy.
KL_ESTIMATORS = {
    "k1": lambda x: x,
    "k2": lambda x: x**2 / 2,
    "k3": lambda x: torch.expm1(-x) + x,
}


def build_model(model_config, mesh, device, activation_checkpointing=False, lora_rank=0, lora_alpha=32.0, tower=None):
    """On the meta device: TP in each decoder layer, LoRA, activation checkpointing, then FSDP per layer and at the
    root; then memory on `device`. checkpoint.load_weights fills it. With a vision tower, prompts with images."""
    # LoRA's frozen base on a GPU: bf16, with no fp32 master copy.
    on_gpu = mesh.device_type == "cuda"
    dtype = torch.bfloat16 if lora_rank and on_gpu else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    # Each decoder layer's plan by its layer types (architectures.py: attention, Gated DeltaNet, MLP, experts).
    architectures.check_tp(model.config, mesh["tp"].size())
    if mesh["tp"].size() > 1:
        architectures.parallelize(model, mesh["tp"])
    architectures.replay_routing(model)  # --routing_replay: routers take the engine's experts when given them
    vision.take_images(model, tower)  # prompts with images: the tower's features in place of the image pads
    lora.add_lora(model, lora_rank, lora_alpha, mesh["tp"])
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # GPU: bf16 compute, fp32 master weights; gradients reduced in fp32.
    param_dtype = torch.bfloat16 if on_gpu else None
    policy = MixedPrecisionPolicy(param_dtype, torch.float32)
    for module in [*model.model.layers, model]:  # each decoder layer, then the root
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    model.to_empty(device=device)
    with torch.device(device):  # rotary frequencies are a non-persistent buffer: rebuild it off the meta device
        model.model.rotary_emb = type(model.model.rotary_emb)(model_config)
    vision.copy_tower(model, tower)  # --train_vision: the model's copy of the tower, from its weights
    return model


# ----------------------------------------------------------------------------------------------------------------
# Rollouts: samples from the engine, tool calls, rewards


def generate_rollouts(engine, workers, tokenizer, items, cfg, seed, temperature, n=1, version=0):
    """On the engine's rank: n samples per item, each generated to its end, by the policy of step `version`, and
    scored; and why the failed reward_fn calls failed. With --tool, a response takes turns: generation stops at a
    ``` fence, its code runs, generation goes on, all in one budget."""
    prompts = [vision.encode_prompt(tokenizer, item, cfg) for item in items]
    samples = [Sample(prompt_ids, images=images) for prompt_ids, images in prompts for _ in range(n)]
    items = [item for item in items for _ in range(n)]
    while running := [s for s in samples if not s.ended]:
        generate_turn(engine, workers, tokenizer, running, cfg, seed, temperature, cfg.max_new_tokens, version)
        seed += 1  # HFEngine's next turn samples afresh
    errors = score_samples(samples, items, workers, tokenizer, cfg)
    return samples, errors


def generate_turn(engine, workers, tokenizer, samples, cfg, seed, temperature, budget, version):
    """One engine call, on the engine's rank: each sample goes on by at most `budget` tokens (within
    --max_new_tokens), each token tagged with `version`, the step whose policy sampled it; a turn that stopped at a
    ``` fence runs its code (--tool). A sample has ended once it sampled a stop token, reached --max_new_tokens, or
    got fewer tokens than asked for with no fence (the engine ended it)."""
    stop_ids = reward.stop_token_ids(tokenizer)
    fence_ids = reward.fence_token_ids(tokenizer) if cfg.tool else []
    budgets = [min(budget, cfg.max_new_tokens - len(s.response_ids)) for s in samples]
    turns = engines.extend_samples(engine, samples, budgets, stop_ids + fence_ids, temperature, seed, version, cfg)
    fenced = []
    for s, asked, ids in zip(samples, budgets, turns):
        if ids and ids[-1] in fence_ids:
            fenced.append(s)
        else:
            s.ended = len(ids) < asked or ids[-1] in stop_ids
    run_tools(fenced, workers, tokenizer, cfg)
    for s in samples:
        s.ended = s.ended or len(s.response_ids) >= cfg.max_new_tokens


def run_tools(samples, workers, tokenizer, cfg):
    """Of samples whose turn stopped at a ``` fence: where the response ends with a ```python block, on a turn but
    the last and with budget left, the workers run the blocks in parallel and each output follows its block as
    tokens that were not sampled. Special tokens that code prints are text: they cannot end the response."""
    runs = []
    for s in samples:
        text = tokenizer.decode(s.response_ids)
        code = reward.code_to_run(text)
        turns_left = len(s.tool_outputs) < cfg.max_turns - 1
        if code is not None and turns_left and len(s.response_ids) < cfg.max_new_tokens:
            runs.append((s, text, code))
    outputs = workers.run_python([code for _, _, code in runs])
    for (s, text, _), output in zip(runs, outputs):
        reply = tokenizer(reward.output_block(text, output), add_special_tokens=False, split_special_tokens=True)
        ids = reply.input_ids[: cfg.max_new_tokens - len(s.response_ids)]
        s.response_ids += ids
        s.sampled += [False] * len(ids)
        s.tool_outputs.append(output)


def score_samples(samples, items, workers, tokenizer, cfg):
    """Each sample's reward: reward_fn's value with its item, or the sum of its terms weighted by --reward_weights;
    whether it is correct (that, or --accuracy_term's term, at least 1); whether --max_new_tokens cut it off (its
    last token is no stop token); its shaped reward, with DAPO's overlong penalty. Returns why the failed calls and
    terms failed."""
    stop_ids = reward.stop_token_ids(tokenizer)
    completions = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    scores, errors = workers.score(completions, items)
    weights = flags.named_numbers(cfg, "reward_weights")
    for s, score in zip(samples, scores):
        if isinstance(score, dict):  # reward_fn's terms
            s.terms = score
            score = sum(weights.get(name, 1.0) * term for name, term in score.items())
        s.reward = score
        s.correct = (s.terms[cfg.accuracy_term] if cfg.accuracy_term else score) >= 1
        s.truncated = not s.response_ids or s.response_ids[-1] not in stop_ids  # SGLang versions differ at the end
        penalty = reward.overlong_penalty(len(s.response_ids), cfg.max_new_tokens, cfg.overlong_buffer)
        s.shaped_reward = score + penalty
    return errors


def collect_rollouts(engine, workers, dataset, tokenizer, in_flight, cfg, step, par):
    """The step's groups of G samples, scored; the failed reward_fn calls; and counts: the groups dynamic sampling
    dropped (equal shaped rewards, so no signal) that no later round could replace, and with --partial_rollouts the
    responses carried into the next step."""
    if cfg.partial_rollouts:  # on the engine's rank, which holds the groups in flight; sent to its TP group
        args = (engine, workers, dataset, tokenizer, in_flight, cfg, step, par.dp_rank, par.dp)
        samples, errors, carried = launch.on_first_rank(par.tp_group, partial_rollouts, *args)
        return samples, errors, dict(groups_dropped=0, responses_carried=carried)
    generate = functools.partial(generate_rollouts, engine, workers, tokenizer)
    kept = []
    dropped = []
    errors = []
    for sampling_round in range(cfg.dynamic_sampling_rounds + 1):
        items = step_items(dataset, step, cfg, par.dp_rank, par.dp, sampling_round)
        seed = hash((cfg.seed, step, sampling_round, par.dp_rank))

        # On the engine's rank, sent to its TP group.
        samples, failed = launch.on_first_rank(
            par.tp_group, generate, items, cfg, seed, cfg.temperature, cfg.group_size, step
        )
        errors += failed
        for i in range(0, len(samples), cfg.group_size):
            group = samples[i : i + cfg.group_size]
            all_equal = len({s.shaped_reward for s in group}) == 1
            if cfg.dynamic_sampling_rounds and all_equal:
                dropped.append(group)
            else:
                kept.append(group)
        if len(kept) >= len(items):
            break
    filled = dropped[: max(0, len(items) - len(kept))]
    groups = kept[: len(items)] + filled
    return [s for group in groups for s in group], errors, dict(groups_dropped=len(dropped) - len(filled))


def partial_rollouts(engine, workers, dataset, tokenizer, in_flight, cfg, step, dp_rank, dp):
    """--partial_rollouts, on the engine's rank: the groups this step trains, scored; why failed reward_fn calls
    failed; and how many responses stay in flight. The step admits prompts until two batches of groups are in
    flight (the first step two batches, each later one), then generates rounds of at most --round_tokens a response
    under its own policy until a batch of groups has ended, and every group --max_staleness steps old among them.
    It trains the oldest groups that ended; the others go on in the next step (docs/losses.md: partial rollouts)."""
    per_rank = cfg.prompts_per_step // dp
    while len(in_flight.groups) < 2 * per_rank:
        for item in step_items(dataset, in_flight.next_batch, cfg, dp_rank, dp):
            prompt_ids, images = vision.encode_prompt(tokenizer, item, cfg)
            samples = [Sample(prompt_ids, images=images) for _ in range(cfg.group_size)]
            in_flight.groups.append(Group(item, samples, step))
        in_flight.next_batch += 1
    for s in in_flight.running():  # --routing_replay: the engine routes a response on new weights afresh
        s.routing = s.routing[:0]
    for generation_round in itertools.count():  # a round at least: the batch just admitted starts
        seed = hash((cfg.seed, step, generation_round, dp_rank))
        running = in_flight.running()
        generate_turn(engine, workers, tokenizer, running, cfg, seed, cfg.temperature, cfg.round_tokens, step)
        if len(in_flight.ended()) >= per_rank and not in_flight.due(step, cfg.max_staleness):
            break
    # Oldest first, so the groups due are among them: with two batches in flight, at most one batch is due.
    trained = in_flight.ended()[:per_rank]
    samples = [s for g in trained for s in g.samples]
    items = [g.item for g in trained for _ in g.samples]
    errors = score_samples(samples, items, workers, tokenizer, cfg)
    in_flight.remove(trained)  # once scored: a stop that gives up the scoring keeps them in flight
    return samples, errors, len(in_flight.running())


# ----------------------------------------------------------------------------------------------------------------
# Advantages


def group_advantages(rewards, group_size, scale_std=True, eps=1e-6, std=None):
    """(r - group mean) / (group std + eps), std unbiased as in GRPO, or a given std (the batch's); without the
    division for Dr. GRPO."""
    r = rewards.view(-1, group_size).double()
    centred = r - r.mean(1, keepdim=True)
    if scale_std and std is None:
        std = r.std(1, keepdim=True)
    if scale_std:
        centred = centred / (std + eps)
    all_equal = (r == r[:, :1]).all(1, keepdim=True)
    return centred.masked_fill(all_equal, 0.0).view(-1)  # equal rewards: no signal, 0


def set_advantages(samples, cfg, dp_group=None):
    """Each sample's advantage from the shaped rewards: group_advantages (--std_of batch divides by the unbiased std
    of every rank's rewards, gathered over dp, as TRL's scale_rewards="batch"), scaled to RLOO's with --advantage
    rloo. --kl_in_reward subtracts beta x summed KL, through the same baseline but never std-scaled (that would
    cancel beta)."""
    rewards = torch.tensor([s.shaped_reward for s in samples])
    std = None
    if cfg.std_of == "batch":  # a TP group's ranks hold the same samples: one of them
        std = launch.gathered(rewards, dp_group).double().std()
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_std, std=std)
    if cfg.kl_in_reward:
        kl_of = KL_ESTIMATORS[cfg.kl_estimator]
        kl = torch.stack([kl_of(s.old_logprobs - s.ref_logprobs).sum() for s in samples])
        advantages -= cfg.beta * group_advantages(kl.cpu(), cfg.group_size, scale_std=False)
    if cfg.advantage == "rloo":
        # RLOO (Ahmadian et al. 2024): r less the mean of the group's G - 1 other rewards, G / (G - 1) x (r - mean).
        advantages *= cfg.group_size / (cfg.group_size - 1)
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage


# ----------------------------------------------------------------------------------------------------------------
# Log-probs and entropy


def response_logprobs(model, samples, cfg, tp_mesh):
    """Log-probs, entropies and log kept masses [N] of the sampled response tokens; lm_head per --logprob_chunk,
    recomputed. With truncated sampling, log p is renormalised over each token's kept set. And the routed experts'
    load-balancing loss and tokens per expert [layers, experts] (architectures.routing; none for a dense model)."""
    device = torch.device(tp_mesh.device_type)
    ids, mask = launch.padded([s.prompt_ids + s.response_ids for s in samples], device)
    engine_routing = architectures.engine_routing(samples, ids.shape[1], model.config, device)  # --routing_replay's
    model.replay = engine_routing if cfg.routing_replay == "on" else None  # its experts replayed by the forward
    model.images = [s.images for s in samples]  # prompts with images: the tower's features in the forward
    out = model(
        input_ids=ids,
        attention_mask=mask,
        logits_to_keep=ids.new_zeros(0),
        output_hidden_states=True,
        output_router_logits=True,  # routed experts': a dense model takes no such output
    )
    # The final norm's output [B, T, H] at the positions that predict the sampled tokens.
    hidden, targets = vocab_parallel.sampled_tokens(out.hidden_states[-1], samples)
    kept = None
    if cfg.truncated_sampling:
        kept = vocab_parallel.kept_sets(samples).to(device)
    weight = model.lm_head.weight
    banned = getattr(model, "banned_ids", None)  # prompts with images: the vision tokens (vision.take_images)
    logprobs = vocab_parallel.chunked_logprobs(
        hidden, weight, targets, kept, cfg.temperature, cfg.logprob_chunk, tp_mesh, banned
    )
    return *logprobs, architectures.routing(out, mask, model, engine_routing)


@torch.no_grad()
def policy_logprobs(model, samples, cfg, par):
    """The model's log-probs of each sample's sampled response tokens, without grad: a tensor per sample, in the
    samples' order (micro-batches by token budget sort them by length)."""
    by_sample = {}
    for batch in launch.micro_batches(samples, cfg, par.world_group):
        logp = response_logprobs(model, batch, cfg, par.mesh["tp"])[0]
        lengths = [s.num_sampled for s in batch]
        for sample, values in zip(batch, logp.split(lengths)):
            by_sample[id(sample)] = values
    return [by_sample[id(s)] for s in samples]


def reference_logprobs(model, ref_model, samples, cfg, par):
    """--beta's reference: the initial policy, kept apart; under LoRA the base model, the policy's adapters off. It
    routes its tokens itself, even with --routing_replay on: its log-probs are the reference model's (as slime's)."""
    cfg = replace(cfg, routing_replay="off")
    if ref_model is None:
        with lora.adapters_off(model):
            return policy_logprobs(model, samples, cfg, par)
    logprobs = policy_logprobs(ref_model, samples, cfg, par)
    ref_model.reshard()  # FSDP keeps root parameters whole after a forward that has no backward
    return logprobs


# ----------------------------------------------------------------------------------------------------------------
# Loss


def policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp=None, entropy=None, is_weights=None, lengths=None):
    """Per-token PG term (--objective's) x is_weights, + beta KL, - entropy bonus, summed with weights; metric sums."""
    log_ratio = (logp - old_logp).clamp(-20, 20)  # as verl: exp overflows above ~88, and one token would skip a step
    if cfg.ratio_level == "sequence":
        # GSPO-token: the value s_i = exp(the response's mean log ratio), the gradient s_i x d log p.
        means = torch.segment_reduce(log_ratio.detach(), "mean", lengths=lengths)
        log_ratio = means.repeat_interleave(lengths) + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    if cfg.objective == "cispo":
        # MiniMax-M1: the ratio, clipped and detached, weights log p; no token is dropped.
        per_token = -ratio.detach().clamp(max=1 + cfg.clip_high) * advantages * logp
        clip_mask = ratio.detach() > 1 + cfg.clip_high
    elif cfg.objective.startswith("dppo"):
        # DPPO: a token that moved too far from the old policy, the way its advantage pushes, gets no gradient (the
        # mask); the rest the policy gradient weighted by the detached ratio, as verl's dppo_tv / dppo_kl.
        clip_mask = dppo_mask(logp.detach(), old_logp, advantages, cfg)
        per_token = (-ratio.detach() * advantages * logp).masked_fill(clip_mask, 0.0)
    elif cfg.objective == "sapo":
        # SAPO: a soft gate in place of the clip, f(r) = sigmoid(tau (r - 1)) x 4 / tau, whose slope 4 s (1 - s) is 1
        # at r = 1 and fades as r leaves it; tau by the advantage's sign, as TRL's. clip_frac: slopes below 1/2.
        temperature = torch.full_like(advantages, cfg.sapo_temperature_neg)
        temperature = temperature.masked_fill(advantages > 0, cfg.sapo_temperature_pos)  # in advantages' dtype
        gate = torch.sigmoid(temperature * (ratio - 1))
        per_token = -gate * 4 / temperature * advantages
        clip_mask = 4 * gate.detach() * (1 - gate.detach()) < 0.5
    else:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        clip_mask = clipped < unclipped
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {
        "clip_frac": clip_mask.sum(),
        "kl": logp.new_zeros(()),
        "entropy": logp.new_zeros(()),
        "ratio_clamped": ((logp - old_logp).detach().abs() > 20).sum(),
    }
    if ref_logp is not None:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp - ref_logp)
        metrics["kl"] = kl.detach().sum()
        if not cfg.kl_in_reward:
            per_token = per_token + cfg.beta * kl
    if entropy is not None:  # in the graph even at coef 0: backward then frees each chunk's recomputed logits
        metrics["entropy"] = entropy.detach().sum()
        per_token = per_token - cfg.entropy_coef * entropy
    return (per_token * weights).sum(), metrics


def dppo_mask(logp, old_logp, advantages, cfg):
    """DPPO's trust region (Qi et al. 2026): the tokens whose divergence from the old policy passes the bound and whose
    probability moved up under a positive advantage, or down under a negative one. The divergence is between the
    two-way distributions (the sampled token, the rest): |p - p_old| (dppo_tv) or KL(old || new) (dppo_kl)."""
    p = logp.exp()
    p_old = old_logp.exp()
    if cfg.objective == "dppo_tv":
        up = p - p_old > cfg.dppo_tv_delta
        down = p_old - p > cfg.dppo_tv_delta
    else:  # KL(old || new) of the sampled token, and of the rest (the 1e-8 as verl's, for a probability of 1)
        rest = (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        binary_kl = p_old * (old_logp - logp) + rest
        up = (binary_kl > cfg.dppo_kl_delta) & (p > p_old)
        down = (binary_kl > cfg.dppo_kl_delta) & (p < p_old)
    return torch.where(advantages > 0, up, down)


def engine_mismatch(trainer_logp, engine_logp, cfg, lengths, fresh=None):
    """IS weights, r = p_trainer / p_engine (None at --tis_cap 0), p_engine that of the policy that sampled each
    token; sums of |log r| and k3 KL over the tokens the engine's current weights sampled (all, or `fresh`: a bad
    push shows), and of |log r| over the older ones (--partial_rollouts: the policy's drift since); masks."""
    log_ratio = trainer_logp - engine_logp
    current = log_ratio if fresh is None else log_ratio[fresh]
    sums = {
        "mismatch_abs": current.abs().sum(),
        "mismatch_kl": KL_ESTIMATORS["k3"](-current).sum(),
    }
    if fresh is not None:
        sums.update(fresh=fresh.sum(), stale_mismatch_abs=log_ratio[~fresh].abs().sum())
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
    tokens = sum(s.num_sampled for s in samples)
    counts = torch.tensor([tokens, len(samples)], dtype=torch.float64)
    dist.all_reduce(counts, group=dp_group)  # response tokens and sequences of the whole mini-batch
    tokens, sequences = counts.tolist()
    dp = dist.get_world_size(dp_group)
    for s in samples:
        if cfg.loss_agg == "sequence":  # each sequence's token mean, then the mean over sequences (GRPO)
            s.loss_weight = dp / (max(s.num_sampled, 1) * sequences)
        elif cfg.loss_agg == "token":  # every token alike, over the tokens (DAPO)
            s.loss_weight = dp / max(tokens, 1)
        else:  # every token alike, over sequences x the length limit (Dr. GRPO)
            s.loss_weight = dp / (cfg.max_new_tokens * sequences)


# ----------------------------------------------------------------------------------------------------------------
# The update


def train_on_rollouts(model, optimizer, samples, cfg, par, version=0):
    """--num_minibatches steps, the ratio against old_logprobs where stored, else on-policy; metric sums. `version`:
    the step, whose policy sampled the fresh tokens (--partial_rollouts)."""
    token_sums = defaultdict(float)  # same keys, same order on every rank
    maxima = defaultdict(float)
    routing_counts = 0  # routed experts: each MoE layer's tokens per expert, and how many its engine routed otherwise
    device = model.device
    per_minibatch = len(samples) // cfg.num_minibatches
    for start in range(0, len(samples), per_minibatch):
        minibatch = samples[start : start + per_minibatch]
        set_loss_weights(minibatch, cfg, par.dp_group)
        batches = launch.micro_batches(minibatch, cfg, par.world_group)
        for batch in batches:
            logp, entropy, log_kept_mass, (router_loss, counts) = response_logprobs(model, batch, cfg, par.mesh["tp"])
            if batch[0].old_logprobs is None:  # the policy that sampled them: the ratio is 1
                old_logp = logp.detach()
            else:
                old_logp = torch.cat([s.old_logprobs for s in batch]).to(device)
            lengths = torch.tensor([s.num_sampled for s in batch], device=device)
            advantages = torch.tensor([s.advantage for s in batch], device=device).repeat_interleave(lengths)
            weights = torch.tensor([s.loss_weight for s in batch], device=device).repeat_interleave(lengths)
            engine_logp = torch.cat([s.engine_logprobs for s in batch]).to(device)
            fresh = None
            if cfg.partial_rollouts:  # the tokens this step's policy sampled
                fresh = torch.cat([s.versions for s in batch]).to(device) == version
            is_weights, mismatch = engine_mismatch(old_logp, engine_logp, cfg, lengths, fresh)
            ref_logp = None
            if cfg.beta > 0:
                ref_logp = torch.cat([s.ref_logprobs for s in batch]).to(device)
            loss, stats = policy_loss(logp, old_logp, advantages, weights, cfg, ref_logp, entropy, is_weights, lengths)
            # The load-balancing loss, a micro-batch's share of the mini-batch's mean (FSDP averages over dp).
            loss = loss + cfg.router_aux_loss_coef * router_loss / len(batches)
            loss.backward()
            routing_counts = routing_counts + counts
            if cfg.truncated_sampling:  # log p(K), what renormalising over the kept sets takes off log p
                stats["log_kept_mass"] = log_kept_mass.detach().sum()
            for key, value in {**stats, **mismatch}.items():
                token_sums[key] += value
        grad_norm = launch.clip_grad_norm(model, cfg.max_grad_norm)
        if math.isfinite(grad_norm):  # a step with a non-finite norm is skipped, and counted
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        maxima["skipped_steps"] += not math.isfinite(grad_norm)  # the norm is global: equal on every rank
        maxima["grad_norm"] += grad_norm / cfg.num_minibatches
    maxima.update(architectures.expert_load(routing_counts, par))  # the busiest expert's load, the routing mismatch
    return token_sums, maxima


def lr_factor(step, cfg):
    """The multiple of --lr at a step: linear warm-up, then constant or cosine down to 0.1 at the last step."""
    if step < cfg.warmup_steps or cfg.lr_schedule == "constant":
        return min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------------------------
# Metrics, logging and evaluation


def sample_metrics(s, cfg):
    """A sample's numbers, each logged as its mean over the step's samples; reward_fn's terms with their std too."""
    values = {
        "reward": s.reward,
        "shaped_reward": s.shaped_reward,
        "accuracy": s.correct,
        "response_len": s.num_sampled,  # tool output is not counted
        "truncated": s.truncated,
        "turns": len(s.tool_outputs) + sum(s.sampled[-1:]),  # a turn per output, and the last
        "tool_calls": len(s.tool_outputs),
        "tool_use": bool(s.tool_outputs),
    }
    if cfg.partial_rollouts:  # how many policies sampled it
        values["versions_per_response"] = len(set(s.versions.tolist()))
    for name, term in s.terms.items():  # reward_fn's terms, in the same order on every rank
        values[f"reward/{name}"] = term
    return values


def step_metrics(samples, token_sums, maxima, errors, rollout_counts, cfg, par, version=0):
    """The step's metrics over all ranks: token_sums' means per sampled token, sample_metrics' means per sample,
    counts, and maxima. `version`: the step, whose policy sampled the fresh tokens (--partial_rollouts)."""
    per_sample = [sample_metrics(s, cfg) for s in samples]
    failures = [reward.tool_failure(output) for s in samples for output in s.tool_outputs]
    rewards = torch.tensor([s.shaped_reward for s in samples]).view(-1, cfg.group_size)
    counts = dict(
        groups=len(rewards),
        zero_std_groups=(rewards == rewards[:, :1]).all(1).sum(),  # all rewards equal: no advantage, no gradient
        samples=len(samples),
        tokens=sum(s.num_sampled for s in samples),
        reward_errors=len(errors),
        **rollout_counts,
        tool_errors=failures.count("error"),
        tool_timeouts=failures.count("timeout"),
    )
    if cfg.partial_rollouts:  # how old the trained tokens are, and how many policies sampled each response
        staleness = version - torch.cat([s.versions for s in samples])
        token_sums = dict(token_sums, staleness_mean=staleness.sum())
        maxima = dict(maxima, staleness_max=max(staleness.tolist(), default=0))
        maxima["versions_per_response_max"] = max(m["versions_per_response"] for m in per_sample)
    metrics, totals = launch.means_over_world(token_sums, per_sample, counts, par)
    if cfg.partial_rollouts:  # the push canary over the tokens the current weights sampled; the older ones apart
        metrics["mismatch_abs"] = totals["mismatch_abs"] / max(totals["fresh"], 1)
        metrics["mismatch_kl"] = totals["mismatch_kl"] / max(totals["fresh"], 1)
        metrics["stale_mismatch_abs"] = totals["stale_mismatch_abs"] / max(totals["tokens"] - totals["fresh"], 1)
    metrics["frac_reward_zero_std"] = totals["zero_std_groups"] / totals["groups"]  # as TRL names it
    maxima = dict(maxima, response_len_max=max(m["response_len"] for m in per_sample))
    return metrics | launch.max_over_world(maxima, par)


def evaluate(engine, tokenizer, test_set, workers, cfg, par):
    """Greedy accuracy, mean@k and pass@k (of k samples at --eval_temperature) on --eval_prompts held-out prompts,
    a response counted as training counts it (Sample.correct); and each reward term's mean over the greedy ones."""
    prompts = range(par.dp_rank, min(cfg.eval_prompts, len(test_set)), par.dp)  # this rank's share
    items = [test_set[i] for i in prompts]
    unrouted = replace(cfg, routing_replay="off")  # nothing trains on these responses: no routing to ask for
    rollouts = (engine, workers, tokenizer, items, unrouted, cfg.seed)
    # On the engine's rank, sent to its TP group; a rank without items (more ranks than prompts) has none.
    sampled, _ = launch.on_first_rank(par.tp_group, generate_rollouts, *rollouts, cfg.eval_temperature, cfg.eval_k)
    greedy, _ = launch.on_first_rank(par.tp_group, generate_rollouts, *rollouts, 0.0, 1)
    correct = torch.tensor([s.correct for s in sampled]).view(-1, cfg.eval_k)  # [prompts, k]
    sums = {
        "eval_greedy_acc": sum(s.correct for s in greedy),
        f"eval_mean@{cfg.eval_k}": correct.float().mean(1).sum(),
        f"eval_pass@{cfg.eval_k}": correct.any(1).sum(),
    }
    for name in test_set.reward_terms:  # the same names on every rank
        sums[f"eval_reward/{name}"] = sum(s.terms[name] for s in greedy)
    totals = launch.sum_over_world(dict(sums, eval_prompts=len(items)), par)
    n = totals["eval_prompts"]  # at least 1: --eval_prompts >= 1
    return {key: total / n for key, total in totals.items()} | {"eval_prompts": n}


# ----------------------------------------------------------------------------------------------------------------
# main


def main():
    started = time.perf_counter()
    rank, world, device = launch.init_distributed()
    # The flags, read and checked on rank 0 while the others wait: a bad one is said once, before any model loads.
    first = dist.new_group(backend="gloo")
    cfg = launch.on_first_rank(first, lambda: flags.check_config(flags.parse(Config, PRESETS), world))
    par = launch.parallel_groups(device.type, cfg.tp)
    launch.on_first_rank(par.world_group, checkpoint.check_sources, cfg)  # --model, --data_path: there to read?
    train_set = PromptDataset(cfg, "train")
    test_set = PromptDataset(cfg, "test") if cfg.eval_every > 0 else None  # no evaluation needs no test split
    terms = train_set.reward_terms  # the names of reward_fn's terms, where it returns a dict of them
    flags.check_terms(cfg, terms)  # --reward_weights, --accuracy_term
    items = [*train_set, *(test_set or [])]
    tokenizer, model_config = checkpoint.load_tokenizer_and_config(cfg, items)
    files = launch.on_first_rank(par.world_group, checkpoint.weight_files, cfg.model)
    # The run folder, once every check passed: a run refused leaves it as it was. Notes on the flags said with them.
    notes = flags.start_notes(cfg, terms, model_config)
    resumed_from, start_step, wandb_id = checkpoint.open_run(cfg, model_config, notes, par.world_group)
    log = logs.RunLog(cfg, rank, tokenizer)
    loading = f"loading {cfg.model} and the engine"
    if resumed_from:
        loading += f", resuming {resumed_from}"
    with log.announce(loading):
        tower = vision.load_tower(cfg, items, files, device)  # prompts with images: frozen, on each rank
        lora_args = (cfg.lora_rank, cfg.lora_alpha)
        model = build_model(model_config, par.mesh, device, cfg.activation_checkpointing, *lora_args, tower)
        ref_model = None
        if cfg.beta > 0 and not cfg.lora_rank:  # LoRA's reference is the base: the policy with its adapters off
            ref_model = build_model(model_config, par.mesh, device, tower=tower).requires_grad_(False)
        models = [model, ref_model] if ref_model else [model]
        checkpoint.load_weights(models, files, cfg, model_config, par.world_group)
        if cfg.lora_rank:
            lora.init_adapters(model, cfg.seed)
        architectures.check_engine_names(model, model_config, cfg.bucket_mb << 20, tower)
        # Before any forward: FSDP2 then leaves root parameters unsharded, and an optimizer would hold stale tensors.
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)  # frozen: no state
        in_flight = InFlight([], next_batch=start_step)  # --partial_rollouts: the groups this rank's engine holds
        if resumed_from:
            saved = checkpoint.resume(resumed_from, model, optimizer, cfg, par.world_group)
            if saved is not None:
                in_flight = InFlight.from_state(saved, Sample)
        # Forked before the engine and the signal handlers exist. Rank 0 shows the first failed call's traceback.
        reward_fn = functools.partial(reward.reward_fn, args=train_set.args)  # --task_args
        reward_workers = sandbox.RewardWorkers(
            reward_fn, cfg.reward_workers, cfg.reward_timeout, terms, show_first_error=rank == 0
        )
        engine = engines.start_engine(cfg, model_config, par, device, tower)
    stopping.STOP.listen(cfg.stop_grace, cfg.out_dir, speaks=rank == 0)  # SIGTERM, SIGINT, SIGUSR1, out_dir/STOP
    evaluating = f"evaluating on {min(cfg.eval_prompts, len(test_set or []))} held-out prompts"
    saved = start_step  # the steps after which the newest checkpoint (or, before any, the start) holds the run
    path = resumed_from

    def save(steps):  # every rank, the state after `steps` steps
        with log.announce(f"saving the checkpoint of step {steps}"):
            return checkpoint.save(cfg, steps, model, optimizer, tokenizer, wandb_id, par.world_group, in_flight)

    try:
        engine.release_memory()  # the first push, as every other, finds the engine's memory released
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
        if cfg.eval_every > 0 and cfg.eval_before_train and start_step == 0:  # the baseline; a resume has it
            with log.announce(evaluating):
                baseline = evaluate(engine, tokenizer, test_set, reward_workers, cfg, par)
            log.step(-1, baseline)
        run_start = time.perf_counter()
        for step in range(start_step, cfg.steps):
            # Generate and reward G samples per prompt (dynamic sampling: maybe more rounds; partial rollouts: the
            # groups that ended, the rest in flight). A stop that leaves no time to end the step gives them up.
            start = time.perf_counter()
            rollouts = (engine, reward_workers, train_set, tokenizer, in_flight, cfg, step, par)
            rollout = stopping.STOP.interruptible(collect_rollouts, *rollouts)
            interrupted = launch.any_rank(rollout is None, par)  # given up on one rank: on every rank
            if interrupted:
                break
            samples, errors, counts = rollout
            engine.release_memory()
            rollout_done = time.perf_counter()
            # Log-probs before the update. The first mini-batch is trained on the policy that sampled it, whose
            # log-probs its own forward gives; --kl_in_reward needs them all first.
            first_stored = 0 if cfg.kl_in_reward else len(samples) // cfg.num_minibatches
            stored = samples[first_stored:]
            for sample, logprobs in zip(stored, policy_logprobs(model, stored, cfg, par)):
                sample.old_logprobs = logprobs
            if cfg.beta > 0:
                for sample, logprobs in zip(samples, reference_logprobs(model, ref_model, samples, cfg, par)):
                    sample.ref_logprobs = logprobs
            # Advantages within each group of G.
            set_advantages(samples, cfg, par.dp_group)
            # Loss and update, the learning rate a function of the step (the flags', not a checkpoint's).
            for group in optimizer.param_groups:
                group.update(lr=cfg.lr * lr_factor(step, cfg), weight_decay=cfg.weight_decay)
            token_sums, maxima = train_on_rollouts(model, optimizer, samples, cfg, par, step)
            train_done = time.perf_counter()
            # The new weights into the engine.
            engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
            end = time.perf_counter()
            # Log, evaluate, save.
            metrics = step_metrics(samples, token_sums, maxima, errors, counts, cfg, par, step)
            metrics |= {
                "time_rollout": rollout_done - start,
                "time_train": train_done - rollout_done,
                "time_push": end - train_done,
                "time_step": end - start,
                "lr": optimizer.param_groups[0]["lr"],
                "eta_s": (end - run_start) / (step + 1 - start_step) * (cfg.steps - step - 1),  # rank 0's
            }
            stop = launch.any_rank(stopping.STOP.asked(), par)  # asked of one rank: of every rank
            last = step + 1 == cfg.steps
            if cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last):
                with log.announce(evaluating):
                    metrics.update(evaluate(engine, tokenizer, test_set, reward_workers, cfg, par))
            log.step(step, metrics, samples[0])
            if stop or last or (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0):
                path = save(step + 1)
                saved = step + 1
            stopping.STOP.step_ended(saved == step + 1)
            if stop:
                break
        if interrupted and saved < step:  # the state after the last step that ended, which no checkpoint holds
            path = save(step)
            saved = step
    finally:  # no orphaned engine or reward processes, whatever ended the run
        launch.shut_down(engine, reward_workers, log.wandb)
    log.end(saved, saved < cfg.steps, path, started)  # stopped: steps left to resume; else done
    dist.barrier(group=par.world_group)  # gloo aborts a rank whose peer tears down first
    dist.destroy_process_group()


if __name__ == "__main__":
    launch.run(main)
