"""The bookkeeping of partial rollouts (--partial_rollouts), for train.py: the groups of responses still being
generated on a rank's engine, how old each is, which have ended, which are due, and which responses go on.

What is admitted and what is trained is train.py's (partial_rollouts): it admits a batch of prompts, runs rounds of
generation over InFlight.running(), trains the oldest of InFlight.ended() and removes them. A checkpoint holds the
InFlight of each dp rank (checkpoint.save_in_flight), so that a resume goes on as the run would have.
"""

from dataclasses import dataclass


@dataclass(eq=False)
class Group:
    """One prompt's G samples (train.Sample), generated over as many steps as they take."""

    item: dict
    samples: list
    admitted: int  # the step that admitted it: no token of it is older

    @property
    def ended(self):
        return all(s.ended for s in self.samples)


@dataclass
class InFlight:
    """The groups in flight on an engine's rank, in the order they were admitted, and the next batch of prompts to
    admit (an index into train.step_items' batches)."""

    groups: list
    next_batch: int

    def ended(self):
        """The groups whose G responses have all ended, oldest first (the order of admission)."""
        return [g for g in self.groups if g.ended]

    def due(self, step, max_staleness):
        """The groups still generating whose tokens could be more than max_staleness steps old if trained later."""
        return [g for g in self.groups if step - g.admitted >= max_staleness and not g.ended]

    def running(self):
        """The samples still generating."""
        return [s for g in self.groups for s in g.samples if not s.ended]

    def remove(self, groups):
        """`groups` out of flight (they are trained)."""
        self.groups = [g for g in self.groups if g not in groups]

    def state(self):
        """As plain data, for a checkpoint: no class of train.py's is pickled (it runs as __main__, and a fork may
        add fields to its Sample)."""
        groups = [dict(item=g.item, admitted=g.admitted, samples=[vars(s) for s in g.samples]) for g in self.groups]
        return dict(groups=groups, next_batch=self.next_batch)

    @classmethod
    def from_state(cls, state, sample_class):
        """An InFlight from state(), each sample a `sample_class` (train.Sample) again."""
        groups = []
        for g in state["groups"]:
            groups.append(Group(g["item"], [sample_class(**s) for s in g["samples"]], g["admitted"]))
        return cls(groups, state["next_batch"])
