"""CPU stand-ins for sglang.Engine, which cannot start without a GPU: everything else engines.SGLangEngine uses is
the real sglang package (its serializer, tensor buckets and process teardown). The fakes follow the behaviour of sglang
0.5.17 / 0.5.23 described in tests/sglang_api.md and record every call in `engine.calls`, in order. As sglang's
TP rank 0 does (its rendezvous store), an engine holds its nccl_port from start to shutdown, and fails to start when
the port is taken; it records the environment its processes would inherit (`environ`).

Engine: 0.5.17 (no weight-update session). SessionEngine: 0.5.21+ (begin/end_weight_update, and updates outside a
session fail). FailingEngine: every weight update reports (False, "boom")."""

import asyncio
import json
import os
import signal
import socket
from collections import namedtuple

import numpy as np
import pybase64
import torch
from sglang.srt.utils import MultiprocessingSerializer, kill_process_tree
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

# ServerArgs fields (both versions); a name outside them is a TypeError, as for the real dataclass.
SERVER_ARGS = {
    "model_path",
    "load_format",
    "skip_tokenizer_init",
    "tp_size",
    "dp_size",
    "base_gpu_id",
    "gpu_id_step",
    "nccl_port",
    "dist_init_addr",
    "port",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "mem_fraction_static",
    "random_seed",
    "attention_backend",
    "sampling_backend",
    "log_level",
    "disable_cuda_graph",
    "context_length",
    "dtype",
    "enable_deterministic_inference",
    "custom_sigquit_handler",
    "enable_fp32_lm_head",
    "enable_return_routed_experts",
}
SAMPLING_PARAMS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "logit_bias",
    "sampling_seed",
}
MEMORY_TAGS = ["kv_cache", "weights", "cuda_graph"]
STARTED = []  # every engine started in this process, so that a test can close the ports they hold
FlushCacheReqOutput = namedtuple("FlushCacheReqOutput", "success message")


class Engine:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - SERVER_ARGS
        if unknown:
            raise TypeError(f"unexpected ServerArgs {sorted(unknown)}")
        self.kwargs = kwargs
        # What the engine's spawned processes would inherit.
        self.signals_at_start = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        self.environ = dict(os.environ)
        self.port = socket.socket()
        try:
            self.port.bind(("127.0.0.1", kwargs["nccl_port"]))
        except OSError as error:  # sglang's scheduler dies in its rendezvous, and the Engine fails to start
            self.port.close()
            raise RuntimeError(f"nccl_port {kwargs['nccl_port']} is taken: {error}") from error
        STARTED.append(self)
        with open(os.path.join(kwargs["model_path"], "config.json")) as f:
            self.model_config = json.load(f)  # the architecture comes from disk, as load_format="dummy" needs
        self.tp_size = kwargs.get("tp_size", 1)
        self.weights = [{} for _ in range(self.tp_size)]  # what each TP rank's scheduler loaded: name -> tensor
        self.producers = [set() for _ in range(self.tp_size)]  # pids of the processes whose memory each rank read
        self.offload_tags = set()
        self.calls = []
        self.loop = asyncio.new_event_loop()  # Engine.generate runs the tokenizer manager's coroutines on it
        self.tokenizer_manager = self  # its generate_request and abort_request, here the engine's own
        self.generate_seconds = 0.0  # how long a generate call runs its event loop, as a real one's requests take
        self.aborted = False

    def generate(
        self,
        input_ids=None,
        sampling_params=None,
        return_logprob=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        **unused,
    ):
        """Prompt i: i % 3 == 0 stops after two tokens; 1 runs to max_new_tokens; 2 samples a stop token exactly at
        the limit, which 0.5.17 reports as finish_reason "length". With no stop token ids (the config names no EOS)
        or ignore_eos, every prompt runs to max_new_tokens. With return_routed_experts (the engine started with
        enable_return_routed_experts), meta_info["routed_experts"] as sglang 0.5.23 gives it: int32 [positions,
        layers, top k] in base64, from routed_experts_start_len to the last token but one (ROUTED below names them)."""
        assert not self.offload_tags, f"generate with released memory {self.offload_tags}: garbage or a crash"
        assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in input_ids)
        per_request = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        assert len(per_request) == len(input_ids), "sglang takes one sampling_params, or one per request"
        unknown = set().union(*per_request) - SAMPLING_PARAMS
        if unknown:
            raise TypeError(f"SamplingParams has no {sorted(unknown)}")
        self.calls.append(
            (
                "generate",
                len(input_ids),
                [dict(p) for p in sampling_params] if isinstance(sampling_params, list) else dict(sampling_params),
            )
        )
        if not self.loop.is_running():  # Engine.generate's own wait; generate_request waits in its caller's
            self.aborted = False
            self.loop.run_until_complete(self.running())
        outputs = []
        for i, params in enumerate(per_request):
            limit, stop = params.get("max_new_tokens", 128), sorted(params.get("stop_token_ids", [2]))
            case = 1 if params.get("ignore_eos") or not stop else i % 3
            body = [1000 + 10 * i + j for j in range({0: min(2, limit - 1), 1: limit, 2: limit - 1}[case])]
            ids = body if case == 1 else body + [stop[0]]
            assert not set(body) & set(stop)
            finish = {"type": "stop", "matched": stop[0]} if case == 0 else {"type": "length", "length": limit}
            if self.aborted:  # as sglang answers a running request that abort_request ended: what it had, so far
                ids, finish = ids[:1], {"type": "abort", "message": "Abort before prefill"}
            meta = {
                "id": str(i),
                "finish_reason": finish,
                "prompt_tokens": len(input_ids[i]),
                "completion_tokens": len(ids),
            }
            if return_logprob:
                meta["output_token_logprobs"] = [(-0.01 * (i + 1) - 0.001 * j, t, None) for j, t in enumerate(ids)]
            if return_routed_experts:
                assert self.kwargs.get("enable_return_routed_experts"), "sglang returns no routing it did not capture"
                assert 0 <= routed_experts_start_len <= len(input_ids[i])
                positions = range(routed_experts_start_len, len(input_ids[i]) + len(ids) - 1)
                meta["routed_experts"] = routed_experts(i, positions, self.model_config)
            outputs.append({"output_ids": ids, "meta_info": meta})
        return outputs

    async def running(self):
        """The requests' time on the engine (generate_seconds), during which the event loop runs what is scheduled
        on it; an abort_request(abort_all=True) ends them."""
        deadline = self.loop.time() + self.generate_seconds
        while self.loop.time() < deadline and not self.aborted:
            await asyncio.sleep(0.01)

    def abort_request(self, rid="", abort_all=False):
        """As sglang's TokenizerManager.abort_request: with abort_all, every request in flight ends now."""
        self.calls.append(("abort_request", rid, abort_all))
        self.aborted = self.aborted or abort_all

    async def generate_request(self, obj, request=None):
        """A GenerateReqInput asking for sampling masks, as SGLangEngine.generate_truncated sends it: generate's
        outputs, with meta_info's per-token kept set (the token, and the id before it) and its log-prob renormalised
        over that set (tests/sglang_sampling_mask.py runs sglang's own code for these)."""
        assert obj.return_sampling_mask and request is None
        for params in obj.sampling_params:  # as sglang's scheduler: a mask needs a finite top_k, at most 4096
            if not 1 <= params.get("top_k", -1) <= 4096:
                raise ValueError(f"return_sampling_mask requires finite 1 < top_k <= 4096; got {params}")
        routing = dict(
            return_routed_experts=obj.return_routed_experts, routed_experts_start_len=obj.routed_experts_start_len
        )
        self.aborted = False
        await self.running()
        outputs = self.generate(input_ids=obj.input_ids, sampling_params=obj.sampling_params, **routing)
        for out in outputs:
            ids = out["output_ids"]
            out["meta_info"]["output_token_sampling_mask"] = [[t, t - 1] for t in ids]
            out["meta_info"]["output_token_sampling_logprobs"] = [-0.05 - 0.001 * j for j in range(len(ids))]
        yield outputs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", len(named_tensors), load_format, flush_cache))
        assert "weights" not in self.offload_tags, "weights pushed into released memory are lost"
        assert load_format == "flattened_bucket"
        for r in range(self.tp_size):  # TP rank r deserializes only entry r; a short list is an IndexError
            payload = MultiprocessingSerializer.deserialize(named_tensors[r])
            flat = payload["flattened_tensor"]
            # With the file_system sharing strategy a CPU tensor's shared memory is named after its producer's pid:
            # on a GPU, the process that made the copy is the GPU the engine rank reads from.
            if torch.multiprocessing.get_sharing_strategy() == "file_system":
                self.producers[r].add(flat.untyped_storage()._share_filename_cpu_()[1].decode().split("_")[1])
            bucket = FlattenedTensorBucket(flattened_tensor=flat, metadata=payload["metadata"])
            for name, tensor in bucket.reconstruct_tensors():
                self.weights[r][name] = tensor.clone()
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        return FlushCacheReqOutput(True, "")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", list(tags or MEMORY_TAGS)))
        self.offload_tags.update(tags or MEMORY_TAGS)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", list(tags or MEMORY_TAGS)))
        for tag in tags or MEMORY_TAGS:
            self.offload_tags.remove(tag)  # KeyError for a tag that was not released: the scheduler dies

    def shutdown(self):
        """As sglang's: after stopping its own parts, SIGKILL every child process of the caller."""
        self.calls.append(("shutdown",))
        self.port.close()
        kill_process_tree(os.getpid(), include_parent=False)


class SessionEngine(Engine):
    session = False

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:
            self.calls.append(("update", len(named_tensors), load_format, flush_cache))
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)


class FailingEngine(Engine):
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", len(named_tensors), load_format, flush_cache))
        return False, "boom"


def ROUTED(request, position, layer, choice, experts):
    """The expert the fake engine reports for a request's position, layer and top-k choice."""
    return (7 * request + 5 * position + 3 * layer + choice) % experts


def routed_experts(request, positions, config):
    """meta_info["routed_experts"] of a request: ROUTED's experts at `positions`, int32 [positions, layers, k], base64
    (sglang/srt/state_capturer/routed_experts.py reads it back with np.frombuffer)."""
    experts = config.get("num_experts") or config["num_local_experts"]  # the hub's name, or transformers 5's
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    grid = [
        [[ROUTED(request, p, layer, c, experts) for c in range(top_k)] for layer in range(layers)] for p in positions
    ]
    return pybase64.b64encode(np.array(grid, dtype=np.int32).reshape(-1).tobytes()).decode()
