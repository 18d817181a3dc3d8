"""train.py's command line: Config's fields as flags, each value checked against the bound its type carries.

A flag is declared once, as a field of train.Config; a bound rides on its type (`Annotated[int, AtLeast(1)]`, or an
alias such as train.Count). parse reads the command line (a --preset's values under the flags given; a mistyped flag
named with the nearest one), and check_bounds refuses a value below its bound, NaN or inf, naming the flag;
check_config refuses flags that do not fit each other or the world size (a check that relates a new flag to others
goes there). The flags that name reward_fn's terms are checked against them (check_terms), and start_notes says at
start what a flag may do that its user did not mean. docs/flags.md lists every flag with its default, and
tests/test_style.py holds it to Config.

Machinery a researcher rarely edits: a new flag is a Config field with its bound, its use and its docs line.
"""

import argparse
import difflib
import importlib.util
import math
import os
import typing
from dataclasses import dataclass

import torch
from transformers import HfArgumentParser

import engines


@dataclass(frozen=True)
class AtLeast:
    """A flag's least value, beside its type: Annotated[int, AtLeast(1)]."""

    least: float

    def admits(self, value):
        return self.least <= value < math.inf  # NaN fails

    def __str__(self):
        return f"from {self.least:g} up"


@dataclass(frozen=True)
class Above:
    """A bound the flag's value must pass, the bound itself refused: Annotated[float, Above(0)]."""

    bound: float

    def admits(self, value):
        return self.bound < value < math.inf  # NaN fails

    def __str__(self):
        return f"above {self.bound:g}"


def parse(config_class, presets, argv=None):
    """config_class from the command line, a --preset's values under the flags given. A flag that cannot be read is
    one line (train.main calls this on rank 0 alone, so it is said once); a mistyped flag names the nearest one."""
    parser = HfArgumentParser(config_class, allow_abbrev=False, exit_on_error=False)
    try:
        flags, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:  # a value of the wrong type, a choice outside its list
        raise SystemExit(f"{error} (python train.py --help lists the flags)") from None
    if unknown:
        nearest = difflib.get_close_matches(unknown[0].split("=")[0], [f"--{name}" for name in vars(flags)], n=1)
        hint = f": did you mean {nearest[0]}?" if nearest else ""
        raise SystemExit(f"unknown flag {unknown[0]}{hint} (python train.py --help lists the flags)")
    parser.set_defaults(**presets.get(flags.preset, {}))
    return config_class(**vars(parser.parse_args(argv)))


def check_bounds(cfg):
    """Every flag within the bound its type carries; the first that is not stops the run, named."""
    for name, hint in typing.get_type_hints(type(cfg), include_extras=True).items():
        for bound in getattr(hint, "__metadata__", ()):
            value = getattr(cfg, name)
            if not bound.admits(value):
                raise SystemExit(f"--{name} must be a number {bound}, not {value}")


def check_config(cfg, world):
    """cfg, once its flags pass every check (their bounds, and each flag against the others and the world size);
    each check names the flag to change, one bad flag at a time."""
    check_bounds(cfg)
    dp = max(world // cfg.tp, 1)
    per_rank = cfg.prompts_per_step // dp
    is_level_or_mode_set = (cfg.is_mode, cfg.is_level) != ("truncate", "token")
    named_numbers(cfg, "reward_weights")
    checks = [
        (world % cfg.tp, f"--tp {cfg.tp} does not divide the world size {world}: use a divisor of {world}"),
        (cfg.prompts_per_step % dp, f"--prompts_per_step {cfg.prompts_per_step} must divide by dp = {dp}"),
        (
            per_rank * cfg.group_size % cfg.num_minibatches,
            f"--num_minibatches {cfg.num_minibatches} must divide a rank's {per_rank} x G samples",
        ),
        (cfg.kl_in_reward and cfg.beta == 0, "--kl_in_reward needs --beta above 0: beta scales the KL penalty"),
        (cfg.std_of == "batch" and not cfg.scale_std, "--std_of batch is the std that --scale_std divides by: keep it"),
        (
            cfg.advantage == "rloo" and cfg.scale_std,
            "--advantage rloo is not divided by a std (as verl's and TRL's RLOO): add --scale_std false",
        ),
        (cfg.temperature == 0, "--temperature must be above 0: greedy samples are all alike, nothing to learn"),
        (not 0 < cfg.top_p <= 1, f"--top_p must be above 0 and at most 1, not {cfg.top_p}"),
        (
            cfg.top_k > engines.MAX_KEPT,
            f"--top_k {cfg.top_k} keeps more than the {engines.MAX_KEPT} tokens stored per sampled token",
        ),
        (not 0 < cfg.mem_fraction < 1, f"--mem_fraction is a share: above 0, below 1, not {cfg.mem_fraction}"),
        (os.path.realpath(cfg.out_dir) == os.path.realpath(cfg.model), "--out_dir must differ from --model"),
        (cfg.overlong_buffer > cfg.max_new_tokens, "--overlong_buffer must be at most --max_new_tokens"),
        (cfg.image_min_pixels > cfg.image_max_pixels, "--image_min_pixels must be at most --image_max_pixels"),
        (
            cfg.train_vision and cfg.lora_rank,
            "--train_vision trains the whole tower, LoRA the adapters alone: drop one",
        ),
        (
            cfg.partial_rollouts and cfg.tis_cap == 0,
            "--partial_rollouts trains tokens older policies sampled: add --tis_cap 2 to correct them (decoupled PPO)",
        ),
        (
            cfg.partial_rollouts and cfg.dynamic_sampling_rounds,
            "--partial_rollouts admits a fixed batch of prompts a step: drop --dynamic_sampling_rounds",
        ),
        (
            cfg.objective.startswith("dppo") and cfg.ratio_level == "sequence",
            f"--objective {cfg.objective} masks tokens by their own ratio: use --ratio_level token",
        ),
        (
            is_level_or_mode_set and cfg.tis_cap <= 1,
            "--is_mode and --is_level act through --tis_cap: set it above 1, the bound on the ratio",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise SystemExit(message)
    engines.check_engine_flags(cfg)
    return cfg


def named_numbers(cfg, flag):
    """A flag of name=number pairs separated by commas (--reward_weights correct=1,format=0.2) as {name: number};
    anything else, or a number that is not finite, stops the run naming the flag."""
    text = getattr(cfg, flag)
    numbers = {}
    try:
        for pair in filter(None, text.split(",")):
            name, number = pair.split("=")
            numbers[name.strip()] = float(number)
    except ValueError:
        why = "give name=number pairs separated by commas, as correct=1,format=0.2"
        raise SystemExit(f"--{flag} {text}: {why}") from None
    if not all(map(math.isfinite, numbers.values())):
        raise SystemExit(f"--{flag} {text}: each number must be finite")
    return numbers


def check_terms(cfg, terms):
    """--reward_weights and --accuracy_term against `terms`, the names of the terms that reward_fn returns."""
    returns = f"only {terms}" if terms else "a number, no terms"
    unknown = sorted(named_numbers(cfg, "reward_weights").keys() - set(terms))
    if unknown:  # reward_fn returned no such term on any of the items tried
        raise SystemExit(f"--reward_weights weighs {unknown[0]!r}, which reward_fn does not return ({returns})")
    if cfg.accuracy_term and cfg.accuracy_term not in terms:
        raise SystemExit(f"--accuracy_term {cfg.accuracy_term}: reward_fn returns no such term ({returns})")


def start_notes(cfg, terms, model_config=None):
    """What rank 0 says at start of flags that may not do what their user meant: accuracy counted from the sum of
    several terms (a bonus alone can reach 1), a warm-up of half the run or more; and of --model's Gated DeltaNet
    layers without their kernels (transformers' own warnings, one a kernel, are kept off the console)."""
    notes = []
    linear = "linear_attention" in (getattr(model_config, "layer_types", None) or ())
    kernels = all(importlib.util.find_spec(package) for package in ("fla", "causal_conv1d"))
    if linear and not kernels and torch.cuda.is_available():
        notes.append(
            "note: --model's Gated DeltaNet layers run PyTorch's reference implementation, at about half the "
            "training speed: pip install flash-linear-attention causal-conv1d (requirements.txt)"
        )
    elif linear and not kernels:
        notes.append(
            "note: --model's Gated DeltaNet layers run PyTorch's reference implementation, as on any CPU "
            "(flash-linear-attention's and causal-conv1d's kernels are for GPUs)"
        )
    if len(terms) > 1 and not cfg.accuracy_term:
        notes.append(
            f"note: accuracy counts a response right when its reward, the weighted sum of the terms "
            f"{', '.join(terms)}, is 1 or more; to count a correctness term alone, name it with --accuracy_term"
        )
    below = min(cfg.warmup_steps - 1, cfg.steps)  # steps whose learning rate is below --lr
    if below > 0 and 2 * below >= cfg.steps:
        notes.append(
            f"note: --warmup_steps {cfg.warmup_steps} keeps the learning rate below --lr for {below} of the "
            f"{cfg.steps} steps: lower it for a short run"
        )
    return notes
