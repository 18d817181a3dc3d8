"""Advantages, loss, KL, entropy, log-probs and the schedule against float64 references written from the formulas."""
import math
import statistics

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import train
from test_parallel import VOCAB, make_samples, tiny_config
from workers import run_ranks


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 3.0])
    adv = train.group_advantages(rewards, 4).tolist()
    for g in range(2):
        group = rewards[4 * g:4 * g + 4].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)  # unbiased, as torch.std
        for i, r in enumerate(group):
            assert adv[4 * g + i] == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)
    no_std = train.group_advantages(rewards, 4, scale_std=False).tolist()
    assert no_std[:4] == pytest.approx([1.0 - 0.5, -0.5, 0.0, 0.0])


def test_equal_rewards_give_zero_advantage():
    assert train.group_advantages(torch.ones(8), 4).abs().max() == 0


def reference_loss(logp, old, adv, weights, lo, hi, beta, ref, coef, ent):
    """Per token, in float64: -min(r A, clip(r, 1-lo, 1+hi) A) + beta k3 - coef H, weighted sum."""
    total = 0.0
    for i in range(len(logp)):
        r = math.exp(logp[i] - old[i])
        term = -min(r * adv[i], min(max(r, 1 - lo), 1 + hi) * adv[i])
        d = ref[i] - logp[i]
        term += beta * (math.exp(d) - d - 1) - coef * ent[i]
        total += weights[i] * term
    return total


def test_policy_loss_value_and_gradient_match_the_formula():
    g = torch.Generator().manual_seed(0)
    n = 64
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ref = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.2
    ent = torch.rand(n, generator=g, dtype=torch.float64).requires_grad_()
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    args = (0.2, 0.28, 0.05, ref, 0.01, ent)
    loss, metrics = train.policy_loss(logp, old, adv, weights, *args)
    expected = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), weights.tolist(), 0.2, 0.28, 0.05,
                              ref.tolist(), 0.01, ent.tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # d/dlogp: -r A where the unclipped term is the minimum (0 where clipping holds it), plus beta (1 - e^d).
    for i in range(n):
        r = math.exp(logp[i].item() - old[i].item())
        a = adv[i].item()
        unclipped_active = r * a <= min(max(r, 0.8), 1.28) * a
        d = ref[i].item() - logp[i].item()
        want = weights[i].item() * ((-r * a if unclipped_active else 0.0) + 0.05 * (1 - math.exp(d)))
        assert logp.grad[i].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert ent.grad.tolist() == pytest.approx((-0.01 * weights).tolist())
    ratios = torch.exp(logp - old).detach()
    clipped = ((ratios < 0.8) & (adv < 0)) | ((ratios > 1.28) & (adv > 0))
    assert metrics["clip_frac"] == clipped.sum().item() > 0
    kl = sum(math.exp(d) - d - 1 for d in (ref - logp).tolist())
    assert metrics["kl"] == pytest.approx(kl)


def naive_logprobs(model, samples, temperature):
    """Full-vocabulary softmax over whole sequences in float64, one sample at a time."""
    logps, ents = [], []
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["ids"]])
        logits = model(ids).logits[0].double() / temperature
        p = len(s["prompt_ids"])
        log_probs = torch.log_softmax(logits[p - 1:-1], -1)
        logps.append(log_probs.gather(-1, torch.tensor(s["ids"])[:, None]).squeeze(-1))
        ents.append(-(log_probs.exp() * log_probs).sum(-1))
    return torch.cat(logps), torch.cat(ents)


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(chunk, temperature):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", False))
    samples = make_samples(6, seed=3)
    cfg = train.Config(logprob_chunk=chunk, temperature=temperature)
    with torch.no_grad():
        logp, ent = train.response_logprobs(model, samples, cfg, pad_id=0)
        want_logp, want_ent = naive_logprobs(model, samples, temperature)
    assert logp.shape == want_logp.shape
    assert (logp.double() - want_logp).abs().max() < 1e-5
    assert (ent.double() - want_ent).abs().max() < 1e-5


def test_only_one_chunk_of_vocabulary_logits_is_kept_for_backward():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", False))
    samples = make_samples(6, seed=3)
    tokens = sum(len(s["ids"]) for s in samples)
    chunk = 4
    assert tokens > 2 * chunk
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logp, _ = train.response_logprobs(model, samples, train.Config(logprob_chunk=chunk), pad_id=0)
    hidden = model.config.hidden_size
    logit_like = [s for s in saved if len(s) and s[-1] == VOCAB and tuple(s) != (hidden, VOCAB)]  # not lm_head.T
    assert sum(math.prod(s) for s in logit_like) <= chunk * VOCAB, logit_like
    logp.sum().backward()  # recomputed chunk by chunk in backward
    assert model.lm_head.weight.grad.abs().sum() > 0


def weights_of_two_ranks(rank, world, loss_agg):
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    samples = make_samples(6, seed=4)[rank * 3:(rank + 1) * 3]
    return train.token_weights(samples, loss_agg, mesh["dp"].get_group(), torch.device("cpu")).tolist()


def test_token_weights_follow_the_aggregation_over_all_ranks():
    samples = make_samples(6, seed=4)
    lengths = [len(s["ids"]) for s in samples]
    token = sum(run_ranks(weights_of_two_ranks, 2, "token"), [])
    # FSDP averages over dp = 2, so each weight carries a factor 2.
    assert token == pytest.approx([2 / sum(lengths)] * sum(lengths))
    sequence = sum(run_ranks(weights_of_two_ranks, 2, "sequence"), [])
    assert sequence == pytest.approx([2 / (n * len(samples)) for n in lengths for _ in range(n)])


def step_with_nan_advantage(rank, world):
    config = tiny_config("qwen2", True)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = train.build_model(config, mesh, torch.device("cpu"), state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    samples = make_samples(4, seed=5)
    samples[0]["advantage"] = float("nan")
    sums = train.train_on_rollouts(model, optimizer, samples, train.Config(), mesh, 0)
    after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return sums["skipped_steps"], max((after[k] - state[k]).abs().max().item() for k in state)


def test_non_finite_grad_norm_skips_the_step():
    skipped, change = run_ranks(step_with_nan_advantage, 1)[0]
    assert skipped == 1 and change == 0


def test_lr_schedule_warms_up_then_holds_or_decays():
    cfg = train.Config(warmup_steps=4, steps=14, lr_schedule="constant")
    f = train.lr_lambda(cfg)
    assert [f(s) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    cosine = train.lr_lambda(train.Config(warmup_steps=4, steps=14, lr_schedule="cosine"))
    assert cosine(4) == pytest.approx(1.0) and cosine(9) == pytest.approx(0.55) and cosine(14) == pytest.approx(0.1)


def engine_and_trainer_logprobs(n=50, seed=6):
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    trainer = engine + torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    return trainer, engine


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_engine_mismatch_sums_and_truncated_importance_weights_match_the_formulas(cap):
    trainer, engine = engine_and_trainer_logprobs()
    weights, sums = train.engine_mismatch(trainer, engine, cap)
    ratios = [math.exp(t) / math.exp(e) for t, e in zip(trainer.tolist(), engine.tolist())]  # p_trainer / p_engine
    assert sums["mismatch_abs"] == pytest.approx(sum(abs(math.log(r)) for r in ratios), rel=1e-12)
    assert sums["mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios), rel=1e-10)  # k3
    if cap == 0:
        assert weights is None
    else:
        assert weights.tolist() == pytest.approx([min(r, cap) for r in ratios], rel=1e-12)
        assert 0 < sum(r > cap for r in ratios) < len(ratios)  # the cap binds on some tokens, not all


def test_identical_logprobs_give_no_mismatch_and_unit_weights():
    trainer, _ = engine_and_trainer_logprobs()
    weights, sums = train.engine_mismatch(trainer, trainer.clone(), 2.0)
    assert sums == {"mismatch_abs": 0.0, "mismatch_kl": 0.0} and weights.tolist() == [1.0] * len(trainer)


def test_importance_weights_scale_only_the_policy_gradient_term():
    g = torch.Generator().manual_seed(7)
    n = 64
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ref = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.2
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    is_w = torch.rand(n, generator=g, dtype=torch.float64) * 2
    beta, coef, lo, hi = 0.05, 0.01, 0.2, 0.28
    loss, _ = train.policy_loss(logp, old, adv, weights, lo, hi, beta, ref, coef, ent, is_weights=is_w)
    expected = 0.0
    for i in range(n):
        r = math.exp(logp[i].item() - old[i].item())
        a = adv[i].item()
        pg = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
        d = ref[i].item() - logp[i].item()
        expected += weights[i].item() * (is_w[i].item() * pg + beta * (math.exp(d) - d - 1) - coef * ent[i].item())
    assert loss.item() == pytest.approx(expected, rel=1e-12)
