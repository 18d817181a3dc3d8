"""SGLangEngine against the real sglang package with only sglang.Engine faked (tests/fake_sglang_engine.py): the
engine cannot start on a CPU, so it alone is replaced and the trainer's code runs unchanged. The fakes follow the
0.5.17 / 0.5.23 API in tests/sglang_api.md: start-up arguments, the port (held by the engine from start, so a taken
one fails) and the environment the engine inherits, weight pushes as flattened bf16 buckets (one serialized payload
per engine TP rank, gathered from the trainer ranks), the 0.5.21+ weight-update session, memory release / resume
bookkeeping, the output format of generate, and shutdown's SIGKILL of every child process. engines.start_engine
waits on the job's process group at start: single-process tests run in a one-rank gloo group (`world`), the others in
run_ranks."""

import os
import socket
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

pytest.importorskip("sglang.srt.utils", reason="needs sglang: pip install --no-deps -r requirements-sglang-cpu.txt")
import engines  # noqa: E402
import fake_sglang_engine  # noqa: E402
import flags  # noqa: E402
import launch  # noqa: E402
import stopping  # noqa: E402
import train  # noqa: E402
from demo_model import demo_config  # noqa: E402
from hub_models import text_config  # noqa: E402
from sglang_cpu_engine import trainer_model  # noqa: E402
from test_parallel import save_reference, tiny_config  # noqa: E402
from workers import run_ranks  # noqa: E402

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
MEMORY_CHECK = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"


@pytest.fixture
def world():
    """A one-rank gloo process group, as `python train.py` makes: start_engine binds its port, then waits on it."""
    assert not dist.is_initialized(), "a process group left initialized by an earlier test"
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def sglang(monkeypatch, tmp_path, world):
    """The real sglang, whose Engine a test swaps for a fake (undone after); the environment and the working
    folder restored after, the fakes' ports closed."""
    import sglang

    monkeypatch.setattr(sglang, "Engine", fake_sglang_engine.Engine)
    for name in (AGENT_STORE, MEMORY_CHECK):  # the owner sets them; monkeypatch puts back what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # a single process: local rank 0
    monkeypatch.chdir(tmp_path)  # the engine's config folder lands under the default out_dir, here
    yield sglang
    for engine in fake_sglang_engine.STARTED:
        engine.port.close()
    fake_sglang_engine.STARTED.clear()


def start_on_one_rank(cfg, model_config):
    """engines.start_engine on the one-rank job, which owns its engine; as main calls it."""
    return engines.start_engine(cfg, model_config, launch.parallel_groups("cpu", 1), torch.device("cpu"))


def start(sglang, kind="Engine", **cfg):
    """An SGLangEngine (this rank owns it) whose sglang.Engine is the fake of the given kind; returns it and the
    fake."""
    sglang.Engine = getattr(fake_sglang_engine, kind)  # the fixture puts the real one back afterwards
    engine = start_on_one_rank(train.Config(engine="sglang", **cfg), tiny_config("qwen2", True))
    assert isinstance(engine, engines.SGLangEngine) and engine.engine.calls == [WARM_UP]
    engine.engine.calls.clear()
    return engine, engine.engine


# The engine's first request, made at start so that SGLang's event loop installs its signal handler before ours.
WARM_UP = ("generate", 1, {"max_new_tokens": 1})


def test_engine_processes_ignore_the_jobs_signals_and_the_trainers_handlers_come_back(sglang):
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    engine, fake = start(sglang)
    assert set(fake.signals_at_start.values()) == {signal.SIG_IGN}  # torchrun and SLURM signal every process
    assert signal.getsignal(signal.SIGTERM) is handler


def test_engine_starts_with_the_arguments_the_design_needs(sglang, tmp_path, monkeypatch):
    monkeypatch.setenv(AGENT_STORE, "True")  # as torchrun sets it
    monkeypatch.setenv("LOCAL_RANK", "4")  # the TP group's first rank, on the node's fifth GPU
    config = tiny_config("qwen3", False)
    cfg = train.Config(
        engine="sglang", engine_port=31000, mem_fraction=0.3, seed=7, out_dir=str(tmp_path / "out"), tp=2
    )
    fake = start_on_one_rank(cfg, config).engine
    kw = fake.kwargs
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True and kw["dtype"] == "bfloat16"
    assert (kw["tp_size"], kw["dp_size"], kw["base_gpu_id"]) == (2, 1, 4)
    assert kw["nccl_port"] == 31004  # --engine_port > 0: engine_port + base_gpu_id, distinct per TP group of a node
    assert kw["enable_memory_saver"] is True and kw["mem_fraction_static"] == 0.3
    assert kw["enable_fp32_lm_head"] is True  # the installed sglang has it: logits in fp32, as the trainer's
    assert os.environ[AGENT_STORE] == "False"  # or the engine's schedulers hang at start under torchrun
    # The architecture reaches the engine through config.json in model_path (load_format="dummy").
    assert os.path.dirname(kw["model_path"]) == cfg.out_dir
    written = fake.model_config
    assert written["model_type"] == "qwen3"
    for field in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
    ):
        assert written[field] == getattr(config, field), field


def test_the_engine_starts_with_sglangs_tp_memory_balance_check_off(sglang):
    """The trainer's ranks hold different shards, so the GPUs of one engine differ in free memory: sglang's check,
    on by default, would refuse to start. Its processes inherit the setting from the environment at start."""
    assert MEMORY_CHECK not in os.environ
    engine, fake = start(sglang, tp=2)
    assert fake.environ[MEMORY_CHECK] == "false"  # a value sglang's EnvBool reads as False (the contract test runs it)


def test_the_default_port_is_a_free_one_not_the_old_fixed_one(sglang, monkeypatch):
    """--engine_port 0 (the default): the port is one the system hands out, free when the engine starts, not
    30000 + LOCAL_RANK, which another program (or another job's engine) may hold."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert train.Config().engine_port == 0
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", 30001))  # the old default's port for this rank, held elsewhere
        except OSError:
            pass  # held by something on this machine already: the same situation
        engine, fake = start(sglang)  # the fake fails to start on a taken port, as sglang's rendezvous does
    port = fake.kwargs["nccl_port"]
    assert port != 30001 and fake.kwargs["base_gpu_id"] == 1
    assert fake.port.getsockname() == ("127.0.0.1", port)  # the engine holds it now


def start_engines_on_one_node(rank, world, folder, engine_port):
    """Two TP groups of one rank on one node, each starting its engine at the same time."""
    import sglang

    sglang.Engine = fake_sglang_engine.Engine  # in this forked rank only
    os.environ["LOCAL_RANK"] = str(rank)
    cfg = train.Config(engine="sglang", engine_port=engine_port, out_dir=folder)
    par = launch.parallel_groups("cpu", 1)  # dp 2: two TP groups of one rank
    engine = engines.start_engine(cfg, tiny_config("qwen2", True), par, torch.device("cpu"))
    dist.barrier()  # both engines running, each holding its port
    return engine.engine.kwargs["nccl_port"], engine.engine.kwargs["base_gpu_id"]


@pytest.mark.parametrize("engine_port", [0, 31000])
def test_two_engines_started_at_once_on_one_node_get_ports_of_their_own(tmp_path, engine_port):
    started = run_ranks(start_engines_on_one_node, 2, str(tmp_path), engine_port)
    assert [gpu for _, gpu in started] == [0, 1]
    ports = [port for port, _ in started]
    assert len(set(ports)) == 2  # a shared port: the second engine's rendezvous fails
    if engine_port:
        assert ports == [31000, 31001]  # engine_port + LOCAL_RANK


def test_engine_config_names_the_model_class(sglang, tmp_path):
    tiny = demo_config(vocab_size=103)  # as main builds it for --model tiny
    assert [type(AutoModelForCausalLM.from_config(tiny)).__name__] == tiny.architectures
    saved = AutoConfig.from_pretrained(save_reference(tmp_path / "qwen3", "qwen3", True))  # a checkpoint's config
    for config, arch in ((tiny, "Qwen2ForCausalLM"), (saved, "Qwen3ForCausalLM")):
        cfg = train.Config(engine="sglang", out_dir=str(tmp_path / "out"))
        fake = start_on_one_rank(cfg, config).engine
        assert fake.model_config.get("architectures") == [arch]


# ----------------------------------------------------------------------------- weight pushes
def push_config():
    """Big enough (~1.7 MB of bf16) that 1 MB buckets hold several tensors and a push takes two buckets."""
    return Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def expected_buckets(sizes, bound):
    """How many buckets a greedy planner closing each bucket once it holds >= bound bytes makes."""
    count, held = 0, 0
    for size in sizes:
        held += size
        if held >= bound:
            count, held = count + 1, 0
    return count + (held > 0)


def push_calls(kind, buckets, tp):
    """What a push after release_memory asks of the engine: the weights resumed, the updates (in a session from
    0.5.21), the cache flushed, then the KV cache resumed."""
    session = kind == "SessionEngine"
    return (
        [("resume", ["weights"])]
        + [("begin",)] * session
        + [("update", tp, "flattened_bucket", False)] * buckets
        + [("end",)] * session
        + [("flush_cache",), ("resume", ["kv_cache"])]
    )


def push_through_fake(rank, world, folder, dp, tp, kind):
    import sglang

    sglang.Engine = getattr(fake_sglang_engine, kind)  # in this forked rank only
    torch.multiprocessing.set_sharing_strategy("file_system")  # shared memory named after the producer's pid
    os.environ["LOCAL_RANK"] = str(rank)
    config = AutoConfig.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    par = launch.parallel_groups("cpu", tp)
    model = trainer_model(folder, par, 1)  # at --bucket_mb 1, as cfg below
    cfg = train.Config(engine="sglang", tp=tp, bucket_mb=1, out_dir=os.path.join(folder, "out"))
    owner = par.mesh["tp"].get_local_rank() == 0
    engine = engines.start_engine(cfg, config, par, torch.device("cpu"))  # on every rank, as main does
    pids = [None] * tp
    dist.all_gather_object(pids, str(os.getpid()), group=par.tp_group)
    engine.release_memory()  # as main does before the first push and after every step's rollouts
    engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
    if not owner:
        peer = isinstance(engine, engines.SGLangPeer) and not hasattr(engine, "engine")  # no sglang.Engine here
        config_written = os.path.exists(os.path.join(cfg.out_dir, f"engine_model_rank{rank}"))
        return {"peer": peer, "config_written": config_written}
    fake = engine.engine
    want = {n: p.detach().to(torch.bfloat16) for n, p in reference.named_parameters()}
    return {
        "calls": fake.calls,
        "port": fake.kwargs["nccl_port"],
        "gpu": fake.kwargs["base_gpu_id"],
        "names": [sorted(w) for w in fake.weights],
        "want_names": sorted(want),
        "exact": [all(torch.equal(w[n], t) for n, t in want.items()) for w in fake.weights],
        "dtypes": sorted({str(t.dtype) for w in fake.weights for t in w.values()}),
        "buckets": expected_buckets([t.numel() * 2 for t in want.values()], 1 << 20),
        "producers": fake.producers,
        "tp_pids": [{pid} for pid in pids],
        "offload_tags": fake.offload_tags,
    }


@pytest.mark.parametrize("kind", ["Engine", "SessionEngine"])  # 0.5.17, and 0.5.21+ with begin/end_weight_update
@pytest.mark.parametrize("dp,tp", [(1, 1), (1, 2), (2, 1)])
def test_push_delivers_every_weight_exactly_to_every_engine_tp_rank(kind, dp, tp, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(push_config()).save_pretrained(tmp_path)
    results = run_ranks(push_through_fake, dp * tp, str(tmp_path), dp, tp, kind)
    owners = [r for r in results if "calls" in r]
    assert owners == results[::tp]  # one engine per TP group, on the group's first rank
    assert [r for r in results if r not in owners] == [{"peer": True, "config_written": False}] * (dp * tp - dp)
    assert len({r["port"] for r in owners}) == dp  # each engine on a port of its own
    assert [r["gpu"] for r in owners] == [g * tp for g in range(dp)]  # base_gpu_id: the group's first local rank
    for r in owners:
        assert r["buckets"] >= 2
        assert r["names"] == [r["want_names"]] * tp and all(r["exact"]) and r["dtypes"] == ["torch.bfloat16"]
        assert r["producers"] == r["tp_pids"]  # engine TP rank i reads only the copy of trainer rank i (its GPU)
        assert r["calls"][:2] == [WARM_UP, ("release", ["kv_cache", "weights"])]
        assert r["calls"][2:] == push_calls(kind, r["buckets"], tp)
        assert not r["offload_tags"]


@pytest.mark.parametrize("kind", ["Engine", "SessionEngine"])
def test_released_memory_is_resumed_weights_first_then_kv_cache_after_the_flush(sglang, kind):
    engine, fake = start(sglang, kind)
    par = launch.parallel_groups("cpu", 1)
    cfg = train.Config(engine="sglang", bucket_mb=1)
    for step in range(2):  # two training steps, each with new weights
        torch.manual_seed(step)
        model = AutoModelForCausalLM.from_config(push_config())
        engine.release_memory()  # after the rollouts: both the KV cache and the weights
        assert [(c[0], sorted(c[1])) for c in fake.calls] == [("release", ["kv_cache", "weights"])]
        assert fake.offload_tags == {"kv_cache", "weights"}
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
        buckets = expected_buckets([p.numel() * 2 for p in model.parameters()], 1 << 20)
        assert buckets >= 2 and fake.calls[1:] == push_calls(kind, buckets, 1)
        assert not fake.offload_tags
        assert all(torch.equal(fake.weights[0][n], p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())
        engine.generate([[5, 6]], [4], 1.0, 1.0, 0, [3], seed=0)  # the fake refuses to generate from released memory
        fake.calls.clear()


def test_every_push_resumes_the_weights_so_it_must_follow_a_release(sglang):
    """begin_update resumes the weights unconditionally; sglang's scheduler dies resuming a resident tag (the
    fake raises its KeyError), which is why main releases the engine's memory before the first push too."""
    engine, fake = start(sglang)
    with pytest.raises(KeyError, match="weights"):
        engine.begin_update()
    assert fake.calls == [("resume", ["weights"])]


def test_a_failed_weight_update_raises_with_sglangs_message(sglang):
    engine, fake = start(sglang, "FailingEngine")
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", True))
    engine.release_memory()
    cfg, par = train.Config(engine="sglang"), launch.parallel_groups("cpu", 1)
    with pytest.raises(RuntimeError, match="SGLang weight update failed: boom"):
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)
    assert [c[0] for c in fake.calls] == ["release", "resume", "update"]  # the first bucket stops the push


# ----------------------------------------------------------------------------- generate
def test_generate_keeps_ids_exactly_with_the_stop_token(sglang):
    engine, fake = start(sglang, "SessionEngine")
    prompts, stop, limit = [[5, 6, 7], [8, 9], [10, 11, 12], [13]], [3, 4], 6
    outputs = engine.generate(prompts, [limit] * len(prompts), 0.7, 1.0, 0, stop, seed=1)
    [(_, n, params)] = fake.calls
    assert n == len(prompts)
    assert params == [{"temperature": 0.7, "top_p": 1.0, "max_new_tokens": limit, "stop_token_ids": stop}] * n
    raw = fake.generate(input_ids=prompts, sampling_params=params, return_logprob=True)  # deterministic
    assert len(outputs) == len(prompts)
    for (ids, logprobs, kept_ids, kept_sizes, _), o in zip(outputs, raw):
        assert ids == o["output_ids"]  # the stop token stays in
        engine_logprobs = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert torch.equal(logprobs, torch.tensor(engine_logprobs))
        assert len(kept_ids) == len(kept_sizes) == 0  # sampling not truncated: no kept sets
    # Prompt 2 sampled its stop token exactly at the limit: 0.5.17 reports "length", yet the ids end in the stop.
    assert raw[2]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(outputs[2][0]) == limit and outputs[2][0][-1] in stop


def test_greedy_decoding_with_top_k_asks_for_no_kept_sets(sglang):
    """Greedy evaluation keeps one token: --top_k reaches SGLang, and no sampling mask is asked for."""
    engine, fake = start(sglang, "SessionEngine")
    engine.generate([[5, 6, 7]], [4], 0.0, 1.0, 20, [3], seed=0)
    [(_, _, params)] = fake.calls
    assert params == [{"temperature": 0.0, "top_p": 1.0, "top_k": 20, "max_new_tokens": 4, "stop_token_ids": [3]}]


def generate_with_routing(rank, world, out_dir, top_p, routing_replay):
    """SGLangEngine.generate on the fake with --routing_replay, the hub's Qwen3-MoE config, routing_from per prompt;
    the engine's start-up arguments and the outputs. In a rank of its own: top_p < 1 sends sglang's io_struct
    request, whose import needs tests/sglang_cpu_stubs' torchvision, kept out of the test process."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_cpu_stubs"))
    import sglang

    sglang.Engine = fake_sglang_engine.SessionEngine
    cfg = train.Config(engine="sglang", routing_replay=routing_replay, out_dir=out_dir)
    engine = start_on_one_rank(cfg, text_config("qwen3_moe"))
    outputs = None
    if routing_replay != "off":
        top_k = 0 if top_p == 1 else 50  # sglang's sampling masks want a top_k, as train.generate_turn gives them
        outputs = engine.generate(PROMPTS, [4, 4, 4], 1.0, top_p, top_k, [3], seed=0, routing_from=ROUTING_FROM)
    engine.engine.port.close()
    return engine.engine.kwargs, outputs


PROMPTS, ROUTING_FROM = [[5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17]], [2, 4, 1]


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # Engine.generate, and the request that asks for sampling masks
def test_routing_replay_gets_each_prompts_experts_from_sglang_from_its_own_first_position(top_p, tmp_path):
    """--routing_replay: the engine starts with SGLang's capturer of routed experts; a batch asks for them from the
    least of its prompts' routing_from (sglang takes one start per request), and each prompt keeps its own positions,
    from its routing_from to its last token but one, decoded from base64 int32 as the experts SGLang chose there."""
    kwargs, outputs = run_ranks(generate_with_routing, 1, str(tmp_path), top_p, "measure")[0]
    assert kwargs["enable_return_routed_experts"] is True
    experts = text_config("qwen3_moe").num_experts
    for i, (prompt, start, (ids, *_, routing)) in enumerate(zip(PROMPTS, ROUTING_FROM, outputs)):
        assert routing.dtype == torch.uint8
        expected = [
            [[fake_sglang_engine.ROUTED(i, p, layer, c, experts) for c in range(2)] for layer in range(2)]
            for p in range(start, len(prompt) + len(ids) - 1)
        ]
        assert routing.tolist() == expected
    kwargs, _ = run_ranks(generate_with_routing, 1, str(tmp_path), top_p, "off")[0]
    assert "enable_return_routed_experts" not in kwargs


def routing_through_sglangs_own_code(rank, world, starts):
    """Per start: the routed experts sglang's capturer takes out of its host buffer for a request of 9 tokens
    (BaseTopkCapturer.get_topk, the sequence's KV slots scattered), encoded as its detokenizer sends them and
    decoded by engines.routed_experts; with the buffer's rows of the request's positions. In a rank of its own, the
    stubs' torchvision kept out of the test process."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_cpu_stubs"))
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    config = text_config("qwen3_moe")
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:9]  # the request's tokens' KV slots
    buffer = torch.randint(0, config.num_experts, (32, config.num_hidden_layers, config.num_experts_per_tok))
    capturer = BaseTopkCapturer.__new__(BaseTopkCapturer)  # its host buffer alone: no device, no model
    capturer.host_cache = types.SimpleNamespace(buffer=buffer.int())
    pool = types.SimpleNamespace(req_to_token=torch.stack([torch.zeros(9, dtype=torch.long), slots]))
    results = []
    for start in starts:
        [encoded] = DetokenizerManager._b64_encode_per_request([capturer.get_topk(1, 9, pool, start)])
        results.append((engines.routed_experts(encoded, config), buffer[slots]))
    return results


def test_routed_experts_are_decoded_as_sglang_slices_and_encodes_them():
    """sglang 0.5.23's own code: a request's experts from routed_experts_start_len to its last token but one, in the
    order of its positions, come back exactly, as the trainer's uint8."""
    for start, (decoded, rows) in zip([0, 3, 8], run_ranks(routing_through_sglangs_own_code, 1, [0, 3, 8])[0]):
        assert decoded.dtype == torch.uint8 and torch.equal(decoded.long(), rows[start:8])


def start_on_a_tp_group_of_two(rank, world, out_dir):
    """start_engine on both ranks of one TP group; what the rank that does not own the engine got and did."""
    import sglang

    sglang.Engine = fake_sglang_engine.Engine  # in this forked rank only
    os.environ["LOCAL_RANK"] = str(rank)
    par = launch.parallel_groups("cpu", 2)
    engine = engines.start_engine(
        train.Config(engine="sglang", tp=2, out_dir=out_dir), tiny_config("qwen2", True), par, torch.device("cpu")
    )
    if rank == 0:
        engine.engine.port.close()
        return None
    for step in (engine.release_memory, engine.begin_update, engine.end_update, engine.shutdown):
        step()
    config_written = os.path.exists(os.path.join(out_dir, f"engine_model_rank{rank}"))
    return type(engine), hasattr(engine, "engine"), fake_sglang_engine.STARTED, config_written


def test_a_rank_that_does_not_own_the_engine_starts_nothing(tmp_path):
    """Every rank of the job calls start_engine (the port and the barrier are collective); only the owner starts
    sglang and writes the engine's config. The others get an SGLangPeer, whose steps do nothing."""
    kind, has_engine, started, config_written = run_ranks(start_on_a_tp_group_of_two, 2, str(tmp_path / "out"))[1]
    assert kind is engines.SGLangPeer and not has_engine and not started and not config_written


def generate_with_a_stop_due(rank, world, out_dir, top_p):
    """SGLangEngine.generate on the fake (3 s of the engine's time a call) while a stop leaves no time to end the
    step: in the rollouts (what it returns, how long it took, the fake's last call), then outside them. In a rank
    of its own: top_p < 1 sends sglang's io_struct request, whose import needs the stubs' torchvision."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_cpu_stubs"))
    import sglang
    from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: F401 (imported before the clock starts)

    sglang.Engine = fake_sglang_engine.Engine
    engine = start_on_one_rank(train.Config(engine="sglang", out_dir=out_dir), tiny_config("qwen2", True))
    engine.engine.generate_seconds = 3.0
    stopping.STOP.listen(30.0, out_dir, speaks=False, install=False)
    stopping.STOP.ask("SIGTERM")  # no step has ended in this process yet: the rollouts are given up at once
    began = time.monotonic()
    top_k = 0 if top_p == 1 else 50  # Engine.generate, or the request that asks for kept sets
    given_up = stopping.STOP.interruptible(engine.generate, PROMPTS, [4, 4, 4], 1.0, top_p, top_k, [3], 0)
    seconds, calls = time.monotonic() - began, list(engine.engine.calls)
    outputs = engine.generate(PROMPTS, [4, 4, 4], 1.0, top_p, top_k, [3], seed=0)  # not in the rollouts: evaluation
    engine.engine.port.close()
    return given_up, seconds, calls, [len(ids) for ids, *_ in outputs]


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # Engine.generate, and the request that asks for sampling masks
def test_a_stop_due_during_generation_aborts_the_engines_requests_and_gives_up_the_rollouts(tmp_path, top_p):
    """Every request is aborted (abort_request(abort_all=True), looked for every second while SGLang's event loop
    runs them) and the rollouts are given up (stopping.Interrupted) a second in; outside the rollouts the same call
    returns whole."""
    given_up, seconds, calls, lengths = run_ranks(generate_with_a_stop_due, 1, str(tmp_path), top_p)[0]
    assert given_up is None and 0.9 < seconds < 2.5
    assert ("abort_request", "", True) in calls
    assert lengths == [3, 4, 4]


# ----------------------------------------------------------------------------- config
def test_sglang_engine_without_a_gpu_says_to_use_the_hf_engine(sglang):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="--engine hf"):
        flags.check_config(train.Config(engine="sglang"), 1)


# ----------------------------------------------------------------------------- teardown
TEARDOWN = """
import sys, psutil, sglang, wandb
import torch.distributed as dist
import torch
import engines, fake_sglang_engine, launch, reward, sandbox, train
from test_parallel import tiny_config
sglang.Engine = fake_sglang_engine.SessionEngine
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # as main without torchrun
workers = sandbox.RewardWorkers(reward.reward_fn, 2, timeout=5.0)
print("scores", workers.score(["a", "b"], [{"task": "toy", "target": "a"}] * 2)[0])  # idle, waiting on the pool
run = wandb.init(project="teardown", mode="offline", dir=sys.argv[1])  # its service is a child of this process
par = launch.parallel_groups("cpu", 1)
engine = engines.start_engine(train.Config(engine="sglang", out_dir=sys.argv[1]), tiny_config("qwen2", True), par,
                              torch.device("cpu"))
launch.shut_down(engine, workers, run)
print("children left", psutil.Process().children(recursive=True))
"""


def test_shutdown_with_sglangs_kill_of_every_child_neither_hangs_nor_leaves_a_process_or_loses_wandb(tmp_path):
    """sglang's shutdown SIGKILLs every child of the trainer: done first, it kills an idle reward worker holding the
    pool's lock (the pool's close then hangs forever) and wandb's service (its finish() then raises)."""
    import subprocess
    import sys

    import psutil

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]), WANDB_SILENT="true")
    process = subprocess.Popen(
        [sys.executable, "-c", TEARDOWN, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:  # a hung shutdown leaves the pool's respawned workers behind (each in its own session): end them too
        for leftover in psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []:
            leftover.kill()
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    assert "scores [1.0, 0.0]" in stdout and "children left []" in stdout
    [run_file] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert run_file.stat().st_size > 0


def score_rows_holding_tensors_after_sglangs_patch(rank, world):
    from multiprocessing.reduction import ForkingPickler

    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    import reward
    import sandbox

    monkey_patch_torch_reductions()  # as on a GPU, in the trainer's process
    try:
        ForkingPickler.dumps(torch.zeros(2))
        patch_breaks_cpu_tensors = False
    except IndexError:
        patch_breaks_cpu_tensors = True
    workers = sandbox.RewardWorkers(reward.reward_fn, 1, timeout=5.0)
    try:
        return patch_breaks_cpu_tensors, workers.score(["a"], [{"task": "toy", "target": "a", "ids": torch.ones(3)}])
    finally:
        workers.close()


def test_reward_workers_take_rows_holding_cpu_tensors_after_sglangs_cuda_ipc_patch():
    [(patch_breaks_cpu_tensors, (scores, errors))] = run_ranks(score_rows_holding_tensors_after_sglangs_patch, 1)
    assert patch_breaks_cpu_tensors  # multiprocessing's own pickling of a CPU tensor fails once patched
    assert (scores, errors) == ([1.0], [])
