"""The multi-turn loop of --tool python (train.generate_rollouts, train.run_tools) against a scripted engine that
answers with known text: the ids kept exactly as sampled, only tool output tokenised and marked unsampled, stops at a
block's end, the budget over all turns, --max_turns, one batch per round, tool calls in parallel, the step's tool
metrics."""

import importlib.util
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

import engines
import launch
import reward
import sandbox
import train
from demo_model import demo_config, demo_tokenizer
from inflight import InFlight
from test_train import metrics, torchrun
from workers import run_ranks

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not sandbox.tool_interpreter(),
    reason="the tool uses Linux limits and a Python that others can run",
)


class ScriptedEngine(engines.Engine):
    """An engine whose model writes a fixed text per prompt: each call continues every prompt from where its sampled
    tokens left off, up to and including a stop id or the budget, as HFEngine and SGLangEngine do, and returns the
    new ids and their log-probs. It records what each call was given; its log-probs are -(position + 1) / 100 so that
    each can be traced back to its token."""

    def __init__(self, tokenizer, scripts):
        self.scripts = {
            tuple(tokenizer(prompt, add_special_tokens=False).input_ids): tokenizer(
                text, add_special_tokens=False
            ).input_ids
            for prompt, text in scripts.items()
        }
        self.done = dict.fromkeys(self.scripts, 0)  # sampled tokens given out so far, per prompt
        self.calls = []

    def generate(self, prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None):
        self.calls.append({"prompts": [list(p) for p in prompts], "budgets": list(budgets), "stop_ids": stop_ids})
        outputs = []
        for ids, budget in zip(prompts, budgets):
            prompt = next(p for p in self.scripts if tuple(ids[: len(p)]) == p)
            start = self.done[prompt]
            rest = self.scripts[prompt][start : start + budget]
            end = next((i + 1 for i, t in enumerate(rest) if t in stop_ids), len(rest))
            self.done[prompt] += end
            logprobs = torch.tensor([-(start + i + 1) / 100 for i in range(end)])
            kept_ids = torch.zeros(0, dtype=torch.int32)  # truncated sampling: each token kept with the id after it
            kept_sizes = torch.zeros(0, dtype=torch.int32)
            if top_p < 1 or top_k > 0:
                kept_ids = torch.tensor([i for t in rest[:end] for i in (t, t + 1)], dtype=torch.int32)
                kept_sizes = torch.full((end,), 2, dtype=torch.int32)
            outputs.append((rest[:end], logprobs, kept_ids, kept_sizes, torch.zeros(0, dtype=torch.uint8)))
        return outputs


def rollouts(tokenizer, scripts, workers=None, **flags):
    """A sample per script, generated in turns (train.run_tools) and then scored, as collect_rollouts does."""
    engine = ScriptedEngine(tokenizer, scripts)
    cfg = train.Config(tool="python", temperature=1.0, **flags)
    items = [{"prompt": prompt, "task": "gsm8k", "answer": "42"} for prompt in scripts]
    own = workers is None
    workers = workers or sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
    try:
        samples, errors = train.generate_rollouts(engine, workers, tokenizer, items, cfg, 0, 1.0)
    finally:
        if own:
            workers.close()
    assert errors == []
    return engine, samples


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


FIRST = "Six sevens:\n```python\nprint(6 * 7)\n```\n"
AFTER = "So the answer is \\boxed{42}.<|im_end|>"


def test_a_closed_block_is_run_and_its_output_appended_as_unsampled_tokens_the_ids_kept_as_sampled(qwen_tokenizer):
    tok = qwen_tokenizer
    engine, [s] = rollouts(tok, {"Q:": FIRST + AFTER}, max_new_tokens=200)
    first, after = ids(tok, FIRST), ids(tok, AFTER)
    reply = ids(tok, "```output\n42\n```\n")
    assert s.response_ids == first + reply + after  # the sampled ids untouched, the reply tokenised alone
    assert s.sampled == [True] * len(first) + [False] * len(reply) + [True] * len(after)
    # One engine log-prob per sampled token, in order, none for the tool's: positions 1.. of the script as written.
    assert s.engine_logprobs.tolist() == pytest.approx([-(i + 1) / 100 for i in range(len(first) + len(after))])
    assert s.tool_outputs == ["42\n"] and s.reward == 1.0 and not s.truncated
    # Token in, token out: what the engine was given after the run is the prompt, its ids and the reply's, exactly.
    assert engine.calls[-1]["prompts"] == [ids(tok, "Q:") + first + reply]
    # The stops at the opening fence (```) and at "``" went on without a run: one run, after the closing "`\n".
    fences = set(reward.fence_token_ids(tok))
    assert [t for t in first if t in fences] == ids(tok, "```") + ids(tok, "``") + ids(tok, "`\n")
    assert len(engine.calls) == 4 and all(set(c["stop_ids"]) >= fences for c in engine.calls)
    assert tok.decode(s.response_ids) == FIRST + "```output\n42\n```\n" + AFTER


def test_kept_sets_of_truncated_sampling_follow_the_sampled_tokens_across_turns_and_the_tool_output_has_none(
    qwen_tokenizer,
):
    tok = qwen_tokenizer
    engine, [s] = rollouts(tok, {"Q:": FIRST + AFTER}, max_new_tokens=200, top_p=0.9)
    sampled = [t for t, was_sampled in zip(s.response_ids, s.sampled) if was_sampled]
    assert s.kept_sizes.tolist() == [2] * len(sampled) == [2] * s.num_sampled
    assert s.kept_ids.tolist() == [i for t in sampled for i in (t, t + 1)]  # each set with its own token, in order
    _, [plain] = rollouts(tok, {"Q:": FIRST + AFTER}, max_new_tokens=200)
    assert len(plain.kept_ids) == len(plain.kept_sizes) == 0  # no truncation: nothing kept


def test_a_response_without_code_is_one_engine_call_and_nothing_is_run(qwen_tokenizer):
    engine, [s] = rollouts(qwen_tokenizer, {"Q:": "It is \\boxed{42}.<|im_end|>"}, max_new_tokens=50)
    assert len(engine.calls) == 1 and s.tool_outputs == [] and all(s.sampled) and s.reward == 1.0


def test_without_the_tool_fences_do_not_stop_generation(qwen_tokenizer):
    engine = ScriptedEngine(qwen_tokenizer, {"Q:": FIRST + AFTER})
    cfg = train.Config(tool="", max_new_tokens=200)
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    try:
        [s], _ = train.generate_rollouts(
            engine, workers, qwen_tokenizer, [{"prompt": "Q:", "task": "gsm8k", "answer": "42"}], cfg, 0, 1.0
        )
    finally:
        workers.close()
    assert len(engine.calls) == 1 and s.response_ids == ids(qwen_tokenizer, FIRST + AFTER) and s.tool_outputs == []


def test_a_special_token_that_the_code_prints_is_text_and_cannot_end_the_response(qwen_tokenizer):
    tok = qwen_tokenizer
    forged = FIRST.replace("6 * 7", "'<|im_' + 'end|>'")
    engine, [s] = rollouts(tok, {"Q:": forged + AFTER}, max_new_tokens=200)
    reply = [t for t, m in zip(s.response_ids, s.sampled) if not m]
    assert s.tool_outputs == ["<|im_end|>\n"] and tok.decode(reply) == "```output\n<|im_end|>\n```\n"
    assert not set(reply) & set(reward.stop_token_ids(tok))  # the characters, not Qwen's end-of-turn token
    assert len(engine.calls) == 4 and s.response_ids[-len(ids(tok, AFTER)) :] == ids(tok, AFTER)


def test_the_last_turn_runs_no_code_and_generation_goes_on_to_the_end(qwen_tokenizer):
    blocks = "".join(f"Try {i}:\n```python\nprint({i})\n```\n" for i in range(3))
    _, [s] = rollouts(qwen_tokenizer, {"Q:": blocks + AFTER}, max_new_tokens=400, max_turns=2)
    assert s.tool_outputs == ["0\n"]  # turn 1 ended in a block that ran; turn 2, the last, runs none
    text = qwen_tokenizer.decode(s.response_ids)
    assert text == blocks.replace("```\nTry 1", "```\n```output\n0\n```\nTry 1", 1) + AFTER
    assert not s.truncated and s.reward == 1.0


def test_the_budget_counts_tool_output_and_cuts_it(qwen_tokenizer):
    tok = qwen_tokenizer
    flood = FIRST.replace("6 * 7", "'x' * 500")
    first = ids(tok, flood)
    _, [s] = rollouts(tok, {"Q:": flood + AFTER}, max_new_tokens=len(first) + 8)
    assert len(s.response_ids) == len(first) + 8 and s.sampled[len(first) :] == [False] * 8  # cut inside the reply
    assert s.truncated and len(s.tool_outputs) == 1
    engine, [s] = rollouts(tok, {"Q:": FIRST + AFTER}, max_new_tokens=5)  # the budget ends the first turn
    assert len(s.response_ids) == 5 and engine.calls[0]["budgets"] == [5] and s.truncated and s.tool_outputs == []


def test_samples_still_generating_go_as_one_batch_per_round_and_the_others_drop_out(qwen_tokenizer):
    scripts = {"A:": FIRST + AFTER, "B:": "\\boxed{42}<|im_end|>", "C:": FIRST.replace("6 * 7", "1 / 0") + AFTER}
    engine, samples = rollouts(qwen_tokenizer, scripts, max_new_tokens=200)
    assert [len(c["prompts"]) for c in engine.calls] == [3, 2, 2, 2]  # B ended in round 1; A and C go on together
    assert [len(s.tool_outputs) for s in samples] == [1, 0, 1]
    assert "ZeroDivisionError" in samples[2].tool_outputs[0]
    after = len(ids(qwen_tokenizer, AFTER))  # the budget left for the last round: tool output counted
    assert engine.calls[-1]["budgets"] == [200 - len(samples[i].response_ids) + after for i in (0, 2)]
    # The step's metrics of these samples: per sample, 2 calls of 3 samples, 2 of 3 used the tool, 5 turns (A and C
    # a turn before their block's output and one after, B one); counts, 1 error and no timeout.
    logged = run_ranks(
        lambda rank, world: train.step_metrics(
            samples, {}, {}, [], {}, train.Config(group_size=3), launch.parallel_groups("cpu", 1)
        ),
        1,
    )[0]
    assert [logged[k] for k in ("tool_calls", "tool_use", "turns")] == pytest.approx([2 / 3, 2 / 3, 5 / 3])
    assert (logged["tool_errors"], logged["tool_timeouts"], logged["samples"]) == (1, 0, 3)


def test_the_tool_calls_of_a_round_run_in_parallel_in_the_workers(qwen_tokenizer):
    # Each code waits for a file that the other creates: run one after the other, the first would time out. Calls
    # share no /tmp (each has its own), so the folder is in /var/tmp, writable by both calls' users when root runs
    # the tests; each lingers after it met the other, whose file goes with its call.
    folder = tempfile.mkdtemp(dir="/var/tmp")
    os.chmod(folder, 0o777)
    wait = (
        "import os, time\nopen('{folder}/{mine}', 'w').close()\nfor _ in range(200):\n"
        "    if os.path.exists('{folder}/{other}'): break\n    time.sleep(0.02)\nprint('met' if os.path.exists("
        "'{folder}/{other}') else 'alone', flush=True)\ntime.sleep(0.5)\n"
    )
    scripts = {
        f"{mine}:": f"```python\n{wait.format(folder=folder, mine=mine, other=other)}```\n" + AFTER
        for mine, other in (("a", "b"), ("b", "a"))
    }
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
    try:
        _, samples = rollouts(qwen_tokenizer, scripts, workers=workers, max_new_tokens=300)
    finally:
        workers.close()
        shutil.rmtree(folder)
    assert [s.tool_outputs for s in samples] == [["met\n"], ["met\n"]]


def tool_using_model(folder, device="cpu", **shape):
    """The tiny model taught by teacher forcing (a few seconds) to answer the question with a ```python block, its
    output and a boxed answer: a model that uses the tool, to drive the whole loop through torchrun."""
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] + '\\n' }}"  # a short prompt: one token per character
    question = [{"role": "user", "content": reward.TOOL_PROMPT.format(question=QUESTION)}]
    prompt = reward.encode_prompt(tokenizer, question)
    response = tokenizer(
        "```python\nprint(6 * 7)\n```\n```output\n42\n```\nSo \\boxed{42}<|im_end|>", add_special_tokens=False
    ).input_ids
    config = demo_config(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3 if shape else 1e-2)  # a wider model needs a lower rate
    ids = torch.tensor([prompt + response], device=device)
    labels = torch.where(torch.arange(ids.shape[1], device=device) < len(prompt), -100, ids)
    for _ in range(500 if shape else 300):
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.01, loss.item()  # taught: it answers as written, sampled at temperature 1
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


QUESTION = "What is 6 * 7?"
ON_GPU = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


@pytest.mark.parametrize(
    "engine", ["hf", pytest.param("sglang", marks=pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and sglang"))]
)
def test_torchrun_with_the_python_tool_runs_the_models_code_and_scores_its_answers(engine, tmp_path):
    # SGLang's attention kernels want Qwen's head size of 128.
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1) if engine == "sglang" else {}
    tool_using_model(tmp_path / "model", "cuda" if engine == "sglang" else "cpu", **shape)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(2 * (json.dumps({"question": QUESTION, "answer": "#### 42"}) + "\n"))
    run = torchrun(
        2 if engine == "hf" else 1,
        "--model",
        str(tmp_path / "model"),
        "--task",
        "gsm8k",
        "--data_path",
        str(tmp_path / "data"),
        "--tool",
        "python",
        "--max_turns",
        "2",
        "--engine",
        engine,
        "--steps",
        "2",
        "--prompts_per_step",
        "2",
        "--group_size",
        "4",
        "--max_new_tokens",
        "80",
        "--lr",
        "1e-6",
        "--eval_every",
        "0",
        "--save_every",
        "0",
        "--sample_every",
        "1",
        "--reward_workers",
        "2",
        "--out_dir",
        str(tmp_path / "out"),
        timeout=900,
        **({"CUDA_VISIBLE_DEVICES": ""} if engine == "hf" else {}),
    )  # hf: two CPU ranks, GPU or not
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout[-1500:])
    rows = metrics(tmp_path / "out")
    assert len(rows) == 2
    for row in rows:  # the taught model writes one block per response; its run prints 42, which it boxes
        assert row["tool_use"] >= 0.5 and row["reward"] >= 0.5 and row["tool_timeouts"] == 0
        assert row["tool_errors"] <= 1  # of 8 samples at temperature 1, one may stray inside its code
        # A turn ends in each tool output, and one more where the response ends in sampled tokens; a response whose
        # tool output the budget cut ends in that output (so it is truncated), with no sampled turn after it. Of the
        # 8 samples at most one may stray so: code that prints past the budget, as a traceback does.
        ended_in_output = (1 + row["tool_calls"] - row["turns"]) * row["samples"]  # samples ending in tool output
        assert ended_in_output == pytest.approx(round(ended_in_output)) and row["samples"] == 8
        assert 0 <= round(ended_in_output) <= min(1, round(row["truncated"] * row["samples"]))
        # The engine's log-probs line up with the trainer's on the sampled tokens alone (tool output has none).
        assert row["mismatch_abs"] < (0.05 if engine == "sglang" else 1e-4)
    assert "```output\n42\n```\nSo \\boxed{42}" in run.stdout and " | tool " in run.stdout


def test_partial_rollouts_carry_a_response_between_its_turns_into_later_steps(qwen_tokenizer):
    """--partial_rollouts with --tool: rounds of 6 tokens, so a response stops at its block's end within a round,
    the block runs, and the response goes on in a later step's rounds, under a newer policy. What trains is what the
    synchronous loop makes of the same scripts: the sampled ids, the tool output as unsampled tokens, and the
    engine's log-probs and kept sets of the sampled tokens alone, each sampled token tagged with the step of its
    round."""
    tok = qwen_tokenizer
    scripts = {f"Q{i}:": FIRST + AFTER if i in (1, 6) else "It is \\boxed{42}.<|im_end|>" for i in range(8)}
    flags = dict(max_new_tokens=200, top_p=0.9)
    cfg = train.Config(tool="python", partial_rollouts=True, tis_cap=2.0, round_tokens=6, group_size=1, **flags)
    cfg.prompts_per_step = 2  # a group of one response per prompt, two a step: Config allows what check_config not
    engine = ScriptedEngine(tok, scripts)
    dataset = [{"prompt": prompt, "task": "gsm8k", "answer": "42"} for prompt in scripts]
    in_flight = InFlight([], next_batch=0)
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
    trained = {}
    try:
        for step in range(3):
            samples, errors, _ = train.partial_rollouts(engine, workers, dataset, tok, in_flight, cfg, step, 0, 1)
            assert errors == [] and len(samples) == 2
            trained.update((tok.decode(s.prompt_ids), (step, s)) for s in samples)
    finally:
        workers.close()
    _, synchronous = rollouts(tok, {prompt: scripts[prompt] for prompt in trained}, **flags)
    carried = 0
    for s, (step, partial) in zip(synchronous, trained.values()):
        assert partial.response_ids == s.response_ids and partial.sampled == s.sampled and partial.ended
        assert partial.tool_outputs == s.tool_outputs and partial.reward == s.reward == 1.0
        assert torch.equal(partial.engine_logprobs, s.engine_logprobs) and torch.equal(partial.kept_ids, s.kept_ids)
        versions = partial.versions.tolist()
        assert len(versions) == partial.num_sampled and versions == sorted(versions) and versions[-1] <= step
        carried += bool(partial.tool_outputs) and len(set(versions)) > 1
    assert carried  # a response whose turns spanned steps: its block's output between two policies' tokens
