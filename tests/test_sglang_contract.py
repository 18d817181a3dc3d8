"""Contract test: train.push_weights into the real sglang 0.5.23 weight-update code, on CPU processes.

tests/sglang_cpu_engine.py runs sglang's own scheduler-side updater, TP-worker deserialization, model-runner updater
and Qwen2 / Qwen3 load_weights on a dummy-loaded model in one process per engine TP rank, and the trainer's
SGLangEngine over the real sglang.Engine class on sharded trainer ranks; only ZMQ is replaced by queues. Every engine
parameter starts as NaN; after a push each must equal the trainer's weight sharded as sglang shards it, computed
here from the HF tensors with the sharding formulas (not with sglang's loaders). Further tests show what sglang does
with a wrong name, a wrong shape and a push outside the 0.5.21+ weight-update session.

Needs `pip install --no-deps -r requirements-sglang-cpu.txt` (after requirements-cpu.txt). Processes are started
once per engine TP size for the module (~20-30 s on 2 cores) and reused by its tests.
"""
import glob
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3Config

pytest.importorskip("sglang.srt.utils", reason="needs sglang: pip install --no-deps -r requirements-sglang-cpu.txt")
import train  # noqa: E402
from sglang_cpu_engine import CPUEngineCluster  # noqa: E402

BUCKET_MB = 1
VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE for embed_tokens and lm_head rows


@pytest.fixture(scope="module")
def clusters():
    """cluster(tp): engine TP ranks and as many trainer ranks, started on first use, kept for the module; one left
    stuck by a failed collective is replaced."""
    started = {}

    def cluster(tp):
        if tp in started and started[tp].broken:
            started.pop(tp).close()
        if tp not in started:
            started[tp] = CPUEngineCluster(tp)
        return started[tp]
    yield cluster
    for running in started.values():
        running.close()


def contract_config(family, tied):
    """Small, but past 2 MB of bf16 so that 1 MB buckets hold several tensors and a push takes several buckets.
    Qwen2's 1000-row vocabulary is padded by sglang (to 1024 rows); Qwen3's 1024 rows divide evenly."""
    common = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    if family == "qwen3":
        return Qwen3Config(vocab_size=1024, head_dim=32, **common)  # Qwen3Config defaults head_dim to 128
    return Qwen2Config(vocab_size=1000, **common)


def save_models(folder, family, tied):
    """The trainer's checkpoint (every tensor random, so any misplaced slice shows) in several safetensors files,
    and the engine's folder: config.json alone, as SGLangEngine writes it. Returns both paths."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(contract_config(family, tied))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    model.save_pretrained(folder / "trainer", max_shard_size="1MB")
    AutoConfig.from_pretrained(folder / "trainer").save_pretrained(folder / "engine")
    return str(folder / "trainer"), str(folder / "engine")


def hf_tensors(folder):
    return {k: v for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) for k, v in load_file(f).items()}


def rank_slice(total, tp, rank):
    return slice(rank * total // tp, (rank + 1) * total // tp)


def vocab_rows(weight, tp, rank):
    """sglang's vocab-parallel rows: the vocabulary padded to a multiple of 64 (of 64 x tp if that does not divide
    by tp), split evenly; padding rows are zero."""
    vocab, padding = weight.shape[0], VOCAB_PADDING
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    per_rank = -(-vocab // padding) * padding // tp
    rows = weight[rank * per_rank:min((rank + 1) * per_rank, vocab)]
    return torch.cat([rows, rows.new_zeros(per_rank - len(rows), weight.shape[1])])


def expected_engine_parameters(hf, config, tp, rank):
    """What engine TP rank `rank` should hold, by sglang parameter name, in bf16: q/k/v fused into qkv_proj (this
    rank's heads of each), gate/up into gate_up_proj (this rank's slice of each), o_proj and down_proj split on their
    input, embeddings and lm_head by vocabulary rows, norms whole. A tied lm_head is embed_tokens itself."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert config.num_key_value_heads % tp == 0  # sglang would replicate KV heads otherwise
    rows = {"q_proj": rank_slice(config.num_attention_heads * head_dim, tp, rank),
            "k_proj": rank_slice(config.num_key_value_heads * head_dim, tp, rank),
            "gate_proj": rank_slice(config.intermediate_size, tp, rank)}
    rows.update(v_proj=rows["k_proj"], up_proj=rows["gate_proj"])
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
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
    """train.weight_buckets' buckets: a bucket closes once it holds >= BUCKET_MB MiB of bf16."""
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


CASES = [(family, tied, tp) for family in ("qwen2", "qwen3") for tied in (False, True) for tp in (1, 2)]


@pytest.mark.parametrize("family,tied,tp", CASES, ids=[f"{f}-{'tied' if t else 'untied'}-tp{tp}" for f, t, tp in CASES])
def test_push_lands_every_weight_exactly_on_every_engine_tp_rank(clusters, tmp_path, family, tied, tp):
    cluster = clusters(tp)
    trainer_folder, engine_folder = save_models(tmp_path, family, tied)
    cluster.load(engine_folder)
    cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB)
    config = AutoConfig.from_pretrained(trainer_folder)
    hf = hf_tensors(trainer_folder)
    assert ("lm_head.weight" in hf) != tied
    buckets = bucket_count(config)
    assert buckets >= 2
    for rank, (state, warnings) in enumerate(cluster.weights()):
        parameters = state["parameters"]
        expected = expected_engine_parameters(hf, config, tp, rank)
        assert sorted(parameters) == sorted(expected), rank
        assert {t.dtype for t in parameters.values()} == {torch.bfloat16}
        assert nan_parameters(parameters) == [], rank
        assert mismatches(parameters, expected) == [], rank
        assert not any(b.isnan().any() for b in state["buffers"].values())
        # The session: begin, one update per bucket (flush_cache=False), end, then the one cache flush.
        assert state["requests"] == (["BeginWeightUpdateReqInput"] + ["UpdateWeightsFromTensorReqInput"] * buckets
                                     + ["EndWeightUpdateReqInput", "FlushCacheReqInput"])
        assert state["flushes"] == 1
        assert warnings == []  # sglang reports an unknown name only as a warning


def test_released_memory_is_resumed_around_the_push(clusters, tmp_path):
    """As after a training step: release, then the push resumes weights first and the KV cache after the flush."""
    cluster = clusters(2)
    trainer_folder, engine_folder = save_models(tmp_path, "qwen3", False)
    cluster.load(engine_folder)
    cluster.trainer("release")
    cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB)
    config, hf = AutoConfig.from_pretrained(trainer_folder), hf_tensors(trainer_folder)
    for rank, (state, _) in enumerate(cluster.weights()):
        assert mismatches(state["parameters"], expected_engine_parameters(hf, config, 2, rank)) == []
        requests = state["requests"]
        assert requests[:3] == ["ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput",
                                "BeginWeightUpdateReqInput"]
        assert requests[-3:] == ["EndWeightUpdateReqInput", "FlushCacheReqInput", "ResumeMemoryOccupationReqInput"]


# ----------------------------------------------------------------------------- what a wrong push does
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_an_unknown_name_is_skipped_with_only_a_warning_and_leaves_nan(clusters, tmp_path, family, tp):
    """torch.compile's "_orig_mod." prefix on one name: sglang's load_weights logs a warning and the push succeeds,
    so only the NaN left in the engine (and the exact comparison) catches it."""
    cluster = clusters(tp)
    trainer_folder, engine_folder = save_models(tmp_path, family, False)
    cluster.load(engine_folder)
    name = "model.layers.1.mlp.down_proj.weight"
    cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB, rename={name: "_orig_mod." + name})
    for state, warnings in cluster.weights():
        assert nan_parameters(state["parameters"]) == [name]
        assert warnings == [f"sglang.srt.models.{family}: Parameter _orig_mod.{name} not found in params_dict"]


def test_a_wrong_name_holding_q_proj_is_dropped_by_qwen2_and_crashes_qwen3(clusters, tmp_path):
    """Qwen2's loader skips a stacked name it cannot place, leaving that slice of qkv_proj NaN; its warning names
    neither what was sent nor a real parameter (q_proj -> qkv_proj, then the v_proj rule matches inside qkv_proj:
    qkqkv_proj). Qwen3's looks the fused name up unguarded: KeyError, and the scheduler dies."""
    cluster = clusters(1)
    name = "model.layers.0.self_attn.q_proj.weight"
    rename = {name: "_orig_mod." + name}
    trainer_folder, engine_folder = save_models(tmp_path / "qwen2", "qwen2", False)
    cluster.load(engine_folder)
    cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB, rename=rename)
    [(state, warnings)] = cluster.weights()
    qkv = state["parameters"]["model.layers.0.self_attn.qkv_proj.weight"]
    q_rows = 128  # 4 heads x 32
    assert qkv[:q_rows].isnan().all() and not qkv[q_rows:].isnan().any()
    assert nan_parameters(state["parameters"]) == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert warnings == ["sglang.srt.models.qwen2: Parameter _orig_mod.model.layers.0.self_attn.qkqkv_proj.weight "
                        "not found in params_dict"]

    trainer_folder, engine_folder = save_models(tmp_path / "qwen3", "qwen3", False)
    cluster.load(engine_folder)
    with pytest.raises(RuntimeError) as failed:
        cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB, rename=rename)
    assert "EngineRankFailed" in str(failed.value)
    assert "KeyError: '_orig_mod.model.layers.0.self_attn.qkv_proj.weight'" in str(failed.value)


def test_a_wrongly_shaped_tensor_crashes_the_engine_and_the_push_raises(clusters, tmp_path):
    """sglang's shape assertion names the shapes but not the parameter."""
    cluster = clusters(1)
    trainer_folder, engine_folder = save_models(tmp_path, "qwen2", False)
    cluster.load(engine_folder)
    with pytest.raises(RuntimeError) as failed:  # [128, 512] sent as [512, 128], zero-padded on its input dim
        cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB,
                        reshape={"model.layers.2.mlp.down_proj.weight": "transpose"})
    assert "EngineRankFailed" in str(failed.value)
    assert "param_data.shape=torch.Size([128, 512]) loaded_weight.shape=torch.Size([512, 512])" in str(failed.value)


@pytest.mark.parametrize("name,how", [("model.layers.3.self_attn.o_proj.weight", "transpose"),  # [128, 128]
                                      ("model.layers.1.mlp.down_proj.weight", "half_columns")])  # [128, 256]
def test_some_wrong_shapes_load_silently_and_only_the_comparison_catches_them(clusters, tmp_path, name, how):
    """A transposed square matrix fits; o_proj and down_proj zero-pad an input dim that is too short (meant for
    Qwen2.5-VL's unaligned MLP). No error, no warning, no NaN: only the exact comparison fails."""
    cluster = clusters(1)
    trainer_folder, engine_folder = save_models(tmp_path, "qwen2", False)
    cluster.load(engine_folder)
    cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB, reshape={name: how})
    [(state, warnings)] = cluster.weights()
    config, hf = AutoConfig.from_pretrained(trainer_folder), hf_tensors(trainer_folder)
    assert warnings == [] and nan_parameters(state["parameters"]) == []
    assert mismatches(state["parameters"], expected_engine_parameters(hf, config, 1, 0)) == [name]
    if how == "half_columns":
        assert not state["parameters"][name][:, 256:].any()  # the missing half arrived as zeros


# ----------------------------------------------------------------------------- the session protocol
def test_an_update_outside_a_session_fails_and_check_raises(clusters, tmp_path):
    cluster = clusters(1)
    _, engine_folder = save_models(tmp_path, "qwen2", True)
    cluster.load(engine_folder)
    ok, message = cluster.trainer("update_outside_session")
    assert not ok and "between begin_weight_update() and end_weight_update()" in message
    with pytest.raises(RuntimeError, match="SGLang weight update failed: update_weights_from_tensor must run"):
        train.SGLangEngine.check((ok, message))


def test_a_trainer_that_sees_no_session_api_fails_loudly_on_0_5_23(clusters, tmp_path):
    """SGLangEngine picks the session by hasattr(engine, "begin_weight_update"): without it (sglang < 0.5.21) its
    push against 0.5.23 raises at the first bucket rather than loading nothing silently."""
    cluster = clusters(1)
    trainer_folder, engine_folder = save_models(tmp_path, "qwen2", True)
    cluster.load(engine_folder)
    with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
        cluster.trainer("push", folder=trainer_folder, bucket_mb=BUCKET_MB, session=False)
    [(state, _)] = cluster.weights()
    assert state["requests"] == ["UpdateWeightsFromTensorReqInput"]
    assert len(nan_parameters(state["parameters"])) == len(state["parameters"])


def test_sglangs_reduction_patch_stops_cpu_tensors_from_pickling_for_ipc(clusters):
    """monkey_patch_torch_reductions() rewrites argument 6 of every reduced tensor (the CUDA device): a CPU tensor's
    reduction has 3, so ForkingPickler fails. train.sglang_payloads patches only when CUDA is present."""
    assert clusters(1).cpu_tensor_ipc_pickle() == "IndexError: tuple index out of range"
