"""Stub (see torchvision/__init__.py): InterpolationMode is used at module level (in default arguments)."""

import enum

from torchvision import placeholder


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):  # Compose, Resize, ToTensor, ...: only called inside image processors
    return placeholder(f"transforms.{name}")
