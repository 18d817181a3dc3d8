"""Prompts with images, on the tiny Qwen3.5 vision-language model (--model tiny-qwen3.5-vl: a vision tower of one
block, 4 x 4 pixels a patch, 2 x 2 patches a token) and the colours task: the prompt's ids and pixel values as
transformers' own Qwen3-VL processor makes them; the HF engine's log-probs equal to the trainer's forward with the
tower's features and the 4-row positions, at tp 1 and 2; no vision token sampled where it would be the likeliest, the
log-probs renormalised without them as a float64 reference; image tokens without their pixel values refused; and
through torchrun, the model learns the colours above its control whose images hide them."""

import json
import math
import os
import re
import types

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForImageTextToText

import architectures
import checkpoint
import engines
import hub_models
import launch
import reward
import task_data
import train
import vision
import vocab_parallel
from demo_model import ImageOnlyProcessor
from test_checkpoint import hf_weights, logged
from test_train import ROOT, copy_project, metrics_lines, torchrun
from workers import run_ranks

CFG = dict(model="tiny-qwen3.5-vl", task="colours", image_min_pixels=256, image_max_pixels=4096, max_new_tokens=6)
FLAGS = ("--model", "tiny-qwen3.5-vl", "--task", "colours", "--image_min_pixels", "256", "--image_max_pixels", "4096")


def colour_items(n, cfg):
    """The colours task's first n held-out items: an image each, and the same text."""
    cfg = train.Config(**{**vars(cfg), "train_size": 20, "test_size": n, "prompts_per_step": 2})
    return list(reward.PromptDataset(cfg, "test"))


def test_an_image_prompt_is_encoded_as_transformers_qwen3_vl_processor_encodes_it():
    """Two images of other sizes in one prompt: each placeholder expanded to its image's tokens, and the pixel
    values and grid of the checkpoint's image processor, as the processor gives them; a prompt that places more
    images than it holds is refused."""
    cfg = train.Config(**CFG)
    tokenizer = checkpoint.tiny_tokenizer(cfg.model)
    images = [item["images"][0] for item in colour_items(2, cfg)]
    images[1] = images[1].resize((40, 24))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    ids, inputs = vision.encode_prompt(tokenizer, {"prompt": prompt, "images": images}, cfg)
    processor = ImageOnlyProcessor(
        image_processor=vision.image_processor(cfg.model, cfg.image_min_pixels, cfg.image_max_pixels),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    want = processor(text=[text], images=images, return_tensors="pt")
    assert ids == want["input_ids"][0].tolist() and ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 31
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])
    assert inputs["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 8, 8], [1, 6, 10]]
    with pytest.raises(SystemExit, match="places 2 images .* and holds 1"):
        vision.encode_prompt(tokenizer, {"prompt": prompt, "images": images[:1]}, cfg)


def engine_and_trainer(rank, world, tp, boost=0.0):
    """Responses to colour prompts from the HF engine's vision-language model, and the trainer's log-probs of them
    (its text model sharded over tp, the tower's features in the image pads, 4-row positions). `boost` raises the
    image pad's logit above every other's (its lm_head row scaled): a token the engines must never sample."""
    cfg = train.Config(**CFG, tp=tp, temperature=0.9)
    items = colour_items(6, cfg)
    tokenizer, config = checkpoint.load_tokenizer_and_config(cfg, items)
    par = launch.parallel_groups("cpu", tp)
    tower = vision.load_tower(cfg, items, [None], torch.device("cpu"))
    model = train.build_model(config, par.mesh, torch.device("cpu"), tower=tower)
    checkpoint.load_weights([model], [None], cfg, config, par.world_group)
    if boost:  # the image pad's LM head row along the hidden states' mean: its logit above every other's
        prompt_ids, images = vision.encode_prompt(tokenizer, items[0], cfg)
        model.images = [images]
        ids = torch.tensor([prompt_ids + [5]])
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
            mean = hidden.hidden_states[-1][0].mean(0)
            model.reshard()  # FSDP keeps root parameters whole after a forward without backward
            model.lm_head.weight.to_local()[tower.vlm_config.image_token_id] = boost * mean / mean.norm()
    engine = engines.start_engine(cfg, config, par, torch.device("cpu"), tower)
    engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)

    def sample():
        prompts = [vision.encode_prompt(tokenizer, item, cfg) for item in items]
        samples = [train.Sample(prompt_ids, images=images) for prompt_ids, images in prompts]
        stop = reward.stop_token_ids(tokenizer)
        engines.extend_samples(engine, samples, [cfg.max_new_tokens] * len(samples), stop, 0.9, 3, 0, cfg)
        return samples

    samples = launch.on_first_rank(par.tp_group, sample)
    with torch.no_grad():
        logp = train.response_logprobs(model, samples, cfg, par.mesh["tp"])[0]
        model.banned_ids, banned = None, model.banned_ids  # the same forward, the ban lifted: the likeliest token
        model.images = [s.images for s in samples]
        ids, mask = launch.padded([s.prompt_ids + s.response_ids for s in samples], torch.device("cpu"))
        logits = model(input_ids=ids, attention_mask=mask).logits
        likeliest = logits[mask.bool()].argmax(-1)
    return samples, logp, banned, likeliest


@pytest.mark.parametrize("tp", [1, 2])
def test_the_trainers_log_probs_with_images_equal_the_engines(tp):
    """The HF engine generates with the pixel values (transformers' vision-language model); the trainer runs its
    text model on the tower's features in the image pads, with transformers' get_rope_index's positions: the same
    log-probs at float noise, at tp 1 and 2."""
    for samples, logp, *_ in run_ranks(engine_and_trainer, tp, tp):
        engine_logp = torch.cat([s.engine_logprobs for s in samples])
        assert len(logp) == len(engine_logp) > 6
        assert (logp - engine_logp).abs().max() < 1e-5


def test_no_vision_token_is_sampled_where_it_is_the_likeliest_and_log_probs_renormalise_without_them():
    """The image pad's logit raised above every token's: no engine samples a vision token; the engine's and the
    trainer's log-probs are of the softmax without them (float64 from the definition), and the trainer's forward on
    those responses runs (a sampled pad would have asked for an image that is not there)."""
    samples, logp, banned, likeliest = run_ranks(engine_and_trainer, 1, 1, 50.0)[0]
    assert (likeliest == banned[0]).float().mean() > 0.9  # the image pad, where nothing banned it
    sampled = [t for s in samples for t in s.response_ids]
    assert not set(sampled) & set(banned) and len(sampled) > 6
    engine_logp = torch.cat([s.engine_logprobs for s in samples])
    assert (logp - engine_logp).abs().max() < 1e-5
    assert engine_logp.max() < 0 and torch.isfinite(logp).all()


def banned_logprobs(rank, world, tp):
    """Log-probs, entropies and the gradient of a mix of both, the vision tokens banned: the trainer's (float32,
    the vocabulary sharded over tp) and, at tp 0, float64 from the definition."""
    torch.manual_seed(0)
    hidden = torch.randn(5, 16, dtype=torch.float64)
    weight = torch.randn(11, 16, dtype=torch.float64)
    targets = torch.tensor([0, 4, 10, 2, 9])
    banned = [1, 7, 8]  # in both ranks' slices at tp 2
    if tp == 0:
        w = weight.clone().requires_grad_()
        logits = (hidden @ w.T).index_fill(1, torch.tensor(banned), -math.inf)
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    else:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
        w = distribute_tensor(weight.float(), tp_mesh, [Shard(0)]).requires_grad_()
        h = DTensor.from_local(hidden.float(), tp_mesh, [Replicate()])
        logp, entropy, _ = vocab_parallel.logprobs_and_entropy(h, w, targets, 1.0, tp_mesh, banned=banned)
    (logp @ torch.arange(5.0).to(logp.dtype) + entropy.sum()).backward()
    grad = w.grad.full_tensor() if hasattr(w.grad, "full_tensor") else w.grad
    return logp.detach().double(), entropy.detach().double(), grad.double()


@pytest.mark.parametrize("tp", [1, 2])
def test_log_probs_and_entropy_without_the_banned_ids_equal_the_definition_in_float64(tp):
    want = run_ranks(banned_logprobs, 1, 0)[0]
    for got in run_ranks(banned_logprobs, tp, tp):
        for value, expected in zip(got, want):
            assert (value - expected).abs().max() < 1e-5


def image_tokens_without_pixels(rank, world):
    cfg = train.Config(**CFG)
    items = colour_items(2, cfg)
    tokenizer, config = checkpoint.load_tokenizer_and_config(cfg, items)
    par = launch.parallel_groups("cpu", 1)
    tower = vision.load_tower(cfg, items, [None], torch.device("cpu"))
    model = train.build_model(config, par.mesh, torch.device("cpu"), tower=tower)
    checkpoint.load_weights([model], [None], cfg, config, par.world_group)
    samples = []
    for item in items:
        ids, images = vision.encode_prompt(tokenizer, item, cfg)
        samples.append(train.Sample(ids, response_ids=[5, 6], sampled=[True, True], images=images))
    errors = []
    for dropped in ([1], [0, 1]):  # one sample's pixel values, then every sample's: the image tokens kept
        for i in dropped:
            samples[i].images = None
        try:
            train.response_logprobs(model, samples, cfg, par.mesh["tp"])
            errors.append("ran")
        except RuntimeError as error:
            errors.append(str(error))
    return errors


def test_image_tokens_without_their_pixel_values_are_refused_not_run_as_text():
    assert run_ranks(image_tokens_without_pixels, 1)[0] == [
        "32 image tokens and 16 image features: an image was dropped",
        "32 image tokens and 0 image features: an image was dropped",
    ]


def test_the_vision_language_class_takes_the_pushed_weights_under_its_own_names():
    """The HF engine's copy: every text weight the trainer pushes lands in the vision-language class."""
    config = checkpoint.tiny_config("tiny-qwen3.5-vl")
    vlm = AutoModelForImageTextToText.from_config(config)
    names = set(vlm.state_dict())
    text = checkpoint.tiny_tokenizer_and_config("tiny-qwen3.5-vl", 0)[1]
    trainer = train.AutoModelForCausalLM.from_config(text)
    assert {vision.vlm_name(name) for name in trainer.state_dict()} <= names


def test_train_vision_on_a_task_without_images_is_refused_naming_the_flag():
    cfg = train.Config(model="tiny-qwen3.5-vl", task="toy", train_vision=True)
    with pytest.raises(SystemExit, match="--train_vision trains a vision tower, and --task toy's items hold no images"):
        vision.load_tower(cfg, [{"prompt": "Say a:"}], [None], torch.device("cpu"))


def test_the_push_check_refuses_a_tower_weight_that_sglangs_vision_language_class_would_not_load():
    """--engine sglang pushes the vision tower too: at start, every tower weight's name and shape is checked against
    the vision-language class (architectures.check_engine_names), and one it would skip is refused by name."""
    cfg = train.Config(**CFG)
    text = checkpoint.tiny_tokenizer_and_config(cfg.model, 0)[1]
    tower = vision.load_tower(cfg, colour_items(1, cfg), [None], torch.device("cpu"))
    model = train.AutoModelForCausalLM.from_config(text)
    architectures.check_engine_names(model, text, 1 << 20, tower)
    tower.merger.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(SystemExit, match=r"model\.visual\.merger\.extra as \[3\]; .* loads no such weight"):
        architectures.check_engine_names(model, text, 1 << 20, tower)


def test_the_tiny_vision_language_model_learns_the_colours_above_its_control_whose_images_hide_them(tmp_path):
    flags = (*FLAGS, "--preset", "cpu", "--steps", "60", "--lr", "3e-3", "--max_new_tokens", "4")
    flags += ("--eval_every", "20", "--eval_prompts", "96", "--sample_every", "0")
    accuracy = {}
    for blank in (0, 1):
        run = torchrun(2, *flags, "--task_args", f"blank={blank}", "--out_dir", str(tmp_path / str(blank)))
        assert run.returncode == 0, run.stderr[-3000:]
        evals = [row["eval_greedy_acc"] for row in metrics_lines(tmp_path / str(blank)) if "eval_greedy_acc" in row]
        accuracy[blank] = max(evals[1:])
    assert accuracy[0] > 0.8 and accuracy[1] < 0.5, accuracy


def straight_and_resumed(tmp_path, flags):
    """4 steps straight (tmp_path/straight), and 2 steps then --resume auto to 4 (tmp_path/split), under torchrun on
    2 ranks: the logged metrics of the straight run, which the split run's must equal."""
    straight = torchrun(2, *flags, "--steps", "4", "--out_dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    for steps in ("2", "4"):
        split = torchrun(2, *flags, "--steps", steps, "--resume", "auto", "--out_dir", str(tmp_path / "split"))
        assert split.returncode == 0, split.stderr[-3000:]
    rows = logged(tmp_path / "straight")
    assert logged(tmp_path / "split") == rows
    return rows


def test_a_response_in_flight_keeps_its_images_through_a_resume_and_lora_trains_beside_the_frozen_tower(tmp_path):
    """--partial_rollouts, responses carried over steps and across a save: 2 steps + resume + 2 steps log what 4
    steps log (the carried responses' images in in_flight.pt). LoRA on the same task: the adapters train, the tower
    stays frozen."""
    flags = (*FLAGS, "--preset", "cpu", "--max_new_tokens", "4", "--eval_every", "0", "--sample_every", "0")
    flags += ("--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "2", "--lr", "3e-3")
    rows = straight_and_resumed(tmp_path, flags)
    assert (tmp_path / "split" / "checkpoints" / "step_000002" / "in_flight.pt").exists()
    assert max(row["responses_carried"] for row in rows) > 0
    lora = torchrun(2, *FLAGS, "--preset", "cpu", "--steps", "2", "--lora_rank", "4", "--out_dir", str(tmp_path / "l"))
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert all(row["mismatch_abs"] < 1e-4 for row in metrics_lines(tmp_path / "l") if "mismatch_abs" in row)


def test_a_trained_tower_reaches_the_engine_every_step_and_resumes_exactly(tmp_path):
    """--train_vision, with a reference model (--beta): the tower moves, the HF engine samples with the pushed tower
    (the trainer's log-probs equal the engine's to float noise at every step, which a stale tower in the engine
    would break from the second step), the reference starts as the policy (KL 0 at step 1), and 2 steps + resume +
    2 steps log what 4 steps log."""
    flags = (*FLAGS, "--preset", "cpu", "--max_new_tokens", "4", "--eval_every", "0", "--sample_every", "0")
    flags += ("--train_vision", "true", "--beta", "0.04", "--lr", "3e-3", "--save_every", "2")
    rows = straight_and_resumed(tmp_path, flags)
    assert max(row["mismatch_abs"] for row in rows) < 1e-5 and rows[0]["kl"] == 0
    cfg = train.Config(**CFG)
    first = vision.load_tower(cfg, colour_items(1, cfg), [None], torch.device("cpu")).state_dict()
    trained = hf_weights(tmp_path / "straight", 4)
    moved = [(trained["model.visual." + name] - weight).abs().max().item() for name, weight in first.items()]
    assert min(moved) > 0, moved
    # Resumed without the flag, the tower's trained weights would be left behind: refused, naming it.
    step_dir = str(tmp_path / "straight" / "checkpoints" / "step_000004")
    cfg = train.Config(**CFG, resume=step_dir, steps=6, out_dir=str(tmp_path / "again"))
    text = checkpoint.tiny_tokenizer_and_config(cfg.model, 0)[1]
    with pytest.raises(SystemExit, match=f"^--resume {step_dir} was trained with --train_vision True"):
        checkpoint.find_resume(cfg, text)


def test_the_export_of_a_trained_tower_keeps_the_hub_layout_and_transformers_loads_it_trained(tmp_path):
    """A checkpoint's hf/ folder (checkpoint.write_hub_layout) of a Qwen3.5 folder whose tower was trained with the
    text model (--train_vision): the source's tensor names and dtypes, the MTP weights as they were, and
    transformers' AutoModelForImageTextToText loads it with the trained weights in every parameter, the tower's
    included."""
    source = hub_models.save_tiny_vision_language_model(tmp_path / "source")
    text = hub_models.text_model(source)
    original = {name: w.detach() for name, w in text.named_parameters()}
    original |= dict(vision.tower_weights(trainer_tower(source), torch.float32))
    generator = torch.Generator().manual_seed(1)
    trained = {name: w + 0.01 * torch.randn(w.shape, generator=generator) for name, w in original.items()}
    checkpoint.write_hub_layout(str(tmp_path / "hf"), trained, text.config, str(source))
    written, before = (safetensors_of(tmp_path / folder) for folder in ("hf", "source"))
    assert {k: t.dtype for k, t in written.items()} == {k: t.dtype for k, t in before.items()}
    assert all(torch.equal(written[k], before[k]) for k in written if k.startswith("mtp."))
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(loaded[vision.vlm_name(name)], weight) for name, weight in trained.items())


def trainer_tower(folder):
    """The frozen tower of a Qwen3.5 folder, as main loads it."""
    cfg = train.Config(**{**CFG, "model": str(folder)})
    return vision.load_tower(cfg, [{"images": ["an image"]}], checkpoint.weight_files(cfg.model), torch.device("cpu"))


def safetensors_of(folder):
    """Every tensor of a folder's safetensors files, by key."""
    return {k: v for file in folder.glob("*.safetensors") for k, v in load_file(file).items()}


def test_routing_replay_with_images_on_an_moe_vision_language_model_at_tp_2_resumes_exactly(tmp_path):
    """tiny-qwen3.5-moe-vl at tp 2 with --routing_replay on and partial rollouts: the engine's routing of the image
    tokens (its positions count the expanded prompt) replayed with the rest, so the trainer's log-probs equal the
    engine's at every step; every engine row usable; and 2 steps + resume + 2 steps log what 4 steps log."""
    flags = ("--model", "tiny-qwen3.5-moe-vl", *FLAGS[2:], "--preset", "cpu", "--tp", "2", "--max_new_tokens", "4")
    flags += ("--routing_replay", "on", "--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "2")
    flags += ("--eval_every", "0", "--sample_every", "0", "--save_every", "2", "--lr", "3e-3")
    rows = straight_and_resumed(tmp_path, flags)
    assert max(row["mismatch_abs"] for row in rows) < 1e-5
    assert max(row["routing_unusable"] for row in rows) == 0 and max(row["responses_carried"] for row in rows) > 0


def test_the_geometry3k_recipe_of_docs_tasks_md_runs_on_a_local_parquet_of_its_schema(tmp_path):
    """docs/tasks.md's recipe, done to a copy of reward.py as a user would (its __getitem__ and reward_fn branches),
    on a folder of train and test parquet files of geometry3k's schema (a list of figures in the Image feature,
    "<image>" in the problem): its command, on the tiny model and the CPU, runs 2 steps and scores by math-verify."""
    import datasets
    from PIL import Image, ImageDraw

    with open(os.path.join(ROOT, "docs", "tasks.md")) as f:
        text = f.read()
    recipe = text[text.index("### A recipe: geometry3k") : text.index("## A task from a library")]
    getitem_branch, reward_branch = re.findall(r"```python\n(.*?)```", recipe, re.S)
    [command] = [line for line in recipe.splitlines() if line.startswith("torchrun")]
    with open(os.path.join(ROOT, "reward.py")) as f:
        source = f.read()
    for anchor, branch in (
        ('        if task == "toy":', getitem_branch),
        ('    raise ValueError(f"unknown task', reward_branch),
    ):
        assert source.count(anchor) == 1, anchor
        source = source.replace(anchor, branch + anchor)
    copy_project(tmp_path, source)
    features = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    for split, n in (("train", 8), ("test", 4)):
        figures, problems, answers = [], [], []
        for i in range(n):
            figure = Image.new("RGB", (40 + 8 * i, 32), "white")
            ImageDraw.Draw(figure).line([(2, 30), (30 + 8 * i, 2)], fill="black", width=2)
            figures.append([figure])
            problems.append(f"<image>Find x, where the line rises {i + 1}.")
            answers.append(str(i + 1))
        data = datasets.Dataset.from_dict(dict(images=figures, problem=problems, answer=answers), features=features)
        data.to_parquet(str(tmp_path / "geo" / f"{split}.parquet"))
    flags = command.split("train.py ")[1].split()
    flags += ["--model", "tiny-qwen3.5-vl", "--data_path", str(tmp_path / "geo"), "--steps", "2", "--max_new_tokens"]
    flags += ["8", "--image_min_pixels", "256", "--image_max_pixels", "4096", "--prompts_per_step", "2"]
    flags += ["--group_size", "2", "--eval_prompts", "4", "--sample_every", "1", "--out_dir", str(tmp_path / "out")]
    run = torchrun(2, *flags, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics_lines(tmp_path / "out")
    assert [row["step"] for row in rows] == [0, 1, 2] and all(row.get("reward_errors", 0) == 0 for row in rows)
    assert "[image: " in run.stdout and "Find x, where the line rises" in run.stdout  # a sample: its figure named


def test_jsonl_rows_that_name_image_files_beside_them_are_read_as_rows_and_their_images_opened(tmp_path):
    """A --data_path folder of train.jsonl and test.jsonl whose rows name image files under it, named after the
    splits (images/train_0.png): the rows are the jsonl's (datasets would otherwise read the folder as images
    alone), and each image opens from its path under --data_path, or from its bytes."""
    from PIL import Image

    (tmp_path / "images").mkdir()
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i, colour in enumerate("rgb"):
                Image.new("RGB", (8 + i, 8), reward.COLOURS[colour]).save(tmp_path / "images" / f"{split}_{i}.png")
                f.write(json.dumps({"image": f"images/{split}_{i}.png", "colour": colour}) + "\n")
    cfg = train.Config(**CFG, data_path=str(tmp_path))
    rows = task_data.load_rows(types.SimpleNamespace(args={}), "test", cfg)
    assert rows == [{"image": f"images/test_{i}.png", "colour": c} for i, c in enumerate("rgb")]
    image = vision.open_image(rows[2]["image"], cfg.data_path)
    assert image.size == (10, 8) and image.getpixel((0, 0)) == reward.COLOURS["b"]
    with open(tmp_path / "images" / "test_2.png", "rb") as f:
        data = f.read()
    assert vision.open_image({"bytes": data, "path": None}, "").getpixel((0, 0)) == reward.COLOURS["b"]


def image_step(rank, world, dp, tp, train_vision):
    """One SGD step of train_on_rollouts on colour prompts (4 a rank, random responses and advantages), the text
    model sharded over (dp, tp) beside the frozen tower (or with its trained copy, sharded with it), against the
    formula on transformers' vision-language model whole: its own forward with the pixel values, the vision tokens'
    logits -inf, the token-mean surrogate at ratio 1, the grad norm clipped. Returns the largest difference of the
    weights after the step, both norms, and how far the step moved the tower."""
    cfg = train.Config(**CFG, tp=tp, micro_batch_size=3, max_grad_norm=0.05, train_vision=train_vision)
    items = colour_items(4 * dp, cfg)
    tokenizer, config = checkpoint.load_tokenizer_and_config(cfg, items)
    par = launch.parallel_groups("cpu", tp)
    tower = vision.load_tower(cfg, items, [None], torch.device("cpu"))
    model = train.build_model(config, par.mesh, torch.device("cpu"), tower=tower)
    checkpoint.load_weights([model], [None], cfg, config, par.world_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # before the first forward
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    start = {name: tensor.clone() for name, tensor in full.items()}  # at dp 1, views of what the step changes
    g = torch.Generator().manual_seed(5)
    samples = []
    for item in items:
        prompt_ids, images = vision.encode_prompt(tokenizer, item, cfg)
        response = torch.randint(3, 90, (int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist()
        advantage = torch.randn((), generator=g).item()
        sampled = [True] * len(response)
        logprobs = torch.zeros(len(response))
        samples.append(train.Sample(prompt_ids, response, sampled, logprobs, advantage=advantage, images=images))
    mine = samples[par.dp_rank * 4 : (par.dp_rank + 1) * 4]
    _, maxima = train.train_on_rollouts(model, optimizer, mine, cfg, par)
    after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = AutoModelForImageTextToText.from_config(tower.vlm_config)
    reference.load_state_dict({vision.vlm_name(name): w for name, w in start.items()}, strict=False)
    reference.model.visual.load_state_dict(tower.state_dict())
    reference.tie_weights()
    reference.model.visual.requires_grad_(train_vision)
    tokens = sum(len(s.response_ids) for s in samples)
    loss = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = reference(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=s.images["pixel_values"],
            image_grid_thw=s.images["image_grid_thw"],
            mm_token_type_ids=(ids == tower.vlm_config.image_token_id).long(),
        ).logits[0, len(s.prompt_ids) - 1 : -1]
        logits = logits.index_fill(1, torch.tensor(vision.vision_token_ids(tower.vlm_config)), -math.inf)
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        loss = loss - (s.advantage * logp).sum() / tokens  # the ratio's value is 1, its gradient log p's
    loss.backward()
    text = [p for name, p in reference.named_parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(text, 0.05).item()
    with torch.no_grad():
        for p in text:
            p -= 0.1 * p.grad
    expected = {name: reference.state_dict()[vision.vlm_name(name)] for name in after}
    weights = max((after[name] - expected[name]).abs().max().item() for name in after)
    tower = [(after[name] - start[name]).abs().max().item() for name in after if ".visual." in name]
    return weights, maxima["grad_norm"], norm, max(tower, default=None)


@pytest.mark.parametrize(
    "dp,tp,train_vision",
    [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (1, 1, True), (2, 2, True)],
    ids=["1x1", "2x1", "1x2", "2x2", "1x1-train_vision", "2x2-train_vision"],
)
def test_a_sharded_step_on_image_prompts_equals_the_vision_language_models_own_step(dp, tp, train_vision):
    """At --dp x --tp, the frozen tower beside the sharded text model, or (--train_vision) its copy sharded and
    trained with it: the step equals the whole model's to 1e-5, the tower's weights too, which the step moved."""
    for weights, sharded_norm, norm, tower in run_ranks(image_step, dp * tp, dp, tp, train_vision):
        assert sharded_norm == pytest.approx(norm, rel=1e-4) and norm > 0.05  # the clipping scaled the step
        assert weights < 1e-5
        assert (tower is not None and tower > 1e-4) if train_vision else tower is None
