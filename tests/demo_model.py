"""`--model tiny`, the CPU demo's model, for tests that build it directly: its character tokenizer and random Qwen2
config come from checkpoint.tiny_tokenizer_and_config, through checkpoint.load_tokenizer_and_config as main gets
them."""

from transformers import Qwen3VLProcessor

import checkpoint
import train


def demo_tokenizer():
    return checkpoint.load_tokenizer_and_config(train.Config(model="tiny", max_new_tokens=1), [{"prompt": ""}])[0]


def demo_config(**changes):
    """A fresh copy of the tiny model's config, with `changes` (vocab_size, hidden_size, ...)."""
    config = checkpoint.load_tokenizer_and_config(train.Config(model="tiny", max_new_tokens=1), [{"prompt": ""}])[1]
    config.update(changes)
    return config


class ImageOnlyProcessor(Qwen3VLProcessor):
    """transformers' Qwen3-VL processor without its video processor, which needs torchvision (not on this CPU)."""

    @classmethod
    def get_attributes(cls):
        return [name for name in super().get_attributes() if name != "video_processor"]
