"""argparse value types shared by the command-line tools (kvserve/cli.py and the tools' own
parsers), kept apart so that a tool's parser need not import the top-level CLI."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v
