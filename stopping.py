"""How a run stops when asked, for train.py: by a signal to any rank (SIGTERM: preemption, or torchrun stopping;
SIGINT: Ctrl-C; SIGUSR1: a batch system's warning of its time limit) or by a file named STOP appearing in --out_dir
(what slurm/train.sbatch writes at the time limit). The run then has --stop_grace seconds until its checkpoint is on
disk; it stops there, and status.json in --out_dir says "stopped" (docs/checkpoints.md).

Within the grace, the step in progress ends and saves when it can, as a stop always did. When it cannot, its rollouts
are given up where the engines and the reward workers wait (check raises Interrupted there), and the run saves the
state it had after the last step that ended: the weights change only in the update, after the rollouts, so the
resumed run redoes the step from its start, exactly. Whether a step can end in time is judged from the steps before
it in this process: the longest time from a step's rollouts to its end (evaluation and saving included); before a
step has ended, or a save has been timed, the rollouts are given up at once, or half the grace before its end.

Machinery a researcher rarely edits. It imports no torch, so that sandbox.py's workers can check it too.
"""

import math
import os
import signal
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_FILE = "STOP"  # in --out_dir: its presence asks the run to stop; the run removes it once it has stopped


class Interrupted(Exception):
    """A step's rollouts given up: the grace left is what saving the last step's state takes."""


class Stop:
    """A run's stop: whether and when one was asked for, and how long the end of a step and a save have taken."""

    def __init__(self):
        self.listen(math.inf, "", speaks=False, install=False)

    def listen(self, grace, out_dir, speaks, install=True):
        """From now on, SIGNALS and the STOP file in `out_dir` ask for a stop; rank 0 (`speaks`) says so."""
        self.grace = grace
        self.file = os.path.join(out_dir, STOP_FILE)
        self.speaks = speaks
        self.why = ""  # what asked: a signal's name, or the file
        self.asked_at = None  # time.monotonic() of the ask
        self.looked_at = -math.inf  # the file is looked for at most once a second
        self.rollouts_ended = None
        self.tails = []  # seconds from each step's rollouts to its end
        self.saved = False  # whether one of those steps saved a checkpoint
        self.in_rollouts = False
        if install:
            for sig in SIGNALS:
                signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt
        self.ask(signal.Signals(signum).name)

    def ask(self, why):
        if self.asked_at is not None:
            return
        self.why = why
        self.asked_at = time.monotonic()
        if self.speaks:
            print(f"{why}: finishing this step, then saving a checkpoint, within {self.grace:g} s", flush=True)

    def asked(self):
        """Whether a stop was asked for: a signal came, or the STOP file is there."""
        now = time.monotonic()
        if self.asked_at is None and now - self.looked_at >= 1.0:
            self.looked_at = now
            if os.path.exists(self.file):
                self.ask(f"{self.file} found")
        return self.asked_at is not None

    def due(self):
        """Whether the rollouts in progress must be given up: a stop was asked for, and what is left of the grace
        is no more than the longest end of a step (evaluation and save included) has taken."""
        if not self.in_rollouts or not self.asked():
            return False
        reserve = max(self.tails, default=math.inf)
        if not self.saved:  # no save timed yet
            reserve += self.grace / 2
        return time.monotonic() >= self.asked_at + self.grace - reserve

    def interruptible(self, rollouts, *args):
        """rollouts(*args), or None where a stop gave them up."""
        self.in_rollouts = True
        try:
            return rollouts(*args)
        except Interrupted:
            return None
        finally:
            self.in_rollouts = False
            self.rollouts_ended = time.monotonic()

    def step_ended(self, saved):
        """A step ended (after its save, if `saved`): how long it took since its rollouts."""
        self.tails.append(time.monotonic() - self.rollouts_ended)
        self.saved = self.saved or saved

    def answered(self):
        """The run stopped: a STOP file that asked for it has been answered, and goes."""
        if self.why.endswith("found") and os.path.exists(self.file):
            os.remove(self.file)


STOP = Stop()  # the process's: train.main listens, the engines and reward workers check


def check():
    """Where rollouts wait (the engines' generation, the reward workers): Interrupted once a stop leaves no time to
    finish the step."""
    if STOP.due():
        raise Interrupted
