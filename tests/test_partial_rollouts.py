"""Partial rollouts (--partial_rollouts): what a step admits and trains, against an engine whose response lengths
have a long tail; the versions tokens carry across a push, with the real HF engine; the decoupled correction in
float64; and the whole loop through torchrun: it learns as the synchronous run does, runs twice alike, resumes
exactly with responses in flight, and runs on 2 ranks, at tp 2 and with the other features."""

import math
import random
import re

import pytest
import torch

import engines
import launch
import reward
import sandbox
import train
from demo_model import demo_config, demo_tokenizer
from inflight import InFlight
from test_checkpoint import hf_weights, logged
from test_train import metrics, torchrun
from workers import run_ranks


class LongTailEngine(engines.Engine):
    """An engine whose responses have a long tail of lengths, decided when a response starts: its first token's id
    is 3 + its length (so a continued response, which the engine sees only as ids, knows where it ends), then "a"s,
    then a stop token; most responses are short, some run to --max_new_tokens. Each call asks for at most each
    budget, as HFEngine and SGLangEngine do; log-probs are 0."""

    def __init__(self, tokenizer, prompt_lengths):
        self.filler = tokenizer.convert_tokens_to_ids("a")
        self.prompt_lengths = prompt_lengths  # a response starts after its prompt's tokens
        self.calls = []

    def generate(self, prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None):
        self.calls.append(len(prompts))
        rng = random.Random(seed)
        outputs = []
        for ids, budget in zip(prompts, budgets):
            response = ids[self.prompt_lengths[tuple(ids[:4])] :]
            if response:
                length = response[0] - 3
            else:
                length = rng.choice([2, 3, 4, 5, 6, 8, 10, 12] * 2 + [300])
            whole = [3 + length] + [self.filler] * (length - 2) + [stop_ids[0]]
            new = whole[len(response) : len(response) + budget]
            no_sets = torch.zeros(0, dtype=torch.int32)
            outputs.append((new, torch.zeros(len(new)), no_sets, no_sets, torch.zeros(0, dtype=torch.uint8)))
        return outputs


def schedule(rank, world, steps, max_staleness):
    """partial_rollouts over `steps` steps with the long-tailed engine: per step, the groups trained (as (prompt,
    admitted, oldest token's version, every sample ended)), and the groups left in flight."""
    tokenizer = demo_tokenizer()
    dataset = [{"prompt": f"p{i:02d}:", "task": "toy", "target": "a"} for i in range(64)]
    prompt_lengths = {}
    for item in dataset:
        ids = reward.encode_prompt(tokenizer, item["prompt"])
        prompt_lengths[tuple(ids[:4])] = len(ids)
    engine = LongTailEngine(tokenizer, prompt_lengths)
    cfg = train.Config(
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=120,
        round_tokens=2,
        max_staleness=max_staleness,
        partial_rollouts=True,
        tis_cap=2.0,
    )
    in_flight = InFlight([], next_batch=0)
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    record = []
    try:
        for step in range(steps):
            before = {tokenizer.decode(g.samples[0].prompt_ids): g.admitted for g in in_flight.groups}
            samples, errors, carried = train.partial_rollouts(
                engine, workers, dataset, tokenizer, in_flight, cfg, step, 0, 1
            )
            trained = []
            for i in range(0, len(samples), 3):
                group = samples[i : i + 3]
                prompt = tokenizer.decode(group[0].prompt_ids)
                oldest = min(int(s.versions.min()) for s in group)
                ended = all(s.ended for s in group) and len({tuple(s.prompt_ids) for s in group}) == 1
                trained.append((prompt, before.get(prompt, step), oldest, ended))
            left = [(tokenizer.decode(g.samples[0].prompt_ids), g.admitted, g.ended) for g in in_flight.groups]
            running = sum(not s.ended for g in in_flight.groups for s in g.samples)
            record.append((trained, left, carried == running, errors))
    finally:
        workers.close()
    return record


@pytest.mark.parametrize("max_staleness", [1, 2, 4])
def test_a_step_trains_the_oldest_groups_that_ended_within_the_staleness_bound_and_loses_none(max_staleness):
    """Long-tailed lengths (most responses 2-12 tokens, 1 in 17 300 against a limit of 120), rounds of 2 tokens: each
    step trains exactly a batch of groups whose G responses have all ended, none older than --max_staleness steps,
    the oldest that ended; nothing is trained twice or lost, and the run's first steps admit two batches, each later
    step one. The bound is reached: long responses are carried, and the rounds go on for the groups that are due."""
    steps = 14
    record = run_ranks(schedule, 1, steps, max_staleness)[0]
    seen = []
    stalest = 0
    for step, (trained, left, carried_counted, errors) in enumerate(record):
        assert len(trained) == 4 and errors == [] and carried_counted  # --prompts_per_step 4 on one rank
        for prompt, admitted, oldest, ended in trained:
            assert ended and step - admitted <= max_staleness and admitted <= oldest, (step, prompt, admitted)
            stalest = max(stalest, step - oldest)
            seen.append(prompt)
        assert len(left) == 4  # two batches in flight before training, one after
        newest_trained = max(admitted for _, admitted, _, _ in trained)
        assert all(admitted >= newest_trained for _, admitted, ended in left if ended)  # the oldest ended go first
        assert all(step - admitted < max_staleness for _, admitted, _ in left)  # due next step at the latest
    assert len(seen) == len(set(seen)) == 4 * steps  # nothing trained twice
    admitted = seen + [prompt for prompt, _, _ in record[-1][1]]
    assert len(set(admitted)) == 4 * (steps + 1)  # every admitted prompt trained or in flight: none lost
    assert stalest == max_staleness  # the bound binds, and holds


def generate_across_a_push(rank, world, folder):
    """Three responses to one prompt, 4 tokens under the pushed policy (version 0), then the policy moved and pushed
    (version 1), then 4 more: each token's version and the engine's log-prob, the log-probs of both versions' models
    recomputed apart, and the importance weights and mismatch sums the trainer makes of them at step 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_parallel import sharded_model

    par = launch.parallel_groups("cpu", 1)
    config = AutoConfig.from_pretrained(folder)
    model = sharded_model(folder, par)
    engine = engines.HFEngine(config, torch.device("cpu"))
    tokenizer = demo_tokenizer()
    cfg = train.Config(max_new_tokens=12, partial_rollouts=True, tis_cap=100.0, temperature=1.0)
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    samples = [train.Sample(reward.encode_prompt(tokenizer, "Say a:")) for _ in range(3)]
    versions = {}
    try:
        for version in (0, 1):
            engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
            versions[version] = {k: v.clone() for k, v in engine.model.state_dict().items()}
            running = [s for s in samples if not s.ended]
            train.generate_turn(engine, workers, tokenizer, running, cfg, 11 + version, 1.0, 4, version)
            with torch.no_grad():  # the policy moves: the next push is another version
                for param in model.parameters():
                    param.mul_(1.6)
    finally:
        workers.close()
    recomputed = {}
    for version, state in versions.items():
        reference = AutoModelForCausalLM.from_config(config)
        reference.load_state_dict(state)
        rows = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(s.prompt_ids) - 1 : -1].double()
            rows.append(torch.log_softmax(logits, -1)[torch.arange(len(s.response_ids)), s.response_ids])
        recomputed[version] = rows
    with torch.no_grad():  # the trainer at step 1, before its update: the policy the second push carried
        model.reshard()
        for param in model.parameters():
            param.div_(1.6)
        trainer_logp = train.response_logprobs(model, samples, cfg, par.mesh["tp"])[0].double()
    engine_logp = torch.cat([s.engine_logprobs for s in samples]).double()
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    fresh = torch.cat([s.versions for s in samples]) == 1
    is_weights, sums = train.engine_mismatch(trainer_logp, engine_logp, cfg, lengths, fresh)
    return samples, recomputed, trainer_logp, is_weights, {k: float(v) for k, v in sums.items()}


def test_each_token_carries_the_version_that_sampled_it_and_is_weighted_by_that_versions_log_prob(tmp_path):
    """A response continued across a push: its first tokens carry version 0 and the log-probs of the version-0
    weights, the next version 1's (each recomputed apart from the engine, to fp32 noise); the policy moved enough
    between them that the two differ by far more. The importance weight of every token is p_trainer / p_engine
    with the engine's log-prob that of the version that sampled it: 1 for version 1's tokens, far from 1 for
    version 0's; mismatch_abs covers the fresh tokens alone (a push canary at fp32 noise), stale_mismatch_abs the
    rest."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(demo_config()).save_pretrained(tmp_path)  # the demo's model: its tokenizer's ids
    samples, recomputed, trainer_logp, is_weights, sums = run_ranks(generate_across_a_push, 1, str(tmp_path))[0]
    spanning = [s for s in samples if set(s.versions.tolist()) == {0, 1}]
    assert spanning and all(s.versions.tolist() == sorted(s.versions.tolist()) for s in samples)
    start = 0
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert len(s.versions) == len(s.engine_logprobs) == n and all(s.sampled)
        for t, version in enumerate(s.versions.tolist()):
            assert s.engine_logprobs[t].item() == pytest.approx(recomputed[version][i][t].item(), abs=1e-5)
            other = recomputed[1 - version][i][t].item()
            expected = math.exp(trainer_logp[start + t] - s.engine_logprobs[t].item())
            assert is_weights[start + t].item() == pytest.approx(expected, rel=1e-6)
            if version == 0:
                assert abs(other - recomputed[version][i][t].item()) > 1e-3  # the versions tell apart
                assert abs(is_weights[start + t].item() - 1) > 1e-3
            else:
                assert is_weights[start + t].item() == pytest.approx(1.0, abs=1e-4)
        start += n
    assert sums["fresh"] == sum(int((s.versions == 1).sum()) for s in samples)
    fresh_tokens = sums["fresh"]
    assert sums["mismatch_abs"] / fresh_tokens < 1e-5 < sums["stale_mismatch_abs"] / (start - fresh_tokens)


def test_the_decoupled_objective_puts_the_behaviour_proximal_and_current_policies_where_each_belongs():
    """Decoupled PPO (AReaL; verl's decoupled mode), as train.py makes it from engine_mismatch and policy_loss:
    per token w min(pi_prox / pi_behav, C) (-min(r A, clip(r) A)), r = pi / pi_prox. The behaviour policy (the
    engine's log-probs, of whichever version sampled the token) enters only the importance weight; the proximal
    policy (the trainer's at the step's start) both that weight and the ratio's denominator; the policy being
    trained only the ratio's numerator, and the gradient flows through it alone. Reference: float64 from the
    formula; each policy moved alone changes the loss as the formula says."""
    g = torch.Generator().manual_seed(5)
    n = 40
    behaviour = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    proximal = behaviour + torch.randn(n, generator=g, dtype=torch.float64) * 0.4  # stale tokens: far apart
    current = (proximal + torch.randn(n, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    cfg = train.Config(tis_cap=2.0, clip_low=0.2, clip_high=0.28)
    lengths = torch.tensor([n])

    def loss_of(current, proximal, behaviour):
        is_weights, _ = train.engine_mismatch(proximal, behaviour, cfg, lengths)
        return train.policy_loss(current, proximal, adv, weights, cfg, is_weights=is_weights)[0]

    def reference(current, proximal, behaviour):
        total, grads = 0.0, []
        for t in range(n):
            weight = min(math.exp(proximal[t] - behaviour[t]), 2.0)
            r = math.exp(current[t] - proximal[t])
            a = adv[t].item()
            clipped = min(max(r, 0.8), 1.28)
            total += weights[t].item() * weight * -min(r * a, clipped * a)
            grads.append(weights[t].item() * weight * (-a * r if r * a <= clipped * a else 0.0))
        return total, grads

    loss = loss_of(current, proximal, behaviour)
    loss.backward()
    expected, grads = reference(*[[v.item() for v in x] for x in (current.detach(), proximal, behaviour)])
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert current.grad.tolist() == pytest.approx(grads, rel=1e-9, abs=1e-15)
    for moved in range(3):  # each policy moved alone: the formula follows it
        policies = [current.detach().clone(), proximal.clone(), behaviour.clone()]
        policies[moved][: n // 2] += 0.3
        want, _ = reference(*[p.tolist() for p in policies])
        assert loss_of(*policies).item() == pytest.approx(want, rel=1e-12)
        assert loss_of(*policies).item() != pytest.approx(expected, rel=1e-6)


PARTIAL = ("--preset", "cpu", "--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "4")


def test_partial_rollouts_learn_the_toy_reward_on_two_ranks_and_log_their_staleness(tmp_path):
    """The CPU demo with partial rollouts (2 ranks, rounds of 4 tokens, staleness at most 2): it learns as the
    synchronous demo does (test_train's thresholds), responses are carried into the next step, the staleness and
    the versions a response spans stay within the bound, the push canary over the fresh tokens stays at fp32 noise
    while the older tokens show the policy's drift, and the console shows the staleness."""
    run = torchrun(2, *PARTIAL, "--max_staleness", "2", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 30 and "Warning" not in run.stderr
    first, last = rows[:5], rows[-5:]
    assert sum(r["reward"] for r in first) / 5 < 0.3 and sum(r["reward"] for r in last) / 5 > 0.8
    assert rows[-1]["eval_greedy_acc"] == 1.0 and [r["step"] for r in rows if "eval_prompts" in r] == [10, 20, 30]
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= 2 for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 1 and max(r["responses_carried"] for r in rows) > 0
    assert all(1 <= r["versions_per_response"] <= r["versions_per_response_max"] <= 3 for r in rows)
    assert all(r["mismatch_abs"] < 1e-5 and r["groups_dropped"] == 0 for r in rows)
    assert max(r["stale_mismatch_abs"] for r in rows) > 1e-2  # the policy moved between versions
    steps = [line for line in run.stdout.splitlines() if re.match(r"step \d+/30 ", line)]
    assert len(steps) == 30 and all(re.search(r" \| stale \d\.\d\d max [012]$", line) for line in steps)


def test_two_identical_seeded_runs_with_partial_rollouts_agree_at_tp_2(tmp_path):
    """Rounds are counted in tokens, and every round's sampling is seeded by (seed, step, round, dp rank): two runs of
    the same command give the same metrics, every value but timings."""
    flags = (*PARTIAL, "--tp", "2", "--steps", "6", "--eval_every", "3", "--eval_prompts", "4")
    for name in ("a", "b"):
        run = torchrun(2, *flags, "--out_dir", str(tmp_path / name))
        assert run.returncode == 0, run.stderr[-3000:]
    assert logged(tmp_path / "a") == logged(tmp_path / "b")
    assert max(r["responses_carried"] for r in logged(tmp_path / "a")) > 0


def test_a_resume_with_responses_in_flight_goes_on_as_the_run_would_have(tmp_path):
    """3 steps, then --resume for 3 more, equals 6 steps straight: the responses in flight at the checkpoint (their
    ids, versions, engine log-probs, the next batch to admit) come back with it, so the staleness, the rewards and
    the weights are the same, step by step."""
    flags = (*PARTIAL, "--max_staleness", "2", "--eval_every", "3", "--eval_prompts", "4")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert torchrun(2, *flags, "--steps", "6", "--out_dir", str(straight)).returncode == 0
    first = torchrun(2, *flags, "--steps", "3", "--out_dir", str(split))
    assert first.returncode == 0, first.stderr[-3000:]
    assert logged(split)[-1]["responses_carried"] > 0  # the checkpoint holds responses half generated
    assert (split / "checkpoints" / "step_000003" / "in_flight.pt").exists()
    second = torchrun(2, *flags, "--steps", "6", "--resume", "auto", "--out_dir", str(split))
    assert second.returncode == 0, second.stderr[-3000:]
    assert logged(split) == logged(straight)
    a, b = hf_weights(straight, 6), hf_weights(split, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Resumed with another G, the groups in flight no longer fit: dropped, said once, and new prompts admitted.
    checkpoint = str(split / "checkpoints" / "step_000003")
    other = torchrun(2, *flags, "--steps", "4", "--group_size", "4", "--resume", checkpoint, "--out_dir", str(tmp_path))
    assert other.returncode == 0, other.stderr[-3000:]
    assert other.stdout.count("its responses in flight are dropped (saved with other --group_size)") == 1
    assert metrics(tmp_path)[-1]["samples"] == 8 * 4  # a batch of fresh groups of 4


def test_partial_rollouts_with_truncated_sampling_minibatches_batch_std_and_lora(tmp_path):
    """The other features with partial rollouts: kept sets carried with their tokens across steps (--top_p), a
    second mini-batch, the batch's std, and LoRA's adapters, which alone learn."""
    flags = ("--top_p", "0.9", "--num_minibatches", "2", "--std_of", "batch", "--lora_rank", "8")
    run = torchrun(2, *PARTIAL, *flags, "--steps", "12", "--eval_every", "0", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    assert rows[-1]["reward"] > rows[0]["reward"] + 0.2 and max(r["responses_carried"] for r in rows) > 0
    assert all(r["mismatch_abs"] < 1e-5 and r["log_kept_mass"] < 0 for r in rows)
