"""Weights in and out of files, for train.py: the model (tokenizer, config, first weights) from an HF folder or
the hub, and the checkpoints that let a run stop and go on exactly.

A checkpoint is a folder checkpoints/step_N under --out_dir:
    dcp/                 the trained parameters and their AdamW state, sharded as the ranks hold them (exact resume)
    in_flight.pt         with --partial_rollouts: the responses still being generated, by dp rank, with their versions
    hf/                  the policy as a transformers folder (LoRA merged in), which loads in transformers and engines
    adapter/             with --lora_rank: the adapters alone, in PEFT's layout
    trainer_state.json   the step, the flags, wandb's run id and every file's size (a damaged checkpoint is seen)
It is written as step_N.tmp and renamed when whole, so a crash or a power cut leaves the old checkpoint or the new.

This is machinery a researcher rarely edits. train.py calls it to load (load_tokenizer_and_config, weight_files,
load_weights), to open the run's folder and find the checkpoint to resume (open_run), to resume (resume) and to save
(save).
"""

import dataclasses
import functools
import glob
import json
import math
import os
import pathlib
import shutil
import textwrap

import huggingface_hub
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import snapshot_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from safetensors.torch import safe_open, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen2Config,
    Qwen2Tokenizer,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

import architectures
import engines
import launch
import vision

# ----------------------------------------------------------------------------------------------------------------
# The model: its tokenizer, config and first weights


def check_sources(cfg):
    """On rank 0, before anything is read: --model and --data_path. A local folder's jsonl files must hold a JSON
    object a line (the first that does not is named by file and line). A name that is no local folder is a hub id:
    said so at once, and the hub asked once with a short timeout, so a mistyped path fails in seconds rather than
    after the hub's retries (with HF_HUB_OFFLINE=1, the loaders read the hub's cache alone)."""
    jsonl_files = []
    if cfg.data_path:
        jsonl_files = sorted(glob.glob(os.path.join(cfg.data_path, "*.jsonl")))
    for path in jsonl_files:
        why = first_bad_json_line(path)
        if why:
            raise SystemExit(f"--data_path {cfg.data_path}: {why}: fix or remove that line")
    for flag, name, kind in (("--model", cfg.model, "model"), ("--data_path", cfg.data_path, "dataset")):
        if name == "" or name in TINY_MODELS or os.path.exists(name) or huggingface_hub.constants.HF_HUB_OFFLINE:
            continue
        try:
            huggingface_hub.utils.validate_repo_id(name)  # a path like /a/b or ./a names no hub repository
        except HFValidationError:
            raise SystemExit(f"{flag} {name}: no such local folder (nor a hub id, org/name): check the path") from None
        print(
            f"{flag} {name}: no local folder of that name, so a {kind} of the Hugging Face hub: asking it", flush=True
        )
        try:
            huggingface_hub.repo_info(name, repo_type=kind, timeout=10)
        except GatedRepoError:
            pass  # it is there: loading it needs a token, and says so
        except RepositoryNotFoundError:
            raise SystemExit(f"{flag} {name}: no such local folder, nor a {kind} on the hub: check the name") from None
        except HfHubHTTPError:
            pass  # the hub answered: the loader reports what went wrong, or retries
        except Exception as error:  # no network, or none to the hub
            raise SystemExit(
                f"{flag} {name}: no such local folder, and the hub cannot be reached ({type(error).__name__}: "
                f"{error}): check the path, or the network"
            ) from None


def first_bad_json_line(path):
    """Where the first line of a jsonl file that is not a JSON object is, and why ("file, line N: why"); "" if none."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:  # a cut line, bad UTF-8 (UnicodeDecodeError is a ValueError)
                return f"{path}, line {number}: {error}"
            if not isinstance(row, dict):
                return f"{path}, line {number}: not a JSON object"
    return ""


def tokenizer_and_config(model, lora_rank=0):
    """--model's tokenizer and the config of the model the trainer builds (architectures.text_config: a
    vision-language checkpoint's text model), from its folder or the hub; "tiny" and its siblings (TINY_MODELS):
    made here (tiny_tokenizer_and_config)."""
    if model in TINY_MODELS:
        return tiny_tokenizer_and_config(model, lora_rank)
    try:
        return AutoTokenizer.from_pretrained(model), architectures.text_config(AutoConfig.from_pretrained(model))
    except (OSError, ValueError) as error:  # a name that is no folder here is looked up on the hub
        first_line = str(error).splitlines()[0]
        raise SystemExit(f"--model {model}: not a model's folder, nor a hub id: {first_line}") from None


def load_tokenizer_and_config(cfg, items):
    """--model's tokenizer and config, checked against the items' prompts and the flags: a sample must fit the
    model's context and a micro-batch, and --routing_replay needs routed experts."""
    tokenizer, config = tokenizer_and_config(cfg.model, cfg.lora_rank)
    longest = max(len(vision.encode_prompt(tokenizer, item, cfg)[0]) for item in items)  # with images' tokens
    sample_tokens = longest + cfg.max_new_tokens
    if sample_tokens > config.max_position_embeddings - 6:  # SGLang fails a batch with an input of C - 6
        raise SystemExit(
            f"the longest prompt ({longest} tokens) and --max_new_tokens {cfg.max_new_tokens} exceed the context "
            f"length {config.max_position_embeddings} less 6 (SGLang's margin): lower one of them"
        )
    if cfg.routing_replay != "off" and not getattr(config, "num_experts", 0):
        raise SystemExit(
            f"--routing_replay {cfg.routing_replay}: --model {cfg.model} is a {config.model_type} model, without "
            "routed experts to replay: drop the flag"
        )
    if 0 < cfg.max_tokens_per_microbatch < sample_tokens:  # a sample must fit one micro-batch
        raise SystemExit(
            f"--max_tokens_per_microbatch {cfg.max_tokens_per_microbatch} is below the longest sample: {longest} "
            f"prompt tokens + --max_new_tokens {cfg.max_new_tokens}; raise it or lower those"
        )
    return tokenizer, config


# --model tiny, the CPU demo's random 2-layer Qwen2, and its siblings, one of each architecture: each a config class
# and its fields beyond the shared shape (TINY_SHAPE). The Gated DeltaNet models: a linear layer, then a full one.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY_SHAPE.update(num_key_value_heads=2, max_position_embeddings=2048)  # room for a prompt in the plain template
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
TINY_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, head_dim=16)
TINY_LINEAR.update(linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
# tiny-qwen3.5-vl: Qwen3.5's vision-language model, its text model tiny-qwen3.5's, a vision tower of one block whose
# processor makes an image 4 x 4 pixels a patch, 2 x 2 patches a token.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
TINY_VISION.update(spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
TINY_MODELS = {
    "tiny": (Qwen2Config, dict(tie_word_embeddings=True)),
    "tiny-qwen3-moe": (Qwen3MoeConfig, dict(TINY_MOE, tie_word_embeddings=False)),
    "tiny-qwen3.5": (Qwen3_5TextConfig, dict(TINY_LINEAR, tie_word_embeddings=True)),
    "tiny-qwen3.5-moe": (Qwen3_5MoeTextConfig, dict(TINY_LINEAR, **TINY_MOE, shared_expert_intermediate_size=64)),
    "tiny-qwen3-next": (Qwen3NextConfig, dict(TINY_LINEAR, **TINY_MOE, shared_expert_intermediate_size=64)),
    "tiny-qwen3.5-vl": (
        Qwen3_5Config,
        dict(vision_config=TINY_VISION, text_config=TINY_LINEAR, tie_word_embeddings=True),
    ),
    "tiny-qwen3.5-moe-vl": (
        Qwen3_5MoeConfig,
        dict(vision_config=TINY_VISION, text_config=dict(TINY_LINEAR, **TINY_MOE, shared_expert_intermediate_size=64)),
    ),
}
# A chat template that places images as Qwen's does: a tiny vision-language model's, whose prompts are chat messages.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer_and_config(model, lora_rank):
    """--model tiny (or a sibling of TINY_MODELS), the CPU demo's: a character tokenizer and the config of the
    random text model. Its weights are drawn in load_weights."""
    return tiny_tokenizer(model), architectures.text_config(tiny_config(model, lora_rank))  # SGLang reads its class


def tiny_tokenizer(model):
    """The tiny models' character tokenizer: printable ASCII (" " is Ġ); a vision-language one's has the vision
    tokens too, and a chat template that places images."""
    chars = []
    for code in [*range(9, 14), *range(32, 127)]:
        chars.append(chr(code) if code > 32 else chr(256 + code))
    specials = ["<|im_start|>"]
    if model.endswith("-vl"):
        specials += ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, *specials[1:]]
    return Qwen2Tokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
        chat_template=TINY_CHAT_TEMPLATE if model.endswith("-vl") else None,
    )


def tiny_config(model, lora_rank=0):
    """The config of a tiny model of TINY_MODELS, as its checkpoint's would be: a vision-language model's holds its
    text model's in text_config, and its vision tokens' ids."""
    tokenizer = tiny_tokenizer(model)
    vocab = tokenizer.get_vocab()
    config_class, fields = TINY_MODELS[model]
    text = dict(
        vocab_size=len(tokenizer),
        eos_token_id=[vocab["<|endoftext|>"], vocab["<|im_end|>"]],  # both end a response, as for Qwen
        pad_token_id=0,
        # Frozen under LoRA: wide enough that the adapters can move the logits.
        initializer_range=0.2 if lora_rank else 0.02,
        **TINY_SHAPE,
    )
    if "vision_config" not in fields:
        return config_class(**text, **fields)
    ids = {f"{name}_token_id": vocab[f"<|{name}|>"] for name in ("vision_start", "vision_end")}
    ids.update(image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"])
    return config_class(**dict(fields, text_config=dict(text, **fields["text_config"])), **ids)


def model_folder(model, download=True):
    """--model's folder: itself, or the hub's snapshot of it (downloaded at start: the weights and every config,
    tokenizer and processor file, which an export copies)."""
    if os.path.isdir(model):
        return model
    return snapshot_download(
        model, allow_patterns=["*.safetensors", "*.json", "*.jinja", "*.txt"], local_files_only=not download
    )


def weight_files(model):
    """On rank 0: the model*.safetensors files of --model (a hub id is downloaded), each checked to be whole; [None]
    for --model tiny and its siblings, whose weights are random."""
    if model in TINY_MODELS:
        return [None]
    files = sorted(map(str, pathlib.Path(model_folder(model)).glob("model*.safetensors")))
    for file in files:
        try:
            # Reads the header, which must cover the whole file.
            safe_open(file, "pt")
        except Exception as error:  # a truncated download, a full disk at save time
            raise SystemExit(f"--model: {file} cannot be read ({error}): download or save it again") from None
    return files


def load_weights(models, files, cfg, model_config, world_group):
    """`files` (from weight_files; [None] for --model tiny*: random weights) into the sharded models, read by rank 0
    a batch of parameters at a time, a batch at most the largest file: host memory holds no more. The checkpoint's
    names become the trainer's by architectures.CheckpointLayout (per-expert weights stacked into fused experts, a
    vision-language checkpoint's text model taken, its vision tower and MTP weights left). LoRA's adapters are not in
    them: lora.init_adapters sets those."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    torch.manual_seed(cfg.seed)  # --model tiny: random weights, seeded with --seed
    batches = [None]
    if dist.get_rank() == 0:
        batches[0], read = weight_batches(files, model_config)
    dist.broadcast_object_list(batches, src=0, group=world_group)  # the names each batch loads
    for names in batches[0]:
        state = {name: read(name) for name in names} if dist.get_rank() == 0 else {}
        for model in models:
            # A shallow copy: set_model_state_dict replaces the dict's entries with their shards.
            set_model_state_dict(model, dict(state), options=options)
    # LoRA's adapters and a trained copy of the vision tower (vision.copy_tower) are not the text model's weights.
    expected = [name for name, _ in models[0].named_parameters() if ".lora_" not in name and ".visual." not in name]
    missing = sorted(set(expected) - {name for names in batches[0] for name in names})
    if missing:
        raise SystemExit(
            f"--model {cfg.model}: its model*.safetensors files lack {missing[:3]} ({len(missing)} tensors); "
            "save the model with save_pretrained"
        )


def weight_batches(files, config):
    """On rank 0: the model's parameter names in batches, in the files' order, each of at most the largest file's
    bytes; and read(name), a parameter's tensor, read from the files when asked for."""
    if files == [None]:
        state = AutoModelForCausalLM.from_config(config).state_dict()  # drawn from --seed
        return [list(state)], state.get
    handles = {file: safe_open(file, "pt") for file in files}
    where = {key: handle for handle in handles.values() for key in handle.keys()}
    layout = architectures.CheckpointLayout(config, where)
    budget = max(os.path.getsize(file) for file in files)
    batches = [[]]
    used = 0
    for name, sources in layout.sources.items():
        size = sum(tensor_bytes(where[key], key) for key, _ in sources)
        if batches[-1] and used + size > budget:
            batches.append([])
            used = 0
        batches[-1].append(name)
        used += size
    return batches, functools.partial(layout.parameter, read=lambda key: where[key].get_tensor(key))


# safetensors' dtypes as torch's, and their bytes per element (the 8-bit ones: 1).
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}


def tensor_bytes(handle, key):
    """The bytes of tensor `key` of an open safetensors file, from its header."""
    piece = handle.get_slice(key)
    return math.prod(piece.get_shape()) * DTYPE_BYTES.get(piece.get_dtype(), 1)


# ----------------------------------------------------------------------------------------------------------------
# The run folder: config.json, metrics.jsonl, wandb/ and checkpoints/


def open_run(cfg, model_config, notes, world_group):
    """The run in --out_dir, once every check passed (a run refused leaves the folder as it was): the checkpoint to
    resume (find_resume), the folder opened by rank 0 (open_run_dir: the flags and `notes` said, wandb started) and
    seen by every rank. Returns that checkpoint ("": none), the step to start from and wandb's run id."""
    resumed_from, start_step, wandb_id = launch.on_first_rank(world_group, find_resume, cfg, model_config)
    run_id, wandb_id = launch.on_first_rank(world_group, open_run_dir, cfg, start_step, wandb_id, notes)
    check_every_rank_sees(cfg.out_dir, run_id, world_group)
    return resumed_from, start_step, wandb_id


def open_run_dir(cfg, start_step, wandb_id, notes=()):
    """On rank 0: the flags that differ from the defaults printed, then `notes` (flags.start_notes'), wandb started
    (wandb.run, resuming the run `wandb_id`), config.json written with every flag and a new run id, and metrics.jsonl
    cut back to start_step (the steps after it run again; a fresh run, start_step 0, keeps no line: not an earlier
    run's evaluation before training). Returns the run id and wandb's (that of the run resumed, or a new one)."""
    defaults = {field.name: field.default for field in dataclasses.fields(cfg)}
    changed = [f"{key}={value}" for key, value in dataclasses.asdict(cfg).items() if value != defaults[key]]
    for line in ["config: " + " ".join(changed), *notes]:
        print(textwrap.fill(line, 120, subsequent_indent="  "), flush=True)
    config = dict(dataclasses.asdict(cfg), run_id=os.urandom(8).hex())  # new: a folder only one node sees lacks it
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        if cfg.wandb_project:
            import wandb

            wandb.init(project=cfg.wandb_project, config=config, id=wandb_id, resume="allow", dir=cfg.out_dir)
            wandb_id = wandb.run.id
        pathlib.Path(cfg.out_dir, "config.json").write_text(json.dumps(config, indent=1))
    except OSError as error:
        raise SystemExit(
            f"--out_dir {cfg.out_dir}: cannot write there ({error.strerror}): choose another folder"
        ) from None
    except Exception as error:  # wandb.init's: no API key (in a terminal it asks for one), no network
        raise SystemExit(
            f"--wandb_project {cfg.wandb_project}: {error} (log offline with WANDB_MODE=offline)"
        ) from None
    metrics = pathlib.Path(cfg.out_dir, "metrics.jsonl")
    if metrics.exists():
        kept = []
        for line in metrics.read_text().splitlines(keepends=True):
            # A line torn by a crash has no newline.
            if start_step and line.endswith("\n") and json.loads(line)["step"] <= start_step:
                kept.append(line)
        metrics.write_text("".join(kept))
    return config["run_id"], wandb_id


def append_metrics(out_dir, step, metrics):
    """On rank 0: the step's metrics as a line of metrics.jsonl, strict JSON (a value that is not finite, such as a
    skipped step's grad norm, is null)."""
    finite = {key: value if math.isfinite(value) else None for key, value in metrics.items()}
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, **finite}) + "\n")


def check_every_rank_sees(out_dir, run_id, world_group):
    """Checkpoints are written to --out_dir and read by every rank: each must see rank 0's config.json there."""
    path = pathlib.Path(out_dir, "config.json")
    seen = torch.tensor(int(path.exists() and run_id in path.read_text()))
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=world_group)
    if not seen:
        raise SystemExit(
            f"--out_dir {out_dir}: ranks on other nodes do not see what rank 0 writes there; it must be a folder "
            "every node sees (a shared file system), as the same path on each"
        )


# ----------------------------------------------------------------------------------------------------------------
# Saving a checkpoint


def training_state(model, optimizer):
    """What dcp/ holds: the trained parameters (LoRA: the adapters; a tied lm_head named once) and AdamW's state."""
    trained = {name: param for name, param in model.named_parameters() if param.requires_grad}
    return {"model": trained, "optim": get_optimizer_state_dict(model, optimizer)}


def save(cfg, step, model, optimizer, tokenizer, wandb_id, world_group, in_flight=None):
    """checkpoints/step_N, written as step_N.tmp and then renamed, by every rank (gathering the full weights for hf/
    is a collective). Data, sampling and the learning rate follow from the step; with --partial_rollouts,
    in_flight.pt holds each dp rank's responses in flight (`in_flight`, its engine's)."""
    rank = dist.get_rank()
    final = os.path.join(cfg.out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier(group=world_group)
        state = training_state(model, optimizer)
        dcp.save(state, checkpoint_id=f"{tmp}/dcp")
        if cfg.partial_rollouts:
            save_in_flight(in_flight.state(), f"{tmp}/in_flight.pt", cfg.tp, world_group)
        weights = {}
        for name, tensor in engines.full_weights(model, torch.float32):
            if rank == 0:
                weights[name] = tensor.cpu()
        adapters = {}
        for name, param in state["model"].items():
            if ".lora_" in name:
                adapters[f"base_model.model.{name}"] = param.detach().full_tensor().cpu()
        if rank == 0:
            write_files(tmp, cfg, step, model, tokenizer, weights, adapters, wandb_id)
            # Every file and folder on disk before the rename, the rename after: a power cut leaves one whole
            # checkpoint, the old or the new.
            os.sync()
            os.replace(tmp, final)
            os.sync()
            # The oldest, and the .tmp of saves that a kill cut off.
            for old in checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints] + checkpoints(cfg.out_dir, ".tmp"):
                shutil.rmtree(old)
    except BaseException as error:  # a full disk (dcp raises a BaseException): no half-written folder is left
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = str(error).strip().splitlines()[-1][:300]
        raise SystemExit(
            f"saving {final} failed ({why}); removed {tmp}: free space under --out_dir, then --resume auto "
            "continues from the last checkpoint"
        ) from None
    dist.barrier(group=world_group)
    return final


def write_hub_layout(folder, weights, config, source):
    """On rank 0: the trained `weights` in the layout of --model's folder `source`, so that what loaded it loads
    this: each weight under its checkpoint names (per-expert where the checkpoint held experts so) and dtype, the
    tensors the trainer does not train (a vision tower, MTP weights) and the files that are no weights (config.json,
    the generation and processor configs) as they were; safetensors files of 5 GB at most, with their index."""
    handles = [safe_open(file, "pt") for file in weight_files(source)]
    where = {key: handle for handle in handles for key in handle.keys()}
    layout = architectures.CheckpointLayout(config, where)
    tensors = {key: where[key].get_tensor(key) for key in layout.extras}
    for name, weight in weights.items():
        for key, tensor in layout.checkpoint_tensors(name, weight):
            tensors[key] = tensor.to(DTYPES.get(where[key].get_slice(key).get_dtype(), tensor.dtype)).contiguous()
    copy_files_but_weights(source, folder)
    shards = huggingface_hub.split_torch_state_dict_into_shards(tensors, max_shard_size="5GB")
    for file, keys in shards.filename_to_tensors.items():
        save_file({key: tensors[key] for key in keys}, os.path.join(folder, file), metadata={"format": "pt"})
    if shards.is_sharded:
        index = {"metadata": shards.metadata, "weight_map": shards.tensor_to_filename}
        pathlib.Path(folder, "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_files_but_weights(source, folder):
    """The files of a model's folder `source` that are no weights (config.json, the generation, tokenizer and
    processor files) into `folder`, made if missing."""
    os.makedirs(folder, exist_ok=True)
    for file in os.listdir(source):
        if not file.startswith("model") and os.path.isfile(os.path.join(source, file)):
            shutil.copyfile(os.path.join(source, file), os.path.join(folder, file))


def write_files(folder, cfg, step, model, tokenizer, weights, adapters, wandb_id):
    """On rank 0: hf/ (safetensors files of 5 GB at most, which load_weights streams one at a time), adapter/ under
    LoRA, and trainer_state.json last, with the size of every file before it."""
    hf = os.path.join(folder, "hf")
    if cfg.model in TINY_MODELS:  # no checkpoint to follow: transformers' layout
        model.save_pretrained(hf, state_dict=weights, max_shard_size="5GB")
    else:
        write_hub_layout(hf, weights, model.config, model_folder(cfg.model, download=False))
    tokenizer.save_pretrained(hf)
    for file in pathlib.Path(hf).iterdir():
        os.chmod(file, 0o644)  # transformers writes the weights 0600; readable like the rest
    if adapters:
        # PEFT's layout: peft.PeftModel.from_pretrained(base model, "adapter") loads it.
        os.makedirs(os.path.join(folder, "adapter"))
        save_file(adapters, os.path.join(folder, "adapter", "adapter_model.safetensors"))
        targets = sorted({name.split(".")[-3] for name in adapters})  # q_proj, ..., of "...q_proj.lora_A.weight"
        adapter_config = dict(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=targets,
            base_model_name_or_path=cfg.model,
        )
        pathlib.Path(folder, "adapter", "adapter_config.json").write_text(json.dumps(adapter_config))
    files = {}
    for file in pathlib.Path(folder).rglob("*"):
        if file.is_file():
            files[str(file.relative_to(folder))] = file.stat().st_size
    # A resume reads the step, checks the flags and the sizes.
    state = dict(step=step, wandb_id=wandb_id, config=dataclasses.asdict(cfg), files=files)
    pathlib.Path(folder, "trainer_state.json").write_text(json.dumps(state))


# ----------------------------------------------------------------------------------------------------------------
# Finding a checkpoint and resuming from it


def what_is_damaged(path):
    """What is missing, cut short or unreadable in checkpoint `path`, by trainer_state.json's sizes; "" if nothing."""
    try:
        state = json.loads(pathlib.Path(path, "trainer_state.json").read_text())
        sizes = state.get("files", {})  # older checkpoints: no sizes
        for name, size in sizes.items():
            # A missing file raises an OSError, which names it.
            if os.path.getsize(os.path.join(path, name)) != size:
                return f"{name} is not the {size} bytes saved"
        return ""
    except (ValueError, AttributeError):
        return "trainer_state.json is not the JSON saved"
    except OSError as error:
        return f"{error.strerror}: {error.filename}"


def checkpoints(out_dir, suffix=""):
    """Complete checkpoints under out_dir, oldest first; with suffix ".tmp", the saves in progress or cut off."""
    return sorted(map(str, pathlib.Path(out_dir, "checkpoints").glob("step_" + "[0-9]" * 6 + suffix)))


def find_resume(cfg, model_config):
    """The folder --resume names ("auto": the newest whole one under --out_dir; "": none), its step and wandb id.
    On rank 0, before any model is built: a checkpoint that cannot be resumed stops the run in one line."""
    found = checkpoints(cfg.out_dir)
    path = cfg.resume
    if cfg.resume == "auto":
        # Damaged ones are moved out of the way of the saves to come.
        while found and (why := what_is_damaged(found[-1])):
            print(f"--resume auto: skipping {found[-1]} ({why}), moved to {found[-1]}.damaged", flush=True)
            os.replace(found[-1], found.pop() + ".damaged")
        path = found[-1] if found else ""
    step = 0
    wandb_id = None
    if path:
        state = checked_state(path, cfg, model_config)
        step = state["step"]
        wandb_id = state["wandb_id"]
    later = [folder for folder in found if int(folder[-6:]) > step]
    if later:  # this run's saves would collide with them, or mix with them
        raise SystemExit(
            f"--out_dir {cfg.out_dir} holds checkpoints after step {step} ({later[-1]}): --resume auto continues "
            "the newest; else delete them, or use another --out_dir"
        )
    return path, step, wandb_id


def checked_state(path, cfg, model_config):
    """trainer_state.json of checkpoint `path`, once the checkpoint is whole and fits the flags and --model."""
    if not os.path.isdir(path):
        raise SystemExit(f"--resume {path}: no such folder: give a checkpoint's (checkpoints/step_N) or --resume auto")
    why = what_is_damaged(path)
    if why:
        raise SystemExit(f"--resume {path}: not a whole checkpoint ({why}): --resume auto takes the newest whole one")
    state = json.loads(pathlib.Path(path, "trainer_state.json").read_text())
    check_trained_flags(cfg, path, state.get("config", {}))
    if state["step"] >= cfg.steps:
        raise SystemExit(f"--resume {path} is at step {state['step']}, --steps {cfg.steps}: raise --steps to go on")
    saved = architectures.text_config(AutoConfig.from_pretrained(os.path.join(path, "hf")))
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        was = getattr(saved, key, None)
        now = getattr(model_config, key, None)
        if was != now:
            raise SystemExit(f"--resume {path} is of another model ({key} {was}, --model's {now}): pass its --model")
    changed = []
    for key, value in state.get("config", {}).items():
        if key != "resume" and value != getattr(cfg, key, value):
            changed.append(f"--{key} {value} -> {getattr(cfg, key)}")
    if changed:
        print(f"resuming {path} with flags changed since it was saved: {', '.join(changed)}", flush=True)
    return state


def check_trained_flags(cfg, path, saved_flags):
    """Another --lora_rank or --train_vision trains other parameters; another --lora_alpha rescales the trained B A,
    so the policy would jump at the first step. A checkpoint from before a flag existed counts as its default."""
    defaults = {field.name: field.default for field in dataclasses.fields(cfg)}
    for key in ("lora_rank", "lora_alpha", "train_vision"):
        saved_value = saved_flags.get(key, defaults[key])
        alpha_without_lora = key == "lora_alpha" and not cfg.lora_rank  # alpha scales nothing then
        if saved_value != getattr(cfg, key) and not alpha_without_lora:
            raise SystemExit(f"--resume {path} was trained with --{key} {saved_value}: resume with that --{key}")


def resume(path, model, optimizer, cfg, world_group):
    """The trained parameters (in place) and AdamW's state as save wrote them; and with --partial_rollouts the state
    of this rank's responses in flight, as its dp rank's engine held them (inflight.InFlight.state), or None."""
    state = training_state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_optimizer_state_dict(model, optimizer, state["optim"])
    if cfg.partial_rollouts:
        return load_in_flight(path, cfg, world_group)
    return None


# The flags that make what is in flight: another value at a resume, and its responses would not fit the run.
IN_FLIGHT_FLAGS = ("task", "data_path", "seed", "prompts_per_step", "group_size", "max_new_tokens", "temperature")
IN_FLIGHT_FLAGS += ("top_p", "top_k", "tool", "max_turns", "plain_template", "routing_replay")


def save_in_flight(state, file, tp, world_group):
    """Each dp rank's responses in flight (`state`: its InFlight.state() on a TP group's first rank) in `file`."""
    world = dist.get_world_size(world_group)
    every_rank = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(state, every_rank, dst=0, group=world_group)
    if dist.get_rank() == 0:
        torch.save(every_rank[::tp], file)  # a TP group's ranks are next to each other: its first, per dp rank


def load_in_flight(path, cfg, world_group):
    """This rank's dp rank's responses in flight from checkpoint `path`; None, said once, where they do not fit: saved
    on another dp, or with another value of a flag that made them (IN_FLIGHT_FLAGS)."""
    world = dist.get_world_size(world_group)
    file = os.path.join(path, "in_flight.pt")
    by_rank = [None] * world
    if dist.get_rank() == 0 and os.path.exists(file):
        by_dp_rank = torch.load(file, weights_only=False)  # plain data and tensors, the items as the dataset made them
        saved = json.loads(pathlib.Path(path, "trainer_state.json").read_text())["config"]
        changed = [f"--{key}" for key in IN_FLIGHT_FLAGS if saved.get(key) != getattr(cfg, key)]
        if len(by_dp_rank) != world // cfg.tp:
            changed.append(f"dp ({len(by_dp_rank)}, now {world // cfg.tp})")
        if changed:
            print(
                f"--resume {path}: its responses in flight are dropped (saved with other {', '.join(changed)}); new "
                "prompts are admitted"
            )
        else:
            by_rank = [by_dp_rank[rank // cfg.tp] for rank in range(world)]
    mine = [None]
    dist.scatter_object_list(mine, by_rank if dist.get_rank() == 0 else None, src=0, group=world_group)
    return mine[0]
