"""What a task is: its data, its prompt, its grader; and the code that runs graders and the Python tool safely on
model output.

Users edit this file to change a reward or add a task; it never imports torch, so it can be tested alone.

The trainer calls `reward_fn(completion, item)` once per sampled completion, in worker processes (`RewardWorkers`
below); `item` is what PromptDataset.__getitem__ in reward.py returned for the prompt. To add a task, write a function
that takes the completion string plus the fields it needs and returns a float in [0, 1], then add a branch to
`reward_fn` (README: your own task). The contract: any string in, a float out, never raises.
Completions are hostile input (megabytes of text, 10,000 parentheses, `__import__('os')`), so nothing here calls
eval, and every scan is linear and capped.
"""

import ctypes
import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import operator
import os
import pickle
import random
import re
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from fractions import Fraction

# Reward for a parsable countdown expression that is wrong (wrong value or wrong numbers). It is small so it
# teaches the answer format early without competing with the 1.0 for a correct answer (as in TinyZero).
FORMAT_SCORE = 0.1

# Limits on model text, so one completion cannot cost seconds of CPU or blow the stack.
MAX_EXPR_CHARS = 200  # countdown expressions are a few dozen characters
MAX_DEPTH = 32  # parenthesis nesting; the parser recurses once per level
MAX_DIGITS = 6  # per integer literal, so Fractions stay small
MAX_NUMBER_CHARS = 30  # gsm8k answers; with _NUMBER (no exponents) this keeps Fraction() cheap
TAIL_CHARS = 10_000  # the last number of a gsm8k answer, or the last \boxed{} of a math answer, is near its end
MAX_BOXED_CHARS = 1_000  # a \boxed{} answer longer than this is not read

_EXPR_CHARS = re.compile(r"[0-9+\-*/()\s]*")
_EXPR_TOKEN = re.compile(r"[0-9]+|[-+*/()]")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_LAST_NUMBER = re.compile(r"(?<![0-9])-?[0-9]+(?:\.[0-9]+)?")  # no lookbehind would read "10-12" as 10 and -12
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")  # \text{ apples}: its text
# Around a number, not part of it: LaTeX's \$ \% and spacing, {,} between thousands, degrees, units and words after it.
_NOT_THE_NUMBER = re.compile(r"\\[$%!,; ]|\{,\}|[$%,]|\^\{?\\circ\}?|\s*[A-Za-z][A-Za-z\s]*$")


# ----------------------------------------------------------------------------------------------------------------
# countdown: combine the given numbers with + - * / to reach the target

COUNTDOWN_PROMPT = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
                    "operations (+, -, *, /) and each number must be used exactly once. Show your work in "
                    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
                    "<answer> (1 + 2) / 3 </answer>.")


_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def countdown_problems(n: int, seed: int) -> list[dict]:
    """n distinct Countdown problems: 3-4 numbers in 1..99 and a target reachable by construction."""
    rng = random.Random(seed)
    problems = {}
    while len(problems) < n:
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        order = rng.sample(nums, len(nums))
        value = Fraction(order[0])
        for x in order[1:]:
            value = _OPERATIONS[rng.choice("+-*/")](value, x)
        if value.denominator == 1 and 0 < value <= 1000:
            problems[(tuple(sorted(nums)), int(value))] = nums
    return [{"nums": nums, "target": target} for (_, target), nums in problems.items()]



def _parse(tokens: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    """expr := term (('+' | '-') term)* ; returns (value, next position). Raises ValueError on bad syntax."""
    value, pos = _term(tokens, pos, depth)
    while pos < len(tokens) and tokens[pos] in "+-":
        rhs, nxt = _term(tokens, pos + 1, depth)
        value, pos = (value + rhs if tokens[pos] == "+" else value - rhs), nxt
    return value, pos


def _term(tokens: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    value, pos = _factor(tokens, pos, depth)
    while pos < len(tokens) and tokens[pos] in "*/":
        rhs, nxt = _factor(tokens, pos + 1, depth)
        value, pos = (value * rhs if tokens[pos] == "*" else value / rhs), nxt  # x/0 raises ZeroDivisionError
    return value, pos


def _factor(tokens: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    """factor := integer | '(' expr ')'. No unary minus: the numbers are given, negating one is not allowed."""
    if pos >= len(tokens):
        raise ValueError("expression ends early")
    if tokens[pos] == "(":
        if depth >= MAX_DEPTH:
            raise ValueError("nested too deeply")
        value, pos = _parse(tokens, pos + 1, depth + 1)
        if pos >= len(tokens) or tokens[pos] != ")":
            raise ValueError("unbalanced parenthesis")
        return value, pos + 1
    if tokens[pos].isdigit() and len(tokens[pos]) <= MAX_DIGITS:
        return Fraction(int(tokens[pos])), pos + 1
    raise ValueError(f"unexpected token {tokens[pos]!r}")


def countdown_reward(completion: str, nums: list[int], target: int) -> float:
    """1.0 if the last <answer> is an expression using each of `nums` once that equals `target`; FORMAT_SCORE if it
    parses but is wrong; 0.0 if there is no answer, it does not parse, or it divides by zero."""
    # rfind, not a regex: a non-greedy regex rescans the tail for every unclosed "<answer>", quadratic on MBs.
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return 0.0
    expr = completion[start + len("<answer>"):end]
    if len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS.fullmatch(expr):
        return 0.0
    tokens = _EXPR_TOKEN.findall(expr)  # whitespace falls out here; "1 2" is still two literals and fails to parse
    try:
        value, pos = _parse(tokens, 0, 0)
    except (ValueError, ZeroDivisionError):
        return 0.0
    if pos != len(tokens):
        return 0.0
    used = sorted(int(t) for t in tokens if t.isdigit())
    return 1.0 if used == sorted(nums) and value == target else FORMAT_SCORE


# ----------------------------------------------------------------------------------------------------------------
# gsm8k: grade school math word problems with a numeric answer

BOXED_PROMPT = "{question}\nThink step by step, then put the final answer in \\boxed{{}}."  # gsm8k and math
DATASETS = {"gsm8k": "openai/gsm8k", "math": "DigitalLearningGmbH/MATH-lighteval"}  # --data_path "" reads these


def _to_number(text: str) -> Fraction | None:
    """'$1,234.00 ', '\\$1{,}234', '1234 \\text{ apples}', 'x = 1234\\%' -> Fraction(1234): what follows the last "=",
    with LaTeX's dollars, percent, thousands separators and the units or words after the number dropped; None if no
    plain decimal number remains."""
    text = _NOT_THE_NUMBER.sub("", _LATEX_TEXT.sub(r"\1", text[:MAX_BOXED_CHARS].rpartition("=")[2]))
    text = text.strip().rstrip(".")
    if len(text) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(text):
        return None
    return Fraction(text)  # exact, so "72.00" == "72" and 0.1 + 0.2 troubles cannot arise


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} in text, braces inside included; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0  # count braces so \boxed{\frac{1}{2}} ends at its own brace; give up after MAX_BOXED_CHARS
    for i in range(start + len("\\boxed"), min(len(text), start + MAX_BOXED_CHARS)):
        depth += 1 if text[i] == "{" else -1 if text[i] == "}" else 0
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def _final_answer(completion: str) -> str:
    """The last \\boxed{...}, else the first number after the last ####, else the last number in the text."""
    boxed = last_boxed(completion[-TAIL_CHARS:])
    if boxed is not None:
        return boxed
    hashes = completion.rfind("####")
    if hashes >= 0:
        match = _NUMBER.search(completion[hashes + 4:hashes + 200].replace(",", "").replace("$", ""))
        return match.group() if match else ""
    numbers = _LAST_NUMBER.findall(completion[-TAIL_CHARS:].replace(",", "").replace("$", ""))
    return numbers[-1] if numbers else ""


def gsm8k_answer(reference: str) -> str | None:
    """The answer of a gsm8k reference solution, the number after its "####"; None when that is not a plain number."""
    answer = reference.split("####")[-1].strip()
    return answer if _to_number(answer) is not None else None


def gsm8k_reward(completion: str, answer: str | None) -> float:
    """1.0 if the completion's final answer equals `answer` as a number, else 0.0 (always, for an answer of None)."""
    predicted = _to_number(_final_answer(completion))
    return 1.0 if answer is not None and predicted is not None and predicted == _to_number(answer) else 0.0


# ----------------------------------------------------------------------------------------------------------------
# addition: "What is a + b?", generated here and graded as gsm8k; small enough for a real model on a CPU

ADDITION_MAX = 30  # operands are drawn from 1..ADDITION_MAX


def addition_problems(n: int, seed: int) -> list[dict]:
    """n distinct additions in gsm8k's row format: {"question": "What is a + b?", "answer": "#### a+b"}."""
    pairs = [(a, b) for a in range(1, ADDITION_MAX + 1) for b in range(1, ADDITION_MAX + 1)]
    if n > len(pairs):
        raise SystemExit(f"--train_size + --test_size = {n}, but only {len(pairs)} distinct additions exist: "
                         "lower them, or raise ADDITION_MAX in reward.py")
    chosen = random.Random(seed).sample(pairs, n)
    return [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in chosen]


# ----------------------------------------------------------------------------------------------------------------
# math: competition problems (MATH) with LaTeX answers


def math_reward(completion: str, answer: str | None) -> float:
    """1.0 if the completion's last \\boxed{} equals `answer` (LaTeX) as mathematics, judged by math-verify: 0.5 and
    \\frac{1}{2}, \\sqrt{2} and \\sqrt 2, the same interval written two ways all match; else 0.0."""
    from math_verify import parse, verify  # imported on first use: only the math task needs math-verify
    boxed = last_boxed(completion[-TAIL_CHARS:])
    if boxed is None or not answer:
        return 0.0
    # math-verify cuts its parse and comparison off after 1 s each (SIGALRM; the trainer's --reward_timeout uses the
    # same alarm, so it no longer covers the rest of this call). Its timeouts log the whole input: keep them quiet.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    gold, predicted = (parse(f"\\boxed{{{text}}}", parsing_timeout=1) for text in (answer, boxed))
    return 1.0 if verify(gold, predicted, timeout_seconds=1) else 0.0


# ----------------------------------------------------------------------------------------------------------------
# shaping and the toy task


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward of a `length`-token response:
    0 up to max_length - buffer tokens, then falling linearly to -1 at max_length, and -1 beyond."""
    if buffer <= 0:
        return 0.0
    return max(-1.0, min(0.0, (max_length - buffer - length) / buffer))


def toy_reward(completion: str, target: str) -> float:
    """Fraction of the (whitespace-stripped) completion's characters equal to the one-character `target`.
    A dense, easy signal: a random tiny model learns to emit only `target` within a minute on CPU."""
    text = completion.strip()
    return text.count(target) / len(text) if text else 0.0


class PromptDataset:
    """Prompts of one task. Edit __getitem__ to change what a prompt says or to add a task (README: your own task)."""
    def __init__(self, cfg, split):
        self.task, self.boxed_prompt = cfg.task, TOOL_PROMPT if cfg.tool else BOXED_PROMPT
        self.rows = load_rows(cfg.task, split, cfg.data_path, cfg.train_size, cfg.test_size, cfg.seed)
        least = cfg.prompts_per_step if split == "train" else 1  # a step's prompts; an evaluation's
        check_items(self, split, least, warn=os.environ.get("RANK", "0") == "0", tool=cfg.tool)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        """An item: {"prompt": chat messages, or a string used as is; "task"; and the fields reward_fn reads}."""
        row, task = self.rows[i], self.task
        if task == "toy":
            return {"prompt": f"Say {row['target']}:", "task": task, "target": row["target"]}
        if task == "countdown":  # the row is {"nums", "target"}
            return {"prompt": [{"role": "user", "content": COUNTDOWN_PROMPT.format(**row)}], "task": task, **row}
        if task in ("gsm8k", "addition"):  # addition's rows are generated in gsm8k's format
            question, answer = row["question"], gsm8k_answer(row["answer"])
        elif task == "math":  # the answer is the last \boxed{} of the reference solution, in LaTeX
            question, answer = row["problem"], last_boxed(row["solution"])
        else:
            raise SystemExit(f"--task {task}: PromptDataset.__getitem__ in reward.py has no branch for it: add one, "
                             "and one to reward_fn (README: your own task)")
        prompt = [{"role": "user", "content": self.boxed_prompt.format(question=question)}]
        return {"prompt": prompt, "task": task, "answer": answer}


def reward_fn(completion: str, item: dict) -> float:
    """Called by the trainer for every completion; `item` is the dataset's item. Edit here to add a task."""
    task = item["task"]
    if task == "countdown":
        return countdown_reward(completion, item["nums"], item["target"])
    if task in ("gsm8k", "addition"):
        return gsm8k_reward(completion, item["answer"])
    if task == "math":
        return math_reward(completion, item["answer"])
    if task == "toy":
        return toy_reward(completion, item["target"])
    raise ValueError(f"unknown task {task!r}: add a branch for it to reward_fn in reward.py (README: your own task)")


# ----------------------------------------------------------------------------------------------------------------
# task data and prompt templates

# The R1-Zero template, for base models: used when the tokenizer has no chat template, or with --plain_template.
PLAIN_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                  "The assistant first thinks about the reasoning process in the mind and then provides the user "
                  "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
                  "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
                  "<answer> answer here </answer>. User: {question} Assistant: <think>")


def encode_prompt(tokenizer, prompt: list[dict] | str, plain_template: bool = False) -> list[int]:
    """Token ids of a prompt: the chat template, or the R1-Zero plain template when the tokenizer has none or
    --plain_template asks for it."""
    if isinstance(prompt, str):
        text = prompt
    elif tokenizer.chat_template and not plain_template:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = PLAIN_TEMPLATE.format(question=prompt[-1]["content"])
    return tokenizer(text, add_special_tokens=False).input_ids


@functools.cache  # once per tokenizer: get_vocab() copies a vocabulary of 151k tokens
def stop_token_ids(tokenizer) -> list[int]:
    """EOS of the tokenizer plus the end-of-turn and end-of-text tokens of Qwen (and SmolLM2) and Llama 3, where the
    vocabulary has them: SGLang stops at each id of a model's config, so both engines stop alike."""
    vocab = tokenizer.get_vocab()
    ends = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ends if t in vocab}
    return sorted(i for i in ids if i is not None)


def check_items(dataset, split: str, least: int = 1, warn: bool = True, tried: int = 64, tool: str = "") -> None:
    """Before any model is loaded, the items of `dataset` (a PromptDataset, or a list): stop with one line when
    a row cannot be made an item, there are fewer than `least` items, they lack a field the prompt or reward_fn reads,
    reward_fn raises on each of the first `tried`, or (with `tool`) the prompts never offer the tool; with `warn`,
    print how many items have a reference answer that does not parse (their "answer" is None: every reward on them
    is 0)."""
    items = []
    for i in range(len(dataset)):
        try:
            items.append(dataset[i])
        except Exception as error:  # a row without a field that __getitem__ reads, or with None where it reads text
            raise SystemExit(f"{split} row {i} (from 0) cannot be made an item ({type(error).__name__}: {error}): "
                             "PromptDataset.__getitem__ in reward.py reads a field that it lacks or holds null: check "
                             "--data_path's rows, or __getitem__")
    if len(items) < least:
        raise SystemExit(f"the {split} split has {len(items)} rows, fewer than {least} (--prompts_per_step for train): "
                         "check --task, --data_path, --train_size, --test_size (or --eval_every 0)")
    errors = []
    for item in items[:tried]:
        try:
            _ = item["prompt"]
            reward_fn("", item)
        except KeyError as missing:
            raise SystemExit(f"{split} items lack the field {missing} that the prompt or reward_fn reads: "
                             "return it from PromptDataset.__getitem__ in reward.py")
        except Exception as error:
            errors.append(error)
    if errors and len(errors) == len(items[:tried]):
        raise SystemExit(f"reward_fn fails on each of the first {len(errors)} {split} items "
                         f"({type(errors[0]).__name__}: {errors[0]}): fix reward_fn in reward.py")
    if tool and "```python" not in str(items[0]["prompt"]):  # nothing would tell the model how to run code
        raise SystemExit(f"--tool {tool}: the {split} prompts do not offer the tool (no ```python in them): use a task "
                         "whose prompts do (gsm8k, math, addition) or add the offer to yours (README: the Python tool)")
    bad = [i for i, item in enumerate(items) if "answer" in item and item["answer"] is None]
    if bad and warn:
        print(f"warning: {len(bad)} of {len(items)} {split} items have a reference answer that does not parse, so "
              f"every reward on them is 0; the first is item {bad[0]}", flush=True)


def toy_problems(n: int, seed: int) -> list[dict]:
    """The CPU demo's task: n times "say a" (toy_reward)."""
    return [{"target": "a"}] * n


GENERATED = {"countdown": countdown_problems, "addition": addition_problems, "toy": toy_problems}  # need no download


def load_rows(task: str, split: str, data_path: str, train_size: int, test_size: int, seed: int) -> list[dict]:
    """The raw rows of one split: from --data_path (a local folder of train.* and test.* splits, jsonl or parquet, or a
    hub id) when given; else generated (GENERATED: the test split first, so they are disjoint); else from the task's
    hub dataset (DATASETS)."""
    if not data_path and task in GENERATED:
        problems = GENERATED[task](test_size + train_size, seed)
        return problems[:test_size] if split == "test" else problems[test_size:]
    if not data_path and task not in DATASETS:
        raise SystemExit(f"--task {task}: reward.py has no data for it (it generates {', '.join(GENERATED)} and "
                         f"downloads {', '.join(DATASETS)}); for your own task give --data_path a folder of "
                         "train.jsonl and test.jsonl (README: your own task)")
    import datasets  # only data that is read needs it
    path = data_path or DATASETS[task]  # a local folder: datasets reads the splits from the file names
    try:
        return list(datasets.load_dataset(path, "main" if path == DATASETS["gsm8k"] else None, split=split))
    except Exception as error:  # no such split, folder or dataset; an empty or malformed file; a failed download
        cause = error.__cause__ or error  # datasets wraps what its reader met
        raise SystemExit(f"--data_path {path}: no readable {split} split ({type(cause).__name__}: "
                         f"{(str(cause).splitlines() or [''])[0][:200]}): give a folder with {split}.jsonl (a JSON "
                         f"object a line) or {split}.parquet")


# ----------------------------------------------------------------------------------------------------------------
# the Python tool: model-written code, run where it can hurt nothing but itself

TOOL_OUTPUT_CHARS = 10_000  # what the model sees of a run's stdout and stderr
TOOL_TIMEOUT = 10.0  # seconds of wall time for one run
TOOL_PROCESSES = 16  # processes and threads one call may run at once, when the trainer is root
# When the trainer is root, each call runs as a user of its own, TOOL_UID_BASE + the id of the thread that makes it: no
# two calls running at once share one. The base starts the band that systemd leaves unused, above its container UIDs.
TOOL_UID_BASE = 0x70000000
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # where every user may write
# Run as root inside the call's new namespaces, before the code's user takes over: the call's folder becomes /tmp and
# a new tmpfs of memory_mb becomes /dev/shm, so what the code writes to either is the call's alone and goes with it.
# The code's stderr joins its stdout here; unshare's own goes to /dev/null (what it says of killed code is noise).
TOOL_MOUNTS = ('folder=$1 size=$2; shift 2; mount --bind "$folder" /tmp && '
               'mount -t tmpfs -o size="$size"m,nosuid,nodev tmpfs /dev/shm && cd /tmp/work && exec "$@" 2>&1')


def _runnable_by_others(path: str) -> bool:
    """Whether a user other than the owner can execute `path`: every folder above it searchable, itself r-x."""
    path = os.path.realpath(path)
    folders = [os.path.dirname(path)]
    while folders[-1] != os.path.dirname(folders[-1]):
        folders.append(os.path.dirname(folders[-1]))
    return all(os.stat(f).st_mode & 0o001 for f in folders) and os.stat(path).st_mode & 0o005 == 0o005


def tool_interpreter() -> str:
    """The Python that runs tool code: this one, or when the trainer is root and the unprivileged user cannot run it
    (a pyenv under /root), the system's /usr/bin/python3. "" when there is none."""
    if os.geteuid() != 0:
        return sys.executable
    return next((p for p in (sys.executable, "/usr/bin/python3") if os.path.exists(p) and _runnable_by_others(p)), "")


def _tool_uid() -> int:
    """The user a call made by this thread runs as: its own under root (TOOL_UID_BASE), else the trainer's."""
    return TOOL_UID_BASE + threading.get_native_id() if os.geteuid() == 0 else os.getuid()


def _command(namespaces: list[str], folder: str, uid: int, memory_mb: int, program: list[str]) -> list[str]:
    """The command that runs `program` for a call: in the namespaces with TOOL_MOUNTS done, if any; as `uid` under root
    (which dies with its parent as PID 1 does: a change of user would drop that)."""
    mounts = ["sh", "-c", TOOL_MOUNTS, "sh", folder, str(memory_mb)] if namespaces else []
    user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL", "--"]
    return namespaces + mounts + (user if os.geteuid() == 0 else []) + program


@functools.cache
def _isolation() -> list[str] | None:
    """The command prefix that gives tool code new mount, PID, network and IPC namespaces (and a user namespace of
    the trainer's user when it is not root): TOOL_MOUNTS gives it a /tmp and /dev/shm of its own, and the /proc of
    its own processes; when its PID 1 exits, the kernel kills every process it started, double-forked daemons included;
    no network but a loopback that is down; SysV shared memory and queues go with the call. [] where the OS allows no
    namespaces (then, under root, the call's own user, whose processes and files are found and removed after the
    call); None when root cannot switch users: then no code runs."""
    namespaces = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--"]
    if os.geteuid() != 0:  # a user namespace of the trainer's user allows the others without root
        namespaces[1:1] = ["--user", "--map-root-user"]
    folder = tempfile.mkdtemp(prefix="tool_")
    try:
        os.mkdir(os.path.join(folder, "work"))
        for prefix in (namespaces, []):
            try:
                command = _command(prefix, folder, _tool_uid(), 64, ["true"])
                if subprocess.run(command, capture_output=True, timeout=10).returncode == 0:
                    return prefix
            except (OSError, subprocess.SubprocessError):
                pass
        return None
    finally:
        subprocess.run(["rm", "-rf", "--", folder], capture_output=True)


def _threads_of(uid: int) -> int:
    """How many threads the processes of `uid` run now (Linux; 0 elsewhere): what RLIMIT_NPROC counts."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            count += len(os.listdir(f"/proc/{pid}/task")) if os.stat(f"/proc/{pid}").st_uid == uid else 0
        except OSError:  # ended meanwhile
            pass
    return count


def _new_cgroup(name: str, memory_mb: int) -> str:
    """A new memory cgroup `name` that caps a call's memory as a whole (its forks, its /dev/shm and page cache
    included; no swap): a child of the trainer's cgroup (cgroup v1), or of the trainer's or the root cgroup, whichever
    lets a child control memory (v2). "" where none can be made: not root, or no such cgroup file system."""
    if os.geteuid() != 0 or not os.path.exists("/proc/self/cgroup"):
        return ""
    with open("/proc/self/cgroup") as f:  # lines of ID:controllers:the trainer's cgroup in their hierarchy
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    if "memory" in own:  # cgroup v1, a hierarchy per controller: a child of the trainer's memory cgroup
        parents = [f"/sys/fs/cgroup/memory{own['memory']}"]
        limits = [("memory.limit_in_bytes", memory_mb << 20), ("memory.memsw.limit_in_bytes", memory_mb << 20)]
    else:  # v2: a cgroup that holds processes (the trainer's, mostly) cannot give a child memory control; the root can
        parents = [f"/sys/fs/cgroup{own.get('', '/')}", "/sys/fs/cgroup"]
        limits = [("memory.max", memory_mb << 20), ("memory.swap.max", 0)]
    for parent in parents:
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        try:
            for i, (file, value) in enumerate(limits):
                if i == 0 or os.path.exists(os.path.join(folder, file)):  # the swap file exists where swap is counted
                    with open(os.path.join(folder, file), "w") as f:
                        f.write(str(value))
            return folder
        except OSError:  # no memory.max: v2 gives this child no memory control
            os.rmdir(folder)
    return ""


def _oom_kills(cgroup: str) -> int:
    """How many of the call's processes the kernel killed for passing its cgroup's memory limit."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        if os.path.exists(os.path.join(cgroup, name)):
            with open(os.path.join(cgroup, name)) as f:
                return int(dict(line.split() for line in f).get("oom_kill", 0))
    return 0


def _remove_cgroup(folder: str) -> None:
    """The call's cgroup removed, once the processes it held have all exited (at most a second)."""
    for _ in range(100):
        try:
            return os.rmdir(folder)
        except FileNotFoundError:
            return
        except OSError:  # busy: a killed process not yet gone
            time.sleep(0.01)


def _remove_files_of(uid: int, folders) -> None:
    """Whatever `uid` owns in `folders` and in the folders within them that every user may write, removed."""
    found, folders = [], list(folders)
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                found.append(entry.path)
            elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002:
                folders.append(entry.path)
    for i in range(0, len(found), 1000):  # rm, as for the call's folder (_clean_up)
        subprocess.run(["rm", "-rf", "--", *found[i:i + 1000]], stdin=subprocess.DEVNULL, capture_output=True)


def run_python(code: str, timeout: float = TOOL_TIMEOUT, memory_mb: int = 2048) -> str:
    """Run model-written `code` in a fresh Python process and return its stdout and stderr as text: at most
    TOOL_OUTPUT_CHARS, with a note when cut or timed out. Never raises. The code runs in a new empty folder of its own,
    as a user of its own when the trainer is root, in its own namespaces where the OS allows (_isolation), with limits
    on CPU time, wall time, memory (of the call as a whole where a cgroup can be made), file size and processes; nothing
    it starts or writes outlives the call."""
    root, uid, namespaces, folder, cgroup = os.geteuid() == 0, _tool_uid(), [], "", ""
    try:
        interpreter, namespaces = tool_interpreter(), _isolation() if sys.platform == "linux" else []
        if not interpreter:
            return ("error: no Python that an unprivileged user can run (the trainer's lives where others cannot "
                    "read); install /usr/bin/python3")
        if namespaces is None:
            return ("error: the trainer is root and cannot run code as an unprivileged user: setpriv "
                    "(util-linux >= 2.33)")
        folder = tempfile.mkdtemp(prefix="tool_")  # main.py, and work/: the code's working directory, TMPDIR and HOME
        inside = "/tmp" if namespaces else folder  # the folder as the code sees it: TOOL_MOUNTS makes it /tmp
        os.mkdir(os.path.join(folder, "work"))
        with open(os.path.join(folder, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if root:
            for path in (folder, os.path.join(folder, "work"), os.path.join(folder, "main.py")):
                os.chown(path, uid, uid)
        cgroup = _new_cgroup(os.path.basename(folder), memory_mb) if sys.platform == "linux" else ""
        # Processes and threads, more than the code's user runs already: under root the call's own user, which runs
        # none (or zombies that a PID 1 has not reaped); otherwise the trainer's, which runs hundreds of threads.
        processes = (TOOL_PROCESSES if root else 256) + _threads_of(uid)

        def limit():  # in the child, before exec: its own session, cgroup and limits, which its children inherit
            os.setsid()
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the worker that started it
            os.umask(0o077)  # what the code writes, its user's alone
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            for kind, value in ((resource.RLIMIT_CPU, math.ceil(timeout) + 1), (resource.RLIMIT_NPROC, processes),
                                (resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, 64 << 20),
                                (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(kind, (value, value))
        work = f"{inside}/work"
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work, "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # numpy's threads would count against the limit
        # A file, not a pipe: a flood of output cannot block anyone. Nameless and outside the folder: the code cannot
        # swap it for a link to a file only the trainer may read, or for a FIFO that would stall the reading.
        with tempfile.TemporaryFile() as output:
            command = _command(namespaces, folder, uid, memory_mb, [interpreter, "-I", f"{inside}/main.py"])
            process = subprocess.Popen(command, cwd=os.path.join(folder, "work"), env=env, stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=subprocess.DEVNULL if namespaces else subprocess.STDOUT,
                                       preexec_fn=limit)
            note = "" if _ended_within(process, timeout) else f"\n[timed out after {timeout:g} s]"
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its namespace's PID 1 goes, and every process with it
            except ProcessLookupError:
                pass
            process.wait()
            if cgroup and _oom_kills(cgroup):  # said as Python would: tool_failure counts it as an error
                note += f"\nMemoryError: the call used its {memory_mb} MB of memory, its processes together; killed"
            output.seek(0)
            head = output.read(4 * TOOL_OUTPUT_CHARS)  # a character is at most 4 bytes
            size = os.fstat(output.fileno()).st_size
        text = head.decode("utf-8", errors="replace")
        if len(text) > TOOL_OUTPUT_CHARS or size > len(head):
            text = text[:TOOL_OUTPUT_CHARS] + f"\n[output cut at {TOOL_OUTPUT_CHARS} characters]"
        return text + note
    except Exception as error:  # the tool never raises: the model sees what went wrong
        return f"error: the tool could not run the code ({type(error).__name__}: {error})"
    finally:
        if folder:
            _clean_up(folder, uid, namespaces, cgroup)


def _ended_within(process: subprocess.Popen, timeout: float) -> bool:
    """Whether `process` ended within `timeout` seconds. Woken by its pidfd when it ends, where the kernel has them:
    Popen.wait(timeout) polls at intervals that double, so a call ending at 16 ms would be seen at 31 ms."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux 5.3 or newer
        try:
            process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


def _clean_up(folder: str, uid: int, namespaces: list[str], cgroup: str) -> None:
    """After a call, never raising: its folder removed, and its cgroup; under root, what its user left where every user
    may write (the namespaces' own /tmp and /dev/shm went with them), and without a PID namespace, every process its
    user still runs: kill(-1) as that user reaches those and no others."""
    try:
        if os.geteuid() == 0 and not namespaces:
            subprocess.run(_command([], folder, uid, 0, ["sh", "-c", "kill -KILL -1"]), capture_output=True)
        if os.geteuid() == 0:
            _remove_files_of(uid, ("/var/tmp", "/run/lock") if namespaces else SHARED_FOLDERS)
        # rm, not shutil.rmtree, which recurses per level: a folder nested 10,000 deep would raise
        subprocess.run(["rm", "-rf", "--", folder], stdin=subprocess.DEVNULL, capture_output=True)
    except OSError:
        pass
    if cgroup:
        _remove_cgroup(cgroup)


# ----------------------------------------------------------------------------------------------------------------
# the Python tool in a rollout (--tool python): the model writes a ```python block, generation stops at its end, the
# block is run, and its output is appended as an ```output block (ToRL's format); the model then goes on

# Qwen2.5-Math's tool-integrated reasoning instruction, and how the tool answers.
TOOL_PROMPT = ("{question}\nPlease integrate natural language reasoning with programs to solve the problem above, and "
               "put your final answer within \\boxed{{}}. Each ```python block you write is run, and what it prints is "
               "shown to you in an ```output block.")


@functools.cache
def fence_token_ids(tokenizer) -> list[int]:
    """The tokens a ``` fence can end on: their text ends with a backquote, whitespace aside. Generation stops at each
    (engines stop on token ids; SGLang's stop strings would need its own tokenizer), and code_to_run tells a fence
    that closes a ```python block from the rest (an opening fence, inline code), after which generation goes on."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(texts) if text.rstrip().endswith("`")]


def code_to_run(response: str) -> str | None:
    """The code of the ```python block that `response` ends with (whitespace aside), or None when it ends otherwise."""
    _, opening, rest = response.rstrip().rpartition("```python")
    if not opening or not rest.endswith("```") or "```" in rest[:-3]:  # one fence after the opening: the closing one
        return None
    return rest[:-3]


def output_block(response: str, output: str) -> str:
    """The text appended to `response` after its block ran: the output in an ```output block on lines of its own."""
    return ("" if response.endswith("\n") else "\n") + f"```output\n{output.rstrip()}\n```\n"


def run_tools(samples: list, workers, tokenizer, max_turns: int, max_new_tokens: int) -> None:
    """Of the trainer's samples whose turn stopped at a ``` fence: where the response ends with a ```python block, on a
    turn but the last and with budget left, the workers run the blocks in parallel and each output goes after its
    block (output_block) as unsampled tokens. Special tokens that code prints are text: it cannot end the response."""
    texts = [tokenizer.decode(s.response_ids) for s in samples]
    runs = [(s, text, code) for s, text in zip(samples, texts) if len(s.tool_outputs) < max_turns - 1
            and len(s.response_ids) < max_new_tokens and (code := code_to_run(text)) is not None]
    for (s, text, _), output in zip(runs, workers.run_tools([code for _, _, code in runs])):
        reply = tokenizer(output_block(text, output), add_special_tokens=False, split_special_tokens=True)
        ids = reply.input_ids[:max_new_tokens - len(s.response_ids)]
        s.response_ids += ids
        s.sampled += [False] * len(ids)
        s.tool_outputs.append(output)


def tool_failure(output: str) -> str | None:
    """"timeout" when the run was cut off, "error" when it failed (a traceback, an `...Error:` line), else None."""
    if "\n[timed out after " in output[-100:]:
        return "timeout"
    return "error" if re.search(r"^(Traceback \(most recent call last\)|\w*Error: |error: )", output, re.M) else None


# ----------------------------------------------------------------------------------------------------------------
# running reward_fn on model output: in worker processes, each call cut off after a timeout


def _reward_or_error(completion: str, item: dict, timeout: float) -> tuple[float, str | None]:
    """In a worker: (score, None), or (0.0, why) when reward_fn raises, runs past `timeout` seconds, or returns
    anything but a finite number (a NaN reward would stop all learning)."""
    def raise_timeout(signum, frame):
        raise TimeoutError("reward_fn ran past --reward_timeout")
    signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout, 1.0)  # repeats if reward_fn swallows the TimeoutError
    try:
        value = reward_fn(completion, item)
    except Exception:
        return 0.0, traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return 0.0, f"reward_fn returned {repr(value)[:200]}, not a finite number"
    return float(value), None


def _send(connection: socket.socket, data: bytes, deadline: float | None = None) -> None:
    """`data` sent as one message (its length, then itself); TimeoutError past `deadline` (time.monotonic()) if any."""
    connection.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
    connection.sendall(len(data).to_bytes(8, "big") + data)


def _receive(connection: socket.socket, deadline: float | None = None) -> bytes:
    """One message; TimeoutError past `deadline` if any, EOFError when the other end has closed."""
    def read(size):
        data = bytearray()
        while len(data) < size:
            connection.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
            chunk = connection.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)
    return read(int.from_bytes(read(8), "big"))


def _serve(connection: socket.socket) -> None:
    """A worker: calls each (function, args) that arrives (reward_fn's or the tool's) until the trainer closes the
    connection."""
    os.setsid()  # its own session and process group: signals sent to the trainer's group are the trainer's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's handler, which a replacement inherits
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux): killed when the trainer dies
    except (OSError, AttributeError):
        pass
    while True:
        try:
            function, args = pickle.loads(_receive(connection))
        except EOFError:
            return
        _send(connection, pickle.dumps(function(*args)))


class RewardWorkers:
    """reward_fn, and the tool's run_python, in `workers` forked processes, each in its own session. A reward_fn call
    past `timeout` is cut off inside its worker (SIGALRM). A worker that has not answered a second later (stuck where
    SIGALRM cannot reach, as C code with signals blocked, or stopped by SIGSTOP) or is dead is killed with its process
    group and replaced, and its call scores 0: every exchange with a worker, the call sent and its answer read, has
    that deadline, so a batch never waits much longer than its slowest allowed call. With show_first_error, the first
    failure is printed, once."""

    def __init__(self, workers: int, timeout: float, show_first_error: bool = False):
        self.timeout, self.show_first_error = timeout, show_first_error
        self.context = multiprocessing.get_context("fork")
        self.workers = [self._start() for _ in range(workers)]

    def _start(self):
        """A new worker: (process, the trainer's end of its connection)."""
        ours, theirs = socket.socketpair()  # a socket, whose every exchange can have a deadline (_run)
        process = self.context.Process(target=_serve, args=(theirs,), daemon=True)
        process.start()
        theirs.close()
        return process, ours

    @staticmethod
    def _stop(process, connection):
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the worker and whatever reward_fn started in its group
        except ProcessLookupError:  # gone already, or killed before its setsid
            process.kill()
        process.join()
        connection.close()  # after the kill: a worker that saw its socket close would print a traceback

    def _replace(self, w):
        """Worker w killed and a new one in its place; the old one's exit code."""
        process, connection = self.workers[w]
        self._stop(process, connection)
        self.workers[w] = self._start()
        return process.exitcode

    def score(self, completions: list[str], items: list[dict]) -> tuple[list[float], list[str]]:
        """reward_fn of each completion with its item; why the failed calls (scored 0) failed."""
        calls = [(_reward_or_error, (completion, item, self.timeout)) for completion, item in zip(completions, items)]
        results, failed = self._run(calls, self.timeout + 1.0, "reward_fn")
        for i, why in failed.items():
            results[i] = (0.0, f"{why}: scored 0, and the worker replaced")
        errors = [error for _, error in results if error]
        if errors and self.show_first_error:
            print(f"reward_fn failed; it scores 0, counted as reward_errors (shown once):\n{errors[0]}", flush=True)
            self.show_first_error = False
        return [value for value, _ in results], errors

    def score_samples(self, samples: list, items: list[dict], tokenizer, max_new_tokens: int, overlong_buffer: int):
        """The trainer's samples scored: each one's reward_fn score with its item, whether --max_new_tokens cut it off
        (its last token is no stop token), and its reward, the score shaped by overlong_penalty. Returns the samples,
        and why the failed calls failed."""
        stop_ids = stop_token_ids(tokenizer)
        completions = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scores, errors = self.score(completions, items)
        for s, score in zip(samples, scores):
            s.score = score
            s.truncated = not s.response_ids or s.response_ids[-1] not in stop_ids  # SGLang versions differ at the end
            s.reward = score + overlong_penalty(len(s.response_ids), max_new_tokens, overlong_buffer)
        return samples, errors

    def run_tools(self, codes: list[str]) -> list[str]:
        """What run_python of each code printed, the runs in parallel; a run whose worker failed says why."""
        outputs, failed = self._run([(run_python, (code,)) for code in codes], TOOL_TIMEOUT + 5.0, "tool")
        return [f"error: {failed[i]}" if i in failed else output for i, output in enumerate(outputs)]

    def _run(self, calls: list[tuple], seconds: float, what: str) -> tuple[list, dict[int, str]]:
        """Each (function, args) called in a free worker; the results in order, and why each call that has none failed:
        its worker died, or did not answer within `seconds` of being sent the call, sending and answering included
        (stuck where SIGALRM cannot reach, or stopped by SIGSTOP): then it is killed and replaced."""
        # Calls travel as pickle's bytes: SGLang patches multiprocessing's own pickling of tensors for CUDA IPC in
        # the trainer's process, after which it fails on a CPU tensor that a row may hold.
        waiting = [(i, pickle.dumps(call)) for i, call in enumerate(calls)][::-1]
        results, failed, busy = [None] * len(calls), {}, {}  # busy: worker index -> (call index, deadline)
        died = f"its {what} worker died"
        late = f"its {what} worker did not answer within {seconds:g} s (stuck where SIGALRM cannot reach, or stopped)"
        while waiting or busy:
            failures = {}  # worker index -> why its call failed
            for w in range(len(self.workers)):
                if w not in busy and waiting:
                    if not self.workers[w][0].is_alive():  # killed between calls
                        self._replace(w)
                    i, call = waiting.pop()
                    busy[w] = (i, time.monotonic() + seconds)
                    try:  # a stopped worker reads nothing: a call larger than the socket's buffer waits for it
                        _send(self.workers[w][1], call, busy[w][1])
                    except OSError as error:  # TimeoutError is one
                        failures[w] = late if isinstance(error, TimeoutError) else died
            answering = [w for w in busy if w not in failures]
            wait = max(0.0, min((busy[w][1] for w in answering), default=0.0) - time.monotonic())
            ready = multiprocessing.connection.wait([self.workers[w][1] for w in answering], wait)
            for w in answering:
                i, deadline = busy[w]
                if self.workers[w][1] in ready:
                    try:  # a worker stopped half-way through its answer sends the rest never
                        results[i] = pickle.loads(_receive(self.workers[w][1], deadline))
                        del busy[w]
                    except TimeoutError:
                        failures[w] = late
                    except (EOFError, OSError):  # the call ended its worker (os._exit), or something killed it
                        failures[w] = died
                elif time.monotonic() >= deadline:
                    failures[w] = late
            for w, failure in failures.items():
                failed[busy.pop(w)[0]] = f"{failure} (exit code {self._replace(w)})"
        return results, failed

    def close(self):
        """Every worker killed, with what its reward_fn started: never waits on a stuck call."""
        for process, connection in self.workers:
            self._stop(process, connection)
        self.workers = []
