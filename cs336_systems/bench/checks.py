"""Checks that the benchmark configs run on construction: a bad value is a ValueError naming it.

The command lines check the same numbers through their argument types (`bench.cli`) so that a typo is
reported as a usage error before anything is built; these checks hold for library callers too."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping


def check_positive(name: str, *values: float) -> None:
    for value in values:
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def check_non_negative(name: str, *values: float) -> None:
    for value in values:
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_known(name: str, values: Iterable[str], known: Collection[str]) -> None:
    for value in values:
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}; known: {', '.join(known)}")


def check_not_empty(name: str, values: Collection) -> None:
    if not values:
        raise ValueError(f"{name} must name at least one value, got none")


def check_context_length(context_length: int, limits: Mapping[str, int]) -> None:
    """context_length within the longest context of every named model size (size -> its limit): the check of
    the benchmark grids and of the training CLI, before a model that would run out of memory is built."""
    for size, limit in limits.items():
        if context_length > limit:
            raise ValueError(f"context length {context_length} exceeds the {limit} tokens size {size!r} supports")
