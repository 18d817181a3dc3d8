"""engines.SGLangEngine's truncated sampling through sglang 0.5.23's own sampling-mask path on CPU, for
tests/test_sglang_contract.py. Run as a script: python tests/sglang_sampling_mask.py OUT.json.

What is real (sglang's code, unchanged): the trainer's SGLangEngine.generate and its GenerateReqInput;
GenerateReqInput.normalize_batch_and_arguments and its split into requests; SamplingParams (normalize, verify) and Req,
built from each request as TokenizerManager._create_tokenized_object and the scheduler build them;
SamplingBatchInfo.from_schedule_batch; the Sampler on the "pytorch" backend (top-k / top-p, the sampling mask and
its log-probs); the scheduler's result processing of the mask (materialize_sampling_mask_output,
get_sampling_mask_finish_reason, add_sampling_mask_return_values) and Req.update_finish_state (stop ids);
SchedulerOutputStreamer.stream_output and sock_send's pickle over the wire; TokenizerManager._handle_batch_output,
which turns the mask into meta_info's lists.

What is replaced: the model (logits drawn at random, a stop id made likely at the third step), the zmq socket (a list),
the ScheduleBatch (an object holding the requests), the TokenizerManager instance (its real method on an object given
the attributes it reads), the engine's event loop and generate_request (run here, as sglang.Engine runs them), and
the scheduler's admission check of the mask request (scheduler.py, Scheduler._handle_generate_request), restated.
"""

import asyncio
import json
import os
import pickle
import socket
import sys
import warnings
from array import array

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(TESTS, "sglang_cpu_stubs"), os.path.dirname(TESTS)]  # torchvision, vllm; the repo
warnings.simplefilter("ignore")

import torch  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.distributed import bootstrap  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers import tokenizer_manager  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper  # noqa: E402
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

import engines  # noqa: E402

VOCAB = 1000
STOP = 7  # made likely at the third step: every response ends there with its stop id
# (temperature, top_p, top_k) as train.generate_rollouts passes them: --top_p alone comes with top_k 512.
SETTINGS = [(0.7, 0.9, 512), (1.3, 1.0, 5), (1.0, 0.8, 20)]


class Socket:
    """The scheduler's socket to the tokenizer side: what is sent, kept."""

    def __init__(self):
        self.sent = []

    def send_pyobj(self, obj, flags=0, protocol=pickle.DEFAULT_PROTOCOL):
        self.sent.append(pickle.dumps(obj, protocol))


class Scheduler:
    """Runs a batch of requests: the model's logits drawn here, the rest sglang's scheduler-side code."""

    def __init__(self, server_args):
        self.server_args = server_args
        self.sampler = Sampler()
        self.logits = []  # per call: [request][step] of the logits each token was sampled from

    def run(self, requests):
        reqs = []
        for request in requests:
            params = SamplingParams(**request.sampling_params)
            params.normalize(None)
            params.verify(VOCAB)
            top_k, cap = params.top_k, self.server_args.sampling_mask_max_tokens
            assert top_k == 1 or 1 < top_k <= cap, "rejected by the scheduler's admission check"
            mode = request.sampling_logprobs_mode or "selected"  # TokenizerManager's default
            ids = array("q", request.input_ids)
            reqs.append(
                Req(
                    request.rid,
                    "",
                    ids,
                    params,
                    return_sampling_mask=request.return_sampling_mask,
                    sampling_logprobs_mode=mode,
                )
            )
        batch = type("Batch", (), {})()  # the penalizer keeps a weak reference to it
        batch.device = "cpu"
        logits = [[] for _ in reqs]
        step = 0
        while running := [i for i, req in enumerate(reqs) if not req.finished()]:
            batch.reqs = [reqs[i] for i in running]
            step_logits = torch.randn(len(running), VOCAB) * 1.5
            step_logits[:, STOP] += 15.0 * (step == 2)
            out = LogitsProcessorOutput(next_token_logits=step_logits.clone())  # the sampler works in place
            info = SamplingBatchInfo.from_schedule_batch(batch, VOCAB)
            positions = torch.zeros(len(running), dtype=torch.long)
            next_ids = self.sampler(out, info, False, [0] * len(running), [None] * len(running), positions)
            SchedulerBatchResultProcessor.materialize_sampling_mask_output(batch.reqs, out)
            for row, (i, req) in enumerate(zip(running, batch.reqs)):
                status = out.next_token_sampling_mask_status[row]
                assert SchedulerBatchResultProcessor.get_sampling_mask_finish_reason(None, status=status) is None
                req.output_ids.append(int(next_ids[row]))
                req.update_finish_state(1)
                SchedulerBatchResultProcessor.add_sampling_mask_return_values(None, row, req, out, accept_len=1)
                logits[i].append(step_logits[row].tolist())
            step += 1
        self.logits.append(logits)
        wire = Socket()
        streamer = SchedulerOutputStreamer(
            send_to_detokenizer=SenderWrapper(wire),
            tree_cache=None,
            server_args=self.server_args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_hicache_storage=lambda: False,
        )
        streamer.stream_output(reqs, return_logprob=False)
        return [pickle.loads(sent) for sent in wire.sent]


class Engine:
    """sglang.Engine as SGLangEngine.generate_truncated uses it: its loop and its tokenizer manager's
    generate_request, which here hands the requests to Scheduler and the replies to TokenizerManager's own code."""

    def __init__(self, scheduler):
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = self
        self.scheduler = scheduler

    async def generate_request(self, obj, request):
        obj.normalize_batch_and_arguments()
        requests = [obj[i] for i in range(obj.batch_size)]
        manager = object.__new__(tokenizer_manager.TokenizerManager)
        manager.enable_metrics, manager.incremental_streaming_output = False, False
        manager.dump_requests_folder = manager.crash_dump_folder = None
        manager.config_value, manager.enable_lora = (lambda name: None), False
        states = {}  # the manager forgets a request once it has finished
        for r in requests:
            states[r.rid] = tokenizer_manager.ReqState(
                out_list=[],
                finished=False,
                event=asyncio.Event(),
                obj=r,
                time_stats=tokenizer_manager.APIServerReqTimeStats(disagg_mode=DisaggregationMode.NULL),
            )
        manager.rid_to_state = dict(states)
        for reply in self.scheduler.run(requests):
            await manager._handle_batch_output(reply)
        yield [states[r.rid].out_list[-1] for r in requests]


def main(out_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = os.path.join(os.path.dirname(out_path), "model")
    os.makedirs(folder, exist_ok=True)
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=VOCAB, hidden_size=8)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    server_args = ServerArgs(model_path=folder, device="cpu", sampling_backend="pytorch", skip_tokenizer_init=True)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port)
    torch.manual_seed(0)
    scheduler = Scheduler(server_args)
    engine = object.__new__(engines.SGLangEngine)  # the trainer's class, on the stand-in engine
    engine.engine = Engine(scheduler)
    engine.tower = None  # a text model, as SGLangEngine.__init__ (not run here) would keep it
    calls = []
    for temperature, top_p, top_k in SETTINGS:
        outputs = engine.generate([[1, 2, 3], [4, 5]], [6, 6], temperature, top_p, top_k, [STOP], seed=0)
        calls.append(
            dict(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                logits=scheduler.logits[-1],
                outputs=[(ids, lp.tolist(), kept.tolist(), sizes.tolist()) for ids, lp, kept, sizes, _ in outputs],
                dtypes=[(str(lp.dtype), str(kept.dtype), str(sizes.dtype)) for _, lp, kept, sizes, _ in outputs],
            )
        )
    with open(out_path, "w") as f:
        json.dump(calls, f)


if __name__ == "__main__":
    main(sys.argv[1])
