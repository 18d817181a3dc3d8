"""Stub of torchvision for the CPU contract test (tests/test_sglang_contract.py) only.

sglang 0.5.23 imports torchvision at module level from its multimodal configs and processors, which the text-only
weight-update path pulls in through sglang.srt.configs; transformers then finds this package, takes torchvision as
installed and imports a few names from it too. The torchvision CPU wheel does not load against CPU torch 2.13
("operator torchvision::nms does not exist"), so these modules stand in. Every name they give is a placeholder that
raises when called: no image or video code runs in the weight-update path.
"""

__version__ = "0.28.0"  # the release paired with torch 2.13; transformers compares it with packaging.version


def placeholder(name):
    """A callable standing in for a torchvision function or class; calling it says why it cannot work here."""

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision.{name} is a stub in sglang_cpu_stubs (no torchvision on CPU torch)")

    unavailable.__name__ = name.rsplit(".", 1)[-1]
    return unavailable
