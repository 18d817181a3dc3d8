"""The real SGLang engine on one GPU, in this process: weights pushed from the FSDP policy reach it (its logprobs
match the trainer's), a second push replaces them, and released memory really goes back to the GPU and returns.
Skipped without a CUDA GPU and sglang. Run with `pytest -s tests/test_engine_sglang_gpu.py` to see the numbers."""

import dataclasses
import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

import checkpoint
import engines
import launch
import train

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None),
    reason="needs a CUDA GPU and sglang (pip install -r requirements.txt)",
)

GiB = 1 << 30
# bf16 engine against the trainer's bf16 compute (fp32 master weights): per-token logprobs differ by rounding only.
MEAN_TOL, MAX_TOL = 0.05, 0.5


def gpu_config():
    # head_dim 128, as in Qwen models, which every attention backend supports. initializer_range 0.05 gives
    # logits of std ~1, so the distributions are far from uniform and a stale push shows up clearly.
    return Qwen2Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )


def rollout(engine, cfg, prompts):
    budgets = [cfg.max_new_tokens] * len(prompts)
    outputs = engine.generate(prompts, budgets, cfg.temperature, cfg.top_p, cfg.top_k, [2], seed=0)
    samples = []
    for prompt, (ids, logprobs, kept_ids, kept_sizes, _) in zip(prompts, outputs):
        sample = train.Sample(prompt, response_ids=ids, sampled=[True] * len(ids), engine_logprobs=logprobs)
        sample.kept_ids, sample.kept_sizes = kept_ids, kept_sizes
        samples.append(sample)
    return samples


def mismatch(model, samples, cfg, tp_mesh):
    with torch.no_grad():
        trainer, _, _, _ = train.response_logprobs(model, samples, cfg, tp_mesh)
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 leaves root parameters unsharded after a forward; the push and the edits below
        # must see the sharded fp32 masters
    engine = torch.cat([s.engine_logprobs for s in samples]).to(trainer.device)
    diff = (trainer.float() - engine).abs()
    return diff.mean().item(), diff.max().item()


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_sglang_engine_takes_pushed_weights_and_gives_memory_back(tmp_path):
    created_group = not dist.is_initialized()
    device = torch.device("cuda", 0)
    if created_group:  # as main without torchrun: one process, NCCL for CUDA tensors, gloo for the rest
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1, store=dist.HashStore(), device_id=device)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(gpu_config())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    reference.save_pretrained(tmp_path / "model")
    config = AutoConfig.from_pretrained(tmp_path / "model")  # a checkpoint's config names its class, as SGLang needs
    par = launch.parallel_groups("cuda", 1)
    model = train.build_model(config, par.mesh, device)
    load_cfg = train.Config(model=str(tmp_path / "model"))
    checkpoint.load_weights([model], checkpoint.weight_files(load_cfg.model), load_cfg, config, par.world_group)
    cfg = train.Config(
        engine="sglang",
        out_dir=str(tmp_path),
        mem_fraction=0.3,
        max_new_tokens=64,
        temperature=1.0,
        top_p=1.0,
        bucket_mb=1,
    )  # engine_port 0: a free port
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14, 20) * 4]
    free_before = free_bytes()
    engine = engines.start_engine(cfg, config, par, device)  # this one-rank job owns the engine

    def push():  # as main
        engines.push_weights(model, engine, cfg.bucket_mb, par.tp_group)

    try:
        assert os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "false"
        engine.release_memory()  # as main: the first push, as every other, finds the engine's memory released
        timer = time.perf_counter()
        # ~4 MB of bf16: several 1 MB buckets
        push()
        push_s = time.perf_counter() - timer
        samples = rollout(engine, cfg, prompts)
        first = mismatch(model, samples, cfg, par.mesh["tp"])
        print(
            f"\npush {push_s:.3f}s; first push: mean |dlogp| {first[0]:.4f}, max {first[1]:.4f} "
            f"over {sum(len(s.response_ids) for s in samples)} tokens"
        )
        assert first[0] < MEAN_TOL and first[1] < MAX_TOL
        # Top-p sampling (with train.py's bound on top_k): SGLang's kept sets and renormalised log-probs against the
        # trainer's renormalised over the same sets, and against its full-vocabulary ones (the bias before).
        truncated = dataclasses.replace(cfg, top_p=0.9, top_k=engines.MAX_KEPT)
        samples = rollout(engine, truncated, prompts)
        renormalised, full = [mismatch(model, samples, c, par.mesh["tp"]) for c in (truncated, cfg)]
        print(
            f"top_p 0.9: mean |dlogp| {renormalised[0]:.4f}, max {renormalised[1]:.4f}; full vocabulary {full[0]:.4f}"
        )
        assert renormalised[0] < MEAN_TOL and renormalised[1] < MAX_TOL and full[0] > 3 * renormalised[0]

        # New weights: noise on every master shard. The old policy stays around, unsharded in bf16, to show what a
        # stale push would look like.
        old = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
        old.load_state_dict(state)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.add_(torch.randn_like(local) * 0.05)
        engine.release_memory()
        push()
        samples = rollout(engine, cfg, prompts)
        second, stale = mismatch(model, samples, cfg, par.mesh["tp"]), mismatch(old, samples, cfg, par.mesh["tp"])
        print(
            f"second push: mean {second[0]:.4f}, max {second[1]:.4f}; against the old policy (a stale push): "
            f"mean {stale[0]:.4f}, max {stale[1]:.4f}"
        )
        assert second[0] < MEAN_TOL and second[1] < MAX_TOL
        assert stale[0] > 5 * max(second[0], 0.01)
        del old

        # Release: weights and KV cache go back to the GPU. The push's begin_update / end_update take them again.
        static = cfg.mem_fraction * free_before  # sglang's weights + KV cache budget at start
        free_running = free_bytes()
        engine.release_memory()
        free_released = free_bytes()
        push()
        free_resumed = free_bytes()
        freed, taken = free_released - free_running, free_released - free_resumed
        print(
            f"free before the engine {free_before / GiB:.2f} GiB; static budget ~{static / GiB:.2f} GiB; "
            f"release freed {freed / GiB:.2f} GiB; resume took {taken / GiB:.2f} GiB"
        )
        assert freed > 256 << 20 and freed > 0.8 * static
        assert taken > 0.8 * freed
        # Weights pushed after the resume are live.
        third = mismatch(model, rollout(engine, cfg, prompts), cfg, par.mesh["tp"])
        print(f"after release and resume: mean {third[0]:.4f}, max {third[1]:.4f}")
        assert third[0] < MEAN_TOL and third[1] < MAX_TOL
    finally:
        engine.shutdown()
        if created_group:
            dist.destroy_process_group()
