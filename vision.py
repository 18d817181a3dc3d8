"""Prompts with images, for train.py: what a vision-language checkpoint (Qwen3.5's) adds to the text model that the
trainer shards. A task's item may hold `images` (PIL images, files under --data_path, or bytes as a parquet column
of HF datasets' Image feature stores them) and place them in its chat prompt with {"type": "image"} parts.

    encode_prompt(tokenizer, item, cfg)  a prompt's token ids, each image's placeholder expanded to its tokens, and
                                         its images' inputs (pixel values and grid), from the checkpoint's image
                                         processor (PIL's, on every machine), sized within --image_min_pixels and
                                         --image_max_pixels; a text prompt's ids as reward.encode_prompt makes them
    load_tower(cfg, items, files, ...)   the vision tower, where the items hold images: frozen, replicated on each
                                         rank, its weights the checkpoint's (model.visual.*)
    take_images(model, tower)            the text model's forward takes a micro-batch's images (model.images): the
                                         tower's features in place of the image pads, and the 4-row positions of
                                         transformers' own get_rope_index (text, then time, height and width)
    tower_weights(tower, dtype)          the tower's weights under the checkpoint's names, as the push sends them
    save_engine_model(cfg, tower, ...)   SGLang's model path: the vision-language config, the processor's files
    vision_token_ids(config)             the vision tokens, which no engine samples (and log-probs renormalise
                                         without)

The engines get the same image tokens: the expanded ids with the pixel values the trainer made (engines.py).
Machinery a researcher rarely edits; a task with images is the same two edits in reward.py as any task.
"""

import copy
import functools
import io
import os

import torch
from torch.distributed.tensor import distribute_tensor
from transformers import AutoConfig, AutoModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import reward

IMAGE_PAD = "<|image_pad|>"


def has_images(items):
    """Whether any item holds images."""
    return any(item.get("images") for item in items)


@functools.cache
def vision_config(model):
    """The vision-language config of --model (Qwen3_5Config: its vision_config, its image token's id), or None for a
    text model."""
    import checkpoint  # a tiny model's config is made there

    if model in checkpoint.TINY_MODELS:
        config = checkpoint.tiny_config(model)
    else:
        config = AutoConfig.from_pretrained(model)
    return config if hasattr(config, "vision_config") else None


@functools.cache
def image_processor(model, min_pixels, max_pixels):
    """--model's image processor (its preprocessor_config.json; a tiny model's sizes from its vision config), with
    the PIL backend on every machine, so a CPU and a GPU make the same pixel values; images resized to hold between
    min_pixels and max_pixels pixels."""
    config = vision_config(model).vision_config
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    if os.path.exists(os.path.join(model, "preprocessor_config.json")):
        return Qwen2VLImageProcessorPil.from_pretrained(model, size=size)
    merge = config.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=config.patch_size, merge_size=merge, temporal_patch_size=config.temporal_patch_size, size=size
    )


def open_image(image, data_path):
    """A PIL image from an item's entry: a PIL image, a file under --data_path, bytes, or {"bytes": ..., "path": ...}
    (HF datasets' Image feature undecoded)."""
    import PIL.Image

    if isinstance(image, dict):
        image = image.get("bytes") or image["path"]
    if isinstance(image, bytes):
        image = PIL.Image.open(io.BytesIO(image))
    elif isinstance(image, str):
        image = PIL.Image.open(os.path.join(data_path, image))
    return image.convert("RGB")


def encode_prompt(tokenizer, item, cfg):
    """An item's prompt as the engine takes it: token ids, and its images' inputs {"pixel_values": [patches, d],
    "image_grid_thw": [images, 3]} (None without images). Each {"type": "image"} part of the chat prompt is the
    checkpoint's placeholder (<|vision_start|><|image_pad|><|vision_end|>), whose pad is expanded to the image's
    tokens (its grid's patches / merge size squared), as transformers' Qwen3-VL processor does."""
    if not item.get("images"):
        return reward.encode_prompt(tokenizer, item["prompt"], cfg.plain_template), None
    images = [open_image(image, cfg.data_path) for image in item["images"]]
    processor = image_processor(cfg.model, cfg.image_min_pixels, cfg.image_max_pixels)
    inputs = processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template(item["prompt"], tokenize=False, add_generation_prompt=True)
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(images):
        raise SystemExit(
            f"an item's prompt places {len(pieces) - 1} images ({{'type': 'image'}} parts) and holds {len(images)} "
            "in its images: give PromptDataset.__getitem__'s prompt a part for each (docs/tasks.md: images)"
        )
    tokens = (inputs["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()
    text = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(tokens, pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids, {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def vision_token_ids(config):
    """The ids of a vision-language config's vision tokens (image and video pads, vision start and end), which no
    engine samples: a response that held an image pad would ask for an image."""
    return [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]


def vlm_name(name):
    """A weight's name in the vision-language model from the trainer's text model's (model.* is the language
    model's, model.language_model.*; the tower's, model.visual.*, and the LM head's are the same)."""
    if name.startswith("model.") and not name.startswith("model.visual."):
        return "model.language_model." + name.removeprefix("model.")
    return name


def load_tower(cfg, items, files, device):
    """Where the items hold images: --model's vision tower (the checkpoint's model.visual.* weights, read by every
    rank; a tiny model's drawn from --seed), frozen, in the compute dtype, with its vision-language model on the meta
    device for transformers' get_rope_index. None for a text task; a text model with images is refused."""
    if not has_images(items) and cfg.train_vision:
        raise SystemExit(f"--train_vision trains a vision tower, and --task {cfg.task}'s items hold no images: drop it")
    if not has_images(items):
        return None
    config = vision_config(cfg.model)
    if config is None:
        raise SystemExit(f"--task {cfg.task} has images and --model {cfg.model} no vision tower: use a Qwen3.5 model")
    if cfg.plain_template:
        raise SystemExit("--plain_template has no place for images: drop it (the chat template places them)")
    torch.manual_seed(cfg.seed + 1)  # a tiny model's: drawn
    tower = AutoModel.from_config(config.vision_config)
    if files != [None]:
        from safetensors import safe_open

        state = {}
        for file in files:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    if key.startswith("model.visual."):
                        state[key.removeprefix("model.visual.")] = handle.get_tensor(key)
        tower.load_state_dict(state)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = tower.to(device, dtype).eval().requires_grad_(False)
    tower.vlm_config = config  # the vision-language model's
    tower.trained = cfg.train_vision  # the policy then trains a copy of it (take_images)
    with torch.device("meta"):  # transformers' get_rope_index, a method of the vision-language model: no weights
        tower.rope_index = AutoModel.from_config(config).get_rope_index
    return tower


def tower_weights(tower, dtype):
    """What a push sends of the frozen tower besides the model's weights: its weights in `dtype`, under the
    checkpoint's names (model.visual.*), which SGLang's vision-language class loads. Nothing for a tower the policy
    trains a copy of (--train_vision): that copy is the model's, pushed with it."""
    if tower.trained:
        return
    for name, weight in tower.state_dict().items():
        yield "model.visual." + name, weight.to(dtype)


def save_engine_model(cfg, tower, text_config, folder):
    """What SGLang reads from its model path for prompts with images, in `folder`: the checkpoint's vision-language
    config holding the engine's text config (architectures.engine_config), and its processor's files (tokenizer,
    image and video processors), from which SGLang builds its image path even when it is given token ids."""
    import checkpoint

    config = copy.deepcopy(tower.vlm_config)
    config.text_config = text_config
    config.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type]]
    if getattr(config.vision_config, "deepstack_visual_indexes", None) is None:  # SGLang's Qwen3.5 tower reads it
        config.vision_config.deepstack_visual_indexes = []
    if cfg.model in checkpoint.TINY_MODELS:
        checkpoint.tiny_tokenizer(cfg.model).save_pretrained(folder)
        image_processor(cfg.model, cfg.image_min_pixels, cfg.image_max_pixels).save_pretrained(folder)
    else:
        checkpoint.copy_files_but_weights(checkpoint.model_folder(cfg.model, download=False), folder)
    config.save_pretrained(folder)  # in place of the checkpoint's


def take_images(model, tower):
    """With a vision tower (None: a text task, and nothing here), the text model's forward takes the images of a
    micro-batch's samples (model.images: each sample's inputs, or None): the tower's features in place of the image
    pads in the embeddings, and position ids [4, batch, time], the text row and then transformers' get_rope_index's
    for time, height and width. Image pads without the pixel values to fill them are refused, never run as text.
    model.banned_ids: the vision tokens, which no engine samples (vocab_parallel renormalises without them).
    --train_vision: the model holds a copy of the tower (model.model.visual, on the meta device until copy_tower),
    sharded and trained with it, and its features come from that copy."""
    model.images = model.banned_ids = None
    if tower is None:
        return
    image_id = tower.vlm_config.image_token_id
    model.banned_ids = vision_token_ids(tower.vlm_config)
    encoder = tower
    if tower.trained:
        with torch.device("meta"):
            model.model.visual = encoder = AutoModel.from_config(tower.vlm_config.vision_config)
    pending = []  # the micro-batch's pixel values and grid, for the embedding's hook

    def before_forward(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        images = [image for image in model.images or [] if image is not None]
        image_tokens = (ids == image_id).long()
        if not images and not image_tokens.any():
            return None
        grid = torch.cat([image["image_grid_thw"] for image in images]).to(ids.device) if images else None
        feature_count = 0
        if images:
            pixels = torch.cat([image["pixel_values"] for image in images]).to(ids.device)
            pending.append((pixels, grid))
            feature_count = int(grid.prod(-1).sum()) // tower.config.spatial_merge_size**2
        if int(image_tokens.sum()) != feature_count:
            pending.clear()
            raise RuntimeError(
                f"{int(image_tokens.sum())} image tokens and {feature_count} image features: an image was dropped"
            )
        rows, _ = tower.rope_index(ids, image_tokens, grid, attention_mask=mask)
        text = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return args, dict(kwargs, position_ids=torch.cat([text[None], rows]))

    def after_embedding(module, args, embeddings):
        if not pending:
            return None
        pixels, grid = pending.pop()
        # Inside the model's forward: a trained copy's weights are gathered (FSDP), and its graph is the model's.
        features = encoder(pixels.to(embeddings.dtype), grid_thw=grid).pooler_output
        image_mask = (args[0] == image_id)[..., None].expand_as(embeddings)
        return embeddings.masked_scatter(image_mask, features.to(embeddings.dtype))

    model.register_forward_pre_hook(before_forward, with_kwargs=True)
    model.get_input_embeddings().register_forward_hook(after_embedding)


def copy_tower(model, tower):
    """--train_vision: the model's copy of the tower (take_images), sharded by FSDP, set to the tower's weights, each
    rank's shard from its own whole copy; its buffers (rotary frequencies) too."""
    if tower is None or not tower.trained:
        return
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            whole = tower.get_parameter(name).to(param.dtype)
            param.to_local().copy_(
                distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            )
        for name, buffer in model.model.visual.named_buffers():
            buffer.copy_(tower.get_buffer(name))
