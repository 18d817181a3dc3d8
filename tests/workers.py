"""Run a function on N gloo ranks forked from the test process: torch is already imported, so a 2-rank run
takes about a second instead of the ~7 s a fresh torchrun costs."""

import multiprocessing
import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # Pickled here: a tensor the queue shared would need this rank alive when the test reads it.
        results.put((rank, pickle.dumps(fn(rank, world, *args)), None))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def run_ranks(fn, world, *args, timeout=120):
    """fn(rank, world, *args) on `world` forked ranks; returns the results in rank order."""
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, value, error = results.get(timeout=timeout)
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
