"""The data stage: problems, datasets, tokenizers, prompt rendering, per-step sharding of prompts, and flags."""

import copy
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import string
from fractions import Fraction

import pytest
import torch
from transformers import AutoTokenizer

import checkpoint
import flags
import reward
import task_data
import train
from demo_model import demo_config, demo_tokenizer

# ---------------------------------------------------------------------------------------------------------------
# countdown


def parse(argv):
    """The Config that train.py's command line `argv` gives."""
    return flags.parse(train.Config, train.PRESETS, argv)


def solve_countdown(nums, target):
    """An expression using every number of `nums` once, equal to `target`, or None. Brute force over all binary
    expression trees: repeatedly replace two of the remaining values by one of their combinations, in exact
    Fractions, so every ordering and every bracketing is tried."""
    target = Fraction(target)

    def search(items):  # items: [(value, expression string)]
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            combos = [(a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"), (a * b, f"({ea} * {eb})")]
            if b != 0:
                combos.append((a / b, f"({ea} / {eb})"))
            for value, expr in combos:
                found = search(rest + [(value, expr)])
                if found is not None:
                    return found
        return None

    return search([(Fraction(n), str(n)) for n in nums])


def key(problem):
    return tuple(sorted(problem["nums"])), problem["target"]


def test_solver_finds_known_solution_and_rejects_unsolvable():
    expr = solve_countdown([3, 4, 5, 25], 83)
    assert expr is not None and eval(expr, {"__builtins__": {}}) == 83  # noqa: S307 -- the solver's own digits and ops
    assert solve_countdown([6, 4, 3], 8) is not None  # 6 / (3 / 4) needs a fraction in between
    assert solve_countdown([1, 1, 1], 100) is None


def test_countdown_problems_are_solvable_with_every_number_once():
    problems = reward.countdown_problems(200, 0, {})
    assert len(problems) == 200
    for p in problems:
        assert solve_countdown(p["nums"], p["target"]) is not None, p


def test_countdown_problems_have_three_or_four_numbers_in_range_and_integer_targets():
    problems = reward.countdown_problems(200, 0, {})
    assert {len(p["nums"]) for p in problems} == {3, 4}
    for p in problems:
        assert all(isinstance(n, int) and 1 <= n <= 99 for n in p["nums"]), p
        assert isinstance(p["target"], int) and 1 <= p["target"] <= 1000, p


def test_countdown_problems_are_distinct():
    problems = reward.countdown_problems(500, 0, {})
    assert len({key(p) for p in problems}) == 500


def test_countdown_problems_follow_the_seed():
    assert reward.countdown_problems(50, 3, {}) == reward.countdown_problems(50, 3, {})
    assert {key(p) for p in reward.countdown_problems(50, 3, {})} != {
        key(p) for p in reward.countdown_problems(50, 4, {})
    }


def test_countdown_solution_scores_one_through_reward():
    """Data and reward agree: a solution found independently of the generator earns the full reward."""
    cfg = train.Config(task="countdown", train_size=30, test_size=10, prompts_per_step=8)
    dataset = train.PromptDataset(cfg, "train")
    for i in range(len(dataset)):
        item = dataset[i]
        expr = solve_countdown(item["nums"], item["target"])
        completion = f"<think> search </think> <answer>{expr}</answer>"
        assert reward.countdown_reward(completion, item["nums"], item["target"]) == 1.0, (item, expr)
        assert reward.reward_fn(completion, item) == 1.0


def test_countdown_item_is_a_chat_prompt_naming_numbers_and_target():
    item = train.PromptDataset(train.Config(task="countdown", train_size=5, test_size=5), "test")[0]
    assert item["task"] == "countdown"
    [message] = item["prompt"]
    assert message["role"] == "user"
    assert str(item["nums"]) in message["content"] and f"equals {item['target']}" in message["content"]
    assert "<answer>" in message["content"]


def split_rows(split, **flags):
    """The rows of a split of PromptDataset under `flags` (train.Config's)."""
    return train.PromptDataset(train.Config(**flags), split).rows


def test_countdown_train_and_test_splits_are_disjoint_and_sized():
    cfg = train.Config(task="countdown", train_size=300, test_size=50)
    train_rows, test_rows = (
        split_rows(split, task="countdown", train_size=300, test_size=50) for split in ("train", "test")
    )
    assert len(train_rows) == 300 and len(test_rows) == 50
    assert len({key(p) for p in train_rows}) == 300 and len({key(p) for p in test_rows}) == 50
    assert not {key(p) for p in train_rows} & {key(p) for p in test_rows}
    assert len(train.PromptDataset(cfg, "train")) == 300 and len(train.PromptDataset(cfg, "test")) == 50


def test_countdown_test_split_does_not_depend_on_train_size():
    """The held-out set stays the same when only --train_size changes, so evaluations stay comparable."""
    small = split_rows("test", task="countdown", train_size=10, test_size=50, prompts_per_step=8)
    large = split_rows("test", task="countdown", train_size=400, test_size=50)
    assert small == large


def test_addition_splits_are_disjoint_and_each_item_is_graded_by_its_sum():
    cfg = train.Config(task="addition", train_size=700, test_size=200)
    train_set, test_set = train.PromptDataset(cfg, "train"), train.PromptDataset(cfg, "test")
    questions = [[row["question"] for row in split.rows] for split in (train_set, test_set)]
    assert len(set(questions[0])) == 700 and len(set(questions[1])) == 200 and not set(questions[0]) & set(questions[1])
    for item in list(test_set)[:20]:
        a, b = map(int, item["prompt"][0]["content"].split("?")[0].removeprefix("What is ").split(" + "))
        assert 1 <= a <= 30 and 1 <= b <= 30 and item["answer"] == str(a + b)  # --task_args max_operand's default
        assert reward.reward_fn(f"{a} + {b} = \\boxed{{{a + b}}}", item) == 1.0
        assert reward.reward_fn(f"{a} + {b} = \\boxed{{{a + b + 1}}}", item) == 0.0
    with pytest.raises(SystemExit, match="--train_size .* raise --task_args max_operand"):  # 30 x 30 exist
        split_rows("train", task="addition", train_size=800, test_size=200)
    wider = split_rows("train", task="addition", train_size=800, test_size=200, task_args="max_operand=40")
    assert len(wider) == 800 and any("40" in row["question"] for row in wider)


# ---------------------------------------------------------------------------------------------------------------
# gsm8k from a local file

GSM8K_ROWS = [
    {
        "question": "A farm has 1,000 hens and buys 234 more. How many hens does it have?",
        "answer": "It has 1000 + 234 = <<1000+234=1234>>1234 hens.\n#### 1,234",
    },
    {"question": "Tom has 3 apples and eats one. How many are left?", "answer": "3 - 1 = 2\n#### 2"},
]


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """Keep the `datasets` cache of local files inside the test's tmp_path."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def check_gsm8k_item(item):
    assert item["task"] == "gsm8k"
    assert item["answer"] == "1,234"
    [message] = item["prompt"]
    assert message["role"] == "user" and GSM8K_ROWS[0]["question"] in message["content"]
    assert reward.reward_fn("So the farm has \\boxed{1234} hens.", item) == 1.0
    assert reward.reward_fn("So the farm has \\boxed{1235} hens.", item) == 0.0


def jsonl_splits(folder, train_rows, test_rows):
    """A local dataset folder as users write one: train.jsonl and test.jsonl."""
    folder.mkdir()
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def test_gsm8k_from_a_local_folder_of_jsonl_splits(tmp_path, datasets_cache):
    folder = jsonl_splits(tmp_path / "gsm8k", GSM8K_ROWS, GSM8K_ROWS[1:])
    cfg = train.Config(task="gsm8k", data_path=folder, prompts_per_step=1)
    dataset = train.PromptDataset(cfg, "train")
    assert len(dataset) == 2
    check_gsm8k_item(dataset[0])
    assert dataset[1]["answer"] == "2"
    assert [row["answer"] for row in train.PromptDataset(cfg, "test")] == ["2"]


def test_gsm8k_from_a_local_folder_of_parquet_splits(tmp_path, datasets_cache):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS[1:]), folder / "test.parquet")
    dataset = train.PromptDataset(train.Config(task="gsm8k", data_path=str(folder), prompts_per_step=1), "train")
    assert len(dataset) == 2
    check_gsm8k_item(dataset[0])


def test_data_path_is_read_for_a_generated_task_too(tmp_path, datasets_cache):
    rows = [{"nums": [3, 5, 25], "target": 80}, {"nums": [2, 7], "target": 14}]
    folder = jsonl_splits(tmp_path / "countdown", rows, rows[1:])
    cfg = train.Config(task="countdown", data_path=folder, prompts_per_step=2)
    assert [(item["nums"], item["target"]) for item in train.PromptDataset(cfg, "train")] == [
        ([3, 5, 25], 80),
        ([2, 7], 14),
    ]
    assert [item["nums"] for item in train.PromptDataset(cfg, "test")] == [[2, 7]]
    no_path = split_rows("train", task="countdown", train_size=5, test_size=2, prompts_per_step=2)
    assert no_path == reward.countdown_problems(7, 0, {})[2:]


def test_any_task_name_parses_and_one_without_data_stops_naming_the_flag_and_the_tasks_with_data():
    assert parse(["--task", "mnist"]).task == "mnist"  # a user's own task: no fixed list of choices
    with pytest.raises(SystemExit, match="--task mnist: reward.py has no data for it .*countdown.*gsm8k"):
        split_rows("train", task="mnist")


MATH_ROWS = [
    {
        "problem": "What is $\\frac{2}{4}$ in lowest terms?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "Divide both by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$.",
    },
    {
        "problem": "Solve $x^2 = 2$ for $x > 0$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "Take the root: $x = \\boxed{\\sqrt{2}}$.",
    },
]


def test_math_from_a_local_folder_takes_the_last_boxed_answer_of_the_solution(tmp_path, datasets_cache):
    folder = jsonl_splits(tmp_path / "math", MATH_ROWS, MATH_ROWS[1:])
    cfg = train.Config(task="math", data_path=folder, prompts_per_step=2)
    first, second = train.PromptDataset(cfg, "train")
    assert (first["task"], first["answer"], second["answer"]) == ("math", "\\frac{1}{2}", "\\sqrt{2}")
    message = first["prompt"][0]
    assert message["role"] == "user" and MATH_ROWS[0]["problem"] in message["content"]
    assert "\\boxed" in message["content"]
    assert reward.reward_fn("so it is \\boxed{0.5}", first) == 1.0
    assert reward.reward_fn("so it is \\boxed{2^{1/2}}", second) == 1.0
    assert reward.reward_fn("so it is \\boxed{\\frac{1}{3}}", first) == 0.0
    assert [row["answer"] for row in train.PromptDataset(cfg, "test")] == ["\\sqrt{2}"]


# ---------------------------------------------------------------------------------------------------------------
# tokenizers and prompt rendering

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
MESSAGES = [{"role": "user", "content": "Using the numbers [3, 5, 25], create an equation that equals 80."}]


def test_qwen_tokenizer_fixture_is_the_qwen_bpe(qwen_tokenizer):
    tok = qwen_tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [ENDOFTEXT, IM_START, IM_END]
    assert len(tok) == 151646
    assert (tok.eos_token_id, tok.pad_token_id) == (IM_END, ENDOFTEXT)
    assert tok("Hello world", add_special_tokens=False).input_ids == [9707, 1879]  # as Qwen2.5's tokenizer.json
    assert tok("<|im_start|>user\n", add_special_tokens=False).input_ids == [IM_START, 872, 198]
    assert len(tok("12345", add_special_tokens=False).input_ids) == 5  # Qwen splits digits one at a time
    text = "Grüße, 世界! 3 * (4 + 5) = 27\n<answer> 1 </answer>"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_encode_prompt_with_chat_template_renders_chatml_and_generation_prompt(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = reward.encode_prompt(tok, MESSAGES)

    def enc(text):
        return tok(text, add_special_tokens=False).input_ids

    expected = (
        [IM_START] + enc("user\n" + MESSAGES[0]["content"]) + [IM_END] + enc("\n") + [IM_START] + enc("assistant\n")
    )
    assert ids == expected
    assert ids[0] == IM_START and ids[-3:] == enc("<|im_start|>assistant\n") == [IM_START, 77091, 198]


def test_encode_prompt_without_chat_template_renders_plain_template(qwen_tokenizer):
    base = copy.copy(qwen_tokenizer)
    base.chat_template = None
    ids = reward.encode_prompt(base, MESSAGES)
    assert IM_START not in ids and IM_END not in ids
    text = base.decode(ids)
    assert text == reward.PLAIN_TEMPLATE.format(question=MESSAGES[0]["content"])
    assert text.startswith("A conversation between User and Assistant.") and text.endswith("Assistant: <think>")
    assert MESSAGES[0]["content"] in text
    assert qwen_tokenizer.chat_template  # the shared fixture keeps its template


def test_plain_template_flag_renders_the_r1_zero_prompt_despite_a_chat_template(qwen_tokenizer):
    cfg = parse(["--plain_template", "true"])
    ids = reward.encode_prompt(qwen_tokenizer, MESSAGES, cfg.plain_template)
    assert qwen_tokenizer.chat_template and IM_START not in ids
    assert qwen_tokenizer.decode(ids) == reward.PLAIN_TEMPLATE.format(question=MESSAGES[0]["content"])
    assert IM_START in reward.encode_prompt(qwen_tokenizer, MESSAGES, parse([]).plain_template)


def test_encode_prompt_encodes_a_string_prompt_as_is(qwen_tokenizer):
    want = qwen_tokenizer("Say a:", add_special_tokens=False).input_ids
    assert reward.encode_prompt(qwen_tokenizer, "Say a:") == want
    assert qwen_tokenizer.decode(reward.encode_prompt(qwen_tokenizer, "Say a:")) == "Say a:"
    ids = reward.encode_prompt(demo_tokenizer(), "Say a:")
    assert len(ids) == 6 and demo_tokenizer().decode(ids) == "Say a:"  # a token per character


def test_stop_token_ids_of_qwen_are_im_end_and_endoftext(qwen_tokenizer):
    assert reward.stop_token_ids(qwen_tokenizer) == [ENDOFTEXT, IM_END]


def test_stop_token_ids_of_llama_3_are_those_its_config_ends_on():
    """Llama-3.1-Instruct ends on eot (its tokenizer's EOS), eom and end_of_text: its config's eos_token_id is
    [128001, 128008, 128009], at each of which SGLang stops; the trainer must stop (and see a stop) at each too."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {"a": 0, "<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eom_id|>": 128008, "<|eot_id|>": 128009}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(ids, unk_token="a"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert reward.stop_token_ids(tok) == [128001, 128008, 128009]


def test_a_qwen_tokenizer_saved_to_a_folder_loads_as_main_loads_it(qwen_tokenizer, tmp_path):
    qwen_tokenizer.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert reward.encode_prompt(tok, MESSAGES) == reward.encode_prompt(qwen_tokenizer, MESSAGES)
    assert reward.stop_token_ids(tok) == [ENDOFTEXT, IM_END]


PRINTABLE = "".join(sorted(set(string.printable) - set("\r\x0b\x0c")))


def test_char_tokenizer_round_trips_printable_text():
    tok = demo_tokenizer()
    for text in [PRINTABLE, "Say a: aaaa", "Hello , world ! it 's (3 + 4) * 5 = 35 .\n\tdon 't", "  two  spaces  "]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text)  # one id per character
        assert tok.decode(ids) == text


def test_char_tokenizer_eos_and_pad_are_single_ids():
    tok = demo_tokenizer()
    assert tok("<|im_end|>", add_special_tokens=False).input_ids == [tok.eos_token_id]
    assert tok("<|endoftext|>", add_special_tokens=False).input_ids == [tok.pad_token_id]
    assert tok.eos_token_id != tok.pad_token_id
    ids = tok("ab<|im_end|>", add_special_tokens=False).input_ids
    assert len(ids) == 3 and tok.decode(ids, skip_special_tokens=True) == "ab"


def test_char_tokenizer_im_start_is_a_single_id():
    tok = demo_tokenizer()
    assert tok("<|im_start|>", add_special_tokens=False).input_ids == [tok.get_vocab()["<|im_start|>"]]


def test_char_tokenizer_stop_ids_contain_eos():
    tok = demo_tokenizer()
    stops = reward.stop_token_ids(tok)
    assert tok.eos_token_id in stops
    assert stops == sorted({tok.get_vocab()["<|im_end|>"], tok.get_vocab()["<|endoftext|>"]})


def test_the_char_tokenizer_has_no_chat_template_so_chat_prompts_render_the_plain_template():
    tok = demo_tokenizer()
    assert not tok.chat_template
    ids = reward.encode_prompt(tok, MESSAGES)  # so chat prompts render the plain template
    assert tok.decode(ids) == reward.PLAIN_TEMPLATE.format(question=MESSAGES[0]["content"])


# ---------------------------------------------------------------------------------------------------------------
# step_items: which prompts each data-parallel rank gets at each step


def test_step_items_splits_a_step_disjointly_over_dp_ranks():
    cfg = train.Config(prompts_per_step=8, seed=0)
    dataset = list(range(40))
    for step in range(7):
        rank0, rank1 = (train.step_items(dataset, step, cfg, r, 2) for r in range(2))
        assert len(rank0) == len(rank1) == 4
        assert not set(rank0) & set(rank1)
        assert len(set(rank0) | set(rank1)) == 8


def test_step_items_is_deterministic():
    cfg = train.Config(prompts_per_step=8, seed=5)
    dataset = list(range(40))
    for step in (0, 3, 11):
        assert train.step_items(dataset, step, cfg, 1, 2) == train.step_items(dataset, step, cfg, 1, 2)


def test_step_items_never_repeats_a_row_within_an_epoch():
    cfg = train.Config(prompts_per_step=8, seed=0)
    dataset = list(range(43))  # 5 steps an epoch; 3 rows left over
    for epoch in range(2):
        seen = [
            row
            for step in range(5 * epoch, 5 * epoch + 5)
            for r in range(2)
            for row in train.step_items(dataset, step, cfg, r, 2)
        ]
        assert len(seen) == len(set(seen)) == 40
    assert train.step_items(dataset, 0, cfg, 0, 2) != train.step_items(dataset, 5, cfg, 0, 2)  # reshuffled


def test_dynamic_sampling_rounds_draw_other_prompts_the_same_way_every_time():
    cfg = train.Config(prompts_per_step=8, seed=0)
    dataset = list(range(400))
    first, again, extra = (train.step_items(dataset, 3, cfg, 1, 2, r) for r in (0, 0, 1))
    assert first == again and extra == train.step_items(dataset, 3, cfg, 1, 2, 1)
    assert extra != first and len(extra) == 4


def test_step_items_returns_dataset_items():
    cfg = train.Config(task="countdown", train_size=20, test_size=5, prompts_per_step=4)
    dataset = train.PromptDataset(cfg, "train")
    items = train.step_items(dataset, 0, cfg, 0, 2)
    assert len(items) == 2 and all(item["task"] == "countdown" and item["prompt"] for item in items)


def test_a_split_with_fewer_rows_than_prompts_per_step_names_the_flag():
    with pytest.raises(SystemExit, match="--prompts_per_step"):
        train.PromptDataset(train.Config(task="countdown", train_size=7, prompts_per_step=8), "train")


def test_an_item_without_a_reward_field_names_getitem_to_edit(tmp_path, datasets_cache):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    cfg = train.Config(task="gsm8k", data_path=str(tmp_path), prompts_per_step=1)

    class NoAnswer(train.PromptDataset):
        def __getitem__(self, i):
            return {k: v for k, v in super().__getitem__(i).items() if k != "answer"}

    with pytest.raises(SystemExit, match="'answer'.*PromptDataset.__getitem__"):
        NoAnswer(cfg, "train")


def test_data_files_that_cannot_be_read_or_rows_without_a_field_stop_in_one_line_naming_them(tmp_path, datasets_cache):
    """An empty file, a line that is not JSON, and rows without a field that __getitem__ reads (or null in it): one
    SystemExit each, naming --data_path or the row, where there were tracebacks from datasets or __getitem__."""
    good = {"question": "1 + 1?", "answer": "#### 2"}
    cases = {
        "empty": ("", "StopIteration"),
        "broken": (json.dumps(good) + '\n{"question": 1 +\n', "ValueError"),
        "no_field": (json.dumps({"problem": "1 + 1?", "answer": "#### 2"}) + "\n", "row 0 .*KeyError: 'question'"),
        "null": (json.dumps(good) + "\n" + json.dumps({"question": "2 + 2?"}) + "\n", "row 1 .*AttributeError"),
    }
    for name, (text, why) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text(text)
        cfg = train.Config(task="gsm8k", data_path=str(tmp_path / name), prompts_per_step=1)
        with pytest.raises(SystemExit, match=why) as stop:
            train.PromptDataset(cfg, "train")
        assert (str(tmp_path / name) if name in ("empty", "broken") else "check --data_path's rows") in str(stop.value)


# ---------------------------------------------------------------------------------------------------------------
# parse_config and check_config


def test_cpu_preset_sets_its_values_and_keeps_other_defaults():
    cfg = parse(["--preset", "cpu"])
    assert (cfg.model, cfg.task, cfg.steps, cfg.lr, cfg.prompts_per_step, cfg.group_size) == (
        "tiny",
        "toy",
        30,
        1e-2,
        8,
        8,
    )
    assert (cfg.max_new_tokens, cfg.warmup_steps, cfg.micro_batch_size, cfg.out_dir) == (16, 0, 32, "runs/cpu")
    assert (cfg.train_size, cfg.test_size) == (1000, 100)
    assert (cfg.clip_low, cfg.clip_high, cfg.tp, cfg.seed) == (0.2, 0.28, 1, 0)  # not in the preset: defaults
    flags.check_config(cfg, world=2)


def test_explicit_flag_wins_over_preset_in_either_order():
    assert parse(["--preset", "cpu", "--lr", "0.5"]).lr == 0.5
    assert parse(["--lr", "0.5", "--preset", "cpu"]).lr == 0.5
    assert parse(["--preset", "cpu", "--lr", "0.5"]).steps == 30


def test_no_flags_give_config_defaults_with_the_engine_chosen_by_the_machine():
    cfg = parse([])
    assert cfg == train.Config() and cfg.engine == ("sglang" if torch.cuda.is_available() else "hf")


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--prompts_per_setp", "4"], "unknown flag --prompts_per_setp: did you mean --prompts_per_step?"),
        (["--max_new_token=8"], "unknown flag --max_new_token=8: did you mean --max_new_tokens?"),
        (["--zzzz", "3"], "unknown flag --zzzz (python train.py --help lists the flags)"),
    ],
)
def test_a_mistyped_flag_is_one_line_naming_the_nearest_flag(flags, said, capsys):
    with pytest.raises(SystemExit, match=re.escape(said)):
        parse(flags)
    assert "usage:" not in capsys.readouterr().err  # not argparse's usage of every flag


@pytest.mark.parametrize(
    "changes, world, flag",
    [
        (dict(tp=2), 3, "--tp"),
        (dict(tp=2, prompts_per_step=6), 8, "--prompts_per_step"),  # dp = 4
        (dict(prompts_per_step=8, group_size=3, num_minibatches=5), 2, "--num_minibatches"),  # 12 samples a rank
        (dict(group_size=1), 1, "--group_size"),
        (dict(loss_agg="constant", beta=-0.1), 1, "--beta"),
        (dict(kl_in_reward=True), 1, "--kl_in_reward"),  # beta 0: nothing to subtract
        (dict(overlong_buffer=-1), 1, "--overlong_buffer"),
        (dict(overlong_buffer=2000, max_new_tokens=1024), 1, "--overlong_buffer"),
        (dict(dynamic_sampling_rounds=-2), 1, "--dynamic_sampling_rounds"),
        (dict(lr=-1e-6), 1, "--lr must be a number from 0 up"),
        (dict(steps=0), 1, "--steps must be a number from 1 up"),
        (dict(lr=math.nan), 1, "--lr must be a number from 0 up, not nan"),
        (dict(lr=math.inf), 1, "--lr .* not inf"),
        (dict(reward_timeout=math.inf), 1, "--reward_timeout"),
        (dict(max_grad_norm=math.nan), 1, "--max_grad_norm"),
        (dict(temperature=0.0), 1, "--temperature must be above 0: greedy samples are all alike"),
        (dict(temperature=-1.0), 1, "--temperature"),
        (dict(temperature=math.nan), 1, "--temperature"),
        (dict(clip_high=-0.5), 1, "--clip_high"),
        (dict(weight_decay=-1.0), 1, "--weight_decay"),
        (dict(bucket_mb=0), 1, "--bucket_mb"),
        (dict(model="runs/x", out_dir="runs/x/"), 1, "--out_dir must differ from"),
        (dict(reward_timeout=0), 1, "--reward_timeout"),
        (dict(keep_checkpoints=0), 1, "--keep_checkpoints"),
        (dict(sample_every=-1), 1, "--sample_every"),
        (dict(max_tokens_per_microbatch=-1), 1, "--max_tokens_per_microbatch"),
        (dict(is_mode="mask"), 1, "--tis_cap"),  # masking acts through the cap, which is 0
        (dict(is_level="sequence", tis_cap=0.5), 1, "--tis_cap"),
        (dict(top_p=0.0), 1, "--top_p must be above 0 and at most 1"),
        (dict(top_p=1.5), 1, "--top_p"),
        (dict(top_p=math.nan), 1, "--top_p"),
        (dict(top_k=-1), 1, "--top_k must be a number from 0 up"),  # 0 is off, not -1 as in SGLang
        (dict(top_k=513), 1, "--top_k 513 keeps more than the 512 tokens stored per sampled token"),
        (dict(mem_fraction=1.0), 1, "--mem_fraction is a share"),
        (dict(mem_fraction=0.0), 1, "--mem_fraction"),
        (dict(mem_fraction=math.nan), 1, "--mem_fraction"),
        (dict(objective="dppo_tv", dppo_tv_delta=-0.1), 1, "--dppo_tv_delta must be a number from 0 up"),
        (dict(objective="dppo_kl", dppo_kl_delta=math.nan), 1, "--dppo_kl_delta"),
        (dict(objective="dppo_kl", ratio_level="sequence"), 1, "--objective dppo_kl masks tokens .* --ratio_level"),
        (dict(std_of="batch", scale_std=False), 1, "--std_of batch is the std that --scale_std divides by"),
        (dict(advantage="rloo"), 1, "--advantage rloo is not divided by a std .* add --scale_std false"),
        (dict(objective="sapo", sapo_temperature_pos=0.0), 1, "--sapo_temperature_pos must be a number above 0"),
        (dict(sapo_temperature_neg=math.inf), 1, "--sapo_temperature_neg must be a number above 0, not inf"),
        (dict(reward_weights="format"), 1, "--reward_weights format: give name=number pairs separated by commas"),
        (dict(reward_weights="format=high"), 1, "--reward_weights format=high: give name=number pairs"),
        (dict(reward_weights="a=1,b=nan"), 1, "--reward_weights a=1,b=nan: each number must be finite"),
        (dict(group_size=1), 1, "--group_size must be a number from 2 up, not 1"),
        (dict(lora_alpha=0.0), 1, "--lora_alpha must be a number above 0, not 0.0"),
        (dict(partial_rollouts=True), 1, "--partial_rollouts trains tokens older policies sampled: add --tis_cap 2"),
        (dict(partial_rollouts=True, tis_cap=2.0, dynamic_sampling_rounds=1), 1, "drop --dynamic_sampling_rounds"),
        (dict(round_tokens=0), 1, "--round_tokens must be a number from 1 up"),
        (dict(max_staleness=0), 1, "--max_staleness must be a number from 1 up"),
        (dict(image_min_pixels=5000, image_max_pixels=4096), 1, "--image_min_pixels must be at most"),
        (dict(train_vision=True, lora_rank=8), 1, "--train_vision trains the whole tower, LoRA the adapters alone"),
    ],
)
def test_check_config_rejects_bad_flags_naming_the_flag(changes, world, flag):
    with pytest.raises(SystemExit, match=flag):
        flags.check_config(train.Config(**changes), world)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--loss_agg", "mean"),
        ("--kl_estimator", "k4"),
        ("--engine", "vllm"),
        ("--lr_schedule", "linear"),
        ("--preset", "gpu9000"),
    ],
)
def test_a_choice_outside_its_list_is_refused_naming_the_flag_and_the_choices(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        parse([flag, value])
    error = str(stop.value.code)
    assert f"argument {flag}" in error and f"invalid choice: '{value}'" in error and "choose from" in error
    assert "usage:" not in capsys.readouterr().err


def test_sglang_engine_on_a_machine_without_cuda_says_that_first(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no sglang either: CUDA is what to fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--engine sglang needs a CUDA GPU: use --engine hf here"):
        flags.check_config(train.Config(engine="sglang"), 1)


def test_sglang_engine_without_sglang_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # as where sglang is not installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as error:
        flags.check_config(train.Config(engine="sglang"), 1)
    assert "pip install -r requirements.txt" in str(error.value) and "--engine hf" in str(error.value)


def test_check_config_accepts_valid_configs():
    flags.check_config(train.Config(), world=1)
    flags.check_config(train.Config(tp=2), world=8)  # dp 4: 8 prompts, 64 samples a rank
    flags.check_config(train.Config(prompts_per_step=8, group_size=3, num_minibatches=4), world=2)
    flags.check_config(train.Config(objective="dppo_kl", std_of="batch", scale_std=True), world=2)
    flags.check_config(train.Config(advantage="rloo", scale_std=False, objective="sapo"), world=1)
    cfg = train.Config(reward_weights="correct=1, format=0.25,")  # spaces and a trailing comma are fine
    assert flags.named_numbers(flags.check_config(cfg, world=1), "reward_weights") == {"correct": 1.0, "format": 0.25}


def test_prompts_that_leave_no_room_for_max_new_tokens_stop_the_run_naming_the_flag_and_the_bound():
    tokenizer = demo_tokenizer()  # one token a character
    items = [{"prompt": "Say a:"}, {"prompt": [{"role": "user", "content": "x" * 40}]}]
    longest = max(len(reward.encode_prompt(tokenizer, item["prompt"])) for item in items)
    assert longest >= 40
    # SGLang 0.5.23 aborts a request (and fails its whole batch) whose input reaches the context - 6 (tp_worker:
    # max_req_input_len = context - 1 - 5); a tool turn's input is the prompt and up to --max_new_tokens - 1 tokens of
    # response. It also ends responses at the context - 2 tokens in all.
    context = demo_config().max_position_embeddings
    fits = context - 6 - longest
    checkpoint.load_tokenizer_and_config(train.Config(model="tiny", max_new_tokens=fits), items)  # fits exactly
    with pytest.raises(
        SystemExit,
        match=f"{longest} tokens\\) and --max_new_tokens {fits + 1} exceed the context length {context} less 6",
    ):
        checkpoint.load_tokenizer_and_config(train.Config(model="tiny", max_new_tokens=fits + 1), items)


def test_reference_answers_that_do_not_parse_are_none_and_counted_in_a_printed_warning(capsys):
    references = ["3 + 69 = 72\n#### 72", "#### 1,234.5", "#### seventy", ""]
    assert [reward.gsm8k_answer(r) for r in references] == ["72", "1,234.5", None, None]
    items = [{"prompt": "q", "task": "gsm8k", "answer": reward.gsm8k_answer(r)} for r in references]
    items.append({"prompt": "q", "task": "math", "answer": reward.last_boxed("no boxed answer")})  # None
    assert [reward.reward_fn("\\boxed{72}", item) for item in items] == [1.0, 0.0, 0.0, 0.0, 0.0]  # None: 0, no raise
    assert task_data.check_items(items, "train", reward.reward_fn) == ()  # reward_fn returns numbers: no named terms
    assert capsys.readouterr().out == (
        "warning: 3 of 5 train items have a reference answer that does not parse, so "
        "every reward on them is 0; the first is item 2\n"
    )
    task_data.check_items(items, "train", reward.reward_fn, warn=False)  # ranks but the first: silent
    task_data.check_items(items[:2], "train", reward.reward_fn)
    assert capsys.readouterr().out == ""


def test_a_reward_fn_that_fails_on_every_item_stops_the_run_in_one_line(monkeypatch, capsys):
    def broken(completion, item, args=None):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(reward, "reward_fn", broken)
    items = [{"prompt": "q", "task": "toy", "target": "a"}] * 100
    with pytest.raises(
        SystemExit,
        match=r"reward_fn fails on each of the first 64 train items \(ZeroDivisionError: "
        r"division by zero\): fix reward_fn in reward.py",
    ):
        task_data.check_items(items, "train", reward.reward_fn)
    calls = iter(range(1000))
    monkeypatch.setattr(
        reward, "reward_fn", lambda c, s, args=None: 1 / (next(calls) % 2)
    )  # fails on half: a model's fault
    # No SystemExit, and no warning: toy items have no reference answer.
    task_data.check_items(items, "train", reward.reward_fn)
    assert capsys.readouterr().out == ""


def fake_checkpoint(out_dir, step, **config_changes):
    """A checkpoint folder as find_resume reads it: trainer_state.json (the flags saved) and hf/config.json."""
    folder = out_dir / "checkpoints" / f"step_{step:06d}"
    demo_config(vocab_size=103).save_pretrained(folder / "hf")
    config = dataclasses.asdict(train.Config(out_dir=str(out_dir), **config_changes))
    (folder / "trainer_state.json").write_text(json.dumps(dict(step=step, wandb_id="w", config=config)))
    return str(folder)


def test_resuming_a_checkpoint_of_another_model_is_refused_before_loading(tmp_path):
    folder = fake_checkpoint(tmp_path, 4)
    cfg = train.Config(out_dir=str(tmp_path), resume="auto")
    assert checkpoint.find_resume(cfg, demo_config(vocab_size=103)) == (folder, 4, "w")
    bigger = demo_config(vocab_size=103, hidden_size=128)
    with pytest.raises(
        SystemExit, match=f"--resume {folder} is of another model \\(hidden_size 64, --model's 128\\): pass its --model"
    ):
        checkpoint.find_resume(cfg, bigger)


def test_a_run_that_would_overwrite_later_checkpoints_is_refused_and_changed_flags_are_named(tmp_path, capsys):
    """Going back to step 2 while step 4 is there would collide with its save, then --resume auto would pick the
    abandoned step 4; a fresh run would mix its checkpoints with them. A resume names the flags that changed."""
    model = demo_config(vocab_size=103)
    earlier, latest = fake_checkpoint(tmp_path, 2, lr=0.5), fake_checkpoint(tmp_path, 4, lr=0.5)
    for resume, step in ((earlier, 2), ("", 0)):
        refusal = f"--out_dir {tmp_path} holds checkpoints after step {step} ({latest}): --resume auto continues"
        with pytest.raises(SystemExit, match=re.escape(refusal + " the newest; else delete them, or use another")):
            checkpoint.find_resume(train.Config(out_dir=str(tmp_path), resume=resume, lr=0.5), model)
    assert checkpoint.find_resume(train.Config(out_dir=str(tmp_path), resume="auto", lr=0.5), model) == (latest, 4, "w")
    assert capsys.readouterr().out == ""  # the same flags: nothing to say
    cfg = train.Config(out_dir=str(tmp_path), resume="auto", lr=0.25, seed=3)
    assert checkpoint.find_resume(cfg, model) == (latest, 4, "w")
    assert (
        capsys.readouterr().out == f"resuming {latest} with flags changed since it was saved: --lr 0.5 -> 0.25, "
        "--seed 0 -> 3\n"
    )
    elsewhere = tmp_path / "elsewhere"  # an earlier checkpoint into an out_dir of its own: a branch, allowed
    assert checkpoint.find_resume(train.Config(out_dir=str(elsewhere), resume=earlier, lr=0.5), model)[:2] == (
        earlier,
        2,
    )


def test_a_token_budget_below_the_longest_sample_is_refused_naming_both_flags():
    items = [{"prompt": "Say a:" + "a" * 20, "task": "toy", "target": "a"}]  # 26 prompt tokens
    cfg = train.Config(model="tiny", max_new_tokens=16)
    for budget in (0, 42, 100):  # 0: fixed micro-batches
        checkpoint.load_tokenizer_and_config(dataclasses.replace(cfg, max_tokens_per_microbatch=budget), items)
    with pytest.raises(
        SystemExit,
        match=r"--max_tokens_per_microbatch 41 is below the longest sample: 26 prompt "
        r"tokens \+ --max_new_tokens 16",
    ):
        checkpoint.load_tokenizer_and_config(dataclasses.replace(cfg, max_tokens_per_microbatch=41), items)


@pytest.mark.parametrize("task", ["toy", "countdown"])
def test_the_python_tool_with_a_task_whose_prompts_do_not_offer_it_is_refused(task):
    cfg = train.Config(task=task, tool="python", train_size=64, test_size=8, prompts_per_step=8)
    with pytest.raises(SystemExit, match="--tool python: the train prompts do not offer the tool"):
        train.PromptDataset(cfg, "train")
    assert "```python" in str(train.PromptDataset(dataclasses.replace(cfg, task="addition"), "train")[0]["prompt"])


def test_resuming_a_checkpoint_already_at_steps_says_so(tmp_path):
    folder = fake_checkpoint(tmp_path, 4)
    for steps in (4, 3):
        with pytest.raises(
            SystemExit, match=f"--resume {re.escape(folder)} is at step 4, --steps {steps}: raise --steps to go on"
        ):
            checkpoint.find_resume(
                train.Config(out_dir=str(tmp_path), resume="auto", steps=steps), demo_config(vocab_size=103)
            )


# ---------------------------------------------------------------------------------------------------------------
# a task's options, a generated task's disjoint splits, and the notes said at start


def test_task_args_take_a_tasks_declared_keys_numbers_as_numbers_and_refuse_the_others():
    assert task_data.task_args("toy", "", reward.TASK_ARGS) == {"letter": "a"}  # TASK_ARGS' defaults
    assert task_data.task_args("toy", " letter = b ", reward.TASK_ARGS) == {"letter": "b"}
    assert task_data.task_args("addition", "max_operand=40", reward.TASK_ARGS) == {"max_operand": 40}
    assert isinstance(task_data.task_args("addition", "max_operand=40", reward.TASK_ARGS)["max_operand"], int)
    assert task_data.task_args("addition", "max_operand=2.5", reward.TASK_ARGS) == {"max_operand": 2.5}
    with pytest.raises(SystemExit, match=r"^--task_args colour: --task toy takes letter \(TASK_ARGS in reward.py\)$"):
        task_data.task_args("toy", "colour=red", reward.TASK_ARGS)
    with pytest.raises(SystemExit, match=r"^--task_args depth: --task countdown takes no options"):
        task_data.task_args("countdown", "depth=3", reward.TASK_ARGS)
    with pytest.raises(SystemExit, match="give key=value pairs separated by commas"):
        task_data.task_args("toy", "letter", reward.TASK_ARGS)
    cfg = train.Config(task="toy", task_args="letter=z", train_size=10, test_size=2, prompts_per_step=2)
    dataset = train.PromptDataset(cfg, "train")
    assert dataset.args == {"letter": "z"} and dataset[0]["prompt"] == "Say z:"


def test_a_generators_train_rows_whose_prompt_a_test_row_gives_are_left_out_and_said(monkeypatch, capsys):
    """A generator that draws the same problems again (7 letters for 40 rows): the test split is its first rows, and
    the train split keeps only the rows whose prompt no test row gives, whatever the generator drew."""
    # The demo's generator back after the test.
    monkeypatch.setitem(task_data.GENERATED, "toy", task_data.GENERATED["toy"])

    @task_data.generated("toy")  # the toy task's rows, now drawn with repeats and held out
    def repeating(n, seed, args):
        return [{"target": "abcdefg"[i % 7]} for i in range(n)]

    cfg = train.Config(task="toy", train_size=37, test_size=3, prompts_per_step=2)
    test_set, train_set = train.PromptDataset(cfg, "test"), train.PromptDataset(cfg, "train")
    assert [item["target"] for item in test_set] == ["a", "b", "c"]
    assert {item["target"] for item in train_set} == {"d", "e", "f", "g"} and len(train_set) == 37 - 15
    assert "note: 15 of the 37 train problems that --task toy generated ask what a test problem asks" in " ".join(
        capsys.readouterr().out.split()
    )


def test_start_notes_name_accuracy_counted_by_a_sum_of_terms_and_a_warm_up_of_half_the_run():
    def notes(terms=(), **changes):
        return flags.start_notes(train.Config(**changes), terms)

    assert notes() == [] and notes(("correct",)) == [] and notes(("correct", "format"), accuracy_term="correct") == []
    [accuracy] = notes(("correct", "format"), warmup_steps=0)
    assert "weighted sum of the terms correct, format" in accuracy and "--accuracy_term" in accuracy
    [warm_up] = notes(steps=8, warmup_steps=10)
    assert (
        warm_up
        == "note: --warmup_steps 10 keeps the learning rate below --lr for 8 of the 8 steps: lower it for a short run"
    )
    assert notes(steps=10, warmup_steps=6) != [] and notes(steps=10, warmup_steps=5) == []  # 5 of 10, 4 of 10
    assert notes(steps=200, warmup_steps=10) == []  # the defaults


def test_reward_workers_default_to_no_more_than_the_cpus_the_process_may_use():
    assert train.Config().reward_workers == min(4, len(os.sched_getaffinity(0)))
