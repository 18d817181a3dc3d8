"""LoRA for train.py (--lora_rank > 0): low-rank adapters on the blocks' linear layers, everything else frozen.

train.py calls four functions: add_lora while it builds the model on the meta device (the adapters split over tp
as their layers are), init_adapters once the weights are loaded (PEFT's start: the policy begins as the base),
adapters_off around --beta's reference pass (the base model is the reference), and merge_adapter as it gathers the
weights that the engine gets (W + alpha / R B A: the engine serves merged weights, at no cost per token).
checkpoint.py saves the adapters alone in PEFT's layout too.
"""

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel

import architectures


def add_lora(model, rank, alpha, tp_mesh):
    """Adapters A [R, in] and B [out, R] (PEFT's names) on each linear layer that its block's TP plan names
    (architectures.layer_plan: attention, Gated DeltaNet, the dense or shared MLP where peft can load them; routed
    experts are 3-D weights and take none), everything else frozen. A forward hook adds x A^T B^T x model.lora_scale
    before TP's hook sees the output: B is split like a column-parallel output and A like a row-parallel input, so
    LoRA adds no collective. Rank 0: nothing to add, all trained."""
    model.lora_scale = alpha / rank if rank else 0.0
    model.requires_grad_(rank == 0)
    if rank == 0:
        return
    for layer in model.model.layers:
        for name, style in architectures.layer_plan(layer, model.config, lora=True).items():
            linear = layer.get_submodule(name)
            if not isinstance(linear, torch.nn.Linear):  # q/k norms, routed experts
                continue
            linear.lora_A = torch.nn.Linear(linear.in_features, rank, bias=False, device="meta")
            linear.lora_B = torch.nn.Linear(rank, linear.out_features, bias=False, device="meta")
            if tp_mesh.size() > 1:
                row_parallel = isinstance(style, RowwiseParallel)
                a_split = Shard(1) if row_parallel else Replicate()
                b_split = Replicate() if row_parallel else Shard(0)
                linear.lora_A.weight = torch.nn.Parameter(distribute_tensor(linear.lora_A.weight, tp_mesh, [a_split]))
                linear.lora_B.weight = torch.nn.Parameter(distribute_tensor(linear.lora_B.weight, tp_mesh, [b_split]))
            linear.register_forward_hook(functools.partial(add_adapter_output, model), prepend=True)


def add_adapter_output(model, linear, args, out):
    """LoRA's forward hook on `linear`: its output plus x A^T B^T x model.lora_scale."""
    return out + linear.lora_B(linear.lora_A(args[0]) * model.lora_scale)


def init_adapters(model, seed):
    """PEFT's start, drawn on rank 0 and sent to every shard: A uniform within 1 / sqrt(in), B zero, so that step
    0's policy is the base model."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.named_parameters():
        if dist.get_rank() == 0 and ".lora_A" in name:
            state[name] = (torch.rand(param.shape, generator=generator) * 2 - 1) / param.shape[1] ** 0.5
        elif dist.get_rank() == 0 and ".lora_B" in name:
            state[name] = torch.zeros(param.shape)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)


@contextlib.contextmanager
def adapters_off(model):
    """The base model alone inside the block (LoRA's reference for --beta): the adapters scaled by 0."""
    scale = model.lora_scale
    model.lora_scale = 0.0
    try:
        yield
    finally:
        model.lora_scale = scale


def merge_adapter(model, name, weight):
    """The full `weight` named `name`, plus alpha / R x B A where its layer has adapters (the engine gets merged
    weights: adapters would cost time on every generated token)."""
    layer_name = name.removesuffix(".weight")
    if layer_name == name or not hasattr(model.get_submodule(layer_name), "lora_A"):
        return weight
    linear = model.get_submodule(layer_name)
    b = linear.lora_B.weight.detach().float().full_tensor()
    a = linear.lora_A.weight.detach().float().full_tensor()
    return weight + (model.lora_scale * b @ a).to(weight.dtype)
