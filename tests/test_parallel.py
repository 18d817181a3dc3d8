"""Sharded (FSDP2 over dp, DTensor TP over tp) against an unsharded model: logits, gradient norm, weights after
a step (so the gradients), and the gathered full state dict, on meshes (2,1), (1,2), (2,2)."""
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

import train
from workers import run_ranks

VOCAB = 96


def tiny_config(family, tied):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)  # Qwen3Config defaults head_dim to 128
    return Qwen2Config(**common)


def make_samples(n, seed):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        prompt_len, response_len = torch.randint(2, 7, (2,), generator=g).tolist()
        ids = torch.randint(1, VOCAB, (prompt_len + response_len,), generator=g).tolist()
        samples.append({"prompt_ids": ids[:prompt_len], "ids": ids[prompt_len:], "finish": "stop",
                        "advantage": torch.randn((), generator=g).item(), "logprobs": [0.0] * response_len})
    return samples


def reference_step(model, minibatches, lr, max_norm, optimizer_name, clip_low=0.2, clip_high=0.28):
    """Token-mean clipped surrogate on an unsharded model, straight from the formula: one optimizer step per
    mini-batch, the ratio taken against the policy before the first step. Returns the mean grad norm."""
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr)

    def logprobs(s):
        logits = model(torch.tensor([s["prompt_ids"] + s["ids"]])).logits[0].double()
        p = len(s["prompt_ids"])
        return torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, torch.tensor(s["ids"])[:, None]).squeeze(-1)

    with torch.no_grad():
        old = [[logprobs(s) for s in minibatch] for minibatch in minibatches]
    norms = []
    for minibatch, old_logps in zip(minibatches, old):
        total_tokens = sum(len(s["ids"]) for s in minibatch)
        loss = 0.0
        for s, old_logp in zip(minibatch, old_logps):
            ratio = torch.exp(logprobs(s) - old_logp)
            adv = s["advantage"]
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
            loss = loss - surrogate.sum() / total_tokens
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return sum(norms) / len(norms)


def make_optimizer(name, params, lr):
    return torch.optim.SGD(params, lr=lr) if name == "sgd" else torch.optim.AdamW(params, lr=lr)


def sharded_vs_unsharded(rank, world, family, tied, dp, tp, optimizer_name, max_norm, activation_checkpointing,
                         num_minibatches=1):
    config = tiny_config(family, tied)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = train.build_model(config, mesh, torch.device("cpu"), state if rank == 0 else {}, activation_checkpointing)
    lr = 0.1 if optimizer_name == "sgd" else 1e-3
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr)  # before the first forward

    samples = make_samples(8, seed=1)
    ids = torch.tensor([s["prompt_ids"][:2] + s["ids"][:1] for s in samples])
    with torch.no_grad():
        logits_diff = (model(ids).logits - reference(ids).logits).abs().max().item()

    cfg = train.Config(micro_batch_size=3, max_grad_norm=max_norm, num_minibatches=num_minibatches)
    share = len(samples) // dp
    per_rank = [samples[r * share:(r + 1) * share] for r in range(dp)]
    model.train()
    sums = train.train_on_rollouts(model, optimizer, per_rank[mesh["dp"].get_local_rank()], cfg, mesh, 0)
    # Mini-batch m of the whole batch is the m-th slice of every rank's share.
    size = share // num_minibatches
    minibatches = [sum((part[m * size:(m + 1) * size] for part in per_rank), []) for m in range(num_minibatches)]
    ref_norm = reference_step(reference, minibatches, lr, max_norm, optimizer_name)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = reference.state_dict()
    weight_diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    return {"logits": logits_diff, "weights": weight_diff, "norm": (sums["grad_norm"], ref_norm),
            "keys": (sorted(full), sorted(expected))}


MESHES = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)])
def test_sharded_step_matches_unsharded(dp, tp, family, tied):
    # max_norm 0.05 is below the gradient norm, so the 2-D clipping path scales the gradients.
    result = run_ranks(sharded_vs_unsharded, dp * tp, family, tied, dp, tp, "sgd", 0.05, False)[0]
    assert result["keys"][0] == result["keys"][1]  # HF names, tied lm_head included
    assert result["logits"] < 1e-5
    sharded_norm, ref_norm = result["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05
    assert result["weights"] < 1e-5


def test_activation_checkpointing_keeps_the_step_exact():
    result = run_ranks(sharded_vs_unsharded, 4, "qwen3", False, 2, 2, "sgd", 1e9, True)[0]
    assert result["logits"] < 1e-5 and result["weights"] < 1e-5


def test_two_minibatches_take_two_steps_with_the_ratio_against_the_sampling_policy():
    result = run_ranks(sharded_vs_unsharded, 4, "qwen3", True, 2, 2, "sgd", 0.05, False, 2)[0]
    assert result["weights"] < 1e-5
    sharded_norm, ref_norm = result["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5)


def test_adamw_under_2d_sharding_matches_unsharded():
    # AdamW's first step is lr * sign(g) for every weight, which amplifies 1e-7 gradient noise where g ~ 0:
    # a tolerance of 0.2 * lr still catches a weight that is not updated at all (off by lr).
    result = run_ranks(sharded_vs_unsharded, 4, "qwen2", True, 2, 2, "adamw", 1e9, False)[0]
    assert result["weights"] < 0.2 * 1e-3


def accumulation(rank, world, micro_batch_size, loss_agg):
    config = tiny_config("qwen2", True)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    model = train.build_model(config, mesh, torch.device("cpu"), state if rank == 0 else {})
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    samples = make_samples(12, seed=2)[rank * 6:(rank + 1) * 6]
    cfg = train.Config(micro_batch_size=micro_batch_size, max_grad_norm=0.0, loss_agg=loss_agg)
    train.train_on_rollouts(model, optimizer, samples, cfg, mesh, 0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.numpy().copy() for k, v in full.items()}  # numpy crosses the queue by value


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(loss_agg):
    full = run_ranks(accumulation, 2, 6, loss_agg)[0]
    for micro in (1, 4):  # 4 leaves a ragged last micro-batch of 2
        split = run_ranks(accumulation, 2, micro, loss_agg)[0]
        assert max(abs(split[k] - full[k]).max() for k in full) < 1e-6
