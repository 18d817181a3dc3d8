"""The Qwen models of 2026 from folders in the hub's layout (tests/hub_models.py: Qwen3-MoE per expert and untied,
Qwen3.5 as a vision-language folder, Qwen3.5-MoE with fused experts, Qwen3-Next with its fused Gated DeltaNet
projections): loaded as transformers loads them, one sharded step equal to the formula on the unsharded model at
every mesh, --tp refused where it cannot divide heads or experts, and a push name SGLang would skip refused."""

import copy
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM

import architectures
import launch
import train
from hub_models import ARCHITECTURES, save_hub_model, text_model
from test_parallel import MESHES, make_samples, sharded_model, sharded_vs_unsharded
from test_train import metrics, metrics_lines, torchrun
from workers import run_ranks


@pytest.fixture(scope="module")
def hub_folders(tmp_path_factory):
    """Each architecture's tiny random model, as the hub ships it."""
    root = tmp_path_factory.mktemp("hub")
    return {architecture: save_hub_model(root / architecture, architecture) for architecture in ARCHITECTURES}


def loaded_state(rank, world, folder, tp):
    par = launch.parallel_groups("cpu", tp)
    full = get_model_state_dict(sharded_model(folder, par), options=StateDictOptions(full_state_dict=True))
    return {name: tensor.numpy().copy() for name, tensor in full.items()}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_hub_folder_loads_as_transformers_loads_it_sharded_over_dp_and_tp(architecture, hub_folders):
    """Streamed into the model sharded over (dp 2, tp 2): every parameter bit for bit as transformers' own class
    loads the folder (Qwen3.5: its vision-language class, whose language model the trainer trains)."""
    loaded = run_ranks(loaded_state, 4, hub_folders[architecture], 2)[0]
    expected = text_model(hub_folders[architecture]).state_dict()
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(torch.from_numpy(loaded[name]), tensor), name


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_one_sharded_step_equals_the_formula_on_the_unsharded_model(architecture, dp, tp, hub_folders):
    """test_parallel's exactness check on each architecture: logits, the grad norm (clipped: max_norm 0.05 is below
    it) and every weight after an SGD step of the clipped surrogate, against an unsharded model stepped by hand."""
    result = run_ranks(sharded_vs_unsharded, dp * tp, hub_folders[architecture], dp, tp, "sgd", 0.05, False)[0]
    assert result["keys"][0] == result["keys"][1]
    assert result["logits"] < 1e-5
    sharded_norm, ref_norm = result["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05
    assert result["weights"] < 1e-5


def test_activation_checkpointing_keeps_the_step_exact_on_a_gated_deltanet_moe_model(hub_folders):
    result = run_ranks(sharded_vs_unsharded, 4, hub_folders["qwen3_5_moe"], 2, 2, "sgd", 1e9, True)[0]
    assert result["logits"] < 1e-5 and result["weights"] < 1e-5


@pytest.mark.parametrize(
    "count, value, tp", [("num_experts", 6, 4), ("num_attention_heads", 6, 4), ("linear_num_value_heads", 3, 2)]
)
def test_a_tp_that_cannot_divide_heads_or_experts_is_refused_naming_both_numbers(count, value, tp):
    config = architectures.text_config(AutoConfig.for_model("qwen3_next", **{"num_key_value_heads": 4, count: value}))
    with pytest.raises(SystemExit, match=rf"--tp {tp} must divide the model's {count} \({value}\)"):
        architectures.check_tp(config, tp)


def whole(config, name, weight, bucket_bytes):
    """A push that sends every weight under the trainer's name, as this trainer's did before per-expert pieces."""
    yield name, weight


def test_a_name_sglang_would_skip_is_refused_at_start_naming_it(monkeypatch):
    """SGLang's Qwen3-MoE class skips fused expert names without a word (and Qwen3-Next's raises on them): a push
    that sends them is refused at start, naming the first, where Qwen3.5-MoE's class takes them. A weight the engine
    loads that the trainer never pushes (a fork that drops Qwen3's q norm) is refused too."""
    for model_type, takes_fused in (("qwen3_moe", False), ("qwen3_next", False), ("qwen3_5_moe_text", True)):
        config = architectures.text_config(AutoConfig.for_model(model_type, **SMALL_MOE))
        model = AutoModelForCausalLM.from_config(config)
        architectures.check_engine_names(model, config, 1 << 29)  # per-expert pieces, or fused, as the table says
        with monkeypatch.context() as patch:
            patch.setattr(architectures, "engine_weights", whole)
            if takes_fused:
                architectures.check_engine_names(model, config, 1 << 29)
            else:
                with pytest.raises(
                    SystemExit, match=r"push model\.layers\.0\.mlp\.experts\.gate_up_proj as \[4, 32, 32\]"
                ):
                    architectures.check_engine_names(model, config, 1 << 29)
    config = architectures.text_config(AutoConfig.for_model("qwen3_moe", **SMALL_MOE))
    model = AutoModelForCausalLM.from_config(config)
    model.model.layers[0].self_attn.q_norm = torch.nn.Identity()
    with pytest.raises(SystemExit, match=r"loads model\.layers\.0\.self_attn\.q_norm\.weight .* never pushes"):
        architectures.check_engine_names(model, config, 1 << 29)


SMALL_MOE = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    moe_intermediate_size=16,
    layer_types=["full_attention"],  # Qwen3.5, Qwen3-Next: one layer, of full attention
    linear_num_key_heads=2,
    linear_num_value_heads=2,
)


# ----------------------------------------------------------------------------------------------------------------
# train.py on each hub folder, through torchrun


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_demo_learns_from_the_hub_folder_and_exports_in_its_layout(architecture, tp, hub_folders, tmp_path):
    """The CPU demo's toy task on 2 ranks, --model the hub folder: the reward climbs, the engine's log-probs equal the
    trainer's after every push. At tp 2, the export: hf/ holds the hub folder's names and dtypes, its config.json as
    it was, the tensors the trainer does not train (Qwen3.5's vision tower and MTP weights) as they were, and the
    trained weights, which transformers' own class loads and train.py reloads as --model."""
    folder = hub_folders[architecture]
    flags = ("--preset", "cpu", "--model", folder, "--tp", str(tp), "--eval_every", "0", "--sample_every", "0")
    run = torchrun(2, *flags, "--steps", "20", "--out_dir", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert rows[0]["reward"] < 0.1 and last > 0.8, (rows[0]["reward"], last)
    assert max(r["mismatch_abs"] for r in rows) < 1e-4
    if tp == 1:
        return
    step_dir = tmp_path / "out" / "checkpoints" / "step_000020"
    source, exported = hub_tensors(folder), hub_tensors(step_dir / "hf")
    assert sorted(exported) == sorted(source)
    assert all(exported[key].dtype == source[key].dtype for key in source)
    assert (step_dir / "hf" / "config.json").read_bytes() == (pathlib.Path(folder) / "config.json").read_bytes()
    trained = dcp_weights(step_dir, tmp_path)
    untrained = [key for key in source if key.startswith(("model.visual.", "mtp."))]
    assert bool(untrained) == architecture.startswith("qwen3_5")  # the vision-language folders
    assert all(torch.equal(exported[key], source[key]) for key in untrained)
    loaded = text_model(step_dir / "hf").state_dict()  # Qwen3.5: through Qwen3_5ForConditionalGeneration
    assert all(torch.equal(loaded[name], tensor) for name, tensor in trained.items())
    assert not torch.equal(
        loaded["model.embed_tokens.weight"], text_model(folder).state_dict()["model.embed_tokens.weight"]
    )
    again = torchrun(2, *flags[:3], str(step_dir / "hf"), "--steps", "1", "--out_dir", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert metrics(tmp_path / "again")[0]["mismatch_abs"] < 1e-4


def hub_tensors(folder):
    """Every tensor of a folder's safetensors files, by its name there."""
    return {
        key: tensor
        for file in sorted(pathlib.Path(folder).glob("*.safetensors"))
        for key, tensor in load_file(file).items()
    }


def dcp_weights(step_dir, tmp_path):
    """The trained parameters of a checkpoint's dcp/, converted by torch's own tool: an independent copy."""
    dcp_to_torch_save(step_dir / "dcp", tmp_path / "full.pt")
    return torch.load(tmp_path / "full.pt", weights_only=False)["model"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_k_steps_resume_k_steps_equals_2k_steps_at_tp_2(architecture, hub_folders, tmp_path):
    flags = ("--preset", "cpu", "--model", hub_folders[architecture], "--tp", "2", "--eval_every", "2")
    flags += ("--eval_prompts", "4", "--save_every", "2", "--sample_every", "0")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert torchrun(2, *flags, "--steps", "4", "--out_dir", str(straight)).returncode == 0
    first = torchrun(2, *flags, "--steps", "2", "--out_dir", str(split))
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(2, *flags, "--steps", "4", "--resume", "auto", "--out_dir", str(split))
    assert second.returncode == 0, second.stderr[-3000:]
    assert timeless(split) == timeless(straight)  # rewards, losses, grad norms, evaluations, step by step
    a, b = (hub_tensors(out / "checkpoints" / "step_000004" / "hf") for out in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def timeless(out_dir):
    """metrics.jsonl's lines without their timings, which no two runs share."""
    return [{k: v for k, v in row.items() if not k.startswith(("time_", "eta_s"))} for row in metrics_lines(out_dir)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lora_trains_every_architecture_and_its_adapter_loads_in_peft(architecture, hub_folders, tmp_path):
    """--lora_rank on the attention, Gated DeltaNet and dense or shared-expert projections (routed experts stay
    frozen: 3-D weights; so does Qwen3-Next's shared expert, whose names peft reads as the routed experts'): the
    adapter loads in peft onto the text model, and with it gives the merged export's logits."""
    from peft import PeftModel

    folder = hub_folders[architecture]
    flags = ("--preset", "cpu", "--model", folder, "--tp", "2", "--lora_rank", "8", "--lr", "1e-3", "--eval_every", "0")
    run = torchrun(2, *flags, "--steps", "3", "--sample_every", "0", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert max(r["mismatch_abs"] for r in metrics(tmp_path)) < 1e-4
    step_dir = tmp_path / "checkpoints" / "step_000003"
    adapters = load_file(step_dir / "adapter" / "adapter_model.safetensors")
    targets = {name.split(".")[-3] for name in adapters}
    assert targets >= {"q_proj", "o_proj"} and not any(".experts." in name for name in adapters)
    if "qwen3_5" in architecture:
        assert targets >= {"in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "down_proj"}  # the MLP or shared expert
    peft_model = PeftModel.from_pretrained(text_model(folder), step_dir / "adapter").eval()
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter, merged = (model(ids).logits for model in (peft_model, text_model(step_dir / "hf").eval()))
    assert (with_adapter - merged).abs().max() < 1e-4


# ----------------------------------------------------------------------------------------------------------------
# MoE training: the load-balancing loss, the experts' load


def load_balancing_loss(model, samples, num_experts, top_k):
    """Switch Transformer's load-balancing loss (Fedus et al., eqs. 4-6), in float64 from the definition, over the
    samples' tokens (right-padded, as the trainer's forward): E x sum_e f_e P_e, f_e the share of the top-k choices
    that go to expert e and P_e its mean router probability, over every MoE layer's tokens at once."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.tensor(
        [s.prompt_ids + s.response_ids + [0] * (longest - len(s.prompt_ids) - len(s.response_ids)) for s in samples]
    )
    mask = (
        torch.arange(longest)[None] < torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples])[:, None]
    )
    logits = model(input_ids=ids, attention_mask=mask.long(), output_router_logits=True).router_logits
    chosen, probs = 0.0, 0.0
    for layer in logits:
        p = layer.double().softmax(-1)[mask.reshape(-1)]
        chosen = chosen + torch.nn.functional.one_hot(p.topk(top_k, -1).indices, num_experts).sum((0, 1)).double()
        probs = probs + p.sum(0)
    rows = len(logits) * mask.sum()
    return num_experts * ((chosen / rows) * (probs / rows)).sum()


def aux_loss_step(rank, world, folder, dp, tp, coef):
    """One SGD step of the trainer with --router_aux_loss_coef on `dp` x `tp` ranks, each dp rank a micro-batch of 4
    samples; the full weights after it, and the logged expert_load_max."""
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = make_samples(4 * dp, seed=1)[4 * par.mesh["dp"].get_local_rank() :][:4]
    cfg = train.Config(micro_batch_size=4, max_grad_norm=0.0, router_aux_loss_coef=coef)
    _, maxima = train.train_on_rollouts(model, optimizer, samples, cfg, par)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.numpy().copy() for name, tensor in full.items()}, maxima["expert_load_max"]


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_the_load_balancing_loss_adds_its_definitions_gradient_and_the_busiest_expert_is_logged(dp, tp, hub_folders):
    """--router_aux_loss_coef 1: the sharded step equals an unsharded SGD step on the token-mean surrogate plus the
    load-balancing loss from its definition (float64; the mean of the dp ranks' micro-batches, as FSDP averages
    them), router included; expert_load_max is the busiest expert's tokens over the mean, the worst layer's."""
    folder = hub_folders["qwen3_5_moe"]
    weights, load = run_ranks(aux_loss_step, dp * tp, folder, dp, tp, 1.0)[0]
    reference = text_model(folder)
    config = reference.config
    samples = make_samples(4 * dp, seed=1)
    parts = [samples[4 * r : 4 * (r + 1)] for r in range(dp)]
    tokens = sum(sum(s.sampled) for s in samples)
    loss = 0.0
    for s in samples:  # on-policy: the ratio is 1, its gradient d log p
        logits = reference(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1].gather(
            -1, torch.tensor(s.response_ids)[:, None]
        )
        logp = logp.squeeze(-1)[torch.tensor(s.sampled)]
        loss = loss - (torch.exp(logp - logp.detach()) * s.advantage).sum() / tokens
    for part in parts:
        loss = loss + load_balancing_loss(reference, part, config.num_experts, config.num_experts_per_tok) / dp
    loss.backward()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            assert (torch.from_numpy(weights[name]) - (param - 0.1 * param.grad)).abs().max() < 1e-5, name
    assert load == pytest.approx(expert_load(reference, samples, config), rel=1e-9)


def expert_load(model, samples, config):
    """The busiest expert's share of a layer's top-k choices over the mean share, the worst layer's."""
    worst = 0.0
    for layer in range(config.num_hidden_layers):
        counts = torch.zeros(config.num_experts, dtype=torch.float64)
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.response_ids]), output_router_logits=True).router_logits[
                layer
            ]
            counts += torch.bincount(
                logits.topk(config.num_experts_per_tok, -1).indices.reshape(-1), minlength=config.num_experts
            )
        worst = max(worst, (counts.max() / counts.mean()).item())
    return worst


@pytest.mark.parametrize("model", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_every_feature_runs_on_the_gated_deltanet_moe_models_at_tp_2(model, tmp_path):
    """Partial rollouts (responses carried over pushes, their older tokens corrected), truncated sampling, CISPO off
    policy (two mini-batches), the KL to a reference model, the load-balancing loss, routing replay and evaluation,
    together, on a Gated DeltaNet MoE model at tp 2: the run completes, the engine's log-probs of the fresh tokens
    equal the trainer's, the kept mass, the experts' load and the routing mismatch are logged; the console says once
    that the Gated DeltaNet layers run without their GPU kernels."""
    flags = ("--preset", "cpu", "--model", model, "--tp", "2", "--steps", "4", "--eval_every", "2")
    flags += ("--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "6", "--top_p", "0.9")
    flags += ("--objective", "cispo", "--num_minibatches", "2", "--beta", "0.05", "--router_aux_loss_coef", "0.01")
    run = torchrun(2, *flags, "--routing_replay", "on", "--sample_every", "0", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["mismatch_abs"] < 1e-4 and r["log_kept_mass"] < 0 and r["expert_load_max"] >= 1 for r in rows)
    assert all(0 <= r["routing_mismatch"] <= 1 for r in rows)
    assert any(r["staleness_max"] >= 1 for r in rows) and rows[-1]["kl"] > 0
    assert "eval_greedy_acc" in rows[1] and "eval_greedy_acc" in rows[3]
    # No kernel's fallback warning from transformers among the trainer's lines: one note, in the trainer's words.
    assert "falling back to its reference PyTorch" not in run.stdout + run.stderr
    assert run.stdout.count("Gated DeltaNet layers run PyTorch's reference implementation, as on any CPU") == 1


def experts_with_idle_ranks(rank, world):
    """A routed-experts layer split by expert over tp 2 whose tokens all go to rank 0's experts: its output and
    gradients against the same layer whole (transformers' own forward), each rank's."""
    torch.manual_seed(0)
    config = architectures.text_config(AutoConfig.for_model("qwen3_moe", **SMALL_MOE))
    whole = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    with torch.no_grad():
        whole.gate_up_proj.normal_(0, 0.2)
        whole.down_proj.normal_(0, 0.2)
    split = copy.deepcopy(whole)
    split.config = copy.deepcopy(config)
    split.config._experts_implementation = "by_rank"
    parallelize_module(split, launch.parallel_groups("cpu", 2).mesh["tp"], architectures.ExpertsByRank())
    hidden = torch.randn(6, config.hidden_size)
    index = torch.tensor([[0, 1]] * 6)  # experts 0 and 1: rank 0's two of 4
    weights = torch.rand(6, 2)
    results = []
    for experts in (whole, split):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(x, index, w)
        (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
        grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in (experts.gate_up_proj.grad,)]
        results.append((out.detach(), x.grad, w.grad, grads[0]))
    return [max((a - b).abs().max().item() for a, b in zip(*results))]


def test_a_rank_whose_experts_get_no_token_still_gives_exact_output_and_gradients():
    """By-expert split, every token routed to rank 0's experts: rank 1 runs none through its grouped matmuls, yet it
    takes part in the sums over tp, and the layer's output, its inputs' gradients and every expert's gradient (0 for
    rank 1's) equal the whole layer's."""
    assert max(max(r) for r in run_ranks(experts_with_idle_ranks, 2)) < 1e-5
