"""The engines that generate rollouts for train.py: HF generate on a CPU, in-process SGLang on GPUs.

One engine per TP group of the trainer, run by the group's first rank (the owner). train.py asks it for samples
(generate), hands it memory back and forth (release_memory before training, begin_update / end_update around a
push) and pushes the new weights in buckets (update) after every step. This is machinery a researcher rarely edits:
the interface is Engine's, and start_engine picks the engine for --engine.
"""

import importlib.util
import itertools
import os
import signal
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, StoppingCriteria, StoppingCriteriaList

import architectures
import launch
import lora
import stopping
import vision

# Truncated sampling keeps at most this many tokens per sampled token (--top_k's bound, and with --top_p alone its
# value): the trainer stores each kept set (as prime-rl, whose default it is), and SGLang reports them up to a bound.
MAX_KEPT = 512


class Engine:
    """What the trainer asks of an engine. generate() runs on the TP group's first rank, the owner; every rank of
    the group calls the rest. Memory and update calls that an engine does not need do nothing here."""

    push_dtype = torch.float32  # of the pushed tensors

    def pieces(self, weights, bucket_bytes):
        """(HF name, full tensor) pairs as the engine loads them: here, as the trainer names them."""
        return weights

    def generate(self, prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None, images=None):
        """Per prompt: the sampled ids, stop included, their log-probs under logits / temperature, and with top_p < 1
        or top_k > 0 each token's kept set (the ids it was drawn from), the ids one set after another and the sets'
        sizes, the log-probs renormalised over them; without truncation the sets are empty. Then, with routing_from
        (a position per prompt), the experts each MoE layer chose at every position from there up to the last
        input token and at each new token but the last: [positions, layers, k] of architectures.routing_dtype;
        without, empty. `images`: each prompt's images' inputs (vision.encode_prompt's; None for a text prompt),
        whose image tokens the prompt holds; with them, no vision token is sampled, and the log-probs are of the
        softmax without them."""
        raise NotImplementedError

    def release_memory(self):
        """Weights and KV cache freed for training (after the rollouts)."""

    def begin_update(self):
        """Before a push: the weights' memory back."""

    def update(self, bucket, group):
        """One bucket of (HF name, full tensor) pairs, on every rank of the TP group `group`."""
        raise NotImplementedError

    def end_update(self):
        """After a push: the cache flushed, the KV cache's memory back."""

    def shutdown(self):
        """The engine's processes ended."""


class IdleEngine(Engine):
    """On an HF engine's TP group, the ranks but the first: the owner generates for them, and loads its own copy."""

    def update(self, bucket, group):
        pass


class HFEngine(Engine):
    """HF generate on the owner's unsharded fp32 copy of the policy; the push hands it each bucket as a state dict."""

    batch_bytes = 1 << 30  # generate keeps every step's fp32 logits [prompts, T, V]: this much at most, then batches

    def __init__(self, model_config, device, tower=None):
        self.tower = tower
        if tower is None:
            self.model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        else:  # prompts with images: the vision-language model, its tower the trainer's (frozen)
            self.model = AutoModelForImageTextToText.from_config(tower.vlm_config, dtype=torch.float32)
            self.model.model.visual.load_state_dict(tower.state_dict())
        self.model = self.model.to(device).eval()
        architectures.record_routing(self.model)  # an MoE model's routers say what they chose

    def update(self, bucket, group):
        weights = dict(bucket) if self.tower is None else {vision.vlm_name(name): w for name, w in bucket}
        self.model.load_state_dict(weights, strict=False)  # check_engine_names vouches for the names

    def generate(self, prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None, images=None):
        logits_bytes = max(budgets) * self.model.config.get_text_config().vocab_size * 4
        batch = max(1, self.batch_bytes // logits_bytes)
        sampling = {}
        if temperature > 0:
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)  # top_k 0: off
        outputs = []
        for i in range(0, len(prompts), batch):  # each batch seeded afresh
            part = slice(i, i + batch)
            routing = None if routing_from is None else routing_from[part]
            inputs = self.image_inputs(None if images is None else images[part])
            outputs += self.generate_batch(prompts[part], budgets[part], sampling, stop_ids, seed + i, routing, inputs)
        return outputs

    def image_inputs(self, images):
        """With a vision tower: generate's inputs for the images of a batch's prompts (each prompt's, or None), in
        prompt order, and the vision tokens banned, text prompts' too."""
        if self.tower is None:
            return {}
        inputs = dict(suppress_tokens=vision.vision_token_ids(self.tower.vlm_config))
        images = [image for image in images or [] if image is not None]
        if images:
            device = self.model.device
            inputs["pixel_values"] = torch.cat([image["pixel_values"] for image in images]).to(device)
            inputs["image_grid_thw"] = torch.cat([image["image_grid_thw"] for image in images]).to(device)
        return inputs

    def generate_batch(self, prompts, budgets, sampling, stop_ids, seed, routing_from, image_inputs):
        ids, mask = launch.padded(prompts, self.model.device, left=True)
        longest = ids.shape[1]
        if "pixel_values" in image_inputs:  # which tokens are an image's (1), or text (0)
            image_inputs["mm_token_type_ids"] = (ids == self.tower.vlm_config.image_token_id).long()
        self.model.routed.clear()
        with torch.random.fork_rng(devices=[]):  # seeded sampling that leaves the global RNG alone
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(budgets),
                eos_token_id=stop_ids,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
                stopping_criteria=StoppingCriteriaList([StopAsked()]),
                **sampling,
                **image_inputs,
            )
        # What was sampled from: logits / temperature, -inf where top_k or top_p removed a token.
        scores = torch.stack(out.scores, 1).float()  # [N, T, V]
        truncated = sampling.get("top_p", 1.0) < 1 or sampling.get("top_k", 0) > 0  # greedy: nothing in `sampling`
        routed = self.routed_positions(len(prompts)) if routing_from is not None else None
        results = []
        for b, (seq, budget, seq_scores) in enumerate(zip(out.sequences[:, longest:].tolist(), budgets, scores)):
            seq = seq[:budget]  # a budget below the batch's longest
            stop = next((t for t, token in enumerate(seq) if token in stop_ids), None)
            if stop is not None:
                seq = seq[: stop + 1]
            seq_scores = seq_scores[: len(seq)]
            logprobs = torch.log_softmax(seq_scores, -1)[torch.arange(len(seq)), seq].cpu()
            kept_ids = torch.zeros(0, dtype=torch.int32)
            kept_sizes = torch.zeros(0, dtype=torch.int32)
            if truncated:
                kept = torch.isfinite(seq_scores)  # [tokens, V]
                kept_ids = kept.nonzero()[:, 1].int().cpu()  # row by row, each row's ids
                kept_sizes = kept.sum(1, dtype=torch.int32).cpu()
            routing = torch.zeros(0, dtype=torch.uint8)
            if routed is not None:  # from routing_from[b] to the last position that produced a kept token
                start = longest - len(prompts[b]) + routing_from[b]  # past the row's left padding
                routing = routed[b, start : longest + len(seq) - 1]
            results.append((seq, logprobs, kept_ids, kept_sizes, routing))
        return results

    def routed_positions(self, rows):
        """The routers' choices [rows, positions, layers, k] of this batch's forwards, at every position they ran:
        the left-padded prefill's, then one a decoding step (0 in a layer without routed experts)."""
        config = self.model.config.get_text_config()  # a vision-language model's: its language model's
        routing = None
        for layer, (prefill, *steps) in self.model.routed.items():  # [rows x longest, k], then [rows, k] a step
            chosen = torch.cat([prefill.view(rows, -1, prefill.shape[-1]), *(step[:, None] for step in steps)], 1)
            if routing is None:
                routing = chosen.new_zeros(rows, chosen.shape[1], config.num_hidden_layers, chosen.shape[-1])
            routing[:, :, layer] = chosen
        return routing.cpu().to(architectures.routing_dtype(config))


class StopAsked(StoppingCriteria):
    """Looked at by HF generate after each token: the rollouts given up there (stopping.Interrupted) once a stop
    leaves no time to finish the step. It never ends a sequence itself."""

    def __call__(self, input_ids, scores, **kwargs):
        stopping.check()
        return torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)


def start_engine(cfg, model_config, par, device, tower=None):
    """One engine per TP group, run by its first rank; the group's other ranks hold what takes part in a push. With
    a vision tower, prompts with images."""
    free_gpu_cache(par.tp_group)  # SGLang sizes itself from the free memory it sees at start
    owner = par.mesh["tp"].get_local_rank() == 0
    if cfg.engine == "hf" and owner:
        return HFEngine(model_config, device, tower)
    if cfg.engine == "hf":
        return IdleEngine()
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if torch.cuda.is_available():
        # On every rank that sends shards: CUDA IPC handles name GPUs by UUID, as the engine's side expects.
        monkey_patch_torch_reductions()
    first_gpu = int(os.environ.get("LOCAL_RANK", 0))  # the TP group's first GPU, on the owner
    with socket.socket() as port:
        # Free (or --engine_port's), and held until every engine of the node has its own.
        port.bind(("127.0.0.1", cfg.engine_port + first_gpu if cfg.engine_port else 0))
        nccl_port = port.getsockname()[1]
        dist.barrier(group=par.world_group)
    if owner:
        return SGLangEngine(cfg, model_config, first_gpu, nccl_port, tower)
    return SGLangPeer(model_config, tower)


class SGLangPeer(Engine):
    """The ranks of an SGLang TP group but the first: each sends its bucket to the owner, which loads them all."""

    push_dtype = torch.bfloat16

    def __init__(self, model_config, tower=None):
        self.model_config = model_config
        self.tower = tower

    def pieces(self, weights, bucket_bytes):
        """As SGLang's class for the architecture loads them (architectures.engine_weights: per-expert names); with a
        vision tower, its weights too, under the checkpoint's names: the engine frees them with the others at each
        release, so every push brings them back."""
        for name, weight in weights:
            yield from architectures.engine_weights(self.model_config, name, weight, bucket_bytes)
        if self.tower is not None:
            yield from vision.tower_weights(self.tower, self.push_dtype)

    def update(self, bucket, group):
        gather_bucket(bucket, group)


def gather_bucket(bucket, group):
    """Every rank's bucket, serialized by CUDA IPC handle, to the group's first rank (None elsewhere). Engine TP
    rank i reads trainer rank i's copy, from its own GPU."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    owner = dist.get_rank(group) == 0
    ranks = [None] * dist.get_world_size(group) if owner else None
    serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
    dist.gather_object(serialized, ranks, dst=dist.get_global_rank(group, 0), group=group)
    return ranks


class SGLangEngine(SGLangPeer):
    """In-process SGLang on the TP group's GPUs, run by the owner; bf16 buckets come by CUDA IPC, not through disk."""

    def __init__(self, cfg, model_config, first_gpu, nccl_port, tower=None):
        import sglang

        super().__init__(model_config, tower)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # or its schedulers hang joining torchrun's store
        os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "false"  # GPUs >10% apart in free memory: safe
        config_dir = os.path.join(cfg.out_dir, f"engine_model_rank{dist.get_rank()}")  # read from disk by SGLang
        config = architectures.engine_config(model_config)
        if tower is None:
            config.save_pretrained(config_dir)
        else:  # prompts with images: the vision-language class, and the processor its image path builds
            vision.save_engine_model(cfg, tower, config, config_dir)
        if tower is not None and tower.trained:  # SGLang's cache of image features would outlive the tower's weights
            os.environ["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
        # The engine's processes inherit ignored stop signals (SIGINT, SIGTERM, SIGUSR1): a stop is the trainer's to
        # act on, and torchrun and batch systems send their signals to every process.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stopping.SIGNALS}
        routing = {}  # --routing_replay: its capturer of each token's experts, started with the engine
        if cfg.routing_replay != "off":
            routing["enable_return_routed_experts"] = True
        self.engine = sglang.Engine(
            model_path=config_dir,
            load_format="dummy",  # the first push brings the weights
            skip_tokenizer_init=True,
            dtype="bfloat16",
            tp_size=cfg.tp,
            dp_size=1,
            base_gpu_id=first_gpu,
            nccl_port=nccl_port,
            random_seed=cfg.seed + dist.get_rank(),
            enable_memory_saver=True,
            mem_fraction_static=cfg.mem_fraction,
            log_level="error",
            enable_fp32_lm_head=True,  # logits in fp32 from bf16 inputs, as the trainer's (sglang 0.5.3 and newer)
            **routing,
        )
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # The first request starts SGLang's event loop, which installs its own SIGTERM handler: the trainer's wins.
        self.engine.generate(input_ids=[[0]], sampling_params={"max_new_tokens": 1})

    def generate(self, prompts, budgets, temperature, top_p, top_k, stop_ids, seed, routing_from=None, images=None):
        # Seeded at start, by --seed. With routing_from, the routed experts of every sequence from the least of them.
        banned = {}
        if self.tower is not None:  # no vision token sampled; SGLang's log-probs are then over the others
            banned["logit_bias"] = {str(i): float("-inf") for i in vision.vision_token_ids(self.tower.vlm_config)}
        sampling = []
        for budget in budgets:
            params = dict(temperature=temperature, top_p=top_p, stop_token_ids=stop_ids, max_new_tokens=budget)
            if top_k > 0:
                params["top_k"] = top_k
            sampling.append(params | banned)
        request = self.image_request(images)
        if routing_from is not None:
            request.update(return_routed_experts=True, routed_experts_start_len=min(routing_from))
        if temperature > 0 and (top_p < 1 or top_k > 0):
            outputs = self.interruptible(self.generate_truncated, prompts, sampling, request)
        else:
            request.update(input_ids=prompts, sampling_params=sampling, return_logprob=True)
            outputs = self.interruptible(self.engine.generate, **request)
        results = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            kept_ids = kept_sizes = torch.zeros(0, dtype=torch.int32)
            if "output_token_sampling_mask" in meta:
                kept = meta["output_token_sampling_mask"]  # per output token, the stop's too: the ids it was drawn from
                kept_ids = torch.tensor(list(itertools.chain.from_iterable(kept)), dtype=torch.int32)
                kept_sizes = torch.tensor([len(row) for row in kept], dtype=torch.int32)
                logprobs = meta["output_token_sampling_logprobs"]  # log p less the kept set's log mass
            else:
                logprobs = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
            experts = torch.zeros(0, dtype=torch.uint8)
            if routing_from is not None:
                experts = routed_experts(meta["routed_experts"], self.model_config)[
                    routing_from[i] - min(routing_from) :
                ]
            results.append(
                (out["output_ids"], torch.tensor(logprobs, dtype=torch.float32), kept_ids, kept_sizes, experts)
            )
        return results

    @staticmethod
    def image_request(images):
        """Each prompt's images (vision.encode_prompt's inputs, or None) as SGLang takes them with the prompt's
        expanded ids: processed, whose pixels and grid its processor takes as they are. Never the raw images: with
        expanded ids, SGLang's processor would expand each pad again and run out of images, and hang (or raise with
        one worker thread)."""
        if images is None or all(image is None for image in images):
            return {}
        processed = [[] if image is None else [dict(image, format="processor_output")] for image in images]
        return {"image_data": processed}

    def interruptible(self, generate, *args, **kwargs):
        """generate(*args, **kwargs), its requests aborted once a stop leaves no time to finish the step (looked at
        every second while the engine's event loop runs them): then stopping.Interrupted."""
        self.aborted = False
        self.watcher = self.engine.loop.call_later(1.0, self.watch)
        try:
            outputs = generate(*args, **kwargs)
        except Exception:
            if not self.aborted:
                raise
        finally:
            self.watcher.cancel()
        if self.aborted:  # SGLang answers aborted requests with what they had, or raises for those it had not run
            raise stopping.Interrupted
        return outputs

    def watch(self):
        """Once a stop is due, every request in flight aborted; again each second, as an abort sent before the call's
        own requests reached the engine ends none of them."""
        if stopping.STOP.due():
            self.aborted = True
            self.engine.tokenizer_manager.abort_request(abort_all=True)
        self.watcher = self.engine.loop.call_later(1.0, self.watch)

    def generate_truncated(self, prompts, sampling, request):
        """Top-p / top-k sampling with each token's kept set, and its log-prob renormalised over that set, as SGLang
        reports them (return_sampling_mask). Engine.generate has no keyword for it: the request is sent as it sends
        its own. A kept set must be at most --sampling-mask-max-tokens (4096), which MAX_KEPT keeps it under."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = GenerateReqInput(input_ids=prompts, sampling_params=sampling, return_sampling_mask=True, **request)
        replies = self.engine.tokenizer_manager.generate_request(request, None)
        return self.engine.loop.run_until_complete(replies.__anext__())

    def release_memory(self):
        self.engine.release_memory_occupation(tags=["kv_cache", "weights"])

    def begin_update(self):
        self.engine.resume_memory_occupation(tags=["weights"])  # freed, not kept: every weight is pushed
        if hasattr(self.engine, "begin_weight_update"):  # sglang >= 0.5.21: updates need a session
            self.engine.begin_weight_update()

    def update(self, bucket, group):
        ranks = gather_bucket(bucket, group)
        result = self.engine.update_weights_from_tensor(ranks, load_format="flattened_bucket", flush_cache=False)
        if not result[0]:  # SGLang reports a failed weight update as (False, why) rather than raising
            raise RuntimeError(f"SGLang weight update failed: {result[1]}")

    def end_update(self):
        if hasattr(self.engine, "end_weight_update"):
            self.engine.end_weight_update()
        self.engine.flush_cache()  # cached prefixes were computed with the old weights
        self.engine.resume_memory_occupation(tags=["kv_cache"])

    def shutdown(self):
        self.engine.shutdown()  # and its scheduler processes


def routed_experts(encoded, config):
    """SGLang's routed experts of a request (meta_info["routed_experts"]: int32 [positions, layers, k] in base64,
    from its routed_experts_start_len to the last token but one) as the trainer keeps them."""
    import pybase64

    experts = np.frombuffer(pybase64.b64decode(encoded), dtype=np.int32)
    experts = experts.reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)
    return torch.from_numpy(experts.copy()).to(architectures.routing_dtype(config))


def extend_samples(engine, samples, budgets, stop_ids, temperature, seed, version, cfg):
    """One engine call, on the engine's rank: each response of `samples` (train.Sample) goes on by at most its
    budget, and the tokens it gets are appended as sampled, with their log-probs, their kept sets (--top_p or
    --top_k; at most MAX_KEPT a token), the experts routing chose (--routing_replay) and `version`, the step whose
    policy sampled them. Returns each sample's new tokens."""
    top_k = cfg.top_k
    if cfg.top_p < 1 and top_k == 0:  # the kept sets bounded
        top_k = MAX_KEPT
    prompts = [s.prompt_ids + s.response_ids for s in samples]
    # --routing_replay: the engine reports its experts at each sample's positions from the first not yet routed.
    routing_from = [len(s.routing) for s in samples] if cfg.routing_replay != "off" else None
    images = {}  # prompts with images: each prompt's inputs
    if any(s.images is not None for s in samples):
        images["images"] = [s.images for s in samples]
    outputs = engine.generate(prompts, budgets, temperature, cfg.top_p, top_k, stop_ids, seed, routing_from, **images)
    for s, (ids, logprobs, kept_ids, kept_sizes, routing) in zip(samples, outputs):
        s.response_ids += ids
        s.sampled += [True] * len(ids)
        s.engine_logprobs = torch.cat([s.engine_logprobs, logprobs])
        s.versions = torch.cat([s.versions, torch.full((len(ids),), version, dtype=torch.int32)])
        s.kept_ids = torch.cat([s.kept_ids, kept_ids])
        s.kept_sizes = torch.cat([s.kept_sizes, kept_sizes])
        s.routing = torch.cat([s.routing, routing])
    return [ids for ids, *_ in outputs]


def check_engine_flags(cfg):
    """What --engine sglang needs, checked before any model loads: a CUDA GPU, the package, a TP group on one node."""
    if cfg.engine != "sglang":
        return
    if not torch.cuda.is_available():
        raise SystemExit("--engine sglang needs a CUDA GPU: use --engine hf here")
    if importlib.util.find_spec("sglang") is None:
        raise SystemExit("--engine sglang needs SGLang (pip install -r requirements.txt), or use --engine hf")
    if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) % cfg.tp:
        raise SystemExit(f"--tp {cfg.tp} must divide the GPUs per node: an engine's TP group lives on one node")


def free_gpu_cache(group):
    """Freed GPU memory (IPC handles released by the engine too) back to the device, then wait for the group."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    dist.barrier(group=group)


def full_weights(model, dtype):
    """(HF name, full tensor in `dtype`) of each weight the engine holds, one at a time: shards cast, then gathered,
    LoRA's adapters merged in."""
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        weight = param.detach().to(dtype)
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        yield name, lora.merge_adapter(model, name, weight)


def weight_buckets(weights, bucket_bytes):
    """(name, tensor) pairs from `weights` in lists of about bucket_bytes."""
    bucket = []
    for name, weight in weights:
        bucket.append((name, weight))
        if sum(tensor.nbytes for _, tensor in bucket) >= bucket_bytes:
            yield bucket
            bucket = []
    if bucket:
        yield bucket


def push_weights(model, engine, bucket_mb, tp_group):
    """The model's weights (full_weights, in engine.push_dtype) into the engine in buckets of --bucket_mb; the
    engine's memory was released at the rollouts' end. Every rank of the TP group runs it."""
    free_gpu_cache(tp_group)  # the trainer's cached blocks back to the GPU before the engine's weights come back
    weights = full_weights(model, engine.push_dtype)
    engine.begin_update()
    for bucket in weight_buckets(engine.pieces(weights, bucket_mb << 20), bucket_mb << 20):
        engine.update(bucket, tp_group)
        dist.barrier(group=tp_group)  # the others gather the next bucket only once the owner has loaded this one
    del bucket  # the last: nothing of the push stays referenced
    free_gpu_cache(tp_group)  # the buckets' memory back to the GPU before the engine's KV cache comes back
    engine.end_update()
