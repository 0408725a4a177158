"""Names a package loads on first use (PEP 562), so that importing it does not import what they are built on."""

from __future__ import annotations

import importlib
import sys


def attach(package: str, on_first_use: dict[str, str], names: list[str]):
    """The `__getattr__` and `__dir__` of `package`: each name of on_first_use (name -> the module that defines it,
    relative to the package where it starts with ".") is imported from its module when first asked for; any other
    unknown name is an AttributeError; dir() lists the package's own names and `names` (its __all__)."""

    def __getattr__(name: str):
        if name not in on_first_use:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(on_first_use[name], package), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
