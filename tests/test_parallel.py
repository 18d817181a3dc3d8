"""Sharded (FSDP2 over dp, DTensor TP over tp) against an unsharded model: loading, logits, gradient norm, weights
after a step (so the gradients), and the gathered full state dict, on meshes (2,1), (1,2), (2,2); micro-batches,
fixed or by token budget, against the whole batch."""

import statistics

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import architectures
import checkpoint
import launch
import logs
import train
from hub_models import text_model
from workers import run_ranks

VOCAB = 96


def tiny_config(family, tied):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)  # Qwen3Config defaults head_dim to 128
    if family == "llama":  # SmolLM2 and Llama 3.x: no attention biases, like Qwen3 but without q/k norms
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def save_reference(folder, family, tied, shard_size="20KB"):
    """A seeded random model saved as HF does it, in several safetensors files; returns the folder."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(family, tied)).save_pretrained(folder, max_shard_size=shard_size)
    return str(folder)


def sharded_model(folder, par, activation_checkpointing=False):
    """The trainer's way: built on the meta device, sharded, then the checkpoint streamed in file by file. par:
    launch.parallel_groups'."""
    config = architectures.text_config(AutoConfig.from_pretrained(folder))
    model = train.build_model(config, par.mesh, torch.device("cpu"), activation_checkpointing)
    cfg = train.Config(model=folder)
    checkpoint.load_weights([model], checkpoint.weight_files(cfg.model), cfg, config, par.world_group)
    return model


def make_samples(n, seed):
    """Every other sample has tool output inside its response: tokens in the forward pass that take no loss."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt_len, response_len = torch.randint(2, 7, (2,), generator=g).tolist()
        ids = torch.randint(1, VOCAB, (prompt_len + response_len + 3 * (i % 2),), generator=g).tolist()
        sampled = [True] * response_len
        if i % 2:  # after the first sampled token
            sampled[1:1] = [False] * 3
        samples.append(
            train.Sample(
                prompt_ids=ids[:prompt_len],
                response_ids=ids[prompt_len:],
                sampled=sampled,
                engine_logprobs=torch.zeros(response_len),
                advantage=torch.randn((), generator=g).item(),
            )
        )
    return samples


def reference_step(model, minibatches, lr, max_norm, optimizer_name, clip_low=0.2, clip_high=0.28):
    """Token-mean clipped surrogate on an unsharded model, straight from the formula: one optimizer step per
    mini-batch, the ratio taken against the policy before the first step. Returns the mean grad norm."""
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr)

    def logprobs(s):  # of the sampled response tokens; tool output is context only
        logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        p = len(s.prompt_ids)
        every = torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        return every[torch.tensor(s.sampled)]

    with torch.no_grad():
        old = [[logprobs(s) for s in minibatch] for minibatch in minibatches]
    norms = []
    for minibatch, old_logps in zip(minibatches, old):
        total_tokens = sum(sum(s.sampled) for s in minibatch)
        loss = 0.0
        for s, old_logp in zip(minibatch, old_logps):
            ratio = torch.exp(logprobs(s) - old_logp)
            adv = s.advantage
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
            loss = loss - surrogate.sum() / total_tokens
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return sum(norms) / len(norms)


def make_optimizer(name, params, lr):
    return torch.optim.SGD(params, lr=lr) if name == "sgd" else torch.optim.AdamW(params, lr=lr)


def sharded_vs_unsharded(
    rank, world, folder, dp, tp, optimizer_name, max_norm, activation_checkpointing, num_minibatches=1
):
    reference = text_model(folder)
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par, activation_checkpointing)
    lr = 0.1 if optimizer_name == "sgd" else 1e-3
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr)  # before the first forward

    samples = make_samples(8, seed=1)
    ids = torch.tensor([s.prompt_ids[:2] + s.response_ids[:1] for s in samples])
    with torch.no_grad():
        logits_diff = (model(ids).logits - reference(ids).logits).abs().max().item()

    cfg = train.Config(micro_batch_size=3, max_grad_norm=max_norm, num_minibatches=num_minibatches)
    share = len(samples) // dp
    per_rank = [samples[r * share : (r + 1) * share] for r in range(dp)]
    model.train()
    mine = per_rank[par.mesh["dp"].get_local_rank()]
    stored = mine[len(mine) // num_minibatches :]
    for sample, logprobs in zip(stored, train.policy_logprobs(model, stored, cfg, par)):
        sample.old_logprobs = logprobs
    _, maxima = train.train_on_rollouts(model, optimizer, mine, cfg, par)
    # Mini-batch m of the whole batch is the m-th slice of every rank's share.
    size = share // num_minibatches
    minibatches = [sum((part[m * size : (m + 1) * size] for part in per_rank), []) for m in range(num_minibatches)]
    ref_norm = reference_step(reference, minibatches, lr, max_norm, optimizer_name)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = reference.state_dict()
    weight_diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    return {
        "logits": logits_diff,
        "weights": weight_diff,
        "norm": (maxima["grad_norm"], ref_norm),
        "keys": (sorted(full), sorted(expected)),
    }


MESHES = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize(
    "family,tied",
    [("qwen2", True), ("qwen2", False), ("qwen3", True), ("qwen3", False), ("llama", True), ("llama", False)],
)
def test_sharded_step_matches_unsharded(dp, tp, family, tied, tmp_path):
    # max_norm 0.05 is below the gradient norm, so the 2-D clipping path scales the gradients.
    folder = save_reference(tmp_path, family, tied)
    result = run_ranks(sharded_vs_unsharded, dp * tp, folder, dp, tp, "sgd", 0.05, False)[0]
    assert result["keys"][0] == result["keys"][1]  # HF names, tied lm_head included
    assert result["logits"] < 1e-5
    sharded_norm, ref_norm = result["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > 0.05
    assert result["weights"] < 1e-5


def test_activation_checkpointing_keeps_the_step_exact(tmp_path):
    result = run_ranks(sharded_vs_unsharded, 4, save_reference(tmp_path, "qwen3", False), 2, 2, "sgd", 1e9, True)[0]
    assert result["logits"] < 1e-5 and result["weights"] < 1e-5


def test_two_minibatches_take_two_steps_with_the_ratio_against_the_sampling_policy(tmp_path):
    folder = save_reference(tmp_path, "qwen3", True)
    result = run_ranks(sharded_vs_unsharded, 4, folder, 2, 2, "sgd", 0.05, False, 2)[0]
    assert result["weights"] < 1e-5
    sharded_norm, ref_norm = result["norm"]
    assert sharded_norm == pytest.approx(ref_norm, rel=1e-5)


def test_adamw_under_2d_sharding_matches_unsharded(tmp_path):
    # AdamW's first step is lr * sign(g) for every weight, which amplifies 1e-7 gradient noise where g ~ 0:
    # a tolerance of 0.2 * lr still catches a weight that is not updated at all (off by lr).
    result = run_ranks(sharded_vs_unsharded, 4, save_reference(tmp_path, "qwen2", True), 2, 2, "adamw", 1e9, False)[0]
    assert result["weights"] < 0.2 * 1e-3


def accumulation(rank, world, folder, loss_agg, flags):
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    samples = make_samples(12, seed=2)[rank * 6 : (rank + 1) * 6]
    cfg = train.Config(max_grad_norm=0.0, loss_agg=loss_agg, max_new_tokens=16, **flags)
    train.train_on_rollouts(model, optimizer, samples, cfg, par)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.numpy().copy() for k, v in full.items()}  # numpy crosses the queue by value


@pytest.mark.parametrize("loss_agg", ["token", "sequence", "constant"])
def test_micro_batches_fixed_or_by_token_budget_accumulate_to_the_full_batch_gradient(loss_agg, tmp_path):
    folder = save_reference(tmp_path, "qwen2", True)
    full = run_ranks(accumulation, 2, folder, loss_agg, dict(micro_batch_size=6))[0]
    # 4 leaves a ragged last micro-batch of 2; budgets of 12 and 30 tokens pack 1 to 3 sequences of 4 to 12 tokens,
    # and the two ranks need different numbers of micro-batches before they are equalised.
    for flags in (
        dict(micro_batch_size=1),
        dict(micro_batch_size=4),
        dict(max_tokens_per_microbatch=12),
        dict(max_tokens_per_microbatch=30),
    ):
        split = run_ranks(accumulation, 2, folder, loss_agg, flags)[0]
        assert max(abs(split[k] - full[k]).max() for k in full) < 1e-6, flags
        assert max(abs(split[k] - expected).max() for k, expected in initial_weights(folder).items()) > 1e-3


def tool_output_gradients(rank, world, folder, tp):
    """The trainer's loss on one response with tool output, every term on: the gradient at each position of the final
    hidden states, and the step's token counts as step_metrics logs them."""
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    sample = make_samples(2, seed=3)[1]  # response tokens 1 to 3 are tool output
    sample.old_logprobs, sample.ref_logprobs = torch.zeros(sum(sample.sampled)), torch.zeros(sum(sample.sampled))
    hidden = {}

    def keep(module, args, out):  # the final norm's output: the hidden states that lm_head reads
        out.retain_grad()
        hidden["out"] = out

    model.model.norm.register_forward_hook(keep)
    cfg = train.Config(beta=0.1, entropy_coef=0.1, tis_cap=2.0, micro_batch_size=1)
    token_sums, maxima = train.train_on_rollouts(model, torch.optim.SGD(model.parameters(), lr=0.0), [sample], cfg, par)
    start = len(sample.prompt_ids) - 1  # the position that predicts the first response token
    grads = hidden["out"].grad[0, start : start + len(sample.response_ids)].abs().amax(-1)
    metrics = train.step_metrics([sample], token_sums, maxima, [], {}, train.Config(group_size=1), par)
    return grads.tolist(), sample.sampled, (metrics["tokens"], metrics["response_len"], metrics["response_len_max"])


@pytest.mark.parametrize("tp", [1, 2])
def test_tool_output_tokens_get_no_gradient_and_are_not_counted(tp, tmp_path):
    grads, sampled, tokens = run_ranks(tool_output_gradients, tp, save_reference(tmp_path, "qwen2", False), tp)[0]
    assert sampled == [True] + [False] * 3 + [True] * (len(sampled) - 4)
    # Loss, KL, entropy and IS weights reach a position only through the token it predicts: none for tool output.
    assert [g == 0 for g in grads] == [not m for m in sampled]
    assert tokens == (sum(sampled),) * 3  # the step's tokens, the response's length and the longest


def listed_logprobs(rank, world, folder, flags):
    """policy_logprobs of samples of varied lengths, as main stores them: the i-th tensor goes to the i-th sample."""
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    logprobs = train.policy_logprobs(model, make_samples(8, seed=13), train.Config(**flags), par)
    return [lp.numpy().copy() for lp in logprobs]


@pytest.mark.parametrize("flags", [dict(micro_batch_size=3), dict(max_tokens_per_microbatch=30)])
def test_policy_logprobs_are_each_samples_own_in_the_samples_order(flags, tmp_path):
    """Token-budget micro-batches sort the samples by length: the log-probs must still come back in the samples'
    order, or a sample's ratio is taken against another's log-probs."""
    folder = save_reference(tmp_path, "qwen2", True)
    listed = run_ranks(listed_logprobs, 1, folder, flags)[0]
    reference = AutoModelForCausalLM.from_pretrained(folder)
    samples = make_samples(8, seed=13)
    assert len(listed) == len(samples)
    for s, got in zip(samples, listed):
        with torch.no_grad():
            logits = reference(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        every = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1]
        want = every.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)[torch.tensor(s.sampled)]
        assert got.shape == tuple(want.shape) and (torch.from_numpy(got).double() - want).abs().max() < 1e-5


def initial_weights(folder):
    return {k: v.numpy() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def lengths_of(batches):
    return [[len(s.prompt_ids) + len(s.response_ids) for s in batch] for batch in batches]


def budget_batches(rank, world, budget):
    g = torch.Generator().manual_seed(rank)
    # Lengths vary 10x: rank 0 has mostly short sequences, rank 1 mostly long ones.
    lengths = [int(torch.randint(5, 50 if rank else 15, (1,), generator=g)) for _ in range(16)]
    samples = [train.Sample([1] * 5, [2] * n, [True] * n) for n in lengths]
    par = launch.parallel_groups("cpu", 1)
    batches = launch.micro_batches(samples, train.Config(max_tokens_per_microbatch=budget), par.world_group)
    return lengths_of([samples]), lengths_of(batches)


def test_token_budget_micro_batches_pack_length_ranges_within_the_budget_as_many_on_every_rank():
    budget = 120
    results = run_ranks(budget_batches, 2, budget)
    for (given,), batches in results:
        assert sorted(sum(batches, [])) == sorted(given)  # every sequence once
        assert all(len(batch) * max(batch) <= budget or len(batch) == 1 for batch in batches)
        for a in batches:  # each micro-batch holds a range of lengths that no other interleaves
            assert all(min(a) >= max(b) or min(b) >= max(a) for b in batches if b is not a)
    assert len(results[0][1]) == len(results[1][1])
    assert len(train_greedy_count(results[0][0][0], budget)) != len(train_greedy_count(results[1][0][0], budget))


def train_greedy_count(lengths, budget):
    """Greedy packing of the sorted lengths alone, before the ranks agree on a count."""
    batches = []
    for n in sorted(lengths, reverse=True):
        if batches and (len(batches[-1]) + 1) * batches[-1][0] <= budget:
            batches[-1].append(n)
        else:
            batches.append([n])
    return batches


def padding_fraction(batches):
    tokens = sum(sum(batch) for batch in batches)
    return 1 - tokens / sum(len(batch) * max(batch) for batch in batches)


def test_token_budget_cuts_padding_when_lengths_vary_tenfold():
    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(20, 200, (1,), generator=g)) for _ in range(64)]
    samples = [train.Sample([1] * 10, [2] * n, [True] * n) for n in lengths]

    def fixed_and_budgeted(rank, world):
        group = launch.parallel_groups("cpu", 1).world_group
        return [
            padding_fraction(lengths_of(launch.micro_batches(samples, cfg, group)))
            for cfg in (train.Config(micro_batch_size=8), train.Config(max_tokens_per_microbatch=8 * 210))
        ]

    fixed, budgeted = run_ranks(fixed_and_budgeted, 1)[0]
    assert fixed > 0.3 and budgeted < fixed / 3


def loaded_state(rank, world, folder, dp, tp):
    par = launch.parallel_groups("cpu", tp)
    full = get_model_state_dict(sharded_model(folder, par), options=StateDictOptions(full_state_dict=True))
    return {k: v.numpy().copy() for k, v in full.items()}


@pytest.mark.parametrize("dp,tp", [(1, 1)] + MESHES)
@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False), ("llama", True)])
def test_streamed_meta_device_loading_gives_the_weights_of_a_plain_load(dp, tp, family, tied, tmp_path):
    folder = save_reference(tmp_path, family, tied)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2  # the stream really has several files
    plain = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    loaded = run_ranks(loaded_state, dp * tp, folder, dp, tp)[0]
    assert sorted(loaded) == sorted(plain)
    assert all((torch.from_numpy(loaded[k]) == plain[k]).all() for k in plain)  # bit for bit


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path):
    folder = save_reference(tmp_path, "qwen2", False)
    from safetensors.torch import load_file, save_file

    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    tensors = load_file(last)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, last, metadata={"format": "pt"})
    with pytest.raises(AssertionError, match=dropped.replace(".", r"\.")):
        run_ranks(loaded_state, 2, folder, 2, 1)


def with_a_new_statistic(rank, world, folder, tp):
    """A fork's new statistic in policy_loss, and nothing else edited: step_metrics logs its mean per sampled token.
    The statistic: the per-token loss weight (x 1000), whose mean over the step's tokens the test knows."""
    original = train.policy_loss

    def policy_loss(logp, old_logp, advantages, weights, cfg, *args, **kwargs):
        loss, stats = original(logp, old_logp, advantages, weights, cfg, *args, **kwargs)
        return loss, dict(stats, weight_x1000=(weights * 1000).sum())

    train.policy_loss = policy_loss  # in this forked rank only
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    samples = make_samples(6 // (world // tp), seed=rank // tp)  # each dp rank its own; a TP group the same
    cfg = train.Config(micro_batch_size=2, num_minibatches=2)
    token_sums, maxima = train.train_on_rollouts(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, cfg, par)
    metrics = train.step_metrics(samples, token_sums, maxima, [], {}, train.Config(group_size=3), par)
    lengths = [sum(s.sampled) for s in samples]
    return metrics["weight_x1000"], metrics["tokens"], [s.loss_weight for s in samples], lengths


@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_a_statistic_added_to_the_loss_is_logged_as_its_mean_per_sampled_token(dp, tp, tmp_path):
    results = run_ranks(with_a_new_statistic, dp * tp, save_reference(tmp_path, "qwen2", False), tp)
    logged, tokens = results[0][:2]
    # Independently: sum over the step's distinct samples (one per dp rank's) of 1000 x weight x tokens, / tokens.
    per_rank = [sum(1000 * w * n for w, n in zip(weights, lengths)) for _, _, weights, lengths in results[::tp]]
    assert tokens == sum(sum(lengths) for *_, lengths in results[::tp])
    assert logged == pytest.approx(sum(per_rank) / tokens, rel=1e-6) and logged > 0  # float32 sums


TIMES = ("time_step", "time_rollout", "time_train", "time_push")  # a step's seconds, as main() logs them


def reward_term_metrics(rank, world, terms):
    """step_metrics of this rank's share of samples, each with reward_fn's terms and the reward they sum to."""
    par = launch.parallel_groups("cpu", 1)
    samples = []
    for correct, bonus in terms[rank]:
        reward = correct + 0.5 * bonus
        sample = train.Sample(
            [1], [5], [True], reward=reward, correct=reward >= 1, terms=dict(correct=correct, bonus=bonus)
        )
        samples.append(sample)
    return train.step_metrics(samples, {}, {}, [], {}, train.Config(group_size=2), par)


def test_each_reward_term_is_logged_as_its_mean_and_std_over_the_steps_samples_on_every_rank():
    """A reward_fn that returns {"correct": ..., "bonus": ...}: metrics.jsonl has reward/correct and reward/bonus,
    the means over the step's samples on both ranks, and their standard deviations (of the whole step's samples,
    not the mean of the ranks'); reward stays the mean of the weighted sum. Reference: Python's statistics."""
    terms = [[(1.0, 0.0), (0.0, 1.0)], [(1.0, 1.0), (1.0, 1.0), (0.0, 0.5), (0.0, 0.0)]]
    logged = run_ranks(reward_term_metrics, 2, terms)
    every = [pair for rank in terms for pair in rank]
    for metrics in logged:
        for i, name in enumerate(("correct", "bonus")):
            values = [pair[i] for pair in every]
            assert metrics[f"reward/{name}"] == pytest.approx(statistics.mean(values))
            assert metrics[f"reward/{name}/std"] == pytest.approx(statistics.pstdev(values))
        assert metrics["reward"] == pytest.approx(statistics.mean(c + 0.5 * b for c, b in every))
    line = logs.step_line(0, dict(logged[0], lr=1e-6, eta_s=0.0, **dict.fromkeys(TIMES, 0.1)), train.Config())
    assert " acc 0.50 [correct 0.50 bonus 0.58] | len " in line  # the means, 3 / 6 and 3.5 / 6
