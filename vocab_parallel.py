"""Log-probs and entropy from an LM head sharded by vocabulary over the tensor-parallel ranks, for train.py.

Each rank holds V / tp rows of the LM head and computes its slice of the logits in fp32, chunk by chunk; the softmax's
maximum and sums are all-reduced over tp, so the full [tokens, V] logits never exist on one rank. Backward sums the
hidden states' gradient over tp, each rank adding its slice's part. With truncated sampling (--top_p, --top_k), the
sampled token's log-prob is renormalised over the ids it was sampled from, wherever they fall in the vocabulary.

train.py calls chunked_logprobs with the final hidden states of the sampled tokens, and kept_sets for the ids each
token was sampled from.
"""

import functools
import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


class FP32Logits(torch.autograd.Function):
    """hidden @ w.T [C, V / tp] in fp32 from bf16 inputs, as SGLang's fp32 LM head (bf16 logits lose ~0.01 nats)."""

    @staticmethod
    def forward(ctx, hidden, w):
        ctx.save_for_backward(hidden, w)
        if hidden.is_cuda:
            return torch.mm(hidden, w.T, out_dtype=torch.float32)
        return hidden.float() @ w.float().T  # CPU torch lacks mm's out_dtype: an upcast

    @staticmethod
    def backward(ctx, grad):
        # CUDA's mm(out_dtype=) has no derivative: bf16 products, as autograd's for a bf16 matmul.
        hidden, w = ctx.saved_tensors
        grad_hidden = grad.to(hidden.dtype) @ w
        grad_w = grad.T.to(hidden.dtype) @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w


def sum_over_tp(x, tp_mesh):
    """All-reduce in forward, identity in backward: every tp rank computes the same loss from it."""
    return DTensor.from_local(x, tp_mesh, [Partial()]).full_tensor()


def logprobs_and_entropy(hidden, weight, targets, temperature, tp_mesh, kept=None, banned=None):
    """Per token: log p(target), entropy of softmax(hidden @ weight.T / T) and log of the kept sets' mass; weight
    sharded over tp by vocabulary. With `kept`, the ids [C, K] each token was sampled from (-1 beyond its set), log p
    is renormalised over them. With `banned`, a list of ids that no engine samples (the vision tokens), the softmax
    is without them, as the engines' (their logits -inf): their probability 0."""
    # Backward sums hidden's gradient over tp (Partial): each rank's slice of the vocabulary adds its part.
    local_hidden = hidden.to_local(grad_placements=[Partial()])
    logits = FP32Logits.apply(local_hidden, weight.to_local()) / temperature  # [C, V / tp]
    slice_start = tp_mesh.get_local_rank() * math.ceil(weight.shape[0] / tp_mesh.size())  # this rank's first id
    if banned is not None:  # the least float, not -inf: exp gives 0 all the same, and 0 x it is 0 (entropy's sum)
        local = torch.tensor(banned, device=logits.device) - slice_start
        least = torch.finfo(logits.dtype).min
        logits = logits.index_fill(1, local[(local >= 0) & (local < logits.shape[1])], least)
    max_logit = DTensor.from_local(logits.detach().amax(-1), tp_mesh, [Partial("max")]).full_tensor()
    exp = torch.exp(logits - max_logit[:, None])
    sum_exp = sum_over_tp(exp.sum(-1), tp_mesh)
    target_logit = sum_over_tp(slice_values(logits, targets[:, None], slice_start).squeeze(-1), tp_mesh)
    log_z = max_logit + sum_exp.log()
    entropy = log_z - sum_over_tp((exp * logits).sum(-1), tp_mesh) / sum_exp
    log_z_sampled = log_z  # the normaliser of the distribution sampled from
    if kept is not None:  # a set spans the vocabulary's slices: each rank sums the exp of its own ids
        kept_logits = slice_values(logits, kept, slice_start, -math.inf)
        # Shifted by the set's own largest logit: a set far below the vocabulary's (a drifted policy, the reference)
        # would sum to 0 in fp32 under the vocabulary's.
        kept_max = DTensor.from_local(kept_logits.detach().amax(-1), tp_mesh, [Partial("max")]).full_tensor()
        kept_exp = sum_over_tp(torch.exp(kept_logits - kept_max[:, None]).sum(-1), tp_mesh)
        log_z_sampled = kept_max + kept_exp.log()
    return target_logit - log_z_sampled, entropy, log_z_sampled - log_z


def slice_values(logits, ids, slice_start, outside=0.0):
    """logits [C, V / tp] at ids [C, K] of the full vocabulary, `outside` where an id is another rank's."""
    in_slice = (ids >= slice_start) & (ids < slice_start + logits.shape[1])
    values = logits.gather(-1, (ids - slice_start).clamp(0, logits.shape[1] - 1))
    return values.masked_fill(~in_slice, outside)


def chunked_logprobs(hidden, lm_head_weight, targets, kept, temperature, chunk, tp_mesh, banned=None):
    """Log-probs, entropies and log kept masses [N] of `targets` from the final hidden states [N, H], the same on
    every tp rank, and the whole lm_head weight [V, H]; `chunk` tokens at a time. `kept`: the kept sets [N, K] of
    kept_sets, or None without truncated sampling; `banned`: ids no engine samples, or None."""
    # lm_head, a root parameter, stays unsharded until backward; as DTensors, backward gathers its grad, sums hidden's.
    weight = DTensor.from_local(lm_head_weight, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(0)])
    hidden = DTensor.from_local(hidden, tp_mesh, [Replicate()])
    compute = logprobs_and_entropy
    if torch.is_grad_enabled():
        # Recomputed in backward: one chunk's fp32 logits [chunk, V / tp] are alive at a time.
        compute = functools.partial(torch.utils.checkpoint.checkpoint, logprobs_and_entropy, use_reentrant=False)
    results = []
    for i in range(0, max(len(targets), 1), chunk):  # one, empty, where no token was sampled
        end = i + chunk
        chunk_kept = None if kept is None else kept[i:end]
        results.append(compute(hidden[i:end], weight, targets[i:end], temperature, tp_mesh, chunk_kept, banned))
    return [torch.cat(values) for values in zip(*results)]


def sampled_tokens(hidden_states, samples):
    """The sampled response tokens of `samples` (a micro-batch: each row its prompt, then its response, then
    padding) [N], and the hidden states that predict them [N, H]: position t predicts token t + 1. Tool output,
    which was not sampled, is left out."""
    device = hidden_states.device
    positions = []
    for row, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        positions.append(hidden_states[row, start : start + len(s.response_ids)])
    sampled = torch.tensor([m for s in samples for m in s.sampled], dtype=torch.bool, device=device)
    targets = torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.long, device=device)
    return torch.cat(positions)[sampled], targets[sampled]


def kept_sets(samples):
    """The samples' kept sets (train.Sample's kept_ids, one set after another, and kept_sizes) as [sampled tokens,
    the largest set] of ids, -1 beyond a token's set."""
    sizes = torch.cat([s.kept_sizes for s in samples]).long()
    ids = torch.cat([s.kept_ids for s in samples]).long()
    sampled = sum(s.num_sampled for s in samples)
    if len(sizes) != sampled:  # an engine that breaks Engine.generate's contract
        raise RuntimeError(f"the engine reported {len(sizes)} kept sets for {sampled} sampled tokens")
    token = torch.arange(len(sizes)).repeat_interleave(sizes)  # the token each id is kept for
    first = (sizes.cumsum(0) - sizes).repeat_interleave(sizes)  # where that token's set starts in `ids`
    width = max(sizes.tolist(), default=1)  # at least 1: a micro-batch without tokens still reduces over it
    padded = torch.full((len(sizes), width), -1)
    padded[token, torch.arange(len(ids)) - first] = ids
    return padded
