"""train.py's command line: Config's fields as flags, each value checked against the bound its type carries.

A flag is declared once, as a field of train.Config; a bound rides on its type (`Annotated[int, AtLeast(1)]`, or an
alias such as train.Count). parse reads the command line (a --preset's values under the flags given; a mistyped flag
named with the nearest one), and check_bounds refuses a value below its bound, NaN or inf, naming the flag.
docs/flags.md lists every flag with its default, and tests/test_style.py holds it to Config.

Machinery a researcher rarely edits: a new flag is a Config field with its bound, its use and its docs line.
"""

import argparse
import difflib
import math
import typing
from dataclasses import dataclass

from transformers import HfArgumentParser


@dataclass(frozen=True)
class AtLeast:
    """A flag's least value, beside its type: Annotated[int, AtLeast(1)]."""

    least: float

    def admits(self, value):
        return self.least <= value < math.inf  # NaN fails

    def __str__(self):
        return f"from {self.least:g} up"


@dataclass(frozen=True)
class Above:
    """A bound the flag's value must pass, the bound itself refused: Annotated[float, Above(0)]."""

    bound: float

    def admits(self, value):
        return self.bound < value < math.inf  # NaN fails

    def __str__(self):
        return f"above {self.bound:g}"


def parse(config_class, presets, argv=None):
    """config_class from the command line, a --preset's values under the flags given. A flag that cannot be read is
    one line (train.main calls this on rank 0 alone, so it is said once); a mistyped flag names the nearest one."""
    parser = HfArgumentParser(config_class, allow_abbrev=False, exit_on_error=False)
    try:
        flags, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:  # a value of the wrong type, a choice outside its list
        raise SystemExit(f"{error} (python train.py --help lists the flags)") from None
    if unknown:
        nearest = difflib.get_close_matches(unknown[0].split("=")[0], [f"--{name}" for name in vars(flags)], n=1)
        hint = f": did you mean {nearest[0]}?" if nearest else ""
        raise SystemExit(f"unknown flag {unknown[0]}{hint} (python train.py --help lists the flags)")
    parser.set_defaults(**presets.get(flags.preset, {}))
    return config_class(**vars(parser.parse_args(argv)))


def check_bounds(cfg):
    """Every flag within the bound its type carries; the first that is not stops the run, named."""
    for name, hint in typing.get_type_hints(type(cfg), include_extras=True).items():
        for bound in getattr(hint, "__metadata__", ()):
            value = getattr(cfg, name)
            if not bound.admits(value):
                raise SystemExit(f"--{name} must be a number {bound}, not {value}")


def named_numbers(cfg, flag):
    """A flag of name=number pairs separated by commas (--reward_weights correct=1,format=0.2) as {name: number};
    anything else, or a number that is not finite, stops the run naming the flag."""
    text = getattr(cfg, flag)
    numbers = {}
    try:
        for pair in filter(None, text.split(",")):
            name, number = pair.split("=")
            numbers[name.strip()] = float(number)
    except ValueError:
        why = "give name=number pairs separated by commas, as correct=1,format=0.2"
        raise SystemExit(f"--{flag} {text}: {why}") from None
    if not all(map(math.isfinite, numbers.values())):
        raise SystemExit(f"--{flag} {text}: each number must be finite")
    return numbers
