"""The CPU rollout engine: sampled ids kept exactly (stop token included), its logprobs, seeding, weight pushes
from a sharded policy to the TP group's one engine, and the broadcast of rollouts to the other ranks of a tp group."""

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import architectures
import engines
import launch
import reward
import sandbox
import train
from demo_model import demo_config, demo_tokenizer
from test_parallel import save_reference, sharded_model, tiny_config
from workers import run_ranks

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
STOP = [3, 4, 20, 21, 22, 23, 24, 25]  # many stop ids, so that random models stop within a few tokens


def tiny_engine(seed=0):
    config = tiny_config("qwen2", False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    engine = engines.HFEngine(config, torch.device("cpu"))
    engine.update(list(model.named_parameters()), None)  # HFEngine loads the bucket itself: no group needed
    return engine, model


def test_samples_end_at_the_first_stop_token_or_the_length_limit():
    engine, _ = tiny_engine()
    outputs = engine.generate(PROMPTS * 20, [12] * 60, 1.0, 1.0, 0, STOP, seed=0)
    assert len(outputs) == 60
    stopped = [ids[-1] in STOP for ids, *_ in outputs]
    assert any(stopped) and not all(stopped)
    for (ids, logprobs, *_), stop in zip(outputs, stopped):
        assert all(t not in STOP for t in ids[:-1])  # nothing after the first stop token
        assert len(ids) <= 12 if stop else len(ids) == 12
        assert logprobs.shape == (len(ids),)


def test_each_prompt_stops_at_its_own_budget():
    engine, _ = tiny_engine()
    budgets = [1, 5, 12] * 20
    outputs = engine.generate(PROMPTS * 20, budgets, 1.0, 1.0, 0, STOP, seed=0)
    for (ids, logprobs, *_), budget in zip(outputs, budgets):
        assert 1 <= len(ids) <= budget and len(logprobs) == len(ids)
        assert ids[-1] in STOP or len(ids) == budget
    assert any(len(ids) == 12 for ids, *_ in outputs)  # the longest budget is reached, not only the batch's least


def test_many_prompts_are_generated_in_batches_whose_logits_fit_the_bound():
    """HF generate keeps [prompts, T, V] fp32 logits: a large --eval_k or --prompts_per_step must not take them all
    at once. Each batch is seeded on its own, so a prompt repeated across batches still gets other samples."""
    engine, _ = tiny_engine()
    sizes, generate = [], engine.model.generate
    engine.model.generate = lambda input_ids, **kw: sizes.append(len(input_ids)) or generate(input_ids=input_ids, **kw)
    engine.batch_bytes = 5 * 6 * 96 * 4  # five prompts' logits of 6 tokens over the vocabulary of 96
    outputs = engine.generate(PROMPTS[:1] * 12, [6] * 12, 1.0, 1.0, 0, [], seed=0)
    assert sizes == [5, 5, 2] and [len(ids) for ids, *_ in outputs] == [6] * 12
    assert len({tuple(ids) for ids, *_ in outputs}) > 5  # not the same five samples again in each batch
    engine.batch_bytes = 1  # below one prompt: one at a time
    sizes.clear()
    engine.generate(PROMPTS, [6] * 3, 1.0, 1.0, 0, [], seed=0)
    assert sizes == [1, 1, 1]


def test_engine_logprobs_are_those_of_the_tempered_distribution_it_samples():
    engine, model = tiny_engine()
    temperature = 0.7
    outputs = engine.generate(PROMPTS, [10] * len(PROMPTS), temperature, 1.0, 0, STOP, seed=1)
    for prompt, (ids, logprobs, *_) in zip(PROMPTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].double()
        want = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]
        want = want.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert (logprobs.double() - want).abs().max() < 1e-5


def hf_kept_set(logits, temperature, top_k, top_p):
    """HF's truncation, in float64: of logits / T the top_k largest (0: all), then of those, renormalised, each token
    whose more likely ones hold less than top_p of the mass."""
    z = logits / temperature
    order = z.argsort(descending=True)
    if top_k:
        order = order[:top_k]
    probs = torch.softmax(z[order], -1)
    mass_before = probs.cumsum(0) - probs
    return sorted(order[mass_before < top_p].tolist())


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.0, 5, 1.0), (1.2, 12, 0.8)])
def test_engine_reports_the_kept_set_of_each_token_and_logprobs_renormalised_over_it(temperature, top_k, top_p):
    engine, model = tiny_engine()
    outputs = engine.generate(PROMPTS * 4, [10] * 12, temperature, top_p, top_k, STOP, seed=1)
    sizes = []
    for prompt, (ids, logprobs, kept_ids, kept_sizes, _) in zip(PROMPTS * 4, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
        sets = kept_ids.split(kept_sizes.tolist())
        assert len(sets) == len(ids) and kept_ids.dtype == torch.int32
        for row, token, kept, logprob in zip(logits, ids, sets, logprobs):
            want = hf_kept_set(row, temperature, top_k, top_p)
            assert sorted(kept.tolist()) == want and token in want
            full = torch.log_softmax(row / temperature, -1)
            assert logprob.item() == pytest.approx((full[token] - full[want].logsumexp(0)).item(), abs=1e-5)
            sizes.append(len(want))
    assert 1 < max(sizes) < 96  # sets that hold several tokens and cut others


def test_same_seed_same_samples_and_the_global_rng_is_untouched():
    engine, _ = tiny_engine()
    state = torch.random.get_rng_state()
    a = engine.generate(PROMPTS, [8] * len(PROMPTS), 1.0, 1.0, 0, STOP, seed=7)
    b = engine.generate(PROMPTS, [8] * len(PROMPTS), 1.0, 1.0, 0, STOP, seed=7)
    c = engine.generate(PROMPTS, [8] * len(PROMPTS), 1.0, 1.0, 0, STOP, seed=8)
    assert [ids for ids, *_ in a] == [ids for ids, *_ in b] != [ids for ids, *_ in c]
    assert torch.equal(torch.random.get_rng_state(), state)


def test_greedy_decoding_at_temperature_zero():
    engine, model = tiny_engine()
    [(sampled, *_)] = engine.generate(PROMPTS[:1], [6], 0.0, 1.0, 0, [], seed=0)
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(6):
            ids.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert sampled == ids[len(PROMPTS[0]) :]


def push_then_generate(rank, world, folder, dp, tp):
    """A sharded policy pushes its weights; the tp group's first rank generates and scores, the group receives."""
    config = AutoConfig.from_pretrained(folder)
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    owner = par.mesh["tp"].get_local_rank() == 0
    engine = engines.start_engine(train.Config(engine="hf"), config, par, torch.device("cpu"))  # as train.main
    if owner:  # start from other weights, so a push that does nothing cannot pass
        engine.update([(n, torch.zeros_like(p)) for n, p in engine.model.named_parameters()], par.tp_group)
    bucket_mb = 1
    engines.push_weights(model, engine, bucket_mb, par.tp_group)
    cfg = train.Config(group_size=3, max_new_tokens=8, temperature=1.0)
    items = [{"prompt": "ab", "task": "toy", "target": "a"}, {"prompt": "cde", "task": "toy", "target": "b"}]
    repeated = [item for item in items for _ in range(cfg.group_size)]  # G samples per prompt, as collect_rollouts
    tokenizer = demo_tokenizer()
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    try:
        samples, errors = launch.on_first_rank(
            par.tp_group, train.generate_rollouts, engine, workers, tokenizer, repeated, cfg, 5, 1.0
        )
    finally:
        workers.close()
    with torch.no_grad():
        trainer_logp, _, _, _ = train.response_logprobs(model, samples, cfg, par.mesh["tp"])
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    scores_right = errors == [] and [s.reward for s in samples] == [
        reward.toy_reward(text, item["target"]) for text, item in zip(texts, repeated)
    ]
    engine_logp = torch.tensor([lp for s in samples for lp in s.engine_logprobs])
    weights_equal = not owner or all(torch.equal(p, state[k]) for k, p in engine.model.named_parameters())
    stop_ids = reward.stop_token_ids(tokenizer)
    finish_right = all(s.truncated == (s.response_ids[-1] not in stop_ids) for s in samples)
    return {
        "ids": [(s.prompt_ids, s.response_ids) for s in samples],
        "weights_equal": weights_equal,
        "finish_right": finish_right and len(samples) == 6,
        "scores_right": scores_right,
        "mismatch": (trainer_logp - engine_logp).abs().max().item(),
    }


def test_pushed_weights_reach_the_engine_and_scored_rollouts_reach_every_tp_rank(tmp_path):
    tokenizer = demo_tokenizer()
    results = run_ranks(push_then_generate, 2, save_reference(tmp_path, "qwen3", False), 1, 2)
    assert all(r["weights_equal"] and r["finish_right"] and r["scores_right"] for r in results)
    assert results[0]["ids"] == results[1]["ids"]  # rank 1 received rank 0's samples
    prompts = [p for p, _ in results[0]["ids"]]
    ab, cde = (tokenizer("ab").input_ids, tokenizer("cde").input_ids)
    assert prompts == [ab] * 3 + [cde] * 3  # G samples per prompt, grouped by prompt
    # The engine's logprobs equal the trainer's on the sampled tokens: the push was complete and exact.
    assert max(r["mismatch"] for r in results) < 1e-5


def bucket_plan(rank, world, folder, dp, tp, bucket_bytes):
    reference = AutoModelForCausalLM.from_pretrained(folder)
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    want = dict(reference.named_parameters())
    buckets = list(engines.weight_buckets(engines.full_weights(model, torch.bfloat16), bucket_bytes))
    tensors = [t for bucket in buckets for _, t in bucket]
    return {
        "names": [[n for n, _ in bucket] for bucket in buckets],
        "want_names": list(want),
        "bytes": [[t.numel() * t.element_size() for _, t in bucket] for bucket in buckets],
        "plain": all(type(t) is torch.Tensor for t in tensors),
        "bf16": all(t.dtype == torch.bfloat16 for t in tensors),
        "exact": all(torch.equal(t, want[n].detach().to(torch.bfloat16)) for b in buckets for n, t in b),
    }


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_weight_buckets_hold_every_full_bf16_weight_once_under_hf_names(dp, tp, tied, tmp_path):
    bound = 4096  # bytes: the tiny model's ~50 KB of bf16 weights make many buckets
    results = run_ranks(bucket_plan, dp * tp, save_reference(tmp_path, "qwen3", tied), dp, tp, bound)
    for r in results:
        names = sum(r["names"], [])
        assert names == r["want_names"]  # each parameter once, HF names, no wrapper prefixes
        assert ("lm_head.weight" in names) != tied  # a tied lm_head is the embedding: not sent twice
        assert r["plain"] and r["bf16"] and r["exact"]
        assert len(r["bytes"]) > 1
        for sizes in r["bytes"]:
            assert sum(sizes[:-1]) < bound  # a bucket closes as soon as it reaches the bound
        for sizes in r["bytes"][:-1]:
            assert sum(sizes) >= bound
    assert all(r["names"] == results[0]["names"] for r in results)  # the same plan on every rank


# ----------------------------------------------------------------------------- scoring
def test_score_samples_shapes_each_reward_by_the_overlong_penalty_and_flags_what_the_limit_cut():
    tokenizer = demo_tokenizer()
    a, b = tokenizer("ab", add_special_tokens=False).input_ids
    stop = tokenizer.eos_token_id
    responses = [[a, stop], [b] * 7 + [stop], [a] * 10]  # 2, 8 and 10 tokens of --max_new_tokens 10; the last cut
    items = [{"prompt": "Say a:", "task": "toy", "target": "a"}] * 3
    samples = [train.Sample([1], r) for r in responses]
    cfg = train.Config(max_new_tokens=10, overlong_buffer=4)
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    try:
        errors = train.score_samples(samples, items, workers, tokenizer, cfg)
    finally:
        workers.close()
    scores = [reward.reward_fn(tokenizer.decode(r, skip_special_tokens=True), items[0]) for r in responses]
    assert errors == [] and [s.reward for s in samples] == scores and scores[0] != scores[1]
    # DAPO's penalty over the last 4 of 10 tokens: 0 up to 6 tokens, (8 - 6) / 4 = 0.5 off at 8, 1 off at 10
    assert [s.shaped_reward for s in samples] == pytest.approx([scores[0], scores[1] - 0.5, scores[2] - 1.0])
    assert [s.truncated for s in samples] == [False, False, True]


# ----------------------------------------------------------------------------- dynamic sampling (DAPO)
def informative_or_flat(completion, item):
    """Items marked flat score the same for every completion (a group with no gradient); the others vary."""
    return 0.5 if item["flat"] else random.random()


def collect(rank, world, dataset, rounds, overlong_buffer):
    par = launch.parallel_groups("cpu", 1)
    tokenizer = demo_tokenizer()
    config = demo_config()
    engine = engines.HFEngine(config, torch.device("cpu"))
    cfg = train.Config(
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=max(2, overlong_buffer),
        dynamic_sampling_rounds=rounds,
        overlong_buffer=overlong_buffer,
    )
    workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
    try:
        samples, errors, counts = train.collect_rollouts(engine, workers, dataset, tokenizer, None, cfg, 7, par)
    finally:
        workers.close()
    groups = [samples[i : i + 3] for i in range(0, len(samples), 3)]
    # The items each round drew, for an independent count of what should have happened.
    drawn = [train.step_items(dataset, 7, cfg, 0, 1, r) for r in range(rounds + 1)]
    return (
        [[s.prompt_ids for s in g] for g in groups],
        [[s.reward for s in g] for g in groups],
        errors,
        counts["groups_dropped"],
        [[item["flat"] for item in items] for items in drawn],
        [[s.shaped_reward for s in g] for g in groups],
    )


# With an overlong penalty over all 40 tokens, responses that the random model stops at different lengths are shaped
# apart: a group is flat by the shaped reward, which advantages are made from, not by reward_fn's alone.
@pytest.mark.parametrize("flat_share, rounds, overlong_buffer", [(0.5, 0, 0), (0.5, 30, 0), (0.9, 1, 0), (0.5, 30, 40)])
def test_dynamic_sampling_refills_dropped_groups_and_counts_them(monkeypatch, flat_share, rounds, overlong_buffer):
    monkeypatch.setattr(reward, "reward_fn", informative_or_flat)  # the workers fork with it
    dataset = [{"prompt": f"row {i}", "flat": i < flat_share * 40} for i in range(40)]
    prompts, scores, errors, dropped, drawn, shaped = run_ranks(collect, 1, dataset, rounds, overlong_buffer)[0]
    assert errors == [] and len(prompts) == 4
    assert all(len(g) == 3 and len(set(map(tuple, g))) == 1 for g in prompts)  # groups of one prompt
    flat = [len(set(g)) == 1 for g in scores]
    if overlong_buffer:  # every group kept has a signal, and some only from the penalty: flat by reward_fn alone
        assert not any(len(set(g)) == 1 for g in shaped) and any(flat)
        return
    # Expected, round by round: informative groups are kept until there are 4; flat ones are dropped, and fill
    # the batch only when the rounds run out.
    kept, seen_flat = 0, 0
    for rows in drawn if rounds else drawn[:1]:
        kept += sum(not f for f in rows)
        seen_flat += sum(rows)
        if kept >= 4:
            break
    if rounds == 0:  # off: the step's rows as they come, nothing dropped
        assert dropped == 0 and sum(flat) == sum(drawn[0])
    else:
        filled = max(0, 4 - kept)
        assert sum(flat) == filled and dropped == seen_flat - filled
        assert (filled > 0) == (flat_share == 0.9)  # 2 rounds of mostly flat rows cannot fill the batch
    assert dropped > 0 or rounds == 0


# ----------------------------------------------------------------------------- what the engine can take
def check_sharded_names(rank, world, folder):
    par = launch.parallel_groups("cpu", world)
    config = architectures.text_config(AutoConfig.from_pretrained(folder))
    architectures.check_engine_names(sharded_model(folder, par), config, 1 << 29)  # full shapes
    return True


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_sharded_policy_pushes_only_names_and_shapes_its_engine_has(family, tmp_path):
    assert run_ranks(check_sharded_names, 2, save_reference(tmp_path, family, False)) == [True, True]


def test_a_name_the_engines_model_lacks_stops_the_run_naming_it():
    # A fork that adds a parameter the engine's model does not have (a value head).
    config = architectures.text_config(tiny_config("qwen2", True))
    model = AutoModelForCausalLM.from_config(config)
    model.value_head = torch.nn.Linear(config.hidden_size, 1)
    with pytest.raises(
        SystemExit, match=r"push value_head\.weight as \[1, 32\]; SGLang's Qwen2ForCausalLM loads no such"
    ):
        architectures.check_engine_names(model, config, 1 << 29)
    # A fork that compiles the policy: every name gains "_orig_mod.", which SGLang skips with only a warning.
    with pytest.raises(SystemExit, match=r"push _orig_mod\.model\.embed_tokens\.weight as \[96, 32\]"):
        architectures.check_engine_names(torch.compile(AutoModelForCausalLM.from_config(config)), config, 1 << 29)


def test_the_engine_builds_the_class_of_the_models_type_whatever_architectures_says():
    # A Qwen3 checkpoint whose config.json names Qwen2 (or nothing, as a config built in code): SGLang would build
    # Qwen2 and silently skip the q/k norms. The trainer names the class by the model type, for itself and the engine.
    config = tiny_config("qwen3", True)
    for named in (["Qwen2ForCausalLM"], None):
        config.architectures = named
        assert architectures.text_config(config).architectures == ["Qwen3ForCausalLM"]


def test_a_weight_the_trainer_never_pushes_stops_the_run_naming_it():
    # The config is Qwen3's, the trainer built a Llama (Qwen3 less the q/k norms, which keep random values).
    model = AutoModelForCausalLM.from_config(tiny_config("llama", True))  # head_dim 8, as the Qwen3 config's
    engine_config = architectures.text_config(tiny_config("qwen3", True))
    with pytest.raises(
        SystemExit, match=r"Qwen3ForCausalLM loads model\.layers\.0\.self_attn\.k_norm\.weight .* never"
    ):
        architectures.check_engine_names(model, engine_config, 1 << 29)


def test_a_shape_the_engines_model_does_not_expect_stops_the_run_naming_it():
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", False))  # vocabulary 96
    engine_config = tiny_config("qwen2", False)
    engine_config.vocab_size = 128
    engine_config = architectures.text_config(engine_config)
    with pytest.raises(SystemExit, match=r"model\.embed_tokens\.weight as \[96, 32\]; .* loads it as \[128, 32\]"):
        architectures.check_engine_names(model, engine_config, 1 << 29)
