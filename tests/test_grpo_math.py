"""Advantages, loss, KL, entropy, log-probs and the schedule against float64 references written from the formulas."""

import math
import statistics

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers import AutoModelForCausalLM

import launch
import train
import vocab_parallel
from live_logits import LiveLogits
from test_parallel import VOCAB, make_samples, save_reference, sharded_model, tiny_config
from workers import run_ranks


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 3.0])
    adv = train.group_advantages(rewards, 4).tolist()
    for g in range(2):
        group = rewards[4 * g : 4 * g + 4].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)  # unbiased, as torch.std
        for i, r in enumerate(group):
            assert adv[4 * g + i] == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)
    no_std = train.group_advantages(rewards, 4, scale_std=False).tolist()
    assert no_std[:4] == pytest.approx([1.0 - 0.5, -0.5, 0.0, 0.0])


@pytest.mark.parametrize("value, group_size", [(1.0, 4), (0.1, 8), (0.7, 12), (0.3, 6)])
@pytest.mark.parametrize("scale_std", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value, group_size, scale_std):
    """0.1 x 8 in float32 has a mean 0.1 does not equal: divided by std + eps, that remainder was -0.0074 each (and
    +0.106 for 0.7 x 12), a push with no signal behind it. The other group keeps its advantages."""
    rewards = torch.tensor([value] * group_size + [0.0] * (group_size - 1) + [1.0])
    adv = train.group_advantages(rewards, group_size, scale_std).tolist()
    assert adv[:group_size] == [0.0] * group_size
    assert adv[-1] > 0 > adv[group_size]


def batch_std_advantages(rank, world, tp, rewards, group_size):
    """set_advantages with --std_of batch on this rank's share of the groups (a TP group's ranks: the same share)."""
    par = launch.parallel_groups("cpu", tp)
    dp_rank, dp = par.mesh["dp"].get_local_rank(), par.mesh["dp"].size()
    share = len(rewards) // dp
    samples = [train.Sample([1], shaped_reward=r) for r in rewards[dp_rank * share : (dp_rank + 1) * share]]
    train.set_advantages(samples, train.Config(group_size=group_size, std_of="batch"), par.dp_group)
    return [s.advantage for s in samples]


@pytest.mark.parametrize("world, tp", [(2, 1), (2, 2), (4, 2)])
def test_batch_std_advantages_on_several_ranks_are_those_of_one_rank_holding_the_whole_batch(world, tp):
    """--std_of batch: the group's mean subtracted, the unbiased std of every reward of the step (all ranks) dividing,
    as TRL's scale_rewards="batch" (its eps is 1e-4, this trainer's 1e-6) and Lite PPO (group mean, batch std). A
    group whose rewards are all equal still gets 0."""
    group_size = 4
    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 3.0, 1.0, 0.1, 0.7, 0.4, 0.4]
    whole = run_ranks(batch_std_advantages, 1, 1, rewards, group_size)[0]
    shared = run_ranks(batch_std_advantages, world, tp, rewards, group_size)
    dp = world // tp
    assert [a for rank in range(0, world, tp) for a in shared[rank]] == pytest.approx(whole, abs=1e-12)
    assert all(shared[rank] == shared[rank - rank % tp] for rank in range(world))  # TP ranks: the same
    std = statistics.stdev(rewards)  # unbiased, over the whole batch
    expected = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / group_size
        expected += [0.0 if len(set(group)) == 1 else (r - mean) / (std + 1e-6) for r in group]
    # Rewards travel as float32, as the trainer keeps them: the float64 reference agrees to float32's rounding.
    assert whole == pytest.approx(expected, rel=1e-6, abs=1e-7) and dp * len(shared[0]) == len(rewards)


def reference_loss(logp, old, adv, weights, lo, hi, beta, ref, coef, ent, estimator="k3"):
    """Per token, in float64: -min(r A, clip(r, 1-lo, 1+hi) A) + beta KL - coef H, weighted sum."""
    total = 0.0
    for i in range(len(logp)):
        r = math.exp(logp[i] - old[i])
        term = -min(r * adv[i], min(max(r, 1 - lo), 1 + hi) * adv[i])
        term += beta * kl_estimate(logp[i] - ref[i], estimator) - coef * ent[i]
        total += weights[i] * term
    return total


def kl_estimate(log_ratio, estimator):
    """Schulman's estimators of KL(p || p_ref) from one sample of p, with log_ratio = log p - log p_ref."""
    ratio_ref = math.exp(-log_ratio)  # p_ref / p
    return {"k1": log_ratio, "k2": log_ratio**2 / 2, "k3": ratio_ref - 1 - math.log(ratio_ref)}[estimator]


def random_tokens(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ref = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.2
    ent = torch.rand(n, generator=g, dtype=torch.float64).requires_grad_()
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    return logp, old, adv, ref, ent, weights


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_loss_value_and_gradient_match_the_formula(estimator):
    logp, old, adv, ref, ent, weights = random_tokens()
    cfg = train.Config(clip_low=0.2, clip_high=0.28, beta=0.05, kl_estimator=estimator, entropy_coef=0.01)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, ref, ent)
    expected = reference_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        weights.tolist(),
        0.2,
        0.28,
        0.05,
        ref.tolist(),
        0.01,
        ent.tolist(),
        estimator,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # d/dlogp: -r A where the unclipped term is the minimum (0 where clipping holds it), plus beta dKL/dlogp:
    # k1: 1; k2: log ratio; k3: 1 - p_ref / p.
    for i in range(len(logp)):
        r = math.exp(logp[i].item() - old[i].item())
        a = adv[i].item()
        unclipped_active = r * a <= min(max(r, 0.8), 1.28) * a
        d = logp[i].item() - ref[i].item()
        dkl = {"k1": 1.0, "k2": d, "k3": 1 - math.exp(-d)}[estimator]
        want = weights[i].item() * ((-r * a if unclipped_active else 0.0) + 0.05 * dkl)
        assert logp.grad[i].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert ent.grad.tolist() == pytest.approx((-0.01 * weights).tolist())
    ratios = torch.exp(logp - old).detach()
    clipped = ((ratios < 0.8) & (adv < 0)) | ((ratios > 1.28) & (adv > 0))
    assert metrics["clip_frac"].item() == clipped.sum().item() > 0
    assert metrics["kl"].item() == pytest.approx(sum(kl_estimate(d, estimator) for d in (logp - ref).tolist()))
    assert metrics["entropy"].item() == pytest.approx(ent.sum().item())


@pytest.mark.parametrize("objective", ["clip", "cispo"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_one_extreme_log_ratio_is_clamped_and_counted_instead_of_overflowing_the_step(objective, ratio_level):
    """exp(log ratio) overflows above ~88: one such token made the loss inf, and the step was skipped. The log ratio
    is clamped to [-20, 20], as verl does; the other tokens keep their exact terms."""
    logp, old, adv, _, _, weights = random_tokens(seed=4)
    cfg = train.Config(objective=objective, ratio_level=ratio_level)
    lengths = torch.tensor([len(logp) - 4, 4])
    _, want = train.policy_loss(logp, old, adv, weights, cfg, lengths=lengths)
    with torch.no_grad():
        old[0] = logp[0] - 100.0  # p / p_old = e^100
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, lengths=lengths)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert metrics["ratio_clamped"].item() == 1 and want["ratio_clamped"].item() == 0
    if ratio_level == "token":  # the others' gradients are untouched
        logp_again = logp.detach().clone().requires_grad_()
        kept = torch.ones(len(logp), dtype=torch.bool)
        kept[0] = False
        train.policy_loss(logp_again[kept], old[kept], adv[kept], weights[kept], cfg)[0].backward()
        assert torch.allclose(logp.grad[kept], logp_again.grad[kept], rtol=1e-12)


def empty_responses_step(rank, world, folder, empty):
    """A step on samples of which `empty` have no sampled token (a custom engine may return an empty response)."""
    torch.manual_seed(0)
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = make_samples(4, seed=6)
    for _ in range(empty):
        samples.insert(0, train.Sample(prompt_ids=[5, 6, 7], advantage=1.0))
    train.train_on_rollouts(model, optimizer, samples, train.Config(micro_batch_size=2), par)
    return {
        k: v.numpy().copy()
        for k, v in get_model_state_dict(  # numpy: tensors would travel as file descriptors
            model, options=StateDictOptions(full_state_dict=True)
        ).items()
    }


def test_a_micro_batch_of_empty_responses_trains_and_changes_nothing(tmp_path):
    folder = save_reference(tmp_path, "qwen2", False)
    alone, with_empty = (run_ranks(empty_responses_step, 1, folder, empty)[0] for empty in (0, 2))
    assert all(abs(alone[k] - with_empty[k]).max() < 1e-7 for k in alone)  # token mean: they add no token


def test_policy_loss_without_entropies_has_no_bonus_and_logs_zero_entropy():
    logp, old, adv, ref, _, weights = random_tokens(seed=2)
    cfg = train.Config(beta=0.05, entropy_coef=0.01)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, ref, entropy=None)
    expected = reference_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        weights.tolist(),
        0.2,
        0.28,
        0.05,
        ref.tolist(),
        0.0,
        [0.0] * len(logp),
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12) and metrics["entropy"].item() == 0


def test_kl_in_the_reward_leaves_it_out_of_the_loss_but_still_measures_it():
    logp, old, adv, ref, ent, weights = random_tokens(seed=1)
    cfg = train.Config(beta=0.05, kl_in_reward=True)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, ref, ent)
    without = train.Config(beta=0.0)
    assert loss.item() == pytest.approx(train.policy_loss(logp, old, adv, weights, without, None, ent)[0].item())
    assert metrics["kl"].item() == pytest.approx(sum(kl_estimate(d, "k3") for d in (logp - ref).tolist()))
    assert metrics["kl"].item() > 0


def test_advantages_come_from_the_shaped_reward_less_beta_times_the_groups_centred_kl():
    """set_advantages: group advantages of each sample's reward (its score plus shaping, not the score); with
    --kl_in_reward, beta x (its summed KL - the group's mean KL) is taken off, not divided by the std."""
    rewards, scores = [1.0, 0.5, 0.0, 0.25], [1.0, 1.0, 0.0, 0.0]  # groups of 2, shaped apart from their scores
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.tensor([-3.0, -1.0, -1.0]), torch.tensor([-2.0])]
    ref = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5]), torch.tensor([-2.0, -2.0, -1.0]), torch.tensor([-1.0])]
    samples = [
        train.Sample([1], reward=score, shaped_reward=r, old_logprobs=o, ref_logprobs=f)
        for score, r, o, f in zip(scores, rewards, old, ref)
    ]
    train.set_advantages(samples, train.Config(group_size=2, beta=0.5, kl_in_reward=True, kl_estimator="k1"))
    kl = [-0.5, 0.0, 0.0, -1.0]  # k1 summed over each response: sum(old - ref)
    expected = []
    for g in (0, 2):
        r, k = rewards[g : g + 2], kl[g : g + 2]
        expected += [(r[j] - sum(r) / 2) / (statistics.stdev(r) + 1e-6) - 0.5 * (k[j] - sum(k) / 2) for j in (0, 1)]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)


def test_k1_k2_k3_estimate_the_kl_between_two_distributions():
    """Averaged over samples of p, k1 and k3 are unbiased for KL(p || q) and k2 is close to it."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(20, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(20, generator=g, dtype=torch.float64) * 0.3 + p.log(), 0)
    exact = (p * (p / q).log()).sum().item()
    draws = torch.multinomial(p, 400_000, replacement=True, generator=g)
    log_ratio = (p.log() - q.log())[draws]
    for name, estimate in train.KL_ESTIMATORS.items():
        values = estimate(log_ratio)
        standard_error = values.std().item() / math.sqrt(len(values))
        # k2 is biased: its mean is E_p[(log p/q)^2] / 2, the KL to second order.
        target = (p * (p / q).log() ** 2).sum().item() / 2 if name == "k2" else exact
        assert abs(values.mean().item() - target) < 4 * standard_error, name
        assert estimate(log_ratio[:5]).tolist() == pytest.approx([kl_estimate(x, name) for x in log_ratio[:5].tolist()])
    assert exact < (p * (p / q).log() ** 2).sum().item() / 2 < 1.3 * exact


def aggregated_loss(rank, world, loss_agg, lengths, max_new_tokens, ratio_level="token"):
    """The trainer's loss for one batch of sequences (all on one rank): weights, then the weighted token sum."""
    par = launch.parallel_groups("cpu", 1)
    g = torch.Generator().manual_seed(3)
    samples = [train.Sample([], [0] * n, [True] * n) for n in lengths]
    cfg = train.Config(
        loss_agg=loss_agg, max_new_tokens=max_new_tokens, clip_low=0.2, clip_high=0.28, ratio_level=ratio_level
    )
    train.set_loss_weights(samples, cfg, par.dp_group)
    n = sum(lengths)
    old = -torch.rand(n, generator=g, dtype=torch.float64)
    logp = (old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.repeat_interleave(torch.randn(len(lengths), generator=g, dtype=torch.float64), torch.tensor(lengths))
    weights = torch.tensor([s.loss_weight for s in samples for _ in s.response_ids], dtype=torch.float64)
    loss, _ = train.policy_loss(
        logp, old, adv, weights, cfg, None, torch.zeros(n, dtype=torch.float64), lengths=torch.tensor(lengths)
    )
    loss.backward()
    return loss.item(), logp.grad.tolist(), old.tolist(), logp.tolist(), adv.tolist()


@pytest.mark.parametrize("loss_agg", ["sequence", "token", "constant"])
def test_loss_aggregation_follows_grpo_dapo_and_dr_grpo(loss_agg):
    """GRPO (Shao et al. 2024, eq. 3): 1/G sum_i 1/|o_i| sum_t l_it. DAPO (Yu et al. 2025, eq. 8): 1/sum_i |o_i|
    sum_i sum_t l_it. Dr. GRPO (Liu et al. 2025): 1/G sum_i sum_t l_it, divided by the generation budget (their
    code's constant normaliser): 1/(G L_max) sum_i sum_t l_it."""
    lengths, max_new_tokens = [3, 7, 1, 12, 5], 16
    loss, grad, old, logp, adv = run_ranks(aggregated_loss, 1, loss_agg, lengths, max_new_tokens)[0]
    surrogate = [-min(math.exp(x - o) * a, min(max(math.exp(x - o), 0.8), 1.28) * a) for x, o, a in zip(logp, old, adv)]
    per_seq, start = [], 0
    for n in lengths:
        per_seq.append(surrogate[start : start + n])
        start += n
    G = len(lengths)
    expected = {
        "sequence": sum(sum(s) / len(s) for s in per_seq) / G,
        "token": sum(map(sum, per_seq)) / sum(lengths),
        "constant": sum(map(sum, per_seq)) / (G * max_new_tokens),
    }[loss_agg]
    assert loss == pytest.approx(expected, rel=1e-6)  # the trainer's weights are float32
    # The gradient of each token's surrogate is scaled by its weight alone: compare with the per-token derivative.
    scale = {
        "sequence": [1 / (G * n) for n in lengths for _ in range(n)],
        "token": [1 / sum(lengths)] * sum(lengths),
        "constant": [1 / (G * max_new_tokens)] * sum(lengths),
    }[loss_agg]
    for i, (x, o, a) in enumerate(zip(logp, old, adv)):
        r = math.exp(x - o)
        active = r * a <= min(max(r, 0.8), 1.28) * a
        assert grad[i] == pytest.approx(scale[i] * (-r * a if active else 0.0), rel=1e-6, abs=1e-15)


def naive_logprobs(model, samples, temperature):
    """Full-vocabulary softmax over whole sequences in float64, one sample at a time; of the sampled tokens."""
    logps, ents = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(ids).logits[0].double() / temperature
        p = len(s.prompt_ids)
        log_probs = torch.log_softmax(logits[p - 1 : -1], -1)
        sampled = torch.tensor(s.sampled)  # tool output is context, not a prediction
        logps.append(log_probs.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)[sampled])
        ents.append(-(log_probs.exp() * log_probs).sum(-1)[sampled])
    return torch.cat(logps), torch.cat(ents)


def chunked_against_naive(rank, world, chunk, temperature):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", False))
    samples = make_samples(6, seed=3)
    cfg = train.Config(logprob_chunk=chunk, temperature=temperature)
    tp_mesh = launch.parallel_groups("cpu", 1).mesh["tp"]
    with torch.no_grad():
        logp, ent, _, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
        want_logp, want_ent = naive_logprobs(model, samples, temperature)
    return (
        logp.shape == want_logp.shape,
        (logp.double() - want_logp).abs().max().item(),
        (ent.double() - want_ent).abs().max().item(),
    )


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(chunk, temperature):
    same_shape, logp_error, entropy_error = run_ranks(chunked_against_naive, 1, chunk, temperature)[0]
    assert same_shape and logp_error < 1e-5 and entropy_error < 1e-5


def peak_logits(rank, world, chunk, n, tp):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", False))
    samples = make_samples(n, seed=3)
    tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
    tracker, cfg = LiveLogits(VOCAB // tp, model.config.hidden_size), train.Config(logprob_chunk=chunk)
    with tracker:
        logp, entropy, _, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
        ones = torch.ones_like(logp)
        loss, _ = train.policy_loss(logp, logp.detach(), ones, ones, cfg, None, entropy)
        loss.backward()
    return tracker.peak, sum(len(s.response_ids) for s in samples)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_stay_within_a_few_chunks_of_this_ranks_vocabulary_slice(tp):
    chunk_bytes = 2 * (VOCAB // tp) * 4  # fp32 logits of a chunk of 2 tokens over this rank's vocabulary slice
    peak, tokens = run_ranks(peak_logits, tp, 2, 16, tp)[0]
    assert run_ranks(peak_logits, tp, 2, 48, tp)[0][0] == peak  # the same for three times the tokens
    unchunked, _ = run_ranks(peak_logits, tp, 10_000, 16, tp)[0]
    assert unchunked >= tokens / 2 * chunk_bytes > 3 * 8 * chunk_bytes  # whole-batch logits show when they exist
    assert 0 < peak <= 8 * chunk_bytes  # a handful of chunk-sized temporaries, whatever the number of tokens


def vocab_sharded(rank, world, vocab, tp):
    config = tiny_config("qwen3", True)
    config.vocab_size = vocab
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # the same unsharded model on every rank
    samples = make_samples(5, seed=8)
    tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
    cfg = train.Config(logprob_chunk=7, temperature=0.8)
    logp, ent, _, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
    g = torch.Generator().manual_seed(1)
    (logp @ torch.randn(len(logp), generator=g) + ent @ torch.randn(len(ent), generator=g)).backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach().numpy(), ent.detach().numpy(), grads


@pytest.mark.parametrize("vocab", [VOCAB, VOCAB + 1])  # an odd vocabulary: uneven slices over tp = 2
def test_vocabulary_sharded_logprobs_entropy_and_gradients_equal_the_gathered_ones(vocab):
    gathered_logp, gathered_ent, gathered_grads = run_ranks(vocab_sharded, 1, vocab, 1)[0]
    for logp, ent, grads in run_ranks(vocab_sharded, 2, vocab, 2):
        assert abs(logp - gathered_logp).max() < 1e-5 and abs(ent - gathered_ent).max() < 1e-5
        assert sorted(grads) == sorted(gathered_grads)  # lm_head (tied: the embedding) and every layer
        for name, grad in gathered_grads.items():
            assert abs(grads[name] - grad).max() < 1e-5 * max(1.0, abs(grad).max()), name


def with_kept_sets(samples, vocab, seed):
    """Each sampled token's kept set: its own id and up to 40 others drawn at random (from every tp rank's slice);
    a response's first token alone (at tp 2 in one slice, some in the second: the other rank holds none of it)."""
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        sets = []
        for token, was_sampled in zip(s.response_ids, s.sampled):
            if not was_sampled:
                continue
            kept = [token]
            if sets:  # a response's first token is kept alone
                others = torch.randperm(vocab, generator=g)[: torch.randint(0, 41, (), generator=g)].tolist()
                kept += [i for i in others if i != token]
            sets.append(kept)
        s.kept_ids = torch.tensor([i for kept in sets for i in kept], dtype=torch.int32)
        s.kept_sizes = torch.tensor([len(kept) for kept in sets], dtype=torch.int32)
    return samples


def renormalised_logprobs(rank, world, vocab, tp, dtype):
    """Log-probs renormalised over the kept sets, log kept masses and the gradients of a random mix of both: the
    trainer's (float32, vocabulary sharded over tp) or, for dtype float64, from the definition, token by token."""
    config = tiny_config("qwen3", True)
    config.vocab_size = vocab
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    samples = with_kept_sets(make_samples(5, seed=8), vocab, seed=2)
    temperature = 0.8
    if dtype == torch.float32:
        cfg = train.Config(logprob_chunk=7, temperature=temperature, top_p=0.9)
        tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
        logp, _, log_kept, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
    else:  # log p(y) - log (sum of p(v) over the kept set v), of softmax(logits / T) over the whole vocabulary
        logp, log_kept = [], []
        for s in samples:
            p = len(s.prompt_ids)
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, p - 1 : -1] / temperature
            probs = torch.softmax(logits[torch.tensor(s.sampled)], -1)
            sets = s.kept_ids.long().split(s.kept_sizes.tolist())
            targets = [t for t, was_sampled in zip(s.response_ids, s.sampled) if was_sampled]
            for row, target, kept in zip(probs, targets, sets):
                logp.append(torch.log(row[target] / row[kept].sum()))
                log_kept.append(torch.log(row[kept].sum()))
        logp, log_kept = torch.stack(logp), torch.stack(log_kept)
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(len(logp), generator=g, dtype=torch.float64).to(dtype)
    (logp @ mix + log_kept @ mix.flip(0)).backward()
    grads = {name: p.grad.double().numpy() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach().double().numpy(), log_kept.detach().double().numpy(), grads


@pytest.mark.parametrize("vocab", [VOCAB, VOCAB + 1])  # an odd vocabulary: uneven slices over tp = 2
@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_renormalised_over_the_kept_sets_and_their_gradients_equal_the_definition(tp, vocab):
    """Truncated sampling: p(y) / (the kept set's mass), as the engine sampled it, and log of that mass; a set spans
    both ranks' slices of the vocabulary at tp 2. Against float64 from the definition."""
    samples = with_kept_sets(make_samples(5, seed=8), vocab, seed=2)
    alone = [s.response_ids[0] for s in samples]  # the first token, sampled in every sample, kept alone
    assert min(alone) < math.ceil(vocab / 2) <= max(alone)  # in the first slice, and in the second
    want_logp, want_kept, want_grads = run_ranks(renormalised_logprobs, 1, vocab, 1, torch.float64)[0]
    assert (want_kept < -0.5).mean() > 0.7  # most sets hold little of the mass: renormalising matters
    for logp, log_kept, grads in run_ranks(renormalised_logprobs, tp, vocab, tp, torch.float32):
        assert abs(logp - want_logp).max() < 1e-5 and abs(log_kept - want_kept).max() < 1e-5
        assert sorted(grads) == sorted(want_grads)
        for name, grad in want_grads.items():
            assert abs(grads[name] - grad).max() < 1e-5 * max(1.0, abs(grad).max()), name


def far_kept_set(rank, world, tp):
    """Logits z = w's diagonal: the likeliest token 200 nats above a kept set {1, 2} that holds the target, 2."""
    z = torch.tensor([200.0, 0.0, 0.5, -1.0, 3.0, -2.0, 1.0, 0.0])
    tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
    w = distribute_tensor(torch.diag(z), tp_mesh, [Shard(0)]).requires_grad_()
    hidden = DTensor.from_local(torch.ones(1, 8), tp_mesh, [Replicate()])
    kept = torch.tensor([[1, 2]])
    logp, _, log_kept = vocab_parallel.logprobs_and_entropy(hidden, w, torch.tensor([2]), 1.0, tp_mesh, kept)
    logp.sum().backward()
    return logp.item(), log_kept.item(), torch.diagonal(w.grad.full_tensor()).tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_kept_set_far_below_the_likeliest_token_keeps_finite_log_probs_and_gradients(tp):
    """A set 200 nats below the vocabulary's largest logit (a drifted policy, the reference model): its exp-sum,
    shifted by the vocabulary's maximum, was 0 in fp32, and log p +inf."""
    logp, log_kept, grad = run_ranks(far_kept_set, tp, tp)[0]
    z = torch.tensor([200.0, 0.0, 0.5, -1.0, 3.0, -2.0, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    want = z[2] - z[1:3].logsumexp(0)
    want.backward()
    assert logp == pytest.approx(want.item(), abs=1e-6)
    assert log_kept == pytest.approx((z[1:3].logsumexp(0) - z.logsumexp(0)).item(), rel=1e-6)
    assert grad == pytest.approx(z.grad.tolist(), abs=1e-6)


def bf16_logit_errors(rank, world, tp):
    """Max error of the sampled tokens' log-probs from bf16 hidden states and lm_head, against float64 from the same
    bf16 values: vocab_parallel.logprobs_and_entropy's, and that of logits rounded to bf16 before the softmax (the old
    way)."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(64, 1024, generator=g) / 4).bfloat16()
    weight = (torch.randn(8192, 1024, generator=g) / 8).bfloat16()
    targets = torch.randint(0, 8192, (64,), generator=g)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    reference = torch.log_softmax(h64 @ w64.T, -1)[torch.arange(64), targets]
    reference.sum().backward()
    rounded = torch.log_softmax((hidden @ weight.T).float(), -1)[torch.arange(64), targets]  # bf16 logits
    tp_mesh = launch.parallel_groups("cpu", tp).mesh["tp"]
    h = hidden.clone().requires_grad_()
    w = distribute_tensor(weight, tp_mesh, [Shard(0)]).requires_grad_()
    logp, _, _ = vocab_parallel.logprobs_and_entropy(
        DTensor.from_local(h, tp_mesh, [Replicate()]), w, targets, 1.0, tp_mesh
    )
    logp.sum().backward()
    grad_errors = [
        ((g.double() - g64).abs().max() / g64.abs().max()).item()  # bf16 gradients: relative ~1e-2
        for g, g64 in ((h.grad, h64.grad), (w.grad.full_tensor(), w64.grad))
    ]
    return (
        (logp.double() - reference).abs().max().item(),
        (rounded.double() - reference).abs().max().item(),
        grad_errors,
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_from_bf16_weights_are_computed_from_fp32_logits(tp):
    """SGLang's fp32 LM head makes fp32 logits of bf16 inputs: the trainer's must be as exact, or the two sides
    differ by bf16's rounding of the logits (~0.01 nats, of the order of GSPO's clip range)."""
    for error, rounded_error, grad_errors in run_ranks(bf16_logit_errors, tp, tp):
        assert rounded_error > 3e-3  # what rounding the logits to bf16 costs at this size
        assert error * 10 < rounded_error and error < 1e-4
        assert max(grad_errors) < 1e-2, grad_errors  # hidden's summed over tp, lm_head's slice by slice


def loss_weights(rank, world, loss_agg):
    par = launch.parallel_groups("cpu", 1)
    samples = make_samples(6, seed=4)[rank * 3 : (rank + 1) * 3]
    train.set_loss_weights(samples, train.Config(loss_agg=loss_agg, max_new_tokens=16), par.dp_group)
    return [s.loss_weight for s in samples for _ in range(sum(s.sampled))]


def test_loss_weights_follow_the_aggregation_over_all_ranks():
    samples = make_samples(6, seed=4)
    lengths = [sum(s.sampled) for s in samples]  # tool output tokens carry no weight
    # FSDP averages over dp = 2, so each weight carries a factor 2.
    token = sum(run_ranks(loss_weights, 2, "token"), [])
    assert token == pytest.approx([2 / sum(lengths)] * sum(lengths))
    sequence = sum(run_ranks(loss_weights, 2, "sequence"), [])
    assert sequence == pytest.approx([2 / (n * len(samples)) for n in lengths for _ in range(n)])
    constant = sum(run_ranks(loss_weights, 2, "constant"), [])
    assert constant == pytest.approx([2 / (16 * len(samples))] * sum(lengths))


def step_with_nan_advantage(rank, world, folder):
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    before = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    before = {k: v.clone() for k, v in before.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    samples = make_samples(4, seed=5)
    samples[0].advantage = float("nan")
    _, maxima = train.train_on_rollouts(model, optimizer, samples, train.Config(), par)
    after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return maxima["skipped_steps"], max((after[k] - before[k]).abs().max().item() for k in before)


def test_non_finite_grad_norm_skips_the_step(tmp_path):
    skipped, change = run_ranks(step_with_nan_advantage, 1, save_reference(tmp_path, "qwen2", True))[0]
    assert skipped == 1 and change == 0


def test_lr_schedule_warms_up_then_holds_or_decays():
    cfg = train.Config(warmup_steps=4, steps=14, lr_schedule="constant")
    assert [train.lr_factor(s, cfg) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    cosine = train.Config(warmup_steps=4, steps=15, lr_schedule="cosine")  # steps 0..14: 10% at the last, 14
    assert [train.lr_factor(s, cosine) for s in (4, 9, 14)] == pytest.approx([1.0, 0.55, 0.1])


def engine_and_trainer_logprobs(n=50, seed=6):
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    trainer = engine + torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    return trainer, engine


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_engine_mismatch_sums_and_truncated_importance_weights_match_the_formulas(cap):
    trainer, engine = engine_and_trainer_logprobs()
    weights, sums = train.engine_mismatch(trainer, engine, train.Config(tis_cap=cap), torch.tensor([50]))
    ratios = [math.exp(t) / math.exp(e) for t, e in zip(trainer.tolist(), engine.tolist())]  # p_trainer / p_engine
    assert sums["mismatch_abs"].item() == pytest.approx(sum(abs(math.log(r)) for r in ratios), rel=1e-12)
    assert sums["mismatch_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios), rel=1e-10)  # k3
    if cap == 0:
        assert weights is None
    else:
        assert weights.tolist() == pytest.approx([min(r, cap) for r in ratios], rel=1e-12)
        assert 0 < sum(r > cap for r in ratios) < len(ratios)  # the cap binds on some tokens, not all


def test_identical_logprobs_give_no_mismatch_and_unit_weights():
    trainer, _ = engine_and_trainer_logprobs()
    weights, sums = train.engine_mismatch(trainer, trainer.clone(), train.Config(tis_cap=2.0), torch.tensor([50]))
    assert {k: float(v) for k, v in sums.items()} == dict.fromkeys(sums, 0.0)
    assert weights.tolist() == [1.0] * len(trainer)


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
    cfg = train.Config(clip_low=lo, clip_high=hi, beta=beta, entropy_coef=coef)
    loss, _ = train.policy_loss(logp, old, adv, weights, cfg, ref, ent, is_weights=is_w)
    expected = 0.0
    for i in range(n):
        r = math.exp(logp[i].item() - old[i].item())
        a = adv[i].item()
        pg = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
        kl = kl_estimate(logp[i].item() - ref[i].item(), "k3")
        expected += weights[i].item() * (is_w[i].item() * pg + beta * kl - coef * ent[i].item())
    assert loss.item() == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- GSPO, CISPO, masked importance sampling
def ragged_tokens(lengths=(3, 7, 1, 5), seed=11):
    """Per-token float64 tensors over responses of ragged lengths; one advantage per response, repeated per token."""
    logp, old, adv, ref, ent, weights = random_tokens(sum(lengths), seed)
    g = torch.Generator().manual_seed(seed)
    per_response = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    return logp, old, per_response.repeat_interleave(torch.tensor(lengths)), weights, list(lengths)


def spans(lengths):
    start = 0
    for n in lengths:
        yield range(start, start + n)
        start += n


def test_gspo_ratio_is_the_geometric_mean_of_token_ratios_clipped_per_response_with_the_papers_gradient():
    """GSPO (Zheng et al. 2025), GSPO-token form: s_i,t = sg(s_i) p_t / sg(p_t) with s_i = (prod_t r_t)^(1/|y_i|),
    so every token's loss is -min(s_i A_i, clip(s_i) A_i) and its gradient -A_i s_i where the clip does not bind."""
    logp, old, adv, weights, lengths = ragged_tokens()
    lo, hi = 0.03, 0.04  # small clip ranges, as the paper's, so that some responses are clipped and some not
    cfg = train.Config(ratio_level="sequence", clip_low=lo, clip_high=hi)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, lengths=torch.tensor(lengths))
    loss.backward()
    expected, clipped_tokens = 0.0, 0
    for span in spans(lengths):
        token_ratios = [math.exp(logp[t].item() - old[t].item()) for t in span]
        s = math.prod(token_ratios) ** (1 / len(span))  # the geometric mean
        a = adv[span[0]].item()
        unclipped_active = s * a <= min(max(s, 1 - lo), 1 + hi) * a
        clipped_tokens += 0 if unclipped_active else len(span)
        for t in span:
            expected += weights[t].item() * -min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
            want = weights[t].item() * (-a * s if unclipped_active else 0.0)
            assert logp.grad[t].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_frac"].item() == clipped_tokens and 0 < clipped_tokens < sum(lengths)


def test_gspo_loss_aggregation_is_the_mean_over_each_response_then_over_responses():
    """GSPO's objective is 1/G sum_i 1/|y_i| sum_t: --loss_agg sequence, as the README's recipe sets."""
    lengths = [3, 7, 1, 12, 5]
    loss, grad, old, logp, adv = run_ranks(aggregated_loss, 1, "sequence", lengths, 16, "sequence")[0]
    expected = 0.0
    for span in spans(lengths):
        s = math.exp(sum(logp[t] - old[t] for t in span) / len(span))
        a = adv[span[0]]
        response_mean = sum(-min(s * a, min(max(s, 0.8), 1.28) * a) for _ in span) / len(span)  # 1/|y_i| sum_t
        expected += response_mean / len(lengths)
    assert loss == pytest.approx(expected, rel=1e-6)


def test_cispo_weights_every_tokens_log_prob_by_its_clipped_detached_ratio():
    """CISPO (MiniMax-M1, 2025): per token -sg(min(r, 1 + eps_high)) A log p; no token loses its gradient."""
    logp, old, adv, weights, lengths = ragged_tokens(seed=12)
    cfg = train.Config(objective="cispo", clip_high=0.1)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, lengths=torch.tensor(lengths))
    loss.backward()
    expected = 0.0
    for t in range(len(logp)):
        r = math.exp(logp[t].item() - old[t].item())
        w = min(r, 1.1)
        expected += weights[t].item() * -w * adv[t].item() * logp[t].item()
        assert logp.grad[t].item() == pytest.approx(weights[t].item() * -w * adv[t].item(), rel=1e-9)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_frac"].item() == sum(math.exp(x - o) > 1.1 for x, o in zip(logp.tolist(), old.tolist())) > 0


@pytest.mark.parametrize("objective, delta", [("dppo_tv", 0.15), ("dppo_kl", 0.05)])
def test_dppo_masks_the_tokens_that_moved_past_its_bound_the_way_their_advantage_pushes(objective, delta):
    """DPPO (Qi et al. 2026, eq. 12-14): M_t = 0 where (A > 0, r > 1, D > delta) or (A < 0, r < 1, D > delta), with D
    the total variation |p - p_old| or KL(old || new) between the two-way distributions (the sampled token, the
    rest); the loss -M A sg(r) log p, so a masked token gets no gradient and a kept one -A r. The paper's defaults
    as the flags' (0.15 and 0.05). Reference: float64 arithmetic in Python, from the paper's formulas."""
    logp, old, adv, weights, lengths = ragged_tokens(lengths=(9, 14, 5, 12), seed=21)
    logp = logp.detach().clamp(max=-0.01).requires_grad_()  # probabilities, below 1
    cfg = train.Config(objective=objective)
    assert (cfg.dppo_tv_delta, cfg.dppo_kl_delta)[objective == "dppo_kl"] == delta
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, lengths=torch.tensor(lengths))
    loss.backward()
    expected, masked = 0.0, 0
    for t in range(len(logp)):
        p, p_old, a, w = math.exp(logp[t].item()), math.exp(old[t].item()), adv[t].item(), weights[t].item()
        if objective == "dppo_tv":
            divergence = abs(p - p_old)
        else:
            divergence = p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))
        r = p / p_old
        keep = not ((a > 0 and r > 1 and divergence > delta) or (a < 0 and r < 1 and divergence > delta))
        masked += not keep
        expected += w * -keep * a * r * logp[t].item()
        assert logp.grad[t].item() == pytest.approx(w * -keep * a * r, rel=1e-9, abs=1e-15)
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert metrics["clip_frac"].item() == masked and 0 < masked < len(logp) // 2


@pytest.mark.parametrize("negative", [False, True])
def test_sapo_replaces_the_clip_by_a_soft_gate_whose_slope_fades_as_the_ratio_leaves_one(negative):
    """SAPO (Gao et al. 2025, arXiv 2511.20347; TRL's loss_type="sapo"): per token -f(r) A with the gate
    f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos where A > 0 and tau_neg elsewhere. Its gradient in log p is
    -A r 4 s (1 - s), s = sigmoid(tau (r - 1)): -A at r = 1, fading on either side; the flags' defaults are the
    paper's and TRL's (1.0, 1.05). clip_frac counts the tokens whose slope 4 s (1 - s) fell below 1/2. Reference:
    float64 arithmetic in Python."""
    logp, old, adv, weights, lengths = ragged_tokens(lengths=(6, 11, 4, 9), seed=31)
    logp = (old + (logp.detach() - old) * 8).requires_grad_()  # ratios far enough from 1 for the gate to fade
    if negative:
        adv = -adv
    cfg = train.Config(objective="sapo")
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)
    loss, metrics = train.policy_loss(logp, old, adv, weights, cfg, lengths=torch.tensor(lengths))
    loss.backward()
    expected, faded = 0.0, 0
    for t in range(len(logp)):
        r, a, w = math.exp(logp[t].item() - old[t].item()), adv[t].item(), weights[t].item()
        tau = 1.0 if a > 0 else 1.05
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        expected += w * -s * 4 / tau * a
        assert logp.grad[t].item() == pytest.approx(w * -a * r * 4 * s * (1 - s), rel=1e-9, abs=1e-15)
        faded += 4 * s * (1 - s) < 0.5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_frac"].item() == faded and 0 < faded < len(logp)
    at_one = train.policy_loss(old.clone().requires_grad_(), old, adv, weights, cfg)[0]
    assert at_one.item() == pytest.approx(sum(-2 / (1.0 if a > 0 else 1.05) * a * w for a, w in zip(adv, weights)))


def test_rloo_advantage_is_the_reward_less_the_mean_of_the_groups_other_rewards():
    """RLOO (Ahmadian et al. 2024; verl's adv_estimator=rloo, TRL's RLOOTrainer): A_i = r_i - 1/(G - 1) sum_{j != i}
    r_j, with no std; a group of equal rewards 0 exactly. Reference: float64 arithmetic in Python."""
    rewards = [1.0, 0.0, 0.5, 0.25, 0.1, 0.1, 0.1, 0.1, 2.0, -1.0, 0.0, 3.0]
    samples = [train.Sample([1], shaped_reward=r) for r in rewards]
    train.set_advantages(samples, train.Config(group_size=4, advantage="rloo", scale_std=False))
    adv = [s.advantage for s in samples]
    for g in range(3):
        group = rewards[4 * g : 4 * g + 4]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            assert adv[4 * g + i] == pytest.approx(r - sum(others) / 3, rel=1e-12, abs=1e-15)
    assert adv[4:8] == [0.0] * 4  # 0.1 four times: float32's remainder would have pushed on nothing


def test_rloo_with_the_kl_in_the_reward_takes_the_same_leave_one_out_baseline_off_beta_times_the_kl():
    """--advantage rloo --kl_in_reward: the advantage of the reward less beta x the summed KL, both through RLOO's
    baseline (the reward penalised first, as TRL's RLOO): A_i = (r_i - beta k_i) - mean_{j != i} (r_j - beta k_j)."""
    g = torch.Generator().manual_seed(4)
    rewards = [0.0, 1.0, 1.0, 0.5, 0.2, 0.2, 0.2, 0.2]
    old = [torch.randn(n, generator=g, dtype=torch.float64) - 2 for n in (3, 5, 2, 4, 6, 1, 3, 2)]
    ref = [o + torch.randn(len(o), generator=g, dtype=torch.float64) * 0.3 for o in old]
    samples = [train.Sample([1], shaped_reward=r, old_logprobs=o, ref_logprobs=f) for r, o, f in zip(rewards, old, ref)]
    cfg = train.Config(group_size=4, beta=0.5, kl_in_reward=True, kl_estimator="k1", advantage="rloo", scale_std=False)
    train.set_advantages(samples, cfg)
    penalised = [r - 0.5 * (o - f).sum().item() for r, o, f in zip(rewards, old, ref)]
    for i, s in enumerate(samples):
        group = penalised[i // 4 * 4 : i // 4 * 4 + 4]
        others = [x for j, x in enumerate(group) if j != i % 4]
        assert s.advantage == pytest.approx(penalised[i] - sum(others) / 3, rel=1e-9)


@pytest.mark.parametrize("level, cap", [("token", 1.5), ("sequence", 1.1)])  # a response's mean strays less
def test_masked_importance_sampling_weights_kept_tokens_by_r_and_drops_the_rest(level, cap):
    """IcePop (and TRL's token_mask, verl's rollout_is with both bounds): r = p_trainer / p_engine per token, or its
    response's geometric mean (sequence); tokens (or whole responses) with r outside [1 / cap, cap] get weight 0 and
    so no policy gradient, kept ones weight r. Reference: float64 arithmetic in Python."""
    lengths = [4, 6, 2, 5, 3]
    trainer, engine = engine_and_trainer_logprobs(sum(lengths), seed=9)
    cfg = train.Config(tis_cap=cap, is_mode="mask", is_level=level)
    weights, sums = train.engine_mismatch(trainer, engine, cfg, torch.tensor(lengths))
    ratios = [math.exp(t - e) for t, e in zip(trainer.tolist(), engine.tolist())]
    if level == "sequence":
        for span in spans(lengths):
            mean = math.prod(ratios[t] for t in span) ** (1 / len(span))
            for t in span:
                ratios[t] = mean
    keep = [1.0 / cap <= r <= cap for r in ratios]
    assert weights.tolist() == pytest.approx([r if k else 0.0 for r, k in zip(ratios, keep)], rel=1e-12, abs=0)
    assert 0 < sum(keep) < len(keep)  # some kept, some masked
    assert sums["is_masked_tokens"].item() == len(keep) - sum(keep)
    assert sorted(sums) == ["is_masked_tokens", "mismatch_abs", "mismatch_kl"]
    # Masked tokens get no gradient from the policy-gradient term; kept ones do (at ratio 1 no clip binds).
    logp, _, adv, loss_weights, _ = ragged_tokens(lengths, seed=10)
    loss, _ = train.policy_loss(logp, logp.detach(), adv, loss_weights, train.Config(), is_weights=weights)
    loss.backward()
    assert all((g == 0) != k for g, k in zip(logp.grad.tolist(), keep))
    want = [-w * (r if k else 0.0) * a for w, r, k, a in zip(loss_weights.tolist(), ratios, keep, adv.tolist())]
    assert logp.grad.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)  # the gradient scales by r, as IcePop's


def test_sequence_level_truncation_caps_each_responses_geometric_mean_ratio():
    lengths = [4, 6, 2, 5, 3]
    trainer, engine = engine_and_trainer_logprobs(sum(lengths), seed=9)
    cfg = train.Config(tis_cap=1.2, is_level="sequence")
    weights, sums = train.engine_mismatch(trainer, engine, cfg, torch.tensor(lengths))
    ratios = [math.exp(t - e) for t, e in zip(trainer.tolist(), engine.tolist())]
    want = [min(math.prod(ratios[t] for t in span) ** (1 / len(span)), 1.2) for span in spans(lengths) for _ in span]
    assert weights.tolist() == pytest.approx(want, rel=1e-12)
    assert sorted(sums) == ["mismatch_abs", "mismatch_kl"]  # truncation masks nothing: no mask count is logged


def step_with_micro_batches(rank, world, folder, flags, micro_batch_size):
    """Two mini-batches (so the second's ratio moves off 1) of one SGD step each, with engine log-probs near the
    policy's; the weights before and after, for micro-batches of micro_batch_size sequences."""
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)

    def weights():
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.numpy().copy() for k, v in full.items()}

    before = weights()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    samples = make_samples(8, seed=13)
    cfg = train.Config(micro_batch_size=micro_batch_size, num_minibatches=2, max_grad_norm=1e9, **flags)
    for sample, logprobs in zip(samples, train.policy_logprobs(model, samples, cfg, par)):
        sample.old_logprobs = logprobs
    g = torch.Generator().manual_seed(14)
    for s in samples:
        s.engine_logprobs = s.old_logprobs + 0.3 * torch.randn(sum(s.sampled), generator=g)
    token_sums, _ = train.train_on_rollouts(model, optimizer, samples, cfg, par)
    return before, weights(), {k: float(v) for k, v in token_sums.items()}


@pytest.mark.parametrize(
    "flags",
    [
        dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, loss_agg="sequence"),
        dict(objective="cispo", clip_high=0.05),
        dict(tis_cap=1.1, is_mode="mask", is_level="sequence"),
        dict(tis_cap=1.5, is_mode="mask", objective="cispo", ratio_level="sequence"),
    ],
)
def test_micro_batches_sum_to_the_whole_batch_step_for_gspo_cispo_and_masking(flags, tmp_path):
    folder = save_reference(tmp_path, "qwen2", True)
    before, whole, whole_sums = run_ranks(step_with_micro_batches, 1, folder, flags, 8)[0]
    _, split, split_sums = run_ranks(step_with_micro_batches, 1, folder, flags, 3)[0]
    assert max(abs(whole[k] - split[k]).max() for k in whole) < 1e-6
    assert max(abs(whole[k] - before[k]).max() for k in whole) > 1e-3  # the step moved the weights
    assert sorted(whole_sums) == sorted(split_sums) and ("is_masked_tokens" in whole_sums) == ("is_mode" in flags)
    for key in ("clip_frac", "is_masked_tokens"):
        assert whole_sums.get(key) == split_sums.get(key)  # counts: equal, not merely close
    if "is_mode" in flags:  # some tokens masked, not all
        assert 0 < whole_sums["is_masked_tokens"] < sum(sum(s.sampled) for s in make_samples(8, seed=13))
