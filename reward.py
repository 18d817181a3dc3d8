"""The task: its data, its prompts and its grader. This file is the task, and only the task.

A task is a --task name that two functions know, the two places to edit (README: your own task):
`PromptDataset.__getitem__` makes a row of data an item (the prompt, the task's name, and the fields the grader
reads), and `reward_fn(completion, item, args)` scores one sampled completion against its item. To add a task, write
a grader that takes the completion string plus the fields it needs and returns a float in [0, 1], then add a branch
to each of the two. Its rows come from --data_path, or from a generator registered where it is defined
(@generated("name")); its options, with their defaults, are its entry in TASK_ARGS (--task_args sets them).
Reading the rows, the options and checking the items before any model loads is task_data.py's machinery.

The contract: any string in, a float out (or a dict of named float terms, the same names for every completion and
item, the empty completion included: the trainer sums them, weighted by --reward_weights, and logs each), never
raises. Completions are hostile input (megabytes of text, 10,000 parentheses, `__import__('os')`), so nothing here
calls eval, and every scan is linear and capped. A reward_fn that breaks the contract anyway costs its sample (or
the term) a score of 0, not the run.

Importing this file never imports torch, and nothing in it starts a process, so it can be tested alone. The trainer
calls reward_fn in worker processes, each call with a deadline, and runs the model's Python tool code in a sandbox:
both live in sandbox.py, machinery that a researcher does not edit. Of the tool, what stays here is what the model
sees: the prompt that offers it and the format of its output.
"""

import functools
import logging
import operator
import random
import re
from fractions import Fraction

import task_data
from task_data import generated

# ----------------------------------------------------------------------------------------------------------------
# the two places to edit: what a prompt says (PromptDataset.__getitem__), and how a completion scores (reward_fn)


# The options each task takes, and their defaults. --task_args key=value,... sets them (a value that reads as a number
# is one); PromptDataset holds them as self.args, and a task's generator and reward_fn receive them.
TASK_ARGS = {"toy": {"letter": "a"}, "addition": {"max_operand": 30}, "colours": {"blank": 0}}


class PromptDataset:
    """Prompts of one task. Edit __getitem__ to change what a prompt says or to add a task (README: your own task)."""

    def __init__(self, cfg, split):
        self.task = cfg.task
        self.args = task_data.task_args(cfg.task, cfg.task_args, TASK_ARGS)
        self.boxed_prompt = TOOL_PROMPT if cfg.tool else BOXED_PROMPT
        self.rows = task_data.load_rows(self, split, cfg)
        least = cfg.prompts_per_step if split == "train" else 1  # a step's prompts; an evaluation's
        # The names of reward_fn's terms, when it returns a dict of them (README: reward terms).
        self.reward_terms = task_data.check_items(self, split, reward_fn, least, tool=cfg.tool, args=self.args)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        """An item: {"prompt": chat messages, or a string used as is; "task"; and the fields reward_fn reads}."""
        row = self.rows[i]
        task = self.task
        if task == "toy":  # the row is {"target": --task_args letter}
            return {"prompt": f"Say {row['target']}:", "task": task, "target": row["target"]}
        if task == "colours":  # the row is {"image": a square of one colour, "colour": its letter, r, g or b}
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COLOURS_PROMPT}]}]
            return {"prompt": prompt, "images": [row["image"]], "task": task, "target": row["colour"]}
        if task == "countdown":  # the row is {"nums", "target"}
            return {"prompt": [{"role": "user", "content": COUNTDOWN_PROMPT.format(**row)}], "task": task, **row}
        if task in ("gsm8k", "addition"):  # addition's rows are generated in gsm8k's format
            question = row["question"]
            answer = gsm8k_answer(row["answer"])
        elif task == "math":  # the answer is the last \boxed{} of the reference solution, in LaTeX
            question = row["problem"]
            answer = last_boxed(row["solution"])
        else:
            raise SystemExit(
                f"--task {task}: PromptDataset.__getitem__ in reward.py has no branch for it: add one, "
                "and one to reward_fn (README: your own task)"
            )
        prompt = [{"role": "user", "content": self.boxed_prompt.format(question=question)}]
        return {"prompt": prompt, "task": task, "answer": answer}


def reward_fn(completion: str, item: dict, args: dict | None = None) -> float | dict[str, float]:
    """Called by the trainer for every completion; `item` is the dataset's item, `args` the task's options (its
    TASK_ARGS, with --task_args). Edit here to add a task, or return {"name": value, ...} for reward terms, each
    logged as reward/<name> (README: where to edit)."""
    task = item["task"]
    if task == "countdown":
        return countdown_reward(completion, item["nums"], item["target"])
    if task in ("gsm8k", "addition"):
        return gsm8k_reward(completion, item["answer"])
    if task == "math":
        return math_reward(completion, item["answer"])
    if task == "toy":
        return toy_reward(completion, item["target"])
    if task == "colours":  # the share of the completion that is the colour's letter, as in toy
        return toy_reward(completion, item["target"])
    raise ValueError(f"unknown task {task!r}: add a branch for it to reward_fn in reward.py (README: your own task)")


# ----------------------------------------------------------------------------------------------------------------
# the graders and the problems they grade

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

COUNTDOWN_PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number must be used exactly once. Show your work in "
    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>."
)
# Reward for a parsable countdown expression that is wrong (wrong value or wrong numbers). It is small so it
# teaches the answer format early without competing with the 1.0 for a correct answer (as in TinyZero).
FORMAT_SCORE = 0.1

_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


@generated("countdown")
def countdown_problems(n: int, seed: int, args: dict) -> list[dict]:
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
        value = _OPERATIONS[tokens[pos]](value, rhs)
        pos = nxt
    return value, pos


def _term(tokens: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    value, pos = _factor(tokens, pos, depth)
    while pos < len(tokens) and tokens[pos] in "*/":
        rhs, nxt = _factor(tokens, pos + 1, depth)
        value = _OPERATIONS[tokens[pos]](value, rhs)  # x/0 raises ZeroDivisionError
        pos = nxt
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
    expr = completion[start + len("<answer>") : end]
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


def _to_number(text: str) -> Fraction | None:
    """'$1,234.00 ', '\\$1{,}234', '1234 \\text{ apples}', 'x = 1234\\%' -> Fraction(1234): what follows the last "=",
    with LaTeX's dollars, percent, thousands separators and the units or words after the number dropped; None if no
    plain decimal number remains."""
    text = text[:MAX_BOXED_CHARS].rpartition("=")[2]
    text = _NOT_THE_NUMBER.sub("", _LATEX_TEXT.sub(r"\1", text))
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
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def _final_answer(completion: str) -> str:
    """The last \\boxed{...}, else the first number after the last ####, else the last number in the text."""
    boxed = last_boxed(completion[-TAIL_CHARS:])
    if boxed is not None:
        return boxed
    hashes = completion.rfind("####")
    if hashes >= 0:
        match = _NUMBER.search(completion[hashes + 4 : hashes + 200].replace(",", "").replace("$", ""))
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
    if answer is None or predicted is None:
        return 0.0
    return 1.0 if predicted == _to_number(answer) else 0.0


# ----------------------------------------------------------------------------------------------------------------
# addition: "What is a + b?", generated here and graded as gsm8k; small enough for a real model on a CPU


@generated("addition")
def addition_problems(n: int, seed: int, args: dict) -> list[dict]:
    """n distinct additions in gsm8k's row format: {"question": "What is a + b?", "answer": "#### a+b"}, a and b
    in 1..--task_args max_operand."""
    largest = args["max_operand"]
    pairs = [(a, b) for a in range(1, largest + 1) for b in range(1, largest + 1)]
    if n > len(pairs):
        raise SystemExit(
            f"--train_size + --test_size = {n}, but only {len(pairs)} distinct additions of 1..{largest} exist: "
            "lower them, or raise --task_args max_operand"
        )
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
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=1)
    predicted = parse(f"\\boxed{{{boxed}}}", parsing_timeout=1)
    return 1.0 if verify(gold, predicted, timeout_seconds=1) else 0.0


# ----------------------------------------------------------------------------------------------------------------
# toy: the CPU demo's task, and shaping by length


@generated("toy", held_out=False)
def toy_problems(n: int, seed: int, args: dict) -> list[dict]:
    """The CPU demo's task: n times "say a", or --task_args letter's (toy_reward)."""
    return [{"target": args["letter"]}] * n


def toy_reward(completion: str, target: str) -> float:
    """Fraction of the (whitespace-stripped) completion's characters equal to the one-character `target`.
    A dense, easy signal: a random tiny model learns to emit only `target` within a minute on CPU."""
    text = completion.strip()
    return text.count(target) / len(text) if text else 0.0


# ----------------------------------------------------------------------------------------------------------------
# colours: the colour of a square on a grey ground, which only the image tells (a tiny vision-language model's task)

COLOURS_PROMPT = "Colour:"  # the same text for every item: the answer is in the image alone
COLOURS = {"r": (210, 40, 40), "g": (40, 180, 60), "b": (50, 70, 220)}


@generated("colours")
def colour_problems(n: int, seed: int, args: dict) -> list[dict]:
    """n images of 32 x 32 pixels: a square of a colour, its side and place drawn at random, on a grey ground; its
    letter the answer. --task_args blank=1 draws each square in a grey of its own: the control, whose images say
    nothing of the answer."""
    from PIL import Image, ImageDraw  # Pillow: only an image task needs it

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour = rng.choice("rgb")
        side = rng.randint(12, 28)
        x, y = rng.randint(0, 32 - side), rng.randint(0, 32 - side)
        image = Image.new("RGB", (32, 32), (128, 128, 128))
        grey = rng.randint(80, 176)
        fill = (grey, grey, grey) if args["blank"] else COLOURS[colour]
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=fill)
        rows.append({"image": image, "colour": colour})
    return rows


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward of a `length`-token response:
    0 up to max_length - buffer tokens, then falling linearly to -1 at max_length, and -1 beyond."""
    if buffer <= 0:
        return 0.0
    return max(-1.0, min(0.0, (max_length - buffer - length) / buffer))


# ----------------------------------------------------------------------------------------------------------------
# prompt templates: a prompt's tokens, and the tokens that end a response

# The R1-Zero template, for base models: used when the tokenizer has no chat template, or with --plain_template.
PLAIN_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user "
    "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>. User: {question} Assistant: <think>"
)


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


# ----------------------------------------------------------------------------------------------------------------
# the Python tool as the model sees it (--tool python): the model writes a ```python block, generation stops at its
# end, the block runs (sandbox.run_python, in the workers), and its output is appended as an ```output block (ToRL's
# format); the model then goes on

# Qwen2.5-Math's tool-integrated reasoning instruction, and how the tool answers.
TOOL_PROMPT = (
    "{question}\nPlease integrate natural language reasoning with programs to solve the problem above, and "
    "put your final answer within \\boxed{{}}. Each ```python block you write is run, and what it prints is "
    "shown to you in an ```output block."
)


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
    block = f"```output\n{output.rstrip()}\n```\n"
    if response.endswith("\n"):
        return block
    return "\n" + block


def tool_failure(output: str) -> str | None:
    """How a run failed: "timeout" when it was cut off, "error" (a traceback, an `...Error:` line), else None."""
    if "\n[timed out after " in output[-100:]:
        return "timeout"
    return "error" if re.search(r"^(Traceback \(most recent call last\)|\w*Error: |error: )", output, re.M) else None
