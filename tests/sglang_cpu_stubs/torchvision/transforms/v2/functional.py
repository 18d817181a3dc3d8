"""Stub (see torchvision/__init__.py)."""

from torchvision import placeholder


def __getattr__(name):
    return placeholder(f"transforms.v2.functional.{name}")
