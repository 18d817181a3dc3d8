"""Tiny random models of the Qwen architectures of 2026, saved as the hub ships them, for the tests:

    qwen3_moe       Qwen3-MoE: routed experts per expert (experts.{i}.gate_proj.weight ...), an untied LM head
    qwen3_5         Qwen3.5: a vision-language folder (Qwen3_5ForConditionalGeneration) with a tiny vision tower,
                    model.language_model.* names, MTP weights, and full_attention_interval in its text_config
    qwen3_5_moe     Qwen3.5-MoE: the same, with routed experts fused (gate_up_proj [E, 2I, H]) and a shared expert
    qwen3_next      Qwen3-Next: Gated DeltaNet with its fused in_proj_qkvz and in_proj_ba, experts per expert

Each folder also holds the CPU demo's character tokenizer, so train.py runs on it (--model folder). Every layer has
its weights drawn at random (not the zeros and ones of a fresh model) so that a weight loaded or pushed to the wrong
place shows.
"""

import json
import os

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

import architectures
import checkpoint
import vision
from demo_model import demo_tokenizer

ARCHITECTURES = ("qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
VOCAB = 128  # the demo tokenizer's 103 tokens, padded
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    eos_token_id=[0, 2],  # <|endoftext|> and <|im_end|> of the demo tokenizer
    pad_token_id=0,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# Gated DeltaNet: one linear-attention layer, then one of full attention (full_attention_interval 2).
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)


def text_config(architecture):
    """The transformers config of the architecture's tiny text model."""
    if architecture == "qwen3_moe":
        return Qwen3MoeConfig(**TEXT, **MOE, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    if architecture == "qwen3_next":
        shared = dict(shared_expert_intermediate_size=48)
        return Qwen3NextConfig(**TEXT, **MOE, **LINEAR, **shared, architectures=["Qwen3NextForCausalLM"])
    vlm = hub_config(architecture)
    return vlm.text_config


def hub_config(architecture):
    """Qwen3.5's vision-language config (its text model's in text_config), as the hub ships it."""
    text = dict(TEXT, **LINEAR)
    if architecture == "qwen3_5_moe":
        text.update(MOE, shared_expert_intermediate_size=48)
        return Qwen3_5MoeConfig(
            text_config=text, vision_config=VISION, architectures=[VLM_CLASSES[architecture].__name__]
        )
    return Qwen3_5Config(
        text_config=text,
        vision_config=VISION,
        tie_word_embeddings=True,
        architectures=["Qwen3_5ForConditionalGeneration"],
    )


# By the config's model_type, which is the architecture's name here.
VLM_CLASSES = {"qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}


def randomized(model, seed):
    """The model with every weight drawn from N(0, 0.1), norms around 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1 if "norm" in name and param.dim() == 1 else noise)
    return model


def save_hub_model(folder, architecture, seed=0):
    """The architecture's tiny random model in the hub's layout (see the module's docstring); returns the folder."""
    os.makedirs(folder, exist_ok=True)
    if architecture in VLM_CLASSES:
        save_vision_language_model(folder, hub_config(architecture), seed)
    else:
        model = randomized(AutoModelForCausalLM.from_config(text_config(architecture)), seed)
        model.save_pretrained(folder, max_shard_size="200KB")  # experts per expert, as transformers writes them
    with_the_hubs_fields(os.path.join(folder, "config.json"), architecture)
    demo_tokenizer().save_pretrained(folder)
    return str(folder)


def save_vision_language_model(folder, config, seed=0):
    """A random vision-language model of `config` in `folder` as the hub ships Qwen3.5: its class's tensors as they
    are (experts fused), a tied LM head left out, the multi-token-prediction head that transformers does not build
    added, and config.json."""
    model = randomized(VLM_CLASSES[config.model_type](config), seed)
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    hidden = config.text_config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    state["mtp.norm.weight"] = torch.ones(hidden)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)


def save_tiny_vision_language_model(folder):
    """--model tiny-qwen3.5-vl as a checkpoint's folder: random weights in the hub's layout, config.json with the
    fields SGLang reads, its tokenizer (the vision tokens, a chat template that places images) and its image
    processor's preprocessor_config.json. Returns the folder."""
    os.makedirs(folder)
    config = checkpoint.tiny_config("tiny-qwen3.5-vl")
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    save_vision_language_model(folder, config)
    with_the_hubs_fields(os.path.join(folder, "config.json"), "qwen3_5")
    checkpoint.tiny_tokenizer("tiny-qwen3.5-vl").save_pretrained(folder)
    vision.image_processor("tiny-qwen3.5-vl", 256, 4096).save_pretrained(folder)
    return str(folder)


def with_the_hubs_fields(path, architecture):
    """config.json as the hub's carry it, where transformers 5.19's save_pretrained leaves out what SGLang's config
    classes read: the Gated DeltaNet models' full_attention_interval (transformers keeps layer_types; SGLang's
    Qwen3-Next config has no default for it), and Qwen3.5's empty vision_config.deepstack_visual_indexes (SGLang
    defaults it to [8, 16, 24] and would build deepstack mergers that no checkpoint weight fills)."""
    with open(path) as f:
        config = json.load(f)
    if architecture == "qwen3_next":
        config["full_attention_interval"] = 2  # LINEAR's layer_types
    if architecture in VLM_CLASSES:
        config["text_config"]["full_attention_interval"] = 2
        config["vision_config"]["deepstack_visual_indexes"] = []
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def text_model(folder):
    """The text model of a hub folder as transformers loads it, in the class the trainer builds: a vision-language
    folder through its own class (Qwen3_5ForConditionalGeneration.from_pretrained), its language model's weights
    renamed by hand, the LM head tied as its config says; any other folder through AutoModelForCausalLM. An
    independent reference for checkpoint.load_weights (and its CheckpointLayout)."""
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in VLM_CLASSES:
        return AutoModelForCausalLM.from_pretrained(folder)
    vlm = VLM_CLASSES[config.model_type].from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(architectures.text_config(config))
    state = {}
    for name, tensor in vlm.state_dict().items():
        if name.startswith("model.language_model."):
            state["model." + name.removeprefix("model.language_model.")] = tensor
        elif name == "lm_head.weight":
            state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    model.tie_weights()
    return model
