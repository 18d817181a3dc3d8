"""Stub (see torchvision/__init__.py)."""

from torchvision import placeholder
from torchvision.transforms import InterpolationMode  # noqa: F401


def __getattr__(name):  # pil_to_tensor, resize, ...
    return placeholder(f"transforms.functional.{name}")
