"""What a tool call costs: sandbox.run_python alone, and a round's tool calls run by RewardWorkers.run_python.

    python3 benchmarks/tool.py

Prints the latency of one call (against a bare `python3 -c pass`) and the calls per second of a round of 64 calls
with 1, 2, 4, ... workers (--reward_workers).
"""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reward  # noqa: E402
import sandbox  # noqa: E402

CODE = "import math\nprint(sum(math.comb(20, k) for k in range(21)))"  # a small computation, as a model writes


def mean_seconds(call, repeats=20):
    call()  # warm: the interpreter's files in the page cache, the isolation probe done
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main():
    interpreter = sandbox.tool_interpreter()
    assert sandbox.run_python(CODE) == "1048576\n", sandbox.run_python(CODE)
    bare = mean_seconds(lambda: subprocess.run([interpreter, "-c", "pass"], check=True))
    tool = mean_seconds(lambda: sandbox.run_python(CODE))
    namespaces = "yes" if "unshare" in (sandbox._isolation() or []) else "no"
    cgroup = sandbox._new_cgroup("tool_benchmark", 64)  # a call's memory cgroup: its move costs an RCU grace period
    if cgroup:
        sandbox._remove_cgroup(cgroup)
    print(
        f"cores: {os.cpu_count()}; namespaces: {namespaces}; cgroup: {'yes' if cgroup else 'no'}; "
        f"interpreter {interpreter}"
    )
    print(f"{'one call':<28}{'ms':>8}")
    print(f"{'bare python3 -c pass':<28}{bare * 1e3:>8.1f}")
    print(f"{'sandbox.run_python':<28}{tool * 1e3:>8.1f}")
    print(f"\n{'workers':<10}{'64 calls, s':>12}{'calls/s':>10}")
    workers = 1
    while workers <= max(os.cpu_count(), 2):
        pool = sandbox.RewardWorkers(reward.reward_fn, workers, timeout=5.0)
        try:
            pool.run_python([CODE])  # started
            start = time.perf_counter()
            outputs = pool.run_python([CODE] * 64)
            seconds = time.perf_counter() - start
        finally:
            pool.close()
        assert all(output == "1048576\n" for output in outputs), outputs[:2]
        print(f"{workers:<10}{seconds:>12.2f}{64 / seconds:>10.1f}")
        workers *= 2


if __name__ == "__main__":
    main()
