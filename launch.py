"""How train.py runs as processes under torchrun: the process group, the (dp, tp) device mesh and gloo groups, work
done once on a group's first rank, what the ranks must do alike (sums over the world, as many micro-batches on every
rank, the global grad norm over dp's and tp's meshes), and every rank exiting together with rank 0 saying why.

Machinery a researcher rarely edits; `python train.py` (one process, no torchrun) goes through the same code.
"""

import contextlib
import datetime
import logging
import math
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import stopping


def init_distributed():
    """Rank, world size and device from torchrun's environment (one process without it), and the default process
    group: NCCL for GPU tensors, gloo for CPU ones."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = None if "MASTER_ADDR" in os.environ else dist.HashStore()  # `python train.py`: one process, no torchrun
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if cuda else "gloo",
        rank=rank,
        world_size=world,
        store=store,
        timeout=datetime.timedelta(hours=1),  # covers a start
        device_id=device if cuda else None,
    )
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # none changed in place
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # TP's few small tensors
    transformers.utils.logging.disable_progress_bar()
    # A Gated DeltaNet kernel's fallback, said by transformers once per kernel and rank: flags.start_notes says it once.
    fallbacks = logging.getLogger("transformers.integrations.hub_kernels")
    fallbacks.addFilter(lambda record: "falling back to its reference PyTorch" not in record.getMessage())
    return rank, world, device


def usable_cpus():
    """The CPUs this process may run on: its affinity where the system has one (Linux), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class Parallel:
    """The device mesh over (dp, tp), which shards the model; and gloo process groups over the world, dp and tp, for
    waits and Python objects: a rank waiting there spins no NCCL kernel on the GPU that the engine uses."""

    mesh: DeviceMesh
    world_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup

    @property
    def dp(self):
        """The number of data-parallel ranks: TP groups, each with its own engine and samples."""
        return self.mesh["dp"].size()

    @property
    def dp_rank(self):
        """This rank's place among them."""
        return self.mesh["dp"].get_local_rank()


def parallel_groups(device_type, tp):
    """Parallel for a (world / tp, tp) layout: dp ranks apart by tp, a TP group's ranks next to each other."""
    shape = (dist.get_world_size() // tp, tp)
    names = ("dp", "tp")
    gloo = init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, "gloo"))
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    world_group = dist.new_group(backend="gloo")
    return Parallel(mesh, world_group, gloo["dp"].get_group(), gloo["tp"].get_group())


def on_first_rank(group, work, *args):
    """work(*args) on the group's first rank, sent to the group: one answer; a SystemExit there (a check made on one
    rank) stops every rank, and an Interrupted there (rollouts a stop gave up) is every rank's."""
    box = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = work(*args)
        except (SystemExit, stopping.Interrupted) as error:  # the others would fail in the next collective
            box[0] = error
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], (SystemExit, stopping.Interrupted)):
        raise box[0]
    return box[0]


def sum_over_world(values, par):
    """Each value summed over all ranks in one float64 all-reduce, a TP group counted once (its ranks hold the same
    samples); the same keys in the same order on every rank."""
    totals = torch.tensor([float(value) for value in values.values()], dtype=torch.float64)
    dist.all_reduce(totals, group=par.world_group)
    totals /= par.mesh["tp"].size()
    return dict(zip(values, totals.tolist()))


def any_rank(flag, par):
    """Whether `flag` holds on any rank (a stop one rank was asked for is every rank's)."""
    flags = torch.tensor(int(flag))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=par.world_group)
    return bool(flags)


def gathered(tensor, group):
    """Every rank's `tensor` (the same shape on each) of `group`, joined in rank order."""
    every_rank = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every_rank, tensor, group=group)
    return torch.cat(every_rank)


def means_over_world(per_token, per_sample, counts, par):
    """A step's means over all ranks: of the sums in `per_token` over the sampled tokens (counts["tokens"]), of the
    values in `per_sample` (a dict a sample, the same keys on every rank) over the samples (counts["samples"]), with
    the std of each reward/ term; and `counts` summed. Returns them, and the totals they come from."""
    sample_sums = {key: sum(values[key] for values in per_sample) for key in per_sample[0]}
    squares = {}
    for key in [key for key in sample_sums if key.startswith("reward/")]:
        squares[f"{key}/std"] = sum(values[key] * values[key] for values in per_sample)
    totals = sum_over_world({**per_token, **sample_sums, **squares, **counts}, par)
    means = {key: totals[key] / max(totals["tokens"], 1) for key in per_token}
    means |= {key: totals[key] / totals["samples"] for key in sample_sums}
    for key in squares:  # over the step's samples
        variance = totals[key] / totals["samples"] - means[key.removesuffix("/std")] ** 2
        means[key] = math.sqrt(max(variance, 0.0))
    return means | {key: totals[key] for key in counts}, totals


def max_over_world(values, par):
    """Each value's maximum over all ranks, in one float64 all-reduce."""
    peaks = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=par.world_group)
    return dict(zip(values, peaks.tolist()))


def micro_batches(samples, cfg, group):
    """--micro_batch_size each, or packed to --max_tokens_per_microbatch; equal count on all ranks (collectives)."""
    if cfg.max_tokens_per_microbatch == 0:
        return [samples[i : i + cfg.micro_batch_size] for i in range(0, len(samples), cfg.micro_batch_size)]
    batches = []
    longest = 0  # the length of the last micro-batch's first sequence
    for sample in sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True):
        if batches and (len(batches[-1]) + 1) * longest <= cfg.max_tokens_per_microbatch:
            batches[-1].append(sample)
        else:
            batches.append([sample])
            longest = len(sample.prompt_ids) + len(sample.response_ids)
    count = torch.tensor(len(batches))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    while len(batches) < count:
        largest = batches.pop(max(range(len(batches)), key=lambda i: len(batches[i])))
        batches += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return batches


def padded(seqs, device, left=False):
    """Token id lists as one batch [B, T] and its attention mask, padded with 0 on the right (or the left), the
    padding masked."""
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, seq in enumerate(seqs):
        columns = slice(longest - len(seq), longest) if left else slice(0, len(seq))
        ids[row, columns] = torch.tensor(seq, dtype=torch.long)
        mask[row, columns] = 1
    return ids.to(device), mask.to(device)


def clip_grad_norm(model, max_norm):
    """The gradients' global norm, and with --max_grad_norm above 0 the gradients scaled to at most that when it is
    finite. A norm per mesh, then combined: clip_grad_norm_ cannot mix dp's and (dp, tp)'s DTensors."""
    by_mesh = defaultdict(list)
    for param in model.parameters():
        if param.grad is not None:
            by_mesh[param.grad.device_mesh].append(param.grad)
    squares = [torch.nn.utils.get_total_norm(grads).full_tensor().item() ** 2 for grads in by_mesh.values()]
    norm = math.sqrt(sum(squares))
    if 0 < max_norm < norm < math.inf:
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def shut_down(engine, reward_workers, wandb_run):
    """Reward workers and wandb first: SGLang's shutdown SIGKILLs every child, and wandb's killed service hangs."""
    try:
        reward_workers.close()
        if wandb_run is not None:
            import wandb

            wandb.teardown()  # finishes the run, and ends its service process
    finally:
        engine.shutdown()  # and its scheduler processes


def run(main):
    """main(), and every rank exits alike when it stops a run with a SystemExit (exit_together)."""
    try:
        main()
    except SystemExit as error:
        exit_together(error)


def exit_together(error):
    """Every rank stops alike and rank 0 says why, once. torchrun stops every rank when one exits with an error, so
    the others wait (10 s at most) until rank 0 has printed its line."""
    rank = int(os.environ.get("RANK", 0))
    code = error.code
    if isinstance(code, str):
        if rank == 0:
            print(code, file=sys.stderr, flush=True)
        code = 1
    if code and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        store = dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=10))
        # torchrun keeps its store over the restarts of --max_restarts: a key of this attempt's own.
        said = f"train.py: rank 0 said why, attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        if rank == 0:
            store.set(said, "")
        else:
            with contextlib.suppress(RuntimeError):  # rank 0 failed elsewhere, or had nothing to say
                store.wait([said])
    raise SystemExit(code)
