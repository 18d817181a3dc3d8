"""--routing_replay (rollout routing replay): the engine reports the experts each MoE layer chose at every position it
ran, and the trainer's forward routes each token to them, weighted by its own router's softmax there. Checked: the
replayed experts and weights against the definition in float64, on each MoE architecture; the HF engine's report
against its model's own routing over the whole sequence, version by version across a push; the trainer's experts
equal to the engine's, and routing_mismatch counting where they would differ; a replayed step sharded equal to the
unsharded one; and through torchrun, learning at tp 2 with partial rollouts and an exact resume with routings in
flight."""

import contextlib
import io
import json
import types
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import architectures
import checkpoint
import engines
import launch
import reward
import sandbox
import train
from demo_model import demo_tokenizer
from hub_models import VOCAB, save_hub_model, text_model
from inflight import InFlight
from test_checkpoint import hf_weights, logged
from test_parallel import MESHES, make_samples, sharded_model
from test_train import metrics, torchrun
from workers import run_ranks

MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")
# Whether the router renormalises its top-k probabilities: the hub fixtures' configs (Qwen3-MoE's norm_topk_prob
# false, as transformers' default; Qwen3-Next's true) and Qwen3.5-MoE's router, which always does.
RENORMALISED = {"qwen3_moe": False, "qwen3_next": True, "qwen3_5_moe": True}


@pytest.fixture(scope="module")
def hub_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {architecture: save_hub_model(root / architecture, architecture) for architecture in MOE_ARCHITECTURES}


def random_routing(positions, config, generator):
    """k distinct experts drawn at random for every position and layer: [positions, layers, k]."""
    scores = torch.rand(positions, config.num_hidden_layers, config.num_experts, generator=generator)
    return scores.argsort(-1)[..., : config.num_experts_per_tok]


def watch_moe_layers(model):
    """Hooks that keep, per MoE layer and forward, what its router is given (the hidden states) and chooses itself
    (its top-k indices, seen before any replay), and what its experts get (the top-k indices and weights); returns
    the record and the hooks' handles."""
    seen = defaultdict(list)
    handles = []
    for i, router in architectures.routers(model).items():
        experts = model.model.layers[i].mlp.experts
        handles += [
            router.register_forward_hook(lambda m, args, out, i=i: seen[i, "own"].append(out[2]), prepend=True),
            router.register_forward_pre_hook(lambda m, args, i=i: seen[i, "hidden"].append(args[0])),
            experts.register_forward_pre_hook(lambda m, args, i=i: seen[i, "experts"].append(args[1:3])),
        ]
    return seen, handles


def choices(seen, what, config):
    """The recorded experts (`what`: "own", the routers' choices; "experts", what the experts got) of the first
    forward, [tokens, layers, k]; -1 in dense layers."""
    layers = {layer: calls[0] for (layer, kind), calls in seen.items() if kind == what}
    first = next(iter(layers.values()))
    first = first[0] if what == "experts" else first
    routing = torch.full((first.shape[0], config.num_hidden_layers, config.num_experts_per_tok), -1)
    for layer, call in layers.items():
        routing[:, layer] = call[0] if what == "experts" else call
    return routing


# ----------------------------------------------------------------------------------------------------------------
# The replayed forward, against the definition


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_replay_routes_to_the_engines_experts_weighted_by_the_routers_softmax_there(architecture, hub_folders):
    """Given an engine's experts for every token but one (which has none: the router's own), each MoE layer's experts
    get exactly those, weighted by softmax(router logits) gathered there, renormalised where the router renormalises
    (float64 from the router's input and weight). Given the router's own choices, the logits and every gradient are
    transformers' unreplayed ones; given others, the router still gets a gradient through the weights."""
    model = text_model(hub_folders[architecture])
    if architecture == "qwen3_5_moe":  # a config may say so; Qwen3.5-MoE's router renormalises all the same
        model.config.norm_topk_prob = False
    architectures.replay_routing(model)
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 7), generator=generator)
    given = random_routing(14, config, generator)
    given[5] = -1
    seen, _ = watch_moe_layers(model)
    model.replay = given
    model(ids).logits.logsumexp(-1).sum().backward()
    for layer, router in architectures.routers(model).items():
        probs = torch.softmax(seen[layer, "hidden"][0].double() @ router.weight.double().T, -1)
        expected = given[:, layer].clone()
        expected[5] = probs[5].topk(config.num_experts_per_tok).indices
        weights = probs.gather(-1, expected)
        if RENORMALISED[architecture]:
            weights = weights / weights.sum(-1, keepdim=True)
        indices, replayed = seen[layer, "experts"][0]
        assert torch.equal(indices, expected)
        assert (replayed.double() - weights).abs().max() < 1e-6
        assert router.weight.grad.abs().sum() > 0
    model.zero_grad()
    seen.clear()
    model.replay = None
    plain = model(ids).logits
    plain.logsumexp(-1).sum().backward()
    plain_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.replay = choices(seen, "own", config)
    replayed = model(ids).logits
    replayed.logsumexp(-1).sum().backward()
    assert torch.equal(replayed, plain)
    assert all(torch.equal(p.grad, plain_grads[name]) for name, p in model.named_parameters())


def test_an_engine_routing_row_that_is_no_k_distinct_experts_is_routed_by_the_router_itself_and_counted(hub_folders):
    """A row with an expert twice (replayed, it would send the token to that expert at full weight) or an index past
    the experts (an engine's -1 kept in a byte, 255: it would raise in the gather) is routed by the router's own
    top-k, as VeOmni's replay does, and counted (the last of architectures.routing's counts, routing_unusable in
    metrics.jsonl); the other rows replay as given, and a position the engine did not run (-1) is not counted."""
    model = text_model(hub_folders["qwen3_moe"])
    architectures.replay_routing(model)
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 7), generator=generator)
    given = random_routing(14, config, generator)
    given[3, :, 1] = given[3, :, 0]  # an expert twice, in every layer
    given[8, :, 0] = 255
    given[13] = -1  # a last token
    seen, _ = watch_moe_layers(model)
    model.replay = given
    out = model(ids, output_router_logits=True)
    for layer in architectures.routers(model):
        expected = given[:, layer].clone()
        for row in (3, 8, 13):
            expected[row] = seen[layer, "own"][0][row]
        assert torch.equal(seen[layer, "experts"][0][0], expected)
    _, counts = architectures.routing(out, torch.ones(2, 7), model, given)
    assert counts[:, -2].tolist() == [11.0] * len(counts)  # the rows compared
    assert counts[:, -1].tolist() == [2.0] * len(counts)  # the rows that could not be replayed
    # 255 is no expert wherever routings are kept in bytes: 256 experts take two.
    assert architectures.routing_dtype(types.SimpleNamespace(num_experts=255)) == torch.uint8
    assert architectures.routing_dtype(types.SimpleNamespace(num_experts=256)) == torch.int16


# ----------------------------------------------------------------------------------------------------------------
# The HF engine's report, and the trainer's forward on it


def engine_routing_recomputed(engine, samples):
    """Each sample's routing as its engine's model routes the whole sequence in one forward (top-k sets, sorted):
    [positions but the last, layers, k]; -1 in dense layers."""
    config = engine.model.config
    rows = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = engine.model(ids, output_router_logits=True).router_logits
        routing = torch.full((ids.shape[1] - 1, config.num_hidden_layers, config.num_experts_per_tok), -1)
        for layer, layer_logits in zip(architectures.routers(engine.model), logits):
            routing[:, layer] = layer_logits[:-1].topk(config.num_experts_per_tok, -1).indices
        rows.append(routing.sort(-1).values)
    return rows


def engine_and_trainer(rank, world, folder, tp):
    """Responses from an HF engine whose routers are nudged off the trainer's (as a bf16 engine's kernels route some
    tokens otherwise), with their routing; then the trainer's forward on them with --routing_replay measure and on:
    what its experts got, its log-probs and its routing counts."""
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    config = model.config
    engine = engines.HFEngine(config, torch.device("cpu"))
    engine.model.load_state_dict(text_model(folder).state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in architectures.routers(engine.model).values():
            router.weight.add_(0.05 * torch.randn(router.weight.shape, generator=generator))
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 5, 6)]
    outputs = engine.generate(prompts, [6, 4, 6, 5], 1.0, 1.0, 0, [], 7, routing_from=[0] * 4)
    samples = []
    for prompt, (ids, logprobs, _, _, routing) in zip(prompts, outputs):
        sample = train.Sample(prompt, response_ids=ids, sampled=[True] * len(ids), engine_logprobs=logprobs)
        sample.routing = routing
        samples.append(sample)
    recomputed = engine_routing_recomputed(engine, samples)
    result = dict(samples=samples, recomputed=recomputed)
    for mode in ("measure", "on"):
        seen, handles = watch_moe_layers(model)
        cfg = train.Config(routing_replay=mode)
        with torch.no_grad():
            logp, _, _, (_, counts) = train.response_logprobs(model, samples, cfg, par.mesh["tp"])
        for handle in handles:
            handle.remove()
        own, experts = choices(seen, "own", config), choices(seen, "experts", config)
        result[mode] = dict(own=own, experts=experts, logp=logp, counts=counts)
    return result


@pytest.mark.parametrize("tp", [1, 2])
def test_the_trainer_routes_as_the_engine_reported_and_routing_mismatch_counts_where_it_would_not(tp, hub_folders):
    """The HF engine's routing: at every position of each sample but the last (prompt and response, left-padded
    batch, prefill then decoding), the experts its own model chooses over the whole sequence. Without replay
    (measure) the trainer's experts are its routers' own; with --routing_replay on they are the engine's at every
    such position and layer (tp 1 and 2). Either way routing_mismatch's count is the share of those (token, layer)
    pairs whose router, in that forward, chose otherwise than the engine; and the engine's log-probs are nearer the
    replayed trainer's than the unreplayed one's."""
    result = run_ranks(engine_and_trainer, tp, hub_folders["qwen3_moe"], tp)[0]
    samples, recomputed = result["samples"], result["recomputed"]
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for s, expected in zip(samples, recomputed):
        assert torch.equal(s.routing.long().sort(-1).values, expected)
    for mode in ("measure", "on"):
        own, experts = (result[mode][key].view(len(samples), longest, -1, 2) for key in ("own", "experts"))
        differing = compared = 0
        for b, s in enumerate(samples):
            given, positions = s.routing.long(), len(s.routing)
            assert torch.equal(experts[b, :positions], given if mode == "on" else own[b, :positions])
            differing += (own[b, :positions].sort(-1).values != given.sort(-1).values).any(-1).sum().item()
            compared += given[..., 0].numel()
        assert 0 < differing < compared / 2
        assert result[mode]["counts"][:, -3:].sum(0).tolist() == [differing, compared, 0]  # every row usable
    engine_logp = torch.cat([s.engine_logprobs for s in samples])
    gaps = {mode: (result[mode]["logp"] - engine_logp).abs().mean() for mode in ("measure", "on")}
    assert gaps["on"] < gaps["measure"]


def partial_routing_across_a_push(rank, world, folder):
    """train.partial_rollouts on the hub's Qwen3-MoE with --routing_replay on for three steps, rounds of 3 tokens,
    the policy moved and pushed between them (its routers flipped, so that odd versions route otherwise than even
    ones): the samples of the steps (trained or still in flight), and each parity's routing of their whole sequences
    recomputed apart."""
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    engine = engines.HFEngine(model.config, torch.device("cpu"))
    tokenizer = demo_tokenizer()
    dataset = [{"prompt": f"Say a{i}:", "task": "toy", "target": "a"} for i in range(8)]
    cfg = train.Config(prompts_per_step=1, group_size=3, max_new_tokens=12, round_tokens=3, max_staleness=4)
    cfg.partial_rollouts, cfg.tis_cap, cfg.routing_replay = True, 2.0, "on"
    in_flight = InFlight([], next_batch=0)
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    samples = []
    recomputed = {}
    try:
        for step in (0, 1, 2):
            engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
            samples += train.partial_rollouts(engine, workers, dataset, tokenizer, in_flight, cfg, step, 0, 1)[0]
            flip_routers(model)  # the policy moves: the next push is another version
        samples += [s for g in in_flight.groups for s in g.samples]
        for parity in (1, 0):  # three flips: the odd versions' routers first
            engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
            recomputed[parity] = engine_routing_recomputed(engine, samples)
            flip_routers(model)
    finally:
        workers.close()
    return samples, recomputed


def flip_routers(model):
    with torch.no_grad():
        for router in architectures.routers(model).values():
            router.weight.mul_(-1)


def test_a_response_carried_across_a_push_is_routed_afresh_by_the_new_weights(hub_folders):
    """Partial rollouts: a response the engine went on with after a push holds, at every position, the routing the
    new weights gave it (the engine runs its whole sequence on them, so the trainer's replayed forward is the
    engine's); one that no round ran after the push keeps the routing of the weights that sampled it."""
    samples, recomputed = run_ranks(partial_routing_across_a_push, 1, hub_folders["qwen3_moe"])[0]
    carried = 0
    for b, s in enumerate(samples):
        latest = s.versions[-1].item()
        assert torch.equal(s.routing.long().sort(-1).values, recomputed[latest % 2][b])
        carried += len(set(s.versions.tolist())) > 1
    assert carried > 0
    assert not torch.equal(recomputed[0][0], recomputed[1][0])


# ----------------------------------------------------------------------------------------------------------------
# A replayed step, sharded and not


def replayed_step(rank, world, folder, dp, tp, checkpointing=False):
    """One SGD step of the trainer with --routing_replay on over dp x tp ranks (with activation checkpointing, whose
    recomputation in backward must route as the forward did, where asked), every sample carrying a random
    routing (-1 at its last position), each dp rank a micro-batch of 4; the full weights after it. Also the same
    step on the unsharded model, its routers replaying the same routing sample by sample."""
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par, checkpointing)
    config = model.config
    samples = make_samples(4 * dp, seed=1)
    generator = torch.Generator().manual_seed(2)
    for s in samples:
        s.routing = random_routing(len(s.prompt_ids) + len(s.response_ids) - 1, config, generator).to(torch.uint8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = train.Config(micro_batch_size=4, max_grad_norm=0.0, routing_replay="on")
    train.train_on_rollouts(model, optimizer, samples[4 * par.mesh["dp"].get_local_rank() :][:4], cfg, par)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = text_model(folder)
    architectures.replay_routing(reference)
    tokens = sum(sum(s.sampled) for s in samples)
    loss = 0.0
    for s in samples:  # on-policy: the ratio is 1, its gradient d log p
        reference.replay = torch.cat([s.routing.long(), torch.full((1, *s.routing.shape[1:]), -1)])
        logits = reference(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1].gather(
            -1, torch.tensor(s.response_ids)[:, None]
        )
        logp = logp.squeeze(-1)[torch.tensor(s.sampled)]
        loss = loss - (torch.exp(logp - logp.detach()) * s.advantage).sum() / tokens
    loss.backward()
    with torch.no_grad():
        return max((full[name] - (p - 0.1 * p.grad)).abs().max().item() for name, p in reference.named_parameters())


@pytest.mark.parametrize("dp,tp,checkpointing", [(dp, tp, False) for dp, tp in MESHES] + [(1, 2, True)])
def test_a_replayed_step_sharded_equals_the_unsharded_one(dp, tp, checkpointing, hub_folders):
    """Each sample's routing reaches its own tokens through dp's split, the micro-batch's padding and TP's experts
    (and activation checkpointing's recomputation): the weights after the sharded step equal an unsharded SGD step on
    the same replayed forward."""
    assert run_ranks(replayed_step, dp * tp, hub_folders["qwen3_moe"], dp, tp, checkpointing)[0] < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# train.py through torchrun


def test_a_moe_model_learns_with_routing_replayed_at_tp_2_with_partial_rollouts(hub_folders, tmp_path):
    """The CPU demo's toy task on the hub's Qwen3-MoE at tp 2, --routing_replay on with partial rollouts (responses
    carried across pushes, their older tokens corrected): the reward climbs; the engine's log-probs of the fresh tokens
    equal the trainer's (a carried response is routed afresh by the weights that go on with it); routing_mismatch is
    logged each step: the drift of the routers since older samples were routed, then 0 once the policy settles."""
    flags = ("--preset", "cpu", "--model", hub_folders["qwen3_moe"], "--tp", "2", "--routing_replay", "on")
    flags += ("--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "4", "--steps", "20")
    run = torchrun(2, *flags, "--eval_every", "0", "--sample_every", "0", "--out_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(tmp_path)
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert rows[0]["reward"] < 0.1 and last > 0.8, (rows[0]["reward"], last)
    assert all(r["mismatch_abs"] < 1e-5 for r in rows)
    assert max(r["routing_mismatch"] for r in rows) > 0.1 and max(r["routing_mismatch"] for r in rows[-10:]) < 0.01
    assert max(r["responses_carried"] for r in rows) > 0


def test_a_resume_with_routings_in_flight_goes_on_as_the_run_would_have(hub_folders, tmp_path):
    """2 steps, then --resume for 2 more, equals 4 steps straight with --routing_replay on and responses in flight:
    their routings come back with them."""
    flags = ("--preset", "cpu", "--model", hub_folders["qwen3_moe"], "--tp", "2", "--routing_replay", "on")
    flags += ("--partial_rollouts", "true", "--tis_cap", "2", "--round_tokens", "4", "--save_every", "2")
    flags += ("--eval_every", "0", "--sample_every", "0")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert torchrun(2, *flags, "--steps", "4", "--out_dir", str(straight)).returncode == 0
    first = torchrun(2, *flags, "--steps", "2", "--out_dir", str(split))
    assert first.returncode == 0, first.stderr[-3000:]
    assert logged(split)[-1]["responses_carried"] > 0
    second = torchrun(2, *flags, "--steps", "4", "--resume", "auto", "--out_dir", str(split))
    assert second.returncode == 0, second.stderr[-3000:]
    assert logged(split) == logged(straight)
    a, b = hf_weights(straight, 4), hf_weights(split, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def in_flight_resumed(rank, world, path, routing_replay):
    """checkpoint.load_in_flight of `path` by a run with --routing_replay `routing_replay`, and what it printed."""
    cfg = train.Config(partial_rollouts=True, tis_cap=2.0, routing_replay=routing_replay)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        state = checkpoint.load_in_flight(path, cfg, dist.group.WORLD)
    return state, printed.getvalue()


@pytest.mark.parametrize("now", ["off", "measure"])
def test_a_resume_with_another_routing_replay_drops_the_responses_in_flight_naming_the_flag(now, tmp_path):
    """Responses in flight saved with --routing_replay on carry routings a run that measures or does not replay would
    use otherwise (and saved with it off they carry none to replay): a resume with another value drops them, said
    once, as for another flag that made them; with the same value it takes them back."""
    saved = dict(vars(train.Config(partial_rollouts=True, tis_cap=2.0, routing_replay="on")))
    (tmp_path / "trainer_state.json").write_text(json.dumps(dict(config=saved)))
    state = dict(groups=[], next_batch=3)
    torch.save([state], tmp_path / "in_flight.pt")
    assert run_ranks(in_flight_resumed, 1, str(tmp_path), "on")[0] == (state, "")
    dropped, printed = run_ranks(in_flight_resumed, 1, str(tmp_path), now)[0]
    assert dropped is None and "--routing_replay" in printed and "dropped" in printed


def test_routing_replay_on_a_dense_model_is_refused_naming_the_flag(tmp_path):
    run = torchrun(1, "--preset", "cpu", "--routing_replay", "on", "--out_dir", str(tmp_path))
    assert run.returncode != 0
    assert "--routing_replay on: --model" in run.stderr + run.stdout and "drop the flag" in run.stderr + run.stdout
