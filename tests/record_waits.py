"""`torchrun tests/record_waits.py FLAGS` runs train.py's main() with FLAGS, recording every wait and object
collective that train.py itself calls: the calling function, the group's backend, and whether it is the default
group (NCCL on a GPU, where a waiting rank spins a kernel). Each rank writes its record to
<out_dir>/waits_rank<RANK>.json."""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.getcwd())  # the train.py of the folder torchrun runs in
import train  # noqa: E402

calls = []


def recording(name, collective):
    def record(*args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_filename == train.__file__:
            group = kwargs.get("group")
            calls.append({"op": name, "caller": caller.co_name, "backend": dist.get_backend(group),
                          "default": group is None or group is dist.group.WORLD})
        return collective(*args, **kwargs)
    return record


for op in ("barrier", "broadcast_object_list", "gather_object", "all_gather_object", "all_reduce"):
    setattr(dist, op, recording(op, getattr(dist, op)))
cfg = train.parse_config()
try:
    train.main()
finally:
    with open(os.path.join(cfg.out_dir, f"waits_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(calls, f)
