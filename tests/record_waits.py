"""`torchrun tests/record_waits.py FLAGS` runs train.py's main() with FLAGS, recording every wait and object
collective that the trainer's own code calls (train.py and the modules beside it that wait: checkpoint.py,
engines.py, launch.py): the calling function, the trainer's functions it was called from, the group's backend, and
whether it is the default group (NCCL on a GPU, where a waiting rank spins a kernel). Each rank writes its record to
<out_dir>/waits_rank<RANK>.json."""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.getcwd())  # the train.py of the folder torchrun runs in
import checkpoint  # noqa: E402
import engines  # noqa: E402
import flags  # noqa: E402
import launch  # noqa: E402
import train  # noqa: E402

TRAINER_FILES = {module.__file__ for module in (train, checkpoint, engines, launch)}

calls = []


def recording(name, collective):
    def record(*args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename in TRAINER_FILES:
            group = kwargs.get("group")
            callers = []  # the trainer's functions above the caller, innermost first
            outer = frame.f_back
            while outer is not None:
                if outer.f_code.co_filename in TRAINER_FILES:
                    callers.append(outer.f_code.co_name)
                outer = outer.f_back
            calls.append(
                {
                    "op": name,
                    "caller": frame.f_code.co_name,
                    "callers": callers,
                    "backend": dist.get_backend(group),
                    "default": group is None or group is dist.group.WORLD,
                }
            )
        return collective(*args, **kwargs)

    return record


for op in ("barrier", "broadcast_object_list", "gather_object", "all_gather_object", "all_reduce"):
    setattr(dist, op, recording(op, getattr(dist, op)))
cfg = flags.parse(
    train.Config,
    train.PRESETS,
)
try:
    train.main()
finally:
    with open(os.path.join(cfg.out_dir, f"waits_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(calls, f)
