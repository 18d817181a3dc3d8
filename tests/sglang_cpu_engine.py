"""The real sglang 0.5.23 weight-update path on CPU processes, for tests/test_sglang_contract.py.

What is real (sglang's own code, unchanged):
- engine side, one spawned process per engine TP rank (dp engines of tp ranks each): ServerArgs built from the very
  arguments engines.SGLangEngine passes sglang.Engine (device="cpu" added), publish() of the runtime context, sglang's
  distributed bootstrap on the nccl_port the trainer chose (gloo groups among an engine's ranks), its measurement of
  the memory before the model loads with the TP memory-balance check (bootstrap.measure_pre_model_load_memory, as
  ModelRunner.init_torch_distributed calls it), the dummy-loaded model from sglang.srt.model_loader.get_model,
  SchedulerWeightUpdaterManager, TpModelWorker.deserialize_own_rank and weight_update_runners, the model runner's
  WeightUpdater (begin/end_weight_update, update_weights_from_tensor, _update_weights_from_flattened_bucket), the
  model class's load_weights (Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, and Qwen3.5's and Qwen3.5-MoE's text classes;
  each rank records the names it is given), SchedulerFlushWrapper, and sglang's TypeBasedDispatcher with the
  weight-update and memory entries of Scheduler.init_request_dispatcher;
- on the wire: the io_struct requests and replies, msgpack-encoded by io_struct.msgpack_encode as sock_send does;
- trainer side, dp x tp gloo ranks: launch.parallel_groups, engines.start_engine (called on every rank: the port, the
  barrier; on the owner engines.SGLangEngine: the environment, the engine's config.json, the warm-up request) over
  the real sglang.Engine class, and engines.push_weights of engines.full_weights on the trainer's sharded model (FSDP2 +
  DTensor TP, its config from checkpoint.tokenizer_and_config, loaded by checkpoint.load_weights, its push's names
  checked by architectures.check_engine_names, as main does).

What is replaced:
- sglang.Engine.__init__, which would spawn the scheduler processes: HarnessEngine builds ServerArgs from the same
  arguments and has the engine ranks (already running, to save sglang's import per test) load the model, handing them
  the SGLANG_* and TORCHELASTIC_* variables of the trainer's environment at that moment, as spawned schedulers
  inherit them; the engine processes are reused from test to test, so their groups are built once, on the first
  nccl_port they are given;
- the overlap schedule, off (disable_overlap_schedule=True added to the engine's arguments): with it on, sglang gives
  a Gated DeltaNet model's radix cache an extra buffer for state snapshots, which it supports on CUDA alone; the
  setting touches the scheduling and the cache, not the model or its weights;
- the ZMQ sockets, by multiprocessing queues: QueueTokenizerManager sends each request to every rank of its engine (in
  sglang rank 0 receives it and broadcasts it over the TP group) and, like the tokenizer manager, keeps rank 0's reply;
- the Scheduler, TpModelWorker and ModelRunner objects, by light stand-ins that hold the real components above
  (the real ones need a KV cache, a tokenizer or a GPU); there is no KV cache, so a cache flush only counts, and no
  generation: the tokenizer manager stand-in records a generate request and answers it with no tokens;
- the memory saver is sglang's no-op adapter (torch_memory_saver needs CUDA);
- the free memory sglang's probe reads (get_free_cpu_memory on CPU): engine TP rank r reports FREE_GIB[r], 8 GiB less
  per rank, as GPUs whose trainer ranks hold different shards and caches do, so that the balance check has something
  to find.

The engine ranks also load a model folder from disk as a server of its own would (CPUEngineCluster.serve): sglang's
DefaultModelLoader (load_format "auto") and the class the folder's config.json names, every parameter NaN until the
loader writes it.

An engine rank that raises (sglang's scheduler would crash and SIGQUIT the engine) answers every later request with
its traceback until the next load, which builds a fresh model and manager: the "restarted" engine.
The engine ranks never run sglang's CPU engine branches (SGLANG_USE_CPU_ENGINE stays unset), so the weight loaders
take the branches they take on a GPU; tests/sglang_cpu_stubs/ supplies torchvision and vllm._custom_ops there and to
the trainer ranks, which import sglang.Engine.
"""

import contextlib
import io
import logging
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
import types
import warnings

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
STUBS = os.path.join(TESTS, "sglang_cpu_stubs")
TIMEOUT = 300  # seconds for any one step; starting includes importing sglang (~6 s alone, ~10 s as 4 start at once)
FREE_GIB = (40, 32, 24, 16)  # what engine TP rank r's memory probe reports, in GiB (module docstring)
INHERITED = ("SGLANG_", "TORCHELASTIC_")  # the trainer's variables that reach the engine processes in the harness
HARNESS_ENV = ("SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_USE_CPU_ENGINE")  # the engine ranks' own (engine_rank_main)


def child_sys_path(with_stubs):
    """sys.path of a spawned process: the stubs first where sglang.Engine or a model is imported, then the repo and
    tests/, then the rest, less any folder holding a fake package named sglang (the real one must load)."""
    rest = [p for p in sys.path if p not in (REPO, TESTS, STUBS) and os.path.basename(p) != "fake_sglang"]
    return ([STUBS] if with_stubs else []) + [REPO, TESTS] + rest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KeepWarnings(logging.Handler):
    """Warnings (and worse) appended to `records` as "logger: message"."""

    def __init__(self, records):
        super().__init__(level=logging.WARNING)
        self.records = records

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")


def quiet_logging():
    """sglang's warnings kept in a list (returned to the test), not printed; Python warnings off."""
    warnings.simplefilter("ignore")
    records = []
    for name in ("sglang", "root"):
        log = logging.getLogger(None if name == "root" else name)
        log.handlers[:] = [KeepWarnings(records)]
        log.propagate = False
    return records


def failure():
    return "".join(traceback.format_exc())


# ----------------------------------------------------------------------------- engine side
class SchedulerStandIn:
    """What the weight-updater manager and the flush wrapper use of sglang's Scheduler. Nothing is ever scheduled, so
    the engine is idle and a cache flush has nothing to drop; record_weight_version_change is the real method."""

    def __init__(self):
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler import Scheduler

        self.disaggregation_mode = DisaggregationMode.NULL
        self._engine_paused = False
        self.flushes = 0
        self.record_weight_version_change = types.MethodType(Scheduler.record_weight_version_change, self)

    def flush_cache(self, empty_cache=True):
        self.flushes += 1
        return True

    def is_fully_idle(self, ignore_waiting=False):
        return True


class ModelRunnerStandIn:
    """Holds the model and the real WeightUpdater, built with the arguments ModelRunner.init_weight_updater uses."""

    def __init__(self, model, model_config, tp_rank):
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_model

        def not_here(*args, **kwargs):  # only disk updates and CUDA graphs use these
            raise NotImplementedError("not part of the CPU weight-update harness")

        self.model = model
        self.weight_updater = WeightUpdater(
            tp_rank=tp_rank,
            device="cpu",
            gpu_id=tp_rank,
            model_config=model_config,
            custom_weight_loaders=get_model().custom_weight_loader,
            get_model=lambda: self.model,
            update_model_fields=not_here,
            recapture_cuda_graph=not_here,
            get_model_runner=lambda: self,
        )


def tp_worker_stand_in(runner):
    """A TpModelWorker without __init__ (which builds the runner, the KV cache and the tokenizer): the methods the
    manager calls, deserialize_own_rank and weight_update_runners, are the real ones."""
    from sglang.srt.managers.tp_worker import TpModelWorker

    class TpWorkerStandIn(TpModelWorker):
        def __init__(self):  # not super().__init__: the real one is what this stand-in avoids
            self._model_runner = runner

        @property
        def model_runner(self):
            return self._model_runner

    return TpWorkerStandIn()


@contextlib.contextmanager
def models_built_as_nan(loaded, warned):
    """While active, sglang's model construction (model_loader/loader.py's _initialize_model, which every loader
    calls before it writes any weight) makes every parameter NaN, and the model's load_weights records the names it is
    given into `loaded` and sglang's warnings while it runs into `warned`."""
    import sglang.srt.model_loader.loader as loader
    import torch

    initialize = loader._initialize_model

    def initialize_as_nan(*args, **kwargs):
        model = initialize(*args, **kwargs)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        load_weights = model.load_weights

        def recorded_load_weights(weights):
            weights = list(weights)
            loaded.extend(name for name, _ in weights)
            handler = KeepWarnings(warned)
            logging.getLogger("sglang").addHandler(handler)
            try:
                return load_weights(weights)
            finally:
                logging.getLogger("sglang").removeHandler(handler)

        model.load_weights = recorded_load_weights
        return model

    loader._initialize_model = initialize_as_nan
    try:
        yield
    finally:
        loader._initialize_model = initialize


class EngineRank:
    """One engine TP rank: sglang's runtime context and groups, a dummy-loaded model, the real updater stack."""

    def __init__(self, tp_rank, tp_size):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.groups_built = False
        self.crashed = None  # the traceback of the request that "killed" this scheduler
        self.requests_seen = []
        self.inherited = set()  # the trainer's variables the last load set
        self.own_environ = {k for k in os.environ if k.startswith(INHERITED) and k not in HARNESS_ENV}

    def inherit(self, environ):
        """The trainer's SGLANG_* and TORCHELASTIC_* variables as a scheduler spawned now would see them."""
        given = {k: v for k, v in environ.items() if k.startswith(INHERITED) and k not in HARNESS_ENV}
        for name in (self.own_environ | self.inherited) - set(given):
            os.environ.pop(name, None)
        os.environ.update(given)
        self.own_environ, self.inherited = set(), set(given)

    def load_model(self, engine_kwargs, environ):
        """The scheduler's steps on CPU, with the arguments sglang.Engine was given: publish, (once) the groups on
        nccl_port, ModelConfig, the memory baseline and its TP balance check, get_model. Every parameter is NaN where
        the loader leaves it: the dummy loader's values are replaced by NaN, a loader reading files writes over NaN."""
        import sglang.srt.utils.common as common
        import torch
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_loader import get_model
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.inherit(environ)
        self.crashed, self.requests_seen = "its last load failed", []  # a failed load leaves a dead scheduler
        server_args = ServerArgs(**engine_kwargs, device="cpu", disable_overlap_schedule=True)  # (module docstring)
        gpu_id = engine_kwargs.get("base_gpu_id", 0) + self.tp_rank  # as _launch_scheduler_processes places ranks
        # As run_scheduler_process does; re-publishing for the next model is last-publish-wins.
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=self.tp_rank, gpu_id=gpu_id))
        model_config = ModelConfig.from_server_args(server_args)
        if not self.groups_built:  # once per process, as in Scheduler.__init__
            bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=engine_kwargs["nccl_port"])
            self.groups_built = True
        bootstrap.init_layer_runtime(model_config=model_config)
        probe = common.get_free_cpu_memory
        common.get_free_cpu_memory = lambda: FREE_GIB[self.tp_rank] << 30
        try:  # ModelRunner.init_torch_distributed: the KV budget's baseline, and the TP memory-balance check
            bootstrap.measure_pre_model_load_memory(device="cpu", is_draft_worker=False)
        finally:
            common.get_free_cpu_memory = probe
        self.loaded = []  # the names load_weights is given, in order: by a loader reading files, then by pushes
        self.load_weights_warnings = []  # sglang's warnings while load_weights ran
        with models_built_as_nan(self.loaded, self.load_weights_warnings):
            model = get_model(
                model_config=model_config,
                load_config=LoadConfig(load_format=engine_kwargs["load_format"]),
                device_config=DeviceConfig("cpu", gpu_id),
            )
        if engine_kwargs["load_format"] == "dummy":  # its random values NaN too: what a push leaves unset shows
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(float("nan"))
        self.model_class = type(model).__name__
        self.runner = ModelRunnerStandIn(model, model_config, self.tp_rank)
        self.scheduler = SchedulerStandIn()
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=tp_worker_stand_in(self.runner),
            draft_worker=None,
            memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
            flush_cache=self.scheduler.flush_cache,
            is_fully_idle=self.scheduler.is_fully_idle,
            scheduler=self.scheduler,
            metrics_collector=None,
        )
        self.dispatch = self.dispatcher()
        self.crashed = None

    def dispatcher(self):
        """The weight-update entries of Scheduler.init_request_dispatcher, to the same handlers."""
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.utils import TypeBasedDispatcher

        def no_deferred_reply(output, request):  # only flushes with a timeout defer their reply
            raise AssertionError("a deferred flush reply: the harness sends no flush timeout")

        flush = SchedulerFlushWrapper(
            flush_cache=self.scheduler.flush_cache,
            is_fully_idle=self.scheduler.is_fully_idle,
            send_output=no_deferred_reply,
        )
        m = self.manager
        return TypeBasedDispatcher(
            [
                (io_struct.FlushCacheReqInput, flush.handle),
                (io_struct.BeginWeightUpdateReqInput, m.begin_weight_update),
                (io_struct.EndWeightUpdateReqInput, m.end_weight_update),
                (io_struct.UpdateWeightsFromTensorReqInput, m.update_weights_from_tensor),
                (io_struct.ReleaseMemoryOccupationReqInput, m.release_memory_occupation),
                (io_struct.ResumeMemoryOccupationReqInput, m.resume_memory_occupation),
            ]
        )

    def handle_request(self, data):
        """An encoded io_struct request in, the encoded reply out; raises once crashed, like a dead scheduler."""
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

        if self.crashed:
            raise RuntimeError(f"engine TP rank {self.tp_rank} has crashed earlier:\n{self.crashed}")
        request = msgpack_decode(data)
        self.requests_seen.append(type(request).__name__)
        try:
            return msgpack_encode(self.dispatch(request))
        except BaseException:
            self.crashed = failure()
            raise

    def shut_down(self):
        """Drop the groups (and their shared-memory broadcast queue) and the communicators, as a scheduler exits."""
        from sglang.srt.distributed.parallel_state import abort_distributed_environment, destroy_model_parallel

        if self.groups_built:
            destroy_model_parallel()
            abort_distributed_environment()

    def weights(self):
        """torch.save bytes of the parameters, the buffers, the requests seen, the flush count, the names
        load_weights was given and sglang's warnings as it ran, and the model's class name (torch.save: after sglang's
        monkey_patch_torch_reductions, ForkingPickler can no longer pickle CPU tensors)."""
        import torch

        model = self.runner.model
        state = {
            "parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "requests": list(self.requests_seen),
            "flushes": self.scheduler.flushes,
            "loaded": list(self.loaded),
            "load_weights_warnings": list(self.load_weights_warnings),
            "model_class": self.model_class,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()


def try_cpu_tensor_ipc_pickle():
    """What sglang's monkey_patch_torch_reductions() (engines.start_engine applies it where CUDA is present) does to
    pickling a CPU tensor for IPC."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    try:
        MultiprocessingSerializer.serialize({"t": torch.zeros(2)}, output_str=True)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def engine_rank_main(engine, tp_rank, tp_size, gpus, requests, to_owner, to_harness, sys_path):
    """Rank tp_rank of engine `engine`: encoded io_struct requests (bytes) and the owner's ("load", kwargs, environ)
    answer to the owner's tokenizer stand-in, the test process's commands (tuples) to the test process."""
    sys.path[:] = sys_path
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # the GPU branches of the loaders (module docstring)
    # sglang binds each CPU rank's OpenMP threads to cores, by gpu_id; one core per rank on this 2-core machine.
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(g % os.cpu_count()) for g in range(gpus))
    start = time.perf_counter()
    log = quiet_logging()
    key = (engine, tp_rank)
    try:
        import torch

        torch.set_num_threads(1)
        import sglang.srt.managers.scheduler  # noqa: F401  the heavy part of the imports, timed here

        rank = EngineRank(tp_rank, tp_size)
        to_harness.put((key, ("ready", time.perf_counter() - start), None))
    except BaseException:
        to_harness.put((key, None, failure()))
        return
    while True:
        message = requests.get()
        if isinstance(message, bytes):
            try:
                to_owner.put((tp_rank, rank.handle_request(message), None))
            except BaseException:
                to_owner.put((tp_rank, None, failure()))
            continue
        command, *args = message
        if command == "stop":
            rank.shut_down()
            for replies in (to_owner, to_harness):
                replies.close()
                replies.join_thread()
            os._exit(0)  # skips C++ teardown that takes ~4 s here; nothing is left to flush
        if command == "load":  # from the owner's HarnessEngine, as a scheduler process starts
            try:
                began = time.perf_counter()
                log.clear()
                rank.load_model(*args)
                to_owner.put((tp_rank, (time.perf_counter() - began, list(log)), None))
                log.clear()
            except BaseException:
                to_owner.put((tp_rank, None, failure()))
            continue
        try:
            if command == "weights":
                result = (rank.weights(), list(log))
            elif command == "serve":  # a model folder loaded as by a server of its own (CPUEngineCluster.serve)
                began = time.perf_counter()
                log.clear()
                rank.load_model(*args)
                result = (time.perf_counter() - began, list(log))
                log.clear()
            elif command == "ipc_pickle":
                result = try_cpu_tensor_ipc_pickle()
            else:
                raise ValueError(f"unknown harness command {command!r}")
            to_harness.put((key, result, None))
        except BaseException:
            to_harness.put((key, None, failure()))


# ----------------------------------------------------------------------------- trainer side
class EngineRankFailed(RuntimeError):
    """An engine rank raised while handling a request: in sglang the scheduler dies and takes the engine down."""


class QueueTokenizerManager:
    """Stands in for sglang's TokenizerManager under sglang.Engine: the async methods the Engine calls for weight
    updates, over queues instead of ZMQ, combining replies as tokenizer_control_mixin does (one DP rank: the
    FanOutCommunicator waits for the reply of engine TP rank 0, the only scheduler that answers)."""

    def __init__(self, requests, replies, timeout=TIMEOUT):
        self.requests, self.replies, self.timeout = requests, replies, timeout
        self.generate_requests = []
        self.mm_processor = None  # a vision-language model's (mm_processor_of)
        self.processed_images = []  # per prompt with images: what the multimodal processor made of it

    def _gather(self, message):
        """message to every rank of the engine; their answers by rank, or EngineRankFailed with every traceback."""
        for ranks_queue in self.requests:
            ranks_queue.put(message)
        answers = {}
        for _ in self.requests:  # every rank answers the harness; sglang would only hear rank 0
            rank, reply, error = self.replies.get(timeout=self.timeout)
            answers[rank] = (reply, error)
        errors = [f"engine TP rank {r}:\n{error}" for r, (_, error) in sorted(answers.items()) if error]
        if errors:
            raise EngineRankFailed("\n".join(errors))
        return [answers[r][0] for r in range(len(self.requests))]

    def start_engine(self, engine_kwargs, environ):
        """Every rank loads the model, as the scheduler processes sglang.Engine spawns; per rank (seconds, log)."""
        return self._gather(("load", engine_kwargs, environ))

    def _call(self, request):
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

        return [msgpack_decode(self._gather(msgpack_encode(request))[0])]  # msgpack: as sock_send

    async def generate_request(self, obj, request=None):
        """No generation here: the request normalized as the tokenizer manager does, recorded, answered with no
        tokens. A prompt with images goes through sglang's multimodal processor as _tokenize_one_request sends it
        (its input ids, its image_data), and what it makes is recorded: the ids the scheduler would get, the image
        items' pixel values and grids, the mrope positions."""
        obj.normalize_batch_and_arguments()
        self.generate_requests.append((obj.input_ids, obj.sampling_params))
        for i in range(1 if obj.is_single else obj.batch_size):
            one = obj if obj.is_single else obj[i]
            if self.mm_processor is not None and one.contains_mm_input():
                processed = await self.mm_processor.process_mm_data_async(
                    image_data=one.image_data, input_text=one.input_ids, request_obj=one, max_req_input_len=1 << 20
                )
                items = [item for item in processed.mm_items if item.is_image()]
                self.processed_images.append(
                    {
                        "prompt": i,
                        "input_ids": list(processed.input_ids),
                        "pixel_values": rows_concatenated([item.feature for item in items]),
                        "image_grid_thw": rows_concatenated(
                            [item.model_specific_data["image_grid_thw"] for item in items]
                        ),
                        "mrope_positions": processed.mrope_positions,
                    }
                )
        reply = {"output_ids": [], "meta_info": {"output_token_logprobs": []}}
        yield reply if obj.is_single else [reply] * obj.batch_size

    async def begin_weight_update(self, obj, request=None):
        from sglang.srt.managers.communicator import FanOutCommunicator

        return FanOutCommunicator.merge_results(self._call(obj))

    async def end_weight_update(self, obj, request=None):
        from sglang.srt.managers.communicator import FanOutCommunicator

        return FanOutCommunicator.merge_results(self._call(obj))

    async def update_weights_from_tensor(self, obj, request=None):
        from sglang.srt.managers.communicator import FanOutCommunicator
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        return FanOutCommunicator.merge_results(self._call(obj))

    async def flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqInput

        return self._call(FlushCacheReqInput(timeout_s=timeout_s))[0]

    async def release_memory_occupation(self, obj, request=None):
        self._call(obj)

    async def resume_memory_occupation(self, obj, request=None):
        self._call(obj)


def harness_engine_class(requests, replies):
    """sglang.Engine for a trainer rank: the real class, whose __init__ builds ServerArgs from the arguments as
    sglang's does and starts the engine ranks of `requests` instead of spawning schedulers (module docstring)."""
    from sglang.srt.entrypoints.engine import Engine  # the class that the lazy sglang.Engine resolves to

    class HarnessEngine(Engine):
        unset_environ = ()  # names left out of what the engine inherits (a trainer that did not set them)

        def __init__(self, **kwargs):  # not super().__init__: the real one launches sglang's processes
            if "log_level" not in kwargs:
                kwargs["log_level"] = "error"
            self.server_args = self.server_args_class(**kwargs)  # sglang's own check of the arguments
            self.kwargs = dict(kwargs)
            self.environ = {k: v for k, v in os.environ.items() if k not in self.unset_environ}
            self.tokenizer_manager = QueueTokenizerManager(requests, replies)
            self.tokenizer_manager.mm_processor = mm_processor_of(self.kwargs)
            self.loads = self.tokenizer_manager.start_engine(self.kwargs, self.environ)
            self.loop = Engine._ensure_event_loop()

    return HarnessEngine


def rows_concatenated(tensors):
    """Tensors of any rank as [rows, last dimension], one after another."""
    import torch

    return torch.cat([tensor.reshape(-1, tensor.shape[-1]) for tensor in tensors])


def mm_processor_of(engine_kwargs):
    """The multimodal processor sglang's TokenizerManager builds for a vision-language model_path (get_mm_processor:
    Qwen3.5's QwenVLImageProcessor), with skip_tokenizer_init too; None for a text model. Its transformers processor
    is Qwen3-VL's made from the folder's tokenizer and image processor files, without the video processor that
    AutoProcessor would add: transformers' needs torchvision, which a CPU has as tests/sglang_cpu_stubs' stub alone.
    Its ServerArgs are the engine ranks' (device "cpu")."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.multimodal.transport import determine_tensor_transport_mode
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from demo_model import ImageOnlyProcessor

    server_args = ServerArgs(**engine_kwargs, device="cpu", disable_overlap_schedule=True)
    model_config = ModelConfig.from_server_args(server_args)
    if not model_config.is_multimodal:
        return None

    folder = server_args.model_path
    processor = ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=None,
    )
    publish(server_args, role="tokenizer")
    import_processors("sglang.srt.multimodal.processors")
    transport = determine_tensor_transport_mode()
    return get_mm_processor(model_config.hf_config, server_args, processor, transport, model_config=model_config)


class SessionlessView:
    """The Engine as engines.SGLangEngine sees an sglang older than 0.5.21: no begin/end_weight_update."""

    def __init__(self, engine):
        for name in (
            "update_weights_from_tensor",
            "flush_cache",
            "release_memory_occupation",
            "resume_memory_occupation",
        ):
            setattr(self, name, getattr(engine, name))


RESHAPES = {"transpose": lambda t: t.t().contiguous(), "half_columns": lambda t: t[:, : t.shape[1] // 2].contiguous()}


def mutate_buckets(rename, reshape):
    """engines.weight_buckets (push_weights finds it as a global of engines) with some names renamed and some tensors
    reshaped by RESHAPES[how] (a trainer-side bug to catch); with neither, the original back."""
    import engines

    original = getattr(engines.weight_buckets, "original", engines.weight_buckets)

    def buckets(*args, **kwargs):
        for bucket in original(*args, **kwargs):
            yield [(rename.get(n, n), RESHAPES[reshape[n]](t) if n in reshape else t) for n, t in bucket]

    buckets.original = original
    engines.weight_buckets = buckets if rename or reshape else original


def trainer_config(folder):
    """The config main builds the model from (checkpoint.tokenizer_and_config): a vision-language folder's text
    model's."""
    import checkpoint

    return checkpoint.tokenizer_and_config(folder)[1]


def trainer_model(folder, par, bucket_mb, tower=None):
    """The trainer's policy as main builds it: sharded over par.mesh, then the checkpoint in `folder` streamed in, and
    main's check that the push at bucket_mb sends every weight SGLang's class loads, under names it loads (with a
    vision tower, the vision-language class's)."""
    import torch

    import architectures
    import checkpoint
    import launch
    import train

    config = trainer_config(folder)
    model = train.build_model(config, par.mesh, torch.device("cpu"), tower=tower)
    cfg = train.Config(model=folder, bucket_mb=bucket_mb)
    files = launch.on_first_rank(par.world_group, checkpoint.weight_files, cfg.model)
    checkpoint.load_weights([model], files, cfg, config, par.world_group)
    architectures.check_engine_names(model, config, cfg.bucket_mb << 20, tower)
    return model


def trainer_tower(folder, train_vision):
    """The vision tower of a vision-language folder, as main loads it for a task with images (vision.load_tower);
    with train_vision, the policy trains a copy of it, which it pushes with the text model."""
    import torch

    import checkpoint
    import train
    import vision

    cfg = train.Config(model=folder, train_vision=train_vision)
    return vision.load_tower(cfg, [{"images": ["an image"]}], checkpoint.weight_files(folder), torch.device("cpu"))


def image_prompts(folder, tower, engine, images):
    """engines.SGLangEngine.generate of two prompts, one with `images` (PIL images) and one text prompt, encoded as
    the trainer encodes them (vision.encode_prompt); what the engine's tokenizer manager recorded of them (its
    multimodal processor's output per prompt with images, each prompt's sampling parameters), and the trainer's
    own: the prompt's ids, pixel values and grid, and the 3 rows of mrope positions of the vision-language model."""
    import torch

    import checkpoint
    import train
    import vision

    cfg = train.Config(model=folder, image_min_pixels=256, image_max_pixels=4096)
    tokenizer = checkpoint.tokenizer_and_config(folder)[0]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What colour?"}]
    items = [{"prompt": [{"role": "user", "content": parts}], "images": images}, {"prompt": "Say a:"}]
    prompts, inputs = zip(*[vision.encode_prompt(tokenizer, item, cfg) for item in items])
    manager = engine.engine.tokenizer_manager
    manager.processed_images.clear()
    engine.generate(list(prompts), [2, 2], 1.0, 1.0, 0, [2], 0, images=list(inputs))
    ids = torch.tensor([prompts[0]])
    rows, _ = tower.rope_index(ids, (ids == tower.vlm_config.image_token_id).long(), inputs[0]["image_grid_thw"])
    trainer = dict(inputs[0], input_ids=prompts[0], mrope_positions=rows[:, 0])
    return {"engine": manager.processed_images, "sampling": manager.generate_requests[-1][1], "trainer": trainer}


def trainer_rank_main(rank, world, port, links, commands, results, sys_path):
    """A trainer rank on gloo, on one node (LOCAL_RANK is the rank), for every engine shape of links: per shape, its
    TP size and the requests and replies of this rank's engine (rank // tp), whose owner is the TP group's first rank,
    as train.main arranges it. A shape's groups (launch.parallel_groups) are made on its first command."""
    sys.path[:] = sys_path
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    start = time.perf_counter()
    quiet_logging()
    try:
        import torch
        import torch.distributed as dist

        import train  # noqa: F401  imported before the clock stops

        logging.getLogger("torch").setLevel(logging.ERROR)  # not DTensor's notes on sequential all-gathers
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, ("ready", time.perf_counter() - start), None))
    except BaseException:
        results.put((rank, None, failure()))
        return
    shapes = [
        types.SimpleNamespace(
            tp=tp, requests=requests, replies=replies, par=None, engine_class=None, engine=None, tower=None
        )
        for tp, requests, replies in links
    ]
    while True:
        command = commands.get()
        if command is None:
            results.close()
            results.join_thread()
            os._exit(0)  # as the engine ranks: skips a slow C++ teardown, nothing is left to flush
        try:
            results.put((rank, run_trainer_command(rank, shapes[command[0]], *command[1:]), None))
        except BaseException:
            results.put((rank, None, failure()))


def run_trainer_command(rank, shape, kind, options):
    """ "start": engines.start_engine on every rank for the model saved in options["folder"]; "release":
    release_memory; "push": engines.push_weights of that model; "update_outside_session": one bucket sent with no
    session open, sglang's (ok, message) returned unchecked."""
    import sglang
    import torch

    import engines
    import launch
    import train

    if shape.par is None:
        shape.par = launch.parallel_groups("cpu", shape.tp)
    par, owner = shape.par, shape.par.mesh["tp"].get_local_rank() == 0
    if kind == "start":
        shape.engine = None
        if owner:  # the only rank that starts sglang.Engine (the others need not import it)
            shape.engine_class = shape.engine_class or harness_engine_class(shape.requests, shape.replies)
            shape.engine_class.unset_environ = options.get("unset_environ", ())
            sglang.Engine = shape.engine_class
        cfg = train.Config(engine="sglang", tp=shape.tp, out_dir=options["out_dir"], seed=3, model=options["folder"])
        shape.tower = None
        if options.get("images"):
            shape.tower = trainer_tower(options["folder"], options.get("train_vision", False))
        config = trainer_config(options["folder"])
        shape.engine = engines.start_engine(cfg, config, par, torch.device("cpu"), shape.tower)
        if not owner:  # an SGLangPeer: no sglang.Engine
            return None
        engine = shape.engine.engine
        return {
            "rank": rank,
            "kwargs": engine.kwargs,
            "loads": engine.loads,
            "generate": engine.tokenizer_manager.generate_requests,
            "vlm_cache_mb": engine.environ.get("SGLANG_VLM_CACHE_SIZE_MB"),  # 0: no cache of image features
            "environ": {
                k: engine.environ.get(k)
                for k in ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "TORCHELASTIC_USE_AGENT_STORE")
            },
        }
    trainer_engine = shape.engine
    if kind == "release":
        trainer_engine.release_memory()
        return None
    if kind == "image_prompts":
        return image_prompts(options["folder"], shape.tower, trainer_engine, options["images"]) if owner else None
    if kind == "update_outside_session":  # the owner alone: it serializes every engine rank's copy
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        if not owner:
            return None
        bucket = FlattenedTensorBucket(named_tensors=[("model.norm.weight", torch.ones(4, dtype=torch.bfloat16))])
        payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        engine = trainer_engine.engine
        per_rank = [
            MultiprocessingSerializer.serialize(payload, output_str=True) for _ in engine.tokenizer_manager.requests
        ]
        return engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=False)
    assert kind == "push", kind
    began = time.perf_counter()
    model = trainer_model(options["folder"], par, options["bucket_mb"], shape.tower)
    built = time.perf_counter()
    engine = trainer_engine.engine if owner else None  # the peers hold no sglang.Engine
    if engine is not None and not options.get("session", True):
        trainer_engine.engine = SessionlessView(engine)
    mutate_buckets(options.get("rename", {}), options.get("reshape", {}))
    try:
        cfg = train.Config(engine="sglang", bucket_mb=options["bucket_mb"])
        engines.push_weights(model, trainer_engine, cfg.bucket_mb, par.tp_group)
    finally:
        mutate_buckets({}, {})
        if engine is not None:
            trainer_engine.engine = engine
    return {"build_s": built - began, "push_s": time.perf_counter() - built}


# ----------------------------------------------------------------------------- test process side
class CPUEngineCluster:
    """Trainer ranks (world of them) and, for one engine shape at a time, dp engines of tp ranks each (dp x tp =
    world), in spawned processes, driven from the test process. The trainer ranks serve every shape of the world;
    use(shape) starts that shape's engine processes, stopping another's first."""

    def __init__(self, world, shapes, timeout=TIMEOUT):
        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: a fork would inherit the test's modules
        assert all(dp * tp == world for dp, tp in shapes)
        self.ctx, self.world, self.shapes, self.timeout, self.broken = ctx, world, list(shapes), timeout, False
        # Every queue exists from the start: a process gets its queues when it is spawned, never later.
        self.engine_requests = [[[ctx.Queue() for _ in range(tp)] for _ in range(dp)] for dp, tp in shapes]
        self.engine_to_owner = [[ctx.Queue() for _ in range(dp)] for dp, _ in shapes]  # the owners' tokenizers read
        self.engine_to_harness = ctx.Queue()
        self.trainer_commands = [ctx.Queue() for _ in range(world)]
        self.trainer_results = ctx.Queue()
        trainer_port = free_port()
        self.trainers = [
            ctx.Process(
                target=trainer_rank_main,
                name=f"trainer-{g}",
                daemon=True,
                args=(
                    g,
                    world,
                    trainer_port,
                    [
                        (tp, self.engine_requests[s][g // tp], self.engine_to_owner[s][g // tp])
                        for s, (_, tp) in enumerate(shapes)
                    ],
                    self.trainer_commands[g],
                    self.trainer_results,
                    child_sys_path(with_stubs=True),
                ),
            )
            for g in range(world)
        ]
        self.engines, self.shape = [], None
        for process in self.trainers:
            process.start()
        try:
            self.trainer_import_s = max(s for _, s in self._gather(self.trainer_results))
        except BaseException:
            self.close()
            raise

    def use(self, dp, tp):
        """The engine processes of shape (dp, tp), started unless running; returns self."""
        if self.shape == (dp, tp):
            return self
        self._stop_engines()
        s = self.shapes.index((dp, tp))
        self.engines = [
            self.ctx.Process(
                target=engine_rank_main,
                name=f"engine{e}-tp{r}",
                daemon=True,
                args=(
                    e,
                    r,
                    tp,
                    self.world,
                    self.engine_requests[s][e][r],
                    self.engine_to_owner[s][e],
                    self.engine_to_harness,
                    child_sys_path(with_stubs=True),
                ),
            )
            for e in range(dp)
            for r in range(tp)
        ]
        for process in self.engines:
            process.start()
        self.shape = (dp, tp)
        self.engine_import_s = max(s for _, s in self._gather(self.engine_to_harness))
        return self

    def _gather(self, replies):
        """Every rank's answer (engine ranks: by (engine, tp rank)), in order; raises with the ranks' tracebacks if
        any failed. A rank still silent soon after a peer failed is stuck in a collective: the cluster is then marked
        broken (start a new one)."""
        out, errors, deadline = {}, [], time.monotonic() + self.timeout
        while len(out) < self.world:
            try:
                rank, value, error = replies.get(timeout=1)
            except queue.Empty:
                dead = [p.name for p in self.trainers + self.engines if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    errors.append(f"no answer in time; processes that died: {dead}")
                    break
                continue
            if error:
                errors.append(f"rank {rank}:\n{error}")
                deadline = min(deadline, time.monotonic() + 15)
            out[rank] = value
        if errors:
            raise RuntimeError("\n".join(errors))
        return [out[k] for k in sorted(out)]

    def _engine_command(self, *command):
        for requests in self.engine_requests[self.shapes.index(self.shape)]:
            for ranks_queue in requests:
                ranks_queue.put(command)
        return self._gather(self.engine_to_harness)

    def weights(self):
        """Per engine, per engine TP rank: ({"parameters", "buffers", "requests", "flushes"}, sglang's warnings since
        the load)."""
        import torch

        dp, tp = self.shape
        states = [(torch.load(io.BytesIO(data)), log) for data, log in self._engine_command("weights")]
        return [states[e * tp : (e + 1) * tp] for e in range(dp)]

    def serve(self, folder):
        """Every rank of the current shape's one engine loads the model folder `folder` as `python -m
        sglang.launch_server --model-path folder --tp N` would: ServerArgs of that path (load_format "auto": sglang's
        DefaultModelLoader reads its safetensors files; the class is the one its config.json's architectures names),
        then the scheduler's steps of EngineRank.load_model, every parameter NaN until the loader writes it. Two
        settings differ from a server's defaults: dtype bfloat16, which "auto" gives the hub's bf16 checkpoints (these
        tests' float32 folders would get float16, configs/model_config.py:2303-2319), and the TP memory-balance
        check off (the harness's probe reports unbalanced GPUs, FREE_GIB; a server of its own has balanced ones).
        Per rank: (seconds, sglang's warnings during the load); weights() then reads what was loaded."""
        dp, tp = self.shape
        assert dp == 1, "one engine: its ranks' groups are built on the port given here, unless built before"
        kwargs = dict(model_path=folder, load_format="auto", dtype="bfloat16", tp_size=tp, nccl_port=free_port())
        return self._engine_command("serve", kwargs, {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"})

    def cpu_tensor_ipc_pickle(self):
        return self._engine_command("ipc_pickle")[0]

    def trainer(self, kind, **options):
        """Run a trainer command for the current shape on every trainer rank; their results in rank order."""
        for commands in self.trainer_commands:
            commands.put((self.shapes.index(self.shape), kind, options))
        return self._gather(self.trainer_results)

    def start(self, folder, out_dir, **options):
        """engines.start_engine on every trainer rank for the checkpoint in folder; per engine, its owner's record."""
        return [r for r in self.trainer("start", folder=folder, out_dir=out_dir, **options) if r is not None]

    def _stop_engines(self):
        for requests in self.engine_requests[self.shapes.index(self.shape)] if self.shape else []:
            for ranks_queue in requests:
                ranks_queue.put(("stop",))
        self._join(self.engines)
        self.engines, self.shape = [], None

    @staticmethod
    def _join(processes):
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def close(self):
        self._stop_engines()
        for commands in self.trainer_commands:
            commands.put(None)
        self._join(self.trainers)
