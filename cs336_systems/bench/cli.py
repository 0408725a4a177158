"""Argument types and options shared by the benchmark command lines."""

from __future__ import annotations

import argparse

import torch

from cs336_systems.timing import resolve_device


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda where there is one)")


def device_from_args(parser: argparse.ArgumentParser, device: str) -> torch.device:
    """resolve_device, reported as a usage error of the CLI."""
    try:
        return resolve_device(device)
    except RuntimeError as error:
        parser.error(str(error))


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def config_or_usage_error(parser: argparse.ArgumentParser, make, **fields):
    """`make(**fields)` (a config dataclass), its ValueError or RuntimeError (bad value, no GPU) reported
    as a usage error of the CLI."""
    try:
        return make(**fields)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
