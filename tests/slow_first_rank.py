"""`torchrun tests/slow_first_rank.py FLAGS` runs train.py's main with FLAGS, rank 0 starting 3 s after the other
ranks, as it may on a loaded machine. A rank that refused the flags and exited at once would have torchrun stop
rank 0 before it could say why."""

import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the train.py of the folder torchrun runs in
if os.environ.get("RANK") == "0":
    time.sleep(3)
import launch  # noqa: E402
import train  # noqa: E402

launch.run(train.main)
