"""A task's data, for reward.py: its options (--task_args), its rows (generated, downloaded or read from
--data_path), and its items checked before any model loads.

reward.py holds the task: PromptDataset, whose __init__ calls task_args, load_rows and check_items here, and
reward_fn; a generator there registers itself with @generated. This is machinery a researcher rarely edits: like
reward.py, it imports no torch and starts no process.
"""

import copy
import glob
import os

# ----------------------------------------------------------------------------------------------------------------
# a generated task's rows: its generator, in reward.py, registers itself where it is defined

GENERATED = {}  # task: (its generator, whether its test split is held out)


def generated(task: str, held_out: bool = True):
    """Makes the decorated function, (n, seed, args) -> n rows, --task `task`'s data when no --data_path is given. Its
    first --test_size rows are the test split and the rest the train split, less the rows whose prompt the test split
    asks too (load_rows), so that the splits are disjoint whatever it draws. held_out=False: the same prompts in both
    splits (the toy task's one prompt)."""

    def register(generator):
        GENERATED[task] = (generator, held_out)
        return generator

    return register


# ----------------------------------------------------------------------------------------------------------------
# a task's options, and its rows: generated, downloaded or read from --data_path

DATASETS = {"gsm8k": "openai/gsm8k", "math": "DigitalLearningGmbH/MATH-lighteval"}  # --data_path "" reads these
FIRST_RANK = os.environ.get("RANK", "0") == "0"  # what is said at start, rank 0 says once


def task_args(task: str, text: str, options: dict) -> dict:
    """The task's options: `options` (reward.TASK_ARGS), with --task_args `text` ("key=value,...") over the entry of
    --task `task`, a value that reads as a number a number. A key the task does not take stops the run, naming
    those it takes."""
    args = dict(options.get(task, {}))
    for pair in filter(None, text.split(",")):
        key, equals, value = (part.strip() for part in pair.partition("="))
        if not equals:
            raise SystemExit(f"--task_args {text}: give key=value pairs separated by commas, as letter=b")
        if key not in args:
            takes = f"takes {', '.join(args)}" if args else "takes no options"
            raise SystemExit(f"--task_args {key}: --task {task} {takes} (TASK_ARGS in reward.py)")
        args[key] = _number_or_text(value)
    return args


def _number_or_text(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def load_rows(dataset, split: str, cfg) -> list[dict]:
    """The raw rows of one split of `dataset` (a PromptDataset): from --data_path (a local folder of train.* and
    test.* splits, jsonl or parquet, or a hub id) when given; else from the task's generator (@generated: the test
    split first, then the train split less the rows whose prompt the test split asks too); else from the task's hub
    dataset (DATASETS)."""
    task, data_path = cfg.task, cfg.data_path
    if not data_path and task in GENERATED:
        generator, held_out = GENERATED[task]
        rows = generator(cfg.test_size + cfg.train_size, cfg.seed, dataset.args)
        test, train = rows[: cfg.test_size], rows[cfg.test_size :]
        if split == "test":
            return test
        if not held_out:
            return train
        asked = set(prompts_of(dataset, test))
        kept = [row for row, prompt in zip(train, prompts_of(dataset, train)) if prompt is None or prompt not in asked]
        if len(kept) < len(train) and FIRST_RANK:
            print(
                f"note: {len(train) - len(kept)} of the {len(train)} train problems that --task {task} generated ask "
                "what a test problem asks: they are left out, so that the splits stay disjoint",
                flush=True,
            )
        return kept
    if not data_path and task not in DATASETS:
        raise SystemExit(
            f"--task {task}: reward.py has no data for it (it generates {', '.join(GENERATED)} and "
            f"downloads {', '.join(DATASETS)}); for your own task give --data_path a folder of "
            "train.jsonl and test.jsonl, or a generator (README: your own task)"
        )
    import datasets  # only data that is read needs it

    path = data_path or DATASETS[task]  # a local folder: datasets reads the splits from the file names
    arguments = dict(path=path, name="main" if path == DATASETS["gsm8k"] else None)
    if os.path.isdir(path):  # the split's jsonl or parquet files: images beside them, datasets would read alone
        for builder, suffix in (("json", "jsonl"), ("parquet", "parquet")):
            files = sorted(glob.glob(os.path.join(path, "**", f"{split}*.{suffix}"), recursive=True))
            if files:
                arguments = dict(path=builder, data_files={split: files})
                break
    try:
        return list(datasets.load_dataset(**arguments, split=split))
    except Exception as error:  # no such split, folder or dataset; an empty or malformed file; a failed download
        cause = error.__cause__ or error  # datasets wraps what its reader met
        first_line = (str(cause).splitlines() or [""])[0][:200]
        raise SystemExit(
            f"--data_path {path}: no readable {split} split ({type(cause).__name__}: {first_line}): give a folder "
            f"with {split}.jsonl (a JSON object a line) or {split}.parquet"
        ) from None


def prompts_of(dataset, rows: list[dict]) -> list[str | None]:
    """The prompt that dataset's __getitem__ makes of each row, as text, with its images' pixels (a task whose text
    is the same for every item asks what its image shows); None where it fails (check_items names it)."""
    view = copy.copy(dataset)
    view.rows = rows
    prompts = []
    for i in range(len(rows)):
        try:
            item = view[i]
            images = [image.tobytes() if hasattr(image, "tobytes") else image for image in item.get("images", [])]
            prompts.append(repr(item["prompt"]) + repr(images))
        except Exception:
            prompts.append(None)
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# the items, checked before any model loads


def check_items(
    dataset,
    split: str,
    reward_fn,
    least: int = 1,
    warn: bool = FIRST_RANK,
    tried: int = 64,
    tool: str = "",
    args: dict | None = None,
) -> tuple:
    """Before any model is loaded, the items of `dataset` (a PromptDataset, or a list), each scored by `reward_fn`
    (reward.reward_fn, given `args`, the task's options) on the empty completion: stop with one line when a row
    cannot be made an item, there are fewer than `least` items, they lack a field the prompt or reward_fn reads,
    reward_fn raises on each of the first `tried`, returns a number for some and a dict for others, or (with `tool`)
    the prompts never offer the tool; with `warn` (rank 0), print how many items have a reference answer that does
    not parse (their "answer" is None: every reward on them is 0). Returns the names of the terms that reward_fn
    returns on the first `tried` items, in the order they first come: () when it returns a number."""
    items = []
    for i in range(len(dataset)):
        try:
            items.append(dataset[i])
        except Exception as error:  # a row without a field that __getitem__ reads, or with None where it reads text
            raise SystemExit(
                f"{split} row {i} (from 0) cannot be made an item ({type(error).__name__}: {error}): "
                "PromptDataset.__getitem__ in reward.py reads a field that it lacks or holds null: check "
                "--data_path's rows, or __getitem__"
            ) from None
    if len(items) < least:
        raise SystemExit(
            f"the {split} split has {len(items)} rows, fewer than {least} (--prompts_per_step for train): "
            "check --task, --data_path, --train_size, --test_size (or --eval_every 0)"
        )
    errors = []
    returned = []
    for item in items[:tried]:
        try:
            _ = item["prompt"]
            returned.append(reward_fn("", item, args))
        except KeyError as missing:
            raise SystemExit(
                f"{split} items lack the field {missing} that the prompt or reward_fn reads: "
                "return it from PromptDataset.__getitem__ in reward.py"
            ) from None
        except Exception as error:
            errors.append(error)
    if errors and len(errors) == len(items[:tried]):
        raise SystemExit(
            f"reward_fn fails on each of the first {len(errors)} {split} items "
            f"({type(errors[0]).__name__}: {errors[0]}): fix reward_fn in reward.py"
        )
    if tool and "```python" not in str(items[0]["prompt"]):  # nothing would tell the model how to run code
        raise SystemExit(
            f"--tool {tool}: the {split} prompts do not offer the tool (no ```python in them): use a task "
            "whose prompts do (gsm8k, math, addition) or add the offer to yours (docs/python-tool.md)"
        )
    terms = [name for value in returned if isinstance(value, dict) for name in value]
    if terms and any(isinstance(value, (int, float)) for value in returned):
        raise SystemExit(
            f"reward_fn returns a dict of terms ({terms[0]!r}, ...) for some {split} items and a number for others: "
            "return one kind (README: reward terms)"
        )
    unnamed = [name for name in terms if not isinstance(name, str) or "/" in name]
    if unnamed:
        raise SystemExit(f"reward_fn returns a term named {unnamed[0]!r}: name each term with a string, no /")
    if any(value == {} for value in returned):  # the run's terms are those it returns here
        raise SystemExit("reward_fn returns an empty dict for an empty completion: return every term, 0 if it is off")
    bad = [i for i, item in enumerate(items) if "answer" in item and item["answer"] is None]
    if bad and warn:
        print(
            f"warning: {len(bad)} of {len(items)} {split} items have a reference answer that does not parse, so "
            f"every reward on them is 0; the first is item {bad[0]}",
            flush=True,
        )
    return tuple(dict.fromkeys(terms))
