"""The real sglang 0.5.23 weight-update path on CPU processes, for tests/test_sglang_contract.py.

What is real (sglang's own code, unchanged):
- engine side, one spawned process per engine TP rank: ServerArgs (device="cpu", load_format="dummy"), publish() of the
  runtime context, sglang's distributed bootstrap (gloo groups among the engine ranks), the dummy-loaded model from
  sglang.srt.model_loader.get_model, SchedulerWeightUpdaterManager, TpModelWorker.deserialize_own_rank and
  weight_update_runners, the model runner's WeightUpdater (begin/end_weight_update, update_weights_from_tensor,
  _update_weights_from_flattened_bucket), Qwen2 / Qwen3 load_weights, SchedulerFlushWrapper, and sglang's
  TypeBasedDispatcher with the weight-update entries of Scheduler.init_request_dispatcher;
- on the wire: the io_struct requests and replies, msgpack-encoded by io_struct.msgpack_encode as sock_send does;
- trainer side: the sglang.Engine class (made with object.__new__) whose methods build the requests, and the trainer's
  train.SGLangEngine / train.push_weights on a sharded model (FSDP2 + DTensor TP over gloo, tests/test_parallel.py).

What is replaced:
- the ZMQ sockets, by multiprocessing queues: QueueTokenizerManager sends each request to every engine rank (in sglang
  rank 0 receives it and broadcasts it over the TP group) and, like the tokenizer manager, keeps rank 0's reply;
- the Scheduler, TpModelWorker and ModelRunner objects, by light stand-ins that hold the real components above
  (the real ones need a KV cache, a tokenizer or a GPU); there is no KV cache, so a cache flush only counts;
- the memory saver is sglang's no-op adapter (torch_memory_saver needs CUDA).

An engine rank that raises (sglang's scheduler would crash and SIGQUIT the engine) answers every later request with
its traceback until the next load_model(), which builds a fresh model and manager: the "restarted" engine.
The engine ranks never run sglang's CPU engine branches (SGLANG_USE_CPU_ENGINE stays unset), so the weight loaders
take the branches they take on a GPU; tests/sglang_cpu_stubs/ supplies torchvision and vllm._custom_ops there only.
"""
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


def child_sys_path(with_stubs):
    """sys.path of a spawned process: the stubs first where sglang.Engine or a model is imported, then the repo and
    tests/, then the rest, less any folder holding a fake package named sglang (the real one must load)."""
    rest = [p for p in sys.path if p not in (REPO, TESTS, STUBS) and os.path.basename(p) != "fake_sglang"]
    return ([STUBS] if with_stubs else []) + [REPO, TESTS] + rest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_logging():
    """sglang's warnings kept in a list (returned to the test), not printed; Python warnings off."""
    warnings.simplefilter("ignore")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    for name in ("sglang", "root"):
        log = logging.getLogger(None if name == "root" else name)
        log.handlers[:] = [Keep(level=logging.WARNING)]
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
            tp_rank=tp_rank, device="cpu", gpu_id=tp_rank, model_config=model_config,
            custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: self.model,
            update_model_fields=not_here, recapture_cuda_graph=not_here, get_model_runner=lambda: self)


def tp_worker_stand_in(runner):
    """A TpModelWorker without __init__ (which builds the runner, the KV cache and the tokenizer): the methods the
    manager calls, deserialize_own_rank and weight_update_runners, are the real ones."""
    from sglang.srt.managers.tp_worker import TpModelWorker

    class TpWorkerStandIn(TpModelWorker):
        def __init__(self):  # noqa: the real __init__ is what this stand-in avoids
            self._model_runner = runner

        @property
        def model_runner(self):
            return self._model_runner

    return TpWorkerStandIn()


class EngineRank:
    """One engine TP rank: sglang's runtime context and groups, a dummy-loaded model, the real updater stack."""

    def __init__(self, tp_rank, tp_size, dist_port):
        self.tp_rank, self.tp_size, self.dist_port = tp_rank, tp_size, dist_port
        self.groups_built = False
        self.crashed = None  # the traceback of the request that "killed" this scheduler
        self.requests_seen = []

    def load_model(self, model_path):
        """ModelRunner's steps on CPU: publish, (once) the groups, ModelConfig, get_model; every parameter NaN."""
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

        server_args = ServerArgs(model_path=model_path, device="cpu", load_format="dummy", tp_size=self.tp_size,
                                 dtype="bfloat16", skip_tokenizer_init=True, random_seed=0)
        # As run_scheduler_process does; re-publishing for the next model is last-publish-wins.
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=self.tp_rank, gpu_id=self.tp_rank))
        model_config = ModelConfig.from_server_args(server_args)
        if not self.groups_built:  # once per process, as in Scheduler.__init__
            bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=self.dist_port)
            self.groups_built = True
        bootstrap.init_layer_runtime(model_config=model_config)
        model = get_model(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                          device_config=DeviceConfig("cpu", self.tp_rank))
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        self.runner = ModelRunnerStandIn(model, model_config, self.tp_rank)
        self.scheduler = SchedulerStandIn()
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=tp_worker_stand_in(self.runner), draft_worker=None,
            memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
            flush_cache=self.scheduler.flush_cache, is_fully_idle=self.scheduler.is_fully_idle,
            scheduler=self.scheduler, metrics_collector=None)
        self.dispatch = self.dispatcher()
        self.crashed, self.requests_seen = None, []

    def dispatcher(self):
        """The weight-update entries of Scheduler.init_request_dispatcher, to the same handlers."""
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.utils import TypeBasedDispatcher

        def no_deferred_reply(output, request):  # only flushes with a timeout defer their reply
            raise AssertionError("a deferred flush reply: the harness sends no flush timeout")

        flush = SchedulerFlushWrapper(flush_cache=self.scheduler.flush_cache,
                                      is_fully_idle=self.scheduler.is_fully_idle, send_output=no_deferred_reply)
        m = self.manager
        return TypeBasedDispatcher([
            (io_struct.FlushCacheReqInput, flush.handle),
            (io_struct.BeginWeightUpdateReqInput, m.begin_weight_update),
            (io_struct.EndWeightUpdateReqInput, m.end_weight_update),
            (io_struct.UpdateWeightsFromTensorReqInput, m.update_weights_from_tensor),
            (io_struct.ReleaseMemoryOccupationReqInput, m.release_memory_occupation),
            (io_struct.ResumeMemoryOccupationReqInput, m.resume_memory_occupation),
        ])

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
        """torch.save bytes of the parameters, the buffers, the requests seen and the flush count (torch.save: after
        sglang's monkey_patch_torch_reductions, ForkingPickler can no longer pickle CPU tensors)."""
        import torch
        model = self.runner.model
        state = {"parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                 "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
                 "requests": list(self.requests_seen), "flushes": self.scheduler.flushes}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()


def try_cpu_tensor_ipc_pickle():
    """What sglang's monkey_patch_torch_reductions() (train.sglang_payloads applies it where CUDA is present) does to
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


def engine_rank_main(tp_rank, tp_size, dist_port, requests, to_tokenizer, to_harness, sys_path):
    """An engine TP rank: encoded io_struct requests (bytes) answer to the tokenizer stand-in, harness commands
    (tuples) to the test process."""
    sys.path[:] = sys_path
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # the GPU branches of the loaders (module docstring)
    # sglang binds each CPU rank's OpenMP threads to cores; one core per rank on this 2-core machine.
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp_size))
    start = time.perf_counter()
    log = quiet_logging()
    try:
        import torch
        torch.set_num_threads(1)
        import sglang.srt.managers.scheduler  # noqa: F401  the heavy part of the imports, timed here
        rank = EngineRank(tp_rank, tp_size, dist_port)
        to_harness.put((tp_rank, ("ready", time.perf_counter() - start), None))
    except BaseException:
        to_harness.put((tp_rank, None, failure()))
        return
    while True:
        message = requests.get()
        if isinstance(message, bytes):
            try:
                to_tokenizer.put((tp_rank, rank.handle_request(message), None))
            except BaseException:
                to_tokenizer.put((tp_rank, None, failure()))
            continue
        command, *args = message
        if command == "stop":
            rank.shut_down()
            for replies in (to_tokenizer, to_harness):
                replies.close()
                replies.join_thread()
            os._exit(0)  # skips C++ teardown that takes ~4 s here; nothing is left to flush
        try:
            if command == "load":
                began = time.perf_counter()
                rank.load_model(*args)
                log.clear()
                result = time.perf_counter() - began
            elif command == "weights":
                result = (rank.weights(), list(log))
            elif command == "ipc_pickle":
                result = try_cpu_tensor_ipc_pickle()
            else:
                raise ValueError(f"unknown harness command {command!r}")
            to_harness.put((tp_rank, result, None))
        except BaseException:
            to_harness.put((tp_rank, None, failure()))


# ----------------------------------------------------------------------------- trainer side
class EngineRankFailed(RuntimeError):
    """An engine rank raised while handling a request: in sglang the scheduler dies and takes the engine down."""


class QueueTokenizerManager:
    """Stands in for sglang's TokenizerManager under sglang.Engine: the async methods the Engine calls for weight
    updates, over queues instead of ZMQ, combining replies as tokenizer_control_mixin does (one DP rank: the
    FanOutCommunicator waits for the reply of engine TP rank 0, the only scheduler that answers)."""

    def __init__(self, requests, replies, timeout=TIMEOUT):
        self.requests, self.replies, self.timeout = requests, replies, timeout

    def _call(self, request):
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode
        data = msgpack_encode(request)  # as sock_send: a request that msgpack cannot carry fails here
        for ranks_queue in self.requests:
            ranks_queue.put(data)
        answers = {}
        for _ in self.requests:  # every rank answers the harness; sglang would only hear rank 0
            rank, reply, error = self.replies.get(timeout=self.timeout)
            answers[rank] = (reply, error)
        errors = [f"engine TP rank {r}:\n{error}" for r, (_, error) in sorted(answers.items()) if error]
        if errors:
            raise EngineRankFailed("\n".join(errors))
        return [msgpack_decode(answers[0][0])]

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


def make_engine(requests, replies):
    """train.SGLangEngine around the real sglang.Engine, both without __init__ (which would launch sglang's own
    processes): the Engine's weight-update methods need only a loop and a tokenizer manager."""
    import train
    from sglang.srt.entrypoints.engine import Engine  # the class that the lazy sglang.Engine resolves to
    engine = object.__new__(Engine)
    engine.loop = Engine._ensure_event_loop()
    engine.tokenizer_manager = QueueTokenizerManager(requests, replies)
    trainer_engine = object.__new__(train.SGLangEngine)
    trainer_engine.engine, trainer_engine.released = engine, False
    return trainer_engine


class SessionlessView:
    """The Engine as train.SGLangEngine sees an sglang older than 0.5.21: no begin/end_weight_update."""

    def __init__(self, engine):
        self.update_weights_from_tensor = engine.update_weights_from_tensor
        self.flush_cache = engine.flush_cache
        self.resume_memory_occupation = engine.resume_memory_occupation


RESHAPES = {"transpose": lambda t: t.t().contiguous(), "half_columns": lambda t: t[:, :t.shape[1] // 2].contiguous()}


def mutate_buckets(rename, reshape):
    """train.weight_buckets with some names renamed and some tensors reshaped by RESHAPES[how] (a trainer-side bug
    to catch); with neither, the original back."""
    import train
    original = getattr(train.weight_buckets, "original", train.weight_buckets)

    def buckets(*args, **kwargs):
        for bucket in original(*args, **kwargs):
            yield [(rename.get(n, n), RESHAPES[reshape[n]](t) if n in reshape else t) for n, t in bucket]
    buckets.original = original
    train.weight_buckets = buckets if rename or reshape else original


def trainer_rank_main(rank, world, port, commands, results, engine_requests, engine_replies, sys_path):
    """A trainer rank (dp 1, tp = world) on gloo; rank 0 owns the SGLangEngine, as train.main does."""
    sys.path[:] = sys_path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    start = time.perf_counter()
    quiet_logging()
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        logging.getLogger("torch").setLevel(logging.ERROR)  # not DTensor's notes on sequential all-gathers
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        trainer_engine = make_engine(engine_requests, engine_replies) if rank == 0 else None
        results.put((rank, ("ready", time.perf_counter() - start), None))
    except BaseException:
        results.put((rank, None, failure()))
        return
    while True:
        command = commands.get()
        if command is None:
            results.close()
            results.join_thread()
            os._exit(0)  # as the engine ranks: skips a slow C++ teardown, nothing is left to flush
        try:
            results.put((rank, run_trainer_command(rank, mesh, trainer_engine, *command), None))
        except BaseException:
            results.put((rank, None, failure()))


def run_trainer_command(rank, mesh, trainer_engine, kind, options):
    """"push": train.push_weights of the model saved in options["folder"]; "release": SGLangEngine.release_memory;
    "update_outside_session": one bucket sent with no session open, sglang's (ok, message) returned unchecked."""
    import torch
    import train
    from test_parallel import sharded_model
    if kind == "release":
        if trainer_engine is not None:
            trainer_engine.release_memory()
        return None
    if kind == "update_outside_session":  # rank 0 alone: it serializes every engine rank's copy
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        if trainer_engine is None:
            return None
        bucket = FlattenedTensorBucket(named_tensors=[("model.norm.weight", torch.ones(4, dtype=torch.bfloat16))])
        payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        engine = trainer_engine.engine
        per_rank = [MultiprocessingSerializer.serialize(payload, output_str=True)
                    for _ in engine.tokenizer_manager.requests]
        return engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=False)
    assert kind == "push", kind
    began = time.perf_counter()
    model = sharded_model(options["folder"], mesh)
    built = time.perf_counter()
    engine = trainer_engine.engine if trainer_engine else None
    if trainer_engine and not options.get("session", True):
        trainer_engine.engine = SessionlessView(engine)
    mutate_buckets(options.get("rename", {}), options.get("reshape", {}))
    try:
        cfg = train.Config(engine="sglang", bucket_mb=options["bucket_mb"])
        train.push_weights(model, trainer_engine, cfg, mesh["tp"].get_group())
    finally:
        mutate_buckets({}, {})
        if trainer_engine:
            trainer_engine.engine = engine
    return {"build_s": built - began, "push_s": time.perf_counter() - built}


# ----------------------------------------------------------------------------- test process side
class CPUEngineCluster:
    """Engine TP ranks and trainer ranks (as many) in spawned processes, driven from the test process."""

    def __init__(self, tp, timeout=TIMEOUT):
        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: a fork would inherit the test's modules
        self.tp, self.timeout, self.broken = tp, timeout, False
        self.engine_requests = [ctx.Queue() for _ in range(tp)]
        self.engine_to_tokenizer, self.engine_to_harness = ctx.Queue(), ctx.Queue()
        self.trainer_commands = [ctx.Queue() for _ in range(tp)]
        self.trainer_results = ctx.Queue()
        engine_port, trainer_port = free_port(), free_port()
        self.processes = [
            ctx.Process(target=engine_rank_main, name=f"engine-tp{r}", daemon=True,
                        args=(r, tp, engine_port, self.engine_requests[r], self.engine_to_tokenizer,
                              self.engine_to_harness, child_sys_path(with_stubs=True)))
            for r in range(tp)] + [
            ctx.Process(target=trainer_rank_main, name=f"trainer-{r}", daemon=True,
                        args=(r, tp, trainer_port, self.trainer_commands[r], self.trainer_results,
                              self.engine_requests, self.engine_to_tokenizer, child_sys_path(with_stubs=r == 0)))
            for r in range(tp)]
        for process in self.processes:
            process.start()
        try:
            self.engine_import_s = max(s for _, s in self._gather(self.engine_to_harness))
            self.trainer_import_s = max(s for _, s in self._gather(self.trainer_results))
        except BaseException:
            self.close()
            raise

    def _gather(self, replies):
        """Every rank's answer, in rank order; raises with the ranks' tracebacks if any failed. A rank still silent
        soon after a peer failed is stuck in a collective: the cluster is then marked broken (start a new one)."""
        out, errors, deadline = {}, [], time.monotonic() + self.timeout
        while len(out) < self.tp:
            try:
                rank, value, error = replies.get(timeout=1)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
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
        return [out[r] for r in range(self.tp)]

    def _engine_command(self, *command):
        for requests in self.engine_requests:
            requests.put(command)
        return self._gather(self.engine_to_harness)

    def load(self, model_path):
        """Every engine rank builds the model of model_path's config.json, all parameters NaN; seconds per rank."""
        return self._engine_command("load", model_path)

    def weights(self):
        """Per engine rank: {"parameters", "buffers", "requests", "flushes"} and sglang's warnings since load."""
        import torch
        return [(torch.load(io.BytesIO(data)), log) for data, log in self._engine_command("weights")]

    def cpu_tensor_ipc_pickle(self):
        return self._engine_command("ipc_pickle")[0]

    def trainer(self, kind, **options):
        """Run a trainer command on every trainer rank; rank 0's result."""
        for commands in self.trainer_commands:
            commands.put((kind, options))
        return self._gather(self.trainer_results)[0]

    def close(self):
        for requests in self.engine_requests:
            requests.put(("stop",))
        for commands in self.trainer_commands:
            commands.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
