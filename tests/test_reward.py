import os
import random
import subprocess
import sys
import time

import pytest

from reward import (
    FORMAT_SCORE,
    countdown_reward,
    gsm8k_reward,
    last_boxed,
    math_reward,
    overlong_penalty,
    reward_fn,
    toy_reward,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answer(expr):
    return f"Let me think. <answer>{expr}</answer>"


# ---------------------------------------------------------------------------------------------------------------
# countdown


def test_countdown_correct_expression_using_every_number_scores_one():
    assert countdown_reward(answer("(25 - 5) * 4 + 3"), [3, 4, 5, 25], 83) == 1.0
    assert countdown_reward(answer("3+4*5+25"), [25, 5, 4, 3], 48) == 1.0


def test_countdown_exact_fraction_division():
    # 6 / (3/4) = 8 exactly; a float evaluator would also get this, 1/3 * 3 below it would not
    assert countdown_reward(answer("6 / (3 / 4)"), [6, 4, 3], 8) == 1.0
    assert countdown_reward(answer("(1 / 3) * 3 * 7"), [1, 3, 3, 7], 7) == 1.0


def test_countdown_right_value_with_wrong_numbers_gets_format_score():
    assert countdown_reward(answer("5 + 5"), [5, 6], 10) == FORMAT_SCORE  # reuses 5
    assert countdown_reward(answer("4 + 6"), [4, 6, 1], 10) == FORMAT_SCORE  # misses 1
    assert countdown_reward(answer("4 + 6 * 1"), [4, 6], 10) == FORMAT_SCORE  # extra 1


def test_countdown_wrong_value_gets_format_score():
    assert FORMAT_SCORE == 0.1
    assert countdown_reward(answer("3 + 4"), [3, 4], 8) == FORMAT_SCORE


def test_countdown_division_by_zero_scores_zero():
    assert countdown_reward(answer("3 / (4 - 4)"), [3, 4, 4], 1) == 0.0


@pytest.mark.parametrize(
    "expr",
    [
        "2 ** 3",  # power
        "-3 + 11",  # unary minus
        "1.5 * 2",  # decimal
        "abs(3)",  # function call
        "x + 3",  # letters
        "__import__('os').system('true')",
        "3 +",
        "(3 + 5",
        "3 + 5)",
        "()",
        "",
        "3 5",
        "3 // 5",
    ],
)
def test_countdown_malformed_expression_scores_zero(expr):
    assert countdown_reward(answer(expr), [3, 5, 8], 8) == 0.0


def test_countdown_without_answer_tag_scores_zero():
    assert countdown_reward("3 + 5 = 8", [3, 5], 8) == 0.0
    assert countdown_reward("<answer>3 + 5", [3, 5], 8) == 0.0
    assert countdown_reward("3 + 5</answer>", [3, 5], 8) == 0.0
    assert countdown_reward("", [3, 5], 8) == 0.0


def test_countdown_last_answer_tag_wins():
    assert countdown_reward(answer("3 * 5") + answer("3 + 5"), [3, 5], 8) == 1.0
    assert countdown_reward(answer("3 + 5") + answer("3 * 5"), [3, 5], 8) == FORMAT_SCORE


def test_countdown_rejects_deep_nesting_and_huge_literals():
    assert countdown_reward(answer("(" * 10_000 + "3 + 5" + ")" * 10_000), [3, 5], 8) == 0.0
    assert countdown_reward(answer("(" * 40 + "3 + 5" + ")" * 40), [3, 5], 8) == 0.0
    assert countdown_reward(answer("(((3 + 5)))"), [3, 5], 8) == 1.0
    big = "9" * 100
    assert countdown_reward(answer(f"{big} - {big} + 8"), [int(big), int(big), 8], 8) == 0.0
    assert countdown_reward(answer("999999 - 999991"), [999999, 999991], 8) == 1.0


def test_countdown_returns_quickly_on_megabyte_strings():
    hostile = [
        "<answer>" * 500_000,  # many unclosed tags: quadratic for a non-greedy regex
        "<answer>" + "(" * 2_000_000 + "</answer>",
        "x" * 5_000_000 + answer("3 + 5"),
        "<answer>" + "1+" * 1_000_000 + "1</answer>",
    ]
    expected = [0.0, 0.0, 1.0, 0.0]
    start = time.perf_counter()
    scores = [countdown_reward(text, [3, 5], 8) for text in hostile]
    assert time.perf_counter() - start < 1.0
    assert scores == expected


# ---------------------------------------------------------------------------------------------------------------
# gsm8k


def test_gsm8k_boxed_answer():
    assert gsm8k_reward("so the total is \\boxed{72}.", "72") == 1.0
    assert gsm8k_reward("\\boxed{70} no wait \\boxed{72}", "72") == 1.0
    assert gsm8k_reward("\\boxed{72} no wait \\boxed{70}", "72") == 0.0


def test_gsm8k_boxed_wins_over_hashes_and_last_number():
    assert gsm8k_reward("#### 5\n\\boxed{72} and 9 more", "72") == 1.0


def test_gsm8k_nested_braces_in_boxed_do_not_crash():
    assert gsm8k_reward("\\boxed{\\frac{1}{2}}", "0.5") == 0.0
    assert gsm8k_reward("\\boxed{\\frac{1}{2}", "2") == 1.0  # unclosed: falls back to the last number


def test_gsm8k_hashes_answer():
    assert gsm8k_reward("3 + 4 = 7 apples\n#### 7", "7") == 1.0
    assert gsm8k_reward("#### 7 apples, not 9", "7") == 1.0
    assert gsm8k_reward("#### 6\n#### 7", "7") == 1.0
    assert gsm8k_reward("#### no number here", "7") == 0.0


def test_gsm8k_last_number():
    assert gsm8k_reward("She has 3 cats and 4 dogs, so 7 pets.", "7") == 1.0
    assert gsm8k_reward("She has 3 cats and 4 dogs, so 7 pets.", "4") == 0.0
    assert gsm8k_reward("pages 10-12", "12") == 1.0  # a hyphen between numbers is not a minus sign


def test_gsm8k_normalises_commas_dollars_and_trailing_zeros():
    assert gsm8k_reward("It costs $1,234.00.", "1234") == 1.0
    assert gsm8k_reward("#### $1,234", "1,234") == 1.0
    assert gsm8k_reward("\\boxed{ 18.0 }", "18") == 1.0
    assert gsm8k_reward("\\boxed{18.}", " 18 ") == 1.0


def test_gsm8k_reads_latex_dollars_percent_thousands_units_and_an_equation():
    """How models box a number in LaTeX: each is the answer, and scored as such."""
    for boxed in (
        "\\$18",
        "18\\%",
        "18%",
        "18 \\text{ apples}",
        "18 dollars",
        "\\text{18}",
        "18^\\circ",
        "x = 18",
        "\\$18.00",
        "\\mathrm{18}\\,",
    ):
        assert gsm8k_reward(f"so \\boxed{{{boxed}}}", "18") == 1.0, boxed
    assert gsm8k_reward("\\boxed{\\$1{,}234}", "1234") == 1.0
    for wrong in ("18 - 2", "18 apples and 3 pears", "x", "\\frac{36}{2}"):
        assert gsm8k_reward(f"\\boxed{{{wrong}}}", "18") == 0.0, wrong
    assert gsm8k_reward("\\boxed{" + "a " * 10 + "18}", "18") == 0.0  # words before it: not an answer


def test_gsm8k_negatives_and_decimals():
    assert gsm8k_reward("The change is -5.", "-5") == 1.0
    assert gsm8k_reward("The change is -5.", "5") == 0.0
    assert gsm8k_reward("#### -$3.50", "-3.5") == 1.0
    assert gsm8k_reward("\\boxed{0.25}", ".25") == 0.0  # a bare ".25" ground truth is not a plain number
    assert gsm8k_reward("\\boxed{0.25}", "0.250") == 1.0
    assert gsm8k_reward("\\boxed{0.3}", "0.30000001") == 0.0


def test_gsm8k_wrong_or_missing_answer_scores_zero():
    assert gsm8k_reward("#### 8", "7") == 0.0
    assert gsm8k_reward("I do not know.", "7") == 0.0
    assert gsm8k_reward("", "7") == 0.0


def test_gsm8k_hostile_strings():
    assert gsm8k_reward("\\boxed{1e999999999}", "1") == 0.0  # Fraction would build 10**999999999
    assert gsm8k_reward("\\boxed{1/2}", "0.5") == 0.0
    assert gsm8k_reward("\\boxed{__import__('os')}", "0") == 0.0
    assert gsm8k_reward("9" * 10_000, "9" * 10_000) == 0.0
    assert gsm8k_reward("\\boxed{" * 100_000, "7") == 0.0
    start = time.perf_counter()
    scores = [
        gsm8k_reward("1 " * 2_500_000 + "7", "7"),
        gsm8k_reward("\\boxed{" + "{" * 5_000_000, "7"),
        gsm8k_reward("####" * 1_000_000 + " 7", "7"),
        gsm8k_reward("-" * 5_000_000 + " 7", "7"),
    ]
    assert time.perf_counter() - start < 1.0
    assert scores == [1.0, 0.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# math: LaTeX answers judged by math-verify


@pytest.mark.parametrize(
    "predicted, answer",
    [
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("0.5", "\\frac12"),
        ("\\dfrac{2}{4}", "\\frac{1}{2}"),
        ("\\sqrt 2", "\\sqrt{2}"),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("(-\\infty, 3]", "(-\\infty,3]"),
        ("[0, 1) \\cup (2, 5]", "[0,1)\\cup(2,5]"),
        ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}"),
        ("x = 4", "4"),
        ("\\pi/2", "\\frac{\\pi}{2}"),
        ("-7", "-7"),
    ],
)
def test_math_answers_that_are_equal_as_mathematics_score_one(predicted, answer):
    assert math_reward(f"Work... so the answer is \\boxed{{{predicted}}}.", answer) == 1.0


@pytest.mark.parametrize(
    "predicted, answer",
    [
        ("\\frac{1}{3}", "\\frac{1}{2}"),
        ("\\sqrt{3}", "\\sqrt{2}"),
        ("(-\\infty, 3)", "(-\\infty, 3]"),
        ("[0, 1]", "(0, 1)"),
        ("\\{1, 2\\}", "\\{1, 2, 3\\}"),
        ("5", "-5"),
    ],
)
def test_math_answers_that_differ_score_zero(predicted, answer):
    assert math_reward(f"\\boxed{{{predicted}}}", answer) == 0.0


def test_math_reads_the_last_boxed_answer_only():
    assert math_reward("first \\boxed{3}, then \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("first \\boxed{0.5}, then \\boxed{3}", "0.5") == 0.0
    assert math_reward("the answer is 0.5", "0.5") == 0.0  # not boxed
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}" and last_boxed("none") is None


def test_math_survives_hostile_completions_within_seconds():
    start = time.perf_counter()
    for text in [
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{" + "(" * 900 + "}",
        "\\boxed{" * 100_000,
        "x" * 5_000_000,
        "\\boxed{\\frac{" * 300 + "}",
        "\\boxed{__import__('os').system('true')}",
        "\\boxed{}",
    ]:
        assert math_reward(text, "5") == 0.0
    assert time.perf_counter() - start < 10  # math-verify gives up after 1 s a parse


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (80, 0.0),
        (81, -1 / 20),
        (90, -0.5),
        (99, -19 / 20),
        (100, -1.0),
        (101, -1.0),
        (5000, -1.0),
    ],
)
def test_overlong_penalty_is_zero_then_linear_over_the_buffer_then_minus_one(length, expected):
    """DAPO eq. 13 with L_max = 100, L_cache = 20: 0 up to 80 tokens, (80 - |y|) / 20 up to 100, -1 beyond."""
    assert overlong_penalty(length, 100, 20) == pytest.approx(expected)


def test_overlong_penalty_is_off_without_a_buffer():
    assert overlong_penalty(10_000, 100, 0) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# toy and dispatch


def test_toy_reward_is_fraction_of_target_characters():
    assert toy_reward("aaaa", "a") == 1.0
    assert toy_reward("  aaab \n", "a") == 0.75
    assert toy_reward("bbbb", "a") == 0.0
    assert toy_reward("", "a") == 0.0
    assert toy_reward(" \n\t", "a") == 0.0


def test_reward_fn_dispatches_on_task():
    assert reward_fn(answer("3 + 5"), {"task": "countdown", "nums": [5, 3], "target": 8}) == 1.0
    assert reward_fn("#### 7", {"task": "gsm8k", "answer": "7"}) == 1.0
    assert reward_fn("aab", {"task": "toy", "target": "b"}) == pytest.approx(1 / 3)
    assert reward_fn("\\boxed{\\tfrac{3}{6}}", {"task": "math", "answer": "\\frac{1}{2}"}) == 1.0


def test_reward_fn_unknown_task_raises_naming_it():
    with pytest.raises(ValueError, match="'chess'.*reward_fn"):
        reward_fn("x", {"task": "chess"})


def test_reward_fn_returns_a_float_in_unit_interval_for_random_strings():
    rng = random.Random(0)
    fragments = [
        "<answer>",
        "</answer>",
        "(",
        ")",
        "**",
        "/",
        "-",
        "#",
        "####",
        "\\boxed{",
        "}",
        "$",
        ",",
        ".",
        "0",
        "7",
        "123",
        "1e9",
        " ",
        "\n",
    ]
    printable = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "٣"]
    items = [
        {"task": "countdown", "nums": [3, 5, 7], "target": 15},
        {"task": "gsm8k", "answer": "7"},
        {"task": "toy", "target": "a"},
        {"task": "math", "answer": "\\frac{7}{2}"},
    ]
    for _ in range(300):
        pieces = [
            rng.choice(fragments) if rng.random() < 0.5 else rng.choice(printable) for _ in range(rng.randrange(60))
        ]
        text = "".join(pieces)
        for item in items:
            score = reward_fn(text, item)
            assert type(score) is float and 0.0 <= score <= 1.0, (text, item, score)


def test_reward_module_does_not_import_torch():
    code = "import sys, reward; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
