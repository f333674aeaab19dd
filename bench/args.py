"""Command-line values the benches share: counts that must be whole numbers in a range."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded_int(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (``high`` None: no bound), else a usage error
    that names the range and ``why``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}{why}")
        return value

    return parse
