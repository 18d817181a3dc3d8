"""The real SGLang engine on one GPU, in this process: weights pushed from the FSDP policy reach it (its logprobs
match the trainer's), a second push replaces them, and released memory really goes back to the GPU and returns.
Skipped without a CUDA GPU and sglang. Run with `pytest -s tests/test_engine_sglang_gpu.py` to see the numbers."""
import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

import train
from workers import free_port

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None),
    reason="needs a CUDA GPU and sglang (pip install -r requirements.txt)")

GiB = 1 << 30
# bf16 engine against the trainer's bf16 compute (fp32 master weights): per-token logprobs differ by rounding only.
MEAN_TOL, MAX_TOL = 0.05, 0.5


def gpu_config():
    # head_dim 128, as in Qwen models, which every attention backend supports. initializer_range 0.05 gives
    # logits of std ~1, so the distributions are far from uniform and a stale push shows up clearly.
    return Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=True, initializer_range=0.05)


def rollout(engine, cfg, prompts):
    samples = engine.generate(prompts, cfg.temperature, cfg.top_p, [cfg.max_new_tokens] * len(prompts), [2], seed=0)
    for prompt, s in zip(prompts, samples):
        s.prompt_ids = prompt
    return samples


def mismatch(model, samples, cfg, tp_mesh):
    with torch.no_grad():
        trainer, _ = train.response_logprobs(model, samples, cfg, tp_mesh, pad_id=0)
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 leaves root parameters unsharded after a forward; the push and the edits below
        # must see the sharded fp32 masters
    engine = torch.tensor([lp for s in samples for lp in s.engine_logprobs], device=trainer.device)
    diff = (trainer.float() - engine).abs()
    return diff.mean().item(), diff.max().item()


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_sglang_engine_takes_pushed_weights_and_gives_memory_back(tmp_path):
    created_group = not dist.is_initialized()
    if created_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(gpu_config())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    reference.save_pretrained(tmp_path / "model")
    config = AutoConfig.from_pretrained(tmp_path / "model")  # a checkpoint's config names its class, as SGLang needs
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp"))
    model = train.build_model(config, mesh, device)
    load_cfg = train.Config(model=str(tmp_path / "model"))
    train.load_weights([model], train.weight_files(load_cfg), load_cfg, config)
    cfg = train.Config(engine="sglang", out_dir=str(tmp_path), mem_fraction=0.3, engine_port=free_port(),
                       max_new_tokens=64, temperature=1.0, top_p=1.0, bucket_mb=1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14, 20) * 4]
    free_before = free_bytes()
    engine = train.SGLangEngine(cfg, config)
    try:
        timer = time.perf_counter()
        # ~4 MB of bf16: several 1 MB buckets
        train.push_weights(model, engine, cfg, mesh["tp"].get_group())
        push_s = time.perf_counter() - timer
        samples = rollout(engine, cfg, prompts)
        first = mismatch(model, samples, cfg, mesh["tp"])
        print(f"\npush {push_s:.3f}s; first push: mean |dlogp| {first[0]:.4f}, max {first[1]:.4f} "
              f"over {sum(len(s.response_ids) for s in samples)} tokens")
        assert first[0] < MEAN_TOL and first[1] < MAX_TOL

        # New weights: noise on every master shard. The old policy stays around, unsharded in bf16, to show what a
        # stale push would look like.
        old = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
        old.load_state_dict(state)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.add_(torch.randn_like(local) * 0.05)
        train.push_weights(model, engine, cfg, mesh["tp"].get_group())
        samples = rollout(engine, cfg, prompts)
        second, stale = mismatch(model, samples, cfg, mesh["tp"]), mismatch(old, samples, cfg, mesh["tp"])
        print(f"second push: mean {second[0]:.4f}, max {second[1]:.4f}; against the old policy (a stale push): "
              f"mean {stale[0]:.4f}, max {stale[1]:.4f}")
        assert second[0] < MEAN_TOL and second[1] < MAX_TOL
        assert stale[0] > 5 * max(second[0], 0.01)
        del old

        # Release: weights and KV cache go back to the GPU. Resume (inside update_weights) takes them again.
        static = cfg.mem_fraction * free_before  # sglang's weights + KV cache budget at start
        free_running = free_bytes()
        engine.release_memory()
        free_released = free_bytes()
        train.push_weights(model, engine, cfg, mesh["tp"].get_group())
        free_resumed = free_bytes()
        freed, taken = free_released - free_running, free_released - free_resumed
        print(f"free before the engine {free_before / GiB:.2f} GiB; static budget ~{static / GiB:.2f} GiB; "
              f"release freed {freed / GiB:.2f} GiB; resume took {taken / GiB:.2f} GiB")
        assert freed > 256 << 20 and freed > 0.8 * static
        assert taken > 0.8 * freed
        # Weights pushed after the resume are live.
        third = mismatch(model, rollout(engine, cfg, prompts), cfg, mesh["tp"])
        print(f"after release and resume: mean {third[0]:.4f}, max {third[1]:.4f}")
        assert third[0] < MEAN_TOL and third[1] < MAX_TOL
    finally:
        engine.engine.shutdown()
        if created_group:
            dist.destroy_process_group()
