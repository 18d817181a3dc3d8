"""What a run says, for train.py: on rank 0, progress lines, each step's console line (STEP_LINE), a sampled response
now and then, a note when a step learned nothing and the run's last line; each step's metrics as a line of
metrics.jsonl (checkpoint.append_metrics) and to wandb; and status.json, how the run ended. The other ranks say
nothing.

Machinery a researcher rarely edits: a metric is defined in train.step_metrics and logged with no edit here; to show
it on the console too, add a part to STEP_LINE.
"""

import contextlib
import datetime
import json
import os
import pathlib
import re
import string
import textwrap
import time

import checkpoint
import stopping

# The console line of a step: a part a metric, each a format of metrics.jsonl's keys, "| " starting a group. A part
# whose keys the step lacks is left out; a metric a fork adds to the console is one more part here.
STEP_LINE = [
    "step {step}/{steps}",
    "| reward {reward:.3f}",
    "acc {accuracy:.2f}",
    "[{reward_terms}]",  # with several reward terms: each one's mean
    "| len {response_len:.0f}",
    "cut {truncated:.2f}",  # the share of responses that --max_new_tokens cut off
    "| ent {entropy:.2f}",
    "kl {kl:.4f}",  # with --beta
    "lr {lr:.0e}",
    "| {time_step:.1f}s (gen {time_rollout:.1f} train {time_train:.1f} push {time_push:.1f})",
    "eta {eta}",
    "| stale {staleness_mean:.2f} max {staleness_max:.0f}",  # with --partial_rollouts
    "| tool {tool_calls:.1f}/sample",  # with --tool
    "| reward_errors {reward_errors:.0f}",  # when there are some
    "| skipped_steps {skipped_steps:.0f}",  # when there are some
]

# An image's tokens in a sample's prompt, shown as what they are: an image of so many tokens.
IMAGE_TOKENS = re.compile(r"(<\|image_pad\|>)+")

# Said once, at the first step whose groups all have equal rewards: such a step learns nothing.
NO_SIGNAL = (
    "step {step} learned nothing: in every group the rewards are equal, so no advantage and no gradient. Usual "
    "causes: responses cut off by --max_new_tokens {max_new_tokens} (cut {truncated:.2f} here), a task too hard for "
    "the model or already learned (reward {reward:.3f}), or a reward_fn that never varies."
)


def format_parts(parts, values):
    """The parts (each a format of `values`' keys) that name only keys `values` holds, formatted, joined by spaces."""
    shown = []
    for part in parts:
        keys = [key for _, key, _, _ in string.Formatter().parse(part) if key]
        if all(key in values for key in keys):
            shown.append(part.format(**values))
    return " ".join(shown)


def step_line(step, metrics, cfg):
    """The console line of STEP_LINE's parts, from the step's metrics."""
    shown = dict(metrics, step=step + 1, steps=cfg.steps)
    if "eta_s" in metrics:  # not before training
        shown["eta"] = datetime.timedelta(seconds=round(metrics["eta_s"]))
    terms = []
    for key, value in metrics.items():
        if key.startswith("reward/") and not key.endswith("/std"):
            terms.append(f"{key.removeprefix('reward/')} {value:.2f}")
    if len(terms) > 1:
        shown["reward_terms"] = " ".join(terms)
    hidden = [key for key in ("reward_errors", "skipped_steps") if not metrics.get(key)]
    if cfg.beta == 0:
        hidden.append("kl")  # only where --beta gives it a meaning
    if not cfg.tool:
        hidden.append("tool_calls")
    return format_parts(STEP_LINE, {key: shown[key] for key in shown if key not in hidden})


class RunLog:
    """A run's record: rank 0 prints and writes it, the other ranks keep quiet."""

    def __init__(self, cfg, rank, tokenizer):
        self.cfg = cfg
        self.speaks = rank == 0
        self.tokenizer = tokenizer
        self.wandb = None
        if self.speaks and cfg.wandb_project:
            import wandb

            self.wandb = wandb.run  # checkpoint.open_run started it
        self.said_no_signal = False
        if self.speaks:
            self.status("running")

    @contextlib.contextmanager
    def announce(self, what):
        """What is being done, then how long it took."""
        start = time.perf_counter()
        if self.speaks:
            print(f"{what}...", end=" ", flush=True)
        yield
        if self.speaks:
            print(f"{time.perf_counter() - start:.1f}s", flush=True)

    def step(self, step, metrics, sample=None):
        """The console line, a metrics.jsonl line and wandb; `sample` shown at the first step and every
        --sample_every; the first step that learned nothing said. Step -1: the evaluation before training, logged as
        step 0."""
        if not self.speaks:
            return
        cfg = self.cfg
        line = step_line(step, metrics, cfg)
        evals = [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval_") and k != "eval_prompts"]
        if evals:
            line += f"\n  eval ({metrics['eval_prompts']:.0f} prompts): " + " | ".join(evals)
        print(line, flush=True)
        checkpoint.append_metrics(cfg.out_dir, step + 1, metrics)
        shown = cfg.sample_every > 0 and (step == 0 or (step + 1) % cfg.sample_every == 0)
        if sample is not None and shown:
            text = self.tokenizer.decode(sample.prompt_ids) + self.tokenizer.decode(sample.response_ids)
            text = IMAGE_TOKENS.sub(lambda match: f"[image: {match.group().count('<|image_pad|>')} tokens]", text)
            shaped = f", shaped {sample.shaped_reward:.3f}" if sample.shaped_reward != sample.reward else ""
            print(f"  sample (reward {sample.reward:.3f}{shaped}):\n{text}", flush=True)  # wandb keeps the console
        if self.wandb is not None:
            self.wandb.log(metrics, step=step + 1)
        if metrics.get("frac_reward_zero_std") == 1 and not self.said_no_signal:
            self.said_no_signal = True  # once: the cause is the same the next time
            note = NO_SIGNAL.format(step=step + 1, max_new_tokens=cfg.max_new_tokens, **metrics)
            print(textwrap.fill(note, 120, subsequent_indent="  "), flush=True)

    def end(self, steps, stopped, path, started):
        """The run's last line: where its results are, and how long it took since `started`; and status.json, which
        tells a batch script whether it stopped (to be resumed: slurm/train.sbatch requeues it) or is done."""
        if not self.speaks:
            return
        ending = "stopped" if stopped else "done"
        why = stopping.STOP.why or ("another rank was asked to stop" if stopped else "")
        self.status(ending, step=steps, checkpoint=path, why=why)
        stopping.STOP.answered()
        wall = datetime.timedelta(seconds=round(time.perf_counter() - started))
        saved = path or "none (no step ended: the next run starts afresh)"
        line = f"{ending} after step {steps} in {wall}: checkpoint {saved}, metrics {self.cfg.out_dir}/metrics.jsonl"
        print(line + ("; continue with --resume auto" if stopped else ""), flush=True)

    def status(self, status, **details):
        """status.json in --out_dir: "running" from the start, then "done" or "stopped"; anything else (an error,
        a kill) leaves "running"."""
        file = pathlib.Path(self.cfg.out_dir, "status.json")
        file.with_suffix(".tmp").write_text(json.dumps(dict(status=status, **details)) + "\n")
        os.replace(file.with_suffix(".tmp"), file)  # whole, or the one before it
