"""SGLangEngine against the real sglang package with only sglang.Engine faked (tests/fake_sglang_engine.py): the
engine cannot start on a CPU, so it alone is replaced and the trainer's code runs unchanged. The fakes follow the
0.5.17 / 0.5.23 API in tests/sglang_api.md: start-up arguments, weight pushes as flattened bf16 buckets (one
serialized payload per engine TP rank), the 0.5.21+ weight-update session, memory release / resume bookkeeping, the
output format of generate, and shutdown's SIGKILL of every child process."""
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3Config

pytest.importorskip("sglang.srt.utils", reason="needs sglang: pip install --no-deps -r requirements-sglang-cpu.txt")
import fake_sglang_engine  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
from test_parallel import save_reference, sharded_model, tiny_config  # noqa: E402
from workers import run_ranks  # noqa: E402

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


@pytest.fixture
def sglang(monkeypatch, tmp_path):
    """The real sglang, whose Engine a test swaps for a fake (undone after); the environment and the working
    folder restored after."""
    import sglang
    monkeypatch.setattr(sglang, "Engine", fake_sglang_engine.Engine)
    monkeypatch.setenv(AGENT_STORE, "")  # SGLangEngine sets it to "False"; monkeypatch puts back what was there
    monkeypatch.delenv(AGENT_STORE)
    monkeypatch.chdir(tmp_path)  # the engine's config folder lands under the default out_dir, here
    yield sglang


def start(sglang, kind="Engine", **cfg):
    """An SGLangEngine whose sglang.Engine is the fake of the given kind; returns it and the fake."""
    sglang.Engine = getattr(fake_sglang_engine, kind)  # the fixture puts the real one back afterwards
    engine = train.SGLangEngine(train.Config(engine="sglang", **cfg), tiny_config("qwen2", True))
    assert engine.engine.calls == [WARM_UP]
    engine.engine.calls.clear()
    return engine, engine.engine


# The engine's first request, made at start so that SGLang's event loop installs its signal handler before ours.
WARM_UP = ("generate", 1, {"max_new_tokens": 1})


def test_engine_processes_ignore_the_jobs_signals_and_the_trainers_handlers_come_back(sglang):
    import signal
    handler = signal.getsignal(signal.SIGTERM)
    engine, fake = start(sglang)
    assert set(fake.signals_at_start.values()) == {signal.SIG_IGN}  # torchrun signals whole process groups
    assert signal.getsignal(signal.SIGTERM) is handler


def test_engine_starts_with_the_arguments_the_design_needs(sglang, tmp_path, monkeypatch):
    monkeypatch.setenv(AGENT_STORE, "True")  # as torchrun sets it
    monkeypatch.setenv("LOCAL_RANK", "4")  # the TP group's first rank, on the node's fifth GPU
    config = tiny_config("qwen3", False)
    cfg = train.Config(engine_port=31000, mem_fraction=0.3, seed=7, out_dir=str(tmp_path / "out"), tp=2)
    fake = train.SGLangEngine(cfg, config).engine
    kw = fake.kwargs
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True and kw["dtype"] == "bfloat16"
    assert (kw["tp_size"], kw["dp_size"], kw["base_gpu_id"]) == (2, 1, 4)
    assert kw["nccl_port"] == 31004  # engine_port + base_gpu_id: distinct for each TP group of a node
    assert kw["enable_memory_saver"] is True and kw["mem_fraction_static"] == 0.3
    assert os.environ[AGENT_STORE] == "False"  # or the engine's schedulers hang at start under torchrun
    # The architecture reaches the engine through config.json in model_path (load_format="dummy").
    assert os.path.dirname(kw["model_path"]) == cfg.out_dir
    written = fake.model_config
    assert written["model_type"] == "qwen3"
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "tie_word_embeddings"):
        assert written[field] == getattr(config, field), field


def test_engine_config_names_the_model_class(sglang, tmp_path):
    tiny = Qwen2Config(vocab_size=103, **reward.TINY_MODEL)  # as main builds it for --model tiny
    assert [type(AutoModelForCausalLM.from_config(tiny)).__name__] == tiny.architectures
    saved = AutoConfig.from_pretrained(save_reference(tmp_path / "qwen3", "qwen3", True))  # a checkpoint's config
    for config, arch in ((tiny, "Qwen2ForCausalLM"), (saved, "Qwen3ForCausalLM")):
        cfg = train.Config(out_dir=str(tmp_path / "out"))
        fake = train.SGLangEngine(cfg, config).engine
        assert fake.model_config.get("architectures") == [arch]


# ----------------------------------------------------------------------------- weight pushes
def push_config():
    """Big enough (~1.7 MB of bf16) that 1 MB buckets hold several tensors and a push takes two buckets."""
    return Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                       tie_word_embeddings=False)


def expected_buckets(sizes, bound):
    """How many buckets a greedy planner closing each bucket once it holds >= bound bytes makes."""
    count, held = 0, 0
    for size in sizes:
        held += size
        if held >= bound:
            count, held = count + 1, 0
    return count + (held > 0)


def push_through_fake(rank, world, folder, dp, tp, kind):
    import sglang
    sglang.Engine = getattr(fake_sglang_engine, kind)  # in this forked rank only
    torch.multiprocessing.set_sharing_strategy("file_system")  # shared memory named after the producer's pid
    os.environ["LOCAL_RANK"] = str(rank)
    config = AutoConfig.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = sharded_model(folder, mesh)
    cfg = train.Config(engine="sglang", tp=tp, bucket_mb=1)
    engine = train.SGLangEngine(cfg, config) if mesh["tp"].get_local_rank() == 0 else None
    pids = [None] * tp
    torch.distributed.all_gather_object(pids, str(os.getpid()), group=mesh["tp"].get_group())
    train.push_weights(model, engine, cfg, mesh["tp"].get_group())
    if engine is None:
        return None
    fake = engine.engine
    want = {n: p.detach().to(torch.bfloat16) for n, p in reference.named_parameters()}
    return {"calls": fake.calls, "port": fake.kwargs["nccl_port"], "gpu": fake.kwargs["base_gpu_id"],
            "names": [sorted(w) for w in fake.weights], "want_names": sorted(want),
            "exact": [all(torch.equal(w[n], t) for n, t in want.items()) for w in fake.weights],
            "dtypes": sorted({str(t.dtype) for w in fake.weights for t in w.values()}),
            "buckets": expected_buckets([t.numel() * 2 for t in want.values()], 1 << 20),
            "producers": fake.producers, "tp_pids": [{pid} for pid in pids]}


@pytest.mark.parametrize("kind", ["Engine", "SessionEngine"])  # 0.5.17, and 0.5.21+ with begin/end_weight_update
@pytest.mark.parametrize("dp,tp", [(1, 1), (1, 2), (2, 1)])
def test_push_delivers_every_weight_exactly_to_every_engine_tp_rank(sglang, kind, dp, tp, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(push_config()).save_pretrained(tmp_path)
    results = run_ranks(push_through_fake, dp * tp, str(tmp_path), dp, tp, kind)
    owners = [r for r in results if r is not None]
    assert len(owners) == dp  # one engine per TP group, on the group's first rank
    assert sorted(r["port"] for r in owners) == sorted(30000 + r["gpu"] for r in owners)
    assert [r["gpu"] for r in owners] == [g * tp for g in range(dp)]  # base_gpu_id: the group's first local rank
    for r in owners:
        assert r["buckets"] >= 2
        assert r["names"] == [r["want_names"]] * tp and all(r["exact"]) and r["dtypes"] == ["torch.bfloat16"]
        assert r["producers"] == r["tp_pids"]  # engine TP rank i reads only the copy of trainer rank i (its GPU)
        assert r["calls"][0] == WARM_UP
        calls = r["calls"][1:]
        kinds = [c[0] for c in calls]
        updates = [i for i, k in enumerate(kinds) if k == "update"]
        assert [calls[i] for i in updates] == [("update", tp, "flattened_bucket", False)] * r["buckets"]
        assert kinds.count("flush_cache") == 1 and kinds.index("flush_cache") > updates[-1]
        assert "resume" not in kinds and "release" not in kinds
        if kind == "SessionEngine":
            assert kinds.count("begin") == kinds.count("end") == 1
            assert kinds.index("begin") < updates[0] and kinds.index("end") > updates[-1]


def payloads_of(n):
    """n buckets of one tensor each, serialized for a one-rank engine as train.sglang_payloads does."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    buckets = [FlattenedTensorBucket(named_tensors=[(f"w{i}", torch.full((2, 3), float(i), dtype=torch.bfloat16))])
               for i in range(n)]
    return [[MultiprocessingSerializer.serialize({"flattened_tensor": b.get_flattened_tensor(),
                                                  "metadata": b.get_metadata()}, output_str=True)] for b in buckets]


@pytest.mark.parametrize("kind", ["Engine", "SessionEngine"])
def test_released_memory_is_resumed_weights_first_then_kv_cache_after_the_flush(sglang, kind):
    engine, fake = start(sglang, kind)
    for _ in range(2):  # two training steps
        engine.release_memory()
        engine.update_weights(iter(payloads_of(3)))  # push_weights hands over a generator
        kinds = [c[0] for c in fake.calls]
        updates = [i for i, k in enumerate(kinds) if k == "update"]
        assert fake.calls[0] == ("release", ["kv_cache", "weights"])
        resumes = [(i, c[1]) for i, c in enumerate(fake.calls) if c[0] == "resume"]
        assert [tags for _, tags in resumes] == [["weights"], ["kv_cache"]]
        assert resumes[0][0] < updates[0] and resumes[1][0] > kinds.index("flush_cache") > updates[-1]
        assert not fake.offload_tags
        engine.generate([[5, 6]], 1.0, 1.0, [4], [3], seed=0)  # the fake refuses to generate from released memory
        fake.calls.clear()


def test_without_a_release_nothing_is_resumed(sglang):
    engine, fake = start(sglang)
    engine.update_weights(payloads_of(2))
    engine.update_weights(payloads_of(2))  # the fake raises KeyError, as sglang does, on resuming a resident tag
    assert [c[0] for c in fake.calls] == ["update", "update", "flush_cache"] * 2
    assert fake.weights[0]["w1"].tolist() == [[1.0] * 3] * 2


def test_a_failed_weight_update_raises_with_sglangs_message(sglang):
    engine, fake = start(sglang, "FailingEngine")
    with pytest.raises(RuntimeError, match="boom"):
        engine.update_weights(payloads_of(2))


# ----------------------------------------------------------------------------- generate
def test_generate_keeps_ids_exactly_with_the_stop_token(sglang):
    engine, fake = start(sglang, "SessionEngine")
    prompts, stop, limit = [[5, 6, 7], [8, 9], [10, 11, 12], [13]], [3, 4], 6
    samples = engine.generate(prompts, 0.7, 0.9, [limit] * len(prompts), stop, seed=1)
    [(_, n, params)] = fake.calls
    assert n == len(prompts)
    assert params == [{"temperature": 0.7, "top_p": 0.9, "max_new_tokens": limit, "stop_token_ids": stop}] * n
    raw = fake.generate(input_ids=prompts, sampling_params=params, return_logprob=True)  # deterministic
    for prompt, s, o in zip(prompts, samples, raw):
        assert s.prompt_ids == prompt and s.response_ids == o["output_ids"]  # the stop token stays in
        engine_logprobs = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert torch.equal(s.engine_logprobs, torch.tensor(engine_logprobs))
    # Prompt 2 sampled its stop token exactly at the limit: 0.5.17 reports "length", yet the ids end in the stop.
    assert raw[2]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(samples[2].response_ids) == limit and samples[2].response_ids[-1] in stop


# ----------------------------------------------------------------------------- config
def test_sglang_engine_without_a_gpu_says_to_use_the_hf_engine(sglang):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="--engine hf"):
        train.check_config(train.Config(engine="sglang"), 1)


# ----------------------------------------------------------------------------- teardown
TEARDOWN = """
import sys, psutil, sglang, wandb
import fake_sglang_engine, reward, train
from test_parallel import tiny_config
sglang.Engine = fake_sglang_engine.SessionEngine
workers = reward.RewardWorkers(2, timeout=5.0)
print("scores", workers.score(["a", "b"], [{"task": "toy", "target": "a"}] * 2)[0])  # idle, waiting on the pool
run = wandb.init(project="teardown", mode="offline", dir=sys.argv[1])  # its service is a child of this process
engine = train.SGLangEngine(train.Config(engine="sglang", out_dir=sys.argv[1]), tiny_config("qwen2", True))
train.shut_down(engine, workers, run)
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
    process = subprocess.Popen([sys.executable, "-c", TEARDOWN, str(tmp_path)], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    monkey_patch_torch_reductions()  # as on a GPU, in the trainer's process
    try:
        ForkingPickler.dumps(torch.zeros(2))
        patch_breaks_cpu_tensors = False
    except IndexError:
        patch_breaks_cpu_tensors = True
    workers = reward.RewardWorkers(1, timeout=5.0)
    try:
        return patch_breaks_cpu_tensors, workers.score(["a"], [{"task": "toy", "target": "a", "ids": torch.ones(3)}])
    finally:
        workers.close()


def test_reward_workers_take_rows_holding_cpu_tensors_after_sglangs_cuda_ipc_patch():
    [(patch_breaks_cpu_tensors, (scores, errors))] = run_ranks(score_rows_holding_tensors_after_sglangs_patch, 1)
    assert patch_breaks_cpu_tensors  # multiprocessing's own pickling of a CPU tensor fails once patched
    assert (scores, errors) == ([1.0], [])
