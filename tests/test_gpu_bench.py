"""benchmarks/gpu.py, the GPU benchmark, run end to end on this CPU at tiny sizes (--preset cpu): every row filled
with finite numbers and labelled as a CPU run; its SGLang path against the fake sglang.Engine (the real sglang
package otherwise); its FLOP formula against a count by hand for Qwen2.5-0.5B."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import train
from conftest import build_qwen_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Qwen2 with the real Qwen tokenizer and a chat template, standing in for SmolLM2 (saves ~25 s)."""
    folder = str(tmp_path_factory.mktemp("tiny_chat"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu.shape_config("tiny")).save_pretrained(folder)
    build_qwen_tokenizer().save_pretrained(folder)
    return folder


def python(*args):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_the_cpu_run_fills_every_row_with_finite_numbers_and_says_it_is_a_cpu_run(chat_model, tmp_path):
    run = python("benchmarks/gpu.py", "--preset", "cpu", "--out_dir", str(tmp_path), "--smollm2", chat_model)
    assert run.returncode == 0, run.stderr[-3000:]
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["label"] == "CPU RUN, not GPU figures" and "measured" in table["peak"] and table["peak_tflops"] > 0
    settings = [f"T {t}, top_p {p}, {dtype} logits" for dtype in ("fp32", "bf16") for t, p in gpu.SAMPLING]
    names = [(r["row"], r["what"]) for r in table["rows"]]
    shapes = ("tiny, 0.0098B parameters", "tiny-qwen3.5, 0.0183B parameters", "tiny-qwen3-moe, 0.0213B parameters")
    for row in ("rollout", "train", "push", "memory", "step"):
        assert all((row, shape) in names for shape in shapes), row
    assert [w for r, w in names if r == "routing"] == [shapes[2]]  # MoE shapes alone
    ways = ["tiny-qwen3.5, text", "tiny-qwen3.5, image", "tiny-qwen3.5, image, --train_vision"]
    assert [w for r, w in names if r == "images"] == ways  # Qwen3.5 shapes alone
    assert [w for r, w in names if r == "logprobs"] == settings
    assert [w for r, w in names if r == "race"] == ["TRL, vLLM colocate", "train.py", "TRL"]
    assert [w for r, w in names if r == "partial"] == ["synchronous", "partial"]
    for r in table["rows"]:
        if r["what"] == "TRL, vLLM colocate":  # vLLM needs a GPU: the row says so instead of numbers
            assert r["values"] == {} and r["note"] == "not run: vLLM needs a GPU"
            continue
        assert r["values"] and all(math.isfinite(v) for v in r["values"].values()), r
    value = {(r["row"], r["what"]): r["values"] for r in table["rows"]}
    rollout = value["rollout", "tiny, 0.0098B parameters"]
    # prompts x G x new tokens on both sides: stops ignored, every response at its budget
    assert rollout["train.py tokens"] == rollout["engine tokens"] == 4 * 2 * 8
    assert rollout["ratio"] == pytest.approx(rollout["train.py tok/s"] / rollout["engine tok/s"])
    trained = value["train", "tiny, 0.0098B parameters"]
    assert 0 < trained["logprob MFU"] and 0 < trained["update MFU"] and 0 <= trained["padding"] < 1
    memory = value["memory", "tiny, 0.0098B parameters"]
    assert memory["released GB"] == 0 and memory["training peak GB"] > 0  # the HF engine keeps its copy
    for shape in shapes:  # the HF engine on a CPU: fp32 on both sides, log-probs equal to rounding
        step = value["step", shape]
        parts = ("generation s", "logprobs s", "update s", "push s")
        assert step["step s"] == pytest.approx(sum(step[part] for part in parts))
        assert step["mismatch |log r|"] < 1e-4
    # Images: a 64 x 64 image is 64 tokens more (and its start and end); the HF engine's log-probs agree either way.
    text, image, trained = (value["images", way] for way in ways)
    assert image["prompt tokens"] == trained["prompt tokens"] == text["prompt tokens"] + 66
    assert all(way["mismatch |log r|"] < 1e-4 for way in (text, image, trained))
    # The HF engine routes as the trainer (fp32, same weights): no routing differs, replayed or not, and the
    # log-probs agree to rounding either way.
    routing = value["routing", shapes[2]]
    assert routing["measure: routing_mismatch"] == routing["on: routing_mismatch"] == 0
    assert routing["measure: |log r|"] < 1e-4 and routing["on: |log r|"] < 1e-4
    # fp32 logits on both sides (the CPU engine is fp32): agreement to rounding; the trainer's bf16 logits lose more.
    for t, p in gpu.SAMPLING:
        fp32, bf16 = (value["logprobs", f"T {t}, top_p {p}, {dtype} logits"] for dtype in ("fp32", "bf16"))
        assert fp32["mean |log r|"] < 1e-5 and bf16["mean |log r|"] > 10 * fp32["mean |log r|"]
        assert 0 < fp32["tokens"] <= 2 * 2 * 8
    for trainer in ("train.py", "TRL"):
        race = value["race", trainer]
        assert race["steps"] == 2 and 0 <= race["accuracy after"] <= 1 and race["s/step"] > 0
    # The printed table: every line of it says it is a CPU run.
    printed = run.stdout[run.stdout.index("\nCPU RUN, not GPU figures: cpu;") :].strip().splitlines()
    assert len(printed) == 2 + len(table["rows"]) and all(line.startswith("CPU RUN") for line in printed[2:])


FAKE_SGLANG = """
import json, sys
sys.path[:0] = ["tests", "benchmarks", "tests/sglang_cpu_stubs"]  # the stubs: for io_struct (top_p's requests)
import sglang, fake_sglang_engine
sglang.Engine = fake_sglang_engine.Engine
import gpu
rows = ["--only", "rollout,push,memory,step,logprobs", "--shapes", "tiny"]
sys.argv[1:] = ["--preset", "cpu", "--engine", "sglang", *rows, *sys.argv[1:]]
gpu.main()
print(json.dumps([dict(fp32_lm_head=e.kwargs.get("enable_fp32_lm_head"), calls=e.calls)
                  for e in fake_sglang_engine.STARTED]))
"""


def test_the_sglang_path_drives_sglang_as_train_py_does_and_starts_the_bf16_engine_without_fp32_logits(
    chat_model, tmp_path
):
    pytest.importorskip("sglang")
    run = python("-c", FAKE_SGLANG, "--out_dir", str(tmp_path), "--smollm2", chat_model)
    assert run.returncode == 0, run.stderr[-3000:]
    engines = json.loads(run.stdout.strip().splitlines()[-1])
    # One engine for the shape, then the log-prob rows' two: fp32 LM head as train.py starts it, then off.
    assert [e["fp32_lm_head"] for e in engines] == [True, True, False]
    assert all(e["calls"][-1] == ["shutdown"] for e in engines)
    generate = [c[2] for c in engines[0]["calls"] if c[0] == "generate"]
    # train.py's path asks with its own per-request params, stops dropped; the direct call with one dict, ignore_eos.
    assert any(
        isinstance(p, list) and all(q["stop_token_ids"] == [] and q["max_new_tokens"] == 8 for q in p) for p in generate
    )
    assert {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "ignore_eos": True} in generate
    # The log-prob rows at top_p 0.9 sample as train.py does: top_k bounded by engines.MAX_KEPT, kept sets asked for.
    calls = [c[2] for e in engines[1:] for c in e["calls"] if c[0] == "generate" and isinstance(c[2], list)]
    truncated = [params for params in calls if params[0]["top_p"] == 0.9]
    assert truncated and all(q["top_k"] == 512 for params in truncated for q in params)
    calls = engines[0]["calls"]  # no prefix cached by an earlier run: a flush before each generation but the first
    assert all(calls[i - 1] == ["flush_cache"] for i, c in enumerate(calls) if c[0] == "generate" and i > 0)
    table = json.loads((tmp_path / "table.json").read_text())
    value = {(r["row"], r["what"]): r["values"] for r in table["rows"]}
    rollout = value["rollout", "tiny, 0.0098B parameters"]
    assert rollout["train.py tokens"] == rollout["engine tokens"] == 4 * 2 * 8
    assert "bfloat16" in next(r["note"] for r in table["rows"] if r["row"] == "push")  # SGLang takes bf16 pushes
    notes = [r["note"] for r in table["rows"] if r["row"] == "logprobs"]
    assert all("LM head fp32" in n for n in notes[:3]) and all("LM head bf16" in n for n in notes[3:])


def test_flops_of_a_qwen2_5_0_5b_forward_match_a_count_by_hand():
    # Qwen2.5-0.5B's config.json: hidden 896, intermediate 4,864, 24 layers, 14 heads of 64, 2 KV heads, vocabulary
    # 151,936. Per layer: q 896 x 896 = 802,816, k and v 896 x 128 = 114,688 each, o 802,816, gate, up and down
    # 896 x 4,864 = 4,358,144 each: 14,909,440 weights; 24 layers: 357,826,560. LM head 151,936 x 896 = 136,134,656.
    # (With the embedding, biases and norms the model has 494,032,768 parameters: the published "0.49B".)
    layers, lm_head, attention = 357_826_560, 136_134_656, 14 * 64  # causal attention: 2 x 24 x T^2 x 896
    config = gpu.shape_config("qwen2.5-0.5b")
    with torch.device("meta"):
        assert sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) == 494_032_768
    answered = train.Sample([1] * 100, [2] * 50, [True] * 50)  # 150 tokens, the last 50 sampled
    # 2 x 357,826,560 x 150 + 2 x 24 x 150^2 x 896 + 2 x 136,134,656 x 50
    # = 107,347,968,000 + 967,680,000 + 13,613,465,600
    assert 2 * layers * 150 + 2 * 24 * 150**2 * attention + 2 * lm_head * 50 == 121_929_113_600
    assert gpu.forward_flops(config, [answered]) == 121_929_113_600
    with_tool = train.Sample([1] * 100, [2] * 50, [True] * 30 + [False] * 20)  # 20 tokens of tool output: no logits
    assert gpu.forward_flops(config, [answered, with_tool]) == 2 * 121_929_113_600 - 2 * lm_head * 20


def test_flops_of_qwen3_30b_a3b_count_the_routed_experts_a_token_uses_and_full_attention_layers_alone():
    # Qwen3-30B-A3B's config, 8 of its 48 layers: hidden 2,048, 32 heads of 128, 4 KV heads, 128 experts of 768, top 8,
    # vocabulary 151,936, untied. Per layer: q 2,048 x 4,096 = 8,388,608, k and v 2,048 x 512 = 1,048,576 each,
    # o 8,388,608, the router 128 x 2,048 = 262,144, and of the experts (3 x 2,048 x 768 = 4,718,592 each) the 8 a
    # token goes to: 37,748,736. 56,885,248 a layer, 455,081,984 for 8. LM head 151,936 x 2,048 = 311,164,928.
    layers, lm_head, attention = 455_081_984, 311_164_928, 32 * 128
    answered = train.Sample([1] * 100, [2] * 50, [True] * 50)
    # 2 x 455,081,984 x 150 + 2 x 8 x 150^2 x 4,096 + 2 x 311,164,928 x 50
    assert 2 * layers * 150 + 2 * 8 * 150**2 * attention + 2 * lm_head * 50 == 169_115_648_000
    assert gpu.forward_flops(gpu.shape_config("qwen3-30b-a3b-8l"), [answered]) == 169_115_648_000
    # Qwen3.5-2B: only its 6 full-attention layers of 24 take the T^2 term (8 heads of 256). A sequence of 200 tokens
    # less two of 100, each with one sampled token: the T^2 terms' difference, less one LM head (248,320 x 2,048).
    config = gpu.shape_config("qwen3.5-2b")
    short, long = (train.Sample([1] * t, [2], [True]) for t in (99, 199))
    difference = gpu.forward_flops(config, [long]) - 2 * gpu.forward_flops(config, [short])
    assert difference == 2 * 6 * (200**2 - 2 * 100**2) * 8 * 256 - 2 * 248_320 * 2_048
