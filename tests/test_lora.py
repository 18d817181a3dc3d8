"""LoRA (--lora_rank): a layer's output and adapter gradients against the formula in float64; a step on every mesh
against an unsharded reference, the base untouched, the push merged; the checkpoint's adapter/ read by PEFT; the demo
learning; bad flags and mismatched resumes refused; a resume exact."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

import checkpoint
import engines
import flags
import launch
import lora
import train
from demo_model import demo_config, demo_tokenizer
from test_checkpoint import hf_weights, logged, save_two_checkpoints_recording_syncs
from test_parallel import VOCAB, make_samples, reference_step, save_reference
from test_train import metrics, torchrun
from workers import run_ranks

RANK, ALPHA = 4, 16.0  # scale 4: a scale of 1, alpha or 1 / rank would show
TARGETS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def whole(param):
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def adapters_of(model):
    """{name: full tensor} of the adapters; a collective, on every rank."""
    return {name: whole(param) for name, param in model.named_parameters() if ".lora_" in name}


def lora_model(folder, par, b_seed=None):
    """The trainer's LoRA model of `folder`, and its adapters as init_adapters set them; B then seeded random (not
    zero) when b_seed is given, so that A gets a gradient and the push's merge is more than W."""
    config = AutoConfig.from_pretrained(folder)
    model = train.build_model(config, par.mesh, torch.device("cpu"), lora_rank=RANK, lora_alpha=ALPHA)
    cfg = train.Config(model=folder)
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, config, par.world_group)
    lora.init_adapters(model, cfg.seed)  # as train.main
    loaded = adapters_of(model)
    if b_seed is not None:
        g = torch.Generator().manual_seed(b_seed)
        b = {name: 0.02 * torch.randn(t.shape, generator=g) for name, t in loaded.items() if ".lora_B" in name}
        set_model_state_dict(model, b, options=StateDictOptions(full_state_dict=True, strict=False))
    return model, loaded


def numpy(tensors):  # numpy crosses the queue by value
    return {name: t.numpy().copy() for name, t in tensors.items()}


# ----------------------------------------------------------------------------- one layer, in float64
def layer_inputs_outputs_grads(rank, world, folder):
    par = launch.parallel_groups("cpu", 1)
    model, _ = lora_model(folder, par, b_seed=1)
    adapters = adapters_of(model)
    seen = {}

    def keep(name):  # after LoRA's hook: the layer's output with the adapters' term, and its upstream gradient
        def hook(module, args, out):
            seen[name] = {"x": args[0].detach().clone(), "out": out.detach().clone()}
            out.register_hook(lambda grad: seen[name].update(grad=grad.clone()))

        return hook

    layer = model.model.layers[1]
    for name in TARGETS:
        layer.get_submodule(name).register_forward_hook(keep(name))
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    grads = {name: whole(param.grad) for name, param in model.named_parameters() if param.grad is not None}
    return model.lora_scale, numpy(adapters), numpy(grads), {k: numpy(v) for k, v in seen.items()}


def test_a_lora_layer_adds_alpha_over_rank_x_a_t_b_t_and_gives_a_and_b_their_exact_gradients(tmp_path):
    folder = save_reference(tmp_path, "qwen2", False)
    scale, adapters, grads, seen = run_ranks(layer_inputs_outputs_grads, 1, folder)[0]
    assert scale == ALPHA / RANK
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert sorted(grads) == sorted(adapters) and len(adapters) == 2 * len(TARGETS) * 2  # only adapters train
    for name in TARGETS:
        prefix = f"model.layers.1.{name}"
        x, out, grad = (torch.from_numpy(seen[name][k]).double() for k in ("x", "out", "grad"))
        w = base[f"{prefix}.weight"].double()
        bias = base[f"{prefix}.bias"].double() if f"{prefix}.bias" in base else 0.0
        a, b = (torch.from_numpy(adapters[f"{prefix}.lora_{x}.weight"]).double().requires_grad_() for x in "AB")
        assert a.shape == (RANK, w.shape[1]) and b.shape == (w.shape[0], RANK)
        expected = x @ w.T + bias + ALPHA / RANK * (x @ a.T) @ b.T
        assert (out - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item()), name
        assert (expected - (x @ w.T + bias)).abs().max() > 1e-3, name  # the adapters' term, well above tolerance
        grad_a, grad_b = torch.autograd.grad(expected, (a, b), grad)
        for got, want in ((grads[f"{prefix}.lora_A.weight"], grad_a), (grads[f"{prefix}.lora_B.weight"], grad_b)):
            assert want.abs().max() > 1e-3, name
            assert (torch.from_numpy(got).double() - want).abs().max().item() < 1e-5 * want.abs().max().item(), name


def base_logits_with_scale_zero(rank, world, folder):
    par = launch.parallel_groups("cpu", 1)
    model, _ = lora_model(folder, par, b_seed=1)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapters = model(ids).logits
        model.lora_scale = 0.0
        without = model(ids).logits
    return with_adapters.numpy(), without.numpy()


def test_lora_scale_zero_switches_the_adapters_off_giving_the_base_model(tmp_path):
    """How --beta gets its reference under LoRA: the same model, its adapters scaled by 0."""
    folder = save_reference(tmp_path, "qwen2", False)
    with_adapters, without = run_ranks(base_logits_with_scale_zero, 1, folder)[0]
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
    assert (torch.from_numpy(without) - base).abs().max() < 1e-5
    assert (torch.from_numpy(with_adapters) - base).abs().max() > 1e-2


# ----------------------------------------------------------------------------- a step on every mesh
def reference_lora_model(folder, adapters):
    """The unsharded model of `folder` with LoRA written from the formula: y = x W^T + b + (alpha / r) x A^T B^T,
    the base frozen."""
    model = AutoModelForCausalLM.from_pretrained(folder).requires_grad_(False)
    for name, linear in model.named_modules():
        if name.endswith(TARGETS):
            linear.A = torch.nn.Parameter(adapters[f"{name}.lora_A.weight"].clone())
            linear.B = torch.nn.Parameter(adapters[f"{name}.lora_B.weight"].clone())
            linear.forward = lambda x, m=linear: F.linear(x, m.weight, m.bias) + ALPHA / RANK * (x @ m.A.T) @ m.B.T
    return model


def lora_step(rank, world, folder, dp, tp):
    """One SGD step of the trainer's loss under LoRA on a (dp, tp) mesh, and the same step on the reference."""
    par = launch.parallel_groups("cpu", tp)
    model, loaded = lora_model(folder, par, b_seed=2)
    start = adapters_of(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)  # as main: the trained
    samples = make_samples(8, seed=1)
    share = len(samples) // dp
    per_rank = [samples[r * share : (r + 1) * share] for r in range(dp)]
    cfg = train.Config(micro_batch_size=3, max_grad_norm=0.05)
    _, maxima = train.train_on_rollouts(model, optimizer, per_rank[par.mesh["dp"].get_local_rank()], cfg, par)
    after = adapters_of(model)
    frozen = {name: whole(param) for name, param in model.named_parameters() if ".lora_" not in name}
    buckets = engines.weight_buckets(engines.full_weights(model, torch.float32), 1 << 14)
    pushed = {name: full for bucket in buckets for name, full in bucket}
    if rank > 0:
        return None
    reference = reference_lora_model(folder, start)
    ref_norm = reference_step(reference, [sum(per_rank, [])], 1.0, 0.05, "sgd")
    expected = {
        f"{name}.lora_{x}.weight": getattr(module, x).detach()
        for name, module in reference.named_modules()
        if hasattr(module, "A")
        for x in "AB"
    }
    return dict(
        loaded=numpy(loaded),
        start=numpy(start),
        after=numpy(after),
        expected=numpy(expected),
        norm=(maxima["grad_norm"], ref_norm),
        frozen=numpy(frozen),
        pushed=list(pushed),
        pushed_values=numpy(pushed),
    )


CASES = [("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen2", 1, 2), ("qwen2", 2, 2), ("qwen3", 2, 2)]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """lora_step's results per case; Qwen2 untied (q/k/v biases, its own lm_head), Qwen3 tied (q/k norms)."""
    results, folders = {}, {}
    for family, dp, tp in CASES:
        if family not in folders:
            folders[family] = save_reference(tmp_path_factory.mktemp(family), family, family == "qwen3")
        results[family, dp, tp] = run_ranks(lora_step, dp * tp, folders[family], dp, tp)[0]
    return results, folders


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-dp{dp}-tp{tp}" for f, dp, tp in CASES])
def test_a_lora_step_on_a_mesh_equals_the_unsharded_step_and_leaves_the_base_bit_identical(steps, case):
    results, folders = steps
    r = results[case]
    sharded_norm, ref_norm = r["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05  # clipped: the 2-D norm path
    assert sorted(r["after"]) == sorted(r["expected"])
    for name, want in r["expected"].items():
        moved = abs(want - r["start"][name]).max()
        assert moved > 1e-5, name  # A and B both take a step (B is not zero)
        assert abs(r["after"][name] - want).max() < 1e-3 * moved + 1e-7, name  # fp32: ~1e-8 apart
    base = AutoModelForCausalLM.from_pretrained(folders[case[0]]).state_dict()
    frozen = {name: torch.from_numpy(t) for name, t in r["frozen"].items()}
    assert sorted(frozen) == sorted(dict(AutoModelForCausalLM.from_pretrained(folders[case[0]]).named_parameters()))
    assert all(torch.equal(frozen[name], base[name]) for name in frozen)  # bit for bit


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_adapters_start_alike_on_every_mesh_a_uniform_within_one_over_root_in_b_zero(steps, family):
    results, _ = steps
    runs = [r["loaded"] for (f, _, _), r in results.items() if f == family]
    for name, first in runs[0].items():
        assert all((r[name] == first).all() for r in runs[1:]), name  # bit for bit, whatever the mesh
        if ".lora_B" in name:
            assert (first == 0).all(), name
        else:
            bound = first.shape[1] ** -0.5
            assert abs(first).max() <= bound and abs(first).max() > 0.9 * bound, name
            assert abs(first.std() - bound / 3**0.5) < 0.1 * bound, name  # uniform's std


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-dp{dp}-tp{tp}" for f, dp, tp in CASES])
def test_the_push_sends_w_plus_alpha_over_rank_b_a_under_hf_names_without_adapters(steps, case):
    results, folders = steps
    r = results[case]
    base = dict(AutoModelForCausalLM.from_pretrained(folders[case[0]]).named_parameters())
    assert r["pushed"] == list(base)  # HF's names and order; no lora_A / lora_B
    merged = 0
    for name, value in r["pushed_values"].items():
        got, w = torch.from_numpy(value), base[name].detach()
        prefix = name.removesuffix(".weight")
        if prefix.endswith(TARGETS) and name.endswith(".weight"):
            a, b = (torch.from_numpy(r["after"][f"{prefix}.lora_{x}.weight"]).double() for x in "AB")
            want = w.double() + ALPHA / RANK * b @ a
            assert (got.double() - want).abs().max() < 1e-6, name
            assert (want - w.double()).abs().max() > 1e-3, name
            merged += 1
        else:  # biases, norms, embeddings, lm_head: the base's own, bit for bit
            assert torch.equal(got, w), name
    assert merged == len(TARGETS) * 2


# ----------------------------------------------------------------------------- through torchrun
@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """The CPU demo's tiny model saved as a local --model, so that PEFT has the base on disk."""
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(demo_config()).save_pretrained(folder)
    demo_tokenizer().save_pretrained(folder)
    return str(folder)


def lora_flags(base_folder, out_dir, steps):
    """--beta 0.05: under LoRA the KL's reference is the base, the adapters scaled by 0."""
    return (
        "--preset",
        "cpu",
        "--model",
        base_folder,
        "--lora_rank",
        "8",
        "--lora_alpha",
        "16",
        "--beta",
        "0.05",
        "--eval_every",
        "2",
        "--eval_prompts",
        "4",
        "--warmup_steps",
        "2",
        "--lr_schedule",
        "cosine",
        "--save_every",
        "2",
        "--steps",
        str(steps),
        "--out_dir",
        str(out_dir),
    )


@pytest.fixture(scope="module")
def lora_run(base_folder, tmp_path_factory):
    """4 steps of LoRA, rank 8, alpha 16, through torchrun on 2 ranks, checkpointed at steps 2 and 4; its out_dir."""
    out = tmp_path_factory.mktemp("lora_run")
    run = torchrun(2, *lora_flags(base_folder, out, 4))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_the_checkpoints_adapter_loads_in_peft_onto_the_base_as_the_merged_hf_model(base_folder, lora_run):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    step_dir = lora_run / "checkpoints" / "step_000004"
    saved = load_file(step_dir / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * len(TARGETS) * demo_config().num_hidden_layers
    assert all(name.startswith("base_model.model.model.layers.") for name in saved)
    assert max(t.abs().max().item() for name, t in saved.items() if "lora_B" in name) > 1e-3  # B has left zero
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), step_dir / "adapter")
    loaded = get_peft_model_state_dict(peft_model)
    assert sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert peft_model.peft_config["default"].r == 8 and peft_model.peft_config["default"].lora_alpha == 16
    merged_hf = AutoModelForCausalLM.from_pretrained(step_dir / "hf")
    ids = torch.randint(3, demo_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter, merged, base = (
            model.eval()(ids).logits
            for model in (peft_model, merged_hf, AutoModelForCausalLM.from_pretrained(base_folder))
        )
    assert (with_adapter - merged).abs().max() < 1e-4
    assert (base - merged).abs().max() > 1e-2  # the adapters changed the model
    unloaded = peft_model.merge_and_unload().state_dict()
    hf = hf_weights(lora_run, 4)
    assert all((unloaded[name] - hf[name]).abs().max() < 1e-6 for name in hf)
    assert sorted(hf) == sorted(name for name in unloaded if name != "lm_head.weight")  # tied: saved once


def test_the_checkpoints_dcp_holds_the_adapters_and_their_optimizer_state_alone(lora_run, tmp_path):
    """The frozen base comes from --model at a resume: the distributed checkpoint does not repeat it."""
    dcp_to_torch_save(lora_run / "checkpoints" / "step_000004" / "dcp", tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    assert [name for name in state["model"] if ".lora_" not in name] == []
    assert len(state["model"]) == 2 * len(TARGETS) * demo_config().num_hidden_layers
    saved = load_file(lora_run / "checkpoints" / "step_000004" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(state["model"][name], saved[f"base_model.model.{name}"]) for name in state["model"])
    moments = state["optim"]["state"]
    assert sorted(moments) == sorted(state["model"]) and all(m["step"] == 4 for m in moments.values())


def test_beta_under_lora_takes_its_kl_to_the_base(lora_run):
    """B starts at zero, so step 1's policy is the base (KL 0); after a step the adapters make it differ."""
    rows = metrics(lora_run)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[1]["kl"] > 1e-3
    assert all(r["mismatch_abs"] < 1e-4 for r in rows)  # the engine holds the merged weights after every push


def test_lora_k_steps_resume_k_steps_equals_2k_steps(base_folder, lora_run, tmp_path):
    """The run cut at its checkpoint of step 2, then resumed in a fresh torchrun, repeats steps 3 and 4 exactly."""
    split = tmp_path / "split"
    shutil.copytree(lora_run, split)
    shutil.rmtree(split / "checkpoints" / "step_000004")
    resumed = torchrun(2, *lora_flags(base_folder, split, 4), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming " in resumed.stdout and "checkpoints/step_000002... " in resumed.stdout
    assert [row["step"] for row in metrics(split)] == [1, 2, 3, 4]
    assert logged(split) == logged(lora_run)  # rewards, losses, grad norms, KL, eval, step by step
    a, b = hf_weights(lora_run, 4), hf_weights(split, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    adapters = [
        load_file(out / "checkpoints" / "step_000004" / "adapter" / "adapter_model.safetensors")
        for out in (lora_run, split)
    ]
    assert adapters[0].keys() == adapters[1].keys() and all(
        torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0]
    )


def test_the_cpu_demo_with_lora_learns_the_toy_reward(tmp_path):
    """The README's CPU command with --lora_rank 8: the adapters alone learn what full fine-tuning learns."""
    run = torchrun(2, "--preset", "cpu", "--lora_rank", "8", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31)) and rows[0]["reward"] < 0.3
    assert sum(r["reward"] for r in rows[-5:]) / 5 >= 0.95
    assert rows[-1]["eval_greedy_acc"] == 1.0


# ----------------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    "flag,value",
    [
        ("--lora_rank", "-1"),
        ("--lora_alpha", "0"),
        ("--lora_alpha", "nan"),
        ("--lora_alpha", "-2"),
        ("--lora_alpha", "inf"),
    ],
)
def test_a_bad_lora_flag_is_refused_in_one_line_naming_it(flag, value):
    with pytest.raises(SystemExit) as refused:
        flags.check_config(flags.parse(train.Config, train.PRESETS, ["--preset", "cpu", flag, value]), 2)
    message = str(refused.value)
    assert message.startswith(f"{flag} must be ") and "\n" not in message and value in message.lower()


def test_resuming_with_another_lora_rank_stops_in_one_line_naming_the_flag(base_folder, lora_run, tmp_path):
    """A full fine-tuning resume of a LoRA checkpoint would load no weight at all (its dcp holds the adapters alone),
    and another rank's adapters do not fit: both are refused before any model is built."""
    step_dir = str(lora_run / "checkpoints" / "step_000004")
    run = torchrun(
        2,
        "--preset",
        "cpu",
        "--model",
        base_folder,
        "--resume",
        step_dir,
        "--steps",
        "6",
        "--out_dir",
        str(tmp_path / "out"),
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "loading" not in out and "[rank1]" not in out
    [line] = [line for line in out.splitlines() if "--lora_rank" in line and "--resume" in line]
    assert line.startswith(f"--resume {step_dir} was trained with --lora_rank 8") and out.count(line) == 1
    config = AutoConfig.from_pretrained(base_folder)
    for rank in (4, 16):
        cfg = train.Config(model=base_folder, resume=step_dir, lora_rank=rank, steps=6, out_dir=str(tmp_path))
        with pytest.raises(SystemExit, match=f"^--resume {step_dir} was trained with --lora_rank 8[^\n]*$"):
            checkpoint.find_resume(cfg, config)


def test_resuming_with_another_lora_alpha_stops_in_one_line_as_it_would_rescale_the_trained_update(lora_run, tmp_path):
    """alpha / R scales B A: resumed with another alpha, the policy would jump at the first step. Without LoRA
    --lora_alpha scales nothing, and a full fine-tuning checkpoint resumes under any."""
    step_dir = str(lora_run / "checkpoints" / "step_000002")
    for alpha in (32.0, 8.0):
        cfg = train.Config(model="tiny", resume=step_dir, lora_rank=8, lora_alpha=alpha, steps=6, out_dir=str(tmp_path))
        with pytest.raises(SystemExit, match=f"^--resume {step_dir} was trained with --lora_alpha 16.0[^\n]*$"):
            checkpoint.find_resume(cfg, demo_config())
    run_ranks(save_two_checkpoints_recording_syncs, 1, str(tmp_path / "full"))
    cfg = train.Config(model="tiny", resume="auto", lora_alpha=8.0, steps=4, out_dir=str(tmp_path / "full"))
    assert checkpoint.find_resume(cfg, demo_config())[:2] == (str(tmp_path / "full" / "checkpoints" / "step_000002"), 2)


def test_resuming_a_checkpoint_from_before_lora_with_lora_on_stops_in_one_line(tmp_path):
    """Checkpoints saved before --lora_rank existed have no lora_rank in their config: full fine-tuning."""
    run_ranks(save_two_checkpoints_recording_syncs, 1, str(tmp_path))
    state_file = tmp_path / "checkpoints" / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["lora_rank"], state["config"]["lora_alpha"]
    state_file.write_text(json.dumps(state))
    cfg = train.Config(model="tiny", resume="auto", lora_rank=8, steps=4, out_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="was trained with --lora_rank 0[^\n]*$"):
        checkpoint.find_resume(cfg, demo_config())
