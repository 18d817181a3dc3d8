"""What prompts with images cost a step on this CPU, measured in one run: the same step (generation by the HF engine,
the old policy's log-probs, the training pass, the push) on 8 prompts x G 4, each prompt three ways:

- image: the chat prompt with one image of --pixels x --pixels (its tokens, the vision tower's forward in every
  training forward, the vision-language class in the engine);
- text: the same prompt without its image (fewer tokens);
- padded: the text prompt with as many text tokens as the image had, in its place (the same length: what the image
  costs beyond its tokens).

A Qwen3.5 vision-language model of random weights (hidden 256, 4 layers, three Gated DeltaNet and one of full
attention; a vision tower of 2 blocks of 128, 4 x 4 pixels a patch, 2 x 2 patches a token), on 2 gloo ranks at
dp 2. Prints tokens per sample, seconds per stage (the median of --repeats, after a warm-up) and each over the text
step's, and the peak resident memory of each way's processes.

    python3 benchmarks/images.py                  # ~2 min on 2 cores
    python3 benchmarks/images.py --pixels 128 --repeats 5
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

import checkpoint  # noqa: E402
import engines  # noqa: E402
import launch  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
import vision  # noqa: E402
from workers import run_ranks  # noqa: E402

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
TEXT.update(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4)
TEXT.update(linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256)
QUESTION = [{"type": "text", "text": "What colour is the square? Answer with one letter."}]


def save_model(folder):
    """The benchmark's model as a hub folder: random weights, config.json, the tiny models' tokenizer (with the
    vision tokens and a chat template that places images) and the image processor's config."""
    config = checkpoint.tiny_config("tiny-qwen3.5-vl")
    config.text_config.update(TEXT)
    config.vision_config.update(VISION)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    checkpoint.tiny_tokenizer("tiny-qwen3.5-vl").save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2).save_pretrained(folder)


def step(rank, world, folder, way, pixels, repeats):
    """Seconds of each stage of a step, the tokens of a sample's prompt and the peak resident memory (MB) of this
    rank."""
    cfg = train.Config(model=folder, max_new_tokens=16, image_min_pixels=256, image_max_pixels=pixels**2)
    image = Image.new("RGB", (pixels, pixels), reward.COLOURS["g"])
    item = {"prompt": [{"role": "user", "content": [{"type": "image"}, *QUESTION]}], "images": [image]}
    tokenizer, config = checkpoint.tokenizer_and_config(folder)
    files = checkpoint.weight_files(folder)
    par = launch.parallel_groups("cpu", 1)
    tower = vision.load_tower(cfg, [item], files, torch.device("cpu"))
    model = train.build_model(config, par.mesh, torch.device("cpu"), tower=tower)
    checkpoint.load_weights([model], files, cfg, config, par.world_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine = engines.start_engine(cfg, config, par, torch.device("cpu"), tower)
    prompt_ids, images = vision.encode_prompt(tokenizer, item, cfg)
    if way != "image":  # the question alone, or with a word repeated in the image's place, as many tokens
        text_ids = reward.encode_prompt(tokenizer, [{"role": "user", "content": QUESTION}], False)
        missing = len(prompt_ids) - len(text_ids)
        filler = tokenizer(" square" * missing, add_special_tokens=False).input_ids[:missing]
        prompt_ids = text_ids if way == "text" else text_ids[:3] + filler + text_ids[3:]
        images = None
    seconds = {"rollout": [], "logprobs": [], "train": [], "push": []}
    for _ in range(repeats + 1):
        samples = [train.Sample(prompt_ids, images=images) for _ in range(4 * 4)]
        start = time.perf_counter()
        engines.extend_samples(engine, samples, [cfg.max_new_tokens] * len(samples), [], 1.0, 0, 0, cfg)
        for s in samples:
            s.advantage = 1.0
        rolled = time.perf_counter()
        for s, logprobs in zip(samples, train.policy_logprobs(model, samples, cfg, par)):
            s.old_logprobs = logprobs
        scored = time.perf_counter()
        train.train_on_rollouts(model, optimizer, samples, cfg, par)
        trained = time.perf_counter()
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
        pushed = time.perf_counter()
        for name, taken in zip(seconds, (rolled - start, scored - rolled, trained - scored, pushed - trained)):
            seconds[name].append(taken)
    medians = {name: statistics.median(values[1:]) for name, values in seconds.items()}
    return medians, len(prompt_ids), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pixels", type=int, default=64, help="the image's side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp()
    save_model(folder)
    results = {}
    for way in ("image", "text", "padded"):
        results[way] = run_ranks(step, 2, folder, way, args.pixels, args.repeats, timeout=1800)[0]
    print(f"\na step of 8 prompts x 4 samples of 16 tokens, 2 gloo ranks, a {args.pixels}-pixel image, seconds:")
    header = ("tokens", 7), ("rollout", 8), ("logprobs", 9), ("train", 7), ("push", 7), ("step", 7), ("/text", 6)
    print(" " * 8 + "".join(f" {name:>{width}}" for name, width in header) + f" {'MB':>6}")
    text_step = sum(results["text"][0].values())
    for way, (medians, tokens, peak) in results.items():
        total = sum(medians.values())
        values = " ".join(f"{medians[name]:{width}.3f}" for name, width in zip(medians, (8, 9, 7, 7)))
        print(f"{way:8} {tokens:7d} {values} {total:7.3f} {total / text_step:6.2f} {peak:6.0f}")


if __name__ == "__main__":
    main()
