"""Stub (see torchvision/__init__.py): transformers.image_utils imports ImageReadMode and decode_image."""

import enum

from torchvision import placeholder


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    RGB = 3


def __getattr__(name):  # decode_image, read_image, ...
    return placeholder(f"io.{name}")
