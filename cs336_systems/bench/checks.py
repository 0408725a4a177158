"""Checks that the benchmark configs run on construction: a bad value is a ValueError naming it.

The command lines check the same numbers through their argument types (`bench.cli`) so that a typo is
reported as a usage error before anything is built; these checks hold for library callers too."""

from __future__ import annotations

from collections.abc import Collection, Iterable


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
