"""Contract test: engines.SGLangEngine and engines.push_weights against the real sglang 0.5.23 weight-update code,
on CPU processes.

tests/sglang_cpu_engine.py runs sglang's own scheduler-side updater, TP-worker deserialization, model-runner updater
and the model class's load_weights on a dummy-loaded model in one process per engine TP rank, and the trainer's engines
(engines.start_engine on every trainer rank, as main does) over the real sglang.Engine class on sharded trainer ranks;
only ZMQ and the engine's process launch are replaced. Shapes: engine tp 1, 2 and 4 (one engine), and dp 2 x tp 2
(two engines at once: the second TP group's gathers go to global rank 2, its owner). Every engine parameter starts as
NaN; after a push each must equal the trainer's weight sharded as sglang shards it, computed here from the HF tensors
with the sharding formulas (not with sglang's loaders). Qwen2 and Qwen3 run at every shape; Qwen3-MoE, Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE (tests/hub_models.py's folders, in the hub's layout) at engine tp 1 and 2, against the formulas
of tests/sglang_layouts.py. Further tests show what sglang does with a wrong name, a wrong shape, a push outside the
0.5.21+ weight-update session, and unbalanced GPUs without the trainer's setting. And sglang's own model loader
serves the trainer's export of each hub model (a checkpoint's hf/ folder) from disk, as a server given its path would,
with the trained weights (and Qwen3.5's vision tower) in every parameter. Prompts with images: the engine's requests
through sglang's own multimodal processor give the trainer's ids, pixels and positions, and the tower's push lands.

Needs `pip install --no-deps -r requirements-sglang-cpu.txt` (after requirements-cpu.txt). Processes are started
once per shape for the module (~20-30 s on 2 cores for tp 1 and 2; four-rank shapes, 8 processes, take longer and run
alone) and reused by its tests.
"""

import glob
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import PIL.Image
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3Config

import architectures
import checkpoint
import hub_models
import vision
from demo_model import demo_tokenizer
from sglang_layouts import expected_parameters, vision_tower, vocab_rows

pytest.importorskip("sglang.srt.utils", reason="needs sglang: pip install --no-deps -r requirements-sglang-cpu.txt")
from sglang_cpu_engine import FREE_GIB, CPUEngineCluster  # noqa: E402

BUCKET_MB = 1
SHAPES = {"tp1": (1, 1), "tp2": (1, 2), "tp4": (1, 4), "dp2xtp2": (2, 2)}  # (engines, engine TP size)
UNBALANCED = "sglang.srt.distributed.bootstrap: The memory capacity is unbalanced."


@pytest.fixture(scope="module")
def clusters():
    """cluster(dp, tp): dp x tp trainer ranks and dp engines of tp ranks, kept for the module. The trainer ranks of a
    world serve each of its shapes; a shape's engine processes start on first use and stop when another shape of the
    world is used. A four-rank world (4 trainer and 4 engine processes) runs alone: starting it closes the others, as
    starting a small one closes it. One left stuck by a failed collective is replaced."""
    started = {}

    def cluster(dp, tp):
        world = dp * tp
        if world in started and started[world].broken:
            started.pop(world).close()
        if world not in started:
            for other in [w for w in started if max(w, world) > 2]:
                started.pop(other).close()
            started[world] = CPUEngineCluster(world, [(d, t) for d, t in SHAPES.values() if d * t == world])
        return started[world].use(dp, tp)

    yield cluster
    for running in started.values():
        running.close()


def contract_config(family, tied, tp=1):
    """Small, but past 2 MB of bf16 so that 1 MB buckets hold several tensors and a push takes several buckets.
    Qwen2's 1000-row vocabulary is padded by sglang (to 1024 rows); Qwen3's 1024 rows divide evenly. Engine tp 4
    takes 4 KV heads (the trainer's TP needs whole heads per rank; sglang would replicate fewer)."""
    common = dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=max(2, tp),
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    if family == "qwen3":
        return Qwen3Config(vocab_size=1024, head_dim=32, **common)  # Qwen3Config defaults head_dim to 128
    return Qwen2Config(vocab_size=1000, **common)


def save_model(folder, family, tied, tp=1, seed=0):
    """The trainer's checkpoint (every tensor random, so any misplaced slice shows) in several safetensors files, with
    the demo's tokenizer; engines.SGLangEngine writes the engine's config.json from its config. Returns the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(contract_config(family, tied, tp))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    model.save_pretrained(folder, max_shard_size="1MB")
    demo_tokenizer().save_pretrained(folder)
    return str(folder)


def start(cluster, folder, **options):
    """engines.start_engine on every trainer rank, its out_dir by the checkpoint's folder (the engine processes live on
    and sglang keeps a model path's config once read); per engine, its owner's record."""
    return cluster.start(folder, f"{folder}-out", **options)


def push(cluster, folder, bucket_mb=BUCKET_MB, **options):
    """A training step's end as main does it: the engine's memory released, then engines.push_weights."""
    cluster.trainer("release")
    return cluster.trainer("push", folder=folder, bucket_mb=bucket_mb, **options)


def check_start(owners, dp, tp):
    """One engine per TP group, owned by its first rank, started with the group's size, its first GPU and a port
    of its own; the engine inherits the setting that lets unbalanced GPUs start, and sglang heeds it."""
    assert [o["rank"] for o in owners] == [e * tp for e in range(dp)]
    for owner in owners:
        kwargs = owner["kwargs"]
        assert (kwargs["tp_size"], kwargs["dp_size"], kwargs["base_gpu_id"]) == (tp, 1, owner["rank"])
        assert owner["environ"] == {
            "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        assert owner["generate"] == [([[0]], [{"max_new_tokens": 1}])]  # the warm-up request, as sglang batches it
        # Every rank whose probe exceeds the group's least free memory by over 10% (all but the last) is told.
        warned = [any(w.startswith(UNBALANCED) for w in log) for _, log in owner["loads"]]
        assert warned == [r < tp - 1 for r in range(tp)]
    ports = [o["kwargs"]["nccl_port"] for o in owners]
    assert len(set(ports)) == dp  # two engines' ranks joining one rendezvous would not have started


def hf_tensors(folder):
    return {k: v for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) for k, v in load_file(f).items()}


def rank_slice(total, tp, rank):
    return slice(rank * total // tp, (rank + 1) * total // tp)


def expected_engine_parameters(hf, config, tp, rank):
    """What engine TP rank `rank` should hold, by sglang parameter name, in bf16: q/k/v fused into qkv_proj (this
    rank's heads of each), gate/up into gate_up_proj (this rank's slice of each), o_proj and down_proj split on their
    input, embeddings and lm_head by vocabulary rows, norms whole. A tied lm_head is embed_tokens itself."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert config.num_key_value_heads % tp == 0  # sglang would replicate KV heads otherwise
    rows = {
        "q_proj": rank_slice(config.num_attention_heads * head_dim, tp, rank),
        "k_proj": rank_slice(config.num_key_value_heads * head_dim, tp, rank),
        "gate_proj": rank_slice(config.intermediate_size, tp, rank),
    }
    rows.update(v_proj=rows["k_proj"], up_proj=rows["gate_proj"])
    fused = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    expected, parts = {}, {}
    for name, full in hf.items():
        full = full.to(torch.bfloat16)
        module_path, leaf = name.rsplit(".", 1)
        parent, _, module = module_path.rpartition(".")
        if module in fused:  # concatenated below in q, k, v / gate, up order
            parts.setdefault(f"{parent}.{fused[module]}.{leaf}", {})[module] = full[rows[module]]
        elif module == "o_proj":
            expected[name] = full[:, rows["q_proj"]]
        elif module == "down_proj":
            expected[name] = full[:, rows["gate_proj"]]
        elif module in ("embed_tokens", "lm_head"):
            expected[name] = vocab_rows(full, tp, rank)
        else:
            assert "norm" in module, f"no sharding rule for {name}"
            expected[name] = full
    for name, by_module in parts.items():
        order = ("q_proj", "k_proj", "v_proj") if "qkv_proj" in name else ("gate_proj", "up_proj")
        expected[name] = torch.cat([by_module[m] for m in order])
    return expected


def bucket_count(config):
    """engines.weight_buckets' buckets: a bucket closes once it holds >= BUCKET_MB MiB of bf16."""
    with torch.device("meta"):
        sizes = [p.numel() * 2 for _, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    count, held = 0, 0
    for size in sizes:
        held += size
        if held >= BUCKET_MB << 20:
            count, held = count + 1, 0
    return count + (held > 0)


def nan_parameters(parameters):
    return sorted(n for n, t in parameters.items() if t.isnan().any())


def mismatches(parameters, expected):
    return sorted(n for n in expected if not torch.equal(parameters[n], expected[n]))


def in_dtypes_of(parameters, expected):
    """expected's tensors each in its sglang parameter's dtype, as the parameter's loader casts what it reads."""
    return {name: tensor.to(parameters[name].dtype) for name, tensor in expected.items()}


def check_gemma_norms(buffers, expected, model_type):
    """Qwen3-Next's and Qwen3.5's norms (GemmaRMSNorm) hold weight + 1 in a buffer, which their kernels use; the norm's
    loader refreshes it."""
    gemma = sorted(name for name in buffers if name.endswith(".gemma_weight"))
    assert bool(gemma) == (model_type != "qwen3_moe")
    for name in gemma:
        weight = expected[name.removesuffix("gemma_weight") + "weight"]
        assert torch.equal(buffers[name], weight.to(buffers[name].dtype) + 1), name


CASES = [
    (family, tied, shape)
    for shape in ("tp4", "dp2xtp2", "tp1", "tp2")  # the four-rank shapes first: alone
    for family in ("qwen2", "qwen3")
    for tied in (False, True)
]


@pytest.mark.parametrize("family,tied,shape", CASES, ids=[f"{f}-{'tied' if t else 'untied'}-{s}" for f, t, s in CASES])
def test_push_lands_every_weight_exactly_on_every_engine_tp_rank(clusters, tmp_path, family, tied, shape):
    dp, tp = SHAPES[shape]
    cluster = clusters(dp, tp)
    trainer_folder = save_model(tmp_path / "trainer", family, tied, tp)
    check_start(start(cluster, trainer_folder), dp, tp)
    push(cluster, trainer_folder)
    config = AutoConfig.from_pretrained(trainer_folder)
    hf = hf_tensors(trainer_folder)
    assert ("lm_head.weight" in hf) != tied
    buckets = bucket_count(config)
    assert buckets >= 2
    for engine in cluster.weights():
        for rank, (state, warnings) in enumerate(engine):
            parameters = state["parameters"]
            expected = expected_engine_parameters(hf, config, tp, rank)
            assert sorted(parameters) == sorted(expected), rank
            assert {t.dtype for t in parameters.values()} == {torch.bfloat16}
            assert nan_parameters(parameters) == [], rank
            assert mismatches(parameters, expected) == [], rank
            assert not any(b.isnan().any() for b in state["buffers"].values())
            # Released after the rollouts; then weights resumed, the session: begin, one update per bucket
            # (flush_cache=False), end; the one cache flush, and the KV cache resumed after it.
            assert state["requests"] == (
                ["ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput", "BeginWeightUpdateReqInput"]
                + ["UpdateWeightsFromTensorReqInput"] * buckets
                + ["EndWeightUpdateReqInput", "FlushCacheReqInput", "ResumeMemoryOccupationReqInput"]
            )
            assert state["flushes"] == 2  # releasing the KV cache flushes too
            assert warnings == []  # sglang reports an unknown name only as a warning


def save_tied(folder, architecture):
    """A text-only hub model (Qwen3-MoE or Qwen3-Next) with its LM head tied to the embedding: no lm_head.weight in
    its files. Returns the folder."""
    config = hub_models.text_config(architecture)
    config.tie_word_embeddings = True
    hub_models.randomized(AutoModelForCausalLM.from_config(config), seed=0).save_pretrained(folder)
    demo_tokenizer().save_pretrained(folder)
    return str(folder)


def save_hub_case(folder, model, monkeypatch):
    """The folder of a HUB_CASES model: hub_models' architecture, tied ("-tied"), or Qwen3.5-MoE with experts 640
    wide ("-wide"), whose fused gate_up_proj [8, 1280, 64] is 1.25 MiB of bf16: over a 1 MB bucket, under a 2 MB one."""
    architecture, _, variant = model.partition("-")
    if variant == "tied":
        return save_tied(folder, architecture)
    if variant == "wide":
        monkeypatch.setitem(hub_models.MOE, "moe_intermediate_size", 640)
    return hub_models.save_hub_model(folder, architecture)


# (model, engine shape, --bucket_mb, the form the push gives routed experts: sglang's Qwen3-MoE and Qwen3-Next take
# them per expert; Qwen3.5-MoE's class takes transformers' fused weights too, sent where the largest fits a bucket)
HUB_CASES = [
    ("qwen3_moe", "tp1", 1, "per expert"),
    ("qwen3_5", "tp1", 1, None),
    ("qwen3_moe", "tp2", 1, "per expert"),
    ("qwen3_next", "tp2", 1, "per expert"),
    ("qwen3_5", "tp2", 1, None),
    ("qwen3_5_moe", "tp2", 1, "fused"),
    ("qwen3_next-tied", "tp2", 1, "per expert"),
    ("qwen3_5_moe-wide", "tp2", 1, "per expert"),
    ("qwen3_5_moe-wide", "tp2", 2, "fused"),
]


def experts_form(names):
    """How a push sent routed experts, from the names load_weights was given: "fused", "per expert", None."""
    experts = [name for name in names if ".experts." in name]
    forms = {
        "fused" if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else "per expert" for name in experts
    }
    assert len(forms) <= 1, forms  # Qwen3.5-MoE's loader drops per-expert names that follow a fused one
    return forms.pop() if forms else None


@pytest.mark.parametrize(
    "model,shape,bucket_mb,experts", HUB_CASES, ids=[f"{m}-{s}-bucket{b}mb" for m, s, b, _ in HUB_CASES]
)
def test_push_of_a_hub_model_lands_every_weight_exactly_in_sglangs_class(
    clusters, tmp_path, monkeypatch, model, shape, bucket_mb, experts
):
    """Qwen3-MoE, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, from folders in the hub's layout (Qwen3.5's vision-language,
    experts fused or per expert) loaded by the trainer's own path, into sglang's text class for each: every
    parameter (its Gemma norms' weight + 1 buffer too) equals the HF text model's weight as tests/sglang_layouts.py
    shards it, nothing is left NaN, sglang warns of nothing, each weight is sent once, and routed experts go in the
    form the case names, the fused form only where it fits --bucket_mb. A tied Qwen3-Next's own LM head gets the
    embedding; a tied Qwen3.5's is the embedding."""
    dp, tp = SHAPES[shape]
    cluster = clusters(dp, tp)
    folder = save_hub_case(tmp_path / "trainer", model, monkeypatch)
    check_start(start(cluster, folder), dp, tp)
    push(cluster, folder, bucket_mb=bucket_mb)
    text = hub_models.text_model(folder)
    for rank, (state, warnings) in enumerate(cluster.weights()[0]):
        parameters, buffers = state["parameters"], state["buffers"]
        expected = expected_parameters(text.state_dict(), text.config, tp, rank)
        assert sorted(parameters) == sorted(expected), rank
        assert {n: t.dtype for n, t in parameters.items()} == {n: t.dtype for n, t in expected.items()}
        assert nan_parameters(parameters) == [], rank
        assert mismatches(parameters, expected) == [], rank
        check_gemma_norms(buffers, expected, text.config.model_type)
        assert not any(b.isnan().any() for b in buffers.values())
        assert warnings == []
        assert len(set(state["loaded"])) == len(state["loaded"])
        assert experts_form(state["loaded"]) == experts


@pytest.mark.parametrize("shape,train_vision", [("tp1", False), ("tp2", False), ("tp2", True)])
def test_image_prompts_reach_sglangs_processor_as_the_trainer_encodes_them_and_the_tower_lands_in_its_class(
    clusters, tmp_path, shape, train_vision
):
    """--engine sglang with prompts with images, for a Qwen3.5 checkpoint's folder. The engine is its vision-language
    class (the engine's model path holds the vision-language config.json and the processor's files). A prompt with
    two images and a text prompt, sent by engines.SGLangEngine.generate through sglang's Engine.generate and its own
    multimodal processor (QwenVLImageProcessor): the ids, pixel values, grids and mrope positions it makes of the
    expanded ids and the processed images equal the trainer's (vision.encode_prompt, transformers' get_rope_index),
    the text prompt goes as text, and each request bans the vision tokens (-inf, string keys as sglang's scheduler
    decodes them). Then a push lands every weight in that class, the vision tower's as sglang shards it too (the
    frozen tower's, or with --train_vision the policy's trained copy, sharded with it), nothing left NaN, no
    warning."""
    dp, tp = SHAPES[shape]
    cluster = clusters(dp, tp)
    folder = hub_models.save_tiny_vision_language_model(tmp_path / "trainer")
    owners = start(cluster, folder, images=True, train_vision=train_vision)
    check_start(owners, dp, tp)
    if train_vision:  # the engine caches no image's features, which the tower's next weights would change
        assert [owner["vlm_cache_mb"] for owner in owners] == ["0"] * dp
    with open(os.path.join(f"{folder}-out", "engine_model_rank0", "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    generator = torch.Generator().manual_seed(0)
    noise = (torch.rand(24, 40, 3, generator=generator) * 255).to(torch.uint8).numpy()
    images = [PIL.Image.new("RGB", (32, 24), (200, 30, 30)), PIL.Image.fromarray(noise)]
    record = [r for r in cluster.trainer("image_prompts", folder=folder, images=images) if r][0]
    (engine,), trainer = record["engine"], record["trainer"]
    assert engine["prompt"] == 0 and len(trainer["image_grid_thw"]) == 2
    assert engine["input_ids"] == trainer["input_ids"]
    assert torch.equal(engine["pixel_values"].float(), trainer["pixel_values"].float())
    assert torch.equal(engine["image_grid_thw"].long(), trainer["image_grid_thw"].long())
    assert torch.equal(engine["mrope_positions"].long(), trainer["mrope_positions"].long())
    config = AutoConfig.from_pretrained(folder)
    banned = {str(i): -math.inf for i in vision.vision_token_ids(config)}
    assert [params["logit_bias"] for params in record["sampling"]] == [banned, banned]
    push(cluster, folder)
    hf, text = hf_tensors(folder), hub_models.text_model(folder)
    for rank, (state, warnings) in enumerate(cluster.weights()[0]):
        assert state["model_class"] == "Qwen3_5ForConditionalGeneration"
        parameters = state["parameters"]
        assert nan_parameters(parameters) == [], rank
        expected = expected_parameters(text.state_dict(), text.config, tp, rank)
        expected |= in_dtypes_of(parameters, vision_tower(hf, tp, rank))
        assert sorted(parameters) == sorted(expected), rank
        assert mismatches(parameters, expected) == [], rank
        assert state["load_weights_warnings"] == [] and warnings == []


# ----------------------------------------------------------------------------- serving the trainer's export
@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """export(architecture), made once for the module: a hub folder of the architecture ("source") and the trainer's
    export of it ("folder", checkpoint.write_hub_layout as a checkpoint's hf/ is written) for weights trained from it
    ("trained": the weights of transformers' text model of the source, "original", and of a vision-language folder's
    tower, as --train_vision trains it, each moved by N(0, 0.01^2) noise, by the trainer's names), in the trainer's
    text config ("config")."""
    made = {}

    def export(architecture):
        if architecture not in made:
            root = tmp_path_factory.mktemp(architecture)
            source = hub_models.save_hub_model(root / "source", architecture)
            original = {name: param.detach() for name, param in hub_models.text_model(source).named_parameters()}
            # A vision-language folder's tower trained too (--train_vision), under the checkpoint's keys.
            original |= {key: t for key, t in hf_tensors(source).items() if key.startswith("model.visual.")}
            generator = torch.Generator().manual_seed(1)
            trained = {name: w + 0.01 * torch.randn(w.shape, generator=generator) for name, w in original.items()}
            config = architectures.text_config(AutoConfig.from_pretrained(source))
            checkpoint.write_hub_layout(str(root / "hf"), trained, config, source)
            made[architecture] = types.SimpleNamespace(
                source=source, folder=str(root / "hf"), original=original, trained=trained, config=config
            )
        return made[architecture]

    return export


SERVED_CLASSES = {  # the class sglang picks by the architectures of the export's (the source's) config.json
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}
SERVE_CASES = [(architecture, shape) for shape in ("tp1", "tp2") for architecture in hub_models.ARCHITECTURES]


@pytest.mark.parametrize("architecture,shape", SERVE_CASES, ids=[f"{a}-{s}" for a, s in SERVE_CASES])
def test_sglangs_own_loader_serves_the_trainers_export_of_a_hub_model_with_the_trained_weights(
    clusters, exports, architecture, shape
):
    """The hf/ folder a checkpoint writes (checkpoint.write_hub_layout) from a hub folder of Qwen3-MoE, Qwen3.5 or
    Qwen3.5-MoE (vision-language folders, experts fused) or Qwen3-Next, loaded as an sglang server loads its
    --model-path, at engine tp 1 and 2: sglang's DefaultModelLoader reads the export's files (the source's tensor names
    and dtypes) and gives every tensor in them to the class that the export's config.json (the source's, unchanged)
    names, Qwen3.5's vision-language ones. Every text-model parameter then equals the trained weight (not the
    source's) as tests/sglang_layouts.py lays it out on the rank, the Gemma norms' weight + 1 buffers too; the vision
    tower equals the trained one (--train_vision); no parameter is left NaN and sglang warns of nothing."""
    export = exports(architecture)
    config_json = [pathlib.Path(folder, "config.json").read_text() for folder in (export.source, export.folder)]
    assert config_json[0] == config_json[1]
    source, written = hf_tensors(export.source), hf_tensors(export.folder)
    assert {n: t.dtype for n, t in written.items()} == {n: t.dtype for n, t in source.items()}
    assert any(name.startswith("model.visual.") for name in source) == (architecture in hub_models.VLM_CLASSES)
    dp, tp = SHAPES[shape]
    cluster = clusters(dp, tp)
    cluster.serve(export.folder)
    for rank, (state, warnings) in enumerate(cluster.weights()[0]):
        assert state["model_class"] == SERVED_CLASSES[architecture]
        assert sorted(state["loaded"]) == sorted(written)  # every tensor of the export's files, once
        parameters, buffers = state["parameters"], state["buffers"]
        assert nan_parameters(parameters) == [], rank
        text = {name: tensor for name, tensor in parameters.items() if not name.startswith("visual.")}
        expected = expected_parameters(export.trained, export.config, tp, rank, dtype=None)
        assert sorted(text) == sorted(expected), rank
        expected = in_dtypes_of(parameters, expected)
        assert mismatches(parameters, expected) == [], rank
        untrained = in_dtypes_of(parameters, expected_parameters(export.original, export.config, tp, rank, dtype=None))
        assert [name for name in expected if torch.equal(expected[name], untrained[name])] == []  # the noise shows
        check_gemma_norms(buffers, expected, export.config.model_type)
        vision = in_dtypes_of(parameters, vision_tower(export.trained, tp, rank))
        assert sorted(vision) == sorted(parameters.keys() - text.keys()), rank
        assert mismatches(parameters, vision) == [], rank
        assert state["load_weights_warnings"] == [] and warnings == []


def test_a_second_push_replaces_every_weight(clusters, tmp_path):
    """As after the next training step: released again, and every weight of the new policy lands."""
    cluster = clusters(1, 2)
    first = save_model(tmp_path / "first", "qwen3", False, seed=0)
    second = save_model(tmp_path / "second", "qwen3", False, seed=1)
    start(cluster, first)
    push(cluster, first)
    push(cluster, second)
    config, hf = AutoConfig.from_pretrained(second), hf_tensors(second)
    for rank, (state, _) in enumerate(cluster.weights()[0]):
        expected = expected_engine_parameters(hf, config, 2, rank)
        assert mismatches(state["parameters"], expected) == []
        step = state["requests"][: len(state["requests"]) // 2]
        assert state["requests"] == step * 2 and step[:2] == [
            "ReleaseMemoryOccupationReqInput",
            "ResumeMemoryOccupationReqInput",
        ]


def test_without_the_trainers_setting_unbalanced_gpus_stop_the_engine(clusters, tmp_path):
    """The control for check_start: an engine that does not inherit SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false
    refuses to start on GPUs whose free memory differs by over 10%, as the trainer's ranks' GPUs do."""
    cluster = clusters(1, 2)
    folder = save_model(tmp_path / "trainer", "qwen2", True)
    with pytest.raises(RuntimeError) as failed:
        start(cluster, folder, unset_environ=("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK",))
    assert "engine TP rank 0:" in str(failed.value) and "engine TP rank 1:" not in str(failed.value)
    assert (
        "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by other processes. "
        f"pre_model_load_memory={FREE_GIB[1]:.1f}, local_gpu_memory={FREE_GIB[0]:.1f}"
    ) in str(failed.value)
    check_start(start(cluster, folder), 1, 2)  # the trainer's own start, on the same engine processes


# ----------------------------------------------------------------------------- what a wrong push does
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_an_unknown_name_is_skipped_with_only_a_warning_and_leaves_nan(clusters, tmp_path, family, tp):
    """torch.compile's "_orig_mod." prefix on one name: sglang's load_weights logs a warning and the push succeeds,
    so only the NaN left in the engine (and the exact comparison) catches it."""
    cluster = clusters(1, tp)
    trainer_folder = save_model(tmp_path / "trainer", family, False)
    start(cluster, trainer_folder)
    name = "model.layers.1.mlp.down_proj.weight"
    push(cluster, trainer_folder, rename={name: "_orig_mod." + name})
    for state, warnings in cluster.weights()[0]:
        assert nan_parameters(state["parameters"]) == [name]
        assert warnings == [f"sglang.srt.models.{family}: Parameter _orig_mod.{name} not found in params_dict"]


def test_a_wrong_name_holding_q_proj_is_dropped_by_qwen2_and_crashes_qwen3(clusters, tmp_path):
    """Qwen2's loader skips a stacked name it cannot place, leaving that slice of qkv_proj NaN; its warning names
    neither what was sent nor a real parameter (q_proj -> qkv_proj, then the v_proj rule matches inside qkv_proj:
    qkqkv_proj). Qwen3's looks the fused name up unguarded: KeyError, and the scheduler dies."""
    cluster = clusters(1, 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    rename = {name: "_orig_mod." + name}
    trainer_folder = save_model(tmp_path / "qwen2", "qwen2", False)
    start(cluster, trainer_folder)
    push(cluster, trainer_folder, rename=rename)
    [[(state, warnings)]] = cluster.weights()
    qkv = state["parameters"]["model.layers.0.self_attn.qkv_proj.weight"]
    q_rows = 128  # 4 heads x 32
    assert qkv[:q_rows].isnan().all() and not qkv[q_rows:].isnan().any()
    assert nan_parameters(state["parameters"]) == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert warnings == [
        "sglang.srt.models.qwen2: Parameter _orig_mod.model.layers.0.self_attn.qkqkv_proj.weight "
        "not found in params_dict"
    ]

    trainer_folder = save_model(tmp_path / "qwen3", "qwen3", False)
    start(cluster, trainer_folder)
    with pytest.raises(RuntimeError) as failed:
        push(cluster, trainer_folder, rename=rename)
    assert "EngineRankFailed" in str(failed.value)
    assert "KeyError: '_orig_mod.model.layers.0.self_attn.qkv_proj.weight'" in str(failed.value)


def test_a_wrongly_shaped_tensor_crashes_the_engine_and_the_push_raises(clusters, tmp_path):
    """sglang's shape assertion names the shapes but not the parameter."""
    cluster = clusters(1, 1)
    trainer_folder = save_model(tmp_path / "trainer", "qwen2", False)
    start(cluster, trainer_folder)
    with pytest.raises(RuntimeError) as failed:  # [128, 512] sent as [512, 128], zero-padded on its input dim
        push(cluster, trainer_folder, reshape={"model.layers.2.mlp.down_proj.weight": "transpose"})
    assert "EngineRankFailed" in str(failed.value)
    assert "param_data.shape=torch.Size([128, 512]) loaded_weight.shape=torch.Size([512, 512])" in str(failed.value)


@pytest.mark.parametrize(
    "name,how",
    [
        ("model.layers.3.self_attn.o_proj.weight", "transpose"),  # [128, 128]
        ("model.layers.1.mlp.down_proj.weight", "half_columns"),
    ],
)  # [128, 256]
def test_some_wrong_shapes_load_silently_and_only_the_comparison_catches_them(clusters, tmp_path, name, how):
    """A transposed square matrix fits; o_proj and down_proj zero-pad an input dim that is too short (meant for
    Qwen2.5-VL's unaligned MLP). No error, no warning, no NaN: only the exact comparison fails."""
    cluster = clusters(1, 1)
    trainer_folder = save_model(tmp_path / "trainer", "qwen2", False)
    start(cluster, trainer_folder)
    push(cluster, trainer_folder, reshape={name: how})
    [[(state, warnings)]] = cluster.weights()
    config, hf = AutoConfig.from_pretrained(trainer_folder), hf_tensors(trainer_folder)
    assert warnings == [] and nan_parameters(state["parameters"]) == []
    assert mismatches(state["parameters"], expected_engine_parameters(hf, config, 1, 0)) == [name]
    if how == "half_columns":
        assert not state["parameters"][name][:, 256:].any()  # the missing half arrived as zeros


# ----------------------------------------------------------------------------- the session protocol
def test_an_update_outside_a_session_fails_with_sglangs_own_message(clusters, tmp_path):
    """What SGLangEngine.update turns into "SGLang weight update failed: ..." (test_a_trainer_that_sees_no_session_api
    below raises it through the trainer's push)."""
    cluster = clusters(1, 1)
    start(cluster, save_model(tmp_path / "trainer", "qwen2", True))
    [(ok, message)] = cluster.trainer("update_outside_session")
    assert not ok and "between begin_weight_update() and end_weight_update()" in message


def test_a_trainer_that_sees_no_session_api_fails_loudly_on_0_5_23(clusters, tmp_path):
    """SGLangEngine picks the session by hasattr(engine, "begin_weight_update"): without it (sglang < 0.5.21) its
    push against 0.5.23 raises at the first bucket rather than loading nothing silently."""
    cluster = clusters(1, 1)
    trainer_folder = save_model(tmp_path / "trainer", "qwen2", True)
    start(cluster, trainer_folder)
    with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
        push(cluster, trainer_folder, session=False)
    [[(state, _)]] = cluster.weights()
    assert state["requests"] == [
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
        "UpdateWeightsFromTensorReqInput",
    ]
    assert len(nan_parameters(state["parameters"])) == len(state["parameters"])


def test_sglangs_reduction_patch_stops_cpu_tensors_from_pickling_for_ipc(clusters):
    """monkey_patch_torch_reductions() rewrites argument 6 of every reduced tensor (the CUDA device): a CPU tensor's
    reduction has 3, so ForkingPickler fails. engines.start_engine patches only when CUDA is present."""
    assert clusters(1, 1).cpu_tensor_ipc_pickle() == "IndexError: tuple index out of range"


def kept_set(logits, temperature, top_p, top_k):
    """SGLang's truncation, in float64: of softmax(logits / T) each token ranked below top_k whose more likely tokens
    hold at most top_p of the mass, both on the whole distribution (not top_p of the top-k-renormalised one, as HF)."""
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1)
    ordered, order = probs.sort(descending=True)
    mass_before = ordered.cumsum(0) - ordered
    keep = (torch.arange(len(order)) < top_k) & (mass_before <= top_p)
    return sorted(order[keep].tolist()), probs


def test_truncated_sampling_reads_sglangs_kept_sets_and_renormalised_logprobs(tmp_path):
    """engines.SGLangEngine.generate with top_p / top_k, through sglang's own sampler, result processing, wire and
    tokenizer manager (tests/sglang_sampling_mask.py): a kept set per output token, the stop token's included, equal
    to the truncation's definition and holding the token sampled; log-probs renormalised over it."""
    out = tmp_path / "calls.json"
    harness = os.path.join(os.path.dirname(__file__), "sglang_sampling_mask.py")
    run = subprocess.run([sys.executable, harness, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    calls = json.loads(out.read_text())
    assert [(c["temperature"], c["top_p"], c["top_k"]) for c in calls] == [
        (0.7, 0.9, 512),
        (1.3, 1.0, 5),
        (1.0, 0.8, 20),
    ]
    sizes_seen = set()
    for call in calls:
        assert call["dtypes"] == [["torch.float32", "torch.int32", "torch.int32"]] * 2
        for logits, (ids, logprobs, kept_ids, kept_sizes) in zip(call["logits"], call["outputs"]):
            assert len(logits) == len(ids) == len(logprobs) == len(kept_sizes)
            assert ids[-1] == 7 and len(ids) == 3  # the stop id, made near certain at the third step, ends it
            assert sum(kept_sizes) == len(kept_ids)
            sets = torch.tensor(kept_ids).split(kept_sizes)
            for row, token, logprob, kept in zip(logits, ids, logprobs, sets):
                want, probs = kept_set(row, call["temperature"], call["top_p"], call["top_k"])
                assert sorted(kept.tolist()) == want and token in want
                assert logprob == pytest.approx(math.log(probs[token] / probs[want].sum()), abs=1e-5)
                sizes_seen.add(len(want))
    assert min(sizes_seen) == 1 and max(sizes_seen) > 20  # top_p's sets vary; there the likely stop stands alone
