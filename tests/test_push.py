"""The weight push, phase by phase, on gloo ranks: each rank casts its shard before the gather, so a bf16 push gathers
half the bytes of an fp32 one with the same bits; the ranks without an engine gather a bucket only after the engine's
rank has loaded the one before; and nothing of the push is left referenced, nor the GPU's cache held, when the
engine takes its KV cache back."""

import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engines
import launch
from test_parallel import save_reference, sharded_model
from workers import run_ranks


class GatheredBytes(TorchDispatchMode):
    """Bytes that all-gathers bring in on this rank (the output of each all_gather_into_tensor), and when each began."""

    def __init__(self):
        super().__init__()
        self.bytes, self.starts = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            shard, group_size = args[0], args[1]
            self.bytes += shard.numel() * shard.element_size() * group_size
            self.starts.append(time.monotonic())
        return func(*args, **(kwargs or {}))


def gathered(rank, world, folder, tp):
    """This rank's bf16 buckets and gathered bytes: the trainer's way (cast, then gather) and the old way (gather
    fp32, then cast)."""
    par = launch.parallel_groups("cpu", tp)
    model = sharded_model(folder, par)
    with GatheredBytes() as new:
        buckets = engines.weight_buckets(engines.full_weights(model, torch.bfloat16), 1 << 20)
        pushed = [(n, t) for bucket in buckets for n, t in bucket]
    with GatheredBytes() as old:
        reference = [(n, p.full_tensor().to(torch.bfloat16)) for n, p in model.named_parameters()]
    same = [n for (n, a), (m, b) in zip(pushed, reference) if n == m and a.dtype == b.dtype and torch.equal(a, b)]
    return len(same), len(reference), new.bytes, old.bytes


@pytest.mark.parametrize("tp", [1, 2])  # dp 2 (FSDP shards gathered), or tp 2 (TP shards gathered)
def test_a_bf16_push_gathers_half_the_bytes_of_fp32_with_bit_identical_tensors(tmp_path, tp):
    folder = save_reference(tmp_path, "qwen3", False)
    for same, total, new_bytes, old_bytes in run_ranks(gathered, 2, folder, tp):
        assert same == total  # every tensor, name by name, bit for bit
        assert old_bytes > 0 and new_bytes * 2 == old_bytes


class SlowLoads(engines.Engine):
    """An engine whose owner takes 0.2 s to load each bucket; records when loads end and when updates begin."""

    push_dtype = torch.bfloat16

    def __init__(self, owner):
        self.owner, self.loaded, self.entered = owner, [], []

    def update(self, bucket, group):
        self.entered.append(time.monotonic())
        if self.owner:
            time.sleep(0.2)
            self.loaded.append(time.monotonic())


def handshake(rank, world, folder):
    par = launch.parallel_groups("cpu", world)
    model = sharded_model(folder, par)
    engine = SlowLoads(owner=rank == 0)
    with GatheredBytes() as gathers:
        # --bucket_mb 0: a bucket per tensor
        engines.push_weights(model, engine, 0, par.tp_group)
    return engine.loaded, engine.entered, gathers.starts


def test_ranks_without_an_engine_gather_the_next_bucket_only_after_the_engine_loaded_the_last(tmp_path):
    """Without the handshake the other rank would start the next bucket's all-gathers (on a GPU: NCCL kernels beside
    the loading engine) at once; with it, every gather of bucket k + 1 begins after the load of bucket k ended."""
    folder = save_reference(tmp_path, "qwen2", True)
    (loaded, _, _), (_, entered, starts) = run_ranks(handshake, 2, folder)
    assert len(loaded) == len(entered) > 3
    checked = 0
    for k in range(len(loaded) - 1):  # the gathers between the follower's update k and update k + 1: bucket k + 1's
        between = [t for t in starts if entered[k] < t < entered[k + 1]]
        if between:  # TP-sharded tensors (norms are whole on every rank here: dp is 1)
            assert min(between) > loaded[k], k
            checked += 1
    assert checked > 3


class LastBucketWatch(engines.Engine):
    """Records every step of a push, and whether a tensor of the last bucket was still alive when the KV cache came
    back (end_update)."""

    push_dtype = torch.bfloat16

    def __init__(self, events):
        self.events, self.watched = events, []

    def begin_update(self):
        self.events.append("begin_update")

    def update(self, bucket, group):
        self.events.append("update")
        self.watched = [weakref.ref(tensor) for _, tensor in bucket]

    def end_update(self):
        alive = sum(ref() is not None for ref in self.watched)
        self.events.append(f"end_update with {alive} tensors of the last bucket alive")


def memory_order(rank, world, folder):
    events = []
    cuda = {
        "ipc_collect": torch.cuda.ipc_collect,
        "empty_cache": torch.cuda.empty_cache,
        "is_available": torch.cuda.is_available,
    }
    torch.cuda.ipc_collect = lambda: events.append("ipc_collect")  # a CPU stands in for the device's allocator
    torch.cuda.empty_cache = lambda: events.append("empty_cache")
    par = launch.parallel_groups("cpu", 1)
    model = sharded_model(folder, par)
    engine = LastBucketWatch(events)
    torch.cuda.is_available = lambda: True
    try:
        engines.push_weights(model, engine, 0, par.tp_group)
    finally:
        for name, function in cuda.items():
            setattr(torch.cuda, name, function)
    return events


def test_the_kv_cache_comes_back_after_the_last_bucket_is_freed_and_the_cache_emptied(tmp_path):
    events = run_ranks(memory_order, 1, save_reference(tmp_path, "qwen2", True))[0]
    updates = events.count("update")
    assert updates > 3
    assert events == (
        ["ipc_collect", "empty_cache", "begin_update"]
        + ["update"] * updates
        + ["ipc_collect", "empty_cache", "end_update with 0 tensors of the last bucket alive"]
    )
