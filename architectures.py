"""What each model architecture needs of the trainer: the config it builds, how its decoder layers split over tensor
parallelism, and the names its weights take in checkpoint files and in the SGLang engine.

An architecture is one entry of ARCHITECTURES, keyed by the model_type of its text config: the TP plans of the layer
types it has (attention, gated attention, Gated DeltaNet, dense MLP, routed experts, shared expert), each applied to
the decoder layers that have its modules, and the form in which SGLang's class for it takes routed experts. Adding
the next Qwen is one entry. The functions below read the table:

    text_config(config)            the config the trainer builds: a vision-language checkpoint's text model
    check_tp(config, tp)           heads and experts that --tp cannot divide, refused at start
    parallelize(model, tp_mesh)    each decoder layer's plan applied, before FSDP
    layer_plan(layer, config)      one layer's plan (LoRA splits its adapters the same way)
    routing, expert_load           the MoE load-balancing loss and the busiest expert's load
    CheckpointLayout               a checkpoint's names as the trainer's parameters, and back (for an export)
    engine_config(config)          the config.json SGLang reads
    engine_weights(...)            a full weight as the engine's names and shapes, in pieces of at most a bucket
    check_engine_names(...)        the push against what SGLang's class loads, at start

Names in files (a hub folder's per-expert or fused experts, a vision-language checkpoint's prefixes) are converted by
transformers' own conversion mapping, the one from_pretrained and save_pretrained use.
"""

import copy
import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import vision

# ----------------------------------------------------------------------------------------------------------------
# Tensor parallelism: a plan per layer type


class ExpertsByRank(ParallelStyle):
    """Routed experts split over tp by expert: rank r holds experts r E / tp to (r + 1) E / tp whole (gate_up_proj and
    down_proj sharded on dim 0), runs the tokens routed to them through one grouped matmul each way, and the outputs
    are summed over tp (experts_by_rank). A split inside each expert would need gate_up_proj's gate and up rows
    reordered per rank, a layout that depends on tp and that a resume at another tp would misread."""

    def _apply(self, module, device_mesh):
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)])
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


def experts_by_rank(experts, hidden_states, top_k_index, top_k_weights):
    """The experts' forward under ExpertsByRank (transformers' experts interface): each (token, choice) routed to one
    of this rank's experts, through it, weighted, summed per token, then over tp. The gradients of the hidden states
    and routing weights are this rank's experts' share: summed over tp in backward, so the router learns whole.
    Experts not split (tp 1, the HF engine's copy, which shares the config that names this forward) run
    transformers' own grouped matmul."""
    gate_up, down = experts.gate_up_proj, experts.down_proj  # DTensors [E, 2I, H] and [E, H, I], Shard(0) over tp
    if not isinstance(gate_up, DTensor):
        return grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
    mesh = gate_up.device_mesh
    gate_up, down = gate_up.to_local(), down.to_local()
    local = gate_up.shape[0]
    ids = top_k_index - mesh.get_local_rank() * local  # [tokens, k]: in [0, local) where the expert is here
    hidden = DTensor.from_local(hidden_states, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    weights = DTensor.from_local(top_k_weights, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    token, choice = ((ids >= 0) & (ids < local)).nonzero(as_tuple=True)  # none at all on an idle rank: fine
    expert = ids[token, choice]
    order = expert.argsort(stable=True)  # grouped by expert, as grouped_mm reads them
    token, choice, expert = token[order], choice[order], expert[order]
    offsets = torch.bincount(expert, minlength=local).cumsum(0).to(torch.int32)
    gate, up = grouped_linear(hidden[token], gate_up, offsets).chunk(2, dim=-1)
    out = grouped_linear(experts.act_fn(gate) * up, down, offsets) * weights[token, choice, None]
    # Each (token, choice) in its place, then summed over the choices: deterministic, unlike index_add on GPUs.
    tokens, top_k = top_k_index.shape
    placed = out.new_zeros(tokens * top_k, out.shape[-1]).index_put((token * top_k + choice,), out)
    summed = placed.view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)
    return DTensor.from_local(summed, mesh, [Partial()]).full_tensor()


def grouped_linear(x, weight, offsets):
    """x [n, in] through weight [experts, out, in], rows grouped by expert (offsets: each group's end)."""
    return torch.nn.functional.grouped_mm(x.to(weight.dtype), weight.transpose(1, 2), offs=offsets)


ALL_EXPERTS_FUNCTIONS.register("by_rank", experts_by_rank)

# Attention: q, k and v split their heads over tp, o its input; one all-reduce per block each way. Qwen3.5's and
# Qwen3-Next's gated attention holds each head's query and output gate side by side in q_proj: split alike.
ATTENTION = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
}
# Qwen3's per-head q/k norms see a rank's heads only (dim 2): replicated weights, gradients summed over tp in backward.
QK_NORM = {
    "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
}
# Gated DeltaNet (Qwen3.5): each projection's weight split over tp and its output gathered, so the recurrence runs
# whole on each rank (as transformers' own plan, slime and Miles); conv1d, A_log, dt_bias and the norm replicated.
GATED_DELTANET = {
    "linear_attn.in_proj_qkv": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.in_proj_z": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.in_proj_b": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.in_proj_a": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.out_proj": ColwiseParallel(output_layouts=Replicate()),
}
# Qwen3-Next's Gated DeltaNet fuses q, k, v, z (interleaved per key-head group) and b, a: split and gathered alike.
GATED_DELTANET_FUSED = {
    "linear_attn.in_proj_qkvz": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.in_proj_ba": ColwiseParallel(output_layouts=Replicate()),
    "linear_attn.out_proj": ColwiseParallel(output_layouts=Replicate()),
}
MLP = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
# The router (mlp.gate) and the shared expert's gate stay whole on every rank: each rank routes every token.
EXPERTS = {"mlp.experts": ExpertsByRank()}
SHARED_EXPERT = {
    "mlp.shared_expert.gate_proj": ColwiseParallel(),
    "mlp.shared_expert.up_proj": ColwiseParallel(),
    "mlp.shared_expert.down_proj": RowwiseParallel(),
}


@dataclass(frozen=True)
class Architecture:
    """One model family: the plans of its layer types, and how SGLang's class for it loads routed experts."""

    plans: tuple  # each layer gets every plan whose modules it has
    # "per_expert": experts.{i}.{gate,up,down}_proj.weight alone (SGLang skips or refuses the fused names);
    # "fused": transformers' 3-D gate_up_proj and down_proj too, sent whole where a bucket holds them.
    engine_experts: str = ""
    # Plans whose layers take no LoRA: peft (0.21) reads a gate_proj, up_proj or down_proj target of the model types
    # it converts as Qwen2-MoE's (Qwen3-MoE, Qwen3-Next) as their routed experts, so it could not load those adapters.
    lora_skips: tuple = ()
    untied_lm_head: bool = False  # SGLang's class keeps its own LM head whatever tie_word_embeddings says


ARCHITECTURES = {
    "qwen2": Architecture((ATTENTION, MLP)),
    "llama": Architecture((ATTENTION, MLP)),
    "qwen3": Architecture((ATTENTION, QK_NORM, MLP)),
    "qwen3_moe": Architecture(
        (ATTENTION, QK_NORM, MLP, EXPERTS), engine_experts="per_expert", lora_skips=(MLP,), untied_lm_head=True
    ),
    "qwen3_next": Architecture(
        (ATTENTION, QK_NORM, GATED_DELTANET_FUSED, MLP, EXPERTS, SHARED_EXPERT),
        engine_experts="per_expert",
        lora_skips=(MLP, SHARED_EXPERT),
        untied_lm_head=True,
    ),
    "qwen3_5_text": Architecture((ATTENTION, QK_NORM, GATED_DELTANET, MLP)),
    "qwen3_5_moe_text": Architecture(
        (ATTENTION, QK_NORM, GATED_DELTANET, EXPERTS, SHARED_EXPERT), engine_experts="fused"
    ),
}


def architecture(config):
    """The table's entry for a text config; an architecture it lacks stops the run, naming those it has."""
    if config.model_type not in ARCHITECTURES:
        raise SystemExit(
            f"--model is a {config.model_type} model; the trainer knows {', '.join(ARCHITECTURES)} "
            "(architectures.py: an entry of ARCHITECTURES adds one)"
        )
    return ARCHITECTURES[config.model_type]


def text_config(config):
    """The config of the model the trainer builds, whose class is its model type's causal LM: a vision-language
    checkpoint's (Qwen3.5) text model, its LM head tied as the checkpoint's is; any other config as it is. The vision
    tower is not trained: an export carries it from the checkpoint unchanged."""
    text = copy.deepcopy(getattr(config, "text_config", config))
    text.tie_word_embeddings = config.tie_word_embeddings  # the checkpoint's class ties by its own config's
    text.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type]]
    architecture(text)
    return text


def check_tp(config, tp):
    """Each rank computes whole heads (attention's and Gated DeltaNet's) and whole experts: --tp must divide them."""
    counts = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")
    for count in (*counts, "num_experts"):
        value = getattr(config, count, None)
        if value and value % tp:
            raise SystemExit(f"--tp {tp} must divide the model's {count} ({value}): use a divisor of {value}")


def layer_plan(layer, config, lora=False):
    """The TP plan of one decoder layer: the plan of each of its architecture's layer types whose modules it has.
    With `lora`, those of the plans whose layers take LoRA."""
    plan = {}
    for part in architecture(config).plans:
        skipped = lora and part in architecture(config).lora_skips
        if all(has_module(layer, name) for name in part) and not skipped:
            plan.update(part)
    return plan


def has_module(layer, name):
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def parallelize(model, tp_mesh):
    """Each decoder layer's plan applied over tp_mesh; routed experts then run by rank (experts_by_rank)."""
    plans = [layer_plan(layer, model.config) for layer in model.model.layers]
    for layer, plan in zip(model.model.layers, plans):
        parallelize_module(layer, tp_mesh, plan)
    if any(EXPERTS.keys() <= plan.keys() for plan in plans):
        model.set_experts_implementation("by_rank")


def routers(model):
    """{decoder layer index: its router} of the layers with routed experts (transformers' mlp.gate), of a causal LM
    or of a vision-language model's language model."""
    layers = getattr(model.model, "language_model", model.model).layers
    return {i: layer.mlp.gate for i, layer in enumerate(layers) if has_module(layer, "mlp.experts")}


def record_routing(model):
    """Forward hooks on each router of `model`: every forward appends each layer's top-k choices to
    model.routed[layer] (an engine's copy, which reports what it sampled with)."""
    model.routed = defaultdict(list)
    for i, router in routers(model).items():
        router.register_forward_hook(functools.partial(recorded, model, i))


def recorded(model, layer, router, args, out):
    model.routed[layer].append(out[2])  # transformers' routers return (logits, weights, top-k indices)


def replay_routing(model):
    """Forward hooks on each router of `model` that, while model.replay is set ([tokens of the forward, layers, k]
    of an engine's choices; -1 where it has none), route each token to the experts it names, weighted by the
    router's own softmax gathered at them and renormalised where the router does (rollout routing replay): the
    router keeps its gradient. The hooks stay for backward, whose recomputation (activation checkpointing) replays
    alike."""
    model.replay = None
    for i, router in routers(model).items():
        renormalise = getattr(router, "norm_topk_prob", True)  # Qwen3.5-MoE's router always renormalises
        router.register_forward_hook(functools.partial(replayed, model, i, renormalise))


def replayed(model, layer, renormalise, router, args, out):
    if model.replay is None:
        return None
    logits, weights, own = out
    given = model.replay[:, layer].long()  # [tokens, k]
    chosen = torch.where(replayable(given, logits.shape[-1])[:, None], given, own)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)
    if renormalise:
        probs = probs / probs.sum(-1, keepdim=True)
    return logits, probs.to(weights.dtype), chosen


def replayable(given, experts):
    """[tokens] whether each row of an engine's routing [tokens, k] can be replayed: k distinct experts. Else (a
    position the engine did not run, -1; an index past the experts, such as an engine's -1 kept in a byte as 255; an
    expert twice, which would send the token to one expert at full weight) the router's own top-k routes it."""
    in_range = ((given >= 0) & (given < experts)).all(-1)
    ordered = given.sort(-1).values
    return in_range & (ordered[:, 1:] != ordered[:, :-1]).all(-1)


def routing_dtype(config):
    """The dtype that holds an expert's index: a byte while the experts and one more value fit one (an engine's -1,
    kept as 255, must be no expert)."""
    return torch.uint8 if config.num_experts < 256 else torch.int16


def engine_routing(samples, longest, config, device):
    """The samples' routings as the engine gave them (Sample.routing: its experts for every position it ran, each
    token's but the last) as one tensor [samples x longest, layers, k] on `device`, in the forward's order,
    right-padded; -1 where a position has none (the last token, padding, a tool's output after the last engine
    call). None where the engine reported none (--routing_replay off): moved once, then read by every MoE layer."""
    if not any(len(s.routing) for s in samples):
        return None
    layers, top_k = config.num_hidden_layers, config.num_experts_per_tok
    replay = torch.full((len(samples), longest, layers, top_k), -1, dtype=torch.int16)
    for b, s in enumerate(samples):
        replay[b, : len(s.routing)] = s.routing
    return replay.view(-1, layers, top_k).to(device)


def routing(out, mask, model, engine=None):
    """Of a forward with output_router_logits: transformers' load-balancing loss (over the tokens `mask` keeps), and
    counts [MoE layers, experts + 3]: each expert's tokens as the router chose them (its own top k), then the tokens
    whose top-k set differs from the engine's routing `engine` (engine_routing's) and those compared, and the tokens
    whose engine routing could not be replayed (replayable); for a model without routed experts, 0 and an empty
    count."""
    if getattr(out, "router_logits", None) is None:
        return mask.new_zeros((), dtype=torch.float32), mask.new_zeros((0, 0), dtype=torch.float32)
    kept = mask.reshape(-1).bool()
    config = model.config
    counts = []
    for layer, logits in zip(routers(model), out.router_logits):  # [batch x time, experts], a MoE layer's
        own = logits.topk(config.num_experts_per_tok, dim=-1).indices
        tokens = torch.bincount(own[kept].reshape(-1), minlength=config.num_experts).float()
        pairs = tokens.new_zeros(3)  # mismatched, compared, unusable
        if engine is not None:
            given = engine[:, layer].long()
            usable = replayable(given, config.num_experts)
            compared = kept & usable
            unusable = kept & ~usable & (given != -1).any(-1)  # reported, but not as k distinct experts
            differ = (own.sort(-1).values != given.sort(-1).values).any(-1)
            pairs = torch.stack([(differ & compared).sum(), compared.sum(), unusable.sum()]).float()
        counts.append(torch.cat([tokens, pairs]))
    return out.aux_loss.float(), torch.stack(counts)


def expert_load(counts, par):
    """expert_load_max: over the MoE layers, the most the busiest expert got of the step's tokens against the mean;
    routing_mismatch: the share of (token, MoE layer) pairs whose router's top-k set differs from the engine's, where
    the engine reported its routing; routing_unusable: the share of those the engine reported whose routing was no
    k distinct experts (routed by the router itself). From every rank's counts (routing's, a TP group's once);
    nothing for a dense model."""
    if not torch.is_tensor(counts) or counts.numel() == 0:
        return {}
    counts = counts.double()
    dist.all_reduce(counts, group=par.world_group)
    counts /= par.mesh["tp"].size()
    tokens, (mismatched, compared, unusable) = counts[:, :-3], counts[:, -3:].sum(0).tolist()
    metrics = {"expert_load_max": (tokens.amax(1) / tokens.mean(1).clamp(min=1e-9)).max().item()}
    if compared:
        metrics["routing_mismatch"] = mismatched / compared
    if compared + unusable:
        metrics["routing_unusable"] = unusable / (compared + unusable)
    return metrics


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files: their names as the trainer's, and back


class CheckpointLayout:
    """How a checkpoint's tensors (`keys`, its names) make the trainer's parameters and back, by transformers'
    conversion mapping for the model (from_pretrained's and save_pretrained's): a vision-language checkpoint's
    model.language_model. prefix dropped, per-expert weights stacked into the fused experts. A key that makes no
    parameter (the vision tower, MTP weights) is the checkpoint's alone: an export carries it as it was."""

    def __init__(self, config, keys):
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config)
        transforms = get_model_conversion_mapping(self.model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        self.sources = defaultdict(list)  # parameter name: [(checkpoint key, the converter's pattern it matched)]
        self.converters = {}  # parameter name: the converter that makes it, where one does
        for key in sorted(keys, key=dot_natural_key):  # expert 0, 1, ..., 10: the order experts stack in
            name, pattern = rename_source_key(key, self.renamings, converters)
            self.sources[name].append((key, pattern))
            if pattern is not None:
                self.converters[name] = by_pattern[pattern]
        names = dict(self.model.named_parameters()).keys()
        self.extras = [key for name in self.sources.keys() - names for key, _ in self.sources.pop(name)]

    def parameter(self, name, read):
        """Parameter `name` from the checkpoint, `read(key)` giving a key's tensor."""
        if name not in self.converters:
            [(key, _)] = self.sources[name]
            return read(key)
        converter = copy.deepcopy(self.converters[name])
        for key, pattern in self.sources[name]:
            converter.add_tensor(name, key, pattern, functools.partial(read, key))  # read when converted
        return converter.convert(name, model=self.model, config=self.model.config)[name]

    def checkpoint_tensors(self, name, tensor):
        """Parameter `name`, trained, as the checkpoint held it: [(key, tensor)], by the inverse of its conversion."""
        if name in self.extras:  # a vision tower trained with the text model (--train_vision): under its own key
            return [(name, tensor)]
        if name not in self.converters:
            [(key, _)] = self.sources[name]
            return [(key, tensor)]
        original = {}  # the names the converter saw (renamed): the checkpoint's
        for key, _ in self.sources[name]:
            original[rename_source_key(key, self.renamings, [])[0]] = key
        return [(original[key], piece) for key, piece in revert_weight_conversion(self.model, {name: tensor}).items()]


# ----------------------------------------------------------------------------------------------------------------
# The engine: its config and the names it loads


def engine_config(config):
    """The config.json SGLang reads for the text model: the text config, with what SGLang's own config classes read
    and transformers' keeps elsewhere: for a hybrid of linear and full attention the full_attention_interval that
    transformers turns into layer_types, and the rope_theta that transformers keeps in rope_parameters (SGLang's
    Qwen3-Next config would take 10,000 without it)."""
    config = copy.deepcopy(config)
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
    layer_types = getattr(config, "layer_types", None) or []
    if "linear_attention" in layer_types:
        interval = layer_types.index("full_attention") + 1
        expected = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))
        ]
        if layer_types != expected:
            raise SystemExit(f"--model's layer_types are not a full attention layer every {interval}: SGLang's are")
        config.full_attention_interval = interval
    return config


@functools.cache
def expert_parts(name):
    """The per-expert names a fused expert weight stands for, by its name: gate_up_proj [E, 2I, H] is each expert's
    gate_proj (the first I rows) and up_proj; down_proj [E, H, I] each expert's down_proj. None for another."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        return None
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{{}}.{part}.weight" for part in parts]


def engine_weights(config, name, weight, bucket_bytes):
    """The full weight `name` as the engine loads it, in (name, tensor) pieces of at most bucket_bytes where it can:
    routed experts' fused weights per expert where SGLang's class takes only those, or where the model's largest
    fused weight would not fit a bucket (Qwen3.5-MoE's class drops per-expert names that come after a fused one in
    one load, so a push sends one form or the other); a tied embedding also as the LM head of a class that keeps its
    own (untied_lm_head); anything else as it is."""
    if name == "model.embed_tokens.weight" and config.tie_word_embeddings and architecture(config).untied_lm_head:
        yield "lm_head.weight", weight
    parts = expert_parts(name)
    if parts is None:
        yield name, weight
        return
    # gate_up_proj [E, 2I, H], the largest fused weight
    largest = weight.element_size() * config.num_experts * 2 * config.moe_intermediate_size * config.hidden_size
    if architecture(config).engine_experts == "fused" and largest <= bucket_bytes:
        yield name, weight
        return
    for expert, rows in enumerate(weight):  # rows [2I, H] or [H, I]
        for part, piece in zip(parts, rows.chunk(len(parts))):
            yield part.format(expert), piece


def check_engine_names(model, config, bucket_bytes, tower=None):
    """Every tensor the push sends (engine_weights, at --bucket_mb) under a name and shape that SGLang's class for the
    architecture loads, and every weight it loads sent. It loads the hub's layout (the per-expert names
    save_pretrained writes), and fused experts where the table says it takes those; with a vision tower, the
    vision-language class's, whose tower's weights are pushed too. SGLang skips a name it does not know and still
    reports success, and keeps its own random values where nothing came: either is refused here, at start, named."""
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    trained = {name: param.detach() for name, param in meta.named_parameters()}
    loads = {name: list(tensor.shape) for name, tensor in revert_weight_conversion(meta, trained).items()}
    if config.tie_word_embeddings and architecture(config).untied_lm_head:
        loads["lm_head.weight"] = loads["model.embed_tokens.weight"]
    fused = {}  # a fused experts' name: the per-expert names it stands for, where the engine takes it
    if architecture(config).engine_experts == "fused":
        for name, tensor in trained.items():
            if expert_parts(name):
                loads[name] = list(tensor.shape)
                fused[name] = {part.format(i) for part in expert_parts(name) for i in range(len(tensor))}
    pieces = []
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            weight = torch.empty(param.shape, dtype=torch.bfloat16, device="meta")  # as SGLang's push sends it
            pieces += engine_weights(config, name, weight, bucket_bytes)
    if tower is not None:
        with torch.device("meta"):
            vlm = AutoModelForImageTextToText.from_config(tower.vlm_config)
        loads |= {name: list(p.shape) for name, p in vlm.named_parameters() if name.startswith("model.visual.")}
        pieces += vision.tower_weights(tower, torch.bfloat16)
    sent = set()
    for piece_name, piece in pieces:
        sent |= {piece_name, *fused.get(piece_name, ())}
        if loads.get(piece_name) != list(piece.shape):
            loaded = f"it as {loads[piece_name]}" if piece_name in loads else "no such weight"
            raise SystemExit(
                f"the trainer would push {piece_name} as {list(piece.shape)}; SGLang's {config.architectures[0]} "
                f"loads {loaded} and would skip it: check architectures.py's entry for {config.model_type}"
            )
    unsent = sorted(name for name in loads.keys() - sent if name not in fused)
    if unsent:
        raise SystemExit(
            f"SGLang's {config.architectures[0]} loads {unsent[0]} ({len(unsent)} weights), which the trainer never "
            f"pushes: it would sample with its own values; check architectures.py's entry for {config.model_type}"
        )
