"""Peak memory of the logits, measured op by op: the tensors of shape [*, width] alive at once."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveLogits(TorchDispatchMode):
    """The peak bytes of [*, width] tensors alive at once that own their memory: views, broadcasts (stride 0) and
    lm_head's [hidden, width] weight aside. Works on fake tensors too, which have shapes but no storage."""

    def __init__(self, width, hidden):
        super().__init__()
        self.width, self.hidden, self.live, self.peak = width, hidden, weakref.WeakSet(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim() == 2
                and t.shape[1] == self.width
                and t.shape[0] != self.hidden
                and t._base is None
                and 0 not in t.stride()
            ):
                self.live.add(t)
        self.peak = max(self.peak, sum(t.numel() * t.element_size() for t in self.live))
        return out
