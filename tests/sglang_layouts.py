"""What each engine TP rank of sglang 0.5.23 holds once a push has landed, for tests/test_sglang_contract.py: Qwen3-MoE,
Qwen3-Next, and Qwen3.5's and Qwen3.5-MoE's text classes, computed from transformers' text model's tensors by the
formulas below, not by sglang's loaders (nor by the trainer's architectures.engine_weights).

One function per layout; each names the sglang code it follows (paths under sglang/srt/, version 0.5.23). The
harness leaves SGLANG_USE_CPU_ENGINE unset, so the loaders take their GPU branches: the Triton MoE layout, and the
shared expert kept apart from the routed ones (its fusion into them is CUDA's alone, models/qwen2_moe.py:283-289).
Every tensor is the pushed one, in bf16.
"""

import torch

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE, layers/vocab_parallel_embedding.py


def rows(weight, tp, rank):
    """A column-parallel weight's share: its output rows split evenly (ColumnParallelLinear.weight_loader,
    layers/linear.py:528; sharded_weight_loader(0), model_loader/weight_utils.py:1596)."""
    return weight.chunk(tp)[rank]


def columns(weight, tp, rank):
    """A row-parallel weight's share: its input columns split evenly (RowParallelLinear.weight_loader,
    layers/linear.py:1649)."""
    return weight.chunk(tp, dim=1)[rank]


def stacked(parts, tp, rank):
    """Parts loaded into one merged parameter, each split over tp, this rank's shares one after another
    (MergedColumnParallelLinear.weight_loader, layers/linear.py:710; QKVParallelLinear's, layers/linear.py:1329, with
    whole KV heads on each rank)."""
    return torch.cat([rows(part, tp, rank) for part in parts])


def vocab_rows(weight, tp, rank):
    """Embedding and LM head rows: the vocabulary padded to a multiple of 64 (of 64 x tp where that does not divide
    by tp), split evenly, padding rows zero (pad_vocab_size, layers/vocab_parallel_embedding.py:57;
    VocabParallelEmbedding.weight_loader, :390)."""
    vocab, padding = weight.shape[0], VOCAB_PADDING
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    per_rank = -(-vocab // padding) * padding // tp
    share = weight[rank * per_rank : min((rank + 1) * per_rank, vocab)]
    return torch.cat([share, share.new_zeros(per_rank - len(share), weight.shape[1])])


def experts_w13(gate_up, tp, rank):
    """Routed experts' w13_weight [E, 2I / tp, H] from transformers' gate_up_proj [E, 2I, H] (each expert's gate rows,
    then its up rows): every expert on every rank, its gate rows' share at offset 0 and its up rows' after
    (FusedMoE._load_w13, layers/moe/fused_moe_triton/layer.py:788-878)."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)


def experts_w2(down, tp, rank):
    """Routed experts' w2_weight [E, H, I / tp] from down_proj [E, H, I]: each expert's input columns split
    (FusedMoE._load_w2, layers/moe/fused_moe_triton/layer.py:881-967)."""
    return down.chunk(tp, dim=2)[rank]


def qkv_channels(weight, config):
    """The q, k and v channels of a Gated DeltaNet's in_proj_qkv or conv1d ([q | k | v]: K, K and V of them)."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return weight.split([key, key, weight.shape[0] - 2 * key])


def full_attention(hf, hf_prefix, prefix, config, tp, rank):
    """q, k, v into qkv_proj (Qwen3-Next's and Qwen3.5's q_proj holds each head's query and output gate side by
    side, and splits by whole heads as it is: models/qwen3_5.py:1500-1505), o_proj split on its input, the per-head
    q and k norms whole."""
    assert config.num_key_value_heads % tp == 0  # sglang would replicate KV heads otherwise
    q, k, v, o = (hf[f"{hf_prefix}{name}_proj.weight"] for name in "qkvo")
    return {
        f"{prefix}qkv_proj.weight": stacked([q, k, v], tp, rank),
        f"{prefix}o_proj.weight": columns(o, tp, rank),
        f"{prefix}q_norm.weight": hf[f"{hf_prefix}q_norm.weight"],
        f"{prefix}k_norm.weight": hf[f"{hf_prefix}k_norm.weight"],
    }


def gated_deltanet(hf, prefix, config, tp, rank):
    """Qwen3.5's Gated DeltaNet: in_proj_qkv ([q | k | v]) and in_proj_z into in_proj_qkvz, q, k, v and z each split
    (shard (0, 1, 2) split by output_sizes, models/qwen3_5.py:592-633, then 3); in_proj_b and in_proj_a into
    in_proj_ba (models/qwen3_5.py:1987-2000); the rest as in both GDN classes (gdn_common)."""
    linear = f"{prefix}linear_attn."
    q, k, v = qkv_channels(hf[f"{linear}in_proj_qkv.weight"], config)
    return {
        f"{linear}in_proj_qkvz.weight": stacked([q, k, v, hf[f"{linear}in_proj_z.weight"]], tp, rank),
        f"{linear}in_proj_ba.weight": stacked(
            [hf[f"{linear}in_proj_b.weight"], hf[f"{linear}in_proj_a.weight"]], tp, rank
        ),
        **gdn_common(hf, linear, config, tp, rank),
    }


def gated_deltanet_packed(hf, prefix, config, tp, rank):
    """Qwen3-Next's Gated DeltaNet: in_proj_qkvz and in_proj_ba, packed per key-head group in the checkpoint, kept
    packed and split by contiguous rows, i.e. by whole groups (the packed loader's shard_id None branch,
    models/qwen3_next.py:306-345); the gated norm in the dtype of the config (models/qwen3_next.py:236 and 253: the
    pushed bf16, widened where the checkpoint's is float32); the rest as in both GDN classes (gdn_common)."""
    linear = f"{prefix}linear_attn."
    return {
        **gdn_common(hf, linear, config, tp, rank),
        f"{linear}in_proj_qkvz.weight": rows(hf[f"{linear}in_proj_qkvz.weight"], tp, rank),
        f"{linear}in_proj_ba.weight": rows(hf[f"{linear}in_proj_ba.weight"], tp, rank),
        f"{linear}norm.weight": hf[f"{linear}norm.weight"].to(config.dtype),
    }


def gdn_common(hf, prefix, config, tp, rank):
    """conv1d's q, k and v channels each split (mamba_v2_sharded_weight_loader, layers/attention/mamba/mamba.py:83,
    set at models/qwen3_5.py:455-470 and models/qwen3_next.py:195-212); A_log and dt_bias split by value heads
    (sharded_weight_loader(0), models/qwen3_5.py:472-487, models/qwen3_next.py:215-228), A_log kept in float32 (the
    pushed bf16, widened); the gated norm whole, in the engine's dtype for Qwen3.5 (models/qwen3_5.py:507-512);
    out_proj split on its input."""
    return {
        f"{prefix}conv1d.weight": stacked(qkv_channels(hf[f"{prefix}conv1d.weight"], config), tp, rank),
        f"{prefix}A_log": rows(hf[f"{prefix}A_log"], tp, rank).float(),
        f"{prefix}dt_bias": rows(hf[f"{prefix}dt_bias"], tp, rank),
        f"{prefix}norm.weight": hf[f"{prefix}norm.weight"],
        f"{prefix}out_proj.weight": columns(hf[f"{prefix}out_proj.weight"], tp, rank),
    }


def dense_mlp(hf, prefix, tp, rank):
    """gate and up into gate_up_proj, down split on its input."""
    gate, up, down = (hf[f"{prefix}{name}_proj.weight"] for name in ("gate", "up", "down"))
    return {
        f"{prefix}gate_up_proj.weight": stacked([gate, up], tp, rank),
        f"{prefix}down_proj.weight": columns(down, tp, rank),
    }


def routed_experts(hf, prefix, tp, rank):
    """The router whole (ReplicatedLinear: models/qwen3_moe.py:290, models/qwen2_moe.py:347), the experts as FusedMoE
    holds them."""
    return {
        f"{prefix}gate.weight": hf[f"{prefix}gate.weight"],
        f"{prefix}experts.w13_weight": experts_w13(hf[f"{prefix}experts.gate_up_proj"], tp, rank),
        f"{prefix}experts.w2_weight": experts_w2(hf[f"{prefix}experts.down_proj"], tp, rank),
    }


def shared_expert(hf, prefix, tp, rank):
    """Qwen3-Next's and Qwen3.5-MoE's shared expert, a dense MLP, and its gate whole (models/qwen2_moe.py:385-394)."""
    return {
        **dense_mlp(hf, f"{prefix}shared_expert.", tp, rank),
        f"{prefix}shared_expert_gate.weight": hf[f"{prefix}shared_expert_gate.weight"],
    }


def expected_parameters(hf, config, tp, rank, dtype=torch.bfloat16):
    """sglang's parameters on engine TP rank `rank` of `tp`, by name, from `hf`, the state dict of transformers' text
    model (fused experts) in the trainer's config `config`. Each layer's kinds are read off its HF names. The tensors
    arrive in `dtype`, bf16 as pushed; None: as `hf` holds them, as a loader reading a checkpoint gets them (each
    parameter's loader then casts to its own dtype)."""
    if dtype is not None:
        hf = {name: tensor.to(dtype) for name, tensor in hf.items()}
    expected = {
        "model.embed_tokens.weight": vocab_rows(hf["model.embed_tokens.weight"], tp, rank),
        "model.norm.weight": hf["model.norm.weight"],
    }
    # Qwen3.5's text classes make a tied LM head the embedding itself (models/qwen3_5_text.py:94-95); Qwen3-MoE's and
    # Qwen3-Next's keep their own (models/qwen3_moe.py:1017-1023, models/qwen3_next.py:1047-1054), to be given the
    # embedding when tied (which transformers' state dict holds as lm_head.weight too).
    if not (config.tie_word_embeddings and config.model_type in ("qwen3_5_text", "qwen3_5_moe_text")):
        expected["lm_head.weight"] = vocab_rows(hf["lm_head.weight"], tp, rank)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[f"{prefix}{norm}.weight"] = hf[f"{prefix}{norm}.weight"]
        if f"{prefix}linear_attn.in_proj_qkvz.weight" in hf:
            expected.update(gated_deltanet_packed(hf, prefix, config, tp, rank))
        elif f"{prefix}linear_attn.in_proj_qkv.weight" in hf:
            expected.update(gated_deltanet(hf, prefix, config, tp, rank))
        else:
            # Qwen3-Next's and Qwen3.5's loaders drop ".self_attn" (models/qwen3_next.py:1193, models/qwen3_5.py:2013)
            attention = prefix + ("self_attn." if config.model_type == "qwen3_moe" else "")
            expected.update(full_attention(hf, f"{prefix}self_attn.", attention, config, tp, rank))
        mlp = f"{prefix}mlp."
        if f"{mlp}experts.gate_up_proj" not in hf:
            expected.update(dense_mlp(hf, mlp, tp, rank))
            continue
        expected.update(routed_experts(hf, mlp, tp, rank))
        if f"{mlp}shared_expert_gate.weight" in hf:
            expected.update(shared_expert(hf, mlp, tp, rank))
    return expected


def vision_tower(hf, tp, rank):
    """sglang's parameters of Qwen3.5's vision tower (Qwen3VLMoeVisionModel, models/qwen3_vl.py) on engine TP rank
    `rank` of `tp`, by name, from a checkpoint's model.visual.* tensors in `hf`, renamed as the vision-language
    class's load_weights renames them (model.visual. -> visual., attn.qkv. -> attn.qkv_proj., models/qwen3_5.py:
    2520-2523): the position embedding by vocabulary rows (a VocabParallelEmbedding, models/qwen3_vl.py:400); each
    block's fused qkv split into q, k and v, each split (QKVParallelLinear given no shard id, layers/linear.py:1373);
    its mlp.linear_fc1 and the merger's split by output rows, weight and bias (ColumnParallelLinear); attn.proj's and
    linear_fc2's weights split on their input (RowParallelLinear, whose bias is whole on every rank); the patch
    embedding's convolution and the layer norms whole."""
    expected = {}
    for name, tensor in hf.items():
        if not name.startswith("model.visual."):
            continue
        name = name.replace("model.visual.", "visual.").replace(".attn.qkv.", ".attn.qkv_proj.")
        module, _, leaf = name.rpartition(".")
        if module == "visual.pos_embed":
            expected[name] = vocab_rows(tensor, tp, rank)
        elif module.endswith(".attn.qkv_proj"):
            expected[name] = stacked(tensor.chunk(3), tp, rank)
        elif module.endswith(".linear_fc1"):
            expected[name] = rows(tensor, tp, rank)
        elif module.endswith((".attn.proj", ".linear_fc2")) and leaf == "weight":
            expected[name] = columns(tensor, tp, rank)
        else:
            expected[name] = tensor
    return expected
